"""Liveness from the tunnel (``cluster/liveness.py``) against a real PostgreSQL.

The owner replica stamps ``last_heartbeat`` of the tunnels it holds, fenced by its claim's
epoch and its own liveness, on the database clock; ages are made and read with the database's
``now()``.  The stamping loop runs on a ``task.Clock``.
"""

from __future__ import annotations

import pytest_twisted
from twisted.internet import task

from localai_tw.cluster.departure import DepartureNotifier
from localai_tw.cluster.health import HealthMonitor
from localai_tw.cluster.liveness import stamp_liveness
from localai_tw.tunnel.liveness import TunnelLiveness
from localai_tw.cluster.nodes import NodeRegistry
from localai_tw.cluster.ownership import OwnershipFence

from .harness_claims import heartbeat_age as _age, make_heartbeat_old as _make_old, \
    make_live, make_stale

TOKEN = "liveness-test-token"
LAG = 11.0


async def _status(db, node_id) -> str:
    [(status,)] = await db.runQuery("SELECT status FROM backend_nodes WHERE id = %s",
                                    (node_id,))
    return status


async def _held_node(db, name: str, replica: str = "replica-a"):
    registry = NodeRegistry(db, registration_token=TOKEN)
    node = (await registry.register(name, presented_token=TOKEN)).node.id
    await make_live(db, replica)
    epoch = await OwnershipFence(db).claim(node, replica)
    await _make_old(db, node, 600)
    return registry, node, epoch


@pytest_twisted.ensureDeferred
async def test_the_owner_stamps_its_held_tunnels_lag_seconds_before_now(db):
    _, node, epoch = await _held_node(db, "w1")
    assert await stamp_liveness(db, "replica-a", [(node, epoch)], LAG) == {node: "healthy"}
    age = await _age(db, node)
    # Never later than the worker was last heard (now - lag), and fresh.
    assert LAG - 0.5 <= age < LAG + 5


@pytest_twisted.ensureDeferred
async def test_a_stamp_never_moves_a_newer_heartbeat_back(db):
    _, node, epoch = await _held_node(db, "w1")
    await _make_old(db, node, 0)  # an HTTP heartbeat just now
    await stamp_liveness(db, "replica-a", [(node, epoch)], LAG)
    assert await _age(db, node) < 5


@pytest_twisted.ensureDeferred
async def test_a_fenced_out_replica_stamps_nothing(db):
    """A replica whose epoch is stale (the worker moved), that is not the owner, whose claim was
    released, or that is not live any more, writes no heartbeat."""
    fence = OwnershipFence(db)
    _, node, old_epoch = await _held_node(db, "w1")
    await make_live(db, "replica-b")
    new_epoch = await fence.claim(node, "replica-b")  # the worker moved to replica b
    assert await stamp_liveness(db, "replica-a", [(node, old_epoch)], LAG) == {}
    assert await stamp_liveness(db, "replica-a", [(node, new_epoch)], LAG) == {}
    assert await _age(db, node) >= 599

    assert await stamp_liveness(db, "replica-b", [(node, new_epoch)], LAG) == {node: "healthy"}
    await _make_old(db, node, 600)
    await make_stale(db, "replica-b")  # b stalled long enough to count as dead
    assert await stamp_liveness(db, "replica-b", [(node, new_epoch)], LAG) == {}
    await make_live(db, "replica-b")
    await fence.release(node, "replica-b", new_epoch)  # the tunnel left
    assert await stamp_liveness(db, "replica-b", [(node, new_epoch)], LAG) == {}
    assert await _age(db, node) >= 599


@pytest_twisted.ensureDeferred
async def test_many_tunnels_are_stamped_in_batches(db, monkeypatch):
    from localai_tw.cluster import liveness

    monkeypatch.setattr(liveness, "STAMP_BATCH", 2)
    nodes = [await _held_node(db, f"w{i}") for i in range(5)]
    claims = [(node, epoch) for _, node, epoch in nodes]
    assert await stamp_liveness(db, "replica-a", claims, LAG) == {n: "healthy" for n, _ in claims}


@pytest_twisted.ensureDeferred
async def test_a_worker_whose_tunnel_ends_goes_stale_on_the_database_clock(db):
    """While the tunnel is open the replica's stamps keep the node healthy without any HTTP
    heartbeat; once it ended (keepalive lost, worker frozen) nothing stamps it, and the health
    pass marks it offline once its heartbeat is older than the threshold."""
    registry, node, epoch = await _held_node(db, "w1")
    open_tunnels = {node: epoch}
    clock = task.Clock()
    stamper = TunnelLiveness(db, "replica-a", lambda: list(open_tunnels.items()), LAG, clock,
                             interval=10)
    monitor = HealthMonitor(db, registry, OwnershipFence(db), DepartureNotifier({}),
                            task.Clock(), interval=15, stale_after=60, grace=90)
    stamper.startService()
    try:
        clock.advance(10)
        await _settled(stamper, 1)
        assert stamper.last_written == 1
        assert await _age(db, node) < LAG + 5
        await monitor.tick()
        assert await _status(db, node) == "healthy"

        del open_tunnels[node]  # the session ended: the registry no longer lists it
        await _make_old(db, node, 91)  # its last sign of life 91 s ago (the grace is 90)
        clock.advance(10)
        await _settled(stamper, 2)
        assert stamper.last_written == 0
        assert await _age(db, node) >= 90  # nobody stamped it
        await monitor.tick()
        assert await _status(db, node) == "offline"
    finally:
        await stamper.stopService()


async def _settled(stamper, passes: int) -> None:
    """Wait until the pass the clock started has finished (its statement runs on the
    database pool, outside the test's clock)."""
    from twisted.internet import reactor

    for _ in range(500):
        if stamper.passes >= passes:
            return
        await task.deferLater(reactor, 0.01, lambda: None)
    raise AssertionError("the liveness pass did not finish")
