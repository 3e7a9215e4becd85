"""The ``echo`` backend: a tiny, fast, deterministic ``backend.Backend`` server for tests and
benchmarks.  Run as ``python -m localai_tw.backends.builtin.echo --addr 127.0.0.1:<port>``.

- ``Health`` answers ``OK`` as soon as the server is up (before any model is loaded).
- ``LoadModel`` succeeds and records ``ModelOptions.Model``, unless ``Options`` holds
  ``echo.fail_load:<message>``: then ``success=false`` with that message (as Python backends
  report a failed load).  Other options: ``echo.delay_ms:<n>`` (sleep per generated word),
  ``echo.dim:<n>`` (embedding width, default 8), ``echo.load_delay_ms:<n>`` (a slow load,
  at most 60 s: the dashboard's test watches a cold load in progress).  Test hooks for crash
  reporting: ``echo.crash_on:<word>`` makes the process die by SIGSEGV when it reaches that
  word of a prompt (a stream sends the words before it first), ``echo.exit_on:<word>`` makes it
  exit with code 3 there, ``echo.crash_load`` makes ``LoadModel`` die by SIGSEGV; each writes
  one line to stderr first.
- ``Predict`` answers the prompt (or the last message when ``UseTokenizerTemplate``) word by
  word, at most ``Tokens`` words when ``Tokens`` > 0; ``tokens`` / ``prompt_tokens`` count
  words.  ``PredictStream`` yields one word per reply (with its trailing space) and the running
  ``tokens`` total.
- ``Embedding``: a unit vector derived from SHA-256 of the input text (or token ids), layout
  FINAL.  ``TokenizeString``: one stable id per word (a hash, so not invertible by itself).
  ``Detokenize``: the words of ids this process's ``TokenizeString`` answered (at most
  ``VOCABULARY_MAX`` remembered, the oldest forgotten), joined by spaces; an id it never
  answered is ``INVALID_ARGUMENT``.  ``Rerank``: each document's score is the share of the
  query's distinct words it contains (deterministic, for tests).
- ``Status``: BUSY while a request runs, READY when loaded, else UNINITIALIZED.  ``Free``
  forgets the model.
- Before ``LoadModel``, inference RPCs fail ``FAILED_PRECONDITION`` ``model not loaded``.

Imports only grpc, protobuf and the standard library; never blocks on anything but its own
optional delay.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
import os
import signal
import struct
import threading
import time

import grpc

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.builtin import serving

DEFAULT_DIM = 8
#: Words ``Detokenize`` remembers (id -> word, from ``TokenizeString``), to bound memory.
VOCABULARY_MAX = 65536


def parse_options(options) -> dict[str, str]:
    """``key:value`` strings (LocalAI's ``Options``) as a dict; the value may hold ``:``."""
    parsed = {}
    for item in options:
        key, sep, value = item.partition(":")
        parsed[key.strip()] = value.strip() if sep else "true"
    return parsed


def words_of(text: str) -> list[str]:
    return text.split()


def prompt_of(request) -> str:
    if request.UseTokenizerTemplate and request.Messages:
        return request.Messages[-1].content
    return request.Prompt


def token_id(word: str) -> int:
    return int.from_bytes(hashlib.sha256(word.encode("utf-8")).digest()[:4], "big") % 50000


def embedding_of(text: str, dim: int) -> list[float]:
    """A unit vector from SHA-256 blocks of ``text``: same text, same vector."""
    values: list[float] = []
    counter = 0
    while len(values) < dim:
        block = hashlib.sha256(f"{counter}:{text}".encode("utf-8")).digest()
        for (raw,) in struct.iter_unpack(">I", block):
            values.append(raw / 0xFFFFFFFF * 2.0 - 1.0)
        counter += 1
    values = values[:dim]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


class EchoServicer(backend_pb2_grpc.BackendServicer):
    def __init__(self, identity: serving.ModelIdentity | None = None):
        self.identity = identity or serving.ModelIdentity()
        self._lock = threading.Lock()
        self._busy = 0
        self.loaded = False
        self.options: dict[str, str] = {}
        self._vocabulary: OrderedDict[int, str] = OrderedDict()  # id -> word (Detokenize)

    # -- lifecycle ----------------------------------------------------------------------

    def Health(self, request, context):
        return backend_pb2.Reply(message=b"OK")

    def LoadModel(self, request, context):
        options = parse_options(request.Options)
        if "echo.crash_load" in options:
            os.write(2, b"echo: crashing on purpose while loading (echo.crash_load)\n")
            signal.raise_signal(signal.SIGSEGV)
            time.sleep(5)
        failure = options.get("echo.fail_load")
        if failure is not None:
            return backend_pb2.Result(success=False, message=failure or "load refused")
        try:
            load_delay = min(max(int(options.get("echo.load_delay_ms", "0")), 0), 60000) / 1000
        except ValueError:
            return backend_pb2.Result(success=False, message="echo.load_delay_ms must be an "
                                      "integer number of milliseconds")
        time.sleep(load_delay)
        self.options = options
        self.loaded = True
        self.identity.loaded = request.Model
        return backend_pb2.Result(success=True, message=f"echo loaded {request.Model!r}")

    def Free(self, request, context):
        self.loaded = False
        self.identity.loaded = ""
        return backend_pb2.Result(success=True, message="freed")

    def Status(self, request, context):
        return serving.status_response(busy=bool(self._busy), loaded=self.loaded)

    # -- inference ----------------------------------------------------------------------

    def _require_loaded(self, context):
        if not self.loaded:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")

    def _delay(self, request) -> float:
        raw = request.Metadata.get("echo.delay_ms") or self.options.get("echo.delay_ms", "0")
        try:
            return max(0.0, float(raw) / 1000.0)
        except ValueError:
            return 0.0

    def _answer_words(self, request) -> tuple[list[str], int]:
        prompt = words_of(prompt_of(request))
        answer = prompt[: request.Tokens] if request.Tokens > 0 else prompt
        return answer, len(prompt)

    def _crash_at(self, word: str) -> None:
        """The crash test hooks (module docstring)."""
        if word == self.options.get("echo.crash_on"):
            os.write(2, f"echo: crashing on purpose at {word!r} (echo.crash_on)\n".encode())
            signal.raise_signal(signal.SIGSEGV)  # this thread, before anything else
            time.sleep(5)
        if word == self.options.get("echo.exit_on"):
            os.write(2, f"echo: exiting on purpose at {word!r} (echo.exit_on)\n".encode())
            os._exit(3)

    def _busy_enter(self):
        with self._lock:
            self._busy += 1

    def _busy_exit(self):
        with self._lock:
            self._busy -= 1

    def Predict(self, request, context):
        self._require_loaded(context)
        self._busy_enter()
        try:
            answer, prompt_tokens = self._answer_words(request)
            for word in answer:
                self._crash_at(word)
            delay = self._delay(request)
            if delay:
                time.sleep(delay * len(answer))
            return backend_pb2.Reply(message=" ".join(answer).encode("utf-8"),
                                     tokens=len(answer), prompt_tokens=prompt_tokens)
        finally:
            self._busy_exit()

    def PredictStream(self, request, context):
        self._require_loaded(context)
        self._busy_enter()
        try:
            answer, prompt_tokens = self._answer_words(request)
            delay = self._delay(request)
            for index, word in enumerate(answer):
                if not context.is_active():
                    return
                if delay:
                    time.sleep(delay)
                self._crash_at(word)
                piece = word if index == len(answer) - 1 else word + " "
                yield backend_pb2.Reply(message=piece.encode("utf-8"), tokens=index + 1,
                                        prompt_tokens=prompt_tokens)
        finally:
            self._busy_exit()

    def Embedding(self, request, context):
        self._require_loaded(context)
        if request.Embeddings:
            text = request.Embeddings
        elif request.EmbeddingTokens:
            text = " ".join(str(t) for t in request.EmbeddingTokens)
        else:
            text = request.Prompt
        try:
            dim = max(1, int(self.options.get("echo.dim", DEFAULT_DIM)))
        except ValueError:
            dim = DEFAULT_DIM
        return backend_pb2.EmbeddingResult(
            embeddings=embedding_of(text, dim), tokens=1, dim=dim,
            prompt_tokens=len(words_of(text)),
            layout=backend_pb2.EMBEDDING_LAYOUT_FINAL)

    def TokenizeString(self, request, context):
        self._require_loaded(context)
        words = words_of(request.Prompt)
        tokens = [token_id(w) for w in words]
        with self._lock:
            for token, word in zip(tokens, words):
                self._vocabulary[token] = word
                self._vocabulary.move_to_end(token)
            while len(self._vocabulary) > VOCABULARY_MAX:
                self._vocabulary.popitem(last=False)
        return backend_pb2.TokenizationResponse(length=len(tokens), tokens=tokens)

    def Detokenize(self, request, context):
        self._require_loaded(context)
        with self._lock:
            words = [self._vocabulary.get(token) for token in request.tokens]
        for token, word in zip(request.tokens, words):
            if word is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"token id {token} was never answered by this backend's "
                              "TokenizeString")
        return backend_pb2.DetokenizeResponse(content=" ".join(words))

    def Rerank(self, request, context):
        self._require_loaded(context)
        query = set(words_of(request.query))
        scores = [len(query & set(words_of(d))) / max(1, len(query)) for d in request.documents]
        tokens = len(words_of(request.query)) + sum(len(words_of(d)) for d in request.documents)
        return serving.rerank_result(list(request.documents), scores, request.top_n, tokens)


def main(argv=None) -> None:
    args = serving.argument_parser("localai-tw echo backend").parse_args(argv)
    identity = serving.ModelIdentity()
    # Four threads unless told otherwise: a Health probe is answered while a slow Predict runs
    # (LocalAI's default of one thread queues it, see the contract sheet §4.4).
    os.environ.setdefault(serving.MAX_WORKERS_ENV, "4")
    serving.serve(EchoServicer(identity), identity, args.addr)


if __name__ == "__main__":
    main()
