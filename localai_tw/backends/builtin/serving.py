"""What every backend program shipped here does around its servicer, as LocalAI's Python
backends do: the ``--addr`` argument, a gRPC server with 50 MiB message caps, the bearer-token
check (``LOCALAI_GRPC_AUTH_TOKEN``), the model-identity guard, a clean exit on SIGTERM/SIGINT,
and the parent-death backstop (``LOCALAI_BACKEND_PARENT_WATCH``).

Runs inside the backend process, never inside the worker.  Imports only grpc, protobuf and the
standard library.

What this module must never do:

- bind with ``SO_REUSEPORT`` (grpc's default): two backends sharing a port would split a
  worker's connections between two models; the worker's port probe relies on a live backend
  making its port unbindable;
- outlive the worker: when the parent process goes away the program exits within the watch
  interval (unless the operator turned the watch off);
- answer an RPC for another model: a request whose ``ModelIdentity`` differs from the loaded
  model's gets ``NOT_FOUND`` with ``model identity mismatch`` before the servicer runs.
"""

from __future__ import annotations

import argparse
import hmac
import os
import re
import signal
import sys
import threading
from concurrent import futures

import grpc

from localai_tw.backends import backend_pb2, backend_pb2_grpc

MAX_MESSAGE_BYTES = 50 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
AUTH_TOKEN_ENV = "LOCALAI_GRPC_AUTH_TOKEN"
PARENT_WATCH_ENV = "LOCALAI_BACKEND_PARENT_WATCH"
#: "1" when the worker's operator allows a model's own code (``--allow-remote-code``); the
#: supervisor always sets it, last, so neither its environment nor a start request decides it.
REMOTE_CODE_ENV = "LOCALAI_ALLOW_REMOTE_CODE"
PARENT_WATCH_INTERVAL_ENV = "LOCALAI_BACKEND_PARENT_WATCH_INTERVAL"
#: "0" when the worker decided llama.cpp's extra buffer types must be off for this start (the
#: AMX fallback, ``backends/amx_fallback.py``); wins over the model's options.
EXTRA_BUFTS_ENV = "LOCALAI_LLAMA_EXTRA_BUFTS"
#: The lines a backend writes to stderr around its first evaluation after a load, so the worker
#: can tell a crash there from a later one; the first ends with the extra buffer types' state.
FIRST_EVAL_STARTED = "[llama-cpp] first evaluation after the load: started, extra buffer types"
FIRST_EVAL_FINISHED = "[llama-cpp] first evaluation after the load: finished"
MAX_WORKERS_ENV = "PYTHON_GRPC_MAX_WORKERS"

#: Methods whose request carries ``ModelIdentity`` and is checked.
IDENTITY_CHECKED = frozenset(
    f"/backend.Backend/{name}" for name in ("Predict", "PredictStream", "Embedding",
                                            "TokenizeString", "Rerank", "TTS",
                                            "AudioTranscription", "GenerateImage"))
LOAD_METHOD = "/backend.Backend/LoadModel"


def rerank_result(documents, scores, top_n: int, prompt_tokens: int):
    """The ``RerankResult`` of ``scores`` (one per document): best first, ties by index, the
    first ``top_n`` (0 or less: all), as LocalAI's rerankers answer."""
    order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))
    if top_n > 0:
        order = order[:top_n]
    return backend_pb2.RerankResult(
        usage=backend_pb2.Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        results=[backend_pb2.DocumentResult(index=i, text=documents[i],
                                            relevance_score=float(scores[i])) for i in order])


def token_ids_in_range(ids, vocabulary_size: int, context) -> list[int]:
    """``ids`` as a list, each checked against ``vocabulary_size`` (``Detokenize``): an id the
    tokenizer does not have is ``INVALID_ARGUMENT`` naming it, never a library exception that
    would surface as ``UNKNOWN`` (or text decoded from nothing)."""
    ids = list(ids)
    for token in ids:
        if not 0 <= token < vocabulary_size:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"token id {token} is not in the model's vocabulary (ids are 0 to "
                          f"{vocabulary_size - 1})")
    return ids


def parse_interval(raw: str, default: float = 2.0) -> float:
    """``500ms``, ``2s``, ``1m`` or plain seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*", raw or "")
    if not m:
        return default
    value = float(m.group(1))
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]


def start_parent_watch() -> None:
    """Exit (``_exit(1)``) when the parent process changes or becomes init, whatever stdio
    is connected to."""
    if os.environ.get(PARENT_WATCH_ENV, "").strip().lower() in ("false", "0", "no", "off"):
        return
    interval = parse_interval(os.environ.get(PARENT_WATCH_INTERVAL_ENV, "2s"))
    parent = os.getppid()

    def watch():
        while True:
            threading.Event().wait(interval)
            now = os.getppid()
            if now != parent or now == 1:
                # Best effort: stderr is often a pipe to the dead parent (EPIPE), or one nobody
                # reads; a failed or stuck write must not keep this process alive.
                try:
                    os.set_blocking(2, False)
                    os.write(2, f"parent process {parent} is gone; exiting\n".encode())
                except BaseException:
                    pass
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ModelIdentity:
    """The model a successful LoadModel recorded (shared by the guard and the servicer)."""

    def __init__(self):
        self.loaded = ""


def _abort_handler(code, text):
    def abort(request, context):
        context.abort(code, text)
    return abort


class GuardInterceptor(grpc.ServerInterceptor):
    """Bearer token (when configured) on every RPC; model identity on inference RPCs."""

    def __init__(self, token: str | None, identity: ModelIdentity):
        self._token = token.encode() if token else None
        self._identity = identity

    def intercept_service(self, continuation, details):
        if self._token is not None:
            presented = b""
            for key, value in details.invocation_metadata or ():
                if key == "authorization":
                    raw = value.encode() if isinstance(value, str) else value
                    if raw[:7].lower() == b"bearer ":
                        presented = raw[7:].strip()
            if not hmac.compare_digest(presented, self._token):
                return grpc.unary_unary_rpc_method_handler(
                    _abort_handler(grpc.StatusCode.UNAUTHENTICATED, "invalid token"))
        handler = continuation(details)
        if handler is None or details.method not in IDENTITY_CHECKED:
            return handler
        return _identity_checked(handler, self._identity)


def _identity_checked(handler, identity: ModelIdentity):
    def check(request, context):
        wanted = getattr(request, "ModelIdentity", "")
        if wanted and identity.loaded and wanted != identity.loaded:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"model identity mismatch: loaded '{identity.loaded}', "
                          f"requested '{wanted}'")

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        def unary(request, context):
            check(request, context)
            return inner(request, context)
        return handler._replace(unary_unary=unary)
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        def stream(request, context):
            check(request, context)
            yield from inner_stream(request, context)
        return handler._replace(unary_stream=stream)
    return handler


def argument_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--addr", default="localhost:50051",
                        help="host:port to serve backend.Backend on")
    return parser


def serve(servicer, identity: ModelIdentity, address: str, *, max_workers: int | None = None):
    """Serve ``servicer`` on ``address`` until SIGTERM/SIGINT; then stop and exit 0."""
    if max_workers is None:
        try:
            max_workers = max(1, int(os.environ.get(MAX_WORKERS_ENV, "1")))
        except ValueError:
            max_workers = 1
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=SERVER_OPTIONS,
        interceptors=[GuardInterceptor(os.environ.get(AUTH_TOKEN_ENV) or None, identity)],
    )
    backend_pb2_grpc.add_BackendServicer_to_server(servicer, server)
    if server.add_insecure_port(address) == 0:
        print(f"cannot bind {address}", file=sys.stderr, flush=True)
        sys.exit(2)
    server.start()
    print(f"Server started. Listening on: {address}", file=sys.stderr, flush=True)
    stopping = threading.Event()

    def stop(signum, frame):
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    start_parent_watch()
    while not stopping.wait(0.5):
        pass
    server.stop(0).wait(5)
    print("Server stopped.", file=sys.stderr, flush=True)
    sys.exit(0)


def status_response(*, busy: bool, loaded: bool) -> "backend_pb2.StatusResponse":
    """``Status``'s answer for a built-in backend: BUSY while a call runs, else READY once a
    model is loaded, else UNINITIALIZED; memory is the process's peak RSS (what the worker's
    eviction and the frontend's ``if_idle`` unload read)."""
    import resource

    state = (backend_pb2.StatusResponse.BUSY if busy else
             backend_pb2.StatusResponse.READY if loaded else
             backend_pb2.StatusResponse.UNINITIALIZED)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return backend_pb2.StatusResponse(
        state=state, memory=backend_pb2.MemoryUsageData(total=rss, breakdown={"rss": rss}))
