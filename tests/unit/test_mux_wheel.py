"""The keepalive wheel: one timer for the keepalives of every session of a reactor, with the
detection bound of tunnel/keepalive.py kept (on a Clock)."""

import random

from twisted.internet import task

from localai_tw.mux import KeepaliveTimeout, Session
from localai_tw.mux.frame import FLAG_ACK, TYPE_PING, Frame, encode
from localai_tw.mux.testing import FrameTransport, connectedSessions
from localai_tw.mux.wheel import TickWheel, common_tick
from localai_tw.tunnel.connect import tunnel_session_config
from localai_tw.tunnel.keepalive import (
    DEAD_TUNNEL_DETECTION,
    TUNNEL_KEEPALIVE_INTERVAL,
    TUNNEL_KEEPALIVE_TIMEOUT,
)


def tunnel_end(clock):
    """The frontend's end of a worker tunnel on a transport we read frames from by hand."""
    session = Session(False, tunnel_session_config(), reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    return session, transport


def pings(transport):
    """The keepalive pings written since the last call (the frames are consumed)."""
    return [f for f in transport.frames() if f.type == TYPE_PING and not f.has(FLAG_ACK)]


def answer(session, ping):
    session.dataReceived(encode(Frame.ping(ping.length, ack=True)))


def answer_all(ends, but=None):
    """Every end but ``but`` answers the pings written since the last call."""
    for session, transport in ends:
        sent = pings(transport)
        if session is not but:
            for ping in sent:
                answer(session, ping)


def test_the_tick_divides_interval_and_timeout():
    assert common_tick(TUNNEL_KEEPALIVE_INTERVAL, TUNNEL_KEEPALIVE_TIMEOUT) == 0.1
    assert common_tick(30.0, 10.0) == 0.1
    assert common_tick(0.2, 0.5) == 0.1
    assert common_tick(0.05, 0.15) == 0.05
    assert common_tick(3.001, 7.0) == 0.3001 / 4  # no millisecond ticks for an odd config


def test_a_thousand_tunnels_keep_one_timer_not_two_each():
    clock = task.Clock()
    ends = []
    for _ in range(1000):
        clock.advance(random.random() / 100)  # the tunnels open over about 5 s
        answer_all(ends)
        ends.append(tunnel_end(clock))
    sent_at = []
    for _ in range(200):  # 10 s of pings, every one answered at once
        clock.advance(0.05)
        for session, transport in ends:
            for ping in pings(transport):
                sent_at.append(round(clock.seconds(), 1))
                answer(session, ping)
        assert len(clock.getDelayedCalls()) == 1
    assert all(session.isOpen for session, _ in ends)
    # and their pings stay spread as their openings were: with one tick a second, a third of
    # the fleet (333) would ping on each
    assert len(sent_at) >= 3000 and max(sent_at.count(t) for t in set(sent_at)) < 200


def test_one_silent_tunnel_among_many_is_declared_dead_within_the_bound():
    clock = task.Clock()
    ends = []
    for _ in range(200):
        clock.advance(random.random() / 20)  # the tunnels open over about 5 s
        answer_all(ends)
        ends.append(tunnel_end(clock))
    silent, silent_transport = ends[77]
    # It goes silent at the moment its next ping leaves: that ping is never answered.
    while True:
        clock.advance(0.01)
        if pings(silent_transport):
            break
        answer_all(ends, but=silent)
    silent_since = clock.seconds()
    while silent.isOpen:
        clock.advance(0.05)
        answer_all(ends, but=silent)
    waited = clock.seconds() - silent_since
    # Its last ping expires after its whole timeout, not before, not later.
    assert TUNNEL_KEEPALIVE_TIMEOUT - 0.011 <= waited <= TUNNEL_KEEPALIVE_TIMEOUT + 0.05
    assert isinstance(silent.ending, KeepaliveTimeout)
    assert sum(session.isOpen for session, _ in ends) == 199


def test_a_silent_tunnel_whose_last_ping_was_answered_goes_within_interval_plus_timeout():
    clock = task.Clock()
    session, transport = tunnel_end(clock)
    sent = []
    while not sent:
        clock.advance(0.01)
        sent = pings(transport)
    answer(session, sent[0])
    answered_at = clock.seconds()
    clock.pump([0.05] * round((DEAD_TUNNEL_DETECTION - 0.1) / 0.05))
    assert session.isOpen  # the worst case takes the whole bound
    clock.advance(0.1 + 1e-3)
    assert not session.isOpen
    assert clock.seconds() - answered_at <= DEAD_TUNNEL_DETECTION + 0.01


def test_a_ping_sent_on_a_late_tick_still_gets_its_whole_timeout():
    clock = task.Clock()
    session, transport = tunnel_end(clock)
    clock.advance(2.0)
    clock.advance(1.07)  # the reactor runs the 3 s tick 70 ms late: the ping leaves at 3.07
    assert len(pings(transport)) == 1
    sent_at = clock.seconds()
    clock.pump([0.05] * round((TUNNEL_KEEPALIVE_TIMEOUT - 0.05) / 0.05))
    assert session.isOpen, clock.seconds() - sent_at
    clock.pump([0.05] * 40)
    assert not session.isOpen


def test_the_timer_stops_once_no_session_waits():
    clock = task.Clock()
    session, _ = tunnel_end(clock)
    clock.advance(1)
    session.loseConnection()
    clock.pump([1] * 10)
    assert clock.getDelayedCalls() == []


def test_a_clock_and_its_sessions_are_not_pinned_by_their_wheel():
    import gc
    import weakref

    clock = task.Clock()
    session, transport = tunnel_end(clock)
    clock.advance(5)  # its keepalive is running
    gone = weakref.ref(clock), weakref.ref(session)
    del clock, session, transport
    gc.collect()
    assert gone[0]() is None and gone[1]() is None


def test_a_missed_tick_runs_its_calls_in_order_at_the_next():
    clock = task.Clock()
    wheel = TickWheel(clock, 1.0)
    ran = []
    for n in (1, 2, 3):
        wheel.later(n, ran.append, n)
    clock.advance(2.5)
    assert ran == [1, 2]
    clock.advance(0.5)
    assert ran == [1, 2, 3] and wheel.waiting == 0 and clock.getDelayedCalls() == []


def test_a_lone_session_wakes_the_reactor_only_when_it_has_something_due():
    clock = task.Clock()
    session, transport = tunnel_end(clock)
    wakeups = 0
    for _ in range(600):  # 30 s in 50 ms steps
        before = len(clock.getDelayedCalls()) and clock.getDelayedCalls()[0].getTime()
        clock.advance(0.05)
        wakeups += before <= clock.seconds()
        for ping in pings(transport):
            answer(session, ping)
    # a ping every 3 s and its expiry 7 s later: about 20 in 30 s, not one per tick (300)
    assert wakeups <= 25 and session.isOpen


def test_a_call_that_raises_does_not_stop_the_others_of_its_tick():
    from twisted.logger import globalLogPublisher

    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        clock = task.Clock()
        wheel = TickWheel(clock, 0.1)
        ran = []
        wheel.later(1, lambda: 1 / 0)
        wheel.later(1, ran.append, "after")
        clock.advance(0.1)
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert ran == ["after"]
    assert any(e.get("log_failure") and e["log_failure"].check(ZeroDivisionError)
               for e in events)


def test_keepalive_still_works_between_two_sessions():
    client, server, pump, clock = connectedSessions(client_config=tunnel_session_config(),
                                                    server_config=tunnel_session_config())
    for _ in range(100):
        clock.advance(0.5)
        pump.flush()
    assert client.isOpen and server.isOpen
