"""``/metrics`` of real replicas after real requests: two ``FrontendService`` replicas on the
test's database, one real worker (tunnel held by replica A) with the ``echo`` backend.  A chat
and an embeddings request on A go through the tunnel A holds (``path="owner"``), a streamed
chat on B is relayed through A (``path="relay"``), a model whose backend does not exist fails
its cold load (a worker answer).  The scrapes are parsed with ``prometheus_client.parser``."""

from __future__ import annotations

import pytest_twisted
import treq
from twisted.internet import defer
from prometheus_client.parser import text_string_to_metric_families

from localai_tw.db.pool import LOCK_HEALTH_CHECK

from .harness_echo import WEIGHTS, echo_model, post
from .inference_harness import ADMIN


async def scrape(base: str, key: str | None = ADMIN, path: str = "/metrics"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = await treq.get(base + path, headers=headers)
    return response, (await treq.content(response)).decode("utf-8")


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of the exposition, keyed by (sample name, labels)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found, name: str, **labels) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


@pytest_twisted.ensureDeferred
async def test_metrics_count_requests_paths_tokens_loads_and_errors(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", echo_model("echo-chat"))
    cluster.write_model("broken.yaml", echo_model("broken", backend="no-such-backend"))
    a = await cluster.frontend("replica-ma")
    b = await cluster.frontend("replica-mb")
    worker = await cluster.worker("w-metrics", a)
    base_a, base_b = cluster.base_url(a), cluster.base_url(b)
    _, text = await scrape(base_a)
    before = samples(text)

    code, _ = await post(base_a + "/v1/chat/completions", {
        "model": "echo-chat", "messages": [{"role": "user", "content": "one two three"}]})
    assert code == 200
    code, _ = await post(base_a + "/v1/embeddings", {"model": "echo-chat", "input": ["x y"]})
    assert code == 200
    code, streamed = await post(base_b + "/v1/chat/completions", {
        "model": "echo-chat", "stream": True,
        "messages": [{"role": "user", "content": "four five"}]})
    assert code == 200 and b"[DONE]" in streamed
    code, _ = await post(base_a + "/v1/chat/completions", {
        "model": "broken", "messages": [{"role": "user", "content": "x"}]})
    assert code >= 500
    code, _ = await post(base_a + "/v1/chat/completions", {
        "model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert code == 404
    refused = await treq.get(base_a + "/v1/models", headers={"Authorization": "Bearer sk-no"})
    assert refused.code == 401
    await treq.content(refused)

    assert "localai_nodes" not in text  # no health pass ran yet: no counts to show

    async def ticks_of_a_while_b_holds_the_health_lock():
        for _ in range(3):
            assert not await a.replica.health.tick()
        return samples((await scrape(base_a))[1])

    async def while_b_holds_the_health_lock():
        held, result = await b.database_service.database.tryWithAdvisoryLock(
            LOCK_HEALTH_CHECK, lambda: defer.ensureDeferred(
                ticks_of_a_while_b_holds_the_health_lock()))
        assert held
        return result

    await while_b_holds_the_health_lock()  # B won A's first ticks
    assert await a.replica.health.tick()  # then a health pass on A (it takes the lock)
    response, text = await scrape(base_a)
    assert response.code == 200
    assert response.headers.getRawHeaders("content-type")[0].startswith("text/plain")
    on_a = samples(text)
    assert value(on_a, "localai_requests_total", endpoint="chat", model="echo-chat",
                 status="200", path="owner") == 1
    assert value(on_a, "localai_requests_total", endpoint="embeddings", model="echo-chat",
                 status="200", path="owner") == 1
    # An unknown name is never a label value: clients choose it.
    assert value(on_a, "localai_requests_total", endpoint="chat", model="", status="404",
                 path="none") == 1
    assert value(on_a, "localai_requests_total", endpoint="models", model="", status="401",
                 path="none") == 1
    assert value(on_a, "localai_tokens_total", model="echo-chat", direction="in") >= 3
    assert value(on_a, "localai_tokens_total", model="echo-chat", direction="out") == 3
    assert value(on_a, "localai_request_duration_seconds_count", endpoint="chat",
                 model="echo-chat") == 1
    assert value(on_a, "localai_cold_loads_total", model="echo-chat", outcome="ok") == 1
    assert value(on_a, "localai_cold_load_duration_seconds_count", model="echo-chat") == 1
    assert value(on_a, "localai_cold_loads_total", model="broken", outcome="failed") == 1
    assert value(on_a, "localai_errors_total", endpoint="chat", condition="worker-answer") == 1
    assert value(on_a, "localai_tunnels_held") == 1
    assert value(on_a, "localai_nodes", status="healthy") == 1
    assert value(on_a, "localai_node_presence", presence="connected") == 1
    # The tunnel carried the requests (the embeddings vectors came back through it) and the
    # relay link carried B's stream.
    for direction in ("in", "out"):
        grew = value(on_a, "localai_tunnel_bytes_total", direction=direction) - \
            value(before, "localai_tunnel_bytes_total", direction=direction)
        assert grew > 1000, direction
        assert value(on_a, "localai_relay_bytes_total", direction=direction) > 0, direction

    _, text = await scrape(base_b)
    on_b = samples(text)
    assert value(on_b, "localai_requests_total", endpoint="chat", model="echo-chat",
                 status="200", path="relay") == 1
    assert value(on_b, "localai_time_to_first_token_seconds_count", endpoint="chat",
                 model="echo-chat") == 1
    assert value(on_b, "localai_tokens_total", model="echo-chat", direction="out") == 2
    assert value(on_b, "localai_tunnels_held") == 0
    assert value(on_b, "localai_nodes", status="healthy") == 0  # B ran no pass

    # While another replica wins the health lock, A's own last pass ages out of its metrics.
    aged = await while_b_holds_the_health_lock()
    assert value(aged, "localai_nodes", status="healthy") == 0
    assert value(on_b, "localai_tunnel_bytes_total", direction="in") == 0
    assert value(on_b, "localai_relay_bytes_total", direction="in") > 0
    assert value(on_b, "localai_relay_bytes_total", direction="out") > 0
    # The worker's own metrics, through its tunnel on A and relayed by B, by id or by name.
    for base, node in ((base_a, worker.node_id), (base_b, "w-metrics")):
        response = await treq.get(f"{base}/api/nodes/{node}/metrics",
                                  headers={"Authorization": f"Bearer {ADMIN}"})
        assert response.code == 200, base
        assert response.headers.getRawHeaders("content-type")[0].startswith("text/plain")
        of_worker = samples((await treq.content(response)).decode())
        assert value(of_worker, "localai_worker_tunnel_connected") == 1
        assert value(of_worker, "localai_worker_tunnel_streams_open") >= 1  # this very call
        assert value(of_worker, "localai_worker_tunnel_bytes_total", direction="out") > 1000
    response = await treq.get(f"{base_a}/api/nodes/{worker.node_id}/metrics")
    assert response.code == 401
    response = await treq.get(f"{base_a}/api/nodes/no-such-node/metrics",
                              headers={"Authorization": f"Bearer {ADMIN}"})
    assert response.code == 404
    # The rest of /api/nodes is still there.
    response = await treq.get(f"{base_a}/api/nodes/{worker.node_id}",
                              headers={"Authorization": f"Bearer {ADMIN}"})
    assert response.code == 200
    assert (await treq.json_content(response))["name"] == "w-metrics"
    # Every worker A holds, gathered in one scrape, each sample labelled with its node.
    response, text = await scrape(base_a, path="/metrics/workers")
    assert response.code == 200
    gathered = samples(text)
    assert value(gathered, "localai_worker_scrape_ok", node=worker.node_id) == 1
    assert value(gathered, "localai_worker_tunnel_connected", node=worker.node_id) == 1
    _, text = await scrape(base_b, path="/metrics/workers")
    assert not any(name.startswith("localai_worker_tunnel") for name, _ in samples(text))
    # Each replica has its own registry: A's requests are not counted on B.
    assert value(on_b, "localai_requests_total", endpoint="embeddings", model="echo-chat",
                 status="200", path="owner") == 0


@pytest_twisted.ensureDeferred
async def test_metrics_follow_the_admin_api_key(cluster):
    frontend = await cluster.frontend("replica-mk")
    base = cluster.base_url(frontend)
    for key in (None, "sk-wrong"):
        for path in ("/metrics", "/metrics/workers"):
            response, text = await scrape(base, key, path)
            assert response.code == 401, (key, path)
            assert "localai_" not in text
    response, text = await scrape(base, ADMIN)
    assert response.code == 200
    assert any(f.name == "localai_requests" for f in text_string_to_metric_families(text))


@pytest_twisted.ensureDeferred
async def test_metrics_are_closed_without_an_api_key(cluster):
    """Like the admin API: no --api-key configured means nobody reads /metrics."""
    frontend = await cluster.frontend("replica-mn", **{"api-key": []})
    response, _ = await scrape(cluster.base_url(frontend), None)
    assert response.code == 401


@pytest_twisted.ensureDeferred
async def test_bus_and_claim_counters_reach_the_exposition(db):
    """The collectors of a PgBus and a ClaimConsumer (not wired into the frontend yet) read
    the counters those keep: published inline and spilled, claims by outcome."""
    from localai_tw.bus.claims import ClaimConsumer, ClaimQueue
    from localai_tw.bus.pgbus import PgBus
    from localai_tw.errors import TransportFailure
    from localai_tw.metrics import ReplicaMetrics, exposition

    from .support import eventually
    from .harness_claims import make_live

    bus = PgBus(db, health_interval=0.5)
    bus.startService()
    queue = ClaimQueue(db)
    await make_live(db, "r-metrics")

    async def handler(claim):
        if claim.payload == b"transport":
            raise TransportFailure("reset under a live copy")
        return "done"

    consumer = ClaimConsumer(queue, "r-metrics", ["task"], handler, poll_interval=0.2)
    try:
        await bus.whenConnected()
        metrics = ReplicaMetrics()
        metrics.watch_bus(bus, [consumer])
        await bus.publish("jobs.j1.result", "small")
        await bus.publish("jobs.j1.result", "x" * 9000)
        await queue.enqueue("task", b"ok")
        await queue.enqueue("task", b"transport")
        consumer.startService()
        await eventually(lambda: consumer.stats["claimed"] == 2 and consumer.inFlight == 0,
                         what="two claims settled")
        found = samples(exposition(metrics.registry).decode())
        assert value(found, "localai_bus_messages_published_total", how="inline") == 1
        assert value(found, "localai_bus_messages_published_total", how="spilled") == 1
        assert value(found, "localai_bus_messages_dropped_total", stage="subscriber") == 0
        assert value(found, "localai_claims_total", outcome="claimed") == 2
        assert value(found, "localai_claims_total", outcome="completed") == 1
        assert value(found, "localai_claims_total", outcome="released") == 1  # the backoff
        assert value(found, "localai_claims_in_flight") == 0
    finally:
        if consumer.running:
            await consumer.stopService()
        await bus.stopService()
