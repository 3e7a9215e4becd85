"""The worker's side of a ``call`` tunnel stream: one backend call made with the gRPC client the
worker already holds for that backend.

``worker/streams.py`` validates the target's port (inside ``--backend-port-range``, as for
``grpc``), asks :meth:`BackendCalls.client_for` for the live backend on it and, when there is
none, refuses the stream ``unavailable`` -- what the ``grpc`` path's loopback connect answers
when nothing listens there (ECONNREFUSED), so the frontend learns the same condition either way.
Otherwise it answers ``ok`` and hands the stream to a :class:`CallStreamProtocol`, which reads
the one request frame (``backends/callframes.py``), makes the call with the backend's own token
attached here (the frontend never needs it for this path), and writes back message frames and
one status frame: the backend's status code and details as-is (the worker's answer).

Never blocking the reactor: a unary call runs in grpcio's future mode; a server stream's items
are read one at a time on :class:`BackendCalls`'s thread pool, and the next item is read only
when the tunnel stream has room (this protocol is the stream's push producer: the stream pauses
it while its write buffer holds unsent bytes, i.e. the frontend's window is spent).  A frontend
that resets or closes the stream cancels the gRPC call.

What this module must never do: parse the request's protobuf (the bytes go to the backend as
they came); call a backend other than the one on the stream's port; hold more than one request
frame, or read a stream item ahead of the tunnel's window; let a failure of one stream touch
another (an internal error resets that stream only).
"""

from __future__ import annotations

import grpc
from twisted.internet import defer, threads
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from localai_tw.backends import callframes
from localai_tw.backends.grpcfuture import deferred_from_future

log = Logger()

#: Seconds the frontend has to deliver the whole request frame once the stream is accepted.
REQUEST_TIMEOUT_SECONDS = 120.0
#: Threads reading server-stream items (each open stream holds one while it waits for its
#: backend's next item, i.e. for most of a generation; not while the tunnel has no room).  The
#: streams of every replica share them: a stream beyond this many waits for a thread.
STREAM_THREADS = 128

_END = object()


def _next_item(iterator):
    try:
        return next(iterator)
    except StopIteration:
        return _END


class BackendCalls:
    """What a ``call`` stream needs of the worker: the client of the backend on a port (from
    the supervisor) and the threads that read stream items."""

    def __init__(self, supervisor, reactor, threads_size: int = STREAM_THREADS,
                 request_timeout: float = REQUEST_TIMEOUT_SECONDS):
        self._supervisor = supervisor
        self.reactor = reactor
        self.request_timeout = request_timeout
        self._size = threads_size
        self._pool: ThreadPool | None = None

    def client_for(self, port: int):
        return self._supervisor.client_for_port(port)

    def read_item(self, iterator) -> defer.Deferred:
        if self._pool is None:
            self._pool = ThreadPool(1, self._size, name="localai-backend-calls")
            self._pool.start()
            self.reactor.addSystemEventTrigger("during", "shutdown", self.stop)
        return threads.deferToThreadPool(self.reactor, self._pool, _next_item, iterator)

    def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()


def _status_of(exc: BaseException) -> tuple[int, str] | None:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        return code.value[0], exc.details() or ""
    return None


class CallStreamProtocol(Protocol):
    """One accepted ``call`` stream: read the request, make the call, write the answer."""

    def __init__(self, calls: BackendCalls, client, port: int):
        self._calls = calls
        self._client = client
        self._port = port
        self._decoder = callframes.FrameDecoder({callframes.REQUEST})
        self._timer = None
        self._request: callframes.CallRequest | None = None
        self._pending: defer.Deferred | None = None  # a unary future or an item read
        self._grpc_call = None  # a server stream's call object
        self._paused = False
        self._resumed: defer.Deferred | None = None
        self.finished = False
        self.cancelled = False

    def __repr__(self) -> str:
        method = self._request.method.name if self._request else "?"
        return f"<CallStream {getattr(self.transport, 'id', '?')} {method} port {self._port}>"

    # -- reading the request ------------------------------------------------------------------

    def connectionMade(self) -> None:
        self._timer = self._calls.reactor.callLater(self._calls.request_timeout,
                                                    self._requestTimedOut)

    def dataReceived(self, data: bytes) -> None:
        if self.finished:
            return
        if self._request is not None:
            self._abort("bytes after the call request")
            return
        try:
            self._decoder.feed(data)
            frame = self._decoder.next_frame()
            if frame is None:
                return
            if self._decoder.buffered_bytes:
                raise callframes.CallProtocolError("bytes after the call request")
            request = callframes.parse_request(frame[1])
        except callframes.CallProtocolError as e:
            self._abort(str(e))
            return
        self._cancelTimer()
        self._request = request
        try:
            self._start(request)
        except Exception:
            log.failure("starting {stream} failed", stream=self)
            self._abort("starting the call failed")

    def _requestTimedOut(self) -> None:
        self._timer = None
        if self._request is None and not self.finished:
            self._abort(f"no whole call request within {self._calls.request_timeout:g}s")

    def _cancelTimer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    # -- the call -----------------------------------------------------------------------------

    def _start(self, request: callframes.CallRequest) -> None:
        method = request.method
        timeout = request.timeout_ms / 1000.0 if request.timeout_ms else None
        callable_ = self._client.raw(method.path, method.server_streaming)
        if not method.server_streaming:
            future = callable_.future(request.body, timeout=timeout,
                                      metadata=self._client.metadata)
            self._pending = deferred_from_future(self._calls.reactor, future)
            self._pending.addCallbacks(self._unaryAnswered, self._failed)
            return
        self._grpc_call = callable_(request.body, timeout=timeout,
                                    metadata=self._client.metadata)
        self.transport.registerProducer(self, True)
        defer.ensureDeferred(self._pump()).addErrback(self._failed)

    def _unaryAnswered(self, body: bytes) -> None:
        self._pending = None
        if self.finished:
            return
        self.transport.write(callframes.encode_message(body) + callframes.encode_status(0))
        self._finish()

    async def _pump(self) -> None:
        call = self._grpc_call
        while not self.finished:
            if self._paused:
                self._resumed = defer.Deferred()
                await self._resumed
                continue
            self._pending = self._calls.read_item(call)
            item = await self._pending
            self._pending = None
            if self.finished:
                return
            if item is _END:
                self.transport.write(callframes.encode_status(0))
                self._finish()
                return
            self.transport.write(callframes.encode_message(item))

    def _failed(self, failure: Failure) -> None:
        self._pending = None
        if self.finished:
            return
        status = _status_of(failure.value)
        if status is None:
            if not failure.check(defer.CancelledError):
                log.failure("{stream} failed", failure, stream=self)
            self._abort(f"the call failed: {failure.getErrorMessage()}")
            return
        self.transport.write(callframes.encode_status(*status))
        self._finish()

    def _finish(self) -> None:
        self.finished = True
        self._unregister()
        self.transport.loseConnection()

    def _abort(self, why: str) -> None:
        """Reset this stream (a protocol error or an internal failure) and cancel the call."""
        if self.finished:
            return
        log.info("resetting {stream}: {why}", stream=self, why=why)
        self._stopCall()
        self._unregister()
        self.transport.abortConnection()

    def _unregister(self) -> None:
        if self._grpc_call is not None:
            self.transport.unregisterProducer()

    def _stopCall(self) -> None:
        """Finished without an answer: cancel the gRPC call, whatever it is doing."""
        self.finished = True
        self._cancelTimer()
        if not self.cancelled and self._request is not None:
            self.cancelled = True
            if self._grpc_call is not None:
                self._grpc_call.cancel()  # ends a blocked next() at once
            pending, self._pending = self._pending, None
            if pending is not None and self._grpc_call is None:
                pending.cancel()  # cancels the unary future
        resumed, self._resumed = self._resumed, None
        if resumed is not None:
            resumed.callback(None)

    # -- IPushProducer: the tunnel stream's room ------------------------------------------------

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        resumed, self._resumed = self._resumed, None
        if resumed is not None:
            resumed.callback(None)

    def stopProducing(self) -> None:
        if not self.finished:
            self._stopCall()

    def connectionLost(self, reason=None) -> None:
        self._cancelTimer()
        if not self.finished:
            # The frontend reset or closed the stream: whatever the backend is doing for it
            # stops now.
            self._stopCall()
