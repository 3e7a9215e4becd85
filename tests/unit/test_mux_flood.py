"""A peer that makes the session answer (pings, SYNs) but never reads the answers must not grow
our memory: past the high-water mark the session stops reading the carrier, past the cap it
ends; the keepalive cannot be satisfied blindly; a worker's SYN ends its tunnel."""

import pytest
from twisted.internet import task
from twisted.logger import globalLogPublisher

from localai_tw.mux import KeepaliveTimeout, Session, SessionConfig, SessionFailed
from localai_tw.mux.frame import (
    FLAG_RST,
    FLAG_SYN,
    GOAWAY_PROTOCOL_ERROR,
    HEADER_SIZE,
    TYPE_GO_AWAY,
    Frame,
    encode,
)
from localai_tw.mux.testing import FrameTransport
from localai_tw.tunnel.connect import tunnel_session_config
from localai_tw.tunnel.peer import peer_session_config

HIGH_WATER = SessionConfig().reply_high_water
CAP = SessionConfig().reply_cap


def paused_session(**config):
    """A session whose carrier has paused it: the carrier's buffer is above its mark, i.e. the
    peer reads nothing of what we write."""
    clock = task.Clock()
    session = Session(False, SessionConfig(**config), reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    session.pauseProducing()
    return session, transport, clock


def pings(n, start=0):
    return b"".join(encode(Frame.ping(start + i)) for i in range(n))


def syns(n):
    return b"".join(encode(Frame.window_update(1 + 2 * i, 0, FLAG_SYN)) for i in range(n))


def test_answers_to_a_peer_that_reads_are_not_limited():
    session, transport, _ = paused_session()
    session.resumeProducing()
    session.dataReceived(pings(CAP // HEADER_SIZE * 3))
    assert session.isOpen and transport.producerState == "producing"
    assert len(transport.frames()) == CAP // HEADER_SIZE * 3


def test_past_the_high_water_mark_the_session_stops_reading_until_the_carrier_drains():
    session, transport, _ = paused_session()
    below = HIGH_WATER // HEADER_SIZE
    session.dataReceived(pings(below))
    assert transport.producerState == "producing"
    session.dataReceived(pings(1, start=below))
    assert transport.producerState == "paused"  # the carrier is asked to stop reading
    assert session.isOpen
    assert len(transport.frames()) == below + 1  # every ping so far was answered
    session.resumeProducing()  # the peer read what it was sent
    assert transport.producerState == "producing"
    # the count starts again from nothing
    session.pauseProducing()
    session.dataReceived(pings(below))
    assert transport.producerState == "producing" and session.isOpen


@pytest.mark.parametrize("flood", [pings, syns], ids=["pings", "refused SYNs"])
def test_a_flood_past_the_cap_ends_the_session_with_a_clear_log_line(flood):
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        session, transport, _ = paused_session(accept_streams=False)
        session.dataReceived(flood(CAP // HEADER_SIZE * 4))  # one big read, as a WebSocket
    finally:                                                  # message can be
        globalLogPublisher.removeObserver(events.append)
    assert not session.isOpen
    assert isinstance(session.ending, SessionFailed) and "not reading" in str(session.ending)
    assert transport.disconnecting
    # what we queued for the peer stayed under the cap
    assert len(transport.value()) <= CAP
    lines = [e for e in events if "is not reading" in e.get("log_format", "")]
    assert len(lines) == 1 and lines[0]["cap"] == CAP


def test_the_keepalive_opaque_is_random_so_blind_replies_do_not_keep_a_session_alive():
    session, transport, clock = paused_session()
    session.resumeProducing()
    clock.advance(30)
    [ping] = transport.frames()
    session.dataReceived(b"".join(encode(Frame.ping(i, ack=True)) for i in range(64)))
    clock.advance(10)
    # (a random opaque below 64 would fail this once in 67 million runs)
    assert isinstance(session.ending, KeepaliveTimeout)
    opaques = {ping.length}
    for _ in range(20):
        other, other_transport, other_clock = paused_session()
        other.resumeProducing()
        other_clock.advance(30)
        opaques.add(other_transport.frames()[0].length)
    assert len(opaques) > 15  # not a counter from 0


def test_a_worker_tunnel_ends_at_the_first_stream_the_worker_opens():
    clock = task.Clock()
    session = Session(False, tunnel_session_config(), reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    session.dataReceived(syns(3))
    assert isinstance(session.ending, SessionFailed) and "protocol error" in str(session.ending)
    frames = transport.frames()
    assert [f.type for f in frames] == [TYPE_GO_AWAY]
    assert frames[0].length == GOAWAY_PROTOCOL_ERROR


def test_peer_links_still_refuse_a_stream_with_rst_and_keep_the_session():
    clock = task.Clock()
    session = Session(True, peer_session_config(accepting=False), reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    session.dataReceived(encode(Frame.window_update(2, 0, FLAG_SYN)))
    assert session.isOpen
    assert transport.frames() == [Frame.window_update(2, 0, FLAG_RST)]


def test_the_marks_must_be_ordered():
    with pytest.raises(ValueError):
        SessionConfig(reply_high_water=2048, reply_cap=1024)
