"""The worker's dial loop: hold one outbound tunnel (WebSocket + yamux) to the frontend.

:class:`TunnelDialer` dials ``<register-to>/api/cluster/connect?id=<node>`` (``http`` becomes
``ws``, ``https`` ``wss``; the path of ``--register-to`` is kept as a prefix) with
``Authorization: Bearer <tunnel credential>``, runs a yamux *client* session over it whose
acceptor serves the streams the frontend opens (``worker/streams.py``), and dials again when the
session ends.  The node id and credential are read through a callable on **every** dial, because
each registration rotates the credential; with no credential it does not dial at all and logs
"no tunnel credential yet".

Reconnecting uses equal-jitter backoff (ref §1.6): the d-th wait is ``d/2 + random[0, d/2]``
where ``d = min(30 s, 0.5 s * 2**attempt)``.  The attempt counter goes back to zero only after a
session that lasted at least :data:`STABLE_SESSION_SECONDS` (30 s): a frontend
that accepts and then drops the tunnel at once (a rolling restart, a replica that dies) does not
turn a thousand workers into a reconnect storm.

A refused dial keeps its HTTP status and is logged with a hint (401: the credential was rotated
or the node row replaced, so ``--node-name`` may not be unique; 403: pending approval; 404: the
frontend predates tunnels; 503: not in distributed mode), and every refusal is retried.  On 401
or 403 the ``reauthorize`` callable (a re-registration) is called at most once per backoff wait;
its new credential is used by the next dial.

Why not ``twisted.application.internet.ClientService``: it resets its failed-attempt count on
every successful connection, which is exactly the reconnect storm the 30-second rule exists to
prevent, and its retry policy sees only that count.  The loop also needs the refusal status
between attempts (to re-register), a credential read per dial, and a "do not dial yet" state,
so it is a small explicit state machine here (:class:`DialState`) with every timer on the
injected reactor.

What this module must never do: log the credential (only the node name and id appear); dial
with an empty credential; hold more than one session; keep dialling after ``stopService``; let
a session that opened after ``stopService`` survive; open a stream (the frontend is the only side
that opens streams).
"""

from __future__ import annotations

import enum
import math
import random
from typing import Callable
from urllib.parse import quote, urlsplit, urlunsplit

from twisted.application.service import Service
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.mux.session import Session, SessionConfig
from localai_tw.tunnel.keepalive import (
    LIVENESS_BY_TUNNEL,
    LIVENESS_HEADER,
    WORKER_PINGS,
    WORKER_PINGS_HEADER,
    tunnel_keepalive,
    tunnel_windows,
)
from localai_tw.tunnel.stampnotice import STAMP_NOTICES, STAMP_NOTICES_HEADER
from localai_tw.tunnel.websocket import HandshakeFailed, connectWebSocket

log = Logger()

#: The frontend's tunnel route, appended to the path of ``--register-to``.
CONNECT_PATH = "/api/cluster/connect"
#: Backoff floor, doubling per attempt up to the cap (seconds).
BACKOFF_BASE_SECONDS = 0.5
BACKOFF_CAP_SECONDS = 30.0
#: A session that lasted at least this long resets the attempt counter.
STABLE_SESSION_SECONDS = 30.0
#: Seconds ``stopService`` waits for the tunnel's connection to close before aborting it.
STOP_CLOSE_TIMEOUT_SECONDS = 5.0

#: Hints for a refused dial, by HTTP status.
REFUSAL_HINTS = {
    401: ("the frontend refused the tunnel credential: it was rotated by a newer registration "
          "or the node row was replaced; check that --node-name is unique in the cluster"),
    403: "the node is pending approval: an administrator must approve it",
    404: "the frontend has no tunnel route: it predates tunnels; upgrade it",
    409: "the frontend asked for another replica; dialling again",
    500: "the frontend failed (its database may be down); nothing is wrong with this worker",
    503: ("the frontend is not serving tunnels right now (it is starting or stopping, its "
          "database is not answering, or it does not run in distributed mode); dialling again"),
}
#: Statuses on which a re-registration may help (a fresh credential, or a status change).
REAUTHORIZE_STATUSES = frozenset({401, 403})


def websocket_url(register_to: str, node_id: str) -> str:
    """The tunnel URL for ``node_id``: ``register_to`` with ``http``->``ws``, ``https``->``wss``
    (``ws``/``wss`` kept), the connect path appended to its path, ``?id=<node>``."""
    parts = urlsplit(register_to.strip())
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme.lower(), parts.scheme.lower())
    if scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"--register-to must be an http, https, ws or wss URL with a host, "
                         f"not {register_to!r}")
    path = parts.path.rstrip("/") + CONNECT_PATH
    return urlunsplit((scheme, parts.netloc, path, "id=" + quote(node_id, safe=""), ""))


def backoff_ceiling(attempt: int, base: float = BACKOFF_BASE_SECONDS,
                    cap: float = BACKOFF_CAP_SECONDS) -> float:
    """``min(cap, base * 2**attempt)``, with the exponent bounded so a huge attempt count never
    overflows (it only ever means "the cap")."""
    if attempt <= 0:
        return min(cap, base)
    ceiling_exponent = max(0, math.ceil(math.log2(cap / base))) + 1 if base > 0 else 0
    return min(cap, base * 2.0 ** min(attempt, ceiling_exponent))


def equal_jitter_delay(attempt: int, random_fraction: float, base: float = BACKOFF_BASE_SECONDS,
                       cap: float = BACKOFF_CAP_SECONDS) -> float:
    """The wait before retry number ``attempt`` (0-based): ``d/2 + random_fraction * d/2`` with
    ``d = backoff_ceiling(attempt)``; ``random_fraction`` in [0, 1]."""
    d = backoff_ceiling(attempt, base, cap)
    fraction = min(1.0, max(0.0, random_fraction))
    return d / 2 + fraction * d / 2


def refusal_hint(status: int | None) -> str:
    """What a refused dial with ``status`` means for the operator."""
    if status is None:
        return "no HTTP answer (frontend down or unreachable, or the handshake timed out)"
    return REFUSAL_HINTS.get(status, f"unexpected HTTP status {status}")


class DialState(enum.Enum):
    STOPPED = "stopped"
    NO_CREDENTIAL = "no-credential"  # waiting for a registration to supply one
    DIALING = "dialing"
    CONNECTED = "connected"
    BACKING_OFF = "backing-off"


def worker_session_config() -> SessionConfig:
    """The worker's end of its tunnel: the tunnel keepalive (``keepalive.py``), so a silent
    carrier is dropped and redialled within 10 s instead of 40, and receive windows that grow
    toward the link's bandwidth-delay product (staging over a long link), at most 64 MiB in
    all above the 256 KiB base per stream."""
    return SessionConfig(**tunnel_keepalive(worker=True), **tunnel_windows())


#: ``credentials() -> (node_id, tunnel_credential)`` or None before the first registration.
CredentialSource = Callable[[], "tuple[str, str] | None"]


class _TunnelSession(Session):
    """The worker's session; adds a Deferred firing when the carrying connection is gone (the
    session itself ends earlier, when it closes), so a stop can wait for the socket."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.carrier_lost: defer.Deferred = defer.Deferred()

    def connectionLost(self, reason=None) -> None:
        super().connectionLost(reason)
        if not self.carrier_lost.called:
            self.carrier_lost.callback(None)


class TunnelDialer(Service):
    """Holds one tunnel session to the frontend and redials it, with backoff, until stopped.

    ``register_to``: the ``--register-to`` URL.  ``credentials()``: the current
    ``(node_id, credential)`` or None, read on every dial.  ``acceptor_factory()``: a new
    acceptor (``acceptor(stream) -> protocol``) for each session.  ``reauthorize()``: called on
    a 401/403 refusal, at most once per backoff wait (may return a Deferred; failures are
    logged).  ``connect``: the WebSocket dialler (``connectWebSocket``), replaceable for tests.
    ``random_fraction()``: the jitter source, a float in [0, 1).  ``takes_stamp_notices``: the
    acceptor serves ``stamped`` streams; the upgrade says so (``tunnel/stampnotice.py``).
    """

    name = "tunnel-dialer"

    def __init__(
        self,
        reactor,
        register_to: str,
        credentials: CredentialSource,
        acceptor_factory: Callable[[], Callable],
        *,
        reauthorize: Callable[[], object] | None = None,
        node_name: str = "",
        session_config: Callable[[], SessionConfig] = worker_session_config,
        connect: Callable[..., defer.Deferred] = connectWebSocket,
        random_fraction: Callable[[], float] = random.random,
        base_delay: float = BACKOFF_BASE_SECONDS,
        max_delay: float = BACKOFF_CAP_SECONDS,
        stable_after: float = STABLE_SESSION_SECONDS,
        takes_stamp_notices: bool = False,
    ):
        websocket_url(register_to, "probe")  # a bad URL is a configuration error: fail now
        self._reactor = reactor
        self._register_to = register_to
        self._credentials = credentials
        self._acceptor_factory = acceptor_factory
        self._reauthorize = reauthorize
        self.node_name = node_name
        self._session_config = session_config
        self._connect = connect
        self._random_fraction = random_fraction
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._stable_after = stable_after
        self._upgrade_headers = ({STAMP_NOTICES_HEADER: STAMP_NOTICES} if takes_stamp_notices
                                 else {})

        self.state = DialState.STOPPED
        #: Consecutive attempts since the last stable session; the next wait is computed from it.
        self.attempt = 0
        self.session: Session | None = None
        self.session_node_id: str | None = None
        self.last_error: str = "not started"
        self.last_status: int | None = None
        #: Every wait scheduled, in seconds (for observation; bounded).
        self.delays: list[float] = []
        self._connected_at: float | None = None
        self._wait_call = None
        self._dialing: defer.Deferred | None = None
        self._dial_generation = 0
        self._reauthorizing: defer.Deferred | None = None
        self._no_credential_logged = False

    # -- observation ------------------------------------------------------------------------

    @property
    def isConnected(self) -> bool:
        return self.state is DialState.CONNECTED and self.session is not None and \
            self.session.isOpen

    @property
    def livenessByTunnel(self) -> bool:
        """A tunnel is held and its replica said, in the upgrade's answer, that it stamps this
        node's heartbeat while the tunnel is up (``cluster/liveness.py``): the HTTP heartbeat
        may then carry only capacity changes (``worker/service.py``)."""
        if not self.isConnected:
            return False
        headers = getattr(self.session.transport, "answer_headers", None) or {}
        return headers.get(LIVENESS_HEADER.lower()) == LIVENESS_BY_TUNNEL

    def readiness(self) -> str | None:
        """None when a tunnel session is held, else why not (for ``/readyz``)."""
        if self.isConnected:
            return None
        if self.state is DialState.NO_CREDENTIAL:
            return "no tunnel credential yet (not registered)"
        return f"tunnel not connected ({self.state.value}): {self.last_error}"

    # -- Service ------------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.attempt = 0
        self._dial()

    def stopService(self) -> defer.Deferred:
        super().stopService()
        self.state = DialState.STOPPED
        self._dial_generation += 1  # a dial in flight may no longer install its session
        if self._wait_call is not None and self._wait_call.active():
            self._wait_call.cancel()
        self._wait_call = None
        dialing, self._dialing = self._dialing, None
        if dialing is not None:
            dialing.cancel()
        session, self.session = self.session, None
        if session is None:
            return defer.succeed(None)
        session.loseConnection()
        return self._awaitCarrier(session)

    def _awaitCarrier(self, session: Session) -> defer.Deferred:
        carrier_lost = getattr(session, "carrier_lost", None)
        if carrier_lost is None or carrier_lost.called:
            return defer.succeed(None)
        waiting: defer.Deferred = defer.Deferred()
        carrier_lost.addBoth(lambda _: waiting.called or waiting.callback(None))

        def too_slow():
            if not waiting.called:
                session.abort("the tunnel did not close in time")
                transport = session.transport
                if transport is not None and hasattr(transport, "abortConnection"):
                    transport.abortConnection()
                waiting.callback(None)

        timer = self._reactor.callLater(STOP_CLOSE_TIMEOUT_SECONDS, too_slow)
        waiting.addBoth(lambda r: (timer.cancel() if timer.active() else None, r)[1])
        return waiting

    # -- the loop -----------------------------------------------------------------------------

    def credentialsChanged(self) -> None:
        """A registration produced a new node id or credential.  Waiting for a credential: dial
        now.  Connected under another node id (the node row was replaced): drop that session so
        the loop dials with the new id.  Otherwise the next dial reads the new credential."""
        if not self.running:
            return
        if self.state is DialState.NO_CREDENTIAL:
            self._cancelWait()
            self._dial()
            return
        current = self._readCredentials()
        if (self.state is DialState.CONNECTED and current is not None
                and self.session_node_id is not None and current[0] != self.session_node_id):
            log.info("node {name} is now registered as {new_id} (was {old_id}); redialling",
                     name=self.node_name, new_id=current[0], old_id=self.session_node_id)
            if self.session is not None:
                self.session.loseConnection()

    def _readCredentials(self) -> tuple[str, str] | None:
        try:
            current = self._credentials()
        except Exception:
            log.failure("reading the tunnel credential failed")
            return None
        if not current or not current[0] or not current[1]:
            return None
        return current

    def _dial(self) -> None:
        if not self.running:
            return
        current = self._readCredentials()
        if current is None:
            self.state = DialState.NO_CREDENTIAL
            self.last_error = "no tunnel credential yet"
            if not self._no_credential_logged:
                self._no_credential_logged = True
                log.info("node {name}: no tunnel credential yet; not dialling until "
                         "registration supplies one", name=self.node_name)
            return
        self._no_credential_logged = False
        node_id, credential = current
        url = websocket_url(self._register_to, node_id)
        self.state = DialState.DIALING
        self._dial_generation += 1
        generation = self._dial_generation

        def build_session():
            if generation != self._dial_generation or not self.running:
                return None  # this dial was abandoned (stopService): drop the WebSocket
            return _TunnelSession(client=True, config=self._session_config(),
                                  acceptor=self._acceptor_factory(), reactor=self._reactor)

        try:
            dialing = self._connect(self._reactor, url, build_session,
                                    {"Authorization": f"Bearer {credential}",
                                     WORKER_PINGS_HEADER: WORKER_PINGS,
                                     **self._upgrade_headers})
        except Exception as e:
            dialing = defer.fail(e)
        self._dialing = dialing
        dialing.addCallbacks(self._connected, self._dialFailed,
                             callbackArgs=(node_id, generation),
                             errbackArgs=(node_id, generation))
        dialing.addErrback(lambda f: log.failure("the tunnel dial loop failed", f))

    def _connected(self, session: Session, node_id: str, generation: int) -> None:
        if generation != self._dial_generation or not self.running:
            session.loseConnection()
            return
        self._dialing = None
        self.session = session
        self.session_node_id = node_id
        self.state = DialState.CONNECTED
        self.last_error = ""
        self.last_status = None
        self._connected_at = self._reactor.seconds()
        log.info("tunnel connected: node {name} ({node_id})", name=self.node_name,
                 node_id=node_id)
        session.whenClosed().addCallback(self._sessionEnded, session, node_id)

    def _dialFailed(self, failure: Failure, node_id: str, generation: int) -> None:
        if generation != self._dial_generation or not self.running:
            return  # cancelled by stopService
        self._dialing = None
        status = failure.value.status if isinstance(failure.value, HandshakeFailed) else None
        self.last_status = status
        detail = _describe(failure)
        self.last_error = f"dial refused (HTTP {status}): {detail}" if status else \
            f"dial failed: {detail}"
        log.warn("tunnel dial for node {name} ({node_id}) failed{status_text}: {detail}; "
                 "{hint}", name=self.node_name, node_id=node_id,
                 status_text=f" with HTTP {status}" if status else "", detail=detail,
                 hint=refusal_hint(status))
        self._backOff(reauthorize=status in REAUTHORIZE_STATUSES)

    def _sessionEnded(self, reason, session: Session, node_id: str) -> None:
        if self.session is not session:
            return  # stopService took it
        self.session = None
        self.session_node_id = None
        lasted = self._reactor.seconds() - (self._connected_at or self._reactor.seconds())
        self._connected_at = None
        if lasted >= self._stable_after:
            self.attempt = 0
        self.last_error = f"session ended: {reason}"
        log.info("tunnel disconnected: node {name} ({node_id}) after {lasted:.1f}s: {reason}",
                 name=self.node_name, node_id=node_id, lasted=lasted, reason=str(reason))
        if self.running:
            self._backOff(reauthorize=False)

    def _backOff(self, reauthorize: bool) -> None:
        delay = equal_jitter_delay(self.attempt, self._random_fraction(), self._base_delay,
                                   self._max_delay)
        self.attempt += 1
        self.state = DialState.BACKING_OFF
        self.delays.append(delay)
        del self.delays[:-64]
        log.info("tunnel for node {name}: backing off {delay:.2f}s (attempt {attempt})",
                 name=self.node_name, delay=delay, attempt=self.attempt)
        self._wait_call = self._reactor.callLater(delay, self._waitOver)
        if reauthorize:
            self._startReauthorize()

    def _waitOver(self) -> None:
        self._wait_call = None
        self._dial()

    def _cancelWait(self) -> None:
        if self._wait_call is not None and self._wait_call.active():
            self._wait_call.cancel()
        self._wait_call = None

    def _startReauthorize(self) -> None:
        """Re-register once for this wait; one already running counts as this wait's."""
        if self._reauthorize is None or self._reauthorizing is not None:
            return
        log.info("node {name}: re-registering to obtain a fresh tunnel credential",
                 name=self.node_name)
        reauthorizing = defer.maybeDeferred(self._reauthorize)
        self._reauthorizing = reauthorizing

        def done(result):
            self._reauthorizing = None
            if isinstance(result, Failure):
                log.warn("node {name}: re-registration failed: {error}; still backing off",
                         name=self.node_name, error=_describe(result))

        reauthorizing.addBoth(done)


def _describe(failure: Failure) -> str:
    value = failure.value
    text = str(value) or type(value).__name__
    return text[:300]
