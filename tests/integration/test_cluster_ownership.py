"""Tunnel ownership against a real PostgreSQL: fenced claims, releases, owner, presence."""

import pytest
import pytest_twisted
from twisted.internet import defer

from localai_tw.cluster.membership import InstanceIdentity, register_instance
from localai_tw.cluster.ownership import (
    FencedOut,
    NoConnection,
    OwnershipFence,
    Presence,
)
from localai_tw.db.pool import Database

NODE = "node-0001"


async def _replica(db, instance_id):
    await register_instance(db, InstanceIdentity(instance_id, "test", "10.0.0.1:8080"))


async def _make_not_live(db, instance_id):
    await db.runOperation(
        "UPDATE instances SET last_seen = now() - interval '1 hour' WHERE id = %s", (instance_id,))


async def _make_live(db, instance_id):
    await db.runOperation("UPDATE instances SET last_seen = now() WHERE id = %s", (instance_id,))


async def _row(db, node=NODE):
    return await db.runQuery(
        "SELECT owner_instance_id, epoch, disconnected_at IS NULL FROM node_connections"
        " WHERE node_id = %s", (node,))


@pytest_twisted.ensureDeferred
async def test_claim_returns_fresh_epoch_and_clears_departure(db):
    fence = OwnershipFence(db)
    await _replica(db, "a")
    first = await fence.claim(NODE, "a")
    await fence.release(NODE, "a", first)
    assert (await _row(db))[0][:1] == ("",)
    second = await fence.claim(NODE, "a")
    assert second != first
    assert await _row(db) == [("a", second, True)]
    assert (await fence.owner(NODE)).epoch == second


@pytest_twisted.ensureDeferred
async def test_two_replicas_claim_concurrently_exactly_one_owner(db, pg_dsn):
    """Two pools (two sets of connections) race 100 times for one node."""
    other = Database(pg_dsn, size=4)
    await other.start()
    try:
        fence_a, fence_b = OwnershipFence(db), OwnershipFence(other)
        await _replica(db, "replica-a")
        await _replica(other, "replica-b")
        stale: list[tuple[str, int]] = []
        named_dead = 0
        for round_no in range(100):
            epoch_a, epoch_b = await defer.gatherResults([
                defer.ensureDeferred(fence_a.claim(NODE, "replica-a")),
                defer.ensureDeferred(fence_b.claim(NODE, "replica-b")),
            ])
            assert epoch_a != epoch_b
            rows = await _row(db)
            assert len(rows) == 1
            owner_id, row_epoch, held = rows[0]
            assert held
            claimed = {"replica-a": epoch_a, "replica-b": epoch_b}
            # The row names the last writer, with exactly the epoch that writer got back.
            assert claimed[owner_id] == row_epoch
            ownership = await (fence_a if round_no % 2 else fence_b).owner(NODE)
            assert (ownership.owner_id, ownership.epoch) == (owner_id, row_epoch)

            loser = "replica-b" if owner_id == "replica-a" else "replica-a"
            loser_fence = fence_b if loser == "replica-b" else fence_a
            with pytest.raises(FencedOut):
                await loser_fence.release(NODE, loser, claimed[loser])
            for old_owner, old_epoch in stale[-3:]:
                with pytest.raises(FencedOut):
                    await (fence_a if old_owner == "replica-a" else fence_b).release(
                        NODE, old_owner, old_epoch)
            assert await _row(db) == [(owner_id, row_epoch, True)]  # fenced releases changed nothing
            stale.extend(claimed.items())

            if round_no % 10 == 0:
                # The owner stops being live: it must never be named, by either replica.
                await _make_not_live(db, owner_id)
                for fence in (fence_a, fence_b):
                    with pytest.raises(NoConnection):
                        await fence.owner(NODE)
                named_dead += 1
                await _make_live(db, owner_id)
        assert named_dead == 10
    finally:
        other.close()


@pytest_twisted.ensureDeferred
async def test_release_requires_node_owner_and_epoch(db):
    fence = OwnershipFence(db)
    await _replica(db, "a")
    await _replica(db, "b")
    epoch = await fence.claim(NODE, "a")
    for node, owner, ep in [(NODE, "b", epoch), (NODE, "a", epoch + 1), ("other", "a", epoch)]:
        with pytest.raises(FencedOut):
            await fence.release(node, owner, ep)
    assert await _row(db) == [("a", epoch, True)]
    await fence.release(NODE, "a", epoch)
    owner_id, _, held = (await _row(db))[0]
    assert (owner_id, held) == ("", False)  # a departure is recorded, the row is kept
    with pytest.raises(FencedOut):  # releasing twice is fenced too
        await fence.release(NODE, "a", epoch)
    with pytest.raises(ValueError):
        await fence.release(NODE, "", epoch)  # '' would match departed rows


@pytest_twisted.ensureDeferred
async def test_release_many_releases_in_batches_and_keeps_the_fence(db):
    """A stopping replica releases all it holds in a few statements; a node another replica
    claimed meanwhile, or a stale epoch, is fenced exactly as a single release is.  (Break the
    ``epoch`` or ``owner_instance_id`` condition in _RELEASE_MANY_SQL: this fails.)"""
    from localai_tw.cluster.ownership import RELEASE_BATCH

    fence = OwnershipFence(db)
    await _replica(db, "a")
    await _replica(db, "b")
    nodes = [f"node-{i:05d}" for i in range(RELEASE_BATCH * 2 + 7)]
    epochs = {}
    for node in nodes:
        epochs[node] = await fence.claim(node, "a")
    moved, stale = nodes[3], nodes[RELEASE_BATCH + 1]
    await fence.claim(moved, "b")  # the worker reconnected to b
    epochs_sent = dict(epochs, **{stale: epochs[stale] + 100000})
    released = await fence.release_many("a", list(epochs_sent.items()))
    assert released == set(nodes) - {moved, stale}
    assert (await _row(db, moved))[0][0] == "b"  # b's hold is untouched
    assert (await _row(db, stale))[0] == ("a", epochs[stale], True)
    for node in sorted(released)[:50]:
        assert (await _row(db, node))[0][2] is False
    with pytest.raises(ValueError):
        await fence.release_many("", [(NODE, 1)])


@pytest_twisted.ensureDeferred
async def test_owner_no_row_departed_or_dead_owner_all_no_connection(db):
    fence = OwnershipFence(db)
    with pytest.raises(NoConnection):
        await fence.owner(NODE)  # no row
    await _replica(db, "a")
    epoch = await fence.claim(NODE, "a")
    await fence.release(NODE, "a", epoch)
    with pytest.raises(NoConnection):
        await fence.owner(NODE)  # departed
    await fence.claim(NODE, "a")
    await _make_not_live(db, "a")
    with pytest.raises(NoConnection):
        await fence.owner(NODE)  # held by a dead owner
    row = await fence.owner_row(NODE)
    assert row is not None and row.owner_id == "a"  # diagnostics still see the raw row
    await fence.claim("ghost-node", "never-registered")
    with pytest.raises(NoConnection):
        await fence.owner("ghost-node")  # an owner with no instances row at all


@pytest_twisted.ensureDeferred
async def test_presence_transitions(db):
    fence = OwnershipFence(db)
    assert (await fence.presence(NODE, 90)).presence is Presence.UNKNOWN
    await _replica(db, "a")
    epoch = await fence.claim(NODE, "a")
    assert (await fence.presence(NODE, 90)).presence is Presence.CONNECTED
    await fence.release(NODE, "a", epoch)
    assert (await fence.presence(NODE, 90)).presence is Presence.RECONNECTING
    await db.runOperation("UPDATE node_connections SET disconnected_at = now() - interval '91 s'")
    assert (await fence.presence(NODE, 90)).presence is Presence.GONE
    assert (await fence.presence(NODE, 120)).presence is Presence.RECONNECTING
    # Held by an owner that died and was not swept yet: reconnecting, never gone.
    await fence.claim(NODE, "a")
    await _make_not_live(db, "a")
    reading = await fence.presence(NODE, 1)
    assert reading.presence is Presence.RECONNECTING and reading.error is None


@pytest_twisted.ensureDeferred
async def test_zero_or_negative_grace_uses_default(db):
    fence = OwnershipFence(db)
    await _replica(db, "a")
    epoch = await fence.claim(NODE, "a")
    await fence.release(NODE, "a", epoch)
    await db.runOperation("UPDATE node_connections SET disconnected_at = now() - interval '60 s'")
    for grace in (0, -5, None):
        assert (await fence.presence(NODE, grace)).presence is Presence.RECONNECTING
    assert (await fence.presence(NODE, 30)).presence is Presence.GONE
    await db.runOperation("UPDATE node_connections SET disconnected_at = now() - interval '91 s'")
    for grace in (0, -5, None):
        assert (await fence.presence(NODE, grace)).presence is Presence.GONE


@pytest_twisted.ensureDeferred
async def test_presence_query_error_is_unknown_with_the_error(pg_dsn):
    database = Database(pg_dsn, size=1)
    await database.start()  # not migrated: node_connections does not exist
    try:
        reading = await OwnershipFence(database).presence(NODE, 90)
        assert reading.presence is Presence.UNKNOWN
        assert reading.error is not None
    finally:
        database.close()


@pytest_twisted.ensureDeferred
async def test_purge_deletes_only_old_departures(db):
    fence = OwnershipFence(db)
    await _replica(db, "a")
    for node in ("old", "recent", "held"):
        await fence.claim(node, "a")
    for node in ("old", "recent"):
        await fence.release(node, "a", (await fence.owner(node)).epoch)
    await db.runOperation("UPDATE node_connections SET disconnected_at = now() - interval '1 day'"
                          " WHERE node_id = 'old'")
    # A held row whose connected_at is ancient is still never purged.
    await db.runOperation("UPDATE node_connections SET connected_at = now() - interval '30 days'"
                          " WHERE node_id = 'held'")
    assert await fence.purge_departed_before(3600) == 1
    left = sorted(r[0] for r in await db.runQuery("SELECT node_id FROM node_connections"))
    assert left == ["held", "recent"]
