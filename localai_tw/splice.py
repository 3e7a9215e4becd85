"""Splice: join two connections both ways with backpressure, and say how the join ended.

A :class:`Splice` has two protocol halves, ``a`` and ``b``.  Connect each to a transport (a TCP
connection, a yamux stream, anything providing ``ITransport`` and ``IPushProducer``) and every
byte read from one side is written to the other, in both directions at once, so a protocol whose
far side speaks first works as well as one whose near side does.  This is the relay of
``twisted.protocols.portforward`` with three additions:

- **Backpressure**: each side's transport is registered (through a small relay, see
  :class:`_ReadPauser`) as the streaming producer of the other side, so a sink that cannot take
  more pauses reading from its source; memory stays bounded by the transports' own buffers.
- **Half-close**: end of input from one side half-closes the other side
  (``loseWriteConnection``) and the other direction keeps copying.  A side whose transport cannot
  half-close is closed instead.
- **Ending classification**: :meth:`Splice.whenDone` fires once *both* sides are gone with a
  :class:`SpliceEnding` saying whether the join ended normally or by a transport failure (the
  table is in :func:`classify_side_ending` and ``docs/tunnel.md``).

A side may join after it is already connected and has read bytes of its own (a protocol that read
a preamble): subclass :class:`HandoffProtocol`, and call :meth:`HandoffProtocol.handOff` with a
half and the bytes that followed the preamble.

What this module must never do: close a side twice (the splice is the only one that closes
sides, exactly once each, which is why the producers it registers ignore ``stopProducing``; the
one exception is :meth:`Splice.abort` cutting short a gentle close that has not finished);
report a transport failure as a normal ending (a caller would treat a truncated relay as a
finished one); buffer without bound (a side waiting for its partner is paused).  It knows
nothing of tunnels, preambles or workers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from twisted.internet import defer, error
from twisted.internet.interfaces import IHalfCloseableProtocol, IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from localai_tw import errors
from localai_tw.deferreds import OneShotObserver
from localai_tw.mux.errors import SessionFailed, StreamReset

_log = Logger()


class EndingKind(enum.Enum):
    """How a side, or the whole splice, ended."""

    NORMAL = "normal"
    TRANSPORT_FAILURE = "transport-failure"


def classify_side_ending(reason: BaseException, copy_live: bool, closed_by_splice: bool) -> EndingKind:
    """Whether ``reason``, the ``connectionLost`` reason of one side, is a normal ending.

    ``copy_live``: a copy through this side was still running (input not yet at EOF, or our
    half-close of its output not yet confirmed by ``writeConnectionLost``).
    ``closed_by_splice``: the splice had already asked this side to close because the join was
    ending for another reason.

    The order matters: a session that died wraps its cause, so it is checked before the generic
    "connection lost" endings, and a reset is judged by who sent it before anything else.
    """
    if isinstance(reason, SessionFailed):  # includes KeepaliveTimeout
        return EndingKind.TRANSPORT_FAILURE
    if isinstance(reason, StreamReset):
        if reason.remote and copy_live and not closed_by_splice:
            return EndingKind.TRANSPORT_FAILURE
        return EndingKind.NORMAL
    if isinstance(reason, error.ConnectionDone):  # EOF, StreamClosed, SessionEnded
        return EndingKind.NORMAL
    if closed_by_splice:  # our own abort (ConnectionAborted) or a close we started
        return EndingKind.NORMAL
    return EndingKind.TRANSPORT_FAILURE


@dataclass(frozen=True)
class SideEnding:
    """How one side ended: the ``connectionLost`` reason and its classification."""

    name: str
    reason: Failure | None
    kind: EndingKind


@dataclass(frozen=True)
class SpliceEnding:
    """How the whole splice ended: a transport failure if either side failed, else normal."""

    kind: EndingKind
    sides: tuple[SideEnding, ...] = field(default=())
    cause: str = ""

    @property
    def normal(self) -> bool:
        return self.kind is EndingKind.NORMAL

    def raiseIfFailed(self) -> None:
        """Raise :class:`~localai_tw.errors.TransportFailure` when the splice did not end
        normally: nothing is known about how much of the carried exchange arrived."""
        if not self.normal:
            raise errors.TransportFailure(f"splice ended by a transport failure: {self.cause}")


@implementer(IPushProducer)
class _ReadPauser:
    """Registered with a sink as its producer: pauses and resumes reading from the source.

    Not the source transport itself, because a transport calls its producer's
    ``stopProducing`` when it is lost, and a TCP transport's ``stopProducing`` closes it: the
    source would then be closed by Twisted behind the splice's back, possibly a second time.
    The splice closes each side itself, so ``stopProducing`` here does nothing.
    """

    def __init__(self, source_transport):
        self._source = source_transport

    def pauseProducing(self) -> None:
        self._source.pauseProducing()

    def resumeProducing(self) -> None:
        self._source.resumeProducing()

    def stopProducing(self) -> None:
        pass


class HalfState(enum.Enum):
    """Where one side's connection is.  It only moves forward: NEW -> CONNECTED -> (CLOSING ->)
    LOST.  CLOSING is entered once, when the splice asks the transport to close (an abort may
    still follow it: :meth:`Splice.abort`); the two directions' half-closes are separate flags,
    not states, because each direction ends on its own."""

    NEW = "new"              # no connection yet (its dial may still be running)
    CONNECTED = "connected"  # carrying bytes, or paused while the partner is NEW
    CLOSING = "closing"      # the splice asked the transport to close; connectionLost follows
    LOST = "lost"            # connectionLost came: nothing more happens to this side


# For the per-chunk path: a module global is a dict lookup, ``HalfState.CONNECTED`` goes through
# the Enum class's attribute machinery (about 70 ns each on Python 3.11).
_NEW = HalfState.NEW
_CONNECTED = HalfState.CONNECTED


@implementer(IHalfCloseableProtocol)
class SpliceHalf(Protocol):
    """One side of a :class:`Splice`: the protocol of one of the two joined connections.

    ``state`` (:class:`HalfState`) is the connection's life; ``input_open``, ``output_open`` and
    ``output_flushed`` are the two directions within CONNECTED.
    """

    def __init__(self, splice: Splice, name: str):
        self._splice = splice
        self.name = name
        self.partner: SpliceHalf  # set by Splice
        self.state = HalfState.NEW
        self.input_open = True  # no EOF read from this side yet
        self.output_open = True  # we have not half-closed this side's output
        self.output_flushed = False  # writeConnectionLost confirmed our half-close
        self.closed_by_splice = False  # the splice closed it because the join ended elsewhere
        self.ending: SideEnding | None = None
        self.paused_for_partner = False
        self.pending: list[bytes] = []  # read while the partner was not connected
        self.has_producer = False  # the partner's _ReadPauser is registered with our transport

    # -- IProtocol ---------------------------------------------------------------------------

    def connectionMade(self) -> None:
        self.state = HalfState.CONNECTED
        self._splice._sideConnected(self)

    def dataReceived(self, data: bytes) -> None:
        if not data:
            return
        partner = self.partner
        state = partner.state
        if state is _CONNECTED and partner.output_open:
            try:
                partner.transport.write(data)
            except Exception:
                self._splice._copyFailed(self, Failure())
        elif state is _NEW:
            self.pending.append(data)
        # otherwise nowhere to deliver: the join is ending and this side is being closed

    def readConnectionLost(self) -> None:
        self.input_open = False
        self._splice._inputEnded(self)

    def writeConnectionLost(self) -> None:
        self.output_flushed = True
        self._splice._maybeFinishSide(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.state is HalfState.LOST:
            return
        self.state = HalfState.LOST
        copy_live = self.input_open or not self.output_flushed
        self.input_open = False
        self.output_open = False
        kind = classify_side_ending(reason.value, copy_live, self.closed_by_splice)
        self.ending = SideEnding(self.name, reason, kind)
        self._splice._sideLost(self)

    # -- what the splice does to this side ---------------------------------------------------------

    def _unregisterPartner(self) -> None:
        # A registered producer holds a TCP close open until it is unregistered.
        if self.has_producer:
            self.has_producer = False
            self.transport.unregisterProducer()

    def _close(self, abort: bool) -> None:
        """Close this side's transport, once.  ``abort`` drops unsent data (used on failures,
        where a sink that stopped reading would otherwise hold the close open forever)."""
        if self.state is not HalfState.CONNECTED:
            return
        self.state = HalfState.CLOSING
        transport = self.transport
        self._unregisterPartner()
        if abort and hasattr(transport, "abortConnection"):
            transport.abortConnection()
        else:
            transport.loseConnection()

    def _abort(self) -> None:
        """Abort this side's transport even if a gentle close is under way (a sink that stopped
        reading would hold that close open forever); nothing to do once it is lost."""
        if self.state is HalfState.NEW or self.state is HalfState.LOST or self.transport is None:
            return
        self.closed_by_splice = True
        self.state = HalfState.CLOSING
        transport = self.transport
        self._unregisterPartner()
        if hasattr(transport, "abortConnection"):
            transport.abortConnection()
        else:
            transport.loseConnection()

    def _halfClose(self) -> None:
        """Half-close this side's output after its partner's input ended; close it when the
        transport cannot half-close."""
        if not self.output_open or self.state is HalfState.CLOSING or self.state is HalfState.LOST:
            return
        self.output_open = False
        transport = self.transport
        self._unregisterPartner()
        lose_write = getattr(transport, "loseWriteConnection", None)
        if lose_write is None:
            self._close(abort=False)
            return
        try:
            lose_write()
        except Exception:
            _log.failure("half-close of splice side {name} failed; closing it", name=self.name)
            self.output_open = False
            self._close(abort=False)


class Splice:
    """Joins two connections both ways; ``a`` and ``b`` are their protocols.

    Connect ``a`` and ``b`` in any order (or hand an already connected transport to one of them
    through :class:`HandoffProtocol`); a side that connects first is paused until its partner
    arrives.  If a partner will never arrive (its dial failed), call :meth:`abandon`; to end
    the join from outside (shutting down), call :meth:`abort`.
    """

    def __init__(self) -> None:
        self.a = SpliceHalf(self, "a")
        self.b = SpliceHalf(self, "b")
        self.a.partner = self.b
        self.b.partner = self.a
        self._joined = False
        self._abandoned: Failure | None = None
        self._ending: SpliceEnding | None = None
        self._done = OneShotObserver()

    # -- public API ---------------------------------------------------------------------------

    def whenDone(self) -> defer.Deferred:
        """A Deferred firing with the :class:`SpliceEnding` once both sides are gone.  It never
        errbacks: a transport failure is a classification, not an exception here."""
        return self._done.when()

    def abandon(self, reason: Failure | BaseException | str) -> None:
        """The partner of a connected side will never connect (its dial failed): abort what is
        connected and end the splice as a transport failure."""
        if not isinstance(reason, Failure):
            reason = Failure(reason if isinstance(reason, BaseException) else Exception(reason))
        if self._joined or self._abandoned is not None:
            return
        self._abandoned = reason
        for half in (self.a, self.b):
            if half.state is not HalfState.NEW:
                half.closed_by_splice = True
                half._close(abort=True)
        self._maybeDone()

    def abort(self) -> None:
        """End the join now, from outside (the owner is shutting down): abort every connected
        side that is not lost yet, including one already closing gently.  The sides end as
        closed by the splice, so the ending is normal unless a transport failed on its own
        first; :meth:`whenDone` fires once both sides are gone.  A partner still dialing is not
        touched: abandon the splice when its dial is given up."""
        for half in (self.a, self.b):
            half._abort()

    # -- events from the halves ----------------------------------------------------------------

    def _sideConnected(self, half: SpliceHalf) -> None:
        if self._abandoned is not None:
            half.closed_by_splice = True
            half._close(abort=True)
            return
        partner = half.partner
        if partner.state is HalfState.NEW:
            # Stay bounded while the partner dials: stop reading until it is there.
            half.paused_for_partner = True
            half.transport.pauseProducing()
            return
        self._join()

    def _join(self) -> None:
        self._joined = True
        a, b = self.a, self.b
        for source, sink in ((a, b), (b, a)):
            if sink.state is HalfState.CONNECTED:
                sink.transport.registerProducer(_ReadPauser(source.transport), True)
                sink.has_producer = True
        for source, sink in ((a, b), (b, a)):
            pending, source.pending = source.pending, []
            for data in pending:
                source.dataReceived(data)
        # Anything that ended while the partner was away is applied now, in arrival order.
        for half in (a, b):
            if half.state is HalfState.LOST:
                self._sideLost(half)
            elif not half.input_open:
                self._inputEnded(half)
        for half in (a, b):
            if half.paused_for_partner and half.state is HalfState.CONNECTED:
                half.paused_for_partner = False
                half.transport.resumeProducing()

    def _inputEnded(self, half: SpliceHalf) -> None:
        """EOF from ``half``: half-close its partner and keep the other direction going."""
        partner = half.partner
        if partner.state is HalfState.NEW:
            return  # applied by _join
        partner._halfClose()
        self._maybeFinishSide(half)
        self._maybeFinishSide(partner)

    def _maybeFinishSide(self, half: SpliceHalf) -> None:
        """A side whose input reached EOF and whose output we half-closed has nothing left to
        carry; a TCP transport does not close itself then, so close it (its one close)."""
        if half.state is not HalfState.CONNECTED:
            return
        if not half.input_open and not half.output_open:
            half._close(abort=False)

    def _copyFailed(self, half: SpliceHalf, reason: Failure) -> None:
        _log.failure("splice copy from side {name} failed", reason, name=half.name)
        for side in (half, half.partner):
            side.closed_by_splice = side.closed_by_splice or side is not half
            side._close(abort=True)

    def _sideLost(self, half: SpliceHalf) -> None:
        partner = half.partner
        if partner.state is HalfState.CONNECTED:
            # Nothing can be carried to or from a lost side: the partner is closed now, gently
            # (flushing what it was given) after a normal ending, at once after a failure.
            partner.closed_by_splice = True
            partner._close(abort=half.ending.kind is EndingKind.TRANSPORT_FAILURE)
        self._maybeDone()

    def _maybeDone(self) -> None:
        if self._ending is not None:
            return
        sides = [h for h in (self.a, self.b) if h.state is not HalfState.NEW]
        if any(h.state is not HalfState.LOST for h in sides):
            return
        if self._abandoned is None and len(sides) < 2:
            return
        endings = tuple(h.ending for h in sides)
        failed = [e for e in endings if e.kind is EndingKind.TRANSPORT_FAILURE]
        if self._abandoned is not None:
            ending = SpliceEnding(
                EndingKind.TRANSPORT_FAILURE,
                endings,
                f"a side never connected: {self._abandoned.getErrorMessage()}",
            )
        elif failed:
            first = failed[0]
            ending = SpliceEnding(
                EndingKind.TRANSPORT_FAILURE,
                endings,
                f"side {first.name}: {first.reason.getErrorMessage()}",
            )
        else:
            ending = SpliceEnding(EndingKind.NORMAL, endings)
        self._ending = ending
        self._done.fire(ending)


@implementer(IHalfCloseableProtocol)
class HandoffProtocol(Protocol):
    """A protocol that reads something of its own first (a preamble), then hands its connection
    to another protocol, typically a :class:`SpliceHalf`, with the bytes it read past its part.

    Subclasses implement :meth:`preludeReceived` (and, if they care, :meth:`preludeLost`) and
    call :meth:`handOff`.  After the hand-off every event of the transport goes to the delegate,
    which sees the same transport; the transport never learns about the change.
    """

    delegate = None

    def preludeReceived(self, data: bytes) -> None:
        """Bytes before the hand-off."""
        raise NotImplementedError

    def preludeLost(self, reason: Failure) -> None:
        """The connection ended before the hand-off."""

    def handOff(self, protocol, leftover: bytes = b"") -> None:
        """From now on ``protocol`` owns this connection; ``leftover`` are bytes already read
        that belong to it.  Call at most once."""
        if self.delegate is not None:
            raise RuntimeError("this connection was already handed off")
        self.delegate = protocol
        protocol.makeConnection(self.transport)
        if leftover:
            protocol.dataReceived(leftover)

    def dataReceived(self, data: bytes) -> None:
        if self.delegate is not None:
            self.delegate.dataReceived(data)
        else:
            self.preludeReceived(data)

    def readConnectionLost(self) -> None:
        delegate = IHalfCloseableProtocol(self.delegate, None) if self.delegate else None
        if delegate is not None:
            delegate.readConnectionLost()
        else:
            # Before the hand-off (or for a delegate that cannot half-close), EOF ends the
            # connection, as it would for a protocol without half-close support.
            self.transport.loseConnection()

    def writeConnectionLost(self) -> None:
        delegate = IHalfCloseableProtocol(self.delegate, None) if self.delegate else None
        if delegate is not None:
            delegate.writeConnectionLost()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.delegate is not None:
            self.delegate.connectionLost(reason)
        else:
            self.preludeLost(reason)
