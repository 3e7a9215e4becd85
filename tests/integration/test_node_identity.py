"""A node's name is not its identity: a real FrontendService (``--require-approval``), real
WorkerServices with data directories, real PostgreSQL, everything over loopback.

Holding the shared registration token and knowing a node's name must not be enough to take the
node over (its credential, its approval, its tunnel, its traffic): re-registering a name needs
the node key the worker keeps in its data directory.  And the frontend's control calls carry
each node's own control token, never the shared registration token.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.web.client import HTTPConnectionPool

from localai_tw import errors
from localai_tw.nodekey import NODE_KEY_FILE, control_token, mint_node_key, node_key_hash
from localai_tw.config import PortRange
from localai_tw.frontend.service import FrontendService
from localai_tw.tunnel.endpoint import ControlClient
from localai_tw.worker.registration import RegistrationClient, RegistrationRejected
from localai_tw.worker.service import WorkerService

from .support import eventually, sleep

TOKEN = "identity-registration-token"
ADMIN = "sk-identity-admin"
TIMEOUT = 30.0


@pytest_twisted.async_yield_fixture
async def cluster(pg_dsn):
    """A ``--require-approval`` frontend, a way to start workers, and raw HTTP to its API."""
    frontend = FrontendService(
        {"listen": "tcp:0:interface=127.0.0.1", "database-url": pg_dsn,
         "instance-id": "replica-id", "single-host": True, "registration-token": TOKEN,
         "require-approval": True, "api-key": [ADMIN], "reconnect-grace": 90.0},
        reactor=reactor)
    frontend.startService()
    pool = HTTPConnectionPool(reactor, persistent=False)
    workers: list[WorkerService] = []
    try:
        await frontend.whenReady().addTimeout(TIMEOUT, reactor)
        yield Cluster(frontend, pool, workers)
    finally:
        for worker in workers:
            if worker.running:
                await worker.stopService()
        await pool.closeCachedConnections()
        await frontend.stopService()


class Cluster:
    def __init__(self, frontend, pool, workers):
        self.frontend = frontend
        self.pool = pool
        self.workers = workers
        self.base = f"http://127.0.0.1:{frontend.listener.tcp_port()}"

    def worker(self, name: str, data_dir) -> WorkerService:
        worker = WorkerService(
            {"register-to": self.base, "registration-token": TOKEN, "node-name": name,
             "node-type": "backend", "backend-port-range": PortRange(31100, 31110),
             "data-dir": str(data_dir), "labels": {}},
            reactor, registrar_options={"heartbeat_interval": 0.2, "retry_first": 0.1,
                                        "retry_cap": 0.2})
        worker.startService()
        self.workers.append(worker)
        return worker

    async def registered(self, worker) -> str:
        return await eventually(lambda: worker.registrar.registration
                                and worker.registrar.registration.node_id,
                                timeout=TIMEOUT, what=f"{worker.node_name} to register")

    async def api(self, method: str, path: str, *, body=None, token=ADMIN):
        response = await treq.request(
            method, self.base + path, headers={"Authorization": f"Bearer {token}",
                                               "Content-Type": "application/json"},
            data=json.dumps(body).encode() if body is not None else None, pool=self.pool)
        return response.code, json.loads(await treq.content(response) or b"null")

    async def approve(self, node_id: str) -> None:
        code, body = await self.api("POST", f"/api/nodes/{node_id}/approve")
        assert code == 200, body


async def tunnel_up(cluster, worker, node_id):
    await eventually(lambda: cluster.frontend.replica.tunnels.holds(node_id)
                     and worker.readiness() is None, timeout=TIMEOUT,
                     what="the tunnel to be up")
    return cluster.frontend.replica.tunnels.held(node_id)


@pytest_twisted.ensureDeferred
async def test_the_shared_token_and_a_name_do_not_take_a_node_over(cluster, tmp_path):
    frontend = cluster.frontend
    real = cluster.worker("w1", tmp_path / "real")
    node_id = await cluster.registered(real)
    assert real.registrar.registration.status == "pending"
    await cluster.approve(node_id)
    held = await tunnel_up(cluster, real, node_id)
    credential = real.registrar.registration.tunnel_token

    # An intruder with the shared token and the name, but not the node's key: 409, naming the
    # fix, and no credential for it.
    code, answer = await cluster.api(
        "POST", "/api/node/register", token=TOKEN,
        body={"name": "w1", "node_key": mint_node_key(), "node_type": "backend"})
    assert code == 409, answer
    assert answer["error"]["code"] == "node_name_taken" and "tunnel_token" not in answer
    message = answer["error"]["message"]
    assert "--node-name" in message and f"DELETE /api/nodes/{node_id}" in message
    # Without any key at all: a 400 naming the field, never a takeover either.
    code, answer = await cluster.api("POST", "/api/node/register", token=TOKEN,
                                     body={"name": "w1", "node_type": "backend"})
    assert code == 400 and answer["error"]["field"] == "node_key", answer

    # A second genuine worker started with the same --node-name and its own data directory is
    # refused the same way (the worker's error names the option and the operator's fix).
    second = RegistrationClient(reactor, cluster.base, TOKEN, "w1", "backend",
                                node_key=mint_node_key())
    try:
        with pytest.raises(RegistrationRejected) as refused:
            await second.register()
    finally:
        await second.close()
    assert refused.value.status == 409
    assert "--node-name" in refused.value.hint and "DELETE /api/nodes" in refused.value.hint

    # The real worker kept everything: credential, approval, the very same tunnel.
    await sleep(0.5)
    assert frontend.replica.tunnels.held(node_id) is held and real.readiness() is None
    assert real.registrar.registration.tunnel_token == credential
    await frontend.replica.nodes.verify_tunnel_credential(node_id, credential)
    node = await frontend.replica.nodes.get_node(node_id)
    assert (node.name, node.status.value, node.approved) == ("w1", "healthy", True)
    assert len(await frontend.replica.nodes.list_nodes()) == 1

    # Restarted on its own data directory, the real worker re-registers: same id, approval
    # kept (healthy at once under --require-approval), tunnel back.
    await real.stopService()
    restarted = cluster.worker("w1", tmp_path / "real")
    assert restarted.node_key == real.node_key
    assert await cluster.registered(restarted) == node_id
    assert restarted.registrar.registration.status == "healthy"
    await tunnel_up(cluster, restarted, node_id)


@pytest_twisted.ensureDeferred
async def test_a_worker_that_lost_its_data_directory_registers_anew_once_removed(cluster,
                                                                                 tmp_path):
    first = cluster.worker("w2", tmp_path / "old")
    node_id = await cluster.registered(first)
    await cluster.approve(node_id)
    await tunnel_up(cluster, first, node_id)
    await first.stopService()

    # The machine comes back with an empty data directory: a new key, so the name is refused
    # (the worker keeps retrying and logging the fix) and the old node keeps its row.
    assert not (tmp_path / "new" / NODE_KEY_FILE).exists()
    lost = cluster.worker("w2", tmp_path / "new")
    assert lost.node_key != first.node_key
    await sleep(1.0)
    assert lost.registrar.registration is None
    node = await cluster.frontend.replica.nodes.get_node(node_id)
    assert node.approved and node.name == "w2"

    # The documented recovery: an administrator removes the node; the worker registers anew as
    # a new node, pending again (approval is never inherited from the removed node).
    code, body = await cluster.api("DELETE", f"/api/nodes/{node_id}")
    assert code == 200 and body["deleted"], body
    new_id = await cluster.registered(lost)
    assert new_id != node_id and lost.registrar.registration.status == "pending"
    node = await cluster.frontend.replica.nodes.get_node(new_id)
    assert (node.name, node.status.value, node.approved) == ("w2", "pending", False)
    await cluster.approve(new_id)
    await tunnel_up(cluster, lost, new_id)


@pytest_twisted.ensureDeferred
async def test_control_calls_carry_the_nodes_own_token_never_the_registration_token(cluster,
                                                                                   tmp_path):
    frontend = cluster.frontend
    worker = cluster.worker("w3", tmp_path / "w3")
    node_id = await cluster.registered(worker)
    await cluster.approve(node_id)
    await tunnel_up(cluster, worker, node_id)

    seen: list[list[bytes]] = []
    check = worker.control_auth.refusal_for

    def recording(request):
        seen.append(request.requestHeaders.getRawHeaders(b"authorization") or [])
        return check(request)

    worker.control_auth.refusal_for = recording
    reply = await frontend.replica.control.call(node_id, "node.status", {}, timeout=10)
    assert reply["node_name"] == "w3"
    expected = control_token(node_key_hash(worker.node_key))
    assert seen and all(values == [f"Bearer {expected}".encode()] for values in seen)
    assert not any(TOKEN.encode() in value for values in seen for value in values)

    # and the worker does not accept the shared registration token as a control credential
    with pytest.raises(errors.TunnelProtocolError):
        await ControlClient(frontend.replica.worker_http, TOKEN, reactor).call(
            node_id, "node.status", {}, timeout=10)
