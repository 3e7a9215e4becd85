"""Control before bulk on one session (issue 15 §3): over the WebSocket carrier, which holds up
to one message of frames per reactor turn, a control frame (window update, ping, ping reply) and
the frames of a control stream (one that has sent less than ``bulk_after``) leave ahead of the
bulk Data frames the carrier still holds; frames that must keep their place (a bulk stream's
FIN, the bulk budget's ping) stay behind them; on resume control streams are served first.
Every stream's own bytes keep their order."""

from twisted.internet import task

from localai_tw.mux import Session, SessionConfig
from localai_tw.mux.frame import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_SYN,
    TYPE_DATA,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    Frame,
    FrameDecoder,
    encode,
)
from localai_tw.mux.testing import FrameTransport, Recorder
from localai_tw.tunnel.websocket import WebSocketCarrier

KIB = 1024
WINDOW = 256 * KIB


class RecordingWebSocket:
    """What the carrier uses of its Autobahn protocol, keeping each message it sends."""

    def __init__(self):
        self.messages: list[bytes] = []

    def _sendBinary(self, chunks, size):
        message = b"".join(chunks)
        assert len(message) == size
        self.messages.append(message)


def carrier(bound=1024 * KIB, coalesce=1024 * KIB):
    ws = RecordingWebSocket()
    clock = task.Clock()
    c = WebSocketCarrier(ws, bound, reactor=clock, coalesce_bytes=coalesce)
    return c, ws, clock


def session_over_carrier(**config):
    """A client session over a carrier that coalesces up to 1 MiB per turn."""
    c, ws, clock = carrier()
    session = Session(True, SessionConfig(**config), reactor=clock)
    c.protocol = session
    session.makeConnection(c)
    return session, c, ws, clock


def sent_frames(ws, clock):
    clock.advance(0)
    frames = FrameDecoder(2**32 - 1).feed(b"".join(ws.messages))
    ws.messages.clear()
    return frames


def position(frames, predicate):
    return next(i for i, f in enumerate(frames) if predicate(f))


def data_of(frames, stream_id):
    return b"".join(f.payload for f in frames if f.type == TYPE_DATA and f.stream_id == stream_id)


# -- the carrier ---------------------------------------------------------------------------------


def test_urgent_writes_go_ahead_of_held_writes_in_their_own_order():
    c, ws, clock = carrier()
    c.write(b"bulk-1 ")
    c.writePieces([b"bulk-2 ", memoryview(b"pieces ")], 14)
    c.writeUrgent(b"urgent-1 ")
    c.write(b"bulk-3")
    c.writeUrgent(b"urgent-2 ")
    clock.advance(0)
    assert ws.messages == [b"urgent-1 urgent-2 bulk-1 bulk-2 pieces bulk-3"]


def test_urgent_writes_count_toward_the_message_bound_and_the_coalescing():
    c, ws, clock = carrier(bound=100, coalesce=100)
    c.write(b"b" * 95)
    c.writeUrgent(b"u" * 10)  # would pass the bound: what is held goes first, as one message
    c.writeUrgent(b"v" * 90)  # reaches the coalescing size: sent at once
    assert ws.messages == [b"b" * 95, b"u" * 10 + b"v" * 90]
    c.writeUrgent(b"w" * 250)  # above the bound: split as a plain write is
    clock.advance(0)
    assert b"".join(ws.messages[2:]) == b"w" * 250
    assert max(map(len, ws.messages)) <= 100


# -- the session over the carrier -----------------------------------------------------------


def test_a_control_write_leaves_ahead_of_the_bulk_frames_the_carrier_holds():
    session, _c, ws, clock = session_over_carrier()
    bulk = session.openStream(Recorder())
    control = session.openStream(Recorder())
    sent_frames(ws, clock)
    # The bulk stream is past bulk_after (its peer granted it a large window); the frames of
    # this turn wait in the carrier for the end of the turn.
    session.dataReceived(encode(Frame.window_update(bulk.id, 4 * WINDOW, FLAG_ACK)))
    bulk.write(b"b" * WINDOW)
    bulk.write(b"B" * WINDOW)
    control.write(b"x")
    frames = sent_frames(ws, clock)
    first_bulk = position(frames, lambda f: f.stream_id == bulk.id and f.type == TYPE_DATA
                          and f.payload[:1] == b"B")
    assert position(frames, lambda f: f.stream_id == control.id) < first_bulk
    # Nothing lost or reordered within a stream.
    assert data_of(frames, bulk.id) == b"b" * WINDOW + b"B" * WINDOW
    assert data_of(frames, control.id) == b"x"


def test_a_window_grant_and_a_ping_reply_overtake_held_bulk_frames():
    session, c, ws, clock = session_over_carrier(bulk_after=0)
    bulk = session.openStream(Recorder())
    inbound = session.openStream(Recorder())
    sent_frames(ws, clock)
    c._startBatch()  # one read: the peer's data, a ping, while our bulk frames are held
    bulk.write(b"b" * WINDOW)
    session.dataReceived(encode(Frame.data(inbound.id, b"i" * (WINDOW // 2), FLAG_ACK))
                         + encode(Frame.ping(7)))
    c._endBatch()
    frames = sent_frames(ws, clock)
    first_bulk = position(frames, lambda f: f.type == TYPE_DATA)
    grant = position(frames, lambda f: f.type == TYPE_WINDOW_UPDATE
                     and f.stream_id == inbound.id and f.length == WINDOW // 2)
    reply = position(frames, lambda f: f == Frame.ping(7, ack=True))
    assert grant < first_bulk and reply < first_bulk
    assert data_of(frames, bulk.id) == b"b" * WINDOW


def test_a_bulk_streams_fin_stays_behind_its_data():
    session, _c, ws, clock = session_over_carrier(bulk_after=0)
    bulk = session.openStream(Recorder())
    sent_frames(ws, clock)
    bulk.write(b"b" * (WINDOW // 2))
    bulk.loseWriteConnection()
    frames = [f for f in sent_frames(ws, clock) if f.stream_id == bulk.id]
    assert frames[-1].has(FLAG_FIN)
    assert data_of(frames, bulk.id) == b"b" * (WINDOW // 2)


def test_a_stream_that_becomes_bulk_keeps_its_order():
    # The first frames go the urgent way (less than bulk_after sent), the rest the plain way:
    # the urgent ones are ahead, so the stream's bytes still arrive in order, FIN last.
    session, _c, ws, clock = session_over_carrier(bulk_after=100 * KIB)
    other = session.openStream(Recorder())
    stream = session.openStream(Recorder())
    sent_frames(ws, clock)
    session.dataReceived(encode(Frame.window_update(stream.id, 4 * WINDOW, FLAG_ACK))
                         + encode(Frame.window_update(other.id, 4 * WINDOW, FLAG_ACK)))
    other.write(b"o" * (300 * KIB))
    body = bytes(range(256)) * (1200 * KIB // 256)
    stream.write(body)
    stream.loseWriteConnection()
    frames = [f for f in sent_frames(ws, clock) if f.stream_id == stream.id]
    assert data_of(frames, stream.id) == body
    assert frames[-1].has(FLAG_FIN) and frames[-1].type == TYPE_WINDOW_UPDATE


def test_the_budget_ping_stays_behind_the_data_it_acknowledges():
    session, _c, ws, clock = session_over_carrier(bulk_in_flight=4 * 64 * KIB, bulk_after=0)
    bulk = session.openStream(Recorder())
    sent_frames(ws, clock)
    bulk.write(b"b" * WINDOW)
    frames = sent_frames(ws, clock)
    ping = position(frames, lambda f: f.type == TYPE_PING and f.has(FLAG_SYN))
    assert ping > 0 and frames[ping - 1].type == TYPE_DATA  # right after the frame it follows


# -- the session's order on resume -------------------------------------------------------------


def test_on_resume_a_control_stream_is_served_before_every_bulk_stream():
    session = Session(True, SessionConfig(bulk_after=64 * KIB), reactor=task.Clock())
    transport = FrameTransport()
    session.makeConnection(transport)
    bulk = [session.openStream(Recorder()) for _ in range(3)]
    control = session.openStream(Recorder())
    for stream in bulk:
        stream.write(b"b" * (64 * KIB))  # each is a bulk stream now
    transport.frames()
    session.pauseProducing()
    for stream in bulk:
        stream.write(b"b" * (64 * KIB))
    control.write(b"x")
    session.resumeProducing()
    frames = [f for f in transport.frames() if f.type == TYPE_DATA]
    assert frames[0].stream_id == control.id
    assert [len(data_of(frames, s.id)) for s in bulk] == [64 * KIB] * 3
