"""Stream life cycle: half-close both ways, resets both ways, and the one connectionLost each
protocol gets, with a reason that says which ending it was."""

from twisted.internet import task
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IConsumer, IPushProducer, ITransport
from twisted.python.failure import Failure

from localai_tw.mux import (
    MuxAddress,
    SessionEnded,
    SessionFailed,
    StreamClosed,
    StreamReset,
    StreamState,
)
from localai_tw.mux.frame import FLAG_ACK, FLAG_FIN, FLAG_RST, FLAG_SYN, Frame, encode
from localai_tw.mux.session import Session, SessionConfig
from localai_tw.mux.testing import (
    FrameTransport,
    HalfCloseRecorder,
    Recorder,
    StreamingProducer,
    connectedSessions,
)


def pair(server_protocol_factory=HalfCloseRecorder, **kw):
    """A client/server pair whose server side accepts with ``server_protocol_factory``."""
    accepted = []

    def acceptor(stream):
        proto = server_protocol_factory()
        accepted.append(proto)
        return proto
    client, server, pump, clock = connectedSessions(server_acceptor=acceptor, **kw)
    return client, server, pump, clock, accepted


def raw_client():
    clock = task.Clock()
    session = Session(True, SessionConfig(), reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    return session, transport, clock


def test_stream_declares_its_interfaces():
    client, server, pump, clock, _ = pair()
    stream = client.openStream(Recorder())
    assert ITransport.providedBy(stream)
    assert IPushProducer.providedBy(stream)
    assert IConsumer.providedBy(stream)
    peer = stream.getPeer()
    assert isinstance(peer, MuxAddress) and peer.stream_id == stream.id


def test_half_close_local_keeps_reading():
    client, server, pump, clock, accepted = pair()
    local = HalfCloseRecorder()
    stream = client.openStream(local, b"request")
    stream.loseWriteConnection()
    pump.flush()
    remote = accepted[0]
    assert remote.received == b"request"
    assert remote.read_lost                    # the server saw our FIN ...
    assert stream.state is StreamState.HALF_CLOSED_LOCAL
    assert local.write_lost and local.reason is None
    remote.transport.write(b"response")        # ... and can still answer
    pump.flush()
    assert local.received == b"response"
    remote.transport.loseWriteConnection()
    pump.flush()
    assert local.events == ["writeConnectionLost", "data", "readConnectionLost", "connectionLost"]
    assert local.reason.check(StreamClosed) and remote.reason.check(StreamClosed)
    assert local.lost_calls == remote.lost_calls == 1
    assert client.streamCount == 0 and server.streamCount == 0


def test_half_close_remote_keeps_writing():
    client, server, pump, clock, accepted = pair()
    local = HalfCloseRecorder()
    stream = client.openStream(local)
    pump.flush()
    accepted[0].transport.loseWriteConnection()
    pump.flush()
    assert local.read_lost and stream.state is StreamState.HALF_CLOSED_REMOTE
    stream.write(b"after your FIN")
    pump.flush()
    assert accepted[0].received == b"after your FIN"
    stream.loseWriteConnection()
    pump.flush()
    assert local.reason.check(StreamClosed) and accepted[0].reason.check(StreamClosed)


def test_fin_is_sent_only_once():
    session, transport, _ = raw_client()
    stream = session.openStream(HalfCloseRecorder())
    transport.frames()
    stream.loseWriteConnection()
    stream.loseWriteConnection()
    stream.loseConnection()
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_FIN)]


def test_fin_waits_for_buffered_data_and_goes_on_its_own_frame():
    session, transport, _ = raw_client()
    stream = session.openStream(HalfCloseRecorder())
    transport.frames()
    stream.write(b"x" * (256 * 1024 + 10))   # 10 bytes beyond the window
    stream.loseWriteConnection()
    frames = transport.frames()
    assert not any(f.has(FLAG_FIN) for f in frames)
    session.dataReceived(encode(Frame.window_update(1, 1000)))
    # Never FIN on a Data frame with payload: Go df201c7 may drop that payload.
    assert transport.frames() == [Frame.data(1, b"x" * 10), Frame.window_update(1, 0, FLAG_FIN)]


def test_writes_after_half_close_are_dropped():
    session, transport, _ = raw_client()
    stream = session.openStream(HalfCloseRecorder())
    stream.loseWriteConnection()
    transport.frames()
    stream.write(b"too late")
    assert transport.frames() == []


def test_inbound_fin_delivered_only_after_buffered_data():
    client, server, pump, clock, accepted = pair()
    local = HalfCloseRecorder()
    stream = client.openStream(local)
    pump.flush()
    stream.pauseProducing()
    accepted[0].transport.write(b"buffered")
    accepted[0].transport.loseWriteConnection()
    pump.flush()
    assert local.events == []
    stream.resumeProducing()
    assert local.events == ["data", "readConnectionLost"]


def test_protocol_without_half_close_is_closed_on_inbound_fin_like_tcp():
    client, server, pump, clock, accepted = pair()
    local = Recorder()
    stream = client.openStream(local)
    pump.flush()
    accepted[0].transport.write(b"last words")
    accepted[0].transport.loseWriteConnection()
    pump.flush()
    assert local.received == b"last words"
    assert local.reason.check(StreamClosed)
    assert accepted[0].reason.check(StreamClosed)    # our FIN went back
    assert client.streamCount == 0 and server.streamCount == 0


def test_lose_connection_ends_our_protocol_once_fin_is_out_and_drops_inbound():
    client, server, pump, clock, accepted = pair()
    local = Recorder()
    stream = client.openStream(local, b"bye")
    stream.loseConnection()
    # Never from inside loseConnection(): callers (twisted.web's HTTP client) set up their
    # wait for connectionLost after calling it, as TCP allows.
    assert local.reason is None
    clock.advance(0)
    assert local.reason.check(StreamClosed)
    pump.flush()
    accepted[0].transport.write(b"nobody listens")
    pump.flush()
    assert local.received == b"" and local.lost_calls == 1
    assert client.streamCount == 1                 # the id lives until the peer's FIN
    accepted[0].transport.loseWriteConnection()
    pump.flush()
    assert client.streamCount == 0 and server.streamCount == 0
    assert local.lost_calls == 1


def test_protocol_resetting_its_stream_on_the_last_data_frame_keeps_the_session():
    class AbortOnData(Recorder):
        def dataReceived(self, data):
            super().dataReceived(data)
            self.transport.abortConnection()
    session, transport, clock = raw_client()
    proto = AbortOnData()
    session.openStream(proto)
    transport.frames()
    session.dataReceived(encode(Frame.data(1, b"last", FLAG_ACK | FLAG_FIN)))
    clock.advance(0)
    assert proto.reason.check(StreamReset)
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_RST)]
    assert session.isOpen


def test_finished_streams_leave_no_trace_in_the_session():
    client, server, pump, clock, accepted = pair(Recorder)   # closes on the peer's FIN
    for _ in range(5):
        client.openStream(Recorder(), b"x").loseConnection()
    stream = client.openStream(Recorder())
    pump.flush()
    stream.abortConnection()
    pump.flush()
    for session in (client, server):
        assert session.streamCount == 0
        assert not session._rotation and not session._lingering


def test_lingering_stream_is_reset_when_the_peer_never_sends_fin():
    client, server, pump, clock, accepted = pair()
    stream = client.openStream(Recorder())
    stream.loseConnection()
    pump.flush()
    clock.advance(300)
    pump.flush()
    assert client.streamCount == 0
    assert accepted[0].reason.check(StreamReset) and accepted[0].reason.value.remote


def test_abort_resets_both_sides():
    client, server, pump, clock, accepted = pair()
    local = HalfCloseRecorder()
    stream = client.openStream(local, b"data")
    pump.flush()
    stream.write(b"never sent" * 100_000)        # queued beyond the window, then dropped
    stream.abortConnection()
    assert local.reason is None                   # delivered on the next turn, as TCP does
    clock.advance(0)
    assert local.reason.check(StreamReset) and local.reason.value.remote is False
    assert stream.state is StreamState.RESET
    pump.flush()
    assert accepted[0].reason.check(StreamReset) and accepted[0].reason.value.remote is True
    assert client.streamCount == 0 and server.streamCount == 0
    assert client.isOpen and server.isOpen


def test_remote_reset_from_server_side():
    client, server, pump, clock, accepted = pair()
    local = HalfCloseRecorder()
    client.openStream(local)
    pump.flush()
    accepted[0].transport.abortConnection()
    pump.flush()
    assert local.reason.check(StreamReset) and local.reason.value.remote is True
    assert accepted[0].reason.value.remote is False


def test_rst_length_is_opaque():
    session, transport, _ = raw_client()
    proto = Recorder()
    stream = session.openStream(proto)
    session.dataReceived(encode(Frame.window_update(1, 0xDEAD, FLAG_RST)))
    assert proto.reason.check(StreamReset)
    assert stream._send_window == 256 * 1024    # not taken as a window increment
    assert session.isOpen


def test_rst_on_a_data_frame_longer_than_the_window_is_not_a_violation():
    session, transport, _ = raw_client()
    proto = Recorder()
    session.openStream(proto)
    session.dataReceived(encode(Frame.data(1, b"z" * 1000, FLAG_RST)))
    assert proto.reason.check(StreamReset) and session.isOpen


def test_session_end_reaches_every_stream_exactly_once():
    client, server, pump, clock, accepted = pair()
    protocols = [HalfCloseRecorder() for _ in range(3)]
    for p in protocols:
        client.openStream(p)
    pump.flush()
    client.loseConnection()
    pump.flush()
    assert all(p.reason.check(SessionEnded) and p.lost_calls == 1 for p in protocols)
    assert all(p.reason.check(SessionEnded) and p.lost_calls == 1 for p in accepted)


def test_transport_failure_reaches_every_stream_as_session_failed():
    session, transport, _ = raw_client()
    protocols = [Recorder() for _ in range(2)]
    for p in protocols:
        session.openStream(p)
    session.connectionLost(Failure(ConnectionLost()))
    assert all(p.reason.check(SessionFailed) for p in protocols)


def test_connection_lost_is_delivered_once_even_after_reset_then_session_end():
    session, transport, clock = raw_client()
    proto = Recorder()
    stream = session.openStream(proto)
    stream.abortConnection()
    session.loseConnection()
    clock.advance(0)
    assert proto.lost_calls == 1 and proto.reason.check(StreamReset)


def test_producer_is_stopped_when_the_stream_ends():
    session, transport, _ = raw_client()
    stream = session.openStream(Recorder())
    producer = StreamingProducer()
    stream.registerProducer(producer, True)
    session.dataReceived(encode(Frame.window_update(1, 0, FLAG_RST)))
    assert producer.stopped


def test_register_producer_on_a_closed_stream_stops_it():
    session, transport, _ = raw_client()
    stream = session.openStream(Recorder())
    stream.abortConnection()
    producer = StreamingProducer()
    stream.registerProducer(producer, True)
    assert producer.stopped


def test_second_fin_from_peer_is_a_protocol_error():
    session, transport, _ = raw_client()
    proto = Recorder()
    stream = session.openStream(proto)
    stream.pauseProducing()    # keep the stream alive in half-closed-remote
    session.dataReceived(encode(Frame.window_update(1, 0, FLAG_ACK | FLAG_FIN)))
    session.dataReceived(encode(Frame.window_update(1, 0, FLAG_FIN)))
    assert not session.isOpen
    assert "FIN" in session.ending.cause
    assert proto.reason.check(SessionFailed)


def test_connect_protocol_on_a_stream_that_died_in_the_backlog():
    clock = task.Clock()
    session = Session(False, SessionConfig(), reactor=clock)
    session.makeConnection(FrameTransport())
    session.dataReceived(encode(Frame.window_update(1, 0, FLAG_SYN)))
    streams = []
    session.accept().addCallback(streams.append)
    session.dataReceived(encode(Frame.window_update(1, 0, FLAG_RST)))
    proto = Recorder()
    streams[0].connectProtocol(proto)
    assert proto.made and proto.reason.check(StreamReset)


def test_syn_data_fin_in_one_frame():
    accepted = []

    def acceptor(stream):
        accepted.append(HalfCloseRecorder())
        return accepted[-1]
    clock = task.Clock()
    session = Session(False, SessionConfig(), acceptor, reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    session.dataReceived(encode(Frame.data(1, b"all at once", FLAG_SYN | FLAG_FIN)))
    assert accepted[0].events == ["data", "readConnectionLost"]
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_ACK)]
