"""Batched heartbeats (``cluster/nodes.py``, ``HeartbeatBatch``) against a real PostgreSQL.

The batch's timer runs on a ``task.Clock``; ages are made and read with the database's
``now()``, never with the process clock.
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer, task

from localai_tw.cluster.departure import DepartureNotifier
from localai_tw.cluster.health import HealthMonitor
from localai_tw.cluster.nodes import (
    HeartbeatBatch,
    NodeCapacity,
    NodeRegistry,
    NodeStatus,
    Unauthorized,
)
from localai_tw.cluster.ownership import OwnershipFence

TOKEN = "batch-test-token"


async def _age(db, node_id) -> float | None:
    """Seconds since the node's last heartbeat, on the database's clock (None: never)."""
    [(age,)] = await db.runQuery(
        "SELECT extract(epoch FROM now() - last_heartbeat) FROM backend_nodes WHERE id = %s",
        (node_id,))
    return None if age is None else float(age)


async def _make_old(db, node_id, seconds: float) -> None:
    await db.runOperation("UPDATE backend_nodes SET last_heartbeat = now() - make_interval("
                          "secs => %s) WHERE id = %s", (seconds, node_id))


@pytest.fixture
def batched(db):
    clock = task.Clock()
    batch = HeartbeatBatch(db, clock, window=0.2)
    return NodeRegistry(db, registration_token=TOKEN, heartbeat_batch=batch), batch, clock


@pytest_twisted.ensureDeferred
async def test_many_nodes_beat_in_one_statement_and_only_matching_credentials_write(db, batched):
    registry, batch, clock = batched
    nodes = [await registry.register(f"w{i}", presented_token=TOKEN) for i in range(3)]
    for node in nodes:
        await _make_old(db, node.node.id, 600)
    beats = [defer.ensureDeferred(registry.beat(n.node.id, n.tunnel_credential,
                                                NodeCapacity(available_vram=1000 + i)))
             for i, n in enumerate(nodes)]
    wrong = defer.ensureDeferred(registry.beat(nodes[0].node.id, "not-its-credential"))
    unknown = defer.ensureDeferred(registry.beat("no-such-node", nodes[1].tunnel_credential))
    clock.advance(0.1)  # inside the window: nothing written, nobody answered
    assert not any(d.called for d in beats + [wrong, unknown]) and batch.writes == 0
    assert all([await _age(db, n.node.id) >= 599 for n in nodes])

    clock.advance(0.1)
    assert await defer.gatherResults(beats) == [NodeStatus.HEALTHY] * 3
    assert batch.writes == 1 and batch.waiting == 0
    for failed in (wrong, unknown):
        with pytest.raises(Unauthorized):
            await failed
    for i, node in enumerate(nodes):
        assert await _age(db, node.node.id) < 60  # the database's now() at the write
        [(vram,)] = await db.runQuery("SELECT available_vram FROM backend_nodes WHERE id = %s",
                                      (node.node.id,))
        assert vram == 1000 + i


@pytest_twisted.ensureDeferred
async def test_a_rotated_credential_no_longer_beats(db, batched):
    registry, batch, clock = batched
    first = await registry.register("w1", presented_token=TOKEN)
    second = await registry.register("w1", presented_token=TOKEN)  # a re-registration
    await _make_old(db, first.node.id, 600)
    stale = defer.ensureDeferred(registry.beat(first.node.id, first.tunnel_credential))
    clock.advance(0.2)
    with pytest.raises(Unauthorized):
        await stale
    assert await _age(db, first.node.id) >= 599  # a beat with the old credential wrote nothing
    fresh = defer.ensureDeferred(registry.beat(second.node.id, second.tunnel_credential))
    clock.advance(0.2)
    assert await fresh is NodeStatus.HEALTHY


@pytest_twisted.ensureDeferred
async def test_offline_and_pending_nodes_beat_without_changing_capacity(db, batched):
    registry, batch, clock = batched
    out = await registry.register("w1", presented_token=TOKEN,
                                  capacity=NodeCapacity(available_vram=5))
    await registry.mark_offline(out.node.id)
    beat = defer.ensureDeferred(registry.beat(out.node.id, out.tunnel_credential,
                                              NodeCapacity(available_vram=99)))
    clock.advance(0.2)
    assert await beat is NodeStatus.OFFLINE
    [(vram,)] = await db.runQuery("SELECT available_vram FROM backend_nodes")
    assert vram == 5


@pytest_twisted.ensureDeferred
async def test_a_node_that_stops_beating_through_the_batch_is_still_found_stale(db, batched):
    """Stale detection is unchanged: the batch writes the database's now(), the health monitor
    compares with it; a node whose beats stop goes offline once past the threshold."""
    registry, batch, clock = batched
    fence = OwnershipFence(db)
    monitor = HealthMonitor(db, registry, fence, DepartureNotifier({}), task.Clock(),
                            interval=15, stale_after=60, grace=90)
    out = await registry.register("w1", presented_token=TOKEN)
    beat = defer.ensureDeferred(registry.beat(out.node.id, out.tunnel_credential))
    clock.advance(0.2)
    await beat
    await monitor.tick()
    [(status,)] = await db.runQuery("SELECT status FROM backend_nodes")
    assert status == "healthy"  # fresh: left alone
    await _make_old(db, out.node.id, 91)  # its beats stopped 91 s ago (the grace is 90)
    await monitor.tick()
    [(status,)] = await db.runQuery("SELECT status FROM backend_nodes")
    assert status == "offline"
