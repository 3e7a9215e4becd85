"""Worker tunnels ping only when quiet (``keepalive_when_quiet``, ``tunnel/keepalive.py``): an
idle tunnel carries about one ping and its answer per interval instead of two of each, and a
silent carrier is still declared dead interval + timeout after the last byte, on a Clock."""

from dataclasses import replace

from localai_tw.mux import KeepaliveTimeout
from localai_tw.mux.testing import (
    Recorder,
    connectedSessions,
    countPings,
    runClock,
    runUntilBothJustRead,
)
from localai_tw.tunnel.connect import tunnel_session_config
from localai_tw.tunnel.dialer import worker_session_config
from localai_tw.tunnel.keepalive import (
    DEAD_TUNNEL_DETECTION,
    TUNNEL_KEEPALIVE_INTERVAL,
    TUNNEL_KEEPALIVE_TIMEOUT,
)




def _tunnel(**changes):
    """Both ends with the frontend's keepalive for a worker that does not say it pings (3 s +
    7 s, when quiet), the worker's 0.2 s sooner: the rule under test, on both ends, as an older
    worker had it."""
    worker = replace(tunnel_session_config(), keepalive_interval=TUNNEL_KEEPALIVE_INTERVAL - 0.2)
    return connectedSessions(client_config=replace(worker, **changes),
                             server_config=replace(tunnel_session_config(), **changes))


def test_the_frontend_pings_only_when_quiet():
    """The frontend's end of a worker that does not say it pings; the worker's own end pings
    every interval whatever it reads (test_keepalive_worker_pings.py)."""
    assert tunnel_session_config().keepalive_when_quiet


def test_an_idle_tunnel_carries_one_ping_per_interval_instead_of_two():
    counts = {}
    for quiet in (False, True):
        worker, frontend, pump, clock = _tunnel(keepalive_when_quiet=quiet)
        sent = countPings(worker), countPings(frontend)
        runClock(clock, pump, 60.0)
        assert worker.isOpen and frontend.isOpen
        counts[quiet] = sent[0][0] + sent[1][0]
    intervals = 60.0 / TUNNEL_KEEPALIVE_INTERVAL
    assert counts[False] >= 2 * intervals - 2  # both ends, every interval
    assert counts[True] <= intervals + 2       # one end or the other, once per interval


def test_a_silent_carrier_is_declared_dead_within_the_bound_after_its_last_byte():
    worker, frontend, pump, clock = _tunnel()
    runClock(clock, pump, 20.0)
    # Stop right after a flush in which both ends read (a ping and its answer).
    silent_since = runUntilBothJustRead(clock, pump, frontend, worker)
    # No byte moves either way from now on (the pump is never flushed again).
    clock.pump([0.05] * round(TUNNEL_KEEPALIVE_TIMEOUT / 0.05))
    assert frontend.isOpen and worker.isOpen  # a ping always gets its whole timeout
    clock.pump([0.05] * round((DEAD_TUNNEL_DETECTION - TUNNEL_KEEPALIVE_TIMEOUT) / 0.05 + 2))
    assert clock.seconds() - silent_since <= DEAD_TUNNEL_DETECTION + 0.1 + 1e-3
    assert isinstance(frontend.ending, KeepaliveTimeout), frontend.ending
    assert isinstance(worker.ending, KeepaliveTimeout), worker.ending


def test_a_peer_that_never_pings_still_gets_a_ping_every_interval():
    """A peer with no keepalive of its own (or Go's 30 s) sends nothing on an idle tunnel: our
    end pings every interval, and a live peer keeps the session open."""
    worker, frontend, pump, clock = connectedSessions(
        client_config=replace(worker_session_config(), keepalive_interval=None),
        server_config=tunnel_session_config())
    sent = countPings(frontend)
    runClock(clock, pump, 30.0)
    assert frontend.isOpen and worker.isOpen
    assert sent[0] >= 30.0 / TUNNEL_KEEPALIVE_INTERVAL - 1


def test_stream_data_from_the_peer_stands_for_a_ping():
    received = Recorder()
    worker, frontend, pump, clock = connectedSessions(
        client_acceptor=lambda stream: received,
        client_config=replace(worker_session_config(), keepalive_interval=None),
        server_config=replace(tunnel_session_config(), forbid_inbound_streams=False,
                              accept_streams=True))
    sent = countPings(worker), countPings(frontend)
    stream = frontend.openStream()
    for _ in range(200):  # the frontend sends a chunk every 0.1 s for 20 s
        stream.write(b"x" * 100)
        clock.advance(0.1)
        pump.flush()
    assert received.chunks
    # The worker never pings here; the frontend pings only while nothing comes back.  The
    # worker's window updates are what it hears, so it does not need a ping for 20 s either.
    assert sent[1][0] <= 20.0 / TUNNEL_KEEPALIVE_INTERVAL + 1
