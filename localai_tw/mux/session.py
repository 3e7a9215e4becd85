"""A yamux session: a Twisted ``Protocol`` that multiplexes streams over one transport.

The session owns the stream table, id allocation, accepting and refusing inbound streams,
keepalive pings, go-away, and the translation of every way the carrier can end into the
ending each stream's protocol sees.  It speaks hashicorp/yamux on the wire (see
``docs/protocol.md``) and runs over any transport: TCP, or the WebSocket adapter.

It must never raise out of ``dataReceived`` (bad input from the peer ends the session with
go-away(protocol error) and a clean teardown of every stream), never let one stream's protocol
take the session down, never reuse a stream id, and never buffer more than the peers' windows
allow: the session itself holds no stream data, it only writes frames while the transport is
not paused.  Control frames (pings, window updates, go-away) are written at once, never queued
behind stream data; over a carrier that offers ``writeUrgent`` (the WebSocket carrier, which
holds up to one message of frames per reactor turn) they, and the frames of control streams
(those that have sent less than ``bulk_after``), also go ahead of the bulk Data frames the
carrier still holds, and on resume control streams are served before bulk streams; but a peer that makes us answer (pings, refused SYNs) while it does not read
what we write is stopped: past ``reply_high_water`` bytes of answers written while the carrier
has paused us, the session stops reading from the carrier until it drains, and past
``reply_cap`` it fails (Go blocks its receive loop on a bounded send queue; Twisted's HTTP/2
aborts past 17 KiB of buffered control frames).

One module of about 780 lines, because it is one protocol's state: the stream table, the
windows both ways, the write scheduler (control before bulk) and the endings are read and
changed together on every frame; ``Stream`` (``stream.py``) and the frame codec
(``frame.py``) are already apart, and what is left would only be split by cutting the
receive path from the send path that answers it.
"""

from __future__ import annotations

import enum
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Callable

from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from localai_tw.deferreds import OneShotObserver
from localai_tw.mux.autowindow import SessionFlow
from localai_tw.mux.errors import (
    FrameError,
    KeepaliveTimeout,
    ProtocolError,
    SessionEnded,
    SessionFailed,
    SessionNotOpen,
    StreamsExhausted,
    TooManyStreams,
)
from localai_tw.mux.frame import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    GOAWAY_INTERNAL_ERROR,
    GOAWAY_NORMAL,
    GOAWAY_PROTOCOL_ERROR,
    HEADER,
    HEADER_SIZE,
    INITIAL_WINDOW,
    MAX_UINT32,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    VERSION,
    Frame,
    FrameDecoder,
    encode,
)
from localai_tw.mux.stream import Stream, StreamState
from localai_tw.mux.wheel import common_tick, wheel_for

log = Logger()

GOAWAY_NAMES = {
    GOAWAY_NORMAL: "normal",
    GOAWAY_PROTOCOL_ERROR: "protocol error",
    GOAWAY_INTERNAL_ERROR: "internal error",
}

#: The default largest Data payload we send: a frame (header included) of exactly 64 KiB.
DEFAULT_MAX_FRAME_SIZE = 64 * 1024 - HEADER_SIZE

#: The first 8 bytes of a ping SYN (version, type, flags, stream 0) and of its answer; the
#: opaque value follows.
_PING_SYN_HEAD = HEADER.pack(VERSION, TYPE_PING, FLAG_SYN, 0, 0)[:8]
_PING_ACK_HEAD = HEADER.pack(VERSION, TYPE_PING, FLAG_ACK, 0, 0)[:8]

# Go allocates ids strictly below 2**32 - 2, then reports "streams exhausted".
_LAST_STREAM_ID = MAX_UINT32 - 2


@dataclass
class SessionConfig:
    """Tunables of one session.  Both ends must agree on ``max_window`` only in the sense that
    each advertises its own; the initial window is fixed by the protocol."""

    accept_backlog: int = 256            # inbound streams waiting for accept(); beyond -> RST
    max_streams: int = 1000              # concurrent streams, both directions (libp2p's default)
    keepalive_interval: float | None = 30.0   # None or 0 disables keepalive pings
    keepalive_timeout: float = 10.0      # no ping reply within this -> KeepaliveTimeout
    # True: ping only after keepalive_interval without a byte from the peer (its own pings, its
    # answers, its data count); a silent carrier is still seen interval + timeout after its last
    # byte.  False: ping every interval whatever arrived (Go's yamux).
    keepalive_when_quiet: bool = False
    # True: send no keepalive ping at all.  The peer has said (tunnel/keepalive.py) that it
    # pings every keepalive_interval whatever it reads, so a live peer is never silent for
    # long; the session ends when nothing was read for keepalive_interval + keepalive_timeout,
    # the bound a ping of ours would have given.  Our answers to its pings keep its own bound.
    keepalive_peer_pings: bool = False
    # True: ping every keepalive_interval whatever arrived and whether or not the previous
    # ping was answered, and end the session when nothing was read for keepalive_interval +
    # keepalive_timeout, not when one ping goes unanswered.  Any byte counts as an answer, so
    # an answer queued behind stream data on a slow link is not taken for a dead peer, and the
    # interval can be longer for the same bound (tunnel/keepalive.py).
    keepalive_on_silence: bool = False
    initial_window: int = INITIAL_WINDOW  # fixed by yamux (no handshake); kept for the contract
    max_window: int = INITIAL_WINDOW     # receive window we advertise per stream (>= 256 KiB)
    accept_streams: bool = True          # False: every inbound SYN is answered with RST
    # 64 KiB - 12: small enough that streams interleave and a ping reply never waits behind a
    # huge frame, large enough that the 12-byte header costs 0.02 %, and header + payload is
    # exactly 64 KiB, Twisted's TCP write-buffer threshold (``bufferSize``): a frame one byte
    # larger pauses the session after every frame, so yamux over TCP would move one frame per
    # reactor turn instead of two.  Go accepts any size up to the window.  A frame may be up to
    # 1/8 larger when that avoids a runt frame after it (``Stream._flush``).
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    # After loseConnection our FIN went out; if the peer never answers with FIN the id is
    # reset after this long, so a silent peer cannot pin stream slots (newer Go does the same).
    linger_timeout: float | None = 300.0
    # True: the peer never opens streams by contract (a worker's tunnel), so its SYN is a
    # protocol error that ends the session, not one RST (and one log line) per SYN.
    forbid_inbound_streams: bool = False
    # Answers we owe the peer (ping replies, RSTs of refused SYNs) written while the carrier has
    # paused us (its buffer is above its high-water mark: the peer is not reading).  Past the
    # high-water mark we stop reading until the carrier drains; past the cap the session fails.
    # A well-behaved peer pings every 30 s: it never comes near either.
    reply_high_water: int = 16 * 1024
    reply_cap: int = 64 * 1024
    # Bulk bytes in flight, session-wide (0: no limit).  A stream that has sent more than
    # ``bulk_after`` bytes is a bulk stream; bulk streams together keep at most this many bytes
    # (headers included) written but not yet acknowledged by the peer, so a control stream's
    # frame never waits behind more than that in the socket buffers.  The acknowledgement is a
    # ping sent every quarter of the budget: the peer answers it only after reading everything
    # written before it.  No wire change; any yamux peer answers pings.
    bulk_in_flight: int = 0
    bulk_after: int = 256 * 1024
    # Receive-window auto-tuning (mux/autowindow.py; 0: off, every stream keeps ``max_window``).
    # The largest window one stream may grow to when its reader consumes a window faster than
    # the round trip allows (a long link); windows grow only while ``session_window`` (the sum
    # of what this session's streams hold above ``max_window``) and ``window_pool`` (shared by
    # sessions: the process's memory budget) still have room, and halve when the consumer
    # pauses.  The round trip is the smallest ping round trip (any yamux peer answers pings; a
    # probe goes out per tuning epoch) of the last ``rtt_max_age`` seconds.
    auto_window: int = 0
    session_window: int = 64 * 1024 * 1024
    window_pool: object = None
    rtt_max_age: float = 10.0

    def __post_init__(self):
        if self.initial_window != INITIAL_WINDOW:
            raise ValueError("yamux's initial window is fixed at 256 KiB")
        if self.max_window < INITIAL_WINDOW or self.max_window > MAX_UINT32:
            raise ValueError("max_window must be between 256 KiB and 2**32 - 1")
        if self.max_frame_size < 1:
            raise ValueError("max_frame_size must be positive")
        if self.accept_backlog < 0 or self.max_streams < 0:
            raise ValueError("limits must not be negative")
        if not 0 < self.reply_high_water <= self.reply_cap:
            raise ValueError("reply_high_water must be positive and at most reply_cap")
        if self.bulk_in_flight < 0 or self.bulk_after < 0:
            raise ValueError("bulk_in_flight and bulk_after must not be negative")
        if self.bulk_in_flight and self.bulk_in_flight < 4 * (self.max_frame_size + HEADER_SIZE):
            raise ValueError("bulk_in_flight must be at least four frames")
        if self.auto_window and not self.max_window <= self.auto_window <= MAX_UINT32:
            raise ValueError("auto_window must be 0 or between max_window and 2**32 - 1")
        if self.session_window < 0 or self.rtt_max_age <= 0:
            raise ValueError("session_window must not be negative, rtt_max_age must be positive")


class SessionState(enum.Enum):
    CONNECTING = "connecting"  # not yet given a transport
    OPEN = "open"
    ENDED = "ended"


@implementer(IPushProducer)
class Session(Protocol):
    """One yamux session.  ``client=True`` opens odd ids (from 1), ``False`` even ids (from 2).

    ``acceptor(stream) -> IProtocol | None`` is called for each inbound stream; the returned
    protocol is connected and the stream acknowledged; ``None`` or an exception refuses it with
    RST.  Without an acceptor inbound streams wait (at most ``accept_backlog``) for ``accept()``.
    """

    #: ``dataReceived`` takes any bytes-like object, not only ``bytes``, and may keep it: the
    #: WebSocket carrier hands over a read-only slice of the immutable bytes it read (an unmasked
    #: frame's payload) or a fresh ``bytearray`` unmasked in place, never a buffer reused later.
    readsBuffers = True

    def __init__(self, client: bool, config: SessionConfig | None = None,
                 acceptor: Callable[[Stream], object] | None = None, reactor=None):
        self.client = client
        self.config = config if config is not None else SessionConfig()
        self._acceptor = acceptor
        if reactor is None:
            from twisted.internet import reactor
        self._reactor = reactor
        self.state = SessionState.CONNECTING
        self.localGoAway = False    # we sent go-away(0): new inbound streams are refused
        self.remoteGoAway = False   # the peer sent go-away(0): we open no new streams
        self._ending: Exception | None = None
        self._decoder = FrameDecoder(max(self.config.max_window, self.config.auto_window))
        self._streams: dict[int, Stream] = {}
        self._rotation: deque[Stream] = deque()   # fair order for serving streams on resume
        self._next_id = 1 if client else 2
        # Lists, not deques: an empty deque is about 600 bytes, and a worker tunnel's session
        # (the frontend's end accepts no stream) never uses either; both stay short.
        self._backlog: list[Stream] = []
        self._accept_waiters: list[defer.Deferred] = []
        self._closed = OneShotObserver()
        self._paused = False
        self._owed = 0              # bytes of answers written since the carrier paused us
        self._reading_paused = False  # we paused the carrier's reading: the peer is not reading
        self._pings: dict[int, tuple[defer.Deferred, float]] = {}
        self._keepalive_opaque: int | None = None
        self._heard_at = 0.0        # reactor time of the last read from the carrier
        self._lingering: dict[int, object] = {}
        self._reading = 0           # > 0 while a read's frames are handled
        self._grants: dict[Stream, None] = {}  # streams whose window grant waits for its end
        # The bulk budget's counters and the window tuning's state, in one slotted object: a
        # session's instance dict stays within CPython's shared-key limit (29 attributes
        # here; one more makes every idle tunnel's session 1.3 KiB larger).
        self._flow = SessionFlow()
        # Wire bytes (headers included) read from and written to the carrier, for metrics:
        # one addition per read and per write call, never per stream.
        self.bytesReceived = 0
        self.bytesSent = 0

    # -- public API -----------------------------------------------------------------------

    @property
    def isOpen(self) -> bool:
        return self.state is SessionState.OPEN

    @property
    def streamCount(self) -> int:
        """Streams whose ids are live (including those waiting in the accept backlog)."""
        return len(self._streams)

    @property
    def ending(self) -> Exception | None:
        """Why the session ended (SessionEnded / SessionFailed / KeepaliveTimeout), or None."""
        return self._ending

    def openStream(self, protocol=None, data: bytes = b"") -> Stream:
        """Open a stream, connect ``protocol`` to it and return it.  ``data`` goes first (the
        SYN rides on it when the window is the default).  Raises ``SessionNotOpen``,
        ``TooManyStreams`` or ``StreamsExhausted``."""
        if self.state is not SessionState.OPEN:
            raise SessionNotOpen("the session is not open")
        if self.remoteGoAway:
            raise SessionNotOpen("the peer sent go-away")
        if len(self._streams) >= self.config.max_streams:
            raise TooManyStreams(f"{len(self._streams)} streams are open")
        stream_id = self._next_id
        if stream_id > _LAST_STREAM_ID:
            raise StreamsExhausted("no stream id left in this session")
        self._next_id += 2
        stream = self._addStream(stream_id, StreamState.SYN_SENT)
        stream._open(data)
        if protocol is not None and stream.protocol is None:
            stream.connectProtocol(protocol)
        return stream

    def accept(self) -> defer.Deferred:
        """A Deferred firing with the next inbound stream (already acknowledged).  Attach a
        protocol with ``stream.connectProtocol(p)``; until then its bytes wait, within its
        window."""
        if self._backlog:
            stream = self._backlog.pop(0)
            stream._sendAck()
            return defer.succeed(stream)
        if self.state is SessionState.ENDED:
            return defer.fail(self._ending)
        d = defer.Deferred(lambda d: self._accept_waiters.remove(d))
        self._accept_waiters.append(d)
        return d

    def ping(self) -> defer.Deferred:
        """Round-trip a ping; fires with the seconds it took, or fails when the session ends."""
        if self.state is not SessionState.OPEN:
            return defer.fail(SessionNotOpen("the session is not open"))
        d = defer.Deferred()
        opaque = self._nextOpaque()
        self._pings[opaque] = (d, self._reactor.seconds())
        self._sendFrame(Frame.ping(opaque))
        return d

    def goAway(self, code: int = GOAWAY_NORMAL) -> None:
        """Send go-away.  ``0``: refuse new inbound streams, keep the existing ones.  Any other
        code ends the session (``SessionFailed``)."""
        if self.state is not SessionState.OPEN:
            return
        if code == GOAWAY_NORMAL:
            if not self.localGoAway:
                self.localGoAway = True
                self._sendFrame(Frame.go_away(GOAWAY_NORMAL), urgent=False)
            return
        self._sendFrame(Frame.go_away(code), urgent=False)
        self._end(SessionFailed(f"local go-away ({_goAwayName(code)})"))
        self._closeTransport(abort=False)

    def loseConnection(self) -> None:
        """Normal local close: go-away(0), every stream ends with ``SessionEnded``, then the
        transport is closed (what was already written is flushed by it)."""
        if self.state is not SessionState.OPEN:
            return
        self.goAway(GOAWAY_NORMAL)
        self._end(SessionEnded("closed by the local side"))
        self._closeTransport(abort=False)

    def abort(self, reason=None) -> None:
        """End the session at once with ``SessionFailed`` (or ``reason`` if it already is a
        session ending) and abort the transport."""
        if self.state is SessionState.ENDED:
            return
        if not isinstance(reason, (SessionEnded, SessionFailed)):
            reason = SessionFailed(f"aborted: {reason}" if reason else "aborted")
        self._end(reason)
        self._closeTransport(abort=True)

    def whenClosed(self) -> defer.Deferred:
        """Fires (callback) with the ending exception once the session ended."""
        return self._closed.when()

    # -- Protocol -------------------------------------------------------------------------

    def connectionMade(self) -> None:
        self.state = SessionState.OPEN
        register = getattr(self.transport, "registerProducer", None)
        if register is not None:
            register(self, True)
        interval = self.config.keepalive_interval
        if interval:
            # One timer for every session of the reactor (mux/wheel.py), not two per session.
            wheel = wheel_for(self._reactor, common_tick(interval, self.config.keepalive_timeout))
            if self.config.keepalive_peer_pings or self.config.keepalive_on_silence:
                self._heard_at = self._reactor.seconds()  # silence counts from the opening
                silence = interval + self.config.keepalive_timeout
                wheel.later(wheel.ticks(silence, up=True), self._silenceCheck, wheel)
            if not self.config.keepalive_peer_pings:
                wheel.later(wheel.ticks(interval, up=False), self._keepaliveTick, wheel)

    def dataReceived(self, data) -> None:
        """Decode the read and handle its frames in order.  The hot path, a Data frame with no
        flags for a live stream (or a bare window update), goes straight to the stream with no
        ``Frame`` object; every other frame goes through ``_handleFrame``.  The streams' window
        grants are decided once, after the whole read was handled."""
        if self.state is not SessionState.OPEN:
            return
        self.bytesReceived += len(data)
        self._heard_at = self._reactor.seconds()
        if (len(data) == HEADER_SIZE and data[:8] == _PING_SYN_HEAD
                and not self._decoder.buffered):
            # A read that is one keepalive ping and nothing else (what an idle tunnel reads
            # every few seconds): answered without the decoder, a Frame or encode.
            if self._mayAnswer():
                self._sendEncoded(_PING_ACK_HEAD + bytes(data[8:]))
            return
        try:
            frames = self._decoder.decode(data)
        except FrameError as e:
            self._protocolError(str(e))
            return
        if not frames:
            return
        streams = self._streams
        self._reading += 1
        try:
            for fields in frames:
                if self.state is not SessionState.OPEN:
                    return
                ftype, flags, sid, length, payload = fields
                try:
                    if not flags and sid:
                        stream = streams.get(sid)
                        if stream is not None:
                            if ftype == TYPE_DATA:
                                stream._receiveData(payload)
                                continue
                            if ftype == TYPE_WINDOW_UPDATE:
                                if length:
                                    stream._receiveWindow(length)
                                continue
                    self._handleFrame(Frame(*fields))
                except ProtocolError as e:
                    self._protocolError(str(e))
                    return
                except Exception:
                    log.failure("yamux session failed handling {frame!r}", frame=Frame(*fields))
                    self._internalError()
                    return
        finally:
            self._reading -= 1
            if not self._reading and self._grants:
                self._grantPending()

    def _grantPending(self) -> None:
        """The window grants the read just handled put off: one decision per stream."""
        grants, self._grants = self._grants, {}
        if self.state is not SessionState.OPEN:
            return
        for stream in grants:
            stream._grantWindow()

    def connectionLost(self, reason: Failure = None) -> None:
        if self.state is SessionState.ENDED:
            return
        if reason is None or reason.check(ConnectionDone):
            ending = SessionEnded("the carrier closed")
        else:
            ending = SessionFailed(f"transport lost: {reason.getErrorMessage()}")
        self._end(ending)

    # -- IPushProducer: the transport's backpressure on us ---------------------------------

    def pauseProducing(self) -> None:
        """The transport's buffer is full: every stream's producer is paused."""
        if self._paused or self.state is not SessionState.OPEN:
            return
        self._paused = True
        for stream in list(self._streams.values()):
            stream._sessionPaused()

    def resumeProducing(self) -> None:
        """Serve streams fairly, stopping as soon as the transport pauses us again.

        First the bytes streams buffered while we were paused go out in rounds of one frame
        per stream (at most ``max_frame_size`` each, or 1/8 more to save a runt), control
        streams (those that have sent less than ``bulk_after``) first in every round, so a
        stream with a few bytes to send (a control call, a reply) leaves before the bulk
        streams' frames, never behind a whole window of theirs.  Then the streams' producers
        are resumed in rotation; the stream served last goes to the back, so the next resume
        starts with the next one.
        """
        if not self._paused:
            return
        self._paused = False
        self._owed = 0
        self._serve()
        if self._reading_paused and self.state is SessionState.OPEN:
            # The peer read what we owed it: read again (held input may be delivered now).
            self._reading_paused = False
            self.transport.resumeProducing()

    def _serve(self) -> None:
        """Buffered frames in rounds, control streams first, then producers in rotation (see
        ``resumeProducing``)."""
        after = self.config.bulk_after
        waiting = [s for s in self._rotation if s._out and s._sent < after]
        waiting += [s for s in self._rotation if s._out and s._sent >= after]
        while waiting and self._writable():
            waiting = [s for s in waiting if self._writable() and s._sessionResumedFrame()]
        for _ in range(len(self._rotation)):
            if self._paused or self.state is not SessionState.OPEN or not self._rotation:
                break
            stream = self._rotation[0]
            self._rotation.rotate(-1)
            stream._sessionResumed()

    def stopProducing(self) -> None:
        """The transport is going away; its connectionLost tells us how."""

    # -- frames in ------------------------------------------------------------------------

    def _handleFrame(self, frame: Frame) -> None:
        if frame.type == TYPE_PING:
            self._handlePing(frame)
        elif frame.type == TYPE_GO_AWAY:
            self._handleGoAway(frame)
        else:
            self._handleStreamFrame(frame)

    def _handlePing(self, frame: Frame) -> None:
        if frame.stream_id != 0:
            raise ProtocolError(f"ping on stream {frame.stream_id}")
        if frame.has(FLAG_SYN):
            # Answer at once, straight to the transport: never behind queued stream data.
            self._sendReply(Frame.ping(frame.length, ack=True))
            return
        opaque = frame.length
        if opaque == self._keepalive_opaque:
            self._keepalive_opaque = None  # its expiry, on the wheel, finds it answered
            if self.config.auto_window:
                self._rttSample(self._reactor.seconds() - self._flow.keepalive_sent)
            return
        probe = self._flow.probe
        if probe is not None and probe[0] == opaque:
            self._flow.probe = None
            self._rttSample(self._reactor.seconds() - probe[1])
            return
        mark = self._flow.budget_pings.pop(opaque, None)
        if mark is not None:
            blocked = self._budgetSpent()
            self._flow.data_acked = max(self._flow.data_acked, mark)
            if blocked and not self._budgetSpent() and self._writable():
                self._serve()
            return
        waiting = self._pings.pop(opaque, None)
        if waiting is not None:
            d, sent = waiting
            rtt = self._reactor.seconds() - sent
            self._rttSample(rtt)
            d.callback(rtt)

    def _handleGoAway(self, frame: Frame) -> None:
        if frame.stream_id != 0:
            raise ProtocolError(f"go-away on stream {frame.stream_id}")
        code = frame.length
        if code == GOAWAY_NORMAL:
            self.remoteGoAway = True
            return
        self._end(SessionFailed(f"peer sent go-away ({_goAwayName(code)})"))
        self._closeTransport(abort=False)

    def _handleStreamFrame(self, frame: Frame) -> None:
        sid = frame.stream_id
        if sid == 0:
            raise ProtocolError(f"{'data' if frame.type == TYPE_DATA else 'window update'} "
                                "frame on stream 0")
        stream = self._streams.get(sid)
        offered = False
        if frame.has(FLAG_SYN):
            if stream is not None:
                raise ProtocolError(f"SYN for live stream {sid}")
            if (sid % 2 == 1) == self.client:
                raise ProtocolError(f"peer opened stream {sid} with our id parity")
            if frame.has(FLAG_RST):
                return  # opened and aborted in one frame: nothing to do
            stream = self._incomingStream(sid)
            if stream is None:
                return  # refused with RST; any payload is dropped
            offered = True
        elif stream is None:
            return  # unknown or finished id: dropped quietly, as Go does

        if frame.has(FLAG_RST):
            stream._receiveReset()  # the length is opaque here (libp2p puts an error code)
            return
        if frame.has(FLAG_ACK):
            stream._receiveAck()
        if frame.type == TYPE_DATA:
            stream._receiveData(frame.payload)
        elif frame.length:
            stream._receiveWindow(frame.length)
        if frame.has(FLAG_FIN) and self._live(stream):
            stream._receiveFin()
        if offered and self._live(stream):
            self._offerStream(stream)

    def _live(self, stream: Stream) -> bool:
        return self.state is SessionState.OPEN and self._streams.get(stream.id) is stream

    def _incomingStream(self, sid: int) -> Stream | None:
        """Register an inbound stream, or refuse it with RST when we cannot take it."""
        if self.config.forbid_inbound_streams:
            raise ProtocolError(f"peer opened stream {sid}; it must never open streams")
        refuse = None
        if self.localGoAway:
            refuse = "after go-away"
        elif not self.config.accept_streams:
            refuse = "inbound streams not accepted"
        elif len(self._streams) >= self.config.max_streams:
            refuse = "too many streams"
        elif self._acceptor is None and len(self._backlog) >= self.config.accept_backlog:
            refuse = "accept backlog full"
        if refuse is not None:
            log.debug("refusing stream {sid}: {why}", sid=sid, why=refuse)
            self._sendReply(Frame.window_update(sid, 0, FLAG_RST))
            return None
        return self._addStream(sid, StreamState.SYN_RECEIVED)

    def _offerStream(self, stream: Stream) -> None:
        """Hand an inbound stream to the acceptor, to a waiting accept(), or to the backlog."""
        if self._acceptor is None:
            if self._accept_waiters:
                d = self._accept_waiters.pop(0)
                stream._sendAck()
                d.callback(stream)
            else:
                self._backlog.append(stream)
            return
        try:
            protocol = self._acceptor(stream)
        except Exception:
            log.failure("acceptor raised for {stream!r}; refusing it", stream=stream)
            protocol = None
        if not self._live(stream):
            return
        if protocol is None:
            stream._reset(remote=False, detail="refused")
            return
        stream._sendAck()
        stream.connectProtocol(protocol)

    # -- frames out and stream bookkeeping (used by Stream) --------------------------------

    def _writable(self) -> bool:
        """May stream data be written now?  Not while the transport has paused us."""
        return self.state is SessionState.OPEN and not self._paused

    def _writableFor(self, stream: Stream) -> bool:
        """May ``stream`` write now?  As ``_writable``, and a bulk stream not while the bulk
        budget is spent."""
        if self.state is not SessionState.OPEN or self._paused:
            return False
        return stream._sent < self.config.bulk_after or not self._budgetSpent()

    def _budgetSpent(self) -> bool:
        budget = self.config.bulk_in_flight
        return bool(budget) and self._flow.data_out - self._flow.data_acked >= budget

    def _sendFrame(self, frame: Frame, urgent: bool = True) -> None:
        """Write a frame that is not stream data (or an empty one: FIN, RST, ACK).  ``urgent``:
        it may overtake the Data frames still held by a carrier that offers ``writeUrgent``
        (see ``_urgentFor``); the caller says False for any frame that must stay behind what
        was written before it."""
        self._sendEncoded(encode(frame), urgent)

    def _sendEncoded(self, raw: bytes, urgent: bool = True) -> None:
        """``_sendFrame`` of a frame already encoded."""
        transport = self.transport
        if self.state is not SessionState.OPEN or transport is None:
            return
        self.bytesSent += len(raw)
        if urgent and getattr(transport, "writesUrgent", False):
            transport.writeUrgent(raw)
        else:
            transport.write(raw)

    def _urgentFor(self, stream: Stream) -> bool:
        """May a frame of ``stream`` overtake the Data frames the carrier still holds?  Yes while
        the stream is a control stream: it has sent less than ``bulk_after`` bytes before this
        frame, so none of its frames went the plain way yet and its own order is kept (urgent
        frames leave in the order they were written, ahead of every plain one).  Once it has
        sent that much it is a bulk stream for good, and its frames (FIN, RST included) queue
        behind the bulk frames before them."""
        return stream._sent < self.config.bulk_after

    def _sendReply(self, frame: Frame) -> None:
        """Write an answer the peer asked for (ping reply, RST of a refused SYN)."""
        if self._mayAnswer():
            self._sendFrame(frame)

    def _mayAnswer(self) -> bool:
        """Count an answer while the carrier has paused us: a peer that asks without reading
        the answers is held off (we stop reading it) and, past ``reply_cap``, dropped (False:
        send nothing)."""
        if self._paused and self.state is SessionState.OPEN:
            self._owed += HEADER_SIZE
            if self._owed > self.config.reply_cap:
                self._peerNotReading()
                return False
            if self._owed > self.config.reply_high_water and not self._reading_paused:
                pause = getattr(self.transport, "pauseProducing", None)
                if pause is not None:
                    self._reading_paused = True
                    pause()
        return True

    def _peerNotReading(self) -> None:
        log.warn("yamux peer is not reading: more than {cap} bytes of answers to its pings and "
                 "streams are waiting behind a full carrier; ending the session",
                 cap=self.config.reply_cap)
        self._end(SessionFailed(f"peer not reading: more than {self.config.reply_cap} bytes "
                                "of answers unread"))
        self._closeTransport(abort=True)

    def _sendData(self, stream_id: int, flags: int, parts: list, length: int,
                  urgent: bool = False) -> None:
        """Write one Data frame whose payload is ``parts`` (``length`` bytes in all, at least
        one).  ``urgent`` (a control stream's frame, ``_urgentFor``): joined and written with
        ``writeUrgent`` where the transport offers it, ahead of held bulk frames.  Otherwise a
        transport that declares ``writesPieces`` (the WebSocket carrier, which joins a whole
        message's pieces once anyway) is given the header and the pieces as they are,
        writev-style; any other gets them joined once, with no intermediate payload copy."""
        transport = self.transport
        if self.state is not SessionState.OPEN or transport is None:
            return
        self.bytesSent += HEADER_SIZE + length
        budget = self.config.bulk_in_flight
        if budget:
            self._flow.data_out += HEADER_SIZE + length
        header = HEADER.pack(VERSION, TYPE_DATA, flags, stream_id, length)
        if urgent and getattr(transport, "writesUrgent", False):
            transport.writeUrgent(b"".join([header, *parts]))
        elif getattr(transport, "writesPieces", False):
            transport.writePieces([header, *parts], HEADER_SIZE + length)
        else:
            transport.write(b"".join([header, *parts]))
        if budget and self._flow.data_out - self._flow.budget_mark >= budget // 4:
            # Acknowledge what was written so far: the reply comes once the peer read it all,
            # so this ping must not overtake the frames before it (never urgent).
            self._flow.budget_mark = self._flow.data_out
            opaque = self._nextOpaque()
            self._flow.budget_pings[opaque] = self._flow.data_out
            self._sendFrame(Frame.ping(opaque), urgent=False)

    def _addStream(self, sid: int, state: StreamState) -> Stream:
        stream = Stream(self, sid, state)
        self._streams[sid] = stream
        self._rotation.append(stream)
        return stream

    # -- receive-window auto-tuning (used by Stream; the rule is in mux/autowindow.py) ------

    def _rttSample(self, rtt: float) -> None:
        """A measured round trip.  The estimate is the smallest sample of the last
        ``rtt_max_age`` seconds (the path's own delay): a ping answered behind our own bulk
        bytes measures the queue a grown window made, and a window grown on that would only
        make the queue longer.  A stale minimum is replaced by the next sample."""
        now = self._reactor.seconds()
        if self._flow.rtt is None or rtt <= self._flow.rtt or now - self._flow.rtt_at > self.config.rtt_max_age:
            self._flow.rtt = rtt
            self._flow.rtt_at = now

    def _rttEstimate(self) -> float | None:
        """The minimum round trip (``_rttSample``), or None before the first sample.  Each
        call (a stream's window epoch ending) sends a probe ping unless one is out already, so
        a window that is being tuned is fed a sample per epoch, and the minimum over them is the
        path's delay rather than our own queue.  The probe never overtakes the Data frames we
        wrote; the peer answers it first (a few dozen bytes per 128 KiB or more granted)."""
        if self._flow.probe is None and self.state is SessionState.OPEN:
            opaque = self._nextOpaque()
            self._flow.probe = (opaque, self._reactor.seconds())
            self._sendFrame(Frame.ping(opaque))
        return self._flow.rtt

    def _resizeWindow(self, stream: Stream, wanted: int) -> int:
        """Move ``stream``'s receive window to ``wanted``: a shrink always, a growth only as
        far as the session's and the pool's budgets allow.  Returns the window it got."""
        current = stream._window
        pool = self.config.window_pool
        if wanted <= current:
            freed = current - wanted
            self._flow.extra -= freed
            if pool is not None:
                pool.give(freed)
            return wanted
        room = min(wanted - current, self.config.session_window - self._flow.extra)
        if pool is not None and room > 0:
            room = pool.take(room)
        room = max(0, room)
        self._flow.extra += room
        return current + room

    def _forgetStream(self, stream: Stream) -> None:
        """The id is finished on the wire; later frames for it are dropped quietly."""
        if stream._tuner is not None and stream._window > self.config.max_window:
            self._resizeWindow(stream, self.config.max_window)
            stream._window = self.config.max_window
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]
            self._rotation.remove(stream)
            if stream in self._backlog:
                self._backlog.remove(stream)
        timer = self._lingering.pop(stream.id, None)
        if timer is not None and timer.active():
            timer.cancel()

    def _lingerStream(self, stream: Stream) -> None:
        """Our side closed; give the peer ``linger_timeout`` to send its FIN, then reset."""
        timeout = self.config.linger_timeout
        if not timeout or stream.id in self._lingering or not self._live(stream):
            return
        self._lingering[stream.id] = self._reactor.callLater(
            timeout, stream._reset, False, "no FIN from the peer")

    # -- keepalive ------------------------------------------------------------------------

    def _nextOpaque(self) -> int:
        """A random opaque value, not one in flight: a counter would let a peer that reads
        nothing keep the keepalive satisfied with blind replies for 0, 1, 2, ..."""
        while True:
            opaque = secrets.randbits(32)
            if (opaque not in self._pings and opaque != self._keepalive_opaque
                    and opaque not in self._flow.budget_pings
                    and (self._flow.probe is None or opaque != self._flow.probe[0])):
                return opaque

    def _keepaliveTick(self, wheel) -> None:
        """Every ``keepalive_interval`` on the wheel: the next tick, then a ping (unless the
        previous one is still running its timeout), whose expiry is ``keepalive_timeout``
        later on the same wheel."""
        if self.state is not SessionState.OPEN:
            return
        interval = self.config.keepalive_interval
        if self.config.keepalive_when_quiet:
            # Heard from the peer less than an interval ago: that proves it alive as well as an
            # answer would.  Look again an interval after that read (rounded down to ticks, so
            # never later): a carrier silent since then still gets its ping then, and is
            # declared dead interval + timeout after its last byte, as without this rule.
            quiet = self._reactor.seconds() - self._heard_at
            if quiet < interval - wheel.tick / 2:
                wheel.later(wheel.ticks(interval - quiet, up=False), self._keepaliveTick, wheel)
                return
        wheel.later(wheel.ticks(interval, up=False), self._keepaliveTick, wheel)
        # keepalive_on_silence: no expiry of its own (the silence check ends the session), and
        # a ping whose answer is late is not waited for, so the peer hears from us every interval.
        expires = not self.config.keepalive_on_silence
        if expires and self._keepalive_opaque is not None:
            return  # the previous keepalive ping is still running its own timeout
        opaque = self._keepalive_opaque = self._nextOpaque()
        self._flow.keepalive_sent = self._reactor.seconds()
        if expires:
            wheel.later(wheel.ticks(self.config.keepalive_timeout, up=True),
                        self._keepaliveCheck, opaque, at_least=True)
        self._sendFrame(Frame.ping(opaque))

    def _silenceCheck(self, wheel, second_look: bool = False) -> None:
        """``keepalive_peer_pings`` and ``keepalive_on_silence``: the session ends once nothing
        was read for interval + timeout (to within half a tick), else looks again when that
        would be.  One wheel call per session per interval + timeout on an idle tunnel."""
        if self.state is not SessionState.OPEN:
            return
        silence = self.config.keepalive_interval + self.config.keepalive_timeout
        quiet = self._reactor.seconds() - self._heard_at
        if quiet < silence - wheel.tick / 2:
            wheel.later(wheel.ticks(silence - quiet, up=True), self._silenceCheck, wheel)
            return
        if not second_look:
            # Timers run before the reactor reads, so after a stall of our own (a long
            # collection, a thread holding the GIL) the peer's pings may be waiting unread in
            # the socket: look again once the reactor has read what is there.
            self._reactor.callLater(0, self._silenceCheck, wheel, True)
            return
        log.warn("yamux keepalive: nothing read from the peer for {t}s", t=silence)
        self._end(KeepaliveTimeout(silence))
        self._closeTransport(abort=True)

    def _keepaliveCheck(self, opaque: int, second_look: bool = False) -> None:
        """A keepalive ping's expiry: the session ends if it is still unanswered -- after a
        second look, as in :meth:`_silenceCheck`: after a stall of our own the answer may be
        waiting unread in the socket, and timers run before the reactor reads."""
        if self.state is not SessionState.OPEN or self._keepalive_opaque != opaque:
            return
        if not second_look:
            self._reactor.callLater(0, self._keepaliveCheck, opaque, True)
            return
        self._keepaliveExpired()

    def _keepaliveExpired(self) -> None:
        log.warn("yamux keepalive: no ping reply within {t}s", t=self.config.keepalive_timeout)
        self._end(KeepaliveTimeout(self.config.keepalive_timeout))
        self._closeTransport(abort=True)

    # -- endings --------------------------------------------------------------------------

    def _protocolError(self, detail: str) -> None:
        log.warn("yamux protocol error from peer: {detail}", detail=detail)
        self._sendFrame(Frame.go_away(GOAWAY_PROTOCOL_ERROR), urgent=False)
        self._end(SessionFailed(f"protocol error: {detail}"))
        self._closeTransport(abort=False)

    def _internalError(self) -> None:
        self._sendFrame(Frame.go_away(GOAWAY_INTERNAL_ERROR), urgent=False)
        self._end(SessionFailed("internal error"))
        self._closeTransport(abort=False)

    def _closeTransport(self, abort: bool) -> None:
        transport = self.transport
        if transport is None:
            return
        if abort and hasattr(transport, "abortConnection"):
            transport.abortConnection()
        else:
            transport.loseConnection()

    def _end(self, reason: Exception) -> None:
        """Tear everything down once: timers, streams (each protocol told ``reason``), pending
        pings and accepts, then whoever waits in ``whenClosed``."""
        if self.state is SessionState.ENDED:
            return
        self.state = SessionState.ENDED
        self._ending = reason
        for timer in self._lingering.values():
            if timer.active():
                timer.cancel()
        self._lingering.clear()
        streams = list(self._streams.values())
        self._streams.clear()
        self._rotation.clear()
        self._backlog.clear()
        for stream in streams:
            stream._sessionEnded(reason)
        pings, self._pings = self._pings, {}
        for d, _ in pings.values():
            d.errback(Failure(reason))
        waiters, self._accept_waiters = self._accept_waiters, []
        for d in waiters:
            d.errback(Failure(reason))
        self._closed.fire(reason)


class ByteTally:
    """Wire bytes of a set of sessions, live and ended (for a metric that must never go down
    when a session ends)."""

    def __init__(self):
        self._live: set[Session] = set()
        self._ended = [0, 0]

    def watch(self, session: Session) -> None:
        """Count ``session`` until it ends, then keep its totals."""
        if session in self._live:
            return
        self._live.add(session)
        session.whenClosed().addBoth(lambda _: self._ended_session(session))

    def _ended_session(self, session: Session) -> None:
        if session in self._live:
            self._live.discard(session)
            self._ended[0] += session.bytesReceived
            self._ended[1] += session.bytesSent

    def totals(self) -> tuple[int, int]:
        """(received, sent) by every session watched, ended ones included."""
        received, sent = self._ended
        for session in self._live:
            received += session.bytesReceived
            sent += session.bytesSent
        return received, sent


def _goAwayName(code: int) -> str:
    return GOAWAY_NAMES.get(code, f"unknown code {code}")
