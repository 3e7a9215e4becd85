"""The loop that stamps the heartbeat of the tunnels this replica holds (``--tunnel-liveness``).

Every ``interval`` (10 s) it lists the open sessions of the ``TunnelRegistry``
(``live_claims``) and writes their heartbeat with ``cluster/liveness.py``'s fenced statement,
``now() - lag``, ``lag`` being the keepalive's detection bound plus a second: an open session
was heard from within that bound (``tunnel/keepalive.py``).

That holds only when the keepalive's expiries have run: after the reactor stalled, a session
whose worker died meanwhile is still open, its expiry due but not yet run.  So a pass that
starts more than :data:`LATE_PASS_SLACK` later than an interval after the previous one stamps
nothing; the next one, once the expiries ran, does.  (The reactor clock only says whether a
pass is late; no heartbeat is judged by it.)

Each pass hands what it wrote (node id -> status) to ``on_stamped``: the replica's stamp
notices tell those workers over their tunnels (``tunnel/stampnotice.py``).

This module must never stamp a session it did not just see open, and never let a failed pass
stop the loop.
"""

from __future__ import annotations

from typing import Callable, Iterable

from twisted.logger import Logger

from localai_tw.cluster.liveness import DEFAULT_TUNNEL_LIVENESS, stamp_liveness
from localai_tw.db.pool import DatabaseUnavailable, PoolClosed
from localai_tw.periodic import PeriodicPass

log = Logger()

#: A pass that starts more than this much later than an interval after the previous one stamps
#: nothing (see the module docstring).
LATE_PASS_SLACK = 1.0


class TunnelLiveness(PeriodicPass):
    """Stamps the heartbeat of every open tunnel this replica holds, every ``interval``.

    :param db: a started ``Database``.
    :param owner_id: this replica's instance id.
    :param live_claims: ``live_claims()`` -> ``(node_id, claim epoch)`` of the open tunnels
        held here (``TunnelRegistry.live_claims``).
    :param lag: seconds a held, open tunnel may have been silent (the keepalive bound plus a
        margin): what the stamp subtracts from ``now()``.
    :param interval: seconds between stamps; 0 turns stamping off.
    :param on_stamped: called with node id -> status of the nodes each pass wrote (the stamp
        notices, ``tunnel/stampnotice.py``); a failure there is logged and stamps on.
    """

    name = "tunnel-liveness"
    pass_name = "tunnel liveness stamp"
    outage_errors = (DatabaseUnavailable, PoolClosed)

    def __init__(self, db, owner_id: str, live_claims: Callable[[], Iterable[tuple[str, int]]],
                 lag: float, reactor=None, interval: float = DEFAULT_TUNNEL_LIVENESS,
                 on_stamped: Callable[[dict[str, str]], None] | None = None):
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
        self.on_stamped = on_stamped
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

    async def run_once(self) -> dict[str, str]:
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
            return {}
        claims = list(self._live_claims())
        written = (await stamp_liveness(self._db, self._owner_id, claims, self.lag)
                   if claims else {})
        self.last_written = len(written)
        self.passes += 1
        if written and self.on_stamped is not None:
            try:
                self.on_stamped(written)
            except Exception:
                log.failure("tunnel liveness: sending the stamp notices failed")
        return written
