"""The jobs queue's depth for ``/metrics``: read every 15 s by each replica, kept in memory.

A scrape makes no query (``docs/metrics.md``); this service makes one small statement pair per
interval instead: unfinished jobs by state (the ``jobs_state_created_idx`` index) and the job
claim rows by status.  A failed read keeps the previous snapshot and is logged once per outage.
"""

from __future__ import annotations

from twisted.logger import Logger

from localai_tw.deferreds import shielded
from localai_tw.periodic import PeriodicPass

from localai_tw.frontend.jobs.store import CLAIM_KIND

log = Logger()

#: Seconds between two reads of the queue's depth.
JOBS_STATS_INTERVAL = 15.0

_JOBS_SQL = ("SELECT state, count(*) FROM jobs WHERE state IN ('queued', 'running')"
             " GROUP BY state")
_CLAIMS_SQL = (
    "SELECT"
    " count(*) FILTER (WHERE claimed_at IS NULL AND (not_before IS NULL OR not_before <= now())),"
    " count(*) FILTER (WHERE claimed_at IS NULL AND not_before > now()),"
    " count(*) FILTER (WHERE claimed_at IS NOT NULL)"
    " FROM work_claims WHERE kind = %s")


class JobStatsService(PeriodicPass):
    """The queue's depth for ``/metrics``, read every ``interval`` (the first at start)."""

    name = "jobs-stats"
    pass_name = "jobs figures pass"
    run_first = True

    def __init__(self, db, reactor, interval: float = JOBS_STATS_INTERVAL):
        self.db = db
        self.snapshot: dict | None = None
        self._reactor = reactor
        self.interval = interval
        self._failing = False

    async def run_once(self) -> None:
        await self.read_once()

    async def read_once(self) -> None:
        try:
            rows = await shielded(self.db.runQuery(_JOBS_SQL))
            (ready, backing_off, held), = await shielded(
                self.db.runQuery(_CLAIMS_SQL, (CLAIM_KIND,)))
        except Exception as e:
            if not self._failing:
                log.warn("jobs: reading the queue's depth failed (the metrics keep the last "
                         "reading): {err}", err=e)
            self._failing = True
            return
        self._failing = False
        jobs = {"queued": 0, "running": 0}
        jobs.update({state: int(n) for state, n in rows})
        self.snapshot = {"jobs": jobs, "claims": {"ready": int(ready),
                                                  "backing_off": int(backing_off),
                                                  "held": int(held)}}
