"""Session behaviour: opening and accepting streams, limits, pings, keepalive, go-away, endings."""

import pytest
from twisted.internet import task
from twisted.internet.error import ConnectionLost
from twisted.python.failure import Failure

from localai_tw.mux import (
    KeepaliveTimeout,
    Session,
    SessionConfig,
    SessionEnded,
    SessionFailed,
    SessionNotOpen,
    StreamClosed,
    StreamState,
    TooManyStreams,
)
from localai_tw.mux.frame import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    TYPE_DATA,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    Frame,
    encode,
)
from localai_tw.mux.testing import FrameTransport, Recorder, connectedSessions


def raw_session(client=False, acceptor=None, **config):
    """A session on a transport we read frames from and write frames to by hand."""
    clock = task.Clock()
    session = Session(client, SessionConfig(**config), acceptor, reactor=clock)
    transport = FrameTransport()
    session.makeConnection(transport)
    return session, transport, clock


def feed(session, *frames):
    session.dataReceived(b"".join(encode(f) for f in frames))


# -- opening and accepting ------------------------------------------------------------------


def test_client_opens_odd_ids_server_even_ids_never_reused():
    accepted = []
    client, server, pump, _ = connectedSessions(
        client_acceptor=lambda s: accepted.append(s) or Recorder(),
        server_acceptor=lambda s: accepted.append(s) or Recorder())
    ids_c = [client.openStream(Recorder()).id for _ in range(3)]
    ids_s = [server.openStream(Recorder()).id for _ in range(3)]
    pump.flush()
    assert ids_c == [1, 3, 5]
    assert ids_s == [2, 4, 6]
    assert sorted(s.id for s in accepted) == [1, 2, 3, 4, 5, 6]
    # closing a stream never frees its id for reuse
    for s in list(client._streams.values()):
        s.abortConnection()
    pump.flush()
    assert client.openStream(Recorder()).id == 7


def test_open_without_data_sends_syn_on_a_window_update():
    session, transport, _ = raw_session(client=True)
    stream = session.openStream(Recorder())
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_SYN)]
    assert stream.state is StreamState.SYN_SENT


def test_open_with_data_puts_syn_on_the_first_data_frame():
    session, transport, _ = raw_session(client=True)
    session.openStream(Recorder(), b"preamble")
    assert transport.frames() == [Frame.data(1, b"preamble", FLAG_SYN)]


def test_larger_max_window_is_advertised_on_the_syn_as_go_does():
    session, transport, _ = raw_session(client=True, max_window=4 * 1024 * 1024)
    session.openStream(Recorder(), b"x")
    assert transport.frames() == [Frame.window_update(1, 3_932_160, FLAG_SYN),
                                  Frame.data(1, b"x")]


def test_ack_moves_syn_sent_to_open():
    session, transport, _ = raw_session(client=True)
    stream = session.openStream(Recorder())
    feed(session, Frame.window_update(1, 0, FLAG_ACK))
    assert stream.state is StreamState.OPEN


def test_inbound_syn_on_window_update_is_acked_and_handed_to_acceptor():
    protocols = []
    session, transport, _ = raw_session(acceptor=lambda s: protocols.append(Recorder()) or protocols[-1])
    feed(session, Frame.window_update(1, 0, FLAG_SYN))
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_ACK)]
    assert protocols[0].made
    assert protocols[0].transport.state is StreamState.OPEN


def test_inbound_syn_on_data_frame_delivers_its_payload():
    protocols = []
    session, transport, _ = raw_session(acceptor=lambda s: protocols.append(Recorder()) or protocols[-1])
    feed(session, Frame.data(1, b"hello", FLAG_SYN))
    assert protocols[0].received == b"hello"
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_ACK)]


def test_ack_carries_the_extra_window_when_configured_larger():
    session, transport, _ = raw_session(acceptor=lambda s: Recorder(), max_window=4 * 1024 * 1024)
    feed(session, Frame.window_update(1, 0, FLAG_SYN))
    assert transport.frames() == [Frame.window_update(1, 3_932_160, FLAG_ACK)]


def test_acceptor_returning_none_refuses_with_rst():
    session, transport, _ = raw_session(acceptor=lambda s: None)
    feed(session, Frame.window_update(1, 0, FLAG_SYN))
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_RST)]
    assert session.streamCount == 0 and session.isOpen


def test_acceptor_raising_refuses_only_that_stream():
    def acceptor(stream):
        raise RuntimeError("boom")
    session, transport, _ = raw_session(acceptor=acceptor)
    feed(session, Frame.window_update(1, 0, FLAG_SYN))
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_RST)]
    assert session.isOpen


def test_accept_deferred_gets_streams_in_order_and_acks_on_accept():
    session, transport, _ = raw_session()
    feed(session, Frame.data(1, b"one", FLAG_SYN), Frame.window_update(3, 0, FLAG_SYN))
    assert transport.frames() == []  # nobody accepted yet: no ACK
    results = []
    session.accept().addCallback(results.append)
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_ACK)]
    proto = Recorder()
    results[0].connectProtocol(proto)
    assert proto.received == b"one"
    d = session.accept()
    d.addCallback(results.append)
    assert [s.id for s in results] == [1, 3]


def test_accept_waiting_before_syn_fires_on_syn():
    session, transport, _ = raw_session()
    results = []
    session.accept().addCallback(results.append)
    feed(session, Frame.window_update(1, 0, FLAG_SYN))
    assert [s.id for s in results] == [1]
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_ACK)]


def test_accept_waiters_are_served_in_order_and_a_cancelled_one_is_skipped():
    session, _, _ = raw_session()
    first, cancelled, third = [], [], []
    session.accept().addCallback(first.append)
    gone = session.accept()
    gone.addErrback(lambda f: cancelled.append(f))
    session.accept().addCallback(third.append)
    gone.cancel()
    feed(session, Frame.window_update(1, 0, FLAG_SYN), Frame.window_update(3, 0, FLAG_SYN))
    assert [s.id for s in first] == [1] and [s.id for s in third] == [3]
    assert len(cancelled) == 1


def test_backlog_overflow_is_refused_with_rst():
    session, transport, _ = raw_session(accept_backlog=2)
    feed(session, *[Frame.window_update(i, 0, FLAG_SYN) for i in (1, 3, 5)])
    assert transport.frames() == [Frame.window_update(5, 0, FLAG_RST)]
    assert session.streamCount == 2 and session.isOpen


def test_default_backlog_is_256():
    session, transport, _ = raw_session()
    feed(session, *[Frame.window_update(2 * i + 1, 0, FLAG_SYN) for i in range(257)])
    assert transport.frames() == [Frame.window_update(513, 0, FLAG_RST)]


def test_reset_stream_leaves_the_backlog():
    session, transport, _ = raw_session()
    feed(session, Frame.window_update(1, 0, FLAG_SYN), Frame.window_update(3, 0, FLAG_SYN),
         Frame.window_update(1, 0, FLAG_RST))
    results = []
    session.accept().addCallback(results.append)
    assert [s.id for s in results] == [3]


def test_inbound_beyond_max_streams_is_refused_with_rst():
    session, transport, _ = raw_session(acceptor=lambda s: Recorder(), max_streams=2)
    feed(session, *[Frame.window_update(i, 0, FLAG_SYN) for i in (1, 3, 5)])
    assert transport.frames()[-1] == Frame.window_update(5, 0, FLAG_RST)
    assert session.streamCount == 2


def test_outbound_beyond_max_streams_raises():
    session, transport, _ = raw_session(client=True, max_streams=1)
    session.openStream(Recorder())
    with pytest.raises(TooManyStreams):
        session.openStream(Recorder())


def test_accept_streams_false_refuses_every_inbound_stream():
    session, transport, _ = raw_session(acceptor=lambda s: Recorder(), accept_streams=False)
    feed(session, Frame.data(1, b"hi", FLAG_SYN))
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_RST)]


def test_frames_for_unknown_ids_are_dropped_quietly():
    session, transport, _ = raw_session(acceptor=lambda s: Recorder())
    feed(session, Frame.data(9, b"stray"), Frame.window_update(11, 100),
         Frame.window_update(13, 0, FLAG_FIN), Frame.window_update(15, 0, FLAG_RST),
         Frame.ping(1))
    assert transport.frames() == [Frame.ping(1, ack=True)]
    assert session.isOpen


def test_frames_for_a_finished_id_are_dropped_quietly():
    session, transport, _ = raw_session(acceptor=lambda s: Recorder())
    feed(session, Frame.window_update(1, 0, FLAG_SYN), Frame.window_update(1, 0, FLAG_RST))
    feed(session, Frame.data(1, b"late"), Frame.window_update(1, 0, FLAG_FIN))
    assert session.isOpen


def test_protocol_exception_resets_only_its_stream():
    class Explodes(Recorder):
        def dataReceived(self, data):
            raise ValueError("bug in the protocol")
    good = Recorder()
    bad = Explodes()
    protocols = iter([bad, good])
    session, transport, _ = raw_session(acceptor=lambda s: next(protocols))
    feed(session, Frame.data(1, b"x", FLAG_SYN), Frame.data(3, b"y", FLAG_SYN))
    frames = transport.frames()
    assert Frame.window_update(1, 0, FLAG_RST) in frames
    assert bad.reason.check(ConnectionLost) and not bad.reason.value.remote
    assert good.received == b"y" and good.reason is None
    assert session.isOpen


# -- pings and keepalive --------------------------------------------------------------------


def test_ping_is_echoed_with_the_same_opaque_value():
    session, transport, _ = raw_session()
    feed(session, Frame.ping(0xDEADBEEF))
    assert transport.frames() == [Frame.ping(0xDEADBEEF, ack=True)]


def test_ping_ack_is_never_echoed():
    session, transport, _ = raw_session()
    feed(session, Frame.ping(7, ack=True))
    assert transport.frames() == []


def test_ping_reply_goes_out_while_the_transport_has_paused_us():
    session, transport, _ = raw_session(client=True)
    stream = session.openStream(Recorder())
    transport.frames()
    session.pauseProducing()
    stream.write(b"queued")
    feed(session, Frame.ping(3))
    assert transport.frames() == [Frame.ping(3, ack=True)]


def test_ping_reports_round_trip_time():
    client, server, pump, clock = connectedSessions()
    results = []
    client.ping().addCallback(results.append)
    pump.flush()
    assert results == [0.0]


def test_keepalive_pings_every_30s_and_survives_with_replies():
    client, server, pump, clock = connectedSessions()
    for _ in range(5):
        clock.advance(30)
        pump.flush()
    assert client.isOpen and server.isOpen


def test_keepalive_sends_ping_after_interval():
    session, transport, clock = raw_session()
    clock.advance(29.9)
    assert transport.frames() == []
    clock.advance(0.1)
    frames = transport.frames()
    assert len(frames) == 1 and frames[0].type == TYPE_PING and frames[0].has(FLAG_SYN)


def test_keepalive_timeout_ends_the_session_and_every_stream():
    session, transport, clock = raw_session(client=True)
    proto = Recorder()
    session.openStream(proto)
    clock.advance(30)
    clock.advance(9.9)
    assert session.isOpen
    clock.advance(0.1)
    assert not session.isOpen
    assert isinstance(session.ending, KeepaliveTimeout) and session.ending.timeout == 10
    assert proto.reason.check(KeepaliveTimeout)
    assert transport.disconnecting


def test_keepalive_reply_cancels_the_timeout():
    session, transport, clock = raw_session()
    clock.advance(30)
    ping = transport.frames()[0]
    clock.advance(5)
    feed(session, Frame.ping(ping.length, ack=True))
    clock.advance(20)
    assert session.isOpen
    assert clock.getDelayedCalls()  # the next keepalive is scheduled


def test_keepalive_can_be_disabled():
    session, transport, clock = raw_session(keepalive_interval=None)
    clock.advance(1000)
    assert transport.frames() == [] and session.isOpen


def test_ping_fails_when_the_session_ends():
    session, transport, clock = raw_session()
    failures = []
    session.ping().addErrback(failures.append)
    session.connectionLost(Failure(ConnectionLost()))
    assert failures[0].check(SessionFailed)


# -- go-away --------------------------------------------------------------------------------


def test_received_goaway_normal_stops_new_opens_but_keeps_streams():
    session, transport, _ = raw_session(client=True)
    proto = Recorder()
    stream = session.openStream(proto)
    feed(session, Frame.go_away(0))
    with pytest.raises(SessionNotOpen):
        session.openStream(Recorder())
    feed(session, Frame.data(1, b"still here"))
    assert proto.received == b"still here"
    stream.write(b"reply")
    assert Frame.data(1, b"reply") in transport.frames()
    assert session.isOpen


def test_after_sending_goaway_new_syns_get_rst():
    session, transport, _ = raw_session(acceptor=lambda s: Recorder())
    feed(session, Frame.window_update(1, 0, FLAG_SYN))
    session.goAway()
    assert transport.frames()[-1] == Frame.go_away(0)
    feed(session, Frame.window_update(3, 0, FLAG_SYN))
    assert transport.frames() == [Frame.window_update(3, 0, FLAG_RST)]
    assert session.streamCount == 1


@pytest.mark.parametrize("code", [1, 2, 77])
def test_received_goaway_error_ends_the_session(code):
    session, transport, _ = raw_session(client=True)
    proto = Recorder()
    session.openStream(proto)
    feed(session, Frame.go_away(code))
    assert not session.isOpen
    assert isinstance(session.ending, SessionFailed)
    assert proto.reason.check(SessionFailed)
    assert transport.disconnecting


def test_local_lose_connection_sends_goaway_and_ends_streams_normally():
    session, transport, _ = raw_session(client=True)
    proto = Recorder()
    session.openStream(proto)
    transport.frames()
    closed = []
    session.whenClosed().addCallback(closed.append)
    session.loseConnection()
    assert transport.frames() == [Frame.go_away(0)]
    assert proto.reason.check(SessionEnded)
    assert isinstance(closed[0], SessionEnded)
    assert transport.disconnecting


def test_clean_eof_is_a_normal_ending_and_transport_error_a_failure():
    client, server, pump, _ = connectedSessions(server_acceptor=lambda s: Recorder())
    proto = Recorder()
    client.openStream(proto)
    pump.flush()
    server.transport.loseConnection()  # like Go's Session.Close(): no go-away
    pump.flush()
    assert proto.reason.check(SessionEnded)

    session, transport, _ = raw_session(client=True)
    proto = Recorder()
    session.openStream(proto)
    session.connectionLost(Failure(ConnectionLost("reset by peer")))
    assert proto.reason.check(SessionFailed)
    assert proto.lost_calls == 1


def test_open_after_end_raises_session_not_open():
    session, transport, _ = raw_session(client=True)
    session.loseConnection()
    with pytest.raises(SessionNotOpen):
        session.openStream(Recorder())
    failures = []
    session.accept().addErrback(failures.append)
    assert failures[0].check(SessionEnded)


def test_pending_accept_fails_when_session_ends():
    session, transport, _ = raw_session()
    failures = []
    session.accept().addErrback(failures.append)
    feed(session, Frame.go_away(1))
    assert failures[0].check(SessionFailed)


def test_abort_ends_with_session_failed():
    session, transport, _ = raw_session(client=True)
    proto = Recorder()
    session.openStream(proto)
    session.abort("operator said so")
    assert proto.reason.check(SessionFailed)
    assert "operator said so" in session.ending.cause


def test_when_closed_after_the_end_fires_at_once():
    session, transport, _ = raw_session()
    session.loseConnection()
    results = []
    session.whenClosed().addCallback(results.append)
    assert isinstance(results[0], SessionEnded)


def test_config_refuses_a_window_below_256k():
    with pytest.raises(ValueError):
        SessionConfig(max_window=1024)


def test_stream_frames_carry_their_stream_id_and_types():
    session, transport, _ = raw_session(client=True)
    stream = session.openStream(Recorder(), b"a")
    stream.loseWriteConnection()
    frames = transport.frames()
    assert [f.type for f in frames] == [TYPE_DATA, TYPE_WINDOW_UPDATE]
    assert frames[1] == Frame.window_update(1, 0, FLAG_FIN)
    assert all(f.stream_id == 1 for f in frames)


def test_both_sides_can_open_and_exchange_data_and_close():
    def echo_acceptor(stream):
        class Echo(Recorder):
            def dataReceived(self, data):
                super().dataReceived(data)
                self.transport.write(data.upper())
        return Echo()
    client, server, pump, _ = connectedSessions(client_acceptor=echo_acceptor,
                                                server_acceptor=echo_acceptor)
    a, b = Recorder(), Recorder()
    sa = client.openStream(a, b"from client")
    sb = server.openStream(b, b"from server")
    pump.flush()
    assert a.received == b"FROM CLIENT" and b.received == b"FROM SERVER"
    sa.loseConnection()
    sb.loseConnection()
    pump.flush()
    assert a.reason.check(StreamClosed) and b.reason.check(StreamClosed)
    assert client.streamCount == 0 and server.streamCount == 0


def test_a_bug_in_frame_handling_ends_the_session_with_internal_error(monkeypatch):
    session, transport, _ = raw_session(client=True)
    proto = Recorder()
    session.openStream(proto)
    transport.frames()

    def broken(frame):
        raise KeyError("bug")
    monkeypatch.setattr(session, "_handlePing", broken)
    # (an answer to a ping: a lone ping SYN is answered on a fast path without _handlePing)
    session.dataReceived(encode(Frame.ping(1, ack=True)))     # must not raise
    assert transport.frames() == [Frame.go_away(2)]
    assert session.ending.cause == "internal error"
    assert proto.reason.check(SessionFailed)


def test_ids_run_out_below_2_to_the_32_minus_2():
    from localai_tw.mux import StreamsExhausted
    session, transport, _ = raw_session(client=True)
    session._next_id = 2**32 - 3
    assert session.openStream(Recorder()).id == 2**32 - 3
    with pytest.raises(StreamsExhausted):
        session.openStream(Recorder())


def test_open_before_the_carrier_is_connected_raises():
    with pytest.raises(SessionNotOpen):
        Session(True, reactor=task.Clock()).openStream(Recorder())


def test_a_conversation_cut_into_5_byte_pieces():
    """The WebSocket carrier may cut the byte stream anywhere; nothing may depend on it."""
    class Echo(Recorder):
        def dataReceived(self, data):
            self.transport.write(data)
    clock = task.Clock()
    client = Session(True, reactor=clock)
    server = Session(False, acceptor=lambda s: Echo(), reactor=clock)
    ct, st = FrameTransport(), FrameTransport()
    client.makeConnection(ct)
    server.makeConnection(st)
    proto = Recorder()
    stream = client.openStream(proto, b"hello")
    stream.write(b"x" * 300_000)
    client.ping()
    for _ in range(50):
        moved = False
        for src, dst in ((ct, server), (st, client)):
            data = src.value()
            src.clear()
            for i in range(0, len(data), 5):
                dst.dataReceived(data[i:i + 5])
            moved = moved or bool(data)
        if not moved:
            break
    assert proto.received == b"hello" + b"x" * 300_000
    assert client.isOpen and server.isOpen
