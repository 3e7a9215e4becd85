"""Placement around nodes that cannot be reached: a registered, heartbeating node that never
dials does not win cold loads, a cold load that meets a routing fact moves on to the next node,
and ``/api/nodes`` says which node never connected.  Nothing is acted on for the node left
behind: its status and its rows stay as they were."""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.web.client import HTTPConnectionPool

from localai_tw.backends import backend_pb2

from .inference_harness import ADMIN, TOKEN
from .support import eventually

COLD_LOADS = 10


def write_models(cluster, count: int) -> list[str]:
    names = [f"cold-{i}" for i in range(count)]
    for name in names:
        cluster.write_model(f"{name}.yaml", f"name: {name}\nbackend: echo\n")
    return names


async def ghost_node(frontend, name: str = "ghost") -> str:
    """A node that registers and heartbeats like a worker but never opens its tunnel."""
    registration = await frontend.replica.nodes.register(name, presented_token=TOKEN)
    await frontend.replica.nodes.heartbeat(registration.node.id)
    assert (await frontend.replica.nodes.get_node(registration.node.id)).status.value == "healthy"
    return registration.node.id


def count_starts(frontend) -> list[str]:
    """The node of every ``backend.start`` this replica sends."""
    starts: list[str] = []
    original = frontend.replica.control.call

    def counting(node_id, verb, body=None, **kw):
        if verb == "backend.start":
            starts.append(node_id)
        return original(node_id, verb, body, **kw)

    frontend.replica.control.call = counting
    return starts


async def api_nodes(cluster, frontend) -> dict[str, dict]:
    pool = HTTPConnectionPool(reactor, persistent=False)
    try:
        response = await treq.get(f"{cluster.base_url(frontend)}/api/nodes", pool=pool,
                                  headers={"Authorization": f"Bearer {ADMIN}"})
        assert response.code == 200
        body = json.loads(await treq.content(response))
    finally:
        await pool.closeCachedConnections()
    return {n["id"]: n for n in body["nodes"]}


@pytest_twisted.ensureDeferred
async def test_a_node_that_never_dials_does_not_win_cold_loads(cluster):
    names = write_models(cluster, COLD_LOADS)
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("real", frontend)
    ghost = await ghost_node(frontend)
    starts = count_starts(frontend)

    # Every cold load is a new model: the ghost holds none, the worker one more each time, so
    # "fewest models first" alone would send every load after the first to the ghost.
    for name in names:
        served = await frontend.replica.inference.predict(name, backend_pb2.PredictOptions(Prompt=name))
        assert served.value.message == name.encode() and served.served_by == worker.node_id
    # connected nodes come first: the ghost was not even tried
    assert starts == [worker.node_id] * COLD_LOADS

    nodes = await api_nodes(cluster, frontend)
    assert nodes[ghost]["never_connected"] is True and nodes[ghost]["presence"] == "unknown"
    assert nodes[worker.node_id]["never_connected"] is False
    assert nodes[worker.node_id]["presence"] == "connected"
    # nothing was acted on for the ghost
    assert nodes[ghost]["status"] == "healthy" and nodes[ghost]["models"] == []


@pytest_twisted.ensureDeferred
async def test_a_cold_load_that_meets_a_routing_fact_tries_the_next_node(cluster):
    names = write_models(cluster, COLD_LOADS)
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("real", frontend)
    ghost = await ghost_node(frontend)
    # A stale claim: the database says this (live) replica holds the ghost's tunnel, so it
    # looks connected, but no session is held here -> every dial to it is a routing fact.
    await frontend.replica.fence.claim(ghost, "replica-a")
    starts = count_starts(frontend)

    for name in names:
        served = await frontend.replica.inference.predict(name, backend_pb2.PredictOptions(Prompt=name))
        assert served.value.message == name.encode() and served.served_by == worker.node_id
    assert starts.count(worker.node_id) == COLD_LOADS
    assert ghost in starts  # it was picked (it holds fewer models) and skipped
    # skipping acted on nothing: the ghost is still healthy, still "connected", holds no rows
    ghost_node_now = await frontend.replica.nodes.get_node(ghost)
    assert ghost_node_now.status.value == "healthy"
    assert [r for r in await cluster.rows() if r[0] == ghost] == []


async def presence_of(frontend, node_id: str, expected: str) -> bool:
    return (await frontend.replica.fence.presence(node_id)).presence.value == expected


@pytest_twisted.ensureDeferred
async def test_a_model_on_an_absent_worker_is_served_by_another_and_its_rows_stay(cluster):
    cluster.write_model("away.yaml", "name: away\nbackend: echo\n")
    frontend = await cluster.frontend("replica-a")
    first = await cluster.worker("w1", frontend)
    second = await cluster.worker("w2", frontend)
    served = await frontend.replica.inference.predict("away", backend_pb2.PredictOptions(Prompt="x"))
    a, b = (first, second) if served.served_by == first.node_id else (second, first)
    [row_on_a] = await cluster.rows("away")
    assert row_on_a[0] == a.node_id and row_on_a[2] == "loaded"

    # A's tunnel goes away (its heartbeats go on): presence "reconnecting", within the grace.
    await a.dialer.stopService()
    await eventually(lambda: not frontend.replica.tunnels.holds(a.node_id), timeout=20,
                     what="A detached")
    await eventually(lambda: presence_of(frontend, a.node_id, "reconnecting"), timeout=20,
                     what="A reconnecting")

    started = reactor.seconds()
    served = await frontend.replica.inference.predict(
        "away", backend_pb2.PredictOptions(Prompt="from b"), deadline=reactor.seconds() + 30)
    assert served.value.message == b"from b" and served.served_by == b.node_id
    assert reactor.seconds() - started < 10  # a cold load on B, not a wait for A
    # and the next one goes straight to B, now loaded there
    again = await frontend.replica.inference.predict("away", backend_pb2.PredictOptions(Prompt="again"))
    assert again.served_by == b.node_id

    # the absent worker's rows were not touched, nor its status
    rows = await cluster.rows("away")
    assert row_on_a in rows
    assert [(r[0], r[2]) for r in rows if r[0] == b.node_id] == [(b.node_id, "loaded")]
    assert (await frontend.replica.nodes.get_node(a.node_id)).status.value == "healthy"
