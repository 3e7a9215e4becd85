"""The WebSocket carrier: run a byte-stream protocol (a yamux session) over WebSocket binary
messages, with Autobahn at both ends.

Two entry points:

- :class:`TunnelWebSocketResource`, a ``twisted.web`` resource mountable at any path, which
  decides authorization *before* the upgrade (a refused dial gets a plain HTTP response such as
  401, never a WebSocket error) and then runs the inner protocol built by
  ``protocol_factory(request, authorization)`` over the upgraded connection;
- :func:`connectWebSocket`, the dialling side, which fires with the inner protocol once the
  WebSocket is open or fails with :class:`HandshakeFailed` keeping the HTTP status of a refusal.

The inner protocol sees a :class:`WebSocketCarrier` as its transport: the writes made in one
reactor turn may be coalesced into one binary message (bounded by ``coalesce_bytes`` and by the
message bound; a write larger than the message bound is split into several, which is harmless
since the receiver treats messages as a byte stream); the bytes keep their order, and whatever is
held goes out before the end of the reactor turn, before any frame Autobahn sends itself (close,
pong) and before our close; inbound messages are delivered as a byte stream
with no alignment to the inner protocol's frames; zero-length messages are skipped; a text
message ends the connection as a protocol error.  A peer close with code normal (1000),
going-away (1001) or no status ends the inner protocol with ``ConnectionDone``; anything else
(including a dropped TCP connection, 1006) with ``ConnectionLost`` carrying the detail.

Backpressure goes through both ways (see ``docs/tunnel.md``): the TCP transport's write buffer
pauses the producer the inner protocol registered with the carrier, and the inner protocol
pausing the carrier stops reading from TCP.

Plain binary frames are built and parsed by the codec mixed into the carrier's protocols
(``tunnel/wsframes.py``); every use of Autobahn's internals goes through
``tunnel/autobahn_compat.py``.

What this module must never do: upgrade a request its authorizer did not accept; accept a message
or frame above the bound (Autobahn enforces it and fails the connection); buffer inbound data
without bound while the inner protocol is paused; let a text message reach the byte stream.  It
knows nothing of nodes, tokens in a database or yamux: those are the caller's factory and
authorizer.

One module of about 760 lines, because both entry points build the same carrier around
Autobahn's protocols, and the carrier's write coalescing, backpressure and close ordering are
one contract with the two protocol classes that feed it; the frame codec (``wsframes.py``) and
Autobahn's private names (``autobahn_compat.py``) are already apart.
"""

from __future__ import annotations

from typing import Any, Callable
from urllib.parse import urlsplit

from autobahn.twisted.websocket import (
    WebSocketClientFactory,
    WebSocketClientProtocol,
    WebSocketServerFactory,
    WebSocketServerProtocol,
)
from twisted.internet import defer, endpoints, error
from twisted.internet.interfaces import IConsumer, IPushProducer, ITransport
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper
from twisted.protocols.tls import TLSMemoryBIOProtocol
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from zope.interface import Interface, implementer

from localai_tw.tunnel import autobahn_compat as ab
from localai_tw.web.sockets import (
    set_no_delay,
    set_not_sent_lowat,
    set_read_size,
    set_write_through,
)
from localai_tw.tunnel.wsframes import FastBinaryFrames
from localai_tw.web import auth

_log = Logger()

#: Largest WebSocket message (and frame) accepted or sent.  A yamux data frame is at most one
#: window (256 KiB by default) plus its 12-byte header, so 1 MiB leaves room for larger windows.
#: Peers configured with windows beyond this must raise the bound on both ends.
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024 + 64 * 1024

#: The carrier coalesces the writes of one reactor turn into one binary message of at most this
#: many bytes (a 64 KiB yamux frame per message made Autobahn's fixed per-message cost a large
#: share of the per-byte cost).  Reaching it flushes at once, so this (or the message bound, if
#: smaller) is all the carrier ever holds; the TCP transport's buffer then pauses the producer.
DEFAULT_COALESCE_BYTES = 256 * 1024

#: Pongs Autobahn writes in answer to the peer's pings while the TCP write buffer is above its
#: high-water mark (the peer is not reading): past the first figure the carrier stops reading
#: until the buffer drains, past the second it drops the connection.  A peer that pings without
#: reading would otherwise grow our write buffer without bound.
PONG_HIGH_WATER = 16 * 1024
PONG_CAP = 64 * 1024

#: Upgrade answer headers a dialler keeps for its carrier (``WebSocketCarrier.answer_headers``):
#: only these names, at most this many, each value cut to this length.
ANSWER_HEADER_PREFIX = "x-localai-"
MAX_ANSWER_HEADERS = 8
MAX_ANSWER_HEADER_CHARS = 64

#: Seconds allowed for the opening handshake (the Go worker's dialer uses 10 s).
DEFAULT_HANDSHAKE_TIMEOUT = 10.0

#: Close codes that mean the peer ended the connection on purpose: normal, going away, and a
#: close frame with no status (Autobahn reports that as ``None``; 1005 on the wire is reserved).
CLEAN_CLOSE_CODES = frozenset({1000, 1001, 1005, None})


# -- authorization -----------------------------------------------------------------------------


class ConnectRefused(Exception):
    """An authorizer's refusal: the dial gets a plain HTTP response with ``status``."""

    def __init__(self, status: int, message: str = "", headers: dict[str, str] | None = None):
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        super().__init__(f"{status} {message}")


class IConnectAuthorizer(Interface):
    """Decides, from the upgrade request alone, whether a dial may become a WebSocket."""

    def authorize(request):
        """Return (or return a Deferred of) an authorization result that is handed to the
        protocol factory, or raise :class:`ConnectRefused` with the HTTP status to answer."""


def _unauthorized(message: str) -> ConnectRefused:
    return ConnectRefused(401, message, {"WWW-Authenticate": "Bearer"})


def bearer_credential(request) -> bytes:
    """The credential of the one ``Authorization: Bearer <credential>`` header of ``request``
    (:func:`localai_tw.web.auth.bearer_credential`); raises a 401 :class:`ConnectRefused`
    otherwise."""
    credential = auth.bearer_credential(request)
    if credential is None:
        repeated = len(auth.authorization_headers(request)) > 1
        raise _unauthorized("ambiguous credential" if repeated else "missing bearer credential")
    return credential


@implementer(IConnectAuthorizer)
class BearerTokenAuthorizer:
    """Accepts a dial whose bearer credential equals the configured token.

    ``token`` is a ``str``/``bytes`` or a zero-argument callable returning one (read on every
    dial, so a rotated token takes effect at once).  An empty token authorizes nobody: the
    route exists in every deployment and must not fail open.  The comparison is constant-time
    over digests, so neither the content nor the length of the token leaks.  The authorization
    result is ``None``.
    """

    def __init__(self, token: str | bytes | Callable[[], str | bytes]):
        self._token = token

    def _expected(self) -> bytes:
        token = self._token() if callable(self._token) else self._token
        return token.encode("utf-8") if isinstance(token, str) else bytes(token or b"")

    def authorize(self, request) -> None:
        expected = self._expected()
        presented = bearer_credential(request)
        if not expected:
            raise _unauthorized("no credential is configured; nobody is authorized")
        if not auth.matches_any(presented, [auth.digest(expected)]):
            raise _unauthorized("wrong credential")
        return None


def _as_authorizer(authorizer) -> Callable[[Any], Any]:
    provider = IConnectAuthorizer(authorizer, None)
    if provider is not None:
        return provider.authorize
    if callable(authorizer):
        return authorizer
    raise TypeError(f"{authorizer!r} is neither an IConnectAuthorizer nor a callable")


# -- the transport the inner protocol sees ------------------------------------------------------


@implementer(IPushProducer)
class _WritePressureRelay:
    """Registered with the TCP transport as its producer: forwards "my write buffer is full" and
    "drained" to whatever producer the inner protocol registered with the carrier.

    ``stopProducing`` (called when TCP is lost) is not forwarded: the inner protocol learns the
    end through ``connectionLost``, and a yamux session's stopProducing is not "TCP is gone"."""

    def __init__(self, carrier: WebSocketCarrier):
        self._carrier = carrier

    def pauseProducing(self) -> None:
        self._carrier._tcpWritePaused(True)

    def resumeProducing(self) -> None:
        self._carrier._tcpWritePaused(False)

    def stopProducing(self) -> None:
        pass


@implementer(ITransport, IPushProducer, IConsumer)
class WebSocketCarrier:
    """The byte-stream transport an inner protocol sees over one WebSocket connection.

    As a consumer (outbound): ``write`` sends binary messages; a producer registered here is
    paused while the TCP transport's write buffer is full.  As a producer (inbound):
    ``pauseProducing`` stops reading from TCP; messages Autobahn had already parsed from the last
    read are held (at most one TCP read plus one message) and delivered on ``resumeProducing``.
    """

    #: On the dialling side: the ``X-LocalAI-*`` headers of the server's upgrade answer
    #: (:data:`ANSWER_HEADER_PREFIX`), names in lower case; what the server offers this
    #: connection (``tunnel/connect.py``).  Never mutated: a connection gets its own dict.
    answer_headers: dict[str, str] = {}

    def __init__(self, websocket, max_message_bytes: int, reactor=None,
                 coalesce_bytes: int = DEFAULT_COALESCE_BYTES):
        if reactor is None:
            from twisted.internet import reactor
        self._ws = websocket
        self._reactor = reactor
        self._max_message_bytes = max_message_bytes
        self._coalesce_bytes = max(1, min(coalesce_bytes, max_message_bytes))
        # outbound: the writes of this reactor turn, not yet sent as one message; the urgent
        # ones (``writeUrgent``) go at its front.  ``_out_size`` counts both lists.
        self._out: list[bytes] = []
        self._urgent: list[bytes] = []
        self._out_size = 0
        self._flush_call = None
        self._batching = 0  # > 0 inside a read or a resume: the flush comes when it returns
        self.protocol = None
        self.connected = True
        self.disconnecting = False
        self._local_ending: BaseException | None = None
        self._producer = None
        self._producer_streaming = True
        self._tcp_write_paused = False
        self._inbound_paused = False
        self._inbound_held: list[bytes] = []
        self._delivering = False
        self._pongs_owed = 0         # pong bytes written since TCP paused our writes
        self._pong_paused = False    # reading stopped because the peer reads none of them

    # ITransport
    def write(self, data: bytes) -> None:
        """Queue ``data`` for the message of this reactor turn.  It is sent when the turn's
        writes reach ``coalesce_bytes`` (or would pass the message bound), at the end of the
        read or resume that made them, or else by a ``callLater(0)``: never later than the next
        reactor iteration, and always in order."""
        if not data or self.disconnecting or not self.connected:
            return
        size = len(data)
        limit = self._max_message_bytes
        if self._out_size + size > limit:
            self._flushOut()
        if size > limit:  # one message per bound's worth
            data = bytes(data)
            for start in range(0, size, limit):
                self._out.append(data[start : start + limit])
                self._out_size = len(self._out[0])
                self._flushOut()
            return
        self._out.append(bytes(data))
        self._out_size += size
        if self._out_size >= self._coalesce_bytes:
            self._flushOut()
        elif not self._batching and self._flush_call is None:
            self._flush_call = self._reactor.callLater(0, self._flushOut)

    def writeSequence(self, data) -> None:
        self.write(b"".join(data))

    #: ``writePieces`` is offered: a yamux session hands its frame's header and payload pieces
    #: over unjoined, and they are joined once, with the rest of the message, when it is sent.
    writesPieces = True

    def writePieces(self, pieces: list, size: int) -> None:
        """``write(b"".join(pieces))`` without that join: ``pieces`` (``size`` bytes in all) are
        bytes or read-only memoryviews of bytes, which stay unchanged while held, and join the
        message of this reactor turn as they are.  Pieces larger than the message bound in all
        are joined and go through ``write``."""
        if not size or self.disconnecting or not self.connected:
            return
        if size > self._max_message_bytes:
            self.write(b"".join(pieces))
            return
        if self._out_size + size > self._max_message_bytes:
            self._flushOut()
        self._out.extend(pieces)
        self._out_size += size
        if self._out_size >= self._coalesce_bytes:
            self._flushOut()
        elif not self._batching and self._flush_call is None:
            self._flush_call = self._reactor.callLater(0, self._flushOut)

    #: ``writeUrgent`` is offered: a yamux session's control frames (window updates, pings, a
    #: small stream's frames) go ahead of the bulk frames this turn already wrote.
    writesUrgent = True

    def writeUrgent(self, data: bytes) -> None:
        """As ``write``, but ``data`` goes at the front of the message of this reactor turn, after
        the urgent writes before it and before every plain ``write``/``writePieces`` still held:
        a control frame does not wait behind up to ``coalesce_bytes`` of bulk frames.  The caller
        keeps its own order: it writes urgently only what may overtake what it wrote plainly
        (a yamux session: whole frames of streams that have no plain frame held)."""
        if not data or self.disconnecting or not self.connected:
            return
        size = len(data)
        if self._out_size + size > self._max_message_bytes:
            self._flushOut()
            if size > self._max_message_bytes:
                self.write(data)
                return
        self._urgent.append(bytes(data))
        self._out_size += size
        if self._out_size >= self._coalesce_bytes:
            self._flushOut()
        elif not self._batching and self._flush_call is None:
            self._flush_call = self._reactor.callLater(0, self._flushOut)

    def _flushOut(self) -> None:
        """Send what this turn wrote as one binary message, the urgent writes first."""
        call, self._flush_call = self._flush_call, None
        if call is not None and call.active():
            call.cancel()
        if not self._out_size:
            return
        size = self._out_size
        if self._urgent:
            chunks = self._urgent
            chunks.extend(self._out)
            self._urgent = []
        else:
            chunks = self._out
        self._out, self._out_size = [], 0
        if self.connected:
            self._ws._sendBinary(chunks, size)

    def _dropOut(self) -> None:
        call, self._flush_call = self._flush_call, None
        if call is not None and call.active():
            call.cancel()
        self._out, self._out_size = [], 0
        self._urgent = []

    def _startBatch(self) -> None:
        self._batching += 1

    def _endBatch(self) -> None:
        self._batching -= 1
        if not self._batching and self._out_size:
            self._flushOut()

    def loseConnection(self) -> None:
        """Send what was written, then a close (1000); the inner protocol's ending is normal."""
        if self.disconnecting or not self.connected:
            return
        self._flushOut()
        self.disconnecting = True
        self._local_ending = error.ConnectionDone("WebSocket closed by our side")
        self._ws.sendClose(code=1000)

    def abortConnection(self) -> None:
        """Drop the TCP connection now, discarding unsent data."""
        if not self.connected:
            return
        self._dropOut()
        self.disconnecting = True
        if self._local_ending is None:
            self._local_ending = error.ConnectionAborted("WebSocket aborted by our side")
        ab.drop(self._ws)

    def getPeer(self):
        return self._ws.transport.getPeer()

    def getHost(self):
        return self._ws.transport.getHost()

    # IConsumer
    def registerProducer(self, producer, streaming: bool) -> None:
        if self._producer is not None:
            raise RuntimeError(f"producer {self._producer!r} was never unregistered")
        if not self.connected:
            producer.stopProducing()
            return
        if not streaming:
            from twisted.internet._producer_helpers import _PullToPush

            producer = _PullToPush(producer, self)
            producer.startStreaming()
        self._producer = producer
        self._producer_streaming = streaming
        if self._tcp_write_paused:
            producer.pauseProducing()

    def unregisterProducer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None and not self._producer_streaming:
            producer.stopStreaming()

    def _tcpWritePaused(self, paused: bool) -> None:
        self._tcp_write_paused = paused
        if not paused:
            self._pongs_owed = 0
            if self._pong_paused:
                self._pong_paused = False
                if not self._inbound_paused and self.connected:
                    self._ws.transport.resumeProducing()
        if self._producer is not None:
            if paused:
                self._producer.pauseProducing()
            else:
                self._startBatch()
                try:
                    self._producer.resumeProducing()
                finally:
                    self._endBatch()

    # IPushProducer (inbound)
    def pauseProducing(self) -> None:
        if self._inbound_paused or not self.connected:
            return
        self._inbound_paused = True
        self._ws.transport.pauseProducing()

    def resumeProducing(self) -> None:
        if not self._inbound_paused or not self.connected:
            return
        self._inbound_paused = False
        self._deliverHeld()
        if not self._inbound_paused and not self._pong_paused and self.connected:
            self._ws.transport.resumeProducing()

    def stopProducing(self) -> None:
        self.abortConnection()

    # events from the WebSocket protocol
    #: The inner protocol's ``dataReceived`` takes any bytes-like object (it declares
    #: ``readsBuffers``, as the yamux session does): the fast path's payload goes to it without
    #: the copy into ``bytes``.  Set when the carrier opens.
    _reads_buffers = False

    def _messageReceived(self, payload) -> None:
        """``payload``: ``bytes``, or a buffer of the fast receive path that nothing changes
        afterwards (a ``bytearray``, a slice of a read); made ``bytes`` here for an inner
        protocol that does not declare ``readsBuffers``.  Holding one holds at most its read."""
        if not self._reads_buffers and type(payload) is not bytes:
            payload = bytes(payload)
        if self._inbound_paused or self._inbound_held or self._delivering:
            self._inbound_held.append(payload)
            return
        self.protocol.dataReceived(payload)

    def _deliverHeld(self) -> None:
        if self._delivering:
            return  # resumeProducing from inside dataReceived: the loop below continues
        self._delivering = True
        try:
            while self._inbound_held and not self._inbound_paused and self.connected:
                self.protocol.dataReceived(self._inbound_held.pop(0))
        finally:
            self._delivering = False

    def _mayPong(self, size: int) -> bool:
        """Autobahn is about to answer a ping with a pong of ``size`` bytes: may it?  Counted
        while TCP has paused our writes; past ``PONG_HIGH_WATER`` reading stops until the buffer
        drains, past ``PONG_CAP`` the connection is dropped (and no pong is sent)."""
        if self.disconnecting or not self.connected:
            return False
        if not self._tcp_write_paused:
            return True
        self._pongs_owed += size
        if self._pongs_owed > PONG_CAP:
            _log.warn("WebSocket peer is not reading: more than {cap} bytes of pongs wait behind "
                      "a full TCP buffer; dropping the connection", cap=PONG_CAP)
            self._drop(error.ConnectionLost(
                f"WebSocket peer not reading: more than {PONG_CAP} bytes of pongs unread"))
            return False
        if self._pongs_owed > PONG_HIGH_WATER and not self._pong_paused:
            self._pong_paused = True
            self._ws.transport.pauseProducing()
        return True

    def _protocolError(self, detail: str) -> None:
        self._drop(error.ConnectionLost(f"WebSocket protocol error: {detail}"))

    def _drop(self, ending: BaseException) -> None:
        if self._local_ending is None:
            self._local_ending = ending
        self._dropOut()
        self.disconnecting = True
        ab.drop(self._ws)

    def _closed(self, was_clean: bool, code, reason) -> None:
        if not self.connected:
            return
        self.connected = False
        self._dropOut()
        self._inbound_held.clear()
        producer, self._producer = self._producer, None
        if producer is not None and not self._producer_streaming:
            producer.stopStreaming()
        if self._local_ending is not None:
            ending = self._local_ending
        elif was_clean and code in CLEAN_CLOSE_CODES:
            ending = error.ConnectionDone(f"WebSocket closed by the peer (code {code})")
        else:
            ending = error.ConnectionLost(f"WebSocket closed with code {code}: {reason}")
        self.protocol.connectionLost(Failure(ending))


class _CarrierMixin(FastBinaryFrames):
    """What the server and client WebSocket protocols share: the carrier and its inner protocol,
    and the binary frame codec (``tunnel/wsframes.py``) that feeds it."""

    carrier: WebSocketCarrier | None = None
    inner_factory: Callable[[], Any] | None = None

    def _openCarrier(self):
        carrier = WebSocketCarrier(self, self.factory.max_message_bytes,
                                   getattr(self.factory, "reactor", None))
        # Called once: the server's factory closes over the upgrade request (and through it the
        # HTTP channel, its headers and buffers), which must not live as long as the tunnel.
        factory, self.inner_factory = self.inner_factory, None
        try:
            inner = factory()
        except Exception:
            _log.failure("the inner protocol factory failed; dropping the WebSocket")
            ab.drop(self)
            return None
        if inner is None:
            ab.drop(self)
            return None
        self.carrier = carrier
        # The dialler's copy of the server's answer headers, before the inner protocol is
        # connected (it may read them in connectionMade).
        headers = getattr(self, "_answer_headers", None)
        if headers:
            carrier.answer_headers, self._answer_headers = headers, None
        carrier.protocol = inner
        carrier._reads_buffers = getattr(inner, "readsBuffers", False) is True
        # Bulk bytes wait in the yamux streams, where control frames can overtake them, rather
        # than in the kernel's send queue (``web/sockets.py``).
        set_not_sent_lowat(self.transport)
        # Bulk comes in reads of up to 128 KiB instead of Twisted's 64 KiB: half the per-read
        # passes through the frame parsers (``web/sockets.py``).
        set_read_size(self.transport)
        # A small write (a control frame, a window update, a token) goes to the kernel in the
        # same reactor turn when nothing waits before it (``web/sockets.py``).
        set_write_through(self.transport)
        self.transport.registerProducer(_WritePressureRelay(carrier), True)
        inner.makeConnection(carrier)
        return inner

    def onPing(self, payload: bytes) -> None:
        carrier = self.carrier
        if carrier is not None and not carrier._mayPong(2 + len(payload or b"")):
            return
        super().onPing(payload)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        carrier = self.carrier
        if carrier is None or not carrier.connected:
            return
        if not isBinary:
            carrier._protocolError("text message on a binary tunnel")
            return
        if payload:
            carrier._messageReceived(payload)

    def onClose(self, wasClean: bool, code, reason) -> None:
        if self.carrier is not None:
            self.carrier._closed(wasClean, code, reason)


class _CarrierServerProtocol(_CarrierMixin, WebSocketServerProtocol):
    def onConnect(self, request):
        """Accept with no subprotocol, adding the resource's answer headers (if any)."""
        answer_headers = getattr(self.factory, "answer_headers", None)
        headers = answer_headers() if answer_headers is not None else None
        return (None, dict(headers)) if headers else None

    def onOpen(self) -> None:
        ab.forget_handshake(self)  # the parsed request would live as long as the tunnel
        self._openCarrier()


class HandshakeFailed(Exception):
    """The WebSocket did not open.  ``status`` is the HTTP status of a refusal (401, 403, ...)
    or None when no HTTP answer was read (connection dropped, handshake timeout, bad answer)."""

    def __init__(self, status: int | None, reason: str):
        self.status = status
        self.reason = reason
        super().__init__(f"WebSocket handshake failed ({status}): {reason}" if status else reason)


class _CarrierClientProtocol(_CarrierMixin, WebSocketClientProtocol):
    opened: defer.Deferred | None = None
    _refusal_status: int | None = None
    _refusal_reason: str = ""

    def connectionMade(self):
        # A worker's tunnel and a replica's peer link: every streamed token crosses as a small
        # write, which Nagle would hold for the peer's delayed ACK (``web/sockets.py``).
        set_no_delay(self.transport)
        return super().connectionMade()

    _answer_headers: dict[str, str] | None = None

    def onConnect(self, response) -> None:
        """Keep the server's ``X-LocalAI-*`` answer headers (a few, bounded) for the carrier."""
        kept = {}
        for name, value in (response.headers or {}).items():
            name = str(name).lower()
            if name.startswith(ANSWER_HEADER_PREFIX) and len(kept) < MAX_ANSWER_HEADERS:
                kept[name] = str(value)[:MAX_ANSWER_HEADER_CHARS]
        self._answer_headers = kept

    def failHandshake(self, reason):
        status = ab.refusal_status(self)
        if status is not None:
            self._refusal_status = status
        self._refusal_reason = reason
        return super().failHandshake(reason)

    def onOpen(self) -> None:
        inner = self._openCarrier()
        opened, self.opened = self.opened, None
        if opened is not None:
            if inner is None:
                opened.errback(HandshakeFailed(None, "the inner protocol factory failed"))
            else:
                opened.callback(inner)

    def onClose(self, wasClean: bool, code, reason) -> None:
        opened, self.opened = self.opened, None
        if opened is not None:
            opened.errback(
                HandshakeFailed(self._refusal_status, self._refusal_reason or str(reason))
            )
        super().onClose(wasClean, code, reason)


def _bounded(factory, max_message_bytes: int, handshake_timeout: float) -> None:
    factory.max_message_bytes = max_message_bytes
    factory.setProtocolOptions(
        maxMessagePayloadSize=max_message_bytes,
        maxFramePayloadSize=max_message_bytes,
        autoFragmentSize=0,  # one frame per message: no fragmentation we did not ask for
        openHandshakeTimeout=handshake_timeout,
        autoPingInterval=0,  # yamux has its own keepalive
    )


# -- the server side ------------------------------------------------------------------------------


class TunnelWebSocketResource(Resource):
    """A ``twisted.web`` resource that authorizes a dial, upgrades it, and runs
    ``protocol_factory(request, authorization)`` over the WebSocket.

    Order of checks, all before any upgrade: the authorizer (a refusal is answered with its own
    status, 401 for a missing or wrong credential, so an anonymous probe never learns more), then
    whether the request is a WebSocket upgrade at all (426 if not).  An authorizer that fails
    with anything but :class:`ConnectRefused` gets a 500: it never falls through to an upgrade.
    """

    isLeaf = True

    def __init__(
        self,
        protocol_factory: Callable[[Any, Any], Any],
        authorizer,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        answer_headers: Callable[[], dict[str, str]] = dict,
    ):
        super().__init__()
        self._protocol_factory = protocol_factory
        self._authorize = _as_authorizer(authorizer)
        self._ws_factory = WebSocketServerFactory()
        self._ws_factory.protocol = _CarrierServerProtocol
        #: ``answer_headers()``: headers added to each upgrade's answer (read per upgrade).
        self._ws_factory.answer_headers = answer_headers
        _bounded(self._ws_factory, max_message_bytes, handshake_timeout)

    def render_GET(self, request):
        authorizing = defer.maybeDeferred(self._authorize, request)
        request.notifyFinish().addErrback(lambda _: authorizing.cancel())
        authorizing.addCallbacks(
            self._authorized, self._refused, callbackArgs=(request,), errbackArgs=(request,)
        )
        authorizing.addErrback(
            lambda failure: _log.failure("answering a WebSocket dial failed", failure)
        )
        return NOT_DONE_YET

    def _refused(self, failure: Failure, request) -> None:
        if failure.check(defer.CancelledError) or request.channel is None:
            return  # the dialler went away while we were deciding
        refusal = failure.value
        if not isinstance(refusal, ConnectRefused):
            _log.failure("the connect authorizer failed; answering 500", failure)
            refusal = ConnectRefused(500, "authorization failed")
        self._answer(request, refusal)

    @staticmethod
    def _answer(request, refusal: ConnectRefused) -> None:
        channel = request.channel
        request.setResponseCode(refusal.status)
        for name, value in refusal.headers.items():
            request.setHeader(name, value)
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        request.setHeader(b"connection", b"close")
        request.write((refusal.message or "refused").encode("utf-8") + b"\n")
        request.finish()
        # A refused dialler has nothing more to say on this connection; closing it (after the
        # response is flushed) spares both sides an idle keep-alive.
        if channel is not None:
            channel.loseConnection()

    def _authorized(self, authorization, request) -> None:
        if request.channel is None:
            return  # the dialler went away while we were deciding
        upgrade = (request.getHeader(b"upgrade") or b"").lower()
        connection = (request.getHeader(b"connection") or b"").lower()
        transport = request.channel.transport
        if (
            upgrade != b"websocket"
            or b"upgrade" not in [t.strip() for t in connection.split(b",")]
            or transport is None  # HTTP/2 carries no upgrade
        ):
            self._answer(
                request,
                ConnectRefused(426, "WebSocket upgrade required", {"Upgrade": "websocket"}),
            )
            return
        websocket = self._ws_factory.buildProtocol(transport.getPeer())
        websocket.inner_factory = lambda: self._protocol_factory(request, authorization)
        self._takeOver(request, transport, websocket)

    @staticmethod
    def _takeOver(request, transport, websocket) -> None:
        """Move the connection from twisted.web's HTTP channel to the WebSocket protocol, and
        tell a counting listener (``frontend.web``'s ``authorized()``) that it is vouched for."""
        request.channel.transport = None
        for wrapper in (transport, getattr(transport, "protocol", None)):
            authorized = getattr(wrapper, "authorized", None)
            if isinstance(wrapper, ProtocolWrapper) and callable(authorized):
                authorized()
                break
        if isinstance(transport, ProtocolWrapper):  # TLS wraps the protocol
            transport.wrappedProtocol = websocket
            if isinstance(transport.transport, TLSMemoryBIOProtocol):
                # A wrapper above TLS (the site's connection count) claims TLS's interfaces,
                # but Autobahn reads the TLS channel from the TLS protocol itself: write to
                # that directly; reads still pass through the wrapper.
                transport = transport.transport
        elif isinstance(getattr(transport, "protocol", None), ProtocolWrapper):
            transport.protocol.wrappedProtocol = websocket
        else:
            transport.protocol = websocket
        # The HTTP channel registered itself as the transport's producer; it no longer writes
        # here, and the carrier registers its own relay once the WebSocket opens.
        transport.unregisterProducer()
        websocket.makeConnection(transport)
        # twisted.web may have paused reading while it handled the request.
        transport.resumeProducing()
        # Autobahn parses the opening handshake itself: give it the request as it came.
        head = [request.method + b" " + request.uri + b" HTTP/1.1"]
        for name, values in request.requestHeaders.getAllRawHeaders():
            head.extend(name + b": " + value for value in values)
        websocket.dataReceived(b"\r\n".join(head) + b"\r\n\r\n")


# -- the client side ------------------------------------------------------------------------------


def connectWebSocket(
    reactor,
    url: str,
    protocol_factory: Callable[[], Any],
    headers: dict[str, str] | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    tls_options=None,
) -> defer.Deferred:
    """Dial ``url`` (``ws://`` or ``wss://``) with ``headers`` (e.g. ``Authorization``) and run
    ``protocol_factory()`` over the WebSocket once it is open.

    Fires with the inner protocol, already connected to its :class:`WebSocketCarrier`.  Fails
    with :class:`HandshakeFailed` (``status`` kept, e.g. 401) when the server refused or the
    handshake did not complete, or with the connection error when TCP could not connect.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a ws:// or wss:// URL: {url!r}")
    factory = WebSocketClientFactory(url, headers=dict(headers or {}), reactor=reactor)
    factory.protocol = _CarrierClientProtocol
    factory.noisy = False  # every dial would log "Starting/Stopping factory"
    _bounded(factory, max_message_bytes, handshake_timeout)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "wss" else 80)
    endpoint = endpoints.HostnameEndpoint(reactor, host, port, timeout=handshake_timeout)
    if parts.scheme == "wss":
        from twisted.internet.ssl import optionsForClientTLS

        endpoint = endpoints.wrapClientTLS(tls_options or optionsForClientTLS(host), endpoint)

    opened: defer.Deferred = defer.Deferred()

    def build(websocket):
        websocket.inner_factory = protocol_factory
        websocket.opened = opened
        return websocket

    def connected(websocket):
        return opened

    connecting = endpoints.connectProtocol(endpoint, build(factory.buildProtocol(None)))
    return connecting.addCallback(connected)
