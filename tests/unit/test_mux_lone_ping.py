"""A read that is exactly one ping SYN (what an idle tunnel reads every few seconds) is answered
on the session's fast path: the same answer bytes, counters and limits as the decoder's path,
and never for twelve bytes that belong to a frame the decoder is in the middle of."""

from twisted.internet import task

from localai_tw.mux import Session, SessionConfig, SessionFailed
from localai_tw.mux.frame import (
    FLAG_SYN,
    HEADER,
    HEADER_SIZE,
    TYPE_PING,
    VERSION,
    Frame,
    encode,
)
from localai_tw.mux.testing import FrameTransport, Recorder

CAP = SessionConfig().reply_cap


def session_on_frames(client=False, acceptor=None, **config):
    session = Session(client, SessionConfig(**config), acceptor, reactor=task.Clock())
    transport = FrameTransport()
    session.makeConnection(transport)
    return session, transport


def test_a_lone_ping_is_answered_with_its_own_opaque_value_whatever_buffer_it_comes_in():
    session, transport = session_on_frames()
    for opaque, wrap in ((0xDEADBEEF, bytes), (1, bytearray), (0x01020304, memoryview)):
        session.dataReceived(wrap(encode(Frame.ping(opaque))))
        assert transport.frames() == [Frame.ping(opaque, ack=True)]
    assert session.bytesReceived == 3 * HEADER_SIZE and session.bytesSent == 3 * HEADER_SIZE
    assert session.isOpen


def test_a_ping_on_a_stream_is_still_a_protocol_error():
    session, transport = session_on_frames()
    session.dataReceived(HEADER.pack(VERSION, TYPE_PING, FLAG_SYN, 3, 5))
    assert not session.isOpen and isinstance(session.ending, SessionFailed)
    assert "ping on stream 3" in str(session.ending)


def test_twelve_bytes_that_complete_a_held_frame_are_data_not_a_ping():
    """The decoder holds a Data frame's header; the next read is its 12-byte payload, which
    happens to spell a ping: it is the stream's data, and nothing is answered."""
    accepted = []
    session, transport = session_on_frames(acceptor=lambda s: accepted.append(s) or Recorder())
    session.dataReceived(encode(Frame.window_update(1, 0, FLAG_SYN)))
    transport.frames()
    [stream] = accepted
    payload = encode(Frame.ping(77))
    session.dataReceived(encode(Frame.data(1, payload))[:HEADER_SIZE])
    session.dataReceived(payload)
    assert transport.frames() == []
    assert stream.protocol.received == payload


def test_lone_pings_from_a_peer_that_reads_nothing_end_the_session_at_the_cap():
    session, transport = session_on_frames()
    session.pauseProducing()  # the carrier's buffer is full: the peer reads nothing
    for i in range(CAP // HEADER_SIZE * 2):
        session.dataReceived(encode(Frame.ping(i)))
        if not session.isOpen:
            break
    assert not session.isOpen and "not reading" in str(session.ending)
    assert len(transport.value()) <= CAP
