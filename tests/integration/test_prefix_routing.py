"""Prefix-cache-aware routing across replicas, against real PostgreSQL (the bus), real tunnels
and two real echo workers: a conversation whose first turn replica A served goes, at its next
turn through replica B, to the same worker; and the load guard sends a hot prefix elsewhere
once the warm worker runs too many calls, counting it as forced away."""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import defer, reactor
from twisted.web.client import HTTPConnectionPool

from localai_tw.backends import backend_pb2

from .inference_harness import ADMIN
from .support import eventually

SYSTEM = "You are a patient assistant who answers in one short sentence. " * 30  # ~1.9 KB


async def schedule(cluster, frontend, **row) -> None:
    pool = HTTPConnectionPool(reactor, persistent=False)
    try:
        response = await treq.post(
            f"{cluster.base_url(frontend)}/api/nodes/scheduling", pool=pool,
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
            data=json.dumps(row).encode())
        assert response.code == 200, await treq.content(response)
        await treq.content(response)
    finally:
        await pool.closeCachedConnections()


async def two_replicas_of(cluster, model: str):
    """Replicas A and B, workers w1 (tunnel to A) and w2 (tunnel to B), ``model`` loaded on
    both workers, every replica's prefix routing hearing the bus."""
    cluster.write_model(f"{model}.yaml", f"name: {model}\nbackend: echo\n")
    a = await cluster.frontend("replica-a")
    b = await cluster.frontend("replica-b")
    w1 = await cluster.worker("w1", a)
    w2 = await cluster.worker("w2", b)
    for replica in (a, b):
        await eventually(lambda: replica.replica.prefix.live(), timeout=20,
                         what="the prefix routing subscribed")
    await schedule(cluster, a, model_name=model, min_replicas=2)
    for _ in range(2):
        await a.replica.scaler.run_once()
    assert sorted(r[0] for r in await cluster.rows(model)) == sorted([w1.node_id, w2.node_id])
    return a, b, w1, w2


def turn(*messages: str, **metadata) -> backend_pb2.PredictOptions:
    options = backend_pb2.PredictOptions(Prompt=SYSTEM + "".join(messages), Tokens=1)
    for key, value in metadata.items():
        options.Metadata[key] = value
    return options


@pytest_twisted.ensureDeferred
async def test_the_next_turn_through_another_replica_goes_to_the_same_worker(cluster):
    """Break: drop the ``prefix.pick`` branch of ``NodeChooser.loaded_placement`` (or stop
    ``PrefixRouting._received`` from applying other replicas' observations): turn 2 lands on
    a random worker, and six conversations all landing right is 1 in 64 by luck."""
    a, b, w1, w2 = await two_replicas_of(cluster, "conv")
    for k in range(6):
        history = f"user: conversation {k} begins with its own question, " * 12 + "\n"
        first = await a.replica.inference.predict("conv", turn(history))
        # what A served reaches B through PostgreSQL's fan-out
        chain = b.replica.prefix.chain_for(b.replica.inference.model("conv"), turn(history))
        await eventually(lambda: b.replica.prefix.index.matches("conv", chain).get(
            first.served_by) == len(chain), timeout=20, what="B heard of turn 1")
        second = await b.replica.inference.predict(
            "conv", turn(history, f"assistant: {first.value.message.decode()}\n",
                         f"user: and a follow-up {k}\n"))
        assert second.served_by == first.served_by, f"conversation {k}"
        third = await a.replica.inference.predict(
            "conv", turn(history, f"assistant: {first.value.message.decode()}\n",
                         f"user: and a follow-up {k}\n", "assistant: ok\n", "user: more\n"))
        assert third.served_by == first.served_by, f"conversation {k}"


@pytest_twisted.ensureDeferred
async def test_the_load_guard_spreads_a_hot_prefix_and_counts_it(cluster):
    """Break: make ``prefix_index.eligible`` return every node (no guard): the second call
    queues behind the slow one on the warm worker, and nothing is counted as forced away."""
    a, b, w1, w2 = await two_replicas_of(cluster, "hot")
    hot = "user: the same popular question everybody asks, " * 12 + "\n"
    warm = (await a.replica.inference.predict("hot", turn(hot))).served_by
    other = w2.node_id if warm == w1.node_id else w1.node_id
    use = a.replica.use
    # one slow call of A on the warm worker...
    slow = a.replica.inference.predict("hot", turn(hot, **{"echo.delay_ms": "20000"}))
    await eventually(lambda: use.in_flight(warm, "hot") == 1, timeout=15,
                     what="a call on the warm worker")
    assert use.in_flight(other, "hot") == 0
    # ...so the next one with the same prefix goes to the idle worker: forced away
    spread = await a.replica.inference.predict("hot", turn(hot))
    assert spread.served_by == other
    # (the replica scaler read the pressure at that call and reset it: max_replicas is not
    # set, so it loaded nothing)
    metrics = a.replica.metrics.registry.get_sample_value(
        "localai_prefix_routes_total", {"model": "hot", "outcome": "forced-away"})
    assert metrics == 1.0
    slow.cancel()
    await defer.DeferredList([slow], consumeErrors=True)
