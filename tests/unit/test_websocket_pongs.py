"""The WebSocket carrier bounds the pongs a peer that pings without reading makes us write:
past ``PONG_HIGH_WATER`` it stops reading TCP until the write buffer drains, past ``PONG_CAP``
it drops the connection (and the inner protocol learns why)."""

from twisted.internet import task
from twisted.internet.protocol import Protocol
from twisted.internet.testing import StringTransport
from twisted.logger import globalLogPublisher

from localai_tw.tunnel.websocket import PONG_CAP, PONG_HIGH_WATER, WebSocketCarrier


class FakeWebSocket:
    """What the carrier uses of its Autobahn protocol: a TCP transport and a way to drop it."""

    def __init__(self):
        self.transport = StringTransport()
        self.dropped = False

    def dropConnection(self, abort=False):
        self.dropped = True


class Inner(Protocol):
    reason = None

    def connectionLost(self, reason):
        self.reason = reason


def carrier():
    ws = FakeWebSocket()
    c = WebSocketCarrier(ws, 1024 * 1024, reactor=task.Clock())
    c.protocol = Inner()
    c.protocol.makeConnection(c)
    return c, ws


PONG = 2 + 125  # the largest pong, as a server sends it


def test_pongs_to_a_peer_that_reads_are_not_limited():
    c, ws = carrier()
    assert all(c._mayPong(PONG) for _ in range(PONG_CAP // PONG * 3))
    assert ws.transport.producerState == "producing" and not ws.dropped


def test_past_the_high_water_mark_reading_stops_until_the_tcp_buffer_drains():
    c, ws = carrier()
    c._tcpWritePaused(True)
    below = PONG_HIGH_WATER // PONG
    assert all(c._mayPong(PONG) for _ in range(below))
    assert ws.transport.producerState == "producing"
    assert c._mayPong(PONG)
    assert ws.transport.producerState == "paused"
    c.pauseProducing()
    c.resumeProducing()  # the session's own pause ends; the pongs still wait
    assert ws.transport.producerState == "paused"
    c._tcpWritePaused(False)
    assert ws.transport.producerState == "producing"


def test_reading_stays_stopped_while_the_inner_protocol_paused_it():
    c, ws = carrier()
    c.pauseProducing()  # the yamux session's own backpressure
    c._tcpWritePaused(True)
    for _ in range(PONG_HIGH_WATER // PONG + 2):
        c._mayPong(PONG)
    c._tcpWritePaused(False)  # the pongs drained, but the session still wants no input
    assert ws.transport.producerState == "paused"
    c.resumeProducing()
    assert ws.transport.producerState == "producing"


def test_past_the_cap_the_connection_is_dropped_with_a_clear_log_line():
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        c, ws = carrier()
        c._tcpWritePaused(True)
        allowed = [c._mayPong(PONG) for _ in range(PONG_CAP // PONG * 2)]
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert ws.dropped
    assert sum(allowed) * PONG <= PONG_CAP  # no pong went out past the cap
    c._closed(False, 1006, "dropped")
    assert "not reading" in c.protocol.reason.getErrorMessage()
    lines = [e for e in events if "is not reading" in e.get("log_format", "")]
    assert len(lines) == 1 and lines[0]["cap"] == PONG_CAP
