"""Backend calls as one framed request on a ``call`` tunnel stream: no gRPC, no HTTP/2 here.

:class:`TunnelBackendClient` has the interface of ``BridgedBackendClient``
(``backend_client.py``): ``call``, ``stream`` (``on_item`` per item; a Deferred it returns is
awaited before the next item is read), ``in_flight``, ``used``, ``closed``, ``close``,
``node_id``, ``port``.  Each call takes an idle ``call`` stream of this (node, port) or opens
one through the ``WorkerDialer`` (locally, or through the owner replica's relay, exactly as
``grpc`` streams go), writes one request frame (``backends/callframes.py``: method, timeout, the
serialized request) and reads message frames, then one status frame.  The worker makes the gRPC call with the client it holds for that backend
and attaches the backend's own token itself (``worker/backendcalls.py``).  Why: the frontend's
grpcio channel cost 350-770 us of CPU per unary call (issue 25 §2).

The four conditions stay what they were on the bridged path:

=================================================  =============================================
what happened                                      raised
=================================================  =============================================
the dial failed (a routing fact, absence within    the dialer's condition as raised (a refusal of
the grace, an unreachable peer; the worker         the stream: ``unavailable`` when no backend is
refused the stream)                                on the port, as the ``grpc`` path's connect)
the caller's deadline passed, or the backend       ``CallerDeadlineExceeded``
answered ``DEADLINE_EXCEEDED``
the caller cancelled                               ``defer.CancelledError`` (the stream is reset:
                                                   the worker cancels the gRPC call)
the stream ended before the status frame           ``TransportFailure``
a frame that breaks the protocol                   ``CallProtocolError`` (a ``TunnelProtocolError``)
any other status than OK                           ``BackendAnswer(node, code name, details)``
=================================================  =============================================

Backpressure: while the Deferred of ``on_item`` is pending the stream is paused (its window is
not granted again), so the worker stops reading items and gRPC's own flow control holds the
backend.  Frames already received stay in the decoder, bounded by the stream's window.

Keep-alive (issue 25 §2: a stream open/close per call cost throughput at c=16 and doubled a
relayed call's cost on the owner): after a status frame, OK or not, the stream goes back to a
pool of at most ``MAX_IDLE_STREAMS`` idle streams (LIFO; ``MAX_IDLE_STREAMS_PER_NODE`` over
all of a node's ports, since they share the worker tunnel's stream limit), and an idle one is
closed after ``IDLE_TIMEOUT`` -- by this side only: the worker never closes an idle stream on
its own.  Only the first call on a stream carries the stream's request frame.  A call that was cancelled, ran
past its deadline, was cut or saw a protocol error resets its stream: never reused.  ``close``
(what ``BackendClients.drop``/``forget``/``close`` call) closes the idle streams; a tunnel that
goes ends them (``connectionLost`` takes them out of the pool).  A ``refused`` frame (the
backend went away while the stream was idle; nothing ran) is the ``unavailable``
``StreamRefused`` a new stream would have had.  Streams are opened ``lasting``: relayed, the
relay frame states no budget, since the stream outlives its first call; each call's deadline is
this module's timer (and the worker's gRPC timeout).

An older worker refuses the tag (``unknown-tag``): that node is remembered (``old_nodes``) and
this call and later ones go through the bridged gRPC client (``fallback``).  That refusal was
never an answer about a backend, so nothing is reaped for it.
"""

from __future__ import annotations

from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError
from twisted.internet import defer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure

from localai_tw import errors
from localai_tw.backends import callframes
from localai_tw.tunnel import preamble

#: Idle ``call`` streams kept per (node, port) (more are closed as their calls end).
MAX_IDLE_STREAMS = 32
#: Idle ``call`` streams kept per node over all its ports: every stream, idle or not, counts
#: toward the worker tunnel's stream limit (``SessionConfig.max_streams``, 1000), which every
#: replica's streams share.
MAX_IDLE_STREAMS_PER_NODE = 64
#: Seconds an idle ``call`` stream is kept; the worker never closes one on its own, so this
#: side always closes first.
IDLE_TIMEOUT = 30.0
#: Per-call timeout when the caller gives no deadline (as the bridged client).
DEFAULT_CALL_TIMEOUT = 300.0
#: The longest details text kept in a ``BackendAnswer`` (as the bridged client).
MAX_DETAILS_CHARS = 2048

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _awaitable(outcome) -> defer.Deferred | None:
    if isinstance(outcome, defer.Deferred):
        return outcome
    if hasattr(outcome, "__await__"):
        return defer.ensureDeferred(outcome)
    return None


class _CallStream(Protocol):
    """One ``call`` stream, carrying one call at a time: writes nothing itself (a call writes
    its request), decodes each answer, and goes back to its client's pool after a status."""

    def __init__(self, client: "TunnelBackendClient"):
        self._client = client
        self._decoder = callframes.FrameDecoder(
            {callframes.MESSAGE, callframes.STATUS, callframes.REFUSED})
        self.call: "_Call | None" = None
        self._waiting = False  # a Deferred of on_item is pending: the stream is paused
        self._paused = False
        self._message = None
        #: reset, closed, or misbehaved: never carries another call
        self.broken = False
        #: when the stream went back to the pool (the client's idle sweep reads it)
        self.idle_since = 0.0
        #: calls this stream carried
        self.calls = 0

    def attach(self, call: "_Call") -> None:
        self.call = call
        self._message = None
        self._waiting = False
        self.calls += 1

    def usable(self) -> bool:
        transport = self.transport
        return (not self.broken and transport is not None
                and not getattr(transport, "disconnecting", False))

    def abort(self) -> None:
        """A reset: the worker cancels the call in progress; the stream is never reused."""
        self.broken = True
        self._client._unpool(self)
        if self.transport is not None:
            self.transport.abortConnection()

    def close(self) -> None:
        """FIN: the worker's side closes too (an idle stream, or one the pool cannot keep)."""
        self.broken = True
        self._client._unpool(self)
        if self.transport is not None:
            self.transport.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        if self.broken:
            return
        call = self.call
        if call is None or call.settled:
            self.abort()  # the worker spoke while no call waited: not this protocol
            return
        try:
            self._decoder.feed(data)
        except callframes.CallProtocolError as e:
            call.fail(Failure(e), abort=True)
            return
        self._drain()

    def _drain(self) -> None:
        call = self.call
        while call is not None and self.call is call and not self._waiting and not call.settled:
            frame = self._decoder.next_frame()
            if frame is None:
                return
            kind, payload = frame
            try:
                if kind == callframes.MESSAGE:
                    self._onMessage(call, payload)
                elif kind == callframes.STATUS:
                    self._onStatus(call, callframes.parse_status(payload))
                else:
                    self._onRefused(call, callframes.parse_refused(payload))
            except callframes.CallProtocolError as e:
                call.fail(Failure(e), abort=True)

    def _onMessage(self, call: "_Call", payload: bytes) -> None:
        try:
            message = call.method.response_type.FromString(payload)
        except DecodeError as e:
            raise callframes.CallProtocolError(
                f"{call.what}: a {call.method.response_type.__name__} that does not decode "
                f"({e})") from None
        if call.on_item is None:
            if self._message is not None:
                raise callframes.CallProtocolError(f"{call.what}: a second message in a unary "
                                                   "answer")
            self._message = message
            return
        try:
            waiting = _awaitable(call.on_item(message))
        except Exception:
            call.fail(Failure(), abort=True)
            return
        if waiting is not None and not waiting.called:
            self._waiting = True
            self._paused = True
            self.transport.pauseProducing()
            waiting.addCallbacks(self._consumed, lambda f: call.fail(f, abort=True),
                                 callbackArgs=(call,))
        elif waiting is not None:
            waiting.addErrback(lambda f: call.fail(f, abort=True))

    def _consumed(self, _, call: "_Call") -> None:
        if self.call is not call or call.settled:
            return
        self._waiting = False
        self._drain()
        if not self._waiting and not call.settled:
            self._resume()

    def _resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resumeProducing()

    def _onStatus(self, call: "_Call", status: callframes.CallStatus) -> None:
        if status.ok and call.on_item is None and self._message is None:
            raise callframes.CallProtocolError(f"{call.what}: status OK without a message")
        message = self._message
        # The call is over on this stream: back to the pool before the caller hears of it, so
        # a call the caller makes at once reuses it.  Bytes after a status are not this
        # protocol: such a stream is dropped (the call itself was answered).
        self.call, self._message, self._waiting = None, None, False
        if self._decoder.buffered_bytes:
            self.abort()
        else:
            self._resume()
            self._client._release(self)
        if status.ok:
            call.succeed(message)
            return
        name = _CODE_NAMES.get(status.code, str(status.code))
        if name == "DEADLINE_EXCEEDED":
            call.fail(Failure(errors.CallerDeadlineExceeded(call.what)))
        else:
            call.fail(Failure(errors.BackendAnswer(call.node_id, name,
                                                   status.details[:MAX_DETAILS_CHARS])))

    def _onRefused(self, call: "_Call", details: str) -> None:
        # The backend went away while this stream was idle; nothing ran.  The refusal a fresh
        # stream would have had, so the router reaps and retries as for that one.
        self.call = None
        self.close()
        call.fail(Failure(errors.StreamRefused(call.node_id, preamble.UNAVAILABLE, details)))

    def connectionLost(self, reason=None) -> None:
        self.broken = True
        self._client._unpool(self)
        call, self.call = self.call, None
        if call is None or call.settled:
            return
        cut = self._decoder.eof()
        why = cut or (reason.getErrorMessage() if reason is not None else "closed")
        call.fail(Failure(errors.TransportFailure(
            f"{call.what}: the stream ended before the call's status ({why})")))


class _Call:
    """The state of one call: its result Deferred, its stream, its deadline timer."""

    def __init__(self, client: "TunnelBackendClient", method: callframes.Method, request,
                 on_item, deadline: float):
        self.client = client
        self.node_id = client.node_id
        self.method = method
        self.on_item = on_item
        self.deadline = deadline
        self.what = f"{method.name} on worker {client.node_id} port {client.port}"
        reactor = client._reactor
        remaining = deadline - reactor.seconds()
        self.request_frame = callframes.encode_request(
            method.name, max(1, int(remaining * 1000)), request.SerializeToString())
        self.stream: _CallStream | None = None
        self.settled = False
        self.result: defer.Deferred = defer.Deferred(self._cancelled)
        self._opening: defer.Deferred | None = None
        self._timer = reactor.callLater(max(remaining, 0), self._expired)

    def start(self) -> defer.Deferred:
        client = self.client
        idle = client._take_idle()
        if idle is not None:
            # Keep-alive: only the request frame; the stream's preamble went with its first.
            self.stream = idle
            idle.attach(self)
            client.streams_reused += 1
            idle.transport.write(self.request_frame)
            return self.result
        started = client._reactor.seconds()
        stream = self.stream = _CallStream(client)
        stream.attach(self)
        # The request rides behind the stream's request frame: no round trip waits for ``ok``
        # (a refused stream drops it unread).  ``lasting``: the stream outlives this call, so
        # a relay states no budget for it (this call's deadline is enforced here and by the
        # worker's gRPC timeout).
        opening = self._opening = client._dialer.open(
            client.node_id, preamble.TAG_CALL, client.target, stream, self.deadline,
            early=self.request_frame, lasting=True)

        def opened(_):
            self._opening = None
            client.dials_ok += 1
            client.last_dial_seconds = max(0.0, client._reactor.seconds() - started)

        def failed(failure):
            self._opening = None
            stream.broken = True
            if not self.settled:
                self.fail(failure)

        opening.addCallbacks(opened, failed)
        return self.result

    def succeed(self, value) -> None:
        if self.settled:
            return
        self.settled = True
        self._stopTimer()
        self.result.callback(value)

    def fail(self, failure: Failure, abort: bool = False) -> None:
        if self.settled:
            return
        self.settled = True
        self._stopTimer()
        if abort:
            self._abortStream()
        self.result.errback(failure)

    def _abortStream(self) -> None:
        opening, self._opening = self._opening, None
        if opening is not None:
            opening.cancel()
        stream = self.stream
        if stream is not None and stream.call is self:
            stream.call = None
            stream.abort()  # a reset: the worker cancels the gRPC call; never reused

    def _expired(self) -> None:
        self._timer = None
        self.fail(Failure(errors.CallerDeadlineExceeded(self.what)), abort=True)

    def _cancelled(self, _) -> None:
        # The caller cancelled: the Deferred fails with CancelledError by itself.
        if not self.settled:
            self.settled = True
            self._stopTimer()
            self._abortStream()

    def _stopTimer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()


def _consumer_failure(failure: Failure, what: str) -> Failure:
    """The bridged client's rule for a failure that is not a status: a condition or a cancel
    passes, anything else (a consumer that raised) is a transport failure of the call."""
    if failure.check(errors.ClusterError, defer.CancelledError):
        return failure
    return Failure(errors.TransportFailure(f"{what}: {failure.getErrorMessage()}"))


class TunnelBackendClient:
    """Calls to one backend (node, port) on ``call`` streams; see the module docstring.

    :param dialer: the replica's ``WorkerDialer``.
    :param fallback: returns the bridged gRPC client of (node, port), for an older worker.
    :param old_nodes: the shared set of nodes known to refuse ``call`` streams.
    :param idle_by_node: the shared count of idle streams per node (``BackendClients``), held
        under ``max_idle_per_node``.
    """

    def __init__(self, dialer, node_id: str, port: int, reactor,
                 default_timeout: float = DEFAULT_CALL_TIMEOUT, *,
                 fallback: Callable[[], Any] | None = None, old_nodes: set[str] | None = None,
                 max_idle: int = MAX_IDLE_STREAMS, idle_timeout: float = IDLE_TIMEOUT,
                 idle_by_node: dict[str, int] | None = None,
                 max_idle_per_node: int = MAX_IDLE_STREAMS_PER_NODE):
        self._dialer = dialer
        self.node_id = node_id
        self.port = int(port)
        self.target = f"127.0.0.1:{self.port}"
        preamble.encode_request(preamble.TAG_CALL, self.target)  # validates
        self._reactor = reactor
        self._default_timeout = default_timeout
        self._fallback = fallback
        self._old_nodes = old_nodes if old_nodes is not None else set()
        #: calls (unary and streams) of this client not finished yet
        self.in_flight = 0
        #: set by every call, cleared by the placement sweep (``channels.py``)
        self.used = True
        self.closed = False
        #: tunnel streams opened, and how long the last one took (a request's ``tunnel`` hop)
        self.dials_ok = 0
        self.last_dial_seconds: float | None = None
        #: calls that took an idle stream instead of opening one
        self.streams_reused = 0
        self._calls: set[_Call] = set()
        self._max_idle = max_idle
        self._idle_timeout = idle_timeout
        self._idle: list[_CallStream] = []  # LIFO: the most recently used on top
        self._idle_by_node = idle_by_node if idle_by_node is not None else {}
        self._max_idle_per_node = max_idle_per_node
        #: one timer for the whole pool, not one per pooled stream: a warm call neither
        #: schedules nor cancels a timer (issue 25 §2, second pass)
        self._sweep = None

    @property
    def idle_streams(self) -> int:
        return len(self._idle)

    def _take_idle(self) -> _CallStream | None:
        while self._idle:
            stream = self._idle[-1]
            self._unpool(stream)
            if stream.usable():
                return stream
        return None

    def _release(self, stream: _CallStream) -> None:
        """A stream whose call ended with a clean status: pooled, or closed when the pool is
        full or the client closed."""
        if not stream.usable():
            return
        if (self.closed or len(self._idle) >= self._max_idle
                or self._idle_by_node.get(self.node_id, 0) >= self._max_idle_per_node):
            stream.close()
            return
        stream.idle_since = self._reactor.seconds()
        self._idle.append(stream)
        self._idle_by_node[self.node_id] = self._idle_by_node.get(self.node_id, 0) + 1
        if self._sweep is None:
            self._sweep = self._reactor.callLater(self._idle_timeout, self._sweepIdle)

    def _sweepIdle(self) -> None:
        """Close the streams idle for the idle timeout; run again when the oldest left is
        due.  The pool is LIFO, so the oldest idle streams are at the bottom."""
        self._sweep = None
        now = self._reactor.seconds()
        for stream in [s for s in self._idle if now - s.idle_since >= self._idle_timeout]:
            stream.close()  # out of the pool as it closes
        if self._idle and not self.closed:
            oldest = min(s.idle_since for s in self._idle)
            self._sweep = self._reactor.callLater(
                max(oldest + self._idle_timeout - now, 0), self._sweepIdle)

    def _stopSweep(self) -> None:
        sweep, self._sweep = self._sweep, None
        if sweep is not None and sweep.active():
            sweep.cancel()

    def _unpool(self, stream: _CallStream) -> None:
        if stream in self._idle:
            self._idle.remove(stream)
            left = self._idle_by_node.get(self.node_id, 0) - 1
            if left > 0:
                self._idle_by_node[self.node_id] = left
            else:
                self._idle_by_node.pop(self.node_id, None)

    def close_idle(self) -> None:
        """Close every idle stream (a route event: the tunnel went, the backend was dropped)."""
        for stream in list(self._idle):
            stream.close()  # out of the pool (and the node's count) as it closes

    @property
    def route(self):
        """What a request's trace reads its tunnel hop from (``metrics.Hops.calling``)."""
        return self

    def _absolute(self, deadline: float | None) -> float:
        return self._reactor.seconds() + self._default_timeout if deadline is None else deadline

    def call(self, method: str, request, deadline: float | None = None) -> defer.Deferred:
        """A unary RPC; fires with the response message or fails with one condition."""
        return self._run(method, request, None, deadline)

    def stream(self, method: str, request, on_item: Callable[[Any], Any],
               deadline: float | None = None) -> defer.Deferred:
        """A server-streaming RPC: ``on_item(message)`` per item, in order, on the reactor;
        a Deferred it returns is awaited before the next item is read.  Fires with None after
        the last item."""
        return self._run(method, request, on_item, deadline)

    def _run(self, method_name: str, request, on_item, deadline) -> defer.Deferred:
        what = f"{method_name} on worker {self.node_id} port {self.port}"
        if self.closed:
            return defer.fail(errors.TransportFailure(f"{what}: the client is closed"))
        method = callframes.METHODS.get(method_name)
        if method is None or method.server_streaming != (on_item is not None):
            return defer.fail(ValueError(f"{method_name!r} is not a "
                                         f"{'streaming' if on_item else 'unary'} method of "
                                         "backend.Backend"))
        absolute = self._absolute(deadline)
        self.in_flight += 1
        self.used = True
        if self.node_id in self._old_nodes and self._fallback is not None:
            done = self._viaFallback(method_name, request, on_item, absolute)
        else:
            done = self._viaTunnel(method, request, on_item, absolute, what)
        return done.addBoth(self._ended)

    def _viaTunnel(self, method, request, on_item, absolute, what) -> defer.Deferred:
        try:
            call = _Call(self, method, request, on_item, absolute)
        except ValueError as e:
            # Over the 50 MiB message cap: what grpcio answers such a request, as before.
            return defer.fail(errors.BackendAnswer(self.node_id, "RESOURCE_EXHAUSTED", str(e)))
        self._calls.add(call)
        result = call.start()
        result.addBoth(self._forget_call, call)
        outer: defer.Deferred = defer.Deferred(lambda _: result.cancel())

        def failed(failure: Failure):
            if (failure.check(errors.StreamRefused) and failure.value.code == preamble.UNKNOWN_TAG
                    and self._fallback is not None and not self.closed):
                # An older worker: it learned nothing about any backend; ask the bridge.
                self._old_nodes.add(self.node_id)
                return self._viaFallback(method.name, request, on_item, absolute)
            if failure.check(defer.CancelledError) and self._reactor.seconds() >= absolute:
                return Failure(errors.CallerDeadlineExceeded(what))
            return _consumer_failure(failure, what)

        result.addErrback(failed).chainDeferred(outer)
        return outer

    def _viaFallback(self, method, request, on_item, absolute) -> defer.Deferred:
        client = self._fallback()
        if on_item is None:
            return client.call(method, request, absolute)
        return client.stream(method, request, on_item, absolute)

    def _forget_call(self, result, call: _Call):
        self._calls.discard(call)
        return result

    def _ended(self, result):
        self.in_flight -= 1
        return result

    def close(self) -> None:
        """No more calls; calls in flight fail ``TransportFailure`` and their streams reset;
        idle streams close."""
        if self.closed:
            return
        self.closed = True
        for call in list(self._calls):
            call.fail(Failure(errors.TransportFailure(
                f"{call.what}: the client was closed during the call")), abort=True)
        self.close_idle()
        self._stopSweep()
