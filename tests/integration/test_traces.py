"""``/api/traces`` of a real replica after real requests: a chat served by a real worker with
the ``echo`` backend through the tunnel this replica holds, and a chat for an unknown model;
the admin key is required, the newest request comes first, no prompt text is kept; the time
in each hop through a relaying replica, and the bytes a cold load staged."""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import defer

from localai_tw.metrics import HOPS

from .inference_harness import ADMIN, sha256_hex
from .harness_echo import WEIGHTS, echo_model, post


@pytest_twisted.ensureDeferred
async def test_traces_list_recent_requests_newest_first_without_prompts(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", echo_model("echo-chat"))
    frontend = await cluster.frontend("replica-tr")
    worker = await cluster.worker("w-traces", frontend)
    base = cluster.base_url(frontend)

    code, _ = await post(base + "/v1/chat/completions", {
        "model": "echo-chat", "messages": [{"role": "user", "content": "secret words"}]})
    assert code == 200
    code, _ = await post(base + "/v1/chat/completions", {
        "model": "no-such-model", "messages": [{"role": "user", "content": "secret too"}]})
    assert code == 404

    refused = await treq.get(base + "/api/traces")
    assert refused.code == 401
    await treq.content(refused)
    bad = await treq.get(base + "/api/traces?limit=0",
                         headers={"Authorization": f"Bearer {ADMIN}"})
    assert bad.code == 400
    await treq.content(bad)
    answer = await treq.get(base + "/api/traces?limit=5",
                            headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.code == 200
    raw = await treq.content(answer)
    assert b"secret" not in raw
    traces = json.loads(raw)["traces"]
    failed, served = traces[0], traces[1]
    assert failed["endpoint"] == "chat" and failed["status"] == "404"
    assert failed["condition"] == "model_not_found" and failed["path"] == "none"
    assert served["model"] == "echo-chat" and served["status"] == "200"
    assert served["nodes"] == [worker.node_id] and served["path"] == "owner"
    assert served["condition"] is None and served["seconds"] > 0
    assert served["completion_tokens"] == 2


BIG = bytes(range(256)) * (12 * 1024)  # 3 MiB: staging it takes many chunks


@pytest_twisted.ensureDeferred
async def test_hops_through_a_relaying_replica_and_the_bytes_staged(cluster):
    """Replica A holds the worker's tunnel; replica B serves through the relay.  B's first
    request cold-loads the model (its trace has a cold-load hop with its phases, and while the
    load waits at the end of staging, ``/api/cluster/loads`` shows every byte staged); B's
    next request is warm (no queue, no cold load; a backend hop and, streamed, its first
    token); A's first request opens A's own stream to that backend (a tunnel hop), and a third
    replica's first request opens one through the relay.  The hops never add up to more than
    the request took."""
    cluster.write_file("echo.bin", BIG)
    cluster.write_model("echo.yaml", echo_model("echo-chat").replace(
        sha256_hex(WEIGHTS), sha256_hex(BIG)))
    a = await cluster.frontend("replica-ha")
    b = await cluster.frontend("replica-hb")
    await cluster.worker("w-hops", a)
    base_b = cluster.base_url(b)
    admin = {"Authorization": f"Bearer {ADMIN}"}

    # Hold B's load where staging ends (before the ``loading`` phase is recorded).
    loads = b.replica.inference.loads
    staged, release = defer.Deferred(), defer.Deferred()
    progress = loads._progress

    async def held(model_name, attempt, phase=None, node_id=None):
        if phase == "loading":
            staged.callback(None)
            await release
        await progress(model_name, attempt, phase, node_id)
    loads._progress = held

    cold = defer.ensureDeferred(post(base_b + "/v1/chat/completions", {
        "model": "echo-chat", "messages": [{"role": "user", "content": "one two"}]}))
    await staged
    answer = await treq.get(base_b + "/api/cluster/loads", headers=admin)
    [load] = json.loads(await treq.content(answer))["loads"]
    assert load["phase"] == "staging" and load["replica"] == "replica-hb"
    assert load["staging"]["staged_bytes"] == load["staging"]["total_bytes"] == len(BIG)
    assert load["staging"]["files"] == 1 and load["staging"]["bytes_per_second"] > 0
    # Another replica does not know the bytes (they are the driving replica's).
    answer = await treq.get(cluster.base_url(a) + "/api/cluster/loads", headers=admin)
    [elsewhere] = json.loads(await treq.content(answer))["loads"]
    assert elsewhere["staging"] is None
    release.callback(None)
    code, _ = await cold
    assert code == 200
    code, streamed = await post(base_b + "/v1/chat/completions", {
        "model": "echo-chat", "stream": True, "messages": [{"role": "user", "content": "x y"}]})
    assert code == 200 and b"[DONE]" in streamed

    answer = await treq.get(base_b + "/api/traces?limit=2", headers=admin)
    warm, first = json.loads(await treq.content(answer))["traces"]
    assert first["path"] == warm["path"] == "relay"
    hops = first["hops"]
    assert hops["cold_load"] > 0 and hops["staging"] > 0
    assert {"starting", "staging", "loading", "placement", "backend"} <= set(hops)
    assert hops["starting"] + hops["staging"] + hops["loading"] <= hops["cold_load"] + 1e-3
    assert "cold_load" not in warm["hops"] and "staging" not in warm["hops"]
    assert "queue" not in warm["hops"]
    assert warm["hops"]["backend"] > 0 and warm["hops"]["placement"] >= 0
    assert 0 <= warm["hops"]["first_token"] <= warm["hops"]["backend"]
    # A's first call to the backend B loaded opens A's own tunnel stream to it: a tunnel hop.
    code, _ = await post(cluster.base_url(a) + "/v1/chat/completions", {
        "model": "echo-chat", "messages": [{"role": "user", "content": "z"}]})
    assert code == 200
    answer = await treq.get(cluster.base_url(a) + "/api/traces?limit=1", headers=admin)
    [opened] = json.loads(await treq.content(answer))["traces"]
    assert opened["path"] == "owner" and opened["hops"]["tunnel"] > 0
    assert "cold_load" not in opened["hops"]
    # So does a third replica's, through the relay (A holds the worker's tunnel).
    c = await cluster.frontend("replica-hc")
    code, _ = await post(cluster.base_url(c) + "/v1/chat/completions", {
        "model": "echo-chat", "messages": [{"role": "user", "content": "z"}]})
    assert code == 200
    answer = await treq.get(cluster.base_url(c) + "/api/traces?limit=1", headers=admin)
    [relayed] = json.loads(await treq.content(answer))["traces"]
    assert relayed["path"] == "relay" and relayed["hops"]["tunnel"] > 0
    assert "cold_load" not in relayed["hops"]
    for trace in (first, warm, opened, relayed):
        passed = sum(trace["hops"].get(h, 0) for h in HOPS)
        assert passed <= trace["seconds"] + 1e-3, trace
