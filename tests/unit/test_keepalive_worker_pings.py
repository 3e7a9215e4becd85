"""A worker that says it pings (``X-LocalAI-Keepalive: worker-pings``, ``tunnel/keepalive.py``)
gets no keepalive ping from the frontend, which ends the tunnel after 10 s without a byte from
it; the worker pings every 5 s whatever it reads and ends the tunnel after 10 s without a byte
from the frontend (any byte, not only a ping's answer).  Both bounds hold, on a Clock; a worker
that does not say so keeps the frontend's older keepalive."""

from types import SimpleNamespace

from localai_tw.mux import KeepaliveTimeout
from localai_tw.mux.testing import (
    Recorder,
    connectedSessions,
    countPings,
    runClock,
    runUntilBothJustRead,
)
from localai_tw.tunnel.connect import WorkerTunnelAcceptor, tunnel_session_config
from localai_tw.tunnel.dialer import worker_session_config
from localai_tw.tunnel.keepalive import (
    DEAD_TUNNEL_DETECTION,
    WORKER_PING_INTERVAL,
    WORKER_PINGS,
    WORKER_PINGS_HEADER,
)
from dataclasses import replace




def _tunnel(**frontend_changes):
    return connectedSessions(
        client_config=worker_session_config(),
        server_config=replace(tunnel_session_config(peer_pings=True), **frontend_changes))


def _tunnel_the_frontend_streams_on(received: Recorder):
    """A tunnel on which the frontend may open streams to the worker (``received`` gets them)."""
    return connectedSessions(
        client_acceptor=lambda stream: received,
        client_config=worker_session_config(),
        server_config=replace(tunnel_session_config(peer_pings=True),
                              forbid_inbound_streams=False, accept_streams=True))


def test_the_frontend_sends_no_ping_to_a_worker_that_pings():
    worker, frontend, pump, clock = _tunnel()
    sent = countPings(worker), countPings(frontend)
    runClock(clock, pump, 60.0)
    assert worker.isOpen and frontend.isOpen
    assert sent[1][0] == 0
    assert 60.0 / WORKER_PING_INTERVAL - 1 <= sent[0][0] <= 60.0 / WORKER_PING_INTERVAL + 1


def test_no_ping_even_when_the_workers_pings_come_late():
    """A loaded worker's timer runs late (here: every 5.1 s): a frontend that pinged when
    quiet would ping first; this one never does."""
    worker, frontend, pump, clock = connectedSessions(
        client_config=replace(worker_session_config(),
                              keepalive_interval=WORKER_PING_INTERVAL + 0.1),
        server_config=tunnel_session_config(peer_pings=True))
    sent = countPings(frontend)
    runClock(clock, pump, 60.0)
    assert worker.isOpen and frontend.isOpen
    assert sent[0] == 0


def test_a_worker_that_only_hears_a_trickle_still_pings_and_the_tunnel_stays():
    """The frontend sends a few bytes every 0.5 s and the worker answers nothing (no window
    update is due): the worker must ping anyway, or the frontend would take it for dead."""
    received = Recorder()
    worker, frontend, pump, clock = _tunnel_the_frontend_streams_on(received)
    stream = frontend.openStream()
    for _ in range(60):  # 30 s
        stream.write(b"x")
        clock.advance(0.5)
        pump.flush()
    assert received.chunks
    assert worker.isOpen and frontend.isOpen


def test_a_silent_carrier_is_declared_dead_within_the_bound_on_both_ends():
    worker, frontend, pump, clock = _tunnel()
    runClock(clock, pump, 20.0)
    silent_since = runUntilBothJustRead(clock, pump, frontend, worker)
    ended = {}
    # No byte moves either way from now on (the pump is never flushed again).
    while (frontend.isOpen or worker.isOpen) and clock.seconds() - silent_since < 15:
        clock.advance(0.01)
        for name, end in (("frontend", frontend), ("worker", worker)):
            if not end.isOpen:
                ended.setdefault(name, clock.seconds() - silent_since)
    assert isinstance(frontend.ending, KeepaliveTimeout), frontend.ending
    assert isinstance(worker.ending, KeepaliveTimeout), worker.ending
    # The frontend: 10 s of silence to half a tick, never sooner.
    assert DEAD_TUNNEL_DETECTION - 0.05 - 1e-6 <= ended["frontend"] <= DEAD_TUNNEL_DETECTION + 0.1
    assert ended["worker"] <= DEAD_TUNNEL_DETECTION + 0.1


def test_the_worker_sees_a_dead_frontend_within_the_bound():
    worker, frontend, pump, clock = _tunnel()
    runClock(clock, pump, 20.0)
    while worker._heard_at != clock.seconds():
        clock.advance(0.01)
        pump.flush()
    silent_since = clock.seconds()
    frontend._end = lambda ending: None  # a frozen frontend: it never ends, never answers
    for _ in range(round(DEAD_TUNNEL_DETECTION / 0.05) + 4):
        clock.advance(0.05)  # the pump is never flushed: nothing reaches either end
        if not worker.isOpen:
            break
    assert isinstance(worker.ending, KeepaliveTimeout), worker.ending
    assert clock.seconds() - silent_since <= DEAD_TUNNEL_DETECTION + 0.1


def test_an_old_worker_still_gets_pings_and_a_silent_one_is_dropped():
    """No header: the frontend pings when quiet (the worker's keepalive off here, as a worker
    whose pings never come), keeps a live tunnel and drops a silent one within the bound."""
    worker, frontend, pump, clock = connectedSessions(
        client_config=replace(worker_session_config(), keepalive_interval=None),
        server_config=tunnel_session_config())
    sent = countPings(frontend)
    runClock(clock, pump, 30.0)
    assert frontend.isOpen and sent[0] >= 9
    silent_since = clock.seconds()
    clock.pump([0.05] * round((DEAD_TUNNEL_DETECTION + 0.2) / 0.05))
    assert isinstance(frontend.ending, KeepaliveTimeout), frontend.ending
    assert clock.seconds() - silent_since <= DEAD_TUNNEL_DETECTION + 0.2


def _request(headers: dict):
    lowered = {k.lower(): v for k, v in headers.items()}
    return SimpleNamespace(getHeader=lambda name: lowered.get(name.lower()),
                           getClientAddress=lambda: None)


def test_the_upgrade_header_decides_the_frontends_keepalive():
    acceptor = WorkerTunnelAcceptor(registry=SimpleNamespace(), reactor=object())
    node = SimpleNamespace(id="n1", name="w1")
    says = acceptor.build_session(_request({WORKER_PINGS_HEADER: WORKER_PINGS}), node)
    old = acceptor.build_session(_request({}), node)
    other = acceptor.build_session(_request({WORKER_PINGS_HEADER: "something-else"}), node)
    assert says.config.keepalive_peer_pings
    assert not old.config.keepalive_peer_pings and old.config.keepalive_when_quiet
    assert not other.config.keepalive_peer_pings


def test_the_worker_pings_whatever_it_reads_and_ends_on_silence():
    config = worker_session_config()
    assert not config.keepalive_when_quiet and not config.keepalive_peer_pings
    assert config.keepalive_on_silence
    assert config.keepalive_interval + config.keepalive_timeout == DEAD_TUNNEL_DETECTION


def test_a_worker_whose_pings_go_unanswered_lives_on_the_frontends_data_and_still_pings():
    """The frontend answers no ping (its answers queued behind stream data on a slow link, as
    far as the worker can tell) but sends a byte every second: any byte proves it alive, so
    the worker keeps the tunnel, and keeps pinging every interval, answered or not (the
    frontend must hear from it).  Once the bytes stop, the worker ends the tunnel 10 s after
    the last one."""
    received = Recorder()
    worker, frontend, pump, clock = _tunnel_the_frontend_streams_on(received)
    frontend._mayAnswer = lambda: False  # no answer to any ping
    pings = countPings(worker)
    stream = frontend.openStream()
    for _ in range(30):
        stream.write(b"x")
        clock.advance(1.0)
        pump.flush()
    assert worker.isOpen and frontend.isOpen
    assert len(received.chunks) >= 29
    assert 30 / WORKER_PING_INTERVAL - 1 <= pings[0] <= 30 / WORKER_PING_INTERVAL + 1
    last_byte = worker._heard_at
    while worker.isOpen and clock.seconds() - last_byte < 15:
        clock.advance(0.05)
        pump.flush()
    assert isinstance(worker.ending, KeepaliveTimeout), worker.ending
    assert DEAD_TUNNEL_DETECTION - 0.05 - 1e-6 <= clock.seconds() - last_byte \
        <= DEAD_TUNNEL_DETECTION + 0.1
