"""The carrier's ``writePieces``: a yamux session's frame header and payload pieces (bytes and
memoryviews of bytes) join the message of the reactor turn unjoined, in order, within the
message bound, exactly as ``write`` of the joined bytes would."""

from twisted.internet import task
from twisted.internet.protocol import Protocol
from twisted.internet.testing import StringTransport

from localai_tw.mux import Session
from localai_tw.mux.frame import FrameDecoder
from localai_tw.tunnel.websocket import WebSocketCarrier


class RecordingWebSocket:
    """What the carrier uses of its Autobahn protocol, keeping each message it sends."""

    def __init__(self):
        self.transport = StringTransport()
        self.messages: list[bytes] = []

    def _sendBinary(self, chunks, size):
        message = b"".join(chunks)
        assert len(message) == size
        self.messages.append(message)


def carrier(bound=1024):
    ws = RecordingWebSocket()
    clock = task.Clock()
    c = WebSocketCarrier(ws, bound, reactor=clock, coalesce_bytes=bound)
    c.protocol = Protocol()
    c.protocol.makeConnection(c)
    return c, ws, clock


def test_pieces_and_writes_keep_their_order_in_one_message():
    c, ws, clock = carrier()
    body = b"0123456789" * 10
    c.write(b"<")
    c.writePieces([b"head", memoryview(body)[10:30], body[:5]], 4 + 20 + 5)
    c.write(b">")
    clock.advance(0)
    assert ws.messages == [b"<" + b"head" + body[10:30] + body[:5] + b">"]


def test_pieces_that_would_pass_the_bound_start_a_new_message():
    c, ws, clock = carrier(bound=100)
    c.write(b"a" * 90)
    c.writePieces([b"h", memoryview(b"b" * 19)], 20)
    clock.advance(0)
    assert ws.messages == [b"a" * 90, b"h" + b"b" * 19]


def test_pieces_larger_than_the_bound_are_split_as_a_write_is():
    c, ws, clock = carrier(bound=100)
    c.writePieces([b"h" * 50, memoryview(b"p" * 200)], 250)
    clock.advance(0)
    assert b"".join(ws.messages) == b"h" * 50 + b"p" * 200
    assert max(map(len, ws.messages)) <= 100


def test_a_session_over_the_carrier_sends_whole_frames_through_pieces():
    c, ws, clock = carrier(bound=1024 * 1024)
    c.protocol = None
    session = Session(True, reactor=clock)
    c.protocol = session
    session.makeConnection(c)
    stream = session.openStream(Protocol())
    payload = bytes(range(256)) * 1000
    stream.write(payload)
    clock.advance(0)
    frames = FrameDecoder(1024 * 1024).feed(b"".join(ws.messages))
    assert b"".join(f.payload for f in frames if f.stream_id == stream.id) == payload
