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


async def offline_by_the_health_monitor(frontend, node: str) -> None:
    """The grace passes for a worker whose tunnel left: the health monitor's own pass marks it
    offline, clearing its rows (heartbeat and departure ages set in SQL, as in
    ``test_health_monitor.py``)."""
    db = frontend.replica.db
    grace = frontend.replica.health.grace
    await db.runOperation("UPDATE backend_nodes SET last_heartbeat = now() - make_interval("
                          "secs => %s) WHERE id = %s", (grace + 60, node))
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
    frontend = await cluster.frontend("replica-a")
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
