"""Bad input from the peer: every case ends the session with go-away(protocol error) and a clean
teardown of every stream; nothing raises out of the session, nothing buffers without bound."""

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import task
from twisted.logger import globalLogPublisher

from localai_tw.mux import Session, SessionConfig, SessionFailed
from localai_tw.mux.frame import (
    FLAG_FIN,
    FLAG_SYN,
    HEADER_SIZE,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    Frame,
    encode,
)
from localai_tw.mux.testing import FrameTransport, HalfCloseRecorder, Recorder

WINDOW = 256 * 1024


def header(version=0, ftype=0, flags=0, sid=0, length=0):
    return struct.pack(">BBHII", version, ftype, flags, sid, length)


def server_with_streams():
    """A server session with a stream the peer opened (1) and one it opened itself (2)."""
    accepted = []

    def acceptor(stream):
        accepted.append(HalfCloseRecorder())
        return accepted[-1]
    clock = task.Clock()
    session = Session(False, SessionConfig(), acceptor, reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    session.dataReceived(encode(Frame.window_update(1, 0, FLAG_SYN)))
    own = HalfCloseRecorder()
    session.openStream(own)
    transport.frames()
    return session, transport, accepted + [own]


BAD_INPUT = {
    "bad version": header(version=1, ftype=TYPE_PING, flags=FLAG_SYN),
    "unknown type": header(ftype=4, sid=1),
    "data beyond the window": encode(Frame.data(1, b"a" * WINDOW)) + encode(Frame.data(1, b"b")),
    "syn on a live id": encode(Frame.window_update(1, 0, FLAG_SYN)),
    "syn with our own parity": encode(Frame.window_update(4, 0, FLAG_SYN)),
    "ping on a stream": encode(Frame(TYPE_PING, FLAG_SYN, 1, 7)),
    "go-away on a stream": encode(Frame(TYPE_GO_AWAY, 0, 1, 0)),
    "window update on stream 0": encode(Frame.window_update(0, 10)),
    "data on stream 0": encode(Frame.data(0, b"x")),
    "length above the limit": header(ftype=TYPE_DATA, sid=1, length=WINDOW + 1),
    "second FIN": encode(Frame.window_update(1, 0, FLAG_FIN)) * 2,
    "data after FIN": encode(Frame.window_update(1, 0, FLAG_FIN)) + encode(Frame.data(1, b"x")),
    "garbage": b"\xff" * 40,
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_ends_the_session_with_protocol_error(case):
    session, transport, protocols = server_with_streams()
    # A paused reader: stream 1 grants no window back and stays live after the peer's FIN.
    protocols[0].transport.pauseProducing()
    session.dataReceived(BAD_INPUT[case])
    assert not session.isOpen
    assert isinstance(session.ending, SessionFailed)
    assert session.ending.cause.startswith("protocol error")
    assert transport.frames()[-1] == Frame.go_away(1)
    assert transport.disconnecting
    for proto in protocols:
        assert proto.lost_calls == 1 and proto.reason.check(SessionFailed)
    assert session.streamCount == 0
    # Anything after the error is ignored, quietly.
    session.dataReceived(encode(Frame.ping(1)) + b"\x00" * 100)
    assert transport.frames() == []


def test_syn_with_wrong_parity_is_refused_for_a_client_too():
    clock = task.Clock()
    session = Session(True, SessionConfig(), lambda s: Recorder(), reactor=clock)
    session.makeConnection(FrameTransport())
    session.dataReceived(encode(Frame.window_update(3, 0, FLAG_SYN)))
    assert not session.isOpen and "parity" in session.ending.cause


def test_frames_split_byte_by_byte_still_work():
    session, transport, protocols = server_with_streams()
    wire = encode(Frame.data(1, b"hello")) + encode(Frame.ping(5)) + encode(Frame.window_update(2, 9))
    for i in range(len(wire)):
        session.dataReceived(wire[i:i + 1])
    assert protocols[0].received == b"hello"
    assert transport.frames() == [Frame.ping(5, ack=True)]
    assert session.isOpen


# -- random input -------------------------------------------------------------------------------

stream_ids = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 2**32 - 1])
random_frames = st.one_of(
    st.builds(Frame.data, stream_ids, st.binary(max_size=64), st.integers(0, 15)),
    st.builds(Frame.window_update, stream_ids,
              st.sampled_from([0, 1, 1000, WINDOW, 2**32 - 1]), st.integers(0, 15)),
    st.builds(lambda sid, flags, v: Frame(TYPE_PING, flags, sid, v),
              st.sampled_from([0, 0, 0, 1]), st.integers(0, 3), st.integers(0, 2**32 - 1)),
    st.builds(lambda sid, code: Frame(TYPE_GO_AWAY, 0, sid, code),
              st.sampled_from([0, 0, 1]), st.integers(0, 3)),
)
chunks = st.one_of(random_frames.map(encode), st.binary(min_size=1, max_size=30))


class Echo(HalfCloseRecorder):
    def dataReceived(self, data):
        super().dataReceived(data)
        self.transport.write(data)

    def readConnectionLost(self):
        super().readConnectionLost()
        self.transport.loseWriteConnection()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(chunks, max_size=25), st.data(), st.booleans())
def test_random_input_never_breaks_the_session(pieces, data, client):
    failures = []

    def observer(event):
        if event.get("log_failure") is not None:
            failures.append(event)
    accepted = []

    def acceptor(stream):
        accepted.append(Echo())
        return accepted[-1]
    clock = task.Clock()
    session = Session(client, SessionConfig(accept_backlog=4), acceptor, reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    own = Echo()
    session.openStream(own, b"hi")
    wire = b"".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    globalLogPublisher.addObserver(observer)
    try:
        previous = 0
        for cut in cuts + [len(wire)]:
            session.dataReceived(wire[previous:cut])   # must never raise
            previous = cut
            clock.advance(1)
    finally:
        globalLogPublisher.removeObserver(observer)
    assert failures == []
    assert session._decoder.buffered < HEADER_SIZE + WINDOW
    for proto in accepted + [own]:
        assert proto.lost_calls <= 1
    if session.isOpen:
        transport.frames()   # what we wrote is well formed
    else:
        assert isinstance(session.ending, SessionFailed)
        assert session.ending.cause.startswith(("protocol error", "peer sent go-away"))
        for proto in accepted + [own]:
            assert proto.lost_calls == 1
