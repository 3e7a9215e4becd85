"""The claim tests' view of the database: instance rows made live or stale on the DB clock,
and one claim's row (``test_claims.py``, ``test_claims_batch.py``, ``test_metrics.py``), and
a node's heartbeat age (the liveness tests).  Their
``consumers`` fixture is in ``conftest.py``."""

from __future__ import annotations


# Until a test needs more, an instance row is (id, last_seen), written with the DB clock.
async def make_live(db, *ids: str) -> None:
    for i in ids:
        await db.runOperation(
            "INSERT INTO instances (id, last_seen) VALUES (%s, now())"
            " ON CONFLICT (id) DO UPDATE SET last_seen = now()", (i,))


async def make_stale(db, instance_id: str) -> None:
    await db.runOperation(
        "UPDATE instances SET last_seen = now() - interval '1 hour' WHERE id = %s",
        (instance_id,))


async def row(db, work_id: str):
    rows = await db.runQuery(
        "SELECT claimed_by, claimed_at IS NOT NULL, attempts, failures,"
        " extract(epoch FROM not_before - now())::float8"
        " FROM work_claims WHERE id = %s", (work_id,))
    return rows[0] if rows else None


async def heartbeat_age(db, node_id) -> float:
    """Seconds since the node's last heartbeat, on the database's clock."""
    [(age,)] = await db.runQuery(
        "SELECT extract(epoch FROM now() - last_heartbeat) FROM backend_nodes WHERE id = %s",
        (node_id,))
    return float(age)


async def make_heartbeat_old(db, node_id, seconds: float) -> None:
    """Set the node's last heartbeat ``seconds`` before the database's ``now()``."""
    await db.runOperation("UPDATE backend_nodes SET last_heartbeat = now() - make_interval("
                          "secs => %s) WHERE id = %s", (seconds, node_id))
