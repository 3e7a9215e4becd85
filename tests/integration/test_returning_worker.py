"""What a worker fault leaves behind (issue 26 §1, §2), with a real tunnel, real backend
processes and a real PostgreSQL:

- a dead worker's backend channel does not redial on its own, and is closed once no placement
  names it (the placement sweep, ``frontend/inference/channels.py``);
- a worker that comes back after ``offline`` (its tunnel only, no registration) has its
  orphan backend processes stopped, and one whose rows survived has them adopted
  (``frontend/inference/reconcile.py``).

The windows in which nothing may happen are bounded real time (grpcio redials on its own
clock, once a second here): a count of zero, never a duration, is asserted."""

from __future__ import annotations

import pytest_twisted

from localai_tw import errors
from localai_tw.backends import backend_pb2
from localai_tw.worker.service import HEARTBEAT_INTERVAL_SECONDS

from .inference_harness import supervisor_of
from .support import eventually, failure_of, sleep

#: Seconds watched for redials: grpcio redials a failed channel every second here.
WINDOW = 3.0


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def loaded(cluster, frontend, model: str):
    served = await frontend.replica.inference.predict(model, backend_pb2.PredictOptions(
        Prompt="hello"))
    assert served.value.message == b"hello"
    [(node, _, state, address, _)] = await cluster.rows(model)
    assert state == "loaded"
    return node, port_of(address)


async def offline_by_the_health_monitor(frontend, node: str, *, tunnel_left=True) -> None:
    """The grace passes for a worker whose tunnel left: the health monitor's own pass marks it
    offline, clearing its rows (heartbeat and departure ages set in SQL, as in
    ``test_health_monitor.py``)."""
    db = frontend.replica.db
    grace = frontend.replica.health.grace
    await db.runOperation("UPDATE backend_nodes SET last_heartbeat = now() - make_interval("
                          "secs => %s) WHERE id = %s", (grace + 60, node))
    if tunnel_left:
        await db.runOperation("UPDATE node_connections SET owner_instance_id = '',"
                              " disconnected_at = now() - make_interval(secs => %s)"
                              " WHERE node_id = %s", (grace + 30, node))
    assert await frontend.replica.health.tick() is True
    assert frontend.replica.health.last_report.marked_offline == [node]


def away(worker) -> None:
    """Heartbeats stop (the worker is frozen or partitioned; it does not register again)."""
    worker.registrar._heartbeat.stop()


def back(worker) -> None:
    worker.registrar._heartbeat.start(HEARTBEAT_INTERVAL_SECONDS, now=True)


@pytest_twisted.ensureDeferred
async def test_a_dead_workers_channel_never_redials_and_closes_with_its_placement(cluster):
    cluster.write_model("m.yaml", "name: m\nbackend: echo\n")
    # the bridged gRPC path's channel (``call`` streams hold no channel to redial)
    frontend = await cluster.frontend("replica-a", **{"backend-calls": "grpc"})
    worker = await cluster.worker("w1", frontend)
    node, port = await loaded(cluster, frontend, "m")
    clients = frontend.replica.backend_clients
    client = clients.open_clients()[(node, port)]
    bridge = client.bridge

    # The worker crashes: its backends die with it, its tunnel breaks, nobody says so.
    away(worker)
    await worker.stopService()
    await eventually(lambda: not frontend.replica.tunnels.holds(node), what="tunnel gone")
    # A call meets the dead route (a probe, a request): it fails with the route's condition.
    failed = await failure_of(client.call("Health", backend_pb2.HealthMessage()))
    assert isinstance(failed, errors.ClusterError), failed
    assert client.in_flight == 0

    # Inside the grace, with no call at all: no dial (grpcio alone redialled once a second).
    dials = bridge.dials
    await sleep(WINDOW)
    assert bridge.dials == dials, f"{bridge.dials - dials} redials with no call in flight"
    assert client.channel_resets >= 1
    # The placement still exists, so the client stays (the sweep looks twice, then keeps it).
    sweep = frontend.replica.channel_sweep
    assert await sweep.run_once() == [] and await sweep.run_once() == []
    assert (node, port) in clients.open_clients()

    # offline clears the rows: the next looks close the channel and its bridge.
    await offline_by_the_health_monitor(frontend, node)
    assert await cluster.rows("m") == []
    closed = await sweep.run_once() + await sweep.run_once()
    assert closed == [(node, port)]
    assert client.closed and bridge.closed
    assert clients.open_clients() == {} and clients.bridges.get(node, port) is None
    await sleep(WINDOW)
    assert bridge.dials == dials


@pytest_twisted.ensureDeferred
async def test_a_worker_back_after_offline_has_its_orphan_backends_stopped(cluster):
    cluster.write_model("m.yaml", "name: m\nbackend: echo\n")
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    node, port = await loaded(cluster, frontend, "m")
    supervisor = supervisor_of(worker)
    [running] = supervisor.list()
    assert running["model"] == "m"

    # A partition longer than the grace: the tunnel leaves, heartbeats stop, offline clears
    # the node's rows.  The worker is told nothing: its backend lives on.
    away(worker)
    await worker.dialer.stopService()
    await eventually(lambda: not frontend.replica.tunnels.holds(node), what="tunnel gone")
    await offline_by_the_health_monitor(frontend, node)
    assert await cluster.rows() == []
    assert [b["process_key"] for b in supervisor.list()] == [running["process_key"]]

    # The partition heals: the same registration, its tunnel back.
    frontend.replica.reconciler.last.pop(node, None)
    worker.dialer.startService()
    back(worker)
    await eventually(lambda: frontend.replica.tunnels.holds(node), timeout=20,
                     what="the tunnel back")
    # The cluster's view becomes the worker's: nothing runs, no row names anything.
    await eventually(lambda: supervisor.list() == [] and node in frontend.replica.reconciler.last,
                     timeout=20, what="the orphan backend stopped")
    report = frontend.replica.reconciler.last[node]
    assert report.error is None
    assert report.stopped == [running["process_key"]] and report.adopted == []
    assert await cluster.rows() == []
    assert (node, port) not in frontend.replica.backend_clients.open_clients()
    # ... and the model is served again the ordinary way (a cold load on the healthy node).
    async def healthy():
        await frontend.replica.health.tick()
        return (await frontend.replica.nodes.get_node(node)).status.value == "healthy"

    await eventually(healthy, timeout=20, what="the node healthy again")
    node_again, _ = await loaded(cluster, frontend, "m")
    assert node_again == node and len(supervisor.list()) == 1


@pytest_twisted.ensureDeferred
async def test_a_worker_back_inside_the_grace_keeps_its_backends(cluster):
    cluster.write_model("m.yaml", "name: m\nbackend: echo\n")
    cluster.write_model("n.yaml", "name: n\nbackend: echo\n")
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    await loaded(cluster, frontend, "m")
    node, _ = await loaded(cluster, frontend, "n")
    supervisor = supervisor_of(worker)
    keys = sorted(b["process_key"] for b in supervisor.list())

    # A short partition; meanwhile the backend of n ends on the worker (nobody is told).
    await worker.dialer.stopService()
    await eventually(lambda: not frontend.replica.tunnels.holds(node), what="tunnel gone")
    await supervisor.stop(next(k for k in keys if k.startswith("n")))
    frontend.replica.reconciler.last.pop(node, None)
    worker.dialer.startService()
    await eventually(lambda: frontend.replica.reconciler.last.get(node), timeout=20,
                     what="the returning worker reconciled")
    report = frontend.replica.reconciler.last[node]
    assert report.error is None and report.stopped == []
    assert [k.split("#")[0] for k in report.adopted] == ["m"]
    # The row of n named a backend the worker no longer runs: gone, the row of m kept.
    assert report.rows_deleted == ["n"]
    assert [(r[1], r[2]) for r in await cluster.rows()] == [("m", "loaded")]
    served = await frontend.replica.inference.predict("m", backend_pb2.PredictOptions(
        Prompt="still here"))
    assert served.value.message == b"still here"


@pytest_twisted.ensureDeferred
async def test_a_worker_whose_tunnel_stayed_has_its_orphans_stopped_when_found_back(cluster):
    """A frozen heartbeat path with the tunnel attached: no attach ever tells anyone, so the
    health pass that promotes the node from offline runs the same rule."""
    cluster.write_model("m.yaml", "name: m\nbackend: echo\n")
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    node, _ = await loaded(cluster, frontend, "m")
    supervisor = supervisor_of(worker)
    assert len(supervisor.list()) == 1

    away(worker)
    await offline_by_the_health_monitor(frontend, node, tunnel_left=False)
    assert await cluster.rows() == [] and len(supervisor.list()) == 1
    assert frontend.replica.tunnels.holds(node)
    frontend.replica.reconciler.last.pop(node, None)
    back(worker)

    async def healthy():
        await frontend.replica.health.tick()
        return (await frontend.replica.nodes.get_node(node)).status.value == "healthy"

    await eventually(healthy, timeout=20, what="the node healthy again")
    await eventually(lambda: supervisor.list() == [] and node in frontend.replica.reconciler.last,
                     timeout=20, what="the orphan backend stopped")
    assert frontend.replica.reconciler.last[node].stopped == ["m#0"]
