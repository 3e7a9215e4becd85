"""Replica-to-replica links: ``/api/cluster/peer``, the dialling pool, and the owner-side relay.

When a worker's tunnel is held by another replica, a stream to it travels over a *peer link*: a
WebSocket + yamux session dialled by the replica that needs the stream (the yamux client, which
accepts no streams) to the owner (the yamux server).  Each direction of relaying uses the link
dialled by the sender, so two replicas may hold two links, one each way.

Credentials (both required, both checked before the upgrade):

- ``Authorization: Bearer <shared registration token>`` (constant time);
- ``X-LocalAI-Peer-Token: <the dialling replica's own secret>``, checked against
  ``instances.peer_token_hash`` of ``?id=``, in constant time; an empty secret or an empty
  stored hash never matches, and there is no fallback to the shared token.  The replica must
  be *live*: one whose secret matches but whose heartbeat is late (re-joining after its
  database connection was re-established) is answered 503, which its side reports as an
  unreachable peer (retry), not as a configuration problem.

A refusal is a version or configuration problem (a replica without a published hash, a different
registration token) and is logged as such, loudly, on both sides; the dialling side raises
``PeerRejected``.  With no registration token configured at all the first check cannot be made;
the peer secret alone then decides, and a warning says so at construction.

The accepting side reads, on each stream, one relay frame ``"<node> <lane> <budget-ms>"`` within
15 s (timeout or malformed -> ``relay-bad-request``), opens the worker's stream through *its own*
:class:`~localai_tw.tunnel.registry.TunnelRegistry` (not held -> ``relay-not-owner``; held but the
session would not carry a stream -> ``relay-unavailable``), answers ``relay-ok`` and splices the
two streams.  The tunnel request frame the caller pipelined behind the relay frame passes through
to the worker untouched, and so does the worker's reply.

TLS: an owner that listens on ``ssl:`` publishes ``wss://host:port`` (see
:mod:`~localai_tw.tunnel.peertls`); the pool then dials ``wss://`` only, checks the certificate
against ``--peer-ca-file`` (else the system trust store) and the advertised host, and a refused
certificate is a ``PeerUnreachable`` with one error line saying why.

Peer links advertise a 4 MiB receive window per stream (ref §1.3: bulk and peer links use bigger
windows).  Each end advertises its own window, so both ends use :func:`peer_session_config`.

What this module must never do: relay onward (exactly one hop: the owner opens the stream on a
tunnel it holds, never on a peer link); accept a peer link on one credential alone when both are
configured; log a token or secret; report a peer problem as anything about a worker (the pool
only ever raises ``PeerUnreachable``, ``PeerRejected``, ``PoolClosed`` or :class:`PeerNotLive`).
"""

from __future__ import annotations

from typing import Callable
from urllib.parse import quote, urlsplit

from twisted.internet import defer
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from zope.interface import implementer

from localai_tw import errors
from localai_tw.cluster.clock import INSTANCE_IS_LIVE_SQL, INSTANCE_LIVENESS, interval_seconds
from localai_tw.cluster.membership import InstanceIdentity, peer_credential, secret_matches_hash
from localai_tw.logs import RateLimitedLog
from localai_tw.logsafe import untrusted
from localai_tw.mux.errors import MuxError
from localai_tw.mux.session import ByteTally, Session, SessionConfig
from localai_tw.splice import HandoffProtocol, Splice
from localai_tw.tunnel import preamble
from localai_tw.tunnel.connect import OpenNotifyingSession
from localai_tw.tunnel.peertls import PeerTrust, split_published
from localai_tw.tunnel.registry import NotHeldHere
from localai_tw.tunnel.websocket import (
    ConnectRefused,
    HandshakeFailed,
    IConnectAuthorizer,
    TunnelWebSocketResource,
    bearer_credential,
    connectWebSocket,
)
from localai_tw.web import auth

log = Logger()

PEER_PATH = "/api/cluster/peer"
PEER_TOKEN_HEADER = "X-LocalAI-Peer-Token"
_PEER_TOKEN_HEADER_BYTES = PEER_TOKEN_HEADER.lower().encode("ascii")
#: Receive window each end of a peer link advertises per stream.
PEER_MAX_WINDOW = 4 * 1024 * 1024
#: Seconds the owner waits for the relay frame of a new stream.
RELAY_HEADER_TIMEOUT = 15.0
#: WebSocket opening handshake of a peer link (ref §3.1).
PEER_HANDSHAKE_TIMEOUT = 10.0
_MAX_PEER_ID_BYTES = 64

_CONFIG_HINT = ("a version or configuration problem: every replica must share the registration "
                "token and publish its peer secret hash (upgrade or reconfigure that replica)")


def peer_session_config(accepting: bool) -> SessionConfig:
    """Both ends of a peer link: 4 MiB windows; only the accepting (server) end takes streams."""
    return SessionConfig(max_window=PEER_MAX_WINDOW, accept_streams=accepting)


class PeerNotLive(Exception):
    """The replica named as owner has no live ``instances`` row any more (it left between the
    owner lookup and the dial).  The router turns this into a routing fact."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        super().__init__(f"replica {peer_id} is not live")


class PeerLookupFailed(Exception):
    """The database could not say where the peer is.  The router turns this into "absent within
    grace": nothing is known."""

    def __init__(self, peer_id: str, cause: BaseException):
        self.peer_id = peer_id
        self.cause = cause
        super().__init__(f"looking up replica {peer_id} failed: {cause}")


# -- the accepting side: authorization ------------------------------------------------------------


def _source(request) -> str:
    address = request.getClientAddress()
    return str(getattr(address, "host", address))


@implementer(IConnectAuthorizer)
class PeerLinkAuthorizer:
    """Checks both peer credentials before the upgrade.  The result is the dialling replica's id.

    Order: shared bearer token (401), the peer-token header present (401), ``id`` (400), the
    dialler's published hash (unknown 401, database error 500, empty or mismatch 401), then
    its liveness (a matching secret of a replica whose heartbeat is late: 503, retry).
    """

    def __init__(self, db, registration_token: str, liveness: float = INSTANCE_LIVENESS,
                 clock=None):
        self._db = db
        self.refusals = RateLimitedLog(
            "refused {count} peer links from {source} in the last {seconds:g} s "
            "({suppressed} of them not logged one by one)", clock=clock,
            level=LogLevel.error)
        self._token_digest = auth.digest(registration_token) if registration_token \
            else b""
        self._liveness = liveness
        if not registration_token:
            log.warn("no registration token configured: peer links are authorized by the peer "
                     "secret alone")

    def _refuse(self, request, status: int, peer_id: str, why: str) -> ConnectRefused:
        if self.refusals.allow(_source(request)):
            log.error("peer link from replica {peer} refused ({status}): {why}; if it "
                      "persists, this is " + _CONFIG_HINT, peer=untrusted(peer_id) or "<unnamed>", status=status,
                      why=why)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        return ConnectRefused(status, why, headers)

    async def _authorize(self, request) -> str:
        raw_id = (request.args.get(b"id") or [b""])[0][:_MAX_PEER_ID_BYTES]
        claimed = raw_id.decode("ascii", "replace")
        if self._token_digest:
            try:
                presented = bearer_credential(request)
            except ConnectRefused:
                raise self._refuse(request, 401, claimed,
                                   "missing shared bearer token") from None
            if not auth.matches_any(presented, [self._token_digest]):
                raise self._refuse(request, 401, claimed, "wrong shared registration token")
        secrets = request.requestHeaders.getRawHeaders(_PEER_TOKEN_HEADER_BYTES) or []
        if len(secrets) != 1 or not secrets[0].strip():
            raise self._refuse(request, 401, claimed, f"missing {PEER_TOKEN_HEADER}")
        if not raw_id:
            raise ConnectRefused(400, "missing id")
        try:
            known = await peer_credential(self._db, claimed, self._liveness)
        except Exception as e:
            log.warn("peer link from replica {peer} answered 500: lookup failed ({err})",
                     peer=untrusted(claimed), err=type(e).__name__)
            raise ConnectRefused(500, "replica lookup failed; try again") from None
        stored, live = known if known is not None else (None, False)
        secret = secrets[0].strip().decode("utf-8", "replace")
        # Always compare (an absent hash compares against a dummy) so timing says nothing.
        matched = secret_matches_hash(secret, stored or "0" * 64)
        if stored is None:
            raise self._refuse(request, 401, claimed, "unknown replica id (a replica that lost its "
                               "database connection re-joins on its own within seconds)")
        if not stored or not matched:
            raise self._refuse(request, 401, claimed,
                               "peer secret does not match the published hash")
        if not live:
            # Its own credentials, but its heartbeat is late: it is re-joining (its database
            # connection was being re-established).  Not a configuration problem: a 503 that
            # its clients see as a retryable unreachable peer, and a warning, not an error.
            if self.refusals.allow(_source(request)):
                log.warn("peer link from replica {peer} refused for now (503): its heartbeat "
                         "is late (re-joining, e.g. after a database outage); it may retry",
                         peer=untrusted(claimed))
            raise ConnectRefused(503, "this replica's heartbeat is late (it is re-joining the "
                                 "cluster); try again", {"Retry-After": "5"})
        return claimed

    def authorize(self, request):
        return defer.ensureDeferred(self._authorize(request))


# -- the accepting side: relaying streams ----------------------------------------------------------


class RelayStreamProtocol(HandoffProtocol):
    """One stream of an accepted peer link: read the relay frame, open the worker's stream on a
    tunnel held here, answer, splice.  Exactly one hop."""

    def __init__(self, registry, reactor, peer_id: str,
                 header_timeout: float = RELAY_HEADER_TIMEOUT,
                 refusals: RateLimitedLog | None = None):
        self._registry = registry
        self._refusals = refusals
        self._reactor = reactor
        self._peer_id = peer_id
        self._header_timeout = header_timeout
        self._reader = preamble.FrameReader()
        self._timer = None
        self._answered = False

    def connectionMade(self) -> None:
        self._timer = self._reactor.callLater(self._header_timeout, self._headerLate)

    def _headerLate(self) -> None:
        self._timer = None
        self._refuse(preamble.RELAY_BAD_REQUEST,
                     f"no relay frame within {self._header_timeout:g}s", node_id="?")

    def preludeReceived(self, data: bytes) -> None:
        if self._answered:
            return
        try:
            self._relay(data)
        except Exception:
            log.failure("relay stream from replica {peer} failed; resetting it",
                        peer=self._peer_id)
            self._answered = True
            self._cancelTimer()
            self.transport.abortConnection()

    def _relay(self, data: bytes) -> None:
        try:
            payload, leftover = self._reader.feed(data)
            if payload is None:
                return
            request = preamble.parse_relay_request(payload)
        except errors.TunnelProtocolError as e:
            self._refuse(preamble.RELAY_BAD_REQUEST, str(e), node_id="?")
            return
        self._cancelTimer()
        splice = Splice()
        try:
            # Our own tunnels only: a stream is never relayed onward.
            self._registry.open_stream(request.node_id, splice.b)
        except NotHeldHere:
            self._refuse(preamble.RELAY_NOT_OWNER,
                         f"replica {self._registry.instance_id} holds no tunnel for this node",
                         request.node_id)
            return
        except Exception as e:
            self._refuse(preamble.RELAY_UNAVAILABLE, f"the tunnel would not carry a stream: {e}",
                         request.node_id)
            return
        self._answered = True
        self.transport.write(preamble.encode_relay_accepted())
        log.debug("relaying a stream from replica {peer} to node={node}", peer=self._peer_id,
                  node=request.node_id)
        self.handOff(splice.a, leftover)
        held = self._registry.held(request.node_id)
        name = held.name if held is not None else "-"
        splice.whenDone().addCallback(
            lambda ending: None if ending.normal else log.info(
                "relayed stream from replica {peer} to node={node} ({name}) ended: {cause}",
                peer=self._peer_id, node=request.node_id, name=name, cause=ending.cause))

    def _refuse(self, code: str, text: str, node_id: str) -> None:
        if self._answered:
            return
        self._answered = True
        self._cancelTimer()
        if self._refusals is None or self._refusals.allow(self._peer_id):
            log.info("relay from replica {peer} for node={node} refused: {code} ({text})",
                     peer=self._peer_id, node=node_id, code=code, text=text)
        self.transport.write(preamble.encode_relay_refused(code, text))
        self.transport.loseConnection()

    def preludeLost(self, reason: Failure) -> None:
        self._cancelTimer()

    def _cancelTimer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None


class AcceptedPeerLinks:
    """The peer links other replicas dialled to us: one session per peer id (a re-dial replaces
    and closes the old one), each relaying its streams through ``registry``."""

    def __init__(self, db, registry, registration_token: str, reactor=None,
                 liveness: float = INSTANCE_LIVENESS):
        if reactor is None:
            from twisted.internet import reactor
        self._registry = registry
        self._reactor = reactor
        self._authorizer = PeerLinkAuthorizer(db, registration_token, liveness, reactor)
        self._relay_refusals = RateLimitedLog(
            "refused {count} relayed streams from replica {source} in the last {seconds:g} s "
            "({suppressed} of them not logged one by one)", clock=reactor)
        self._sessions: dict[str, Session] = {}
        #: Wire bytes of the accepted links (relay traffic and pings), for metrics.
        self.bytes = ByteTally()

    def sessions(self) -> dict[str, Session]:
        return dict(self._sessions)

    def resource(self) -> TunnelWebSocketResource:
        """The resource to mount at ``/api/cluster/peer``."""
        return TunnelWebSocketResource(self._build, self._authorizer)

    def _build(self, request, peer_id: str) -> Session:
        def accept(stream):
            return RelayStreamProtocol(self._registry, self._reactor, peer_id,
                                       refusals=self._relay_refusals)

        return OpenNotifyingSession(
            client=False, config=peer_session_config(accepting=True), acceptor=accept,
            reactor=self._reactor, on_open=lambda session: self._opened(peer_id, session))

    def _opened(self, peer_id: str, session: Session) -> None:
        old = self._sessions.get(peer_id)
        self._sessions[peer_id] = session
        self.bytes.watch(session)
        log.info("peer link from replica {peer} accepted by replica {me}", peer=peer_id,
                 me=self._registry.instance_id)
        session.whenClosed().addCallback(lambda _: self._forget(peer_id, session))
        if old is not None and old is not session:
            old.loseConnection()

    def _forget(self, peer_id: str, session: Session) -> None:
        if self._sessions.get(peer_id) is session:
            del self._sessions[peer_id]

    def close(self) -> None:
        """Shutdown: close every accepted link."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.loseConnection()


# -- the dialling side ------------------------------------------------------------------------------

_ADDRESS_SQL = f"SELECT advertised_addr FROM instances WHERE id = %s AND {INSTANCE_IS_LIVE_SQL}"


class _SharedDial:
    """One dial in progress to one peer, awaited by any number of callers.  A caller that gives
    up (cancels) only stops waiting; the dial goes on for the others and for the cache."""

    def __init__(self):
        self._waiters: list[defer.Deferred] = []
        self.result = None

    def wait(self) -> defer.Deferred:
        d = defer.Deferred(lambda d: self._waiters.remove(d) if d in self._waiters else None)
        self._waiters.append(d)
        return d

    def settle(self, result) -> None:
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)


class PeerPool:
    """One cached peer link per peer replica, dialled on demand.

    :param db: a started ``Database`` (for the peer's advertised address, read at dial time).
    :param identity: this replica's ``InstanceIdentity`` (its id and plaintext peer secret).
    :param registration_token: the shared token sent as ``Authorization: Bearer``.
    :param ca_file: a PEM CA that ``wss://`` peers' certificates must chain to (None: the
        system trust store).
    """

    def __init__(self, db, identity: InstanceIdentity, registration_token: str, reactor=None, *,
                 liveness: float = INSTANCE_LIVENESS,
                 handshake_timeout: float = PEER_HANDSHAKE_TIMEOUT,
                 connect: Callable = connectWebSocket, ca_file: str | None = None):
        if reactor is None:
            from twisted.internet import reactor
        self._trust = PeerTrust(ca_file)
        self._db = db
        self._identity = identity
        self._registration_token = registration_token
        self._reactor = reactor
        self._liveness = interval_seconds(liveness)
        self._handshake_timeout = handshake_timeout
        self._connect = connect
        self._sessions: dict[str, Session] = {}
        self._dialing: dict[str, _SharedDial] = {}
        #: Wire bytes of the links dialled from here (relay traffic and pings), for metrics.
        self.bytes = ByteTally()
        self._closed = False

    @property
    def instance_id(self) -> str:
        return self._identity.instance_id

    def cached_peers(self) -> list[str]:
        return sorted(p for p, s in self._sessions.items() if s.isOpen)

    def open_stream(self, peer_id: str, protocol) -> defer.Deferred:
        """A Deferred firing with a new stream to ``peer_id`` with ``protocol`` connected.

        Uses the cached link; if it will not open a stream, closes it and dials once more.
        Fails with ``PoolClosed``, ``PeerRejected``, ``PeerUnreachable``, :class:`PeerNotLive` or
        :class:`PeerLookupFailed`.
        """
        return defer.ensureDeferred(self._open_stream(peer_id, protocol))

    async def _open_stream(self, peer_id: str, protocol):
        if self._closed:
            raise errors.PoolClosed()
        session = self._sessions.get(peer_id)
        if session is not None:
            try:
                return session.openStream(protocol)
            except MuxError as e:
                log.info("peer link to replica {peer} would not open a stream ({err}); "
                         "dialling again", peer=peer_id, err=e)
                self._drop(peer_id, session)
                session.loseConnection()
        session = await self._session(peer_id)
        if self._closed:
            raise errors.PoolClosed()
        try:
            return session.openStream(protocol)
        except MuxError as e:
            raise errors.PeerUnreachable(peer_id, f"a fresh link would not open a stream: {e}",
                                         e) from e

    def _session(self, peer_id: str) -> defer.Deferred:
        dial = self._dialing.get(peer_id)
        if dial is None:
            dial = self._dialing[peer_id] = _SharedDial()

            def done(result):
                if self._dialing.get(peer_id) is dial:
                    del self._dialing[peer_id]
                dial.settle(result)

            defer.ensureDeferred(self._dial(peer_id)).addBoth(done)
        return dial.wait()

    async def _dial(self, peer_id: str) -> Session:
        try:
            rows = await self._db.runQuery(_ADDRESS_SQL, (peer_id, self._liveness))
        except Exception as e:
            raise PeerLookupFailed(peer_id, e) from e
        if not rows:
            raise PeerNotLive(peer_id)
        address = rows[0][0]
        if not address:
            raise errors.PeerUnreachable(peer_id, "it publishes no advertised address")
        try:
            tls, hostport = split_published(address)
        except ValueError as e:
            raise errors.PeerUnreachable(peer_id, str(e), e) from e
        scheme = "wss" if tls else "ws"
        url = f"{scheme}://{hostport}{PEER_PATH}?id={quote(self.instance_id, safe='')}"
        creator = self._trust.creator(urlsplit(url).hostname) if tls else None
        headers = {PEER_TOKEN_HEADER: self._identity.peer_secret}
        if self._registration_token:
            headers["Authorization"] = f"Bearer {self._registration_token}"

        def build():
            return Session(client=True, config=peer_session_config(accepting=False),
                           acceptor=None, reactor=self._reactor)

        try:
            session = await self._connect(self._reactor, url, build, headers=headers,
                                          handshake_timeout=self._handshake_timeout,
                                          tls_options=creator)
        except Exception as e:
            why = creator.refused if creator is not None else None
            if why is None:
                if isinstance(e, HandshakeFailed) and e.status in (401, 403) \
                        and await self._rejoining():
                    # Refused because *this* replica is not live in the peer's eyes yet (its
                    # heartbeat is late or its row was swept while its database connection was
                    # re-established): transient, a retryable unreachable peer.
                    log.warn("peer link to replica {peer} at {addr} refused ({status}) while "
                             "this replica re-joins the cluster (its own heartbeat is late, "
                             "e.g. after a database outage); requests are answered 503 until "
                             "it is live again", peer=peer_id, addr=address, status=e.status)
                    raise errors.PeerUnreachable(
                        peer_id, f"refused ({e.status}) while this replica re-joins the "
                        "cluster after its database connection was re-established; retry",
                        e) from e
                raise self._unreachable(peer_id, address, e) from e
            # A peer's certificate is a fact about that replica, never about a worker.
            log.error("peer link to replica {peer} at {addr}: its TLS certificate was refused "
                      "({why}; checked against {source}); check --peer-ca-file and that "
                      "replica's certificate", peer=peer_id, addr=address, why=why,
                      source=self._trust.source)
            raise errors.PeerUnreachable(
                peer_id, f"TLS certificate of {address} refused: {why}", e) from e
        if self._closed:
            session.loseConnection()
            raise errors.PoolClosed()
        log.info("peer link to replica {peer} at {addr} open", peer=peer_id, addr=address)
        old = self._sessions.get(peer_id)
        self._sessions[peer_id] = session
        self.bytes.watch(session)
        session.whenClosed().addCallback(lambda _: self._drop(peer_id, session))
        if old is not None and old is not session:
            old.loseConnection()
        return session

    async def _rejoining(self) -> bool:
        """Whether this replica's own ``instances`` row is missing or not live (or the
        database cannot say): then a peer's 401 is about our late heartbeat, not our
        configuration."""
        try:
            known = await peer_credential(self._db, self.instance_id, self._liveness)
        except Exception:
            return True
        return known is None or not known[1]

    @staticmethod
    def _unreachable(peer_id: str, address: str, e: Exception) -> Exception:
        """The error for a dial that failed for a reason other than a refused certificate."""
        if isinstance(e, HandshakeFailed):
            if e.status in (401, 403):
                log.error("peer link to replica {peer} at {addr} refused ({status}); this is "
                          + _CONFIG_HINT, peer=peer_id, addr=address, status=e.status)
                return errors.PeerRejected(peer_id, f"refused our credentials ({e.status}); "
                                           + _CONFIG_HINT, e)
            return errors.PeerUnreachable(peer_id, f"handshake with {address} failed: {e}", e)
        return errors.PeerUnreachable(peer_id, f"cannot connect to {address}: {e}", e)

    def _drop(self, peer_id: str, session: Session) -> None:
        if self._sessions.get(peer_id) is session:
            del self._sessions[peer_id]

    def close(self) -> None:
        """Shutdown: close every link; later opens fail with ``PoolClosed``."""
        self._closed = True
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.loseConnection()
        dials, self._dialing = list(self._dialing.values()), {}
        for dial in dials:
            dial.settle(Failure(errors.PoolClosed()))
