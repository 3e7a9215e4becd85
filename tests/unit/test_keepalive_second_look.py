"""A keepalive ping's expiry looks twice (``mux/session.py``, ``_keepaliveCheck``), as the
silence check does: the reactor runs its timers before it reads, so after a stall of our own
(a long collection, a thread holding the GIL) a ping's answer may be waiting unread in the
socket when its expiry runs.  The peer links and the frontend's end of an older worker's tunnel
end a session on a ping's expiry; this must not end one whose answer is there to read.

The clock here keeps the reactor's order: a call scheduled while due calls run waits for the
next pass, and the test's reads come between two passes."""

from __future__ import annotations

from twisted.internet import task

from localai_tw.mux import KeepaliveTimeout, Session, SessionConfig
from localai_tw.mux.frame import TYPE_PING, Frame, encode
from localai_tw.mux.testing import FrameTransport

INTERVAL, TIMEOUT = 3.0, 7.0


class ReactorOrderClock(task.Clock):
    """``advance`` runs the calls due when it starts, not those they schedule for now."""

    def advance(self, amount: float) -> None:
        self.rightNow += amount
        self._sortCalls()
        due = [call for call in self.calls if call.getTime() <= self.seconds()]
        for call in due:
            if call not in self.calls:  # cancelled by an earlier call of this pass
                continue
            self.calls.remove(call)
            call.called = 1
            call.func(*call.args, **call.kw)
        self._sortCalls()


def _session():
    clock = ReactorOrderClock()
    session = Session(False, SessionConfig(keepalive_interval=INTERVAL,
                                           keepalive_timeout=TIMEOUT), reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    return session, transport, clock


def _next_ping(transport, clock) -> int:
    for _ in range(round(INTERVAL / 0.1) + 2):
        clock.advance(0.1)
        pings = [f for f in transport.frames() if f.type == TYPE_PING and not f.has(0x2)]
        if pings:
            return pings[-1].length
    raise AssertionError("no keepalive ping left")


def test_an_answer_waiting_unread_after_our_own_stall_keeps_the_session():
    session, transport, clock = _session()
    opaque = _next_ping(transport, clock)
    # Our own stall: the ping's whole timeout passes in one step; the peer answered meanwhile,
    # and its answer waits in the socket.  The timers of the next pass run first.
    clock.advance(TIMEOUT + 0.2)
    assert session.isOpen, session.ending
    session.dataReceived(encode(Frame.ping(opaque, ack=True)))  # that pass's reads
    clock.advance(0)
    assert session.isOpen, session.ending


def test_an_answer_that_is_not_there_on_the_second_look_ends_the_session():
    session, transport, clock = _session()
    _next_ping(transport, clock)
    clock.advance(TIMEOUT + 0.2)
    assert session.isOpen  # the second look is one pass later
    clock.advance(0)  # that pass read nothing from the peer
    assert isinstance(session.ending, KeepaliveTimeout), session.ending
    assert transport.disconnecting
