"""What the worker does with each stream the frontend opens on its tunnel session.

The worker is the yamux client and only *accepts* streams.  Every stream starts with one request
frame (``"<tag> <target>"``, see :mod:`localai_tw.tunnel.preamble`) and the worker always answers
with one reply frame before the carried protocol starts:

- ``http``: the worker's own control plane.  Answer ``ok`` and hand the stream to the control
  ``Site`` (:func:`~localai_tw.worker.httpserve.serve_http_on_transport`); the target is ignored.
- ``grpc``: a backend process.  Keep only the port of the target (the host is thrown away: the
  frontend can never make the worker connect anywhere but loopback), refuse a port outside the
  backend port range with ``bad-request``, connect to ``127.0.0.1:<port>``, answer ``ok`` and
  splice the stream with the connection; bytes that followed the frame go to the backend first.
- ``call``: one backend call in frames (``backends/callframes.py``): the port is checked as for
  ``grpc``; with no live backend on it the stream is refused ``unavailable`` (what the loopback
  connect of ``grpc`` answers then), else ``ok`` and the stream goes to
  :class:`~localai_tw.worker.backendcalls.CallStreamProtocol`, which makes the call with the
  worker's own client of that backend.
- ``stamped``: the replica's stamp notices (``tunnel/stampnotice.py``): answer ``ok`` and hand
  every later frame to ``on_stamped``; refused ``unknown-tag`` when nothing takes them.
- any other tag: ``unknown-tag``.

A frame that does not arrive within :data:`HEADER_TIMEOUT_SECONDS` is answered ``not-served``
(never ``bad-request``: it may be late behind a relay); a malformed frame ``bad-request``.  A
local connect failure is classified by :func:`classify_local_dial_error`: refused, unreachable or
reset is ``unavailable`` (evidence that the backend is not there); resource exhaustion, permission
problems and timeouts are ``not-served`` (the worker learned nothing).  **Anything unrecognised is
``unavailable``**, deliberately (the A-late Go behaviour): an error nobody foresaw usually means
the backend is not there, and answering ``not-served`` would leave a dead backend's
``node_models`` row in place forever, since only evidence may reap it.  The cost is that an
exotic local fault may reap a row that a later load restores.

What this module must never do:

- connect anywhere but ``127.0.0.1``, or to a port outside the backend range;
- read past the request frame before deciding (the bytes after it belong to HTTP or gRPC), or
  buffer without bound while the backend connection is being made (the stream is paused);
- let one stream's failure touch the session or another stream: an exception is logged and that
  stream alone is reset;
- leave a stream unanswered: every stream gets exactly one reply frame, or a reset.
"""

from __future__ import annotations

import enum
import errno
from typing import Callable

from twisted.internet import defer, error
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw import errors
from localai_tw.config import PortRange
from localai_tw.logs import RateLimitedLog
from localai_tw.splice import HandoffProtocol, Splice
from localai_tw.tunnel import preamble
from localai_tw.tunnel.stampnotice import NoticeReader
from localai_tw.web.sockets import set_no_delay
from localai_tw.worker.backendcalls import BackendCalls, CallStreamProtocol
from localai_tw.worker.httpserve import serve_http_on_transport

log = Logger()

#: Seconds the frontend has to deliver the request frame after opening a stream.
HEADER_TIMEOUT_SECONDS = 15.0
#: Seconds a connect to a loopback backend may take before it is answered ``not-served``.
BACKEND_CONNECT_TIMEOUT_SECONDS = 10.0
#: The only host a ``grpc`` stream is ever connected to.
BACKEND_HOST = "127.0.0.1"
#: Bytes read past the frame while the backend connection is being made.  The stream is paused
#: then, so only what already arrived with the frame is held; this bound is a backstop.
MAX_HELD_BYTES = 512 * 1024

_MAX_PORT_DIGITS = 5


# -- pure decisions ---------------------------------------------------------------------------

#: errno values that are a statement about the target: it is not listening or not reachable.
UNAVAILABLE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ECONNREFUSED", "EHOSTUNREACH", "ENETUNREACH", "ECONNRESET")
    if hasattr(errno, name))
#: errno values that say nothing about the target: this machine ran out of something, or may
#: not connect at all.
NOT_SERVED_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EMFILE", "ENFILE", "ENOBUFS", "ENOMEM", "EADDRNOTAVAIL",
                                      "EACCES", "EPERM", "ETIMEDOUT")
    if hasattr(errno, name))


def classify_errno(number: int | None) -> str | None:
    """The refusal code an errno of a local connect maps to, or None when it is not one of the
    classified values."""
    if number in UNAVAILABLE_ERRNOS:
        return preamble.UNAVAILABLE
    if number in NOT_SERVED_ERRNOS:
        return preamble.NOT_SERVED
    return None


def _errno_of(exc: BaseException) -> int | None:
    if isinstance(exc, error.ConnectError) and isinstance(exc.osError, int):
        return exc.osError
    number = getattr(exc, "errno", None)
    return number if isinstance(number, int) else None


def classify_local_dial_error(failure: Failure | BaseException) -> str:
    """The refusal code for a failed connect to a local backend.

    Timeouts and cancellations are ``not-served`` (nothing learned).  Then the errno decides
    (:func:`classify_errno`), then Twisted's own classes for refused/unreachable/reset.
    Anything unrecognised is ``unavailable``, deliberately (see the module docstring).
    """
    exc = failure.value if isinstance(failure, Failure) else failure
    if isinstance(exc, (error.TimeoutError, error.TCPTimedOutError, defer.TimeoutError,
                        defer.CancelledError, TimeoutError)):
        return preamble.NOT_SERVED
    code = classify_errno(_errno_of(exc))
    if code is not None:
        return code
    if isinstance(exc, (error.ConnectionRefusedError, error.NoRouteError,
                        error.ConnectionLost)):
        return preamble.UNAVAILABLE
    return preamble.UNAVAILABLE


class BadTarget(ValueError):
    """A ``grpc`` target the worker will not connect to; answered ``bad-request``."""


def port_of_target(target: str) -> int:
    """The port of ``host:port`` or ``[v6]:port``; the host is discarded unread.  Raises
    :class:`BadTarget` for anything else, including a port that is not 1-65535 in decimal."""
    host, colon, port_text = target.rpartition(":")
    if not colon:
        raise BadTarget(f"target {target[:64]!r} is not host:port")
    if host.startswith("[") != host.endswith("]"):
        raise BadTarget(f"target {target[:64]!r} has an unbalanced IPv6 bracket")
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > _MAX_PORT_DIGITS:
        raise BadTarget(f"target {target[:64]!r} has no decimal port")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise BadTarget(f"port {port} is outside 1-65535")
    return port


def backend_port(target: str, backend_ports: PortRange) -> int:
    """The loopback port a ``grpc`` stream for ``target`` goes to: its port, which must be
    inside ``backend_ports``.  Raises :class:`BadTarget` otherwise."""
    port = port_of_target(target)
    if port not in backend_ports:
        raise BadTarget(f"port {port} is outside the backend port range {backend_ports}")
    return port


# -- the per-stream protocol ----------------------------------------------------------------------

#: ``connect_backend(port, protocol) -> Deferred[protocol]``: connect ``protocol`` to a loopback
#: backend port.
BackendConnector = Callable[[int, object], defer.Deferred]


class StreamPhase(enum.Enum):
    READING_FRAME = "reading-frame"
    CONNECTING = "connecting-backend"  # grpc: waiting for the loopback connect
    CARRYING = "carrying"              # answered ok and handed over
    REFUSED = "refused"                # answered err, closing
    FAILED = "failed"                  # reset after an internal error
    LOST = "lost"                      # the stream ended before a hand-off


class _SiteOnStream:
    """Builds the control site's HTTP protocol when the hand-off connects it to the stream.
    :func:`serve_http_on_transport` connects the channel itself, so this adapter calls it from
    ``makeConnection`` and forwards every later event to what it returned."""

    def __init__(self, site):
        self._site = site
        self._http = None

    def makeConnection(self, transport) -> None:
        self._http = serve_http_on_transport(self._site, transport)

    def dataReceived(self, data: bytes) -> None:
        self._http.dataReceived(data)

    def connectionLost(self, reason) -> None:
        self._http.connectionLost(reason)


class WorkerStreamProtocol(HandoffProtocol):
    """One inbound tunnel stream on the worker: reads the request frame, answers it, hands the
    stream to the control site or splices it to a backend."""

    def __init__(self, router: StreamRouter):
        self.router = router
        self.phase = StreamPhase.READING_FRAME
        self.request: preamble.StreamRequest | None = None
        self.splice: Splice | None = None
        self._reader = preamble.FrameReader()
        self._header_timer = None
        self._connecting: defer.Deferred | None = None
        self._held: list[bytes] = []
        self._held_size = 0
        self._eof_held = False

    def __repr__(self) -> str:
        stream_id = getattr(self.transport, "id", "?")
        return f"<WorkerStream {stream_id} {self.phase.value}>"

    # -- HandoffProtocol ---------------------------------------------------------------------

    def connectionMade(self) -> None:
        self._header_timer = self.router.reactor.callLater(
            self.router.header_timeout, self._headerTimedOut)

    def preludeReceived(self, data: bytes) -> None:
        if self.phase is StreamPhase.READING_FRAME:
            self._readFrame(data)
        elif self.phase is StreamPhase.CONNECTING:
            self._hold(data)
        # REFUSED / FAILED: the stream is closing; its bytes are dropped.

    def preludeLost(self, reason: Failure) -> None:
        self._cancelHeaderTimer()
        previous, self.phase = self.phase, StreamPhase.LOST
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
        if self.splice is not None:
            self.splice.abandon(f"the tunnel stream ended while connecting: "
                                f"{reason.getErrorMessage()}")
        if previous in (StreamPhase.READING_FRAME, StreamPhase.CONNECTING):
            log.debug("tunnel stream {stream} ended before it was served: {why}",
                      stream=self, why=reason.getErrorMessage())

    # -- reading and answering the frame ------------------------------------------------------------

    def _readFrame(self, data: bytes) -> None:
        try:
            payload, leftover = self._reader.feed(data)
        except errors.TunnelProtocolError as e:
            self._refuse(preamble.BAD_REQUEST, str(e))
            return
        if payload is None:
            return
        self._cancelHeaderTimer()
        try:
            request = preamble.parse_request(payload)
        except errors.TunnelProtocolError as e:
            self._refuse(preamble.BAD_REQUEST, str(e))
            return
        self.request = request
        self._dispatch(request, leftover)

    def _dispatch(self, request: preamble.StreamRequest, leftover: bytes) -> None:
        try:
            if request.tag == preamble.TAG_HTTP:
                self._serveControl(leftover)
            elif request.tag == preamble.TAG_GRPC:
                self._connectBackend(request.target, leftover)
            elif request.tag == preamble.TAG_CALL:
                self._serveCall(request.target, leftover)
            elif request.tag == preamble.TAG_STAMPED and self.router.on_stamped is not None:
                self._serveStampNotices(leftover)
            else:
                self._refuse(preamble.UNKNOWN_TAG,
                             f"this worker does not serve tag {request.tag[:64]!r}")
        except Exception:
            self._fail("dispatching the stream failed", Failure())

    def _headerTimedOut(self) -> None:
        self._header_timer = None
        if self.phase is StreamPhase.READING_FRAME:
            self._refuse(preamble.NOT_SERVED,
                         f"request frame not received within {self.router.header_timeout:g}s")

    def _cancelHeaderTimer(self) -> None:
        timer, self._header_timer = self._header_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _refuse(self, code: str, text: str) -> None:
        self._cancelHeaderTimer()
        self.phase = StreamPhase.REFUSED
        if self.router.refusals.allow(code):
            log.info("refused tunnel stream {stream} ({request}): {code} {text}", stream=self,
                     request=self._describeRequest(), code=code, text=text)
        self.transport.write(preamble.encode_refused(code, text))
        self.transport.loseConnection()

    def _fail(self, what: str, failure: Failure | None = None) -> None:
        """An internal error: log it and reset this stream only."""
        log.failure("{what} on tunnel stream {stream}; resetting it", failure, what=what,
                    stream=self)
        self._cancelHeaderTimer()
        self.phase = StreamPhase.FAILED
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
        if self.splice is not None:
            self.splice.abandon(what)
        abort = getattr(self.transport, "abortConnection", None)
        if abort is not None:
            abort()
        else:
            self.transport.loseConnection()

    def _describeRequest(self) -> str:
        if self.request is None:
            return "no request"
        return f"{self.request.tag} {self.request.target[:64]}"

    # -- http ---------------------------------------------------------------------------------------

    def _serveControl(self, leftover: bytes) -> None:
        self.phase = StreamPhase.CARRYING
        self.transport.write(preamble.encode_accepted())
        self.handOff(_SiteOnStream(self.router.control_site), leftover)

    # -- stamped ------------------------------------------------------------------------------------

    def _serveStampNotices(self, leftover: bytes) -> None:
        self.phase = StreamPhase.CARRYING
        self.transport.write(preamble.encode_accepted())
        self.handOff(NoticeReader(self.router.on_stamped), leftover)

    # -- grpc ---------------------------------------------------------------------------------------

    def _connectBackend(self, target: str, leftover: bytes) -> None:
        try:
            port = backend_port(target, self.router.backend_ports)
        except BadTarget as e:
            self._refuse(preamble.BAD_REQUEST, str(e))
            return
        self.phase = StreamPhase.CONNECTING
        # Nothing more is read from the stream until the backend is there: the peer's window
        # bounds what it can send meanwhile.
        self.transport.pauseProducing()
        self._hold(leftover)
        self.splice = Splice()
        connecting = self.router.connect_backend(port, self.splice.b)
        self._connecting = connecting
        connecting.addCallbacks(self._backendConnected, self._backendFailed,
                                callbackArgs=(port,), errbackArgs=(port,))
        connecting.addErrback(self._internalError, "answering the backend connect")

    # -- call -----------------------------------------------------------------------------------

    def _serveCall(self, target: str, leftover: bytes) -> None:
        try:
            port = backend_port(target, self.router.backend_ports)
        except BadTarget as e:
            self._refuse(preamble.BAD_REQUEST, str(e))
            return
        calls = self.router.backend_calls
        client = calls.client_for(port) if calls is not None else None
        if client is None:
            # What the grpc path's loopback connect answers when nothing listens there.
            self._refuse(preamble.UNAVAILABLE, f"connecting to {BACKEND_HOST}:{port} failed: "
                                               "no backend process listens on that port")
            return
        self.phase = StreamPhase.CARRYING
        self.transport.write(preamble.encode_accepted())
        self.handOff(CallStreamProtocol(calls, client, port), leftover)

    def _hold(self, data: bytes) -> None:
        if not data:
            return
        self._held_size += len(data)
        if self._held_size > MAX_HELD_BYTES:
            raise ValueError(f"more than {MAX_HELD_BYTES} bytes arrived while connecting")
        self._held.append(data)

    def _backendConnected(self, _protocol, port: int) -> None:
        self._connecting = None
        if self.phase is not StreamPhase.CONNECTING:
            return  # the stream ended meanwhile; preludeLost abandoned the splice
        # What waited in the stream comes in now and is held (bounded by the stream window),
        # so the splice gets it as leftover; resuming only after the hand-off could undo a
        # pause the splice itself asked for.
        self.transport.resumeProducing()
        if self.phase is not StreamPhase.CONNECTING:
            return  # holding failed and the stream was reset
        self.phase = StreamPhase.CARRYING
        self.transport.write(preamble.encode_accepted())
        held, self._held = b"".join(self._held), []
        splice = self.splice
        self.handOff(splice.a, held)
        if self._eof_held:
            super().readConnectionLost()
        splice.whenDone().addCallback(self._spliceDone, port)

    def readConnectionLost(self) -> None:
        if self.delegate is None and self.phase is StreamPhase.CONNECTING:
            # The peer half-closed right after its frame (and data): the backend still gets
            # the request, and the EOF, once it is connected.
            self._eof_held = True
            return
        super().readConnectionLost()

    def _internalError(self, failure: Failure, what: str) -> None:
        self._fail(f"{what} failed", failure)

    def _backendFailed(self, failure: Failure, port: int) -> None:
        self._connecting = None
        if self.phase is not StreamPhase.CONNECTING:
            return  # cancelled because the stream ended
        code = classify_local_dial_error(failure)
        self._held = []
        self._refuse(code, f"connecting to {BACKEND_HOST}:{port} failed: "
                           f"{failure.getErrorMessage()}")

    def _spliceDone(self, ending, port: int) -> None:
        if ending.normal:
            log.debug("tunnel stream {stream} to backend port {port} ended", stream=self,
                      port=port)
        else:
            log.info("tunnel stream {stream} to backend port {port} ended by a transport "
                     "failure: {cause}", stream=self, port=port, cause=ending.cause)


# -- the acceptor -----------------------------------------------------------------------------------


class StreamRouter:
    """The acceptor of the worker's yamux session: ``router.acceptor(stream)`` (or
    ``router(stream)``) returns a fresh :class:`WorkerStreamProtocol` for every inbound stream.

    ``control_site`` serves ``http`` streams; ``backend_ports`` bounds ``grpc`` targets;
    ``connect_backend`` (default: TCP to ``127.0.0.1``) is replaceable for tests.
    """

    def __init__(
        self,
        control_site,
        backend_ports: PortRange,
        reactor=None,
        *,
        connect_backend: BackendConnector | None = None,
        backend_calls: BackendCalls | None = None,
        header_timeout: float = HEADER_TIMEOUT_SECONDS,
        connect_timeout: float = BACKEND_CONNECT_TIMEOUT_SECONDS,
    ):
        if reactor is None:
            from twisted.internet import reactor
        self.control_site = control_site
        self.backend_ports = backend_ports
        self.reactor = reactor
        self.header_timeout = header_timeout
        self.connect_timeout = connect_timeout
        self.connect_backend = connect_backend or self._connectLoopback
        #: the backends ``call`` streams reach (set once the supervisor exists; None on an
        #: agent worker, whose ``call`` streams are all refused ``unavailable``)
        self.backend_calls = backend_calls
        #: ``on_stamped(status)`` for each stamp notice of the replica (``tunnel/stampnotice.py``;
        #: set by the worker's wiring); None: ``stamped`` streams are refused ``unknown-tag``
        self.on_stamped: Callable[[str], None] | None = None
        #: A frontend opening stream after stream that is refused gets a few lines and a count.
        self.refusals = RateLimitedLog(
            "refused {count} tunnel streams with {source} in the last {seconds:g} s "
            "({suppressed} of them not logged one by one)", clock=reactor)

    def _connectLoopback(self, port: int, protocol) -> defer.Deferred:
        endpoint = TCP4ClientEndpoint(self.reactor, BACKEND_HOST, port,
                                      timeout=self.connect_timeout)

        def connected(protocol):
            # The gRPC requests and their flow-control frames are small writes (the backend's
            # own gRPC server sets TCP_NODELAY on its side); fires before the first write
            # leaves, since Twisted sends on the next reactor iteration.
            set_no_delay(protocol.transport)
            return protocol

        return connectProtocol(endpoint, protocol).addCallback(connected)

    def acceptor(self, stream) -> WorkerStreamProtocol:
        return WorkerStreamProtocol(self)

    __call__ = acceptor
