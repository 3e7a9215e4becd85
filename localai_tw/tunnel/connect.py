"""``GET /api/cluster/connect``: where a worker's tunnel arrives at a frontend replica.

The worker dials with ``?id=<node id>`` and ``Authorization: Bearer <per-node tunnel
credential>``.  :class:`ConnectAuthorizer` decides before any upgrade, in the order of ref §1.1:

1. no or empty bearer credential -> 401 (first, so an anonymous probe never sees a 400);
2. the frontend is not wired for distributed mode -> 503;
3. no ``id`` -> 400;
4. unknown node, an empty stored credential hash, or a wrong credential -> 401 (the same answer
   for all three, so ids cannot be enumerated); a database that does not answer the lookup ->
   503, any other lookup failure -> 500 (a worker must not be told its credential is wrong
   because the database is down);
5. ``pending`` -> 403 (awaiting approval; draining and unhealthy nodes keep their tunnels).

The upgrade's answer carries ``X-LocalAI-Liveness: tunnel`` when this replica stamps the
heartbeat of the tunnels it holds (``cluster/liveness.py``, ``--tunnel-liveness``): the worker
then sends its HTTP heartbeat only on a capacity change or its slow refresh.  A worker whose
upgrade request says ``X-LocalAI-Stamp-Notices: stream`` also gets the replica's stamp notices
(``tunnel/stampnotice.py``), which put that refresh off.

Then the WebSocket is upgraded and a yamux **server** session runs over it.  The frontend only
opens streams: a stream the worker opens is a protocol error that ends the session (an accepted
but unread stream would pin a window of memory, and an RST per SYN is an answer a non-reading
worker can make us pile up).  Once the session is open the node is attached in the
:class:`~localai_tw.tunnel.registry.TunnelRegistry` (claim in the database, then install), and
when it closes it is detached with the token the attach returned.  Every tunnel event is logged
with node (id and name), replica and epoch.  Refused dials are logged one by one only up to a
burst per source address, then summarised (:class:`~localai_tw.logs.RateLimitedLog`).

What this module must never do: upgrade a dial the authorizer did not accept; log or echo the
credential; accept a stream opened by the worker; detach with anything but the attach's own
token.
"""

from __future__ import annotations

from typing import Callable

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from localai_tw.cluster.nodes import NodeStatus, Unauthorized
from localai_tw.db.pool import DatabaseUnavailable, PoolClosed
from localai_tw.logs import RateLimitedLog
from localai_tw.logsafe import untrusted
from localai_tw.mux.autowindow import WindowPool
from localai_tw.mux.session import Session, SessionConfig
from localai_tw.tunnel.keepalive import (
    FRONTEND_WINDOW_BUDGET,
    LIVENESS_BY_TUNNEL,
    LIVENESS_HEADER,
    WORKER_PINGS,
    WORKER_PINGS_HEADER,
    tunnel_keepalive,
    tunnel_windows,
)
from localai_tw.tunnel.stampnotice import STAMP_NOTICES, STAMP_NOTICES_HEADER
from localai_tw.tunnel.websocket import (
    ConnectRefused,
    IConnectAuthorizer,
    TunnelWebSocketResource,
    bearer_credential,
)

log = Logger()

CONNECT_PATH = "/api/cluster/connect"
#: Longest node id looked up (ids are at most 36 characters); longer ones are simply unknown.
MAX_NODE_ID_BYTES = 64

#: The grown receive windows of every worker tunnel this frontend process holds, together.
FRONTEND_WINDOW_POOL = WindowPool(FRONTEND_WINDOW_BUDGET)


def tunnel_session_config(peer_pings: bool = False) -> SessionConfig:
    """The yamux configuration of the frontend's end of a worker tunnel: a server that accepts no
    streams, and ends the session at the first stream the worker opens (workers never open
    streams by contract; one RST and one log line per SYN would let a worker flood us with
    answers it never reads).  The receive window starts at the protocol default (256 KiB per
    stream) and grows toward the link's bandwidth-delay product (``mux/autowindow.py``), from
    one budget shared by every worker tunnel of this process (``FRONTEND_WINDOW_POOL``): each
    end advertises its own, so the worker's choice does not have to match (see
    docs/routing.md).  The keepalive is the tunnel's (``keepalive.py``): a silent carrier is
    declared dead within 10 s, so requests stop being routed to it.  ``peer_pings``: the worker
    said it pings every interval (``WORKER_PINGS_HEADER``): we send it no ping and end the
    session after 10 s without a byte from it."""
    return SessionConfig(accept_streams=False, forbid_inbound_streams=True,
                         **tunnel_keepalive(peer_pings=peer_pings),
                         **tunnel_windows(FRONTEND_WINDOW_POOL))


class OpenNotifyingSession(Session):
    """A yamux session that calls ``on_open(session)`` once its carrier is connected.
    ``takes_stamp_notices``: its worker said on the upgrade that it reads stamp notices
    (``tunnel/stampnotice.py``)."""

    def __init__(self, *args, on_open: Callable[["OpenNotifyingSession"], None],
                 takes_stamp_notices: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_open = on_open
        self.takes_stamp_notices = takes_stamp_notices

    def connectionMade(self) -> None:
        super().connectionMade()
        try:
            self._on_open(self)
        except Exception:
            log.failure("session open hook failed; closing the session")
            self.loseConnection()


def _single_arg(request, name: bytes) -> str | None:
    values = request.args.get(name) or []
    if len(values) != 1 or not values[0]:
        return None
    try:
        return values[0].decode("ascii")
    except UnicodeDecodeError:
        return ""


#: Tunnel dials whose credential lookup may be in flight at once (:class:`ConnectAuthorizer`).
MAX_AUTHORIZING = 64


def _source(request) -> str:
    address = request.getClientAddress()
    return str(getattr(address, "host", address))


@implementer(IConnectAuthorizer)
class ConnectAuthorizer:
    """Authorizes a worker's tunnel dial (ref §1.1 order).  The result is the ``Node``.

    :param nodes: a ``NodeRegistry``, or None when distributed mode is not wired (503).
    :param max_authorizing: credential lookups in flight at once; a dial beyond them is
        answered 503 with ``Retry-After`` at once, without a statement.  After a restart
        thousands of workers dial together: admitted at the pace the database answers, their
        lookups do not queue in the pool ahead of every other request of the replica.
    """

    def __init__(self, nodes, clock=None, max_authorizing: int = MAX_AUTHORIZING):
        self._nodes = nodes
        self.max_authorizing = max_authorizing
        self.authorizing = 0
        self.refusals = RateLimitedLog(
            "refused {count} tunnel dials from {source} in the last {seconds:g} s "
            "({suppressed} of them not logged one by one)", clock=clock)
        self.deferred_dials = RateLimitedLog(
            "deferred {count} tunnel dials in the last {seconds:g} s: "
            f"{max_authorizing} credential lookups were already in flight (a reconnect storm; "
            "the workers dial again after their backoff)", clock=clock, burst=0)

    async def _authorize(self, request):
        credential = bearer_credential(request)  # 401 first, before anything else
        if self._nodes is None:
            raise ConnectRefused(503, "distributed mode is not enabled on this frontend")
        node_id = _single_arg(request, b"id")
        if node_id is None:
            raise ConnectRefused(400, "missing id")
        if self.authorizing >= self.max_authorizing:
            self.deferred_dials.allow("all")
            raise ConnectRefused(503, "this replica is admitting as many tunnel dials as it can "
                                 "take; dial again", {"Retry-After": "2"})
        self.authorizing += 1
        try:
            return await self._look_up(request, credential, node_id)
        finally:
            self.authorizing -= 1

    async def _look_up(self, request, credential: bytes, node_id: str):
        if len(node_id) > MAX_NODE_ID_BYTES or not node_id:
            node_id = ""  # unknown by construction; still verified, so timing says nothing
        try:
            node = await self._nodes.verify_tunnel_credential(
                node_id, credential.decode("utf-8", "replace"))
        except Unauthorized:
            if self.refusals.allow(_source(request)):
                log.info("tunnel dial refused (401): node={node} unknown or credential not "
                         "current (re-register the worker)",
                         node=untrusted(node_id) or "<invalid>")
            raise ConnectRefused(401, "unknown node or wrong credential",
                                 {"WWW-Authenticate": "Bearer"}) from None
        except (defer.CancelledError, defer.TimeoutError, DatabaseUnavailable, PoolClosed) as e:
            # The database did not answer (in time): a fact about this replica, not the worker.
            if self.refusals.allow(_source(request)):
                log.warn("tunnel dial of node={node} answered 503: the database did not answer "
                         "the node lookup ({err}); the worker dials again",
                         node=untrusted(node_id), err=type(e).__name__)
            raise ConnectRefused(503, "the frontend's database is not answering; try again",
                                 {"Retry-After": "5"}) from None
        except Exception as e:
            log.warn("tunnel dial of node={node} answered 500: node lookup failed ({err})",
                     node=untrusted(node_id), err=type(e).__name__)
            raise ConnectRefused(500, "node lookup failed; try again") from None
        if node.status is NodeStatus.PENDING:
            if self.refusals.allow(_source(request)):
                log.info("tunnel dial refused (403): node={node} ({name}) awaits approval",
                         node=node_id, name=node.name)
            raise ConnectRefused(403, "node awaiting approval")
        return node

    def authorize(self, request):
        return defer.ensureDeferred(self._authorize(request))


class WorkerTunnelAcceptor:
    """Runs the server end of each authorized tunnel and keeps the registry in step with it."""

    def __init__(self, registry, reactor=None, config_factory=tunnel_session_config):
        if reactor is None:
            from twisted.internet import reactor
        self._registry = registry
        self._reactor = reactor
        self._config_factory = config_factory

    def build_session(self, request, node) -> Session:
        peer = request.getClientAddress()
        # The hook keeps what it logs, not the Node (its row, labels and dates would live as
        # long as the tunnel).
        node_id, name = node.id, node.name
        peer_pings = request.getHeader(WORKER_PINGS_HEADER) == WORKER_PINGS
        return OpenNotifyingSession(
            client=False, config=self._config_factory(peer_pings=peer_pings), acceptor=None,
            reactor=self._reactor,
            takes_stamp_notices=request.getHeader(STAMP_NOTICES_HEADER) == STAMP_NOTICES,
            on_open=lambda session: self._opened(session, node_id, peer, name))

    def _opened(self, session: Session, node_id: str, peer, name: str = "") -> None:
        replica = self._registry.instance_id
        log.info("tunnel node={node} ({name}) replica={replica}: session open from {peer}, "
                 "claiming", node=node_id, name=name, replica=replica,
                 peer=getattr(peer, "host", peer))
        attaching = self._registry.attach(node_id, session, name)

        def attached(token: int):
            log.info("tunnel node={node} ({name}) replica={replica} epoch={epoch}: attached",
                     node=node_id, name=name, replica=replica, epoch=token)
            session.whenClosed().addCallback(closed, token)

        def closed(ending, token: int):
            log.info("tunnel node={node} ({name}) replica={replica} epoch={epoch}: session "
                     "ended ({why})", node=node_id, name=name, replica=replica, epoch=token,
                     why=ending)
            return self._registry.detach(node_id, token)

        def failed(failure):
            log.warn("tunnel node={node} ({name}) replica={replica}: attach failed, session "
                     "closed ({err})", node=node_id, name=name, replica=replica,
                     err=failure.getErrorMessage())

        attaching.addCallbacks(attached, failed)


def connect_resource(nodes, registry, reactor=None, *,
                     config_factory=tunnel_session_config) -> TunnelWebSocketResource:
    """The resource to mount at ``/api/cluster/connect``.  ``nodes`` or ``registry`` None: every
    authenticated dial is answered 503."""
    authorizer = ConnectAuthorizer(nodes if registry is not None else None, reactor)
    acceptor = WorkerTunnelAcceptor(registry, reactor, config_factory) if registry else None

    def protocol_factory(request, node):
        return acceptor.build_session(request, node)

    def answer_headers() -> dict[str, str]:
        # The replica stamps the liveness of the tunnels it holds (cluster/liveness.py): the
        # worker may then heartbeat over HTTP only when its capacity changes.
        if registry is not None and registry.stamps_liveness:
            return {LIVENESS_HEADER: LIVENESS_BY_TUNNEL}
        return {}

    return TunnelWebSocketResource(protocol_factory, authorizer, answer_headers=answer_headers)
