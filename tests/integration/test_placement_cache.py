"""The warm path's placement cache against real PostgreSQL, real replicas and real tunnels: a
warm request reads no placement from the database; a worker departure announced by one
replica (its health pass) reaches another replica's cache through the bus, so that replica's
next request does not even try the departed node; and a new pin written at one replica
applies at once at another."""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.web.client import HTTPConnectionPool

from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.placement import _CANDIDATES_SQL

from .inference_harness import ADMIN
from .support import eventually


def record_placement_reads(frontend) -> list[str]:
    """Every placement read (the scheduling row, the candidate query) this replica's chooser
    sends to its ``Database`` from now on."""
    db = frontend.replica.inference.chooser._db
    assert db is frontend.replica.db
    seen: list[str] = []
    original = db.runQuery

    def counting(sql, *args, **kw):
        if sql == _CANDIDATES_SQL or "FROM model_scheduling_configs" in sql:
            seen.append(sql)
        return original(sql, *args, **kw)

    db.runQuery = counting
    return seen


def record_dials(frontend) -> list[str]:
    """The node of every gRPC client the router asks for (one per attempt)."""
    tried: list[str] = []
    clients = frontend.replica.backend_clients
    original = clients.client

    def recording(node_id, port):
        tried.append(node_id)
        return original(node_id, port)

    clients.client = recording
    return tried


@pytest_twisted.ensureDeferred
async def test_a_warm_request_reads_no_placement_from_the_database(cluster):
    cluster.write_model("warm.yaml", "name: warm\nbackend: echo\n")
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    await eventually(lambda: frontend.replica.placements.live(), timeout=20,
                     what="the placement fan-out subscribed")
    # Far longer than the test: the 2 s TTL runs on the real clock, and under load 21 requests
    # can outlast it (one legitimate read, seen once in a loaded full run). Expiry by TTL is
    # tests/unit/test_placement_cache.py's, on a task.Clock; this test is about warm requests.
    frontend.replica.placements.cache.ttl = 3600.0
    reads = record_placement_reads(frontend)
    inference = frontend.replica.inference

    cold = await inference.predict("warm", backend_pb2.PredictOptions(Prompt="cold"))
    assert cold.served_by == worker.node_id
    assert reads  # the cold path read (and loaded)
    del reads[:]
    await inference.predict("warm", backend_pb2.PredictOptions(Prompt="fill"))  # fills
    del reads[:]
    for i in range(20):
        served = await inference.predict("warm", backend_pb2.PredictOptions(Prompt=f"w{i}"))
        assert served.value.message == f"w{i}".encode() and served.served_by == worker.node_id
    assert reads == []  # warm: no placement statement at all

    # A change of the model's scheduling row drops the entry: the next request reads again.
    frontend.replica.placements.model_changed("warm")
    await inference.predict("warm", backend_pb2.PredictOptions(Prompt="after"))
    assert len(reads) == 2


@pytest_twisted.ensureDeferred
async def test_a_departure_seen_by_one_replica_reaches_the_others_cache(cluster):
    cluster.write_model("moved.yaml", "name: moved\nbackend: echo\n")
    owner = await cluster.frontend("replica-a", **{"reconnect-grace": 1.0})
    other = await cluster.frontend("replica-b", **{"reconnect-grace": 1.0})
    first = await cluster.worker("w1", owner)
    second = await cluster.worker("w2", owner)
    for replica in (owner, other):
        await eventually(lambda: replica.replica.placements.live(), timeout=20,
                         what="the placement fan-out subscribed")
    # Far longer than the test: only an invalidation can drop the entry, never the TTL.
    other.replica.placements.cache.ttl = 3600.0
    # Only the owner runs health passes here, so the other replica can learn of the departure
    # from the bus alone (not from a pass of its own).
    await other.replica.health.stopService()

    served = await other.replica.inference.predict("moved", backend_pb2.PredictOptions(Prompt="x"))
    gone, stays = (first, second) if served.served_by == first.node_id else (second, first)
    await other.replica.inference.predict("moved", backend_pb2.PredictOptions(Prompt="warm"))
    assert len(other.replica.placements.cache) == 1  # warm at the relaying replica

    # The worker's tunnel goes and stays away past the grace; its heartbeats go on.  The
    # owner's health pass finds it gone (unhealthy, status only; rows kept) and announces it.
    await gone.dialer.stopService()
    await eventually(lambda: not owner.replica.tunnels.holds(gone.node_id), timeout=20,
                     what="the tunnel detached")

    async def announced():
        await owner.replica.health.tick()
        return owner.replica.notifier.is_departed(gone.node_id)

    await eventually(announced, timeout=30, what="the departure announced by the owner")
    # The other replica learns it through PostgreSQL's fan-out only.
    await eventually(lambda: len(other.replica.placements.cache) == 0, timeout=20,
                     what="the other replica's entry dropped")

    tried = record_dials(other)
    again = await other.replica.inference.predict(
        "moved", backend_pb2.PredictOptions(Prompt="after"), deadline=reactor.seconds() + 60)
    assert again.value.message == b"after" and again.served_by == stays.node_id
    assert gone.node_id not in tried  # not even tried: no dial to the departed node
    # the cache acted on nothing: the departed node's rows are still there
    assert [r[0] for r in await cluster.rows("moved") if r[0] == gone.node_id] == [gone.node_id]


async def pin(cluster, frontend, model: str, selector: dict) -> None:
    pool = HTTPConnectionPool(reactor, persistent=False)
    try:
        response = await treq.post(
            f"{cluster.base_url(frontend)}/api/nodes/scheduling", pool=pool,
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
            data=json.dumps({"model_name": model, "node_selector": selector}).encode())
        assert response.code == 200, await treq.content(response)
        await treq.content(response)
    finally:
        await pool.closeCachedConnections()


@pytest_twisted.ensureDeferred
async def test_a_new_pin_at_one_replica_applies_at_once_at_another(cluster):
    cluster.write_model("pinned.yaml", "name: pinned\nbackend: echo\n")
    owner = await cluster.frontend("replica-a")
    other = await cluster.frontend("replica-b")
    one = await cluster.worker("w1", owner, labels={"slot": "one"})
    two = await cluster.worker("w2", owner, labels={"slot": "two"})
    for replica in (owner, other):
        await eventually(lambda: replica.replica.placements.live(), timeout=20,
                         what="the placement fan-out subscribed")
    other.replica.placements.cache.ttl = 3600.0  # only an invalidation drops the entry

    await pin(cluster, owner, "pinned", {"slot": "one"})
    for prompt in ("load", "warm"):
        served = await other.replica.inference.predict(
            "pinned", backend_pb2.PredictOptions(Prompt=prompt))
        assert served.served_by == one.node_id
    assert len(other.replica.placements.cache) == 1

    await pin(cluster, owner, "pinned", {"slot": "two"})  # written at the owner
    await eventually(lambda: len(other.replica.placements.cache) == 0, timeout=20,
                     what="the other replica's entry dropped")
    moved = await other.replica.inference.predict(
        "pinned", backend_pb2.PredictOptions(Prompt="moved"), deadline=reactor.seconds() + 60)
    assert moved.value.message == b"moved" and moved.served_by == two.node_id
