"""(No tests here: the shared harness, named test_* to stay within this suite's files.)
A real cluster in one process for the inference tests: FrontendService replicas on one
PostgreSQL database, real ``makeWorkerService`` workers (tunnel over WebSocket + yamux, the
backend supervisor, file staging) and the built-in ``echo`` backend as a real subprocess."""

from __future__ import annotations

import hashlib
import itertools
import os
import random

from twisted.internet import reactor

from localai_tw.config import PortRange
from localai_tw.frontend.service import FrontendService
from localai_tw.worker.service import makeWorkerService

from .support import eventually

TOKEN = "inference-registration-token"
ADMIN = "sk-inference-admin"
# A random block per test process: other suites (and other checkouts) use fixed ranges.
_ports = itertools.count(random.randrange(34000, 60000, 20), 20)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Cluster:
    def __init__(self, dsn: str, base_dir: str):
        self.dsn = dsn
        self.base_dir = base_dir
        self.models_dir = os.path.join(base_dir, "models")
        os.makedirs(self.models_dir, exist_ok=True)
        self.frontends: list[FrontendService] = []
        self.workers: list = []

    def write_model(self, filename: str, text: str) -> None:
        with open(os.path.join(self.models_dir, filename), "w") as f:
            f.write(text)

    def write_file(self, relative: str, data: bytes) -> str:
        path = os.path.join(self.models_dir, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return path

    async def frontend(self, instance_id: str, *, job_kinds=None,
                       **options) -> FrontendService:
        data_dir = os.path.join(self.base_dir, instance_id)
        os.makedirs(data_dir, exist_ok=True)
        service = FrontendService(
            {"listen": "tcp:0:interface=127.0.0.1", "database-url": self.dsn,
             "instance-id": instance_id, "single-host": True, "registration-token": TOKEN,
             "api-key": [ADMIN], "reconnect-grace": 90.0, "data-dir": data_dir,
             "models-dir": self.models_dir,
             # the operator's option: the tests' file servers listen on 127.0.0.1
             "allow-private-downloads": True, **options}, reactor=reactor, job_kinds=job_kinds)
        service.startService()
        self.frontends.append(service)
        await service.whenReady().addTimeout(30, reactor)
        return service

    def base_url(self, frontend: FrontendService) -> str:
        return f"http://127.0.0.1:{frontend.listener.tcp_port()}"

    async def worker(self, name: str, via: FrontendService, labels=None, **options):
        first = next(_ports)
        data_dir = os.path.join(self.base_dir, "w-" + name)
        worker = makeWorkerService(
            {"register-to": self.base_url(via), "registration-token": TOKEN, "node-name": name,
             "node-type": "backend", "backend-port-range": PortRange(first, first + 15),
             "labels": labels or {}, "data-dir": data_dir, **options}, reactor)
        worker.startService()
        self.workers.append(worker)
        node_id = await eventually(lambda: worker.registrar.registration
                                   and worker.registrar.registration.node_id,
                                   timeout=20, what=f"{name} registered")
        await eventually(lambda: via.replica.tunnels.holds(node_id), timeout=20,
                         what=f"{name} tunnel held")
        # The attach's reconcile pass stops any process no placement names; a test that starts
        # a backend by a bare control call must not race it (seen under load: "m#0 was stopped
        # while starting").
        await eventually(lambda: node_id in via.replica.reconciler.last, timeout=20,
                         what=f"{name}'s attach reconciled")
        worker.node_id = node_id
        worker.data_dir = data_dir
        return worker

    async def agent(self, name: str, via: FrontendService, *, kinds=None, max_jobs: int = 4):
        """An ``agent`` worker (``--node-type agent``) registered with ``via``; its jobs call
        ``via``'s ``/v1`` with the admin key."""
        from localai_tw.worker.service import makeAgentWorkerService

        first = next(_ports)
        data_dir = os.path.join(self.base_dir, "a-" + name)
        worker = makeAgentWorkerService(
            {"register-to": self.base_url(via), "registration-token": TOKEN, "node-name": name,
             "node-type": "agent", "backend-port-range": PortRange(first, first + 15),
             "data-dir": data_dir, "api-token": ADMIN, "max-jobs": max_jobs}, reactor,
            kinds=kinds)
        worker.startService()
        self.workers.append(worker)
        node_id = await eventually(lambda: worker.registrar.registration
                                   and worker.registrar.registration.node_id,
                                   timeout=20, what=f"{name} registered")
        await eventually(lambda: via.replica.tunnels.holds(node_id), timeout=20,
                         what=f"{name} tunnel held")
        worker.node_id = node_id
        return worker

    async def owner_of(self, node_id: str) -> str:
        rows = await self.frontends[0].database_service.database.runQuery(
            "SELECT owner_instance_id FROM node_connections WHERE node_id = %s", (node_id,))
        return rows[0][0] if rows else ""

    async def rows(self, model_name: str | None = None):
        db = self.frontends[0].database_service.database
        rows = await db.runQuery(
            "SELECT node_id, model_name, state, address, loaded_model FROM node_models"
            " WHERE %s::text IS NULL OR model_name = %s ORDER BY node_id, model_name",
            (model_name, model_name))
        return [tuple(r) for r in rows]

    async def close(self) -> None:
        for worker in reversed(self.workers):
            if worker.running:
                await worker.stopService()
        for frontend in reversed(self.frontends):
            if frontend.running:
                await frontend.stopService()


def supervisor_of(worker):
    from localai_tw.backends.process import BackendSupervisor

    for service in worker:
        if isinstance(service, BackendSupervisor):
            return service
    raise AssertionError("no backend supervisor")
