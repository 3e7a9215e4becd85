"""The time rules of the cluster layer, spelled once.

Every "how long ago" in cluster state is decided by PostgreSQL's ``now()``: replicas run on
different machines whose clocks disagree, and the database clock is the only one all of them
read.  This module holds the durations (plain seconds, bound as parameters) and the SQL
fragments that compare against ``now()``; ``membership``, ``ownership`` and later layers
(health monitor, claim queue) import them instead of writing their own spelling.

This module must never read the process clock (``time.time``, ``datetime.now``,
``reactor.seconds``) to decide liveness, presence or age; a unit test greps the package for it.
"""

from __future__ import annotations

import math

#: How often a replica refreshes its ``instances.last_seen``.
INSTANCE_HEARTBEAT = 5.0
#: A replica is live while ``last_seen`` is younger than this (six missed beats).
INSTANCE_LIVENESS = 30.0
#: How long a worker's tunnel may be away before its absence counts (presence ``gone``).  It must
#: exceed two capped dial backoffs (2 x 30 s) plus a handshake (10 s).
DEFAULT_RECONNECT_GRACE = 90.0
#: Upper bound on any interval handed to ``make_interval``, so arithmetic on a huge configured
#: grace cannot overflow PostgreSQL's interval range (about 100 years here).
MAX_INTERVAL_SECONDS = 100 * 365 * 86400.0

#: The live-replica predicate, the single spelling.  Binds one parameter: the liveness window in
#: seconds.  It names the table ``instances`` unaliased so it can be dropped into a join.
INSTANCE_IS_LIVE_SQL = "instances.last_seen > now() - make_interval(secs => %s)"

#: Ids of live replicas, for use as a sub-select (``... IN (LIVE_INSTANCE_IDS_SQL)``).  Binds one
#: parameter: the liveness window in seconds.
LIVE_INSTANCE_IDS_SQL = f"SELECT instances.id FROM instances WHERE {INSTANCE_IS_LIVE_SQL}"

#: A connection row is held by a replica.  The empty owner means "held by nobody"; filtering on it
#: keeps departed rows out of every statement that acts on held rows.
CONNECTION_IS_HELD_SQL = "node_connections.owner_instance_id <> ''"


def interval_seconds(seconds: float) -> float:
    """``seconds`` as a finite, non-negative float bounded for ``make_interval``."""
    seconds = float(seconds)
    if math.isnan(seconds):
        raise ValueError("an interval cannot be NaN")
    return min(max(seconds, 0.0), MAX_INTERVAL_SECONDS)


def effective_grace(grace: float | None) -> float:
    """The reconnect grace actually used: zero, negative or missing means the default.

    A zero grace would turn every departure, however brief, into a verdict of absence.
    """
    if grace is None:
        return DEFAULT_RECONNECT_GRACE
    grace = float(grace)
    if math.isnan(grace) or grace <= 0:
        return DEFAULT_RECONNECT_GRACE
    return interval_seconds(grace)


def departure_retention(grace: float | None, liveness: float = INSTANCE_LIVENESS) -> float:
    """How long a departure row is kept: max(10 x liveness, 5 x grace).

    Purging a departure turns presence ``gone`` back into ``unknown``; keeping it several graces
    long means a purge never outruns the grace that reads it.
    """
    return interval_seconds(max(10.0 * float(liveness), 5.0 * effective_grace(grace)))
