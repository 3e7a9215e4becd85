"""Liveness from the tunnel: the replica holding a worker's tunnel keeps its heartbeat fresh.

A worker used to prove it was alive with an HTTP heartbeat every 10 s: 400 requests a second
for a replica holding 4000 idle workers, half of its idle CPU (docs/benchmarks.md, "An idle
fleet").  The replica already knows which of its tunnels are alive: a tunnel whose peer stops
answering the keepalive is ended within ``DEAD_TUNNEL_DETECTION`` (10 s,
``tunnel/keepalive.py``), so a session still open was heard from at most that long ago.
Every ``interval`` (10 s) ``tunnel/liveness.py``'s loop writes, for every open tunnel it holds,
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
only when its capacity changed, or every ``worker/service.py``'s slow refresh, which the
replica's stamp notices put off (``tunnel/stampnotice.py``: only written stamps are noticed);
without a tunnel, or to a replica that does not stamp, it beats every 10 s as before.

This module holds the statement; the loop that runs it (and skips a pass that starts late) is
``tunnel/liveness.py``, beside the sessions whose keepalive it relies on.

This module must never write a node whose claim it does not hold at that epoch, and never read
a clock (the database's ``now()`` is the only one).
"""

from __future__ import annotations

from .clock import CONNECTION_IS_HELD_SQL, INSTANCE_IS_LIVE_SQL, INSTANCE_LIVENESS, \
    interval_seconds
from .rowlocks import locked_first


#: Seconds between two stamps of the tunnels this replica holds (``--tunnel-liveness``); a
#: worker's HTTP heartbeat came as often.
DEFAULT_TUNNEL_LIVENESS = 10.0
#: The longest ``--tunnel-liveness`` accepted: a held tunnel's heartbeat is at most this plus
#: the lag (41 s) old before the next stamp, far inside the 90 s stale threshold.
MAX_TUNNEL_LIVENESS = 30.0
#: Tunnels stamped per statement.
STAMP_BATCH = 1000

# Bind: node ids, epochs (arrays of equal length), lag seconds, replica liveness, owner.
_STAMP_ROWS_LOCKED, _STAMP_ROWS_ARE_LOCKED = locked_first("SELECT node_id FROM t")
_STAMP_SQL = (
    "WITH t AS (SELECT * FROM unnest(%s::text[], %s::bigint[]) AS t(node_id, epoch)),"
    f" {_STAMP_ROWS_LOCKED}"
    " UPDATE backend_nodes AS b"
    " SET last_heartbeat = GREATEST(b.last_heartbeat, now() - make_interval(secs => %s))"
    " FROM t"
    " JOIN node_connections ON node_connections.node_id = t.node_id"
    "  AND node_connections.epoch = t.epoch"
    " JOIN instances ON instances.id = node_connections.owner_instance_id"
    f"  AND {INSTANCE_IS_LIVE_SQL}"
    f" WHERE {_STAMP_ROWS_ARE_LOCKED} AND b.id = t.node_id"
    " AND node_connections.owner_instance_id = %s"
    f"  AND {CONNECTION_IS_HELD_SQL}"
    " RETURNING b.id, b.status"
)


async def stamp_liveness(db, owner_id: str, claims: list[tuple[str, int]], lag: float,
                         liveness: float = INSTANCE_LIVENESS) -> dict[str, str]:
    """Write ``last_heartbeat = now() - lag`` for the ``(node_id, epoch)`` claims that
    ``owner_id`` holds at that epoch while live; returns node id -> status of the nodes written
    (the others were fenced out).  :data:`STAMP_BATCH` claims per statement."""
    if not owner_id:
        raise ValueError("owner_id must not be empty")
    written: dict[str, str] = {}
    for start in range(0, len(claims), STAMP_BATCH):
        batch = claims[start:start + STAMP_BATCH]
        rows = await db.runQuery(
            _STAMP_SQL,
            ([node for node, _ in batch], [int(epoch) for _, epoch in batch],
             interval_seconds(lag), interval_seconds(liveness), owner_id))
        written.update((row[0], row[1]) for row in rows)
    return written
