"""A real FrontendService and a real WorkerService on loopback: the two halves agree.

The worker registers through ``/api/node/register``, heartbeats, dials the tunnel, and the
frontend reaches the worker's own HTTP site through that tunnel.  Deleting the node through the
admin API makes the worker's next heartbeat a 404, and the worker registers again.
"""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.web.client import HTTPConnectionPool

from localai_tw.config import PortRange
from localai_tw.frontend.service import FrontendService
from localai_tw.tunnel.endpoint import worker_url
from localai_tw.worker.service import WorkerService

from .support import eventually

TOKEN = "joint-registration-token"
ADMIN = "sk-joint-admin"


@pytest_twisted.ensureDeferred
async def test_worker_registers_dials_and_is_reachable_through_the_frontend(pg_dsn):
    frontend = FrontendService(
        {"listen": "tcp:0:interface=127.0.0.1", "database-url": pg_dsn,
         "instance-id": "replica-j", "single-host": True, "registration-token": TOKEN,
         "api-key": [ADMIN], "reconnect-grace": 90.0}, reactor=reactor)
    frontend.startService()
    worker = None
    pool = HTTPConnectionPool(reactor, persistent=False)
    try:
        await frontend.whenReady().addTimeout(30, reactor)
        base = f"http://127.0.0.1:{frontend.listener.tcp_port()}"
        worker = WorkerService(
            {"register-to": base, "registration-token": TOKEN, "node-name": "joint-1",
             "node-type": "backend", "backend-port-range": PortRange(31000, 31010),
             "labels": {"zone": "lab"}},
            reactor, registrar_options={"heartbeat_interval": 0.2})
        worker.startService()

        first_id = await eventually(lambda: worker.registrar.registration
                                    and worker.registrar.registration.node_id, timeout=15)
        await eventually(lambda: frontend.replica.tunnels.holds(first_id), timeout=15)
        node = await frontend.replica.nodes.get_node(first_id)
        assert node.name == "joint-1" and node.labels == {"zone": "lab"}

        # the frontend reaches the worker's own site through the tunnel
        worker_http = frontend.replica.worker_http
        response = await worker_http.get(worker_url(first_id, "/healthz")).addTimeout(
            10, reactor)
        assert response.code == 200

        # delete through the admin API: the next heartbeat is a 404, the worker re-registers
        deleted = await treq.delete(f"{base}/api/nodes/{first_id}",
                                    headers={"Authorization": f"Bearer {ADMIN}"}, pool=pool)
        assert deleted.code == 200 and json.loads(await treq.content(deleted))["deleted"]
        second_id = await eventually(
            lambda: worker.registrar.registration
            and worker.registrar.registration.node_id != first_id
            and worker.registrar.registration.node_id, timeout=15)
        await eventually(lambda: frontend.replica.tunnels.holds(second_id), timeout=15)
        assert (await frontend.replica.nodes.get_node(second_id)).name == "joint-1"
    finally:
        if worker is not None:
            await worker.stopService()
        await pool.closeCachedConnections()
        await frontend.stopService()
