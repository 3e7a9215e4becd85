"""The health monitor against a real PostgreSQL, ticks driven by ``task.Clock``.

Ages are made in SQL (``last_heartbeat`` and ``disconnected_at`` moved back with the database's
``now()``), never with the process clock.
"""

from __future__ import annotations

import psycopg2
import pytest
import pytest_twisted
from twisted.internet import defer, task

from localai_tw.cluster.departure import DepartureNotifier
from localai_tw.cluster.health import HealthMonitor
from localai_tw.cluster.membership import InstanceIdentity, register_instance
from localai_tw.cluster.nodes import NodeRegistry
from localai_tw.cluster.ownership import OwnershipFence
from localai_tw.db.pool import Database

from .support import sleep, within

TOKEN = "health-test-token"
GRACE = 90.0
REPLICA = "replica-a"


class Departures:
    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, node_id):
        self.calls.append(node_id)


@pytest.fixture
def departures():
    return Departures()


@pytest.fixture
def world(db, departures):
    registry = NodeRegistry(db, registration_token=TOKEN)
    fence = OwnershipFence(db)
    notifier = DepartureNotifier({"recorder": departures})
    clock = task.Clock()
    monitor = HealthMonitor(db, registry, fence, notifier, clock, interval=15,
                            stale_after=60, grace=GRACE)
    return registry, fence, notifier, clock, monitor


async def register(registry, name="w1", **kwargs) -> str:
    return (await registry.register(name, presented_token=TOKEN, **kwargs)).node.id


async def status_of(db, node_id) -> str:
    return (await db.runQuery("SELECT status FROM backend_nodes WHERE id = %s", (node_id,)))[0][0]


async def model_rows(db, node_id) -> int:
    return (await db.runQuery("SELECT count(*) FROM node_models WHERE node_id = %s",
                              (node_id,)))[0][0]


async def add_model(db, node_id, name="llama"):
    await db.runOperation("INSERT INTO node_models (node_id, model_name, state)"
                          " VALUES (%s, %s, 'loaded')", (node_id, name))


async def heartbeat_age(db, node_id, seconds: float):
    await db.runOperation("UPDATE backend_nodes SET last_heartbeat = now() - make_interval("
                          "secs => %s) WHERE id = %s", (seconds, node_id))


async def departed_ago(db, node_id, seconds: float):
    """A departure row (held by nobody) whose departure happened ``seconds`` ago."""
    await db.runOperation(
        "INSERT INTO node_connections (node_id, owner_instance_id, epoch, connected_at,"
        " disconnected_at) VALUES (%s, '', nextval('node_connection_epochs'),"
        " now() - interval '1 hour', now() - make_interval(secs => %s))"
        " ON CONFLICT (node_id) DO UPDATE SET owner_instance_id = '',"
        " disconnected_at = EXCLUDED.disconnected_at", (node_id, seconds))


async def connected(db, fence, node_id):
    await register_instance(db, InstanceIdentity(REPLICA, "test"))
    return await fence.claim(node_id, REPLICA)


async def ticks(monitor, n=1) -> list[bool]:
    return [await monitor.tick() for _ in range(n)]


@pytest_twisted.ensureDeferred
async def test_stale_heartbeat_marks_offline_and_deletes_model_rows(db, world, departures):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    await departed_ago(db, node, GRACE + 60)  # gone as well: the stale branch comes first
    await heartbeat_age(db, node, GRACE + 1)
    assert await ticks(monitor) == [True]
    assert await status_of(db, node) == "offline"
    assert await model_rows(db, node) == 0
    assert monitor.last_report.marked_offline == [node]
    assert departures.calls == []  # not fired for a stale heartbeat
    # already offline: nothing more (no log spam, no second transition)
    await ticks(monitor, 2)
    assert monitor.last_report.marked_offline == []
    assert departures.calls == []


@pytest_twisted.ensureDeferred
async def test_fresh_heartbeat_is_left_alone_below_the_threshold(db, world, departures):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    await heartbeat_age(db, node, 55)
    await ticks(monitor)
    assert await status_of(db, node) == "healthy"
    assert await model_rows(db, node) == 1


@pytest_twisted.ensureDeferred
async def test_unhealthy_node_with_a_stale_heartbeat_goes_offline(db, world):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    await registry.mark_unhealthy(node)
    await heartbeat_age(db, node, 120)
    await ticks(monitor)
    assert await status_of(db, node) == "offline"
    assert await model_rows(db, node) == 0


@pytest_twisted.ensureDeferred
async def test_presence_gone_demotes_status_only_and_fires_once(db, world, departures):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    await departed_ago(db, node, GRACE + 5)
    await ticks(monitor, 3)
    assert await status_of(db, node) == "unhealthy"
    assert await model_rows(db, node) == 1  # status only: rows are kept
    assert departures.calls == [node]  # once across several ticks


@pytest_twisted.ensureDeferred
async def test_within_the_grace_nothing_happens(db, world, departures):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    await departed_ago(db, node, GRACE - 30)  # reconnecting
    assert (await fence.presence(node, GRACE)).presence.value == "reconnecting"
    await ticks(monitor, 3)
    assert await status_of(db, node) == "healthy"
    assert await model_rows(db, node) == 1
    assert departures.calls == []


@pytest_twisted.ensureDeferred
async def test_unknown_presence_does_nothing(db, world, departures):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)  # never dialled: no node_connections row
    await registry.mark_unhealthy(node)
    await ticks(monitor, 2)
    assert (await fence.presence(node, GRACE)).presence.value == "unknown"
    assert await status_of(db, node) == "unhealthy"  # not promoted without a tunnel either
    assert departures.calls == []


@pytest_twisted.ensureDeferred
async def test_failed_presence_read_leaves_the_node_alone(db, pg_dsn, world, departures):
    registry, fence, notifier, clock, _ = world
    node = await register(registry)
    await departed_ago(db, node, GRACE + 5)
    broken = Database(pg_dsn, size=1)
    await broken.start()
    broken.close()
    monitor = HealthMonitor(db, registry, OwnershipFence(broken), notifier, clock, grace=GRACE)
    await ticks(monitor, 2)
    assert monitor.last_report.left_alone == [node]
    assert await status_of(db, node) == "healthy"
    assert departures.calls == []
    # ...and a failed read does not re-arm an announced departure either
    notifier.departed(node)
    assert departures.calls == [node]
    await ticks(monitor)
    assert notifier.is_departed(node)


@pytest_twisted.ensureDeferred
async def test_connected_again_promotes_and_re_arms(db, world, departures):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await departed_ago(db, node, GRACE + 5)
    await ticks(monitor)
    assert departures.calls == [node] and await status_of(db, node) == "unhealthy"
    epoch = await connected(db, fence, node)
    await ticks(monitor)
    assert await status_of(db, node) == "healthy"
    assert monitor.last_report.marked_healthy == [node]
    assert not notifier.is_departed(node)
    # leaves again: announced again once past the grace
    await fence.release(node, REPLICA, epoch)
    await ticks(monitor)
    assert departures.calls == [node]  # reconnecting: not yet
    await departed_ago(db, node, GRACE + 5)
    await ticks(monitor, 2)
    assert departures.calls == [node, node]


@pytest_twisted.ensureDeferred
async def test_offline_node_heartbeating_and_connected_comes_back(db, world):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await heartbeat_age(db, node, GRACE + 1)
    await ticks(monitor)
    assert await status_of(db, node) == "offline"
    await registry.heartbeat(node)
    await ticks(monitor)
    assert await status_of(db, node) == "offline"  # no tunnel yet: presence unknown
    await connected(db, fence, node)
    await ticks(monitor)
    assert await status_of(db, node) == "healthy"


@pytest_twisted.ensureDeferred
async def test_draining_nodes_are_skipped(db, world, departures):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    await registry.drain(node)
    await heartbeat_age(db, node, 600)
    await ticks(monitor)
    await departed_ago(db, node, GRACE + 5)
    await heartbeat_age(db, node, 0)
    await ticks(monitor)
    assert await status_of(db, node) == "draining"
    assert await model_rows(db, node) == 1
    assert departures.calls == []


@pytest_twisted.ensureDeferred
async def test_pending_node_is_never_promoted(db, world):
    _, fence, notifier, clock, _ = world
    approving = NodeRegistry(db, registration_token=TOKEN, require_approval=True)
    monitor = HealthMonitor(db, approving, fence, notifier, clock, grace=GRACE)
    node = await register(approving)
    await connected(db, fence, node)
    await ticks(monitor)
    assert await status_of(db, node) == "pending"


@pytest_twisted.ensureDeferred
async def test_the_clock_drives_ticks_and_stop_waits(db, world):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await heartbeat_age(db, node, GRACE + 1)
    monitor.startService()
    try:
        clock.advance(14)
        await sleep(0.05)
        assert monitor.last_report is None
        clock.advance(1)
        for _ in range(100):
            if monitor.last_report is not None:
                break
            await sleep(0.02)
        assert monitor.last_report.marked_offline == [node]
    finally:
        await monitor.stopService()
    assert not clock.getDelayedCalls()


@pytest_twisted.ensureDeferred
async def test_two_replicas_at_the_same_moment_run_one_pass(db, pg_dsn, world, departures):
    """The advisory lock: two monitors on two pools tick together; the winner is held inside
    its pass (a table lock blocks its read) while the other tries; only one pass runs."""
    registry, fence, notifier, clock, monitor_a = world
    node = await register(registry)
    await heartbeat_age(db, node, GRACE + 1)
    other_db = Database(pg_dsn, size=4)
    await other_db.start()
    other_departures = Departures()
    monitor_b = HealthMonitor(other_db, NodeRegistry(other_db, registration_token=TOKEN),
                              OwnershipFence(other_db),
                              DepartureNotifier({"recorder": other_departures}),
                              task.Clock(), grace=GRACE)
    blocker = psycopg2.connect(pg_dsn)
    try:
        with blocker.cursor() as cur:
            cur.execute("LOCK TABLE backend_nodes IN ACCESS EXCLUSIVE MODE")
        tick_a, tick_b = monitor_a.tick(), monitor_b.tick()
        first = await within(defer.DeferredList([tick_a, tick_b], fireOnOneCallback=True,
                                                consumeErrors=True), 10)
        assert first[0] is False  # the loser returned at once; the winner is still blocked
        blocker.commit()
        results = [await within(tick_a, 10), await within(tick_b, 10)]
    finally:
        blocker.close()
        other_db.close()
    assert sorted(results) == [False, True]
    assert await status_of(db, node) == "offline"
    assert (monitor_a.last_report is None) != (monitor_b.last_report is None)


# -- one timeline for every fault (docs/cluster-state.md) -------------------------------------
#
# ``world`` runs the frontend's defaults: a 60 s stale threshold, a 90 s grace, 15 s ticks.  A
# fault starts at T = 0; the worker's last heartbeat was up to one heartbeat interval before it.
# The test steps T through the grace in tick-sized steps (ages set in SQL) and runs a pass at
# each: nothing may be marked offline, demoted, announced or deleted before the grace has passed.

HEARTBEAT_INTERVAL = 10.0
INSIDE_THE_GRACE = [0, 15, 30, 45, 55, 60, 65, 75, 85, GRACE - 5]


async def untouched(db, monitor, node, departures):
    assert await status_of(db, node) == "healthy"
    assert await model_rows(db, node) == 1
    assert monitor.last_report.marked_offline == [] == monitor.last_report.marked_unhealthy
    assert departures.calls == []


def test_the_stale_threshold_is_never_shorter_than_the_grace(db, world):
    registry, fence, notifier, clock, monitor = world
    assert monitor.stale_after == GRACE  # 60 s asked for, raised to the 90 s grace
    longer = HealthMonitor(db, registry, fence, notifier, clock, stale_after=300, grace=GRACE)
    assert longer.stale_after == 300


@pytest_twisted.ensureDeferred
async def test_crash_nothing_acts_inside_the_grace_then_offline(db, world, departures):
    """Crash: heartbeats stop and the tunnel departs (its owner records the departure)."""
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    epoch = await connected(db, fence, node)
    await fence.release(node, REPLICA, epoch)
    for t in INSIDE_THE_GRACE:
        await heartbeat_age(db, node, t + HEARTBEAT_INTERVAL)
        await departed_ago(db, node, t)
        assert await ticks(monitor) == [True]
        await untouched(db, monitor, node, departures)
    await heartbeat_age(db, node, GRACE + 1 + HEARTBEAT_INTERVAL)
    await departed_ago(db, node, GRACE + 1)
    await ticks(monitor)
    assert await status_of(db, node) == "offline"
    assert await model_rows(db, node) == 0
    assert monitor.last_report.marked_offline == [node]
    assert departures.calls == []  # the stale branch evicts through mark_offline, not the notifier


@pytest_twisted.ensureDeferred
async def test_freeze_nothing_acts_inside_the_grace_then_offline_then_back(db, world, departures):
    """Freeze: heartbeats stop while the tunnel stays attached (presence connected)."""
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    await connected(db, fence, node)
    for t in INSIDE_THE_GRACE:
        if t + HEARTBEAT_INTERVAL > GRACE:
            break
        await heartbeat_age(db, node, t + HEARTBEAT_INTERVAL)
        await ticks(monitor)
        assert (await fence.presence(node, GRACE)).presence.value == "connected"
        await untouched(db, monitor, node, departures)
    await heartbeat_age(db, node, GRACE + 1)
    await ticks(monitor)
    assert await status_of(db, node) == "offline"
    assert await model_rows(db, node) == 0
    # it thaws: the next heartbeat and the attached tunnel bring it back
    await registry.heartbeat(node)
    await ticks(monitor)
    assert await status_of(db, node) == "healthy"
    assert departures.calls == []


@pytest_twisted.ensureDeferred
async def test_partition_healed_inside_the_grace_leaves_no_trace(db, world, departures):
    """Partition: heartbeats stop and the tunnel departs; the worker is back before the grace
    ends, heartbeating and re-homed."""
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    epoch = await connected(db, fence, node)
    await fence.release(node, REPLICA, epoch)
    for t in INSIDE_THE_GRACE:
        await heartbeat_age(db, node, t + HEARTBEAT_INTERVAL)
        await departed_ago(db, node, t)
        await ticks(monitor)
        await untouched(db, monitor, node, departures)
    await registry.heartbeat(node)
    await connected(db, fence, node)
    await ticks(monitor, 2)
    await untouched(db, monitor, node, departures)


@pytest_twisted.ensureDeferred
async def test_partition_longer_than_the_grace_goes_offline_then_comes_back(db, world,
                                                                          departures):
    registry, fence, notifier, clock, monitor = world
    node = await register(registry)
    await add_model(db, node)
    epoch = await connected(db, fence, node)
    await fence.release(node, REPLICA, epoch)
    await heartbeat_age(db, node, GRACE - 5 + HEARTBEAT_INTERVAL)  # stale: past the grace
    await departed_ago(db, node, GRACE - 5)                        # but the tunnel is not
    await ticks(monitor)
    await untouched(db, monitor, node, departures)
    await heartbeat_age(db, node, GRACE + 10 + HEARTBEAT_INTERVAL)
    await departed_ago(db, node, GRACE + 10)
    await ticks(monitor)
    assert await status_of(db, node) == "offline" and await model_rows(db, node) == 0
    await registry.heartbeat(node)
    await connected(db, fence, node)
    await ticks(monitor)
    assert await status_of(db, node) == "healthy"
    assert departures.calls == []




@pytest_twisted.ensureDeferred
async def test_a_pass_reads_presence_in_batches_not_per_node(db, world, departures, monkeypatch):
    """One statement per PRESENCE_BATCH nodes (4000 nodes were 4000 statements every 15 s),
    with the same outcomes as reading one node at a time."""
    from localai_tw.cluster import health

    registry, fence, notifier, clock, monitor = world
    monkeypatch.setattr(health, "PRESENCE_BATCH", 2)
    connected_node = await register(registry, "w1")
    await connected(db, fence, connected_node)
    gone = await register(registry, "w2")
    await departed_ago(db, gone, GRACE + 5)
    unknown = await register(registry, "w3")  # registered, never dialled: no connection row
    batches = []
    real = fence.connections

    async def counted(node_ids, grace=None):
        batches.append(list(node_ids))
        return await real(node_ids, grace)

    async def per_node(*args):
        raise AssertionError("presence read one node at a time")

    monkeypatch.setattr(fence, "connections", counted)
    monkeypatch.setattr(fence, "presence", per_node)
    await ticks(monitor)
    assert sorted(len(b) for b in batches) == [1, 2]
    report = monitor.last_report
    assert report.presence == {"connected": 1, "gone": 1, "unknown": 1}
    assert report.marked_unhealthy == [gone] and departures.calls == [gone]
    assert await status_of(db, connected_node) == "healthy"
    assert await status_of(db, unknown) == "healthy"  # unknown: nobody acts
