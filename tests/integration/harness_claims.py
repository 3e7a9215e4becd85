"""The claim tests' view of the database: instance rows made live or stale on the DB clock,
and one claim's row (``test_claims.py``, ``test_claims_batch.py``, ``test_metrics.py``).  Their
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
