"""``/api/traces`` of a real replica after real requests: a chat served by a real worker with
the ``echo`` backend through the tunnel this replica holds, and a chat for an unknown model;
the admin key is required, the newest request comes first, no prompt text is kept."""

from __future__ import annotations

import json

import pytest_twisted
import treq

from .inference_harness import ADMIN
from .test_metrics import WEIGHTS, echo_model, post


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
