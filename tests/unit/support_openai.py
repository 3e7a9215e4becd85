"""Test doubles for the OpenAI API tests: a fake ``IInferenceRouter`` and raw-HTTP helpers.

``FakeRouter`` implements the interface exactly as documented in ``frontend/inference/interfaces.py``
(``Served`` results, ``on_start`` before the first reply, ``on_reply`` Deferreds awaited for
backpressure, cancellation of the returned Deferred).  It records every call's options so tests
can assert what the API layer sent.  No test lives here; the module holds shared helpers only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from zope.interface import implementer

from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.interfaces import IInferenceRouter, Served
from localai_tw.localai.model_config import parse_model_config
from localai_tw.frontend.api.openai import (
    OPENAI_MAX_BODY_BYTES,
    OpenAIResource,
    api_prefixes,
    early_error,
    unprefixed_aliases,
    unprefixed_roots,
)
from localai_tw.web.listener import BoundedSite


def model_config(name: str, **more):
    data = {"name": name, "backend": "echo"}
    data.update(more)
    return parse_model_config(data, f"{name}.yaml")


class ManualStream:
    """A ``predict_stream`` call the test drives by hand."""

    def __init__(self, name, options, on_reply, on_start, node, on_loading=None):
        self.name = name
        self.options = options
        self.on_reply = on_reply
        self.on_start = on_start
        self.on_loading = on_loading
        self.node = node
        self.cancelled = False
        self.result = defer.Deferred(self._cancel)

    def _cancel(self, _):
        self.cancelled = True

    def loading(self):
        """The router found no loaded replica and starts a cold load."""
        if self.on_loading is not None:
            self.on_loading(self.name)

    def start(self):
        if self.on_start is not None:
            self.on_start(self.node)

    def push(self, message: bytes, tokens: int = 0, prompt_tokens: int = 0):
        """Deliver one reply; returns what ``on_reply`` returned (a Deferred means wait)."""
        return self.on_reply(backend_pb2.Reply(message=message, tokens=tokens,
                                               prompt_tokens=prompt_tokens))

    def end(self):
        self.result.callback(Served(None, self.node))

    def fail(self, error: BaseException):
        self.result.errback(Failure(error))


@implementer(IInferenceRouter)
class FakeRouter:
    """An ``IInferenceRouter`` answering from scripts.

    - ``answer``: text of every ``Predict`` (default: the prompt, or the last message).
    - ``stream_pieces``: the byte pieces of every automatic ``PredictStream``.
    - ``manual_streams``: when True, ``predict_stream`` returns a :class:`ManualStream`'s
      Deferred and appends it to ``streams`` for the test to drive.
    - ``hold``: when True, ``predict``/``embed`` return unfired Deferreds kept in ``pending``.
    - ``fail_with``: an exception every call fails with.
    """

    models_dir = "/nonexistent"

    def __init__(self, configs=(), node="node-a"):
        self.configs = {c.name: c for c in configs}
        self.node = node
        self.calls: list[tuple[str, str, backend_pb2.PredictOptions]] = []
        self.answer: str | None = None
        self.tokens: int | None = None
        self.stream_pieces: list[bytes] = [b"Hello", b" world"]
        self.manual_streams = False
        self.streams: list[ManualStream] = []
        self.hold = False
        self.pending: list[defer.Deferred] = []
        self.cancelled: list[str] = []
        self.fail_with: BaseException | None = None
        self.embedding_dim = 4
        self.embedding_layout = backend_pb2.EMBEDDING_LAYOUT_FINAL
        self.auto_stream_waits: list[bool] = []
        self.reply_logprobs = b""  # Reply.logprobs of every predict reply
        self.reply_deltas: list = []  # Reply.chat_deltas of every predict reply
        self.stream_deltas: list = []  # Reply.chat_deltas of each stream piece (lists)
        self.stream_logprobs: list[bytes] = []  # Reply.logprobs of each stream piece
        self.stopping_word = ""  # Reply.stopping_word of a predict reply, a stream's last

    def models(self):
        return [self.configs[n] for n in sorted(self.configs)]

    def model(self, name):
        return self.configs.get(name)

    def _record(self, verb, name, options):
        self.calls.append((verb, name, options))

    def _held(self, verb, value):
        d = defer.Deferred(lambda _: self.cancelled.append(verb))
        self.pending.append((d, value))
        return d

    def release(self):
        pending, self.pending = self.pending, []
        for d, value in pending:
            if not d.called:
                d.callback(value)

    def predict(self, name, options, deadline=None):
        self._record("predict", name, options)
        if self.fail_with is not None:
            return defer.fail(self.fail_with)
        text = self.answer
        if text is None:
            text = options.Messages[-1].content if options.UseTokenizerTemplate \
                else options.Prompt
        words = len(text.split())
        reply = backend_pb2.Reply(message=text.encode("utf-8"),
                                  tokens=self.tokens if self.tokens is not None else words,
                                  prompt_tokens=len(options.Prompt.split()) or 1,
                                  logprobs=self.reply_logprobs,
                                  chat_deltas=self.reply_deltas,
                                  stopping_word=self.stopping_word)
        served = Served(reply, self.node)
        if self.hold:
            return self._held("predict", served)
        return defer.succeed(served)

    def predict_stream(self, name, options, on_reply, deadline=None, on_start=None,
                       on_loading=None):
        self._record("predict_stream", name, options)
        if self.fail_with is not None:
            return defer.fail(self.fail_with)
        if self.manual_streams:
            stream = ManualStream(name, options, on_reply, on_start, self.node, on_loading)
            self.streams.append(stream)
            return stream.result
        return defer.ensureDeferred(self._auto_stream(on_reply, on_start))

    async def _auto_stream(self, on_reply, on_start):
        if on_start is not None:
            on_start(self.node)
        for index, piece in enumerate(self.stream_pieces):
            logprobs = self.stream_logprobs[index] if index < len(self.stream_logprobs) \
                else b""
            deltas = self.stream_deltas[index] if index < len(self.stream_deltas) else []
            last = index == len(self.stream_pieces) - 1
            waiting = on_reply(backend_pb2.Reply(message=piece, tokens=index + 1,
                                                 prompt_tokens=3, logprobs=logprobs,
                                                 chat_deltas=deltas,
                                                 stopping_word=self.stopping_word if last
                                                 else ""))
            self.auto_stream_waits.append(isinstance(waiting, defer.Deferred))
            if isinstance(waiting, defer.Deferred):
                await waiting
        return Served(None, self.node)

    def embed(self, name, options, deadline=None):
        self._record("embed", name, options)
        if self.fail_with is not None:
            return defer.fail(self.fail_with)
        seed = options.Embeddings or ",".join(str(t) for t in options.EmbeddingTokens)
        vector = [((len(seed) + i) % 7) / 8.0 for i in range(self.embedding_dim)]
        result = backend_pb2.EmbeddingResult(embeddings=vector, tokens=1,
                                             dim=self.embedding_dim,
                                             prompt_tokens=len(seed.split()),
                                             layout=self.embedding_layout)
        served = Served(result, self.node)
        if self.hold:
            return self._held("embed", served)
        return defer.succeed(served)

    def rerank(self, name, request, deadline=None):
        """Longer documents rank higher; ``rerank_answer`` replaces the results when set."""
        self._record("rerank", name, request)
        if self.fail_with is not None:
            return defer.fail(self.fail_with)
        order = sorted(range(len(request.documents)),
                       key=lambda i: (-len(request.documents[i]), i))[:request.top_n]
        results = getattr(self, "rerank_answer", None) or [
            backend_pb2.DocumentResult(index=i, text=request.documents[i],
                                       relevance_score=len(request.documents[i]) / 4)
            for i in order]
        return defer.succeed(Served(backend_pb2.RerankResult(
            usage=backend_pb2.Usage(total_tokens=9, prompt_tokens=9), results=results),
            self.node))

    def tokenize(self, name, options, deadline=None):
        """As many tokens as ``Prompt`` has words; ``fail_with`` fails it."""
        self._record("tokenize", name, options)
        if self.fail_with is not None:
            return defer.fail(self.fail_with)
        words = options.Prompt.split()
        return defer.succeed(Served(backend_pb2.TokenizationResponse(
            length=len(words), tokens=list(range(len(words)))), self.node))

    def detokenize(self, name, request, deadline=None):
        """Token ``i`` reads ``t<i>``; ``fail_with`` fails it."""
        self._record("detokenize", name, request)
        if self.fail_with is not None:
            return defer.fail(self.fail_with)
        return defer.succeed(Served(backend_pb2.DetokenizeResponse(
            content=" ".join(f"t{t}" for t in request.tokens)), self.node))


# -- raw HTTP over a StringTransport ------------------------------------------------------------


def make_site(router, api_keys=None, limit=OPENAI_MAX_BODY_BYTES, reactor=None) -> BoundedSite:
    """``/v1`` and its unprefixed aliases, mounted and capped as ``FrontendService`` does."""
    root = Resource()
    openai = OpenAIResource(router, api_keys=api_keys, now=lambda: 1700000000, reactor=reactor)
    root.putChild(b"v1", openai)
    for name in unprefixed_roots():
        root.putChild(name, openai.unprefixed())
    site = BoundedSite(root, body_limits={b"/v1/": limit}, timeout=None)
    for alias, twin in unprefixed_aliases():
        site.add_body_limit(alias, site.body_limit_for(twin))
    for prefix in api_prefixes():
        site.add_early_answer_shape(prefix, early_error)
    return site


@dataclass
class Response:
    status: int
    headers: dict
    raw_body: bytes
    complete: bool
    body_chunks: list = field(default_factory=list)

    def json(self):
        return json.loads(self.raw_body)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def events(self) -> list:
        """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]`` (comment
        lines, ``: ...``, are left out: see :meth:`comments`)."""
        out = []
        for block in self.raw_body.decode("utf-8").split("\n\n"):
            if not block.strip() or block.startswith(":"):
                continue
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        return out


    def comments(self) -> list[str]:
        """The SSE comment lines (``: text``) of the body, in order."""
        return [block[1:].strip() for block in self.raw_body.decode("utf-8").split("\n\n")
                if block.startswith(":")]


def parse_response(data: bytes) -> Response:
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, f"no complete response head in {data[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        headers[name] = f"{headers[name]}, {value.strip()}" if name in headers \
            else value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body, chunks, complete = b"", [], False
        while rest:
            size_line, sep, rest = rest.partition(b"\r\n")
            if not sep:
                break
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                complete = True
                break
            chunk, rest = rest[:size], rest[size + 2:]
            chunks.append(chunk)
            body += chunk
        return Response(status, headers, body, complete, chunks)
    length = int(headers.get("content-length", len(rest)))
    return Response(status, headers, rest[:length], len(rest) >= length)


class Client:
    """One HTTP/1.1 connection to ``site`` over a ``StringTransport``."""

    def __init__(self, site):
        self.channel = site.buildProtocol(None)
        self.transport = StringTransport()
        self.channel.makeConnection(self.transport)

    def send(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
        if raw is None:
            raw = b"" if body is None else (body if isinstance(body, bytes)
                                            else json.dumps(body).encode("utf-8"))
        head = [f"{method} {path} HTTP/1.1", "Host: test"]
        all_headers = {"Content-Type": "application/json"} if raw else {}
        all_headers.update(headers or {})
        head += [f"{k}: {v}" for k, v in all_headers.items()]
        head.append(f"Content-Length: {len(raw)}")
        self.channel.dataReceived("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + raw)
        return self

    def response(self) -> Response:
        return parse_response(self.transport.value())

    def disconnect(self):
        self.channel.connectionLost(Failure(ConnectionDone("client left")))


def call(site, method, path, body=None, headers=None, raw=None) -> Response:
    return Client(site).send(method, path, body, headers, raw).response()


async def call_settled(site, method, path, body=None, headers=None, raw=None,
                       timeout: float = 10.0) -> Response:
    """:func:`call` for a request whose answer waits on a thread (a request's big schemas are
    planned, and a big answer validated, in the answer-checks thread): the real reactor runs
    (a ``pytest_twisted`` test) until the response is whole."""
    from twisted.internet import reactor, task

    client = Client(site).send(method, path, body, headers, raw)
    for _ in range(int(timeout / 0.01)):
        data = client.transport.value()
        if b"\r\n\r\n" in data and parse_response(data).complete:
            break
        await task.deferLater(reactor, 0.01, lambda: None)
    return client.response()


def assert_error(response, status, type_=None, param=None, code=None):
    """The answer is OpenAI's error shape with ``status`` (and the given fields); returns it."""
    assert response.status == status, response.raw_body
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if type_ is not None:
        assert error["type"] == type_
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error
