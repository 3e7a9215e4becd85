"""The worker's side of a ``call`` tunnel stream: one backend call made with the gRPC client the
worker already holds for that backend.

``worker/streams.py`` validates the target's port (inside ``--backend-port-range``, as for
``grpc``), asks :meth:`BackendCalls.client_for` for the live backend on it and, when there is
none, refuses the stream ``unavailable`` -- what the ``grpc`` path's loopback connect answers
when nothing listens there (ECONNREFUSED), so the frontend learns the same condition either way.
Otherwise it answers ``ok`` and hands the stream to a :class:`CallStreamProtocol`, which reads
a request frame (``backends/callframes.py``), makes the call with the backend's own token
attached here (the frontend never needs it for this path), and writes back message frames and
one status frame: the backend's status code and details as-is (the worker's answer).

Keep-alive: after the status frame the stream stays open and the next request frame on it is
the next call (one call at a time per stream; the frontend pools idle streams and closes them
after its idle timeout).  This side never closes an idle stream on its own: it ends with the
frontend's FIN, the tunnel, or the worker.  Each call asks for the backend on the port afresh
(a backend restarted on the same port is called with its own token); when none is there any
more the stream answers one ``REFUSED`` frame and closes -- nothing ran, as a fresh stream's
``unavailable`` refusal says.  The request timeout applies to the first request and to a
request begun but not finished, never to the idle wait between calls.

Never blocking the reactor: a unary call runs in grpcio's future mode; a server stream's items
are read one at a time on :class:`BackendCalls`'s thread pool, and the next item is read only
when the tunnel stream has room (this protocol is the stream's push producer: the stream pauses
it while its write buffer holds unsent bytes, i.e. the frontend's window is spent).  A frontend
that resets or closes the stream cancels the gRPC call.

What this module must never do: parse the request's protobuf (the bytes go to the backend as
they came); call a backend other than the one on the stream's port; hold more than one request
frame, take a second request while a call runs, or read a stream item ahead of the tunnel's
window; let a failure of one stream touch
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
from localai_tw.backends.grpcfuture import STREAM_END, deferred_from_future, next_stream_item

log = Logger()

#: Seconds the frontend has to deliver the whole first request frame once the stream is
#: accepted, and the rest of any request frame once its first bytes came.
REQUEST_TIMEOUT_SECONDS = 120.0
#: Threads reading server-stream items (each open stream holds one while it waits for its
#: backend's next item, i.e. for most of a generation; not while the tunnel has no room).  The
#: streams of every replica share them: a stream beyond this many waits for a thread.
STREAM_THREADS = 128

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
        return threads.deferToThreadPool(self.reactor, self._pool, next_stream_item, iterator)

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
    """One accepted ``call`` stream: read a request, make the call, write the answer; again,
    until the frontend closes the stream."""

    def __init__(self, calls: BackendCalls, client, port: int):
        self._calls = calls
        self._client = client  # the backend's client when the stream was accepted
        self._port = port
        self._decoder = callframes.FrameDecoder({callframes.REQUEST})
        self._timer = None
        self._paused = False
        self._resumed: defer.Deferred | None = None
        #: the stream ended (the frontend, a reset, an error): no more calls on it
        self.finished = False
        #: calls answered with a status on this stream
        self.served = 0
        self._reset_call()

    def _reset_call(self) -> None:
        self._request: callframes.CallRequest | None = None
        self._pending: defer.Deferred | None = None  # a unary future or an item read
        self._grpc_call = None  # a server stream's call object
        self._registered = False
        self._paused = False  # a producer registered for the next call starts unpaused
        self.cancelled = False

    def __repr__(self) -> str:
        method = self._request.method.name if self._request else "-"
        return f"<CallStream {getattr(self.transport, 'id', '?')} {method} port {self._port}>"

    # -- reading a request ----------------------------------------------------------------------

    def connectionMade(self) -> None:
        self._armTimer()

    def _armTimer(self) -> None:
        if self._timer is None:
            self._timer = self._calls.reactor.callLater(self._calls.request_timeout,
                                                        self._requestTimedOut)

    def dataReceived(self, data: bytes) -> None:
        if self.finished:
            return
        if self._request is not None:
            # One call at a time: the frontend sends the next request after the status only.
            self._abort("bytes after the call request")
            return
        try:
            self._decoder.feed(data)
            frame = self._decoder.next_frame()
            if frame is None:
                self._armTimer()  # a request begun must end in time; the idle wait has none
                return
            if self._decoder.buffered_bytes:
                raise callframes.CallProtocolError("bytes after the call request")
            request = callframes.parse_request(frame[1])
        except callframes.CallProtocolError as e:
            self._abort(str(e))
            return
        self._cancelTimer()
        self._request = request
        client = self._calls.client_for(self._port) if self.served else self._client
        if client is None:
            # The backend went away while the stream was idle: nothing ran; say so and close
            # (the frontend treats it as the refusal a fresh stream would get).
            self.finished = True
            self.transport.write(callframes.encode_refused(
                f"connecting to 127.0.0.1:{self._port} failed: no backend process listens on "
                "that port"))
            self.transport.loseConnection()
            return
        self._client = client
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
            pending = self._pending = deferred_from_future(self._calls.reactor, future)
            pending.addCallbacks(self._unaryAnswered, self._failed,
                                 callbackArgs=(pending,), errbackArgs=(pending,))
            return
        grpc_call = self._grpc_call = callable_(request.body, timeout=timeout,
                                                metadata=self._client.metadata)
        self._registered = True
        self.transport.registerProducer(self, True)
        defer.ensureDeferred(self._pump(grpc_call)).addErrback(self._failed, grpc_call)

    def _current(self, token) -> bool:
        """Whether ``token`` (a unary call's Deferred or a stream's call object) is the call in
        progress on this stream (not one that ended before)."""
        return not self.finished and token is not None and (
            token is self._pending or token is self._grpc_call)

    def _unaryAnswered(self, body: bytes, pending) -> None:
        if not self._current(pending):
            return
        self._pending = None
        self._answered(callframes.encode_message(body) + callframes.encode_status(0))

    async def _pump(self, call) -> None:
        while self._current(call):
            if self._paused:
                self._resumed = defer.Deferred()
                await self._resumed
                continue
            self._pending = self._calls.read_item(call)
            item = await self._pending
            if not self._current(call):
                return
            self._pending = None
            if item is STREAM_END:
                self._answered(callframes.encode_status(0))
                return
            self.transport.write(callframes.encode_message(item))

    def _failed(self, failure: Failure, token=None) -> None:
        if not self._current(token):
            return
        self._pending = None
        status = _status_of(failure.value)
        if status is None:
            if not failure.check(defer.CancelledError):
                log.failure("{stream} failed", failure, stream=self)
            self._abort(f"the call failed: {failure.getErrorMessage()}")
            return
        self._answered(callframes.encode_status(*status))

    def _answered(self, frames: bytes) -> None:
        """The call's last frames: write them and wait, idle, for the next request."""
        self._unregister()
        self.transport.write(frames)
        self.served += 1
        self._reset_call()

    def _abort(self, why: str) -> None:
        """Reset this stream (a protocol error or an internal failure) and cancel the call."""
        if self.finished:
            return
        log.info("resetting {stream}: {why}", stream=self, why=why)
        self._stopCall()
        self._unregister()
        self.transport.abortConnection()

    def _unregister(self) -> None:
        if self._registered:
            self._registered = False
            self.transport.unregisterProducer()

    def _stopCall(self) -> None:
        """The stream ends: cancel the gRPC call in progress, whatever it is doing."""
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
            # The frontend closed or reset the stream: whatever the backend is doing for it
            # (if anything) stops now.
            self._stopCall()
