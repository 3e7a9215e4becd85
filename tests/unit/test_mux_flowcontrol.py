"""Flow control and backpressure: per-stream windows, producers, and the carrier's pause."""

from twisted.internet import task
from twisted.internet.abstract import FileDescriptor
from twisted.internet.testing import StringTransport

from localai_tw.mux import Session, SessionConfig, SessionFailed
from localai_tw.mux.frame import (
    FLAG_ACK,
    FLAG_SYN,
    HEADER_SIZE,
    TYPE_DATA,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    Frame,
    FrameDecoder,
    encode,
)
from localai_tw.mux.testing import (
    FrameTransport,
    HalfCloseRecorder,
    Recorder,
    StreamingProducer,
    connectedSessions,
)

KIB = 1024
WINDOW = 256 * KIB


def raw(client=True, acceptor=None, transport=None, **config):
    clock = task.Clock()
    session = Session(client, SessionConfig(**config), acceptor, reactor=clock)
    transport = transport if transport is not None else FrameTransport()
    session.makeConnection(transport)
    return session, transport


def payload_bytes(frames, stream_id=None):
    return sum(f.length for f in frames
               if f.type == TYPE_DATA and (stream_id is None or f.stream_id == stream_id))


class PausingRecorder(Recorder):
    """Pauses its stream as soon as it is connected: a consumer that reads nothing."""

    def connectionMade(self):
        super().connectionMade()
        self.transport.pauseProducing()


# -- sending: the peer's window ----------------------------------------------------------------


def test_writes_are_cut_at_the_window_and_at_64k_frames():
    session, transport = raw()
    stream = session.openStream(Recorder())
    transport.frames()
    stream.write(b"a" * (WINDOW + 100))
    frames = transport.frames()
    frame = 64 * KIB - HEADER_SIZE
    # The window's last 48 bytes ride on the fourth frame rather than going as a runt.
    assert [f.length for f in frames] == [frame] * 3 + [WINDOW - 3 * frame]
    assert stream._out_size == 100


def test_a_64k_write_is_one_frame_not_a_full_frame_and_a_runt():
    """A file body's 64 KiB chunk (or an HTTP chunk with its framing) is 12+ bytes more than
    the default frame: it goes as one frame, not a full one and a 12-byte one that would cost
    both ends and the reader's ``dataReceived`` as much again."""
    session, transport = raw()
    received = Recorder()
    stream = session.openStream(received)
    transport.frames()
    for size in (64 * KIB, 64 * KIB + 9):
        stream.write(b"b" * size)
        assert [f.length for f in transport.frames()] == [size]


def test_the_runt_slack_is_bounded():
    """Only up to 1/8 of a frame more: anything longer is cut at ``max_frame_size``."""
    session, transport = raw()
    stream = session.openStream(Recorder())
    transport.frames()
    frame = SessionConfig().max_frame_size
    stream.write(b"c" * (frame + frame // 8 + 1))
    assert [f.length for f in transport.frames()] == [frame, frame // 8 + 1]
    stream.write(b"d" * (frame + frame // 8))
    assert [f.length for f in transport.frames()] == [frame + frame // 8]


def test_a_default_data_frame_fits_twisteds_write_buffer_threshold():
    """Header + the largest default payload is exactly Twisted's ``bufferSize``: a full frame
    does not pause the session by itself, so over TCP two frames go out per reactor turn."""
    assert HEADER_SIZE + SessionConfig().max_frame_size == FileDescriptor.bufferSize
    session, transport = raw()
    stream = session.openStream(Recorder())
    transport.frames()
    stream.write(b"a" * (2 * KIB * 64))
    sizes = [len(encode(f)) for f in transport.frames()]
    assert sizes[0] == FileDescriptor.bufferSize


def test_window_exhaustion_pauses_the_producer_and_an_update_resumes_it():
    session, transport = raw()
    stream = session.openStream(Recorder())
    producer = StreamingProducer()
    stream.registerProducer(producer, True)
    stream.write(b"a" * WINDOW)
    assert not producer.paused                  # exactly filling the window blocks nothing yet
    stream.write(b"b")
    stream.write(b"c")                          # a producer that ignores pause is paused once
    assert producer.paused and producer.calls == ["pause"]
    transport.frames()
    session.dataReceived(encode(Frame.window_update(stream.id, 10)))
    assert transport.frames() == [Frame.data(stream.id, b"bc")]
    assert producer.calls == ["pause", "resume"]


def test_one_full_window_does_not_pause_other_streams():
    session, transport = raw()
    first, second = session.openStream(Recorder()), session.openStream(Recorder())
    p1, p2 = StreamingProducer(), StreamingProducer()
    first.registerProducer(p1, True)
    second.registerProducer(p2, True)
    transport.frames()
    first.write(b"x" * (WINDOW + 1))
    second.write(b"y" * 10)
    assert p1.paused and not p2.paused
    assert payload_bytes(transport.frames(), second.id) == 10


def test_pull_producer_is_asked_for_more_only_while_there_is_room():
    class Pull:
        def __init__(self, stream, total):
            self.stream, self.left, self.calls = stream, total, 0

        def resumeProducing(self):
            self.calls += 1
            if self.left:
                chunk = min(self.left, 16 * KIB)
                self.left -= chunk
                self.stream.write(b"p" * chunk)

        def stopProducing(self):
            pass
    session, transport = raw()
    stream = session.openStream(Recorder())
    transport.frames()
    producer = Pull(stream, 1024 * KIB)
    stream.registerProducer(producer, False)
    assert payload_bytes(transport.frames()) == WINDOW
    assert producer.calls == 16                     # exactly the chunks that fit
    session.dataReceived(encode(Frame.window_update(stream.id, 64 * KIB)))
    assert payload_bytes(transport.frames()) == 64 * KIB
    assert producer.calls == 20


def test_window_updates_are_increments_and_may_exceed_what_was_consumed():
    session, transport = raw()
    stream = session.openStream(Recorder())
    session.dataReceived(encode(Frame.window_update(stream.id, 1000)) +
                         encode(Frame.window_update(stream.id, 1000)))
    transport.frames()
    stream.write(b"z" * (WINDOW + 3000))
    assert payload_bytes(transport.frames()) == WINDOW + 2000


# -- receiving: our window ---------------------------------------------------------------------


def test_update_is_sent_once_half_the_window_has_been_delivered():
    session, transport = raw(client=False, acceptor=lambda s: Recorder())
    session.dataReceived(encode(Frame.data(1, b"a" * (128 * KIB - 1), FLAG_SYN)))
    assert transport.frames() == [Frame.window_update(1, 0, FLAG_ACK)]
    session.dataReceived(encode(Frame.data(1, b"a")))
    assert transport.frames() == [Frame.window_update(1, 128 * KIB)]


def test_update_threshold_follows_the_configured_max_window():
    session, transport = raw(client=False, acceptor=lambda s: Recorder(), max_window=1024 * KIB)
    session.dataReceived(encode(Frame.window_update(1, 0, FLAG_SYN)))
    assert transport.frames() == [Frame.window_update(1, 768 * KIB, FLAG_ACK)]
    session.dataReceived(encode(Frame.data(1, b"a" * (512 * KIB - 1))))
    assert transport.frames() == []
    session.dataReceived(encode(Frame.data(1, b"a")))
    assert transport.frames() == [Frame.window_update(1, 512 * KIB)]


def test_data_exactly_filling_the_window_is_fine_one_byte_more_is_a_protocol_error():
    protos = []
    session, transport = raw(client=False, acceptor=lambda s: protos.append(PausingRecorder()) or protos[-1])
    session.dataReceived(encode(Frame.data(1, b"a" * WINDOW, FLAG_SYN)))
    assert session.isOpen
    session.dataReceived(encode(Frame.data(1, b"a")))
    assert not session.isOpen
    assert "window" in session.ending.cause
    assert transport.frames()[-1] == Frame.go_away(1)
    assert protos[0].reason.check(SessionFailed)


def test_nothing_is_handed_over_while_paused_not_even_syn_data():
    protos = []
    session, transport = raw(client=False, acceptor=lambda s: protos.append(PausingRecorder()) or protos[-1])
    session.dataReceived(encode(Frame.data(1, b"first", FLAG_SYN)) + encode(Frame.data(1, b"second")))
    assert protos[0].chunks == []
    protos[0].transport.resumeProducing()
    assert protos[0].received == b"firstsecond"


def test_pausing_inside_data_received_stops_delivery_at_once():
    class PauseAfterOne(Recorder):
        def dataReceived(self, data):
            super().dataReceived(data)
            self.transport.pauseProducing()
    client, server, pump, clock = connectedSessions(server_acceptor=lambda s: Recorder())
    proto = PauseAfterOne()
    stream = client.openStream(proto)
    pump.flush()
    stream.pauseProducing()
    server._streams[stream.id].write(b"1")
    pump.flush()
    server._streams[stream.id].write(b"2")
    pump.flush()
    stream.resumeProducing()
    assert proto.chunks == [b"1"]
    stream.resumeProducing()
    assert proto.chunks == [b"1", b"2"]


def test_paused_reader_parks_the_remote_writer_after_exactly_one_window():
    protos = []
    client, server, pump, clock = connectedSessions(
        server_acceptor=lambda s: protos.append(PausingRecorder()) or protos[-1])
    stream = client.openStream(Recorder())
    producer = StreamingProducer()
    stream.registerProducer(producer, True)
    stream.write(b"m" * (1024 * KIB))
    pump.flush()
    remote = protos[0].transport
    assert remote._in_size == WINDOW                # buffered at the receiver: exactly 256 KiB
    assert protos[0].chunks == []
    assert stream._out_size == 768 * KIB            # the rest waits at the writer ...
    assert producer.paused                          # ... whose producer is paused
    assert server._decoder.buffered == 0
    # The reader resumes: the bytes flow and the writer's producer is resumed at the end.
    remote.resumeProducing()
    pump.flush()
    assert len(protos[0].received) == 1024 * KIB
    assert not producer.paused
    assert stream._out_size == 0


def test_larger_max_window_lets_the_peer_send_that_much_before_an_update():
    config = SessionConfig(max_window=1024 * KIB)
    protos = []
    client, server, pump, clock = connectedSessions(
        server_acceptor=lambda s: protos.append(PausingRecorder()) or protos[-1],
        client_config=config, server_config=config)
    stream = client.openStream(Recorder())
    stream.write(b"w" * (2048 * KIB))
    pump.flush()
    assert protos[0].transport._in_size == 1024 * KIB
    protos[0].transport.resumeProducing()
    pump.flush()
    assert len(protos[0].received) == 2048 * KIB


def test_end_to_end_transfer_through_window_updates():
    protos = []
    client, server, pump, clock = connectedSessions(
        server_acceptor=lambda s: protos.append(HalfCloseRecorder()) or protos[-1])
    stream = client.openStream(HalfCloseRecorder())
    data = bytes(range(256)) * (12 * KIB)   # 3 MiB
    stream.write(data)
    stream.loseWriteConnection()
    pump.flush()
    assert protos[0].received == data and protos[0].read_lost


# -- the carrier's backpressure ----------------------------------------------------------------


class CarrierTransport(StringTransport):
    """Pauses its producer (the session) once ``limit`` bytes are waiting, like a TCP transport
    whose buffer is full; ``drain`` empties it and resumes the session."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.carrier_paused = False

    def write(self, data):
        super().write(data)
        if len(self.value()) >= self.limit and not self.carrier_paused and self.producer:
            self.carrier_paused = True
            self.producer.pauseProducing()

    def drain(self):
        data = self.value()
        self.clear()
        self.carrier_paused = False
        self.producer.resumeProducing()
        return data


class ChunkPerResume(StreamingProducer):
    """Writes one chunk to its stream each time it is resumed."""

    def __init__(self, name, stream, log, size=10 * KIB):
        super().__init__()
        self.name, self.stream, self.log, self.size = name, stream, log, size

    def resumeProducing(self):
        super().resumeProducing()
        self.log.append(self.name)
        self.stream.write(self.name.encode() * self.size)


def test_carrier_pause_pauses_every_stream_and_resume_rotates_fairly():
    session, transport = raw(transport=CarrierTransport(limit=8 * KIB))
    order = []
    streams = [session.openStream(Recorder()) for _ in range(3)]
    producers = [ChunkPerResume(n, s, order) for n, s in zip("abc", streams)]
    for s, p in zip(streams, producers):
        s.registerProducer(p, True)
    session.pauseProducing()
    assert all(p.paused for p in producers)
    for _ in range(6):
        transport.drain()
    # Each resume serves the next stream first; the one that refilled the carrier goes last.
    assert order == ["a", "b", "c", "a", "b", "c"]


def test_duplicate_pause_and_resume_are_ignored():
    session, transport = raw()
    stream = session.openStream(Recorder())
    producer = StreamingProducer()
    stream.registerProducer(producer, True)
    session.pauseProducing()
    session.pauseProducing()
    session.resumeProducing()
    session.resumeProducing()
    assert producer.calls == ["pause", "resume"]


def test_producer_ignoring_pause_does_not_reach_the_carrier_while_paused():
    session, transport = raw()
    stream = session.openStream(Recorder())
    transport.frames()
    session.pauseProducing()
    stream.write(b"ignored the pause" * 100_000)
    assert transport.frames() == []
    session.resumeProducing()
    assert payload_bytes(transport.frames()) == WINDOW


def test_control_frames_still_flow_while_paused():
    session, transport = raw(client=False, acceptor=lambda s: Recorder())
    session.pauseProducing()
    session.dataReceived(encode(Frame.data(1, b"a" * (128 * KIB), FLAG_SYN)) +
                         encode(Frame.ping(9)))
    frames = transport.frames()
    assert Frame.window_update(1, 0, FLAG_ACK) in frames
    assert Frame.window_update(1, 128 * KIB) in frames
    assert Frame.ping(9, ack=True) in frames


def test_session_buffering_is_bounded_by_the_sum_of_windows():
    session, transport = raw()
    for _ in range(3):
        stream = session.openStream(Recorder())
        stream.write(b"q" * (1024 * KIB))
    frames = transport.frames()
    assert payload_bytes(frames) == 3 * WINDOW
    wire = sum(HEADER_SIZE + (f.length if f.type == TYPE_DATA else 0) for f in frames)
    assert wire <= 3 * WINDOW + HEADER_SIZE * len(frames)
    assert all(f.type in (TYPE_DATA, TYPE_WINDOW_UPDATE) for f in frames)


def test_window_granted_on_the_peers_syn_counts():
    streams = []
    session, transport = raw(client=False, acceptor=lambda s: streams.append(s) or Recorder())
    session.dataReceived(encode(Frame.window_update(1, 768 * KIB, FLAG_SYN)))
    transport.frames()
    streams[0].write(b"s" * (2048 * KIB))
    assert payload_bytes(transport.frames()) == 1024 * KIB


def test_sides_with_different_max_windows_interoperate():
    big = SessionConfig(max_window=4096 * KIB)
    protos = []
    client, server, pump, clock = connectedSessions(
        server_acceptor=lambda s: protos.append(PausingRecorder()) or protos[-1],
        client_config=big)
    stream = client.openStream(PausingRecorder())
    pump.flush()
    remote = protos[0].transport
    remote.write(b"d" * (8192 * KIB))
    stream.write(b"u" * (1024 * KIB))
    pump.flush()
    assert stream._in_size == 4096 * KIB      # the client advertised 4 MiB on its SYN
    assert remote._in_size == WINDOW          # the server kept the default
    stream.resumeProducing()
    remote.resumeProducing()
    pump.flush()
    assert len(stream.protocol.received) == 8192 * KIB
    assert len(protos[0].received) == 1024 * KIB


def test_a_control_write_leaves_within_one_frame_of_each_bulk_stream_on_resume():
    # Two bulk streams filled their windows while the carrier had paused the session, then a
    # control stream wrote one byte.  On resume the byte must not wait behind both windows
    # (8 frames of 64 KiB): streams are served one frame each per round.
    session, transport = raw()
    bulk = [session.openStream(Recorder()) for _ in range(2)]
    control = session.openStream(Recorder())
    transport.frames()
    session.pauseProducing()
    for stream in bulk:
        stream.write(b"b" * WINDOW)
    control.write(b"x")
    assert transport.frames() == []
    session.resumeProducing()
    frames = [f for f in transport.frames() if f.type == TYPE_DATA]
    position = next(i for i, f in enumerate(frames) if f.stream_id == control.id)
    assert position <= len(bulk)
    # Every byte still went, in order per stream, within each stream's window.
    for stream in bulk:
        assert payload_bytes(frames, stream.id) == WINDOW
    assert payload_bytes(frames, control.id) == 1


def test_round_robin_on_resume_stops_when_the_carrier_pauses_again():
    session, transport = raw(transport=CarrierTransport(limit=100 * KIB))
    bulk = [session.openStream(Recorder()) for _ in range(3)]
    transport.clear()
    session.pauseProducing()
    for stream in bulk:
        stream.write(b"b" * WINDOW)
    transport.drain()
    frames = FrameDecoder(WINDOW).feed(transport.value())
    # 64 KiB frames: the second one pushed the carrier past its limit; nothing after it.
    assert [f.stream_id for f in frames] == [bulk[0].id, bulk[1].id]


# -- the session-wide bulk budget, acknowledged by pings ----------------------------------------

BUDGET = 4 * 64 * KIB


def data_and_pings(transport):
    frames = transport.frames()
    pings = [f for f in frames if f.type == TYPE_PING and f.has(FLAG_SYN)]
    return payload_bytes(frames), frames, pings


def test_bulk_streams_together_stay_within_the_budget_until_pings_acknowledge_it():
    session, transport = raw(bulk_in_flight=BUDGET, bulk_after=0)
    streams = [session.openStream(Recorder()) for _ in range(3)]
    transport.frames()
    for stream in streams:
        stream.write(b"b" * WINDOW)  # three windows' worth: far beyond the budget
    sent, _, pings = data_and_pings(transport)
    assert BUDGET - 64 * KIB < sent <= BUDGET + 64 * KIB
    assert pings  # the acknowledgement was asked for while writing
    # Nothing more while no acknowledgement came.
    session.dataReceived(b"")
    assert data_and_pings(transport)[0] == 0
    session.dataReceived(b"".join(encode(Frame.ping(p.length, ack=True)) for p in pings))
    more, _, _ = data_and_pings(transport)
    assert more > 0
    assert sent + more <= 3 * WINDOW


def test_a_control_stream_is_not_held_by_the_spent_bulk_budget():
    session, transport = raw(bulk_in_flight=BUDGET)  # bulk after 256 KiB sent, the default
    bulk = session.openStream(Recorder())
    session.dataReceived(encode(Frame.window_update(bulk.id, 4 * WINDOW, FLAG_ACK)))
    bulk.write(b"b" * (5 * WINDOW))
    transport.frames()
    assert session._budgetSpent()
    control = session.openStream(Recorder())
    control.write(b"x")
    frames = transport.frames()
    assert payload_bytes(frames, control.id) == 1
    assert payload_bytes(frames, bulk.id) == 0


def test_a_budget_below_four_frames_is_refused():
    import pytest

    with pytest.raises(ValueError):
        SessionConfig(bulk_in_flight=64 * KIB)


def test_bulk_streams_under_a_budget_finish_against_a_peer_with_larger_windows():
    # Grants come only after half of the peer's window (2 MiB here) was read, far above the
    # budget: the pings, not the windows, must keep the transfer moving.
    protos = []
    client, server, pump, clock = connectedSessions(
        server_acceptor=lambda s: protos.append(HalfCloseRecorder()) or protos[-1],
        client_config=SessionConfig(bulk_in_flight=BUDGET, bulk_after=0),
        server_config=SessionConfig(max_window=4 * 1024 * KIB))
    data = bytes(range(256)) * (12 * KIB)   # 3 MiB per stream
    streams = [client.openStream(HalfCloseRecorder()) for _ in range(3)]
    for stream in streams:
        stream.write(data)
        stream.loseWriteConnection()
    pump.flush()
    assert [p.received == data and p.read_lost for p in protos] == [True] * 3
