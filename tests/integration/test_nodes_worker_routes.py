"""Admin routes that ask a worker itself (status, backends, logs) through its tunnel, and keep
the four conditions apart in what they answer."""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.web.client import HTTPConnectionPool

from localai_tw.config import PortRange
from localai_tw.frontend.service import FrontendService
from localai_tw.worker.service import WorkerService

from .support import eventually

TOKEN = "routes-registration-token"
ADMIN = "sk-routes-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


async def get_json(pool, url):
    response = await treq.get(url, headers=AUTH, pool=pool).addTimeout(30, reactor)
    return response.code, json.loads(await treq.content(response))


@pytest_twisted.ensureDeferred
async def test_worker_questions_answer_through_the_tunnel_and_name_each_condition(pg_dsn):
    frontend = FrontendService(
        {"listen": "tcp:0:interface=127.0.0.1", "database-url": pg_dsn,
         "instance-id": "replica-routes", "single-host": True, "registration-token": TOKEN,
         "api-key": [ADMIN], "reconnect-grace": 90.0}, reactor=reactor)
    frontend.startService()
    worker = None
    pool = HTTPConnectionPool(reactor, persistent=False)
    try:
        await frontend.whenReady().addTimeout(30, reactor)
        base = f"http://127.0.0.1:{frontend.listener.tcp_port()}"
        worker = WorkerService(
            {"register-to": base, "registration-token": TOKEN, "node-name": "routes-1",
             "node-type": "backend", "backend-port-range": PortRange(31020, 31030),
             "labels": {}}, reactor)
        worker.startService()
        node_id = await eventually(lambda: worker.registrar.registration
                                   and worker.registrar.registration.node_id, timeout=15)
        await eventually(lambda: frontend.replica.tunnels.holds(node_id), timeout=15)

        # The worker's own answer, through the tunnel.
        code, body = await get_json(pool, f"{base}/api/nodes/{node_id}/status")
        assert code == 200 and body["id"] == node_id
        assert body["answer"]["node_name"] == "routes-1"

        # This worker serves no backend verbs: its 404 is its answer (502 worker-answer), not
        # absence and not "no route".
        code, body = await get_json(pool, f"{base}/api/nodes/{node_id}/backends")
        assert code == 502 and body["error"]["code"] == "worker-answer"

        # A registered node that never dialled: a routing fact, named as "no route".
        registered = await treq.post(
            f"{base}/api/node/register", json={"name": "never-dials", "node_type": "backend",
                                                 "node_key": "never-dials-" + "k" * 32},
            headers={"Authorization": f"Bearer {TOKEN}"}, pool=pool)
        silent = json.loads(await treq.content(registered))["id"]
        code, body = await get_json(pool, f"{base}/api/nodes/{silent}/status")
        assert code == 503 and body["error"]["code"] == "routing-fact"
        assert "no route" in body["error"]["message"]

        code, body = await get_json(pool, f"{base}/api/nodes/not-a-node/status")
        assert code == 404
    finally:
        if worker is not None:
            await worker.stopService()
        await pool.closeCachedConnections()
        await frontend.stopService()
