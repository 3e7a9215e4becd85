"""One yamux stream: the transport a protocol rides, with per-stream flow control.

A ``Stream`` is, at once, an ``ITransport`` for the protocol connected to it, an
``IPushProducer`` of its inbound bytes (whoever consumes it may pause it) and an ``IConsumer``
of outbound bytes (a producer may be registered on it).  It is modelled on Twisted's HTTP/2
``H2Stream``:

* outbound writes are cut at the peer's send window and at ``max_frame_size``; what does not
  fit waits in the stream, and the registered producer is paused until a window update (or the
  session's resume) lets the buffer drain;
* inbound bytes are handed to the protocol only while the stream is not paused, and receive
  window is granted back only for bytes actually handed over (Go's rule: once at least half of
  the maximum window can be granted), so a paused consumer makes the remote writer stop.

It must never send more payload than the peer granted, never grant window for bytes the
protocol has not been given, never hand bytes to a paused consumer, and never call
``connectionLost`` more than once.  Everything wire-related goes through the session.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import (
    IAddress,
    IConsumer,
    IHalfCloseableProtocol,
    IPushProducer,
    ITransport,
)
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from localai_tw.mux.autowindow import WindowTuner
from localai_tw.mux.errors import ProtocolError, StreamClosed, StreamReset
from localai_tw.mux.frame import FLAG_ACK, FLAG_FIN, FLAG_RST, FLAG_SYN, INITIAL_WINDOW, Frame

if TYPE_CHECKING:  # pragma: no cover
    from localai_tw.mux.session import Session

log = Logger()


class StreamState(enum.Enum):
    """Where a stream is in its life, from the wire's point of view (Go uses the same set)."""

    IDLE = "idle"
    SYN_SENT = "syn-sent"
    SYN_RECEIVED = "syn-received"
    OPEN = "open"
    HALF_CLOSED_LOCAL = "half-closed-local"    # we sent FIN
    HALF_CLOSED_REMOTE = "half-closed-remote"  # we received FIN
    CLOSED = "closed"                          # FIN both ways, or the session ended
    RESET = "reset"                            # RST either way

    # Members are singletons compared by identity, so identity hashing is correct, and it is
    # C code where Enum's own __hash__ is Python: TRANSITIONS is looked up on every handshake
    # and ending.
    __hash__ = object.__hash__


class StreamEvent(enum.Enum):
    """What moves a stream from one :class:`StreamState` to another."""

    ACK_SENT = "ack-sent"
    ACK_RECEIVED = "ack-received"
    FIN_SENT = "fin-sent"
    FIN_RECEIVED = "fin-received"
    RESET = "reset"                  # RST sent or received
    SESSION_ENDED = "session-ended"

    __hash__ = object.__hash__  # as StreamState's


def _table() -> dict[tuple[StreamState, StreamEvent], StreamState]:
    S, E = StreamState, StreamEvent
    live = (S.SYN_SENT, S.SYN_RECEIVED, S.OPEN, S.HALF_CLOSED_LOCAL, S.HALF_CLOSED_REMOTE)
    table = {}
    for state in (*live, S.CLOSED, S.RESET):
        # The first frame we send on an accepted stream carries its ACK; a late ACK either
        # way (after a FIN or an ending) changes nothing.
        table[state, E.ACK_SENT] = S.OPEN if state is S.SYN_RECEIVED else state
        table[state, E.ACK_RECEIVED] = S.OPEN if state is S.SYN_SENT else state
    for state in live:
        if state is not S.HALF_CLOSED_LOCAL:
            table[state, E.FIN_SENT] = (S.CLOSED if state is S.HALF_CLOSED_REMOTE
                                        else S.HALF_CLOSED_LOCAL)
        if state is not S.HALF_CLOSED_REMOTE:
            table[state, E.FIN_RECEIVED] = (S.CLOSED if state is S.HALF_CLOSED_LOCAL
                                            else S.HALF_CLOSED_REMOTE)
    for state in (*live, S.CLOSED):
        # CLOSED -> RESET: FIN went both ways but the protocol still had bytes to take.
        table[state, E.RESET] = S.RESET
        table[state, E.SESSION_ENDED] = S.CLOSED
    # A reset stays reset, even if the session ends while the RST is being written.
    table[S.RESET, E.SESSION_ENDED] = S.RESET
    return table


#: Every allowed (state, event) pair and the state it leads to; a pair not in here is refused
#: (``IllegalTransition``).  ``IDLE`` is the state before any event and has none of its own.
#: Only endings and the SYN/ACK/FIN handshake go through it, never a Data frame.
TRANSITIONS: dict[tuple[StreamState, StreamEvent], StreamState] = _table()


class IllegalTransition(RuntimeError):
    """A (state, event) pair the table refuses: a bug in the caller, never the peer's doing
    (the peer's wrong FIN is a ``ProtocolError`` found before the table is asked)."""


def _accepting(event: StreamEvent) -> tuple[StreamState, ...]:
    # Tuples, not sets: membership is then an identity check in C, the cheapest test on the
    # per-frame path.  OPEN comes first: it is the state nearly every frame finds.
    order = (StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE, StreamState.HALF_CLOSED_LOCAL,
             StreamState.SYN_SENT, StreamState.SYN_RECEIVED, StreamState.IDLE,
             StreamState.CLOSED, StreamState.RESET)
    return tuple(state for state in order if (state, event) in TRANSITIONS)


_LOCAL_OPEN = _accepting(StreamEvent.FIN_SENT)        # we may still write and send FIN
_REMOTE_OPEN = _accepting(StreamEvent.FIN_RECEIVED)   # the peer may still send data and FIN
_FINISHED = (StreamState.CLOSED, StreamState.RESET)

#: A Data frame may exceed ``max_frame_size`` by up to 1/RUNT_SLACK of it when that sends what
#: is left in one frame instead of a full frame and a runt (``Stream._flush``).
RUNT_SLACK = 8


@implementer(IAddress)
@dataclass(frozen=True)
class MuxAddress:
    """The address of a stream: its id, and the address of the carrying transport."""

    stream_id: int
    carrier: Any = None


@implementer(ITransport, IPushProducer, IConsumer)
class Stream:
    """A yamux stream.  Created by ``Session``; applications never construct one."""

    def __init__(self, session: "Session", stream_id: int, state: StreamState):
        self.session = session
        self.id = stream_id
        self.state = state
        self.protocol = None
        self.connected = False       # a protocol is attached and not yet told connectionLost
        self.disconnecting = False   # loseConnection was called
        self._ending: Exception | None = None  # why the stream ended, once it did
        self._syn_pending = state is StreamState.SYN_SENT
        self._ack_pending = state is StreamState.SYN_RECEIVED

        # outbound: bytes the application wrote that the peer has not granted window for yet
        self._send_window = INITIAL_WINDOW
        self._out: deque[bytes] = deque()
        self._out_size = 0
        self._out_offset = 0         # bytes of _out[0] already sent
        self._sent = 0               # payload bytes sent in all (past bulk_after: a bulk stream)
        self._fin_pending = False    # loseWriteConnection asked for FIN after the buffer drains
        self._producer = None
        self._streaming = False
        self._producer_paused = False
        self._pulling = False

        # inbound: bytes received but not yet handed to the protocol
        self._recv_window = INITIAL_WINDOW
        # With auto-tuning: our receive window's size and the epoch (one slotted object, so
        # the instance dict stays within CPython's shared-key limit: 29 attributes here).
        self._tuner = (WindowTuner(session.config.max_window) if session.config.auto_window
                       else None)
        self._in: deque[bytes] = deque()
        self._in_size = 0
        self._paused = False         # pauseProducing by our consumer
        self._delivering = False
        self._discard = False        # after loseConnection: inbound bytes are dropped
        self._eof_delivered = False
        self._write_lost_delivered = False
        self._linger = None

    @property
    def disconnected(self) -> bool:
        """The stream has ended for its protocol (``connectionLost`` was or will be its last
        call)."""
        return self._ending is not None

    @property
    def ending(self) -> Exception | None:
        """The reason passed to ``connectionLost``, once the stream ended."""
        return self._ending

    def __repr__(self) -> str:
        return f"<Stream id={self.id} {self.state.value}>"

    # -- ITransport ------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Queue ``data``; it goes out as the peer's window allows.  Dropped once closing."""
        if not data or not self._canWrite():
            return
        self._out.append(bytes(data))
        self._out_size += len(data)
        self._flush()
        self._updateProducer()

    def writeSequence(self, data) -> None:
        self.write(b"".join(data))

    def loseConnection(self) -> None:
        """Flush what was written, send FIN, and stop reading: the protocol is told
        ``connectionLost(StreamClosed)`` once FIN went out, on a later reactor turn (as TCP
        does: callers such as twisted.web's HTTP client set up their wait for
        ``connectionLost`` after calling ``loseConnection``)."""
        if self.disconnecting or self._ending is not None:
            return
        self.disconnecting = True
        self._dropInbound()
        self.loseWriteConnection()
        self._maybeFinish()

    def loseWriteConnection(self) -> None:
        """Half-close: flush, then send FIN once; reading goes on."""
        if self._fin_pending or not self._canSendFin():
            return
        self._fin_pending = True
        self._flush()

    def abortConnection(self) -> None:
        """Reset the stream now: RST to the peer, buffered bytes dropped both ways.  The
        protocol's ``connectionLost`` follows on a later reactor turn, as for TCP."""
        self._reset(remote=False, later=True)

    def logPrefix(self) -> str:
        return f"yamux-stream-{self.id}"

    def getPeer(self) -> MuxAddress:
        return MuxAddress(self.id, self._carrierAddress("getPeer"))

    def getHost(self) -> MuxAddress:
        return MuxAddress(self.id, self._carrierAddress("getHost"))

    def _carrierAddress(self, which: str):
        transport = self.session.transport
        getter = getattr(transport, which, None)
        return getter() if getter is not None else None

    # -- IPushProducer: our inbound bytes --------------------------------------------------

    def pauseProducing(self) -> None:
        """Stop handing bytes to the protocol; the peer keeps only its remaining window (and
        an auto-tuned window halves at its next grant instead of growing)."""
        self._paused = True
        if self._tuner is not None:
            self._tuner.paused = True

    def resumeProducing(self) -> None:
        """Hand over what was buffered, then grant window for it."""
        if not self._paused:
            return
        self._paused = False
        self._deliver()

    def stopProducing(self) -> None:
        """Our consumer went away for good: close the stream, as a TCP transport does."""
        self.loseConnection()

    # -- IConsumer: our outbound bytes -----------------------------------------------------

    def registerProducer(self, producer, streaming: bool) -> None:
        if self._producer is not None:
            raise RuntimeError(
                f"Cannot register producer {producer!r}: {self._producer!r} is still registered")
        if not self._canWrite():
            self._callProducer(producer.stopProducing)
            return
        self._producer = producer
        self._streaming = bool(streaming)
        self._producer_paused = False
        self._updateProducer()

    def unregisterProducer(self) -> None:
        self._producer = None
        self._producer_paused = False

    # -- connecting a protocol -------------------------------------------------------------

    def connectProtocol(self, protocol) -> None:
        """Attach ``protocol`` (``makeConnection``) and start handing it buffered bytes.

        Used for streams taken from ``Session.accept()``; ``openStream`` and the acceptor
        callback do it for you.
        """
        if self.protocol is not None:
            raise RuntimeError(f"{self!r} already has a protocol")
        self.protocol = protocol
        if self._ending is not None:
            # The stream died before anyone took it: the protocol still learns how.
            try:
                protocol.makeConnection(self)
                protocol.connectionLost(Failure(self._ending))
            except Exception:
                log.failure("protocol of dead {stream!r} raised", stream=self)
            return
        self.connected = True
        if not self._guarded(protocol.makeConnection, self):
            return
        self._deliver()

    # -- outbound machinery ----------------------------------------------------------------

    def _canWrite(self) -> bool:
        return self.state in _LOCAL_OPEN and not self._fin_pending and not self.disconnecting

    def _canSendFin(self) -> bool:
        return self.state in _LOCAL_OPEN

    def _takeOpenFlags(self) -> int:
        """A SYN or ACK we still owe rides on the first frame we send."""
        if self._syn_pending:
            self._syn_pending = False
            return FLAG_SYN
        if self._ack_pending:
            self._ack_pending = False
            self._move(StreamEvent.ACK_SENT)
            return FLAG_ACK
        return 0

    def _flush(self, frames: int = -1) -> bool:
        """Send as much buffered data as the window, the frame size and the session allow (at
        most ``frames`` Data frames when that is not negative: the session's round robin on
        resume); then FIN if it was asked for and everything went.  Returns whether this stream
        still holds bytes it could send now (window left, session writable).

        A frame carries at most ``max_frame_size`` bytes, or all that can be sent now when that
        is at most 1/``RUNT_SLACK`` more: a 64 KiB write (a file body's chunk) or a window's worth
        then goes as one frame instead of a full frame and a runt of a few bytes, which would
        cost the sender and the receiver (and its protocol's ``dataReceived``) as much as the
        full one.

        FIN always goes on its own window update, never on the last Data frame: Go df201c7
        handles the FIN flag before it buffers the payload of the same frame, so its reader can
        see end-of-stream first and lose those bytes (the Go interop suite checks this)."""
        session = self.session
        max_frame = session.config.max_frame_size
        runt_bound = max_frame + max_frame // RUNT_SLACK
        while self._out and self._send_window > 0 and frames and session._writableFor(self):
            take = min(self._send_window, self._out_size)
            if take > runt_bound:
                take = max_frame
            parts = self._popOut(take)
            self._send_window -= take
            urgent = session._urgentFor(self)
            self._sent += take
            session._sendData(self.id, self._takeOpenFlags(), parts, take, urgent)
            frames -= 1
            if self.state in _FINISHED:  # a producer or the transport reset us meanwhile
                return False
        if not self._out and self._fin_pending and self.state in _LOCAL_OPEN:
            flags = self._takeOpenFlags() | FLAG_FIN
            session._sendFrame(Frame.window_update(self.id, 0, flags), session._urgentFor(self))
            self._finSent()
        return bool(self._out) and self._send_window > 0 and session._writableFor(self)

    def _popOut(self, size: int) -> list:
        """Take ``size`` bytes off the front, as a list of pieces (whole chunks, or memoryviews
        into them).  A large write is consumed through an offset into its first chunk, and the
        session joins the pieces with the frame header, so each byte is copied once on its way
        to the transport, not once per frame plus once more for the header."""
        parts = []
        need = size
        out = self._out
        while need:
            head = out[0]
            offset = self._out_offset
            available = len(head) - offset
            if available <= need:
                parts.append(head if not offset else memoryview(head)[offset:])
                out.popleft()
                self._out_offset = 0
                need -= available
            else:
                parts.append(memoryview(head)[offset:offset + need])
                self._out_offset = offset + need
                need = 0
        self._out_size -= size
        return parts

    def _finSent(self) -> None:
        # A registered producer stays registered (as on a half-closed TCP transport); it is
        # stopped when the stream ends.
        self._move(StreamEvent.FIN_SENT)
        if (not self.disconnecting and not self._write_lost_delivered and self.connected
                and IHalfCloseableProtocol.providedBy(self.protocol)):
            self._write_lost_delivered = True
            self._guarded(self.protocol.writeConnectionLost)
        self._maybeFinish()

    def _updateProducer(self) -> None:
        """Pause the producer while our bytes cannot go out; resume (or pull) when they can.

        Blocked means the session is paused or this stream still holds unsent bytes (its window
        ran out).  Only this stream's producer is touched: other streams have their own windows.
        """
        producer = self._producer
        if producer is None:
            return
        blocked = bool(self._out) or not self.session._writableFor(self)
        if self._streaming:
            if blocked and not self._producer_paused:
                self._producer_paused = True
                self._callProducer(producer.pauseProducing)
            elif not blocked and self._producer_paused:
                self._producer_paused = False
                self._callProducer(producer.resumeProducing)
        elif not blocked:
            self._pull()

    def _pull(self) -> None:
        """Ask a pull producer for chunks while there is room; a loop, never recursion."""
        if self._pulling:
            return
        self._pulling = True
        try:
            while (self._producer is not None and not self._streaming and not self._out
                   and self._send_window > 0 and self.session._writableFor(self)
                   and self._canWrite()):
                before = self._out_size, self._send_window
                self._callProducer(self._producer.resumeProducing)
                if (self._out_size, self._send_window) == before:
                    break  # it will write later; that write pulls again
        finally:
            self._pulling = False

    def _callProducer(self, method) -> None:
        try:
            method()
        except Exception:
            log.failure("producer of {stream!r} raised; resetting the stream", stream=self)
            self._reset(remote=False)

    # -- called by the session -------------------------------------------------------------

    def _sessionPaused(self) -> None:
        self._updateProducer()

    def _sessionResumed(self) -> None:
        self._flush()
        self._updateProducer()

    def _sessionResumedFrame(self) -> bool:
        """One round of the session's round robin: at most one frame of what was buffered while
        the session was paused.  True if more could go."""
        return self._flush(1)

    def _open(self, data: bytes) -> None:
        """Announce the stream.  With data and the default window the SYN rides the first
        Data frame; otherwise it goes on a window update that carries any window beyond
        256 KiB, as Go does.  Either way the SYN has been written when this returns."""
        if data and self._grantDelta() == 0:
            self.write(data)
            data = b""
        if self._syn_pending:
            self._grantWindow(self._takeOpenFlags())
        if data:
            self.write(data)

    def _sendAck(self) -> None:
        """Accept the stream; the ACK carries any extra window."""
        if not self._ack_pending:
            return
        self._grantWindow(self._takeOpenFlags())

    def _receiveWindow(self, delta: int) -> None:
        self._send_window += delta
        self._flush()
        self._updateProducer()

    def _receiveAck(self) -> None:
        self._move(StreamEvent.ACK_RECEIVED)

    def _receiveData(self, payload: bytes) -> None:
        if self.state not in _REMOTE_OPEN:
            raise ProtocolError(f"data on stream {self.id} after its FIN")
        if len(payload) > self._recv_window:
            raise ProtocolError(
                f"stream {self.id}: {len(payload)} bytes beyond the granted window "
                f"of {self._recv_window}")
        if not payload:
            return
        self._recv_window -= len(payload)
        tuner = self._tuner
        if tuner is not None:
            tuner.received += len(payload)
        if self._discard:
            self._grantWindow()
            return
        self._in.append(payload)
        self._in_size += len(payload)
        self._deliver()

    def _receiveFin(self) -> None:
        if self.state not in _REMOTE_OPEN:
            raise ProtocolError(f"second FIN on stream {self.id}")
        self._move(StreamEvent.FIN_RECEIVED)
        self._deliver()
        self._maybeFinish()

    def _receiveReset(self) -> None:
        self._reset(remote=True)

    def _sessionEnded(self, reason: Exception) -> None:
        """The whole session is gone: drop everything and tell the protocol why."""
        if self.state in _FINISHED and self._ending is not None:
            return
        self._move(StreamEvent.SESSION_ENDED)
        self._clearBuffers()
        self._end(reason)

    # -- inbound machinery -----------------------------------------------------------------

    def _deliver(self) -> None:
        """Hand buffered bytes to the protocol until it pauses us; then grant window for what
        it took, then report EOF if the peer's FIN came and nothing is left."""
        if self._delivering or self.protocol is None or not self.connected:
            return
        self._delivering = True
        try:
            while self._in and not self._paused and self.connected:
                chunk = self._in.popleft()
                self._in_size -= len(chunk)
                if not self._guarded(self.protocol.dataReceived, chunk):
                    return
            if not self.connected:
                return
            session = self.session
            if session._reading:
                session._grants[self] = None  # decided once the whole read was handled
            else:
                self._grantWindow()
            if (not self._in and not self._paused and not self._eof_delivered
                    and self.state in (StreamState.HALF_CLOSED_REMOTE, StreamState.CLOSED)):
                self._eof_delivered = True
                if IHalfCloseableProtocol.providedBy(self.protocol):
                    if not self._guarded(self.protocol.readConnectionLost):
                        return
                else:
                    self.loseConnection()  # like TCP: no half-close support, the stream closes
                self._maybeFinish()
        finally:
            self._delivering = False

    def _dropInbound(self) -> None:
        self._discard = True
        self._in.clear()
        self._in_size = 0
        self._eof_delivered = True
        if self.state in _REMOTE_OPEN:
            self._grantWindow()

    @property
    def _window(self) -> int:
        """Our receive window's size: ``max_window``, or as auto-tuning resized it."""
        tuner = self._tuner
        return tuner.window if tuner is not None else self.session.config.max_window

    @_window.setter
    def _window(self, size: int) -> None:
        self._tuner.window = size

    def _grantDelta(self) -> int:
        return (self._window - self._in_size) - self._recv_window

    def _grantWindow(self, flags: int = 0) -> None:
        """Go's rule: send ``(max - buffered) - window`` once it reaches half the maximum, or
        whenever a flag (ACK) has to go out anyway.  With auto-tuning on, the maximum is this
        stream's own window, resized (``_tuneWindow``) just before each such grant."""
        if self.state not in _REMOTE_OPEN and not flags:
            return  # the peer sent FIN: it will not use more window
        delta = self._grantDelta()
        if not flags and delta < self._window // 2:
            return
        if not flags and self._tuner is not None:
            self._tuneWindow()
            delta = self._grantDelta()
            if delta < self._window // 2:
                return
        if delta <= 0 and not flags:
            return
        delta = max(delta, 0)
        self._recv_window += delta
        # A bare grant may overtake anything (it is about the other direction); one that
        # carries SYN or ACK keeps this stream's order.
        self.session._sendFrame(Frame.window_update(self.id, delta, flags),
                                not flags or self.session._urgentFor(self))

    def _tuneWindow(self) -> None:
        """One epoch of receive-window auto-tuning (``mux/autowindow.py``) ends here."""
        session = self.session
        now = session._reactor.seconds()
        tuner = self._tuner
        consumed = tuner.received - self._in_size
        if tuner.epoch_start is None:
            # The first grant starts the first epoch; the round trip is asked for now, so a
            # sample is there (or on its way) when the epoch ends.
            tuner.start(now, consumed)
            session._rttEstimate()
            return
        config = session.config
        wanted = tuner.decide(now, consumed, self._window, config.max_window,
                              config.auto_window, session._rttEstimate())
        if wanted != self._window:
            self._window = session._resizeWindow(self, wanted)

    # -- endings ---------------------------------------------------------------------------

    def _move(self, event: StreamEvent) -> None:
        """The one place the state changes: as :data:`TRANSITIONS` says, or not at all."""
        new = TRANSITIONS.get((self.state, event))
        if new is None:
            raise IllegalTransition(f"{self!r}: {event.value} is not allowed")
        self.state = new

    def _maybeFinish(self) -> None:
        """FIN went both ways (and the protocol saw all bytes), or we closed and our FIN went:
        the protocol learns ``StreamClosed``; the session forgets the id once the wire is done."""
        if self.state is StreamState.CLOSED and self._eof_delivered:
            self._end(StreamClosed())
        elif self.disconnecting and self.state is StreamState.HALF_CLOSED_LOCAL:
            # Our side is finished; the id stays known until the peer's FIN (or RST) arrives.
            self._notifyLost(StreamClosed(), later=True)
            self.session._lingerStream(self)

    def _reset(self, remote: bool, detail: str = "", later: bool = False) -> None:
        """RST now.  A stream that is already finished on the wire but still owes its
        protocol an ending (closed while paused with bytes left) ends as reset, silently."""
        if self.state is StreamState.RESET or (
                self.state is StreamState.CLOSED and self._ending is not None):
            return
        wire_live = self.state is not StreamState.CLOSED
        self._move(StreamEvent.RESET)
        self._clearBuffers()
        if not remote and wire_live:
            self.session._sendFrame(Frame.window_update(self.id, 0, FLAG_RST),
                                    self.session._urgentFor(self))
        self._end(StreamReset(remote=remote, detail=detail), later=later)

    def _clearBuffers(self) -> None:
        self._out.clear()
        self._out_size = 0
        self._out_offset = 0
        self._in.clear()
        self._in_size = 0
        self._fin_pending = False

    def _end(self, reason: Exception, later: bool = False) -> None:
        self.session._forgetStream(self)
        self._notifyLost(reason, later=later)

    def _notifyLost(self, reason: Exception, later: bool = False) -> None:
        """``connectionLost`` exactly once; the registered producer is stopped, as TCP does.

        ``later``: the ending was asked for by our own side (``loseConnection``,
        ``abortConnection``); the protocol hears of it on the next reactor turn, never from
        inside the call that asked, which is what Twisted transports promise."""
        if self._ending is not None:
            return
        self._ending = reason
        if later:
            self.session._reactor.callLater(0, self._deliverLost, reason)
            return
        self._deliverLost(reason)

    def _deliverLost(self, reason: Exception) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.stopProducing()
            except Exception:
                log.failure("producer of {stream!r} raised in stopProducing", stream=self)
        if not self.connected:
            return
        self.connected = False
        try:
            self.protocol.connectionLost(Failure(reason))
        except Exception:
            log.failure("protocol of {stream!r} raised in connectionLost", stream=self)

    def _guarded(self, method, *args) -> bool:
        """Call into the protocol.  If it raises, it alone pays: log, reset its stream."""
        try:
            method(*args)
        except Exception:
            log.failure("protocol of {stream!r} raised; resetting the stream", stream=self)
            self._reset(remote=False, detail="protocol raised")
            return False
        return True
