"""What monitoring and UIs ask a LocalAI server first (issue 24 §5), asked of a real replica
with a real worker running the ``echo`` backend: ``/version`` (anyone), ``/.well-known/
localai.json`` and ``/api/features`` (a key as for ``/v1``), ``/system`` (admin: it names the
nodes, with the backends and models each runs), ``/v1/models/{id}``, and ``GET /`` as a browser
and as an API client see it."""

from __future__ import annotations

import json

import pytest_twisted
import treq

from localai_tw import __version__
from localai_tw.backends import backend_pb2

from .harness_echo import WEIGHTS, echo_model
from .inference_harness import ADMIN

USER = "sk-discovery-user"


async def get(url: str, key: str | None = None, accept: str | None = None):
    headers = {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if accept is not None:
        headers["Accept"] = accept
    answer = await treq.get(url, headers=headers)
    raw = await answer.content()
    return answer.code, answer.headers, raw


async def scoped(cluster, name: str):
    """A replica with an inference key (USER) and an admin key (ADMIN) apart."""
    return await cluster.frontend(name, **{"api-key": [USER], "admin-api-key": [ADMIN]})


@pytest_twisted.ensureDeferred
async def test_version_is_public_and_says_the_version_only(cluster):
    """Red when /version loses its row (404) or gets a guard (401)."""
    frontend = await scoped(cluster, "replica-version")
    code, headers, raw = await get(cluster.base_url(frontend) + "/version")
    assert code == 200 and json.loads(raw) == {"version": __version__}
    assert headers.getRawHeaders("content-type")[0].startswith("application/json")
    head = await treq.head(cluster.base_url(frontend) + "/version")
    assert head.code == 200 and await head.content() == b""
    refused = await treq.post(cluster.base_url(frontend) + "/version", b"")
    assert refused.code == 405 and "error" in json.loads(await refused.content())


@pytest_twisted.ensureDeferred
async def test_discovery_and_features_need_a_key_once_one_is_configured(cluster):
    frontend = await scoped(cluster, "replica-wellknown")
    base = cluster.base_url(frontend)
    for path in ("/.well-known/localai.json", "/api/features"):
        code, _, raw = await get(base + path)
        assert code == 401, path
        assert json.loads(raw)["error"]["message"], path
        code, _, _ = await get(base + path, key="sk-wrong")
        assert code == 401, path
    code, _, raw = await get(base + "/.well-known/localai.json", key=USER)  # any key
    assert code == 200
    document = json.loads(raw)
    assert document["version"] == __version__
    assert document["endpoints"]["chat_completions"] == "/v1/chat/completions"
    groups = document["endpoint_groups"]
    assert groups["monitoring"]["system"] == "/system"
    assert groups["ui"]["chat"] == "/dashboard/chat.html"
    assert "mcp" not in groups and "p2p" not in groups  # not served here: not listed
    assert document["capabilities"]["mcp"] is False and document["capabilities"]["tracing"]
    # every listed route answers something other than 404 here (the document never lies)
    for group in groups.values():
        for path in group.values():
            if ":" in path:
                continue
            answer = await treq.get(base + path, headers={"Authorization": f"Bearer {ADMIN}"})
            await answer.content()
            assert answer.code != 404, path
    code, _, raw = await get(base + "/api/features", key=USER)
    assert code == 200
    assert json.loads(raw) == {"agents": False, "mcp": False, "fine_tuning": False,
                               "quantization": False, "distributed": True,
                               "localai_assistant": False}


@pytest_twisted.ensureDeferred
async def test_discovery_is_open_like_v1_while_no_key_is_configured(cluster):
    frontend = await cluster.frontend("replica-open", **{"api-key": []})
    base = cluster.base_url(frontend)
    code, _, raw = await get(base + "/api/features")
    assert code == 200 and json.loads(raw)["distributed"] is True
    code, _, _ = await get(base + "/.well-known/localai.json")
    assert code == 200
    code, _, raw = await get(base + "/system")  # the admin API stays closed without a key
    assert code == 401


@pytest_twisted.ensureDeferred
async def test_system_names_each_node_with_its_backends_and_loaded_models(cluster):
    """Red when /system answers for the replica alone (no ``nodes``), when it lists a model
    that is not loaded, or when an inference key reads it."""
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", echo_model("echo-sys"))
    cluster.write_model("idle.yaml", echo_model("echo-idle"))
    frontend = await scoped(cluster, "replica-system")
    worker = await cluster.worker("w-sys", frontend)
    await frontend.replica.inference.predict("echo-sys", backend_pb2.PredictOptions(Prompt="x"))
    node_id = worker.registrar.registration.node_id
    # A load of another model in progress on the node (its row as a cold load writes it).
    await frontend.replica.db.runOperation(
        "INSERT INTO node_models (node_id, model_name, state, backend_type)"
        " VALUES (%s, 'echo-idle', 'staging', 'echo')", (node_id,))
    base = cluster.base_url(frontend)

    code, _, raw = await get(base + "/system")
    assert code == 401
    code, _, raw = await get(base + "/system", key=USER)
    assert code == 403 and json.loads(raw)["error"]["code"] == "admin_key_required"
    code, _, raw = await get(base + "/system", key=ADMIN)
    assert code == 200, raw
    system = json.loads(raw)
    assert "echo" in system["backends"] and "llama-cpp" in system["backends"]
    assert system["loaded_models"] == [{"id": "echo-sys", "backend": "echo"}]
    [node] = system["nodes"]
    assert node["name"] == "w-sys" and node["id"] == node_id
    assert node["status"] == "healthy" and node["backends"] == ["echo"]
    assert node["models"] == [
        {"id": "echo-idle", "backend": "echo", "state": "staging", "replica_index": 0},
        {"id": "echo-sys", "backend": "echo", "state": "loaded", "replica_index": 0}]
    assert ADMIN not in raw.decode() and USER not in raw.decode()


@pytest_twisted.ensureDeferred
async def test_one_model_by_id_in_openai_shape_and_an_unknown_one_is_404(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", echo_model("echo-one"))
    frontend = await scoped(cluster, "replica-model")
    base = cluster.base_url(frontend)
    code, _, raw = await get(base + "/v1/models/echo-one", key=USER)
    assert code == 200
    assert json.loads(raw) == {"id": "echo-one", "object": "model", "created": 0,
                               "owned_by": "localai-tw"}
    code, _, raw = await get(base + "/v1/models/nope", key=USER)
    error = json.loads(raw)["error"]
    assert code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    code, _, _ = await get(base + "/v1/models/echo-one")
    assert code == 401


@pytest_twisted.ensureDeferred
async def test_root_is_the_web_ui_for_a_browser_and_the_index_for_a_client(cluster):
    frontend = await scoped(cluster, "replica-root")
    base = cluster.base_url(frontend)
    code, headers, raw = await get(base + "/", accept="text/html,application/xhtml+xml,*/*;q=0.8")
    assert code == 200 and headers.getRawHeaders("content-type")[0].startswith("text/html")
    assert b'href="/dashboard/chat.html"' in raw and b'href="/dashboard/gallery.html"' in raw
    code, headers, raw = await get(base + "/", accept="application/json")
    assert code == 200 and json.loads(raw)["version"] == __version__
    for page in ("/dashboard/chat.html", "/dashboard/gallery.html"):
        code, headers, raw = await get(base + page)
        assert code == 200, page
        csp = headers.getRawHeaders("content-security-policy")[0]
        assert csp.startswith("default-src 'self'") and "frame-ancestors 'none'" in csp
        assert b"<script>" not in raw and b"style=" not in raw  # nothing inline: CSP holds
        assert b"http://" not in raw and b"https://" not in raw  # nothing fetched elsewhere
