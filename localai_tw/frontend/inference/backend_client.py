"""gRPC calls from the frontend to a backend on a worker, through that backend's bridge, and
:class:`BackendClients`, which picks each (node, port)'s client.

By default (``--backend-calls tunnel``) a call is one framed request on a ``call`` tunnel
stream (``tunnelcalls.py``: no grpcio, no HTTP/2 in the frontend); the bridged client here
serves ``--backend-calls grpc`` and workers too old for ``call`` streams.

:class:`BridgedBackendClient` holds one grpcio channel to ``unix:<bridge socket>`` (see
``grpcbridge.py``) and makes ``backend.Backend`` calls without ever blocking the reactor:

- **unary** calls use grpcio's synchronous channel in *future* mode (``stub.X.future(...)``),
  the same style as the worker's supervisor (``backends/process.py``): grpcio's own threads
  complete the call and the result is handed to the reactor with ``callFromThread``.  No thread
  is parked per call; cancelling the Deferred cancels the RPC.
- **server streaming** (``PredictStream``) has no future mode, so each ``next()`` on the call's
  iterator runs on a small dedicated thread pool (:class:`StreamThreads`), one item at a time:
  the next item is fetched only after the caller's ``on_item`` (and the Deferred it returned,
  if any) finished, so a slow consumer holds the stream (grpc's flow control then holds the
  backend) -- that is the backpressure.  Items are delivered on the reactor thread, in order.
  Cancelling cancels the RPC, which ends the blocked ``next()`` at once.

Every call carries ``authorization: Bearer <the backend process's own token>``: the worker's
supervisor mints one per process and tells it to this replica over the control channel
(:class:`BackendTokens`; a call the backend refuses as ``UNAUTHENTICATED``, one restarted on
the same port, asks again and is retried once), and uses 50 MiB message limits both ways.

Failure mapping (:func:`classify_rpc_failure`), the heart of "may anyone act on this":

=================================================  =============================================
what happened                                      raised
=================================================  =============================================
the caller's deadline passed (``DEADLINE_EXCEEDED``  ``CallerDeadlineExceeded``
or the reactor clock says so)
the caller cancelled                               ``defer.CancelledError``
``CANCELLED`` because this replica closed the      ``TransportFailure`` (nothing was learned)
client (no route event during the call)
``UNAVAILABLE`` and the bridge recorded a dial     that condition exactly: ``WorkerUnroutable``,
error (now, or a route event during the call)      ``WorkerGone``, ``AbsentWithinGrace``,
                                                   ``PeerUnreachable``, ``TransportFailure``, or
                                                   ``StreamRefused`` (the worker's answer)
``INTERNAL``/``CANCELLED`` with a route event      that route condition
during the call
any other status (incl. ``UNAVAILABLE`` with no    ``BackendAnswer(node, code name, details)``
dial error: the backend itself answered)
=================================================  =============================================

**Dial only on demand.**  grpcio keeps a channel whose connect failed in ``TRANSIENT_FAILURE``
and redials it by itself, once a second here (``grpcoptions.py``), for as long as the channel
lives, with no call at all: after a worker crash every redial was a tunnel dial (an owner and a
presence query, or a stream to a closed port) and a log line, forever.  So a client closes its
grpc channel when the route is down and no call of its own is in flight (a dial failed with
nothing in flight, or its last call ended while the bridge's ``last_dial_error`` is set), and
opens a new one at its next call: an idle channel never dials.  A channel whose established
connection broke goes ``IDLE`` and does not redial (nothing to do there).  How long a client
lives at all is its placement's business (``channels.py``).

What this module must never do: block the reactor (no synchronous stub call, no iterator read on
the reactor thread); report a route failure as the backend's answer; read more than one stream
item ahead of the consumer; keep a channel that redials with no call in flight.
"""

from __future__ import annotations

from typing import Any, Callable

import grpc
from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from localai_tw import errors
from localai_tw.backends import backend_pb2_grpc
from localai_tw.backends.grpcfuture import STREAM_END, deferred_from_future, next_stream_item
from localai_tw.backends.grpcoptions import CLIENT_OPTIONS
from localai_tw.backends.grpcthread import close_channel, open_channel
from localai_tw.frontend.inference.tunnelcalls import TunnelBackendClient

log = Logger()

#: The shared options (backends/grpcoptions.py), and the HTTP/2 connection (one tunnel stream)
#: kept alive across idle periods.
CHANNEL_OPTIONS = [*CLIENT_OPTIONS, ("grpc.keepalive_time_ms", 60_000)]
#: Per-call timeout when the caller gives no deadline.
DEFAULT_CALL_TIMEOUT = 300.0
#: Threads reading stream items (each open stream holds one only while it waits for an item).
STREAM_THREADS = 32

_ROUTE_SHAPED_WITH_EVENT = (grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)


def classify_rpc_failure(failure: Failure, bridge, snapshot: int, node_id: str, what: str,
                         deadline_passed: bool) -> Failure:
    """Map a failed RPC to one condition (module docstring table)."""
    if failure.check(errors.ClusterError):
        return failure
    if failure.check(defer.CancelledError):
        if deadline_passed:
            return Failure(errors.CallerDeadlineExceeded(what))
        return failure
    exc = failure.value
    if not (isinstance(exc, grpc.RpcError) and hasattr(exc, "code")):
        return Failure(errors.TransportFailure(f"{what}: {failure.getErrorMessage()}"))
    code = exc.code()
    details = exc.details() or ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or (deadline_passed
                                                     and code == grpc.StatusCode.CANCELLED):
        return Failure(errors.CallerDeadlineExceeded(what))
    if code == grpc.StatusCode.UNAVAILABLE:
        route = bridge.route_failure_since(snapshot)
        if route is not None:
            return Failure(route)
    elif code in _ROUTE_SHAPED_WITH_EVENT and bridge.route_events > snapshot:
        return Failure(bridge.route_failure_since(snapshot))
    return Failure(errors.BackendAnswer(node_id, code.name, details[:2048]))


def _cut_by_close(failure: Failure, bridge, snapshot: int) -> bool:
    """A ``CANCELLED`` status with no route event since the call started: what grpcio answers
    to the calls in flight when the channel is closed."""
    exc = failure.value
    return (isinstance(exc, grpc.RpcError) and hasattr(exc, "code")
            and exc.code() == grpc.StatusCode.CANCELLED and bridge.route_events <= snapshot)


class StreamThreads:
    """The thread pool that reads server-stream items (started lazily, stopped by ``stop``)."""

    def __init__(self, reactor, size: int = STREAM_THREADS):
        self._reactor = reactor
        self._size = size
        self._pool: ThreadPool | None = None

    def run(self, fn, *args) -> defer.Deferred:
        if self._pool is None:
            self._pool = ThreadPool(1, self._size, name="localai-grpc-streams")
            self._pool.start()
        return threads.deferToThreadPool(self._reactor, self._pool, fn, *args)

    def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()


class BridgedBackendClient:
    """Calls to one backend (node, port) through its :class:`GrpcBridge`."""

    def __init__(self, bridge, reactor, stream_threads: StreamThreads,
                 auth_token: str | None = None, default_timeout: float = DEFAULT_CALL_TIMEOUT,
                 *, tokens: "BackendTokens | None" = None):
        self.bridge = bridge
        self.node_id = bridge.node_id
        self.port = bridge.port
        self._reactor = reactor
        self._threads = stream_threads
        self._default_timeout = default_timeout
        self._channel: grpc.Channel | None = None
        self._stub_now: backend_pb2_grpc.BackendStub | None = None
        #: calls (unary and streams) of this client not finished yet
        self.in_flight = 0
        #: set by every call, cleared by the placement sweep (``channels.py``): a client
        #: used since the sweep's last look is not closed by it
        self.used = True
        #: grpc channels closed because the route was down with no call in flight
        self.channel_resets = 0
        bridge.on_dial_failed = self._dial_failed
        #: the backend process's own token, learnt over the control channel (when given);
        #: else the fixed ``auth_token`` (tests, and nothing at all when that is None)
        self._tokens = tokens
        self._metadata = _bearer(auth_token)
        self.closed = False

    @property
    def route(self):
        """What a request's trace reads its tunnel hop from (``metrics.Hops.calling``)."""
        return self.bridge

    @property
    def _stub(self) -> backend_pb2_grpc.BackendStub:
        """The stub over the current channel, opened now when there is none (a fresh client,
        or one whose channel was closed while the route was down)."""
        if self._stub_now is None:
            self._channel = open_channel(self.bridge.address, CHANNEL_OPTIONS)
            self._stub_now = backend_pb2_grpc.BackendStub(self._channel)
        return self._stub_now

    def _began(self) -> None:
        self.in_flight += 1
        self.used = True

    def _ended(self, result):
        self.in_flight -= 1
        if self.in_flight == 0 and self.bridge.last_dial_error is not None:
            self._idle_channel_down()
        return result

    def _dial_failed(self) -> None:
        """The bridge's dial failed: with no call of ours in flight it was grpcio redialling
        on its own, which it would do forever."""
        if self.in_flight == 0:
            self._idle_channel_down()

    def _idle_channel_down(self) -> None:
        channel, self._channel, self._stub_now = self._channel, None, None
        if channel is not None and not self.closed:
            self.channel_resets += 1
            log.debug("grpc channel to worker {node} port {port} closed: the route is down "
                      "and no call is in flight (the next call opens a new one)",
                      node=self.node_id, port=self.port)
            close_channel(channel)

    def _metadata_now(self) -> defer.Deferred:
        if self._tokens is None:
            return defer.succeed(self._metadata)
        return self._tokens.get(self.node_id, self.port).addCallback(_bearer)

    def _timeout(self, deadline: float | None) -> tuple[float, float]:
        now = self._reactor.seconds()
        if deadline is None:
            deadline = now + self._default_timeout
        return max(deadline - now, 0.001), deadline

    def call(self, method: str, request, deadline: float | None = None) -> defer.Deferred:
        """A unary RPC; fires with the response message or fails with one condition."""
        what = f"{method} on worker {self.node_id} port {self.port}"
        if self.closed:
            return defer.fail(errors.TransportFailure(f"{what}: the client is closed"))
        _, absolute = self._timeout(deadline)
        snapshot = self.bridge.snapshot()
        self._began()
        return self._attempt(method, request, absolute, retry=True).addErrback(
            self._classify, snapshot, what, absolute).addBoth(self._ended)

    def _attempt(self, method: str, request, absolute: float, *, retry: bool):
        def send(metadata):
            timeout = max(absolute - self._reactor.seconds(), 0.001)
            future = getattr(self._stub, method).future(request, timeout=timeout,
                                                        metadata=metadata)
            return deferred_from_future(self._reactor, future)

        sent = self._metadata_now().addCallback(send)
        if retry and self._tokens is not None:
            def again(failure):
                # The backend refused the token before running anything (it was restarted
                # on this port with a new one): learn the current token and try once more.
                if not _unauthenticated(failure):
                    return failure
                self._tokens.forget(self.node_id, self.port)
                return self._attempt(method, request, absolute, retry=False)

            sent.addErrback(again)
        return sent

    def stream(self, method: str, request, on_item: Callable[[Any], Any],
               deadline: float | None = None) -> defer.Deferred:
        """A server-streaming RPC: ``on_item(message)`` per item, in order, on the reactor;
        a Deferred it returns is awaited before the next item is read.  Fires with None after
        the last item."""
        what = f"{method} on worker {self.node_id} port {self.port}"
        if self.closed:
            return defer.fail(errors.TransportFailure(f"{what}: the client is closed"))
        _, absolute = self._timeout(deadline)
        snapshot = self.bridge.snapshot()
        getting = self._metadata_now()
        state: dict[str, Any] = {"cancelled": False, "call": None}

        def cancel(_):
            state["cancelled"] = True
            if state["call"] is not None:
                state["call"].cancel()
            else:
                getting.cancel()

        result: defer.Deferred = defer.Deferred(cancel)

        async def pump():
            metadata = await getting
            if result.called:
                return
            timeout = max(absolute - self._reactor.seconds(), 0.001)
            call = state["call"] = getattr(self._stub, method)(request, timeout=timeout,
                                                               metadata=metadata)
            while True:
                item = await self._threads.run(next_stream_item, call)
                if result.called:
                    return
                if item is STREAM_END:
                    return
                outcome = on_item(item)
                if isinstance(outcome, defer.Deferred) or hasattr(outcome, "__await__"):
                    await outcome
                if result.called:
                    return

        def finished(outcome):
            if result.called:
                return None
            if isinstance(outcome, Failure):
                if not outcome.check(grpc.RpcError) and state["call"] is not None:
                    state["call"].cancel()  # the consumer failed: stop the backend's work too
                if self._tokens is not None and _unauthenticated(outcome):
                    self._tokens.forget(self.node_id, self.port)  # the next call asks again
                result.errback(outcome)
            else:
                result.callback(None)
            return None

        self._began()
        defer.ensureDeferred(pump()).addBoth(finished)
        return result.addErrback(self._classify, snapshot, what, absolute).addBoth(self._ended)

    def _classify(self, failure: Failure, snapshot: int, what: str, deadline: float):
        passed = self._reactor.seconds() >= deadline
        if self.closed and not passed and _cut_by_close(failure, self.bridge, snapshot):
            # This replica closed the channel under the call (the backend dropped or
            # forgotten): nothing was learned, and it is not the backend's answer.
            return Failure(errors.TransportFailure(
                f"{what}: the client was closed during the call"))
        return classify_rpc_failure(failure, self.bridge, snapshot, self.node_id, what, passed)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.bridge.on_dial_failed == self._dial_failed:
                self.bridge.on_dial_failed = None
            channel, self._channel, self._stub_now = self._channel, None, None
            if channel is not None:
                close_channel(channel)


#: How the frontend reaches backends (``--backend-calls``): ``tunnel``, one framed request on a
#: ``call`` stream (``tunnelcalls.py``; an older worker through the bridge), or ``grpc``, every
#: call through the bridge.
BACKEND_CALL_MODES = ("tunnel", "grpc")


class BackendClients:
    """One client per (node, port): a :class:`~localai_tw.frontend.inference.tunnelcalls.
    TunnelBackendClient` (``mode`` ``tunnel``, the default), else a
    :class:`BridgedBackendClient` over :class:`GrpcBridges` -- also the fallback of a tunnel
    client for a worker that refuses ``call`` streams (remembered per node: ``old_nodes``)."""

    def __init__(self, bridges, reactor, auth_token: str | None = None,
                 default_timeout: float = DEFAULT_CALL_TIMEOUT, *, control=None,
                 dialer=None, mode: str = "tunnel"):
        if mode not in BACKEND_CALL_MODES:
            raise ValueError(f"backend call mode must be one of {BACKEND_CALL_MODES}: {mode!r}")
        self.bridges = bridges
        self._reactor = reactor
        self._token = auth_token
        self._default_timeout = default_timeout
        #: with a ``ControlClient``: each backend's own token, asked of its worker
        self.tokens = BackendTokens(control, auth_token) if control is not None else None
        self.stream_threads = StreamThreads(reactor)
        #: ``tunnel`` needs the ``WorkerDialer``; without one every call is bridged
        self._dialer = dialer
        self.mode = mode if dialer is not None else "grpc"
        #: nodes whose worker refused a ``call`` stream (``unknown-tag``): bridged from now on
        self.old_nodes: set[str] = set()
        #: idle ``call`` streams per node, over its clients (``tunnelcalls.py`` bounds it)
        self.idle_by_node: dict[str, int] = {}
        self._clients: dict[tuple[str, int], Any] = {}
        self._bridged: dict[tuple[str, int], BridgedBackendClient] = {}

    def client(self, node_id: str, port: int):
        key = (node_id, int(port))
        existing = self._clients.get(key)
        if existing is not None and not existing.closed:
            bridge = getattr(existing, "bridge", None)
            if bridge is None or not bridge.closed:
                return existing
        if existing is not None:
            existing.close()
        if self.mode == "tunnel":
            client = TunnelBackendClient(
                self._dialer, node_id, int(port), self._reactor, self._default_timeout,
                fallback=lambda: self.bridged(node_id, port), old_nodes=self.old_nodes,
                idle_by_node=self.idle_by_node)
        else:
            client = self.bridged(node_id, port)
        self._clients[key] = client
        return client

    def bridged(self, node_id: str, port: int) -> BridgedBackendClient:
        """The gRPC client of (node, port) through its bridge (made on first use)."""
        key = (node_id, int(port))
        existing = self._bridged.get(key)
        if existing is not None and not existing.closed and not existing.bridge.closed:
            return existing
        if existing is not None:
            existing.close()
        bridge = self.bridges.bridge(node_id, port)
        client = BridgedBackendClient(bridge, self._reactor, self.stream_threads, self._token,
                                      self._default_timeout, tokens=self.tokens)
        self._bridged[key] = client
        return client

    def open_clients(self) -> dict[tuple[str, int], Any]:
        """The clients open now, by (node, port) (a copy)."""
        return {key: c for key, c in self._clients.items() if not c.closed}

    def remember_token(self, node_id: str, port: int, token: str | None) -> None:
        """The token ``backend.start`` answered for the backend on (node, port)."""
        if self.tokens is not None:
            self.tokens.remember(node_id, port, token)

    def drop(self, node_id: str, port: int) -> defer.Deferred:
        # (the token stays known: a backend started on that port later has another one,
        # which the first call refused UNAUTHENTICATED learns)
        for clients in (self._clients, self._bridged):
            client = clients.pop((node_id, int(port)), None)
            if client is not None:
                client.close()
        return self.bridges.drop(node_id, port)

    def forget(self, node_id: str) -> defer.Deferred:
        if self.tokens is not None:
            self.tokens.forget(node_id)
        self.old_nodes.discard(node_id)  # it may come back upgraded
        for clients in (self._clients, self._bridged):
            for key in [k for k in clients if k[0] == node_id]:
                clients.pop(key).close()
        return self.bridges.forget(node_id)

    def close(self) -> defer.Deferred:
        for clients in (self._clients, self._bridged):
            for client in clients.values():
                client.close()
            clients.clear()
        self.stream_threads.stop()
        return self.bridges.close()


def _bearer(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def _unauthenticated(failure: Failure) -> bool:
    exc = failure.value
    return (isinstance(exc, grpc.RpcError) and hasattr(exc, "code")
            and exc.code() == grpc.StatusCode.UNAUTHENTICATED)


#: Seconds a ``backend.token`` control call may take.
TOKEN_TIMEOUT = 30.0


class BackendTokens:
    """Each backend process's own gRPC token, by (node, port), as its worker tells it over the
    control channel (``backend.start`` answers it; ``backend.token`` when this replica did not
    start the backend).  The control channel carries the node's own control token, so only a
    replica learns a backend's token; the cluster's registration token is never sent to a
    backend, except to one of a worker too old to serve ``backend.token`` (``fallback``: its
    backends were started with that token)."""

    def __init__(self, control, fallback: str | None = None):
        self._control = control
        self._fallback = fallback or ""
        self._known: dict[tuple[str, int], str] = {}

    def get(self, node_id: str, port: int) -> defer.Deferred:
        """Fires with the token ('' when the worker knows none: the call then tells why)."""
        key = (node_id, int(port))
        if key in self._known:
            return defer.succeed(self._known[key])
        return defer.ensureDeferred(self._ask(key))

    async def _ask(self, key: tuple[str, int]) -> str:
        node_id, port = key
        try:
            reply = await self._control.call(node_id, "backend.token", {"port": port},
                                             timeout=TOKEN_TIMEOUT)
        except errors.VerbNotServed:  # an older worker (docs/operators.md, rollout order)
            if self._fallback:
                self._known[key] = self._fallback  # asked once, not before every call
            return self._fallback
        token = (reply or {}).get("token")
        if not isinstance(token, str) or not token:
            return ""  # no backend there now: the call itself answers that
        self._known[key] = token
        return token

    def remember(self, node_id: str, port: int, token: str | None) -> None:
        if isinstance(token, str) and token:
            self._known[(node_id, int(port))] = token

    def forget(self, node_id: str, port: int | None = None) -> None:
        for key in [k for k in self._known
                    if k[0] == node_id and (port is None or k[1] == int(port))]:
            del self._known[key]
