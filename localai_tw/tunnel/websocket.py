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

What this module must never do: upgrade a request its authorizer did not accept; accept a message
or frame above the bound (Autobahn enforces it and fails the connection); buffer inbound data
without bound while the inner protocol is paused; let a text message reach the byte stream.  It
knows nothing of nodes, tokens in a database or yamux: those are the caller's factory and
authorizer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Any, Callable
from urllib.parse import urlsplit

from autobahn.twisted.websocket import (
    WebSocketClientFactory,
    WebSocketClientProtocol,
    WebSocketServerFactory,
    WebSocketServerProtocol,
)
from autobahn.websocket.protocol import WebSocketProtocol
from autobahn.websocket.xormasker import create_xor_masker
from twisted.internet import defer, endpoints, error
from twisted.internet.interfaces import IConsumer, IPushProducer, ITransport
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper
from twisted.protocols.tls import TLSMemoryBIOProtocol
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from zope.interface import Interface, implementer

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
    (scheme matched case-insensitively); raises a 401 :class:`ConnectRefused` otherwise."""
    values = request.requestHeaders.getRawHeaders(b"authorization") or []
    if len(values) != 1:
        raise _unauthorized("missing bearer credential" if not values else "ambiguous credential")
    scheme, _, credential = values[0].strip().partition(b" ")
    credential = credential.strip()
    if scheme.lower() != b"bearer" or not credential:
        raise _unauthorized("missing bearer credential")
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
        if not hmac.compare_digest(
            hashlib.sha256(presented).digest(), hashlib.sha256(expected).digest()
        ):
            raise _unauthorized("wrong credential")
        return None


def _as_authorizer(authorizer) -> Callable[[Any], Any]:
    provider = IConnectAuthorizer(authorizer, None)
    if provider is not None:
        return provider.authorize
    if callable(authorizer):
        return authorizer
    raise TypeError(f"{authorizer!r} is neither an IConnectAuthorizer nor a callable")


# -- binary data frames, sent without Autobahn's per-message machinery ---------------------------

try:  # Autobahn's NVX C extension (the XOR masker it uses itself), called without its wrapper
    from _nvx_xormasker import ffi as _nvx_ffi, lib as _nvx_lib
except ImportError:  # pragma: no cover - Autobahn without its C extension
    _nvx_ffi = _nvx_lib = None

# Below this many bytes the XOR through Python ints is cheaper than a C masker's setup.
_SMALL_MASK = 256


def _mask_in_place(buf: bytearray, start: int, key: bytes) -> None:
    """XOR ``buf[start:]`` with the 4-byte WebSocket masking ``key`` (RFC 6455 5.3), in place."""
    n = len(buf) - start
    if n <= 0:
        return
    if n <= _SMALL_MASK or _nvx_lib is None:
        if n > _SMALL_MASK:  # no C extension: Autobahn's own fallback
            buf[start:] = create_xor_masker(key, n).process(bytes(buf[start:]))
            return
        keys = int.from_bytes((key * (n // 4 + 1))[:n], "little")
        buf[start:] = (int.from_bytes(buf[start:], "little") ^ keys).to_bytes(n, "little")
        return
    masker = _nvx_lib.nvx_xormask_new(_nvx_ffi.new("uint8_t[4]", key))  # copies the key
    try:
        _nvx_lib.nvx_xormask_set_impl(masker, 2)  # SSE2, as Autobahn's own masker does
        with _nvx_ffi.from_buffer("uint8_t[]", buf, require_writable=True) as data:
            _nvx_lib.nvx_xormask_process(masker, data + start, n)
    finally:
        _nvx_lib.nvx_xormask_free(masker)


_B0_BINARY_FINAL = 0x82  # FIN, no RSV bits, opcode 2 (binary)
_LEN16 = struct.Struct("!BBH")
_LEN64 = struct.Struct("!BBQ")


def _binary_frame_header(length: int, masked: bool) -> bytes:
    """The header of one final, uncompressed binary frame (RFC 6455 5.2), minimal length form;
    without the masking key."""
    bit = 0x80 if masked else 0
    if length <= 125:
        return bytes((_B0_BINARY_FINAL, bit | length))
    if length <= 0xFFFF:
        return _LEN16.pack(_B0_BINARY_FINAL, bit | 126, length)
    return _LEN64.pack(_B0_BINARY_FINAL, bit | 127, length)


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

    def __init__(self, websocket, max_message_bytes: int, reactor=None,
                 coalesce_bytes: int = DEFAULT_COALESCE_BYTES):
        if reactor is None:
            from twisted.internet import reactor
        self._ws = websocket
        self._reactor = reactor
        self._max_message_bytes = max_message_bytes
        self._coalesce_bytes = max(1, min(coalesce_bytes, max_message_bytes))
        # outbound: the writes of this reactor turn, not yet sent as one message
        self._out: list[bytes] = []
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

    def _flushOut(self) -> None:
        """Send what this turn wrote as one binary message."""
        call, self._flush_call = self._flush_call, None
        if call is not None and call.active():
            call.cancel()
        if not self._out:
            return
        chunks, size = self._out, self._out_size
        self._out, self._out_size = [], 0
        if self.connected:
            self._ws._sendBinary(chunks, size)

    def _dropOut(self) -> None:
        call, self._flush_call = self._flush_call, None
        if call is not None and call.active():
            call.cancel()
        self._out, self._out_size = [], 0

    def _startBatch(self) -> None:
        self._batching += 1

    def _endBatch(self) -> None:
        self._batching -= 1
        if not self._batching and self._out:
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
        self._ws.dropConnection(abort=True)

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
    def _messageReceived(self, payload: bytes) -> None:
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
        self._ws.dropConnection(abort=True)

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


class _CarrierMixin:
    """What the server and client WebSocket protocols share: the carrier and its inner protocol."""

    carrier: WebSocketCarrier | None = None
    inner_factory: Callable[[], Any] | None = None

    def _openCarrier(self):
        carrier = WebSocketCarrier(self, self.factory.max_message_bytes,
                                   getattr(self.factory, "reactor", None))
        try:
            inner = self.inner_factory()
        except Exception:
            _log.failure("the inner protocol factory failed; dropping the WebSocket")
            self.dropConnection(abort=True)
            return None
        if inner is None:
            self.dropConnection(abort=True)
            return None
        self.carrier = carrier
        carrier.protocol = inner
        self.transport.registerProducer(_WritePressureRelay(carrier), True)
        inner.makeConnection(carrier)
        return inner

    # Autobahn's own dataReceived and sendData format a debug line (click.style through hltype
    # and hlval) on every read and every write, even with debug logging off: 15-20 % of each
    # side's CPU in the transport benchmark.  These two do the same work without it.

    #: The start of a binary frame whose header is not complete yet, held by the fast receive
    #: path (Autobahn's ``data`` is empty meanwhile); at most one header (14 bytes).
    _rx: bytearray | None = None
    #: Payload bytes still to come of the frame the fast path is in the middle of (its header
    #: was accepted and the payload so far delivered), its masking key (None: not masked), how
    #: far into the payload we are (the key's offset), and its length (for the statistics).
    _rx_left: int = 0
    _rx_key: bytes | None = None
    _rx_done: int = 0
    _rx_length: int = 0

    def dataReceived(self, data: bytes) -> None:
        carrier = self.carrier
        if carrier is None:
            self._dataReceived(data)
            return
        carrier._startBatch()  # what the inner protocol writes in answer goes out as one message
        try:
            if self._rx_left or self._fastReceivable():
                self._receiveFast(data)
            else:
                if self._rx:  # the fast path held the start of a frame: Autobahn takes it
                    self.data, self._rx = bytes(self._rx), None
                self._dataReceived(data)
        finally:
            carrier._endBatch()

    def _fastReceivable(self) -> bool:
        """Open, at a message boundary, nothing negotiated or logged that needs Autobahn's own
        frame handling."""
        carrier = self.carrier
        return (self.state == WebSocketProtocol.STATE_OPEN and self.current_frame is None
                and not self.inside_message and self._perMessageCompress is None
                and not self.logFrames and not self.logOctets and not self.trackedTimings
                and not self.autoPingTimeoutCall and carrier is not None and carrier.connected)

    def _receiveFast(self, data: bytes) -> None:
        """Deliver the final binary frames of ``data`` straight to the carrier.

        Only a frame that Autobahn would accept as a whole binary message takes this path: FIN
        set, no RSV bits, opcode 2, masked exactly when this side requires it (the client's
        frames are, the server's are not), minimal length encoding, length within the frame and
        message bounds and non-zero.  Its payload is unmasked and delivered as it arrives: each
        read's part of it at once, at the running offset of the masking key, never collected
        into a whole message; there are no frame or message objects, no future and no log line.
        At the first frame that is anything else (a control frame, a fragment, text, a
        violation) the rest of the read goes to Autobahn's own parser, which handles or refuses
        it as before; an incomplete header is held (``_rx``) for the next read."""
        self.trafficStats.incomingOctetsWireLevel += len(data)
        if self.data:  # Autobahn holds the start of a frame (came with the handshake)
            data, self.data = self.data + data, b""
        pos = 0
        if self._rx_left:
            with memoryview(data) as view:
                pos = min(self._rx_left, len(view))
                self._fastPayload(view, 0, pos)
            if self._rx_left:
                return  # the whole read was payload of that frame
            if not self._fastReceivable():  # closing meanwhile: Autobahn takes what follows
                if self._rx:
                    self.data, self._rx = bytes(self._rx), None
                self._dataReceived(data[pos:])
                return
        rx = self._rx
        if rx:
            rx += memoryview(data)[pos:]
            buf = rx
            pos = 0
        else:
            buf = data
        carrier = self.carrier
        masked = bool(self.factory.isServer)
        if masked and not (self.requireMaskedClientFrames and self.applyMask):
            masked = None  # an unusual configuration: Autobahn decides every frame
        max_frame = self.maxFramePayloadSize
        max_message = self.maxMessagePayloadSize
        end = len(buf)
        handover = False
        with memoryview(buf) as view:
            while end - pos >= 2:
                b1 = view[pos + 1]
                if view[pos] != _B0_BINARY_FINAL or masked is None or bool(b1 & 0x80) != masked:
                    handover = True
                    break
                length = b1 & 0x7F
                start = pos + 2
                if length == 126:
                    if end - start < 2:
                        break
                    length = int.from_bytes(view[start:start + 2], "big")
                    start += 2
                    if length < 126:
                        handover = True
                        break
                elif length == 127:
                    if end - start < 8:
                        break
                    length = int.from_bytes(view[start:start + 8], "big")
                    start += 8
                    if length <= 0xFFFF or length > 0x7FFFFFFFFFFFFFFF:
                        handover = True
                        break
                if (not length or (max_frame and length > max_frame)
                        or (max_message and length > max_message)):
                    handover = True
                    break
                if masked:
                    if end - start < 4:
                        break
                    self._rx_key = view[start:start + 4].tobytes()
                    start += 4
                else:
                    self._rx_key = None
                self._rx_left, self._rx_done, self._rx_length = length, 0, length
                pos = min(start + length, end)
                self._fastPayload(view, start, pos)
                if self._rx_left:
                    break  # the rest of the payload comes with the next reads
                if self.state != WebSocketProtocol.STATE_OPEN or not carrier.connected:
                    handover = True  # closing: Autobahn handles what follows
                    break
            rest = view[pos:].tobytes() if handover else None
            if not handover and pos < end and buf is not rx:
                self._rx = bytearray(view[pos:])
        if handover:
            self._rx = None
            self.data = rest
            if rest:
                self.consumeData()
        elif buf is rx:
            if pos == end:
                self._rx = None
            else:
                del rx[:pos]
        elif pos == end:
            self._rx = None

    def _fastPayload(self, view: memoryview, start: int, stop: int) -> None:
        """Unmask ``view[start:stop]``, the next bytes of the current frame's payload, and hand
        them to the carrier (dropped once it is gone); count the frame once it is whole."""
        n = stop - start
        if n > 0:
            key = self._rx_key
            if key is None:
                payload = view[start:stop].tobytes()
            else:
                shift = self._rx_done & 3
                if shift:
                    key = key[shift:] + key[:shift]
                piece = bytearray(view[start:stop])
                _mask_in_place(piece, 0, key)
                payload = bytes(piece)
            self._rx_left -= n
            self._rx_done += n
        if not self._rx_left:  # counted before the last bytes are handed over
            length = self._rx_length
            stats = self.trafficStats
            stats.incomingWebSocketFrames += 1
            stats.incomingWebSocketMessages += 1
            stats.incomingOctetsWebSocketLevel += length
            stats.incomingOctetsAppLevel += length
        if n > 0:
            carrier = self.carrier
            if carrier is not None and carrier.connected:
                carrier._messageReceived(payload)

    def sendData(self, data: bytes, sync: bool = False, chopsize: int | None = None) -> None:
        carrier = self.carrier
        if carrier is not None and carrier._out:
            carrier._flushOut()  # a frame of Autobahn's own (close, pong) never overtakes data
        if sync or chopsize or self.send_queue or self.logOctets:
            super().sendData(data, sync, chopsize)
            return
        self.transport.write(data)
        if self.state == WebSocketProtocol.STATE_OPEN:
            self.trafficStats.outgoingOctetsWireLevel += len(data)
        elif self.state in (WebSocketProtocol.STATE_CONNECTING,
                            WebSocketProtocol.STATE_PROXY_CONNECTING):
            self.trafficStats.preopenOutgoingOctetsWireLevel += len(data)

    def _sendBinary(self, chunks: list[bytes], size: int) -> None:
        """Send ``chunks`` (``size`` bytes in all, within the message bound) as one binary
        message.  In the plain case (open, no compression, no sync queue, no frame logging)
        the frame is built here: one final binary frame, masked with a fresh random key on
        the client side (RFC 6455 5.3), two copies of the payload instead of Autobahn's five
        and none of its per-message objects.  Otherwise Autobahn's ``sendMessage`` does it."""
        if self.state != WebSocketProtocol.STATE_OPEN:
            return  # closing: Autobahn would refuse it too; the peer is not reading any more
        masked = self.maskServerFrames if self.factory.isServer else self.maskClientFrames
        if (self._perMessageCompress is not None or self.send_queue or self.logFrames
                or self.logOctets or self.trackedTimings or (masked and not self.applyMask)
                or self.send_state != WebSocketProtocol.SEND_STATE_GROUND):
            self.sendMessage(b"".join(chunks), isBinary=True)
            return
        header = _binary_frame_header(size, masked)
        if masked:
            key = os.urandom(4)
            frame = bytearray().join([header, key, *chunks])
            _mask_in_place(frame, len(header) + 4, key)
            raw = bytes(frame)
        else:
            raw = b"".join([header, *chunks])
        self.transport.write(raw)
        stats = self.trafficStats
        stats.outgoingWebSocketMessages += 1
        stats.outgoingWebSocketFrames += 1
        stats.outgoingOctetsAppLevel += size
        stats.outgoingOctetsWebSocketLevel += size
        stats.outgoingOctetsWireLevel += len(raw)

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
    def onOpen(self) -> None:
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

    def failHandshake(self, reason):
        status_line = getattr(self, "http_status_line", "") or ""
        fields = status_line.split()
        if len(fields) >= 2 and fields[1].isdigit() and fields[1] != "101":
            self._refusal_status = int(fields[1])
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
    ):
        super().__init__()
        self._protocol_factory = protocol_factory
        self._authorize = _as_authorizer(authorizer)
        self._ws_factory = WebSocketServerFactory()
        self._ws_factory.protocol = _CarrierServerProtocol
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
        """Move the connection from twisted.web's HTTP channel to the WebSocket protocol."""
        request.channel.transport = None
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
