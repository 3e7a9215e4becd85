"""Splice without sockets: both directions, backpressure, half-close, closing each side once,
and the ending classification."""

from __future__ import annotations

import pytest
from twisted.internet import error
from twisted.internet.interfaces import IPushProducer, ITransport
from twisted.python.failure import Failure
from zope.interface import implementer

from localai_tw.mux.errors import (
    KeepaliveTimeout,
    SessionEnded,
    SessionFailed,
    StreamClosed,
    StreamReset,
)
from localai_tw.splice import EndingKind, HalfState, HandoffProtocol, Splice, SpliceEnding


@implementer(ITransport, IPushProducer)
class FakeSideTransport:
    """A connection as Splice sees it: a write buffer that pauses its registered producer past
    ``limit`` bytes (as a TCP transport does), a read side that can be paused, half-close, and a
    record of every close asked of it.  ``loseConnection`` and ``abortConnection`` deliver
    ``connectionLost`` at once; ``half_closeable=False`` models a transport with no
    ``loseWriteConnection``."""

    def __init__(self, limit: int = 64 * 1024, half_closeable: bool = True):
        self.limit = limit
        self.buffer = bytearray()
        self.delivered = bytearray()  # what the far end has taken out of the buffer
        self.producer = None
        self.producer_paused = False
        self.reading_paused = False
        self.closes: list[str] = []
        self.write_closed = False
        self.protocol = None
        self.max_buffered = 0
        if half_closeable:
            self.loseWriteConnection = self._loseWriteConnection

    def connect(self, protocol):
        self.protocol = protocol
        protocol.makeConnection(self)

    # ITransport
    def write(self, data):
        assert not self.write_closed, "write after half-close"
        assert not self.closes, "write after close"
        self.buffer += data
        self.max_buffered = max(self.max_buffered, len(self.buffer))
        if self.producer is not None and len(self.buffer) > self.limit and not self.producer_paused:
            self.producer_paused = True
            self.producer.pauseProducing()

    def writeSequence(self, seq):
        self.write(b"".join(seq))

    def drain(self, amount: int | None = None):
        """The far end reads ``amount`` bytes (all by default); resumes a paused producer."""
        amount = len(self.buffer) if amount is None else amount
        self.delivered += self.buffer[:amount]
        del self.buffer[:amount]
        if self.producer is not None and self.producer_paused and len(self.buffer) <= self.limit // 2:
            self.producer_paused = False
            self.producer.resumeProducing()

    def _loseWriteConnection(self):
        self.write_closed = True
        self.protocol.writeConnectionLost()

    def loseConnection(self):
        self.closes.append("lose")
        self.drain()
        self.protocol.connectionLost(Failure(error.ConnectionDone()))

    def abortConnection(self):
        self.closes.append("abort")
        self.protocol.connectionLost(Failure(error.ConnectionAborted()))

    def getPeer(self):
        return None

    def getHost(self):
        return None

    # IConsumer
    def registerProducer(self, producer, streaming):
        assert streaming
        assert self.producer is None, "two producers registered"
        self.producer = producer

    def unregisterProducer(self):
        assert self.producer is not None, "unregister without a producer"
        self.producer = None

    # IPushProducer (the read side)
    def pauseProducing(self):
        self.reading_paused = True

    def resumeProducing(self):
        self.reading_paused = False

    def stopProducing(self):
        raise AssertionError("Splice must close sides itself, never through stopProducing")

    # the far end's actions
    def receive(self, data: bytes):
        assert not self.reading_paused, "the transport would not read while paused"
        self.protocol.dataReceived(data)

    def receiveEOF(self):
        self.protocol.readConnectionLost()

    def lose(self, reason: BaseException):
        self.protocol.connectionLost(Failure(reason))


def joined(**kwargs):
    splice = Splice()
    a, b = FakeSideTransport(**kwargs), FakeSideTransport(**kwargs)
    a.connect(splice.a)
    b.connect(splice.b)
    return splice, a, b


def ending_of(splice) -> SpliceEnding | None:
    result = []
    splice.whenDone().addCallback(result.append)
    return result[0] if result else None


def test_bytes_flow_both_ways_and_far_side_may_speak_first():
    splice, a, b = joined()
    b.receive(b"server banner\r\n")  # the far side speaks first
    assert bytes(a.buffer) == b"server banner\r\n"
    a.receive(b"hello")
    assert bytes(b.buffer) == b"hello"


def test_a_side_connected_first_is_paused_and_its_bytes_kept_until_the_partner_arrives():
    splice = Splice()
    a, b = FakeSideTransport(), FakeSideTransport()
    a.connect(splice.a)
    assert a.reading_paused
    splice.a.dataReceived(b"already in flight")
    b.connect(splice.b)
    assert not a.reading_paused
    assert bytes(b.buffer) == b"already in flight"


class PreambleThenSplice(HandoffProtocol):
    """Reads one line of its own, then hands the connection and what followed to a splice."""

    def __init__(self, splice):
        self.splice = splice
        self.line = b""

    def preludeReceived(self, data):
        self.line += data
        if b"\n" in self.line:
            head, _, rest = self.line.partition(b"\n")
            self.head = head
            self.handOff(self.splice.a, rest)


def test_a_connected_transport_with_leftover_bytes_joins_later():
    splice = Splice()
    b = FakeSideTransport()
    b.connect(splice.b)
    a = FakeSideTransport()
    reader = PreambleThenSplice(splice)
    a.connect(reader)
    a.receive(b"grpc 127.0.0.1:1\nPRI * HTTP/2.0")
    assert reader.head == b"grpc 127.0.0.1:1"
    assert bytes(b.buffer) == b"PRI * HTTP/2.0"
    a.receive(b" more")
    assert bytes(b.buffer) == b"PRI * HTTP/2.0 more"
    b.receive(b"reply")
    assert bytes(a.buffer) == b"reply"
    a.receiveEOF()  # forwarded through the hand-off protocol
    assert b.write_closed


def test_a_reader_that_stops_parks_the_writer_and_memory_stays_bounded():
    limit = 64 * 1024
    splice, a, b = joined(limit=limit)
    chunk = b"x" * 4096
    offered = 0
    target = 20 * limit  # more than ten times what may be buffered
    while offered < target:
        if a.reading_paused:
            break  # the source is parked: a real transport reads nothing now
        a.receive(chunk)
        offered += len(chunk)
    assert a.reading_paused, "the writer was never parked"
    assert b.max_buffered <= limit + len(chunk)
    # The reader resumes; the rest flows and the buffer stays bounded throughout.
    while offered < target:
        if a.reading_paused:
            b.drain()
            continue
        a.receive(chunk)
        offered += len(chunk)
    b.drain()
    assert len(b.delivered) == target
    assert b.max_buffered <= limit + len(chunk)


@pytest.mark.parametrize("first", ["a", "b"])
def test_eof_half_closes_the_other_side_and_the_other_direction_continues(first):
    splice, a, b = joined()
    src, dst = (a, b) if first == "a" else (b, a)
    src.receive(b"request")
    src.receiveEOF()
    assert dst.write_closed and not dst.closes
    assert not src.closes
    dst.receive(b"response after the half-close")
    assert bytes(src.buffer) == b"response after the half-close"
    assert ending_of(splice) is None
    dst.receiveEOF()
    assert src.write_closed
    # Both directions done: each side closed exactly once, and the ending is normal.
    assert a.closes == ["lose"] and b.closes == ["lose"]
    ending = ending_of(splice)
    assert ending is not None and ending.normal


def test_a_side_that_cannot_half_close_is_closed_instead():
    splice, a, b = joined(half_closeable=False)
    a.receive(b"last words")
    a.receiveEOF()
    assert b.closes == ["lose"]
    assert bytes(b.delivered) == b"last words"
    assert a.closes == ["lose"]
    assert ending_of(splice).normal


def test_failure_on_one_side_closes_the_other_once_and_is_a_transport_failure():
    splice, a, b = joined()
    a.receive(b"partial body")
    a.lose(error.ConnectionLost("connection reset by peer"))
    assert b.closes == ["abort"]
    assert a.closes == []
    ending = ending_of(splice)
    assert ending.kind is EndingKind.TRANSPORT_FAILURE
    assert "reset by peer" in ending.cause


def test_later_events_never_close_a_side_twice():
    splice, a, b = joined()
    a.lose(error.ConnectionLost("boom"))
    b.receiveEOF()  # late events on the closed side
    b.lose(error.ConnectionLost("again"))
    assert a.closes == [] and b.closes == ["abort"]


def test_done_waits_for_both_sides():
    splice = Splice()
    a, b = FakeSideTransport(), FakeSideTransport()
    a.connect(splice.a)
    b.connect(splice.b)
    # Direction a->b finished, b->a still copying: not done.
    a.receiveEOF()
    assert ending_of(splice) is None
    b.receive(b"still going")
    assert ending_of(splice) is None


def test_abandon_closes_the_connected_side_and_reports_failure():
    splice = Splice()
    a = FakeSideTransport()
    a.connect(splice.a)
    splice.abandon(error.ConnectionRefusedError("backend port closed"))
    assert a.closes == ["abort"]
    assert ending_of(splice).kind is EndingKind.TRANSPORT_FAILURE


# -- the ending classification --------------------------------------------------------------------
#
# Each case: what side ``a`` reports while its copies are live; side ``b`` is then closed by the
# splice.  These are the cases an "always normal" classifier gets wrong.


@pytest.mark.parametrize(
    "reason, expected",
    [
        (error.ConnectionDone(), EndingKind.NORMAL),
        (StreamClosed(), EndingKind.NORMAL),
        (SessionEnded(), EndingKind.NORMAL),
        (StreamReset(remote=False), EndingKind.NORMAL),
        (StreamReset(remote=True), EndingKind.TRANSPORT_FAILURE),
        (SessionFailed("transport error"), EndingKind.TRANSPORT_FAILURE),
        (KeepaliveTimeout(10.0), EndingKind.TRANSPORT_FAILURE),
        (error.ConnectionLost("reset"), EndingKind.TRANSPORT_FAILURE),
    ],
)
def test_ending_under_a_live_copy(reason, expected):
    splice, a, b = joined()
    a.receive(b"data")
    a.lose(reason)
    ending = ending_of(splice)
    assert ending.kind is expected
    # A normal ending closes the partner gently (flushing), a failure aborts it.
    assert b.closes == (["lose"] if expected is EndingKind.NORMAL else ["abort"])


def slow_to_close(transport):
    """A close that completes later, as a stream flushing its FIN does."""
    transport.loseConnection = lambda: transport.closes.append("lose")


def test_remote_reset_after_both_copies_finished_is_normal():
    splice, a, b = joined()
    slow_to_close(a)
    b.receiveEOF()  # a's output half-closed and confirmed by writeConnectionLost
    a.receiveEOF()  # a's input at EOF: both of a's copies are finished
    assert a.closes == ["lose"]
    a.lose(StreamReset(remote=True))  # the peer resets instead of completing the close
    assert ending_of(splice).normal


def test_remote_reset_while_the_other_direction_still_copies_is_a_failure():
    splice, a, b = joined()
    a.receiveEOF()  # a->b finished, b->a still live
    b.receive(b"response")
    a.lose(StreamReset(remote=True))
    assert ending_of(splice).kind is EndingKind.TRANSPORT_FAILURE
    assert b.closes == ["abort"]


def test_remote_reset_on_a_side_the_splice_was_closing_is_normal():
    splice, a, b = joined()
    a.lose(error.ConnectionDone())  # normal: b is closed by the splice
    assert b.closes == ["lose"]
    assert ending_of(splice).normal


def test_session_failure_on_the_side_being_closed_is_still_a_failure():
    splice, a, b = joined()
    slow_to_close(b)  # a real stream flushing; the session dies meanwhile
    a.lose(error.ConnectionDone())
    b.lose(SessionFailed("keepalive"))
    assert ending_of(splice).kind is EndingKind.TRANSPORT_FAILURE


def test_raise_if_failed():
    from localai_tw import errors

    splice, a, b = joined()
    a.lose(error.ConnectionLost("gone"))
    with pytest.raises(errors.TransportFailure):
        ending_of(splice).raiseIfFailed()
    splice2, a2, b2 = joined()
    a2.lose(error.ConnectionDone())
    ending_of(splice2).raiseIfFailed()


def slow_to_abort(transport):
    """An abort whose connectionLost comes on a later reactor turn, as TCP's does."""
    transport.abortConnection = lambda: transport.closes.append("abort")


def test_abort_ends_a_live_join_at_once_each_side_closed_once_and_the_ending_is_normal():
    splice, a, b = joined()
    slow_to_abort(a)
    slow_to_abort(b)
    a.receive(b"request")
    b.receive(b"half an answer")
    splice.abort()
    assert a.closes == ["abort"] and b.closes == ["abort"]
    assert a.producer is None and b.producer is None  # nothing holds a close open
    a.lose(error.ConnectionAborted())
    b.lose(error.ConnectionAborted())
    assert ending_of(splice).kind is EndingKind.NORMAL  # we ended it: not a route failure
    splice.abort()  # both sides are gone: nothing more to close
    assert a.closes == ["abort"] and b.closes == ["abort"]


def test_abort_escalates_a_gentle_close_a_stalled_sink_holds_open():
    splice, a, b = joined()
    slow_to_close(a)
    b.lose(error.ConnectionDone())  # a is now closed gently, and its sink never drains
    assert a.closes == ["lose"] and ending_of(splice) is None
    splice.abort()
    assert a.closes == ["lose", "abort"]
    assert ending_of(splice).kind is EndingKind.NORMAL


def test_abort_leaves_a_partner_still_dialing_to_abandon():
    splice = Splice()
    a = FakeSideTransport()
    a.connect(splice.a)
    splice.abort()
    assert a.closes == ["abort"]
    assert ending_of(splice) is None  # the dial is still out: its outcome decides
    splice.abandon("dial cancelled")
    ending = ending_of(splice)
    assert ending.kind is EndingKind.TRANSPORT_FAILURE and "never connected" in ending.cause


def test_a_side_moves_new_connected_closing_lost_and_stays_lost():
    splice = Splice()
    a, b = FakeSideTransport(), FakeSideTransport()
    slow_to_close(b)
    assert splice.a.state is HalfState.NEW and splice.b.state is HalfState.NEW
    a.connect(splice.a)
    assert splice.a.state is HalfState.CONNECTED
    b.connect(splice.b)
    a.lose(error.ConnectionDone())  # a ended normally: b is closed gently, once
    assert splice.a.state is HalfState.LOST and splice.b.state is HalfState.CLOSING
    assert b.closes == ["lose"]
    splice.a.connectionLost(Failure(error.ConnectionLost("late")))  # ignored
    b.receive(b"late bytes")  # nowhere to go: a is lost
    assert a.buffer == b"" and splice.b.pending == []  # dropped, not kept
    assert b.closes == ["lose"]
    b.lose(error.ConnectionDone())
    assert splice.b.state is HalfState.LOST
    assert ending_of(splice).kind is EndingKind.NORMAL
