"""Liveness from the tunnel: the replica holding a worker's tunnel keeps its heartbeat fresh.

A worker used to prove it was alive with an HTTP heartbeat every 10 s: 400 requests a second
for a replica holding 4000 idle workers, half of its idle CPU (docs/benchmarks.md, "An idle
fleet").  The replica already knows which of its tunnels are alive: a tunnel whose peer stops
answering the keepalive is ended within ``DEAD_TUNNEL_DETECTION`` (10 s,
``tunnel/keepalive.py``), so a session still open was heard from at most that long ago.
Every ``interval`` (10 s) :class:`TunnelLiveness` writes, for every open tunnel it holds,
``last_heartbeat = now() - lag`` (``lag``: that bound plus a second), in one statement per
:data:`STAMP_BATCH` tunnels:

- **fenced**: a row is written only when ``node_connections`` still names this replica as the
  holder at the epoch of its claim, and this replica is live in ``instances``; a replica that
  was fenced out (the worker moved), swept (a long stall) or died writes nothing;
- **on the database clock**: ``now()`` minus a fixed duration, never a time read here; the
  stamp never moves a heartbeat backwards (``GREATEST``: a later HTTP beat stays);
- **never later than the worker was heard**: ``now() - lag`` is no later than the last byte the
  replica read from the worker, so a worker that froze or lost its tunnel goes stale on the
  database clock within the same 90 s of its last sign of life as with HTTP heartbeats.

The worker learns from its tunnel's upgrade answer that its replica stamps (the
``X-LocalAI-Liveness: tunnel`` header, ``tunnel/keepalive.py``) and then sends its HTTP heartbeat
only when its capacity changed, or every ``worker/service.py``'s slow refresh; without a tunnel,
or to a replica that does not stamp, it beats every 10 s as before.

A pass that starts late (the replica's reactor stalled: a session whose worker died meanwhile
may still be open, its keepalive expiry due but not run yet) stamps nothing; the next one does.

This module must never write a node whose claim it does not hold at that epoch, never read a
clock to decide a heartbeat, and never let a failed pass stop the loop.
"""

from __future__ import annotations

from typing import Callable, Iterable

from twisted.logger import Logger

from localai_tw.periodic import PeriodicPass
from localai_tw.db.pool import DatabaseUnavailable, PoolClosed

from .clock import CONNECTION_IS_HELD_SQL, INSTANCE_IS_LIVE_SQL, INSTANCE_LIVENESS, \
    interval_seconds

log = Logger()

#: Seconds between two stamps of the tunnels this replica holds (``--tunnel-liveness``); a
#: worker's HTTP heartbeat came as often.
DEFAULT_TUNNEL_LIVENESS = 10.0
#: The longest ``--tunnel-liveness`` accepted: a held tunnel's heartbeat is at most this plus
#: the lag (41 s) old before the next stamp, far inside the 90 s stale threshold.
MAX_TUNNEL_LIVENESS = 30.0
#: Tunnels stamped per statement.
STAMP_BATCH = 1000
#: A pass that starts more than this much later than an interval after the previous one stamps
#: nothing: the reactor stalled, and a session whose peer died meanwhile may still be open,
#: its keepalive expiry due but not yet run.  The next pass (the expiries have run) stamps.
LATE_PASS_SLACK = 1.0

# Bind: lag seconds, node ids, epochs (arrays of equal length), replica liveness, owner.
_STAMP_SQL = (
    "UPDATE backend_nodes AS b"
    " SET last_heartbeat = GREATEST(b.last_heartbeat, now() - make_interval(secs => %s))"
    " FROM unnest(%s::text[], %s::bigint[]) AS t(node_id, epoch)"
    " JOIN node_connections ON node_connections.node_id = t.node_id"
    "  AND node_connections.epoch = t.epoch"
    " JOIN instances ON instances.id = node_connections.owner_instance_id"
    f"  AND {INSTANCE_IS_LIVE_SQL}"
    " WHERE b.id = t.node_id AND node_connections.owner_instance_id = %s"
    f"  AND {CONNECTION_IS_HELD_SQL}"
    " RETURNING b.id"
)


async def stamp_liveness(db, owner_id: str, claims: list[tuple[str, int]], lag: float,
                         liveness: float = INSTANCE_LIVENESS) -> set[str]:
    """Write ``last_heartbeat = now() - lag`` for the ``(node_id, epoch)`` claims that
    ``owner_id`` holds at that epoch while live; returns the node ids written (the others were
    fenced out).  :data:`STAMP_BATCH` claims per statement."""
    if not owner_id:
        raise ValueError("owner_id must not be empty")
    written: set[str] = set()
    for start in range(0, len(claims), STAMP_BATCH):
        batch = claims[start:start + STAMP_BATCH]
        rows = await db.runQuery(
            _STAMP_SQL,
            (interval_seconds(lag), [node for node, _ in batch],
             [int(epoch) for _, epoch in batch], interval_seconds(liveness), owner_id))
        written.update(row[0] for row in rows)
    return written


class TunnelLiveness(PeriodicPass):
    """Stamps the heartbeat of every open tunnel this replica holds, every ``interval``.

    :param db: a started ``Database``.
    :param owner_id: this replica's instance id.
    :param live_claims: ``live_claims()`` -> ``(node_id, claim epoch)`` of the open tunnels
        held here (``TunnelRegistry.live_claims``).
    :param lag: seconds a held, open tunnel may have been silent (the keepalive bound plus a
        margin): what the stamp subtracts from ``now()``.
    :param interval: seconds between stamps; 0 turns stamping off.
    """

    name = "tunnel-liveness"
    pass_name = "tunnel liveness stamp"
    outage_errors = (DatabaseUnavailable, PoolClosed)

    def __init__(self, db, owner_id: str, live_claims: Callable[[], Iterable[tuple[str, int]]],
                 lag: float, reactor=None, interval: float = DEFAULT_TUNNEL_LIVENESS):
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        if interval < 0 or lag < 0:
            raise ValueError("the tunnel liveness interval and lag must be >= 0")
        self._db = db
        self._owner_id = owner_id
        self._live_claims = live_claims
        self._reactor = reactor
        self.lag = float(lag)
        self.interval = float(interval)
        #: Passes finished, and the nodes the last one wrote (tests and metrics read them);
        #: passes skipped because they started late (:data:`LATE_PASS_SLACK`).
        self.passes = 0
        self.last_written = 0
        self.late_passes = 0
        self._last_start: float | None = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def pass_enabled(self) -> bool:
        return self.enabled

    async def run_once(self) -> set[str]:
        # The reactor clock only tells whether this pass runs late; no heartbeat is judged by it.
        start, previous = self._reactor.seconds(), self._last_start
        self._last_start = start
        if previous is not None and start - previous > self.interval + LATE_PASS_SLACK:
            self.late_passes += 1
            self.last_written = 0
            self.passes += 1
            log.info("tunnel liveness: this pass started {late:.1f}s late (the reactor was "
                     "busy); nothing stamped until the keepalive has run",
                     late=start - previous - self.interval)
            return set()
        claims = list(self._live_claims())
        written = (await stamp_liveness(self._db, self._owner_id, claims, self.lag)
                   if claims else set())
        self.last_written = len(written)
        self.passes += 1
        return written
