"""Receive-window auto-tuning: the growth and shrink rules, the budgets, over iosim with a
``task.Clock`` standing for the link's delay (no real time anywhere)."""

import pytest

from localai_tw.mux import SessionConfig
from localai_tw.mux.autowindow import WindowPool, WindowTuner
from localai_tw.mux.errors import FrameError
from localai_tw.mux.frame import HEADER, TYPE_DATA, VERSION, Frame, FrameDecoder, encode
from localai_tw.mux.testing import Recorder, connectedSessions

KIB = 1024
MIB = 1024 * KIB
BASE = 256 * KIB
RTT = 0.05


# -- the rule alone ------------------------------------------------------------------------------


def test_a_window_consumed_within_a_few_round_trips_doubles():
    tuner = WindowTuner(BASE)
    tuner.start(0.0, 0)
    assert tuner.decide(RTT, BASE, BASE, BASE, 16 * MIB, RTT) == 2 * BASE


def test_a_window_consumed_slowly_stays():
    tuner = WindowTuner(BASE)
    tuner.start(0.0, 0)
    assert tuner.decide(10 * RTT, BASE, BASE, BASE, 16 * MIB, RTT) == BASE


def test_no_decision_on_less_than_half_a_window_and_none_without_a_round_trip():
    tuner = WindowTuner(BASE)
    tuner.start(0.0, 0)
    assert tuner.decide(0.001, BASE // 2, BASE, BASE, 16 * MIB, RTT) == BASE
    assert tuner.epoch_consumed == 0  # the epoch goes on
    assert tuner.decide(0.001, BASE, BASE, BASE, 16 * MIB, None) == BASE


def test_growth_stops_at_the_ceiling():
    tuner = WindowTuner(BASE)
    tuner.start(0.0, 0)
    assert tuner.decide(0.001, 12 * MIB, 12 * MIB, BASE, 16 * MIB, RTT) == 16 * MIB
    assert tuner.decide(0.002, 28 * MIB, 16 * MIB, BASE, 16 * MIB, RTT) == 16 * MIB


def test_a_pause_in_the_epoch_halves_and_never_grows_below_the_base():
    tuner = WindowTuner(BASE)
    tuner.start(0.0, 0)
    tuner.paused = True
    # consumed fast, yet the consumer paused: the reader is the bottleneck
    assert tuner.decide(0.001, 4 * MIB, 4 * MIB, BASE, 16 * MIB, RTT) == 2 * MIB
    assert not tuner.paused
    tuner.paused = True
    assert tuner.decide(0.002, 5 * MIB, BASE, BASE, 16 * MIB, RTT) == BASE


def test_the_pool_grants_at_most_what_is_left():
    pool = WindowPool(MIB)
    assert pool.take(768 * KIB) == 768 * KIB
    assert pool.take(768 * KIB) == 256 * KIB
    assert pool.take(1) == 0
    pool.give(512 * KIB)
    assert pool.take(MIB) == 512 * KIB
    with pytest.raises(ValueError):
        WindowPool(-1)


def test_config_bounds():
    with pytest.raises(ValueError):
        SessionConfig(auto_window=BASE - 1)
    with pytest.raises(ValueError):
        SessionConfig(auto_window=2**32)
    with pytest.raises(ValueError):
        SessionConfig(rtt_max_age=0)
    assert SessionConfig(auto_window=16 * MIB).auto_window == 16 * MIB


# -- a session over a link with a delay -----------------------------------------------------------


class PausingRecorder(Recorder):
    def connectionMade(self):
        super().connectionMade()
        self.transport.pauseProducing()


def linked(server_protocol=Recorder, **server_config):
    """A client that sends, a server that receives with auto-tuning; ``step()`` is half a round
    trip: the clock moves on, then what each side wrote reaches the other."""
    accepted = []

    def acceptor(stream):
        protocol = server_protocol()
        accepted.append((stream, protocol))
        return protocol

    server_config.setdefault("auto_window", 4 * MIB)
    client, server, pump, clock = connectedSessions(
        server_acceptor=acceptor, client_config=SessionConfig(keepalive_interval=None),
        server_config=SessionConfig(keepalive_interval=None, **server_config))

    def step(n=1):
        for _ in range(n):
            clock.advance(RTT / 2)
            pump.pump()

    return client, server, accepted, step


def test_a_window_limited_stream_grows_to_its_ceiling_and_delivers_everything():
    client, server, accepted, step = linked()
    stream = client.openStream(Recorder())
    total = 24 * MIB
    stream.write(b"x" * total)
    step(60)
    (sstream, protocol), = accepted
    assert len(protocol.received) == total
    assert sstream._window == 4 * MIB
    assert server._flow.extra == 4 * MIB - BASE
    assert server._flow.rtt == pytest.approx(RTT)
    # the sender was never given more than the receiver's window at any time
    assert sstream._recv_window + sstream._in_size <= sstream._window


def test_the_window_moves_more_per_round_trip_than_a_fixed_one():
    fixed_client, _, fixed, fixed_step = linked(auto_window=0)
    auto_client, _, auto, auto_step = linked()
    for client in (fixed_client, auto_client):
        client.openStream(Recorder()).write(b"x" * (64 * MIB))
    fixed_step(40)
    auto_step(40)
    moved_fixed = len(fixed[0][1].received)
    moved_auto = len(auto[0][1].received)
    assert moved_fixed <= 20 * BASE + BASE  # one window per round trip
    assert moved_auto > 8 * moved_fixed


def test_a_paused_consumer_never_makes_the_window_grow():
    client, server, accepted, step = linked(server_protocol=PausingRecorder)
    client.openStream(Recorder()).write(b"x" * (8 * MIB))
    step(20)
    (sstream, protocol), = accepted
    assert protocol.received == b""
    assert sstream._window == BASE
    # resumed for one window's worth then paused again: still no growth
    for _ in range(5):
        sstream.resumeProducing()
        sstream.pauseProducing()
        step(4)
    assert sstream._window == BASE
    assert server._flow.extra == 0


def test_a_grown_window_halves_when_the_reader_pauses_and_the_budget_comes_back():
    client, server, accepted, step = linked()
    stream = client.openStream(Recorder())
    stream.write(b"x" * (16 * MIB))
    step(20)
    (sstream, protocol), = accepted
    assert sstream._window == 4 * MIB
    sstream.pauseProducing()
    stream.write(b"x" * (16 * MIB))
    step(4)
    sstream.resumeProducing()
    step(1)
    assert sstream._window == 2 * MIB
    assert server._flow.extra == 2 * MIB - BASE
    stream.abortConnection()
    step(2)
    assert server._flow.extra == 0


def test_the_session_budget_and_a_shared_pool_bound_the_growth():
    pool = WindowPool(3 * MIB)
    client, server, accepted, step = linked(session_window=2 * MIB, window_pool=pool)
    for _ in range(3):
        client.openStream(Recorder()).write(b"x" * (16 * MIB))
    step(40)
    assert server._flow.extra <= 2 * MIB
    assert sum(s._window - BASE for s, _ in accepted) == server._flow.extra
    assert pool.used == server._flow.extra
    other_client, other_server, _, other_step = linked(window_pool=pool)
    other_client.openStream(Recorder()).write(b"x" * (16 * MIB))
    other_step(40)
    assert pool.used <= 3 * MIB
    assert other_server._flow.extra == pool.used - server._flow.extra
    server.abort()
    assert pool.used == other_server._flow.extra


def test_the_decoder_takes_frames_up_to_the_grown_window_and_refuses_beyond():
    client, server, accepted, step = linked()
    assert server._decoder.max_payload == 4 * MIB
    decoder = FrameDecoder(4 * MIB)
    assert decoder.feed(encode(Frame.data(1, b"x" * 10)))
    with pytest.raises(FrameError):
        decoder.feed(HEADER.pack(VERSION, TYPE_DATA, 0, 1, 4 * MIB + 1))


def test_a_stale_round_trip_is_measured_again_with_one_probe():
    client, server, accepted, step = linked(rtt_max_age=1.0)
    stream = client.openStream(Recorder())
    stream.write(b"x" * (4 * MIB))
    step(10)
    first = server._flow.rtt_at
    step(60)  # 1.5 s later, no traffic
    stream.write(b"x" * (4 * MIB))
    step(10)
    assert server._flow.rtt_at > first
    assert server._flow.probe is None


def test_the_round_trip_is_the_recent_minimum_not_an_average():
    """A ping answered behind our own bulk bytes (a long sample) must not raise the estimate:
    a window grown on it would lengthen the very queue it measured."""
    client, server, accepted, step = linked(rtt_max_age=1.0)
    server._rttSample(0.05)
    server._rttSample(0.8)
    assert server._flow.rtt == 0.05
    server._rttSample(0.04)
    assert server._flow.rtt == 0.04
    step(60)  # 1.5 s: the minimum is stale, the next sample replaces it
    server._rttSample(0.2)
    assert server._flow.rtt == 0.2
