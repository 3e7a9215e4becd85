"""A worker tunnel whose carrier goes silent (no FIN, no RST, no byte) is declared dead within
10 s on both ends, on a Clock: the frontend stops routing to it and the worker redials."""

from localai_tw.mux import KeepaliveTimeout
from localai_tw.mux.testing import connectedSessions
from localai_tw.tunnel.connect import tunnel_session_config
from localai_tw.tunnel.dialer import worker_session_config
from localai_tw.tunnel.keepalive import DEAD_TUNNEL_DETECTION


def test_the_documented_bound_is_10_seconds():
    assert DEAD_TUNNEL_DETECTION == 10.0


def test_a_silent_carrier_is_declared_dead_within_10_seconds_on_both_ends():
    worker, frontend, pump, clock = connectedSessions(
        client_config=worker_session_config(), server_config=tunnel_session_config())
    # A live carrier: pings are answered, nothing ends however long it runs.
    for _ in range(40):
        clock.advance(0.5)
        pump.flush()
    assert worker.isOpen and frontend.isOpen
    # Worst case: the carrier goes silent right after both ends read (a ping and its answer):
    # each end's next ping leaves an interval after that (the worker's a little sooner,
    # keepalive.py), and is declared unanswered its timeout later.
    while not (frontend._heard_at == worker._heard_at == clock.seconds()):
        clock.advance(0.01)
        pump.flush()
    silent_since = clock.seconds()
    # From now on no byte moves either way (the pump is never flushed again).
    # (small steps: Clock.advance runs every due call at the new time, so one big step would
    # start the timers late)
    clock.pump([0.05] * round((DEAD_TUNNEL_DETECTION - 0.1) / 0.05))
    assert frontend.isOpen  # the frontend's end: this was the worst case, it takes the 10 s
    clock.advance(0.1 + 1e-3)  # (the epsilon only absorbs float rounding of the clock)
    assert clock.seconds() - silent_since <= DEAD_TUNNEL_DETECTION + 0.01
    assert isinstance(frontend.ending, KeepaliveTimeout), frontend.ending
    assert isinstance(worker.ending, KeepaliveTimeout), worker.ending
