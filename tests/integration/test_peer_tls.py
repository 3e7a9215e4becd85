"""Replicas listening on ``ssl:`` (FrontendService, one database).  The certificates are made in
the test."""

from __future__ import annotations

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.ssl import Certificate, optionsForClientTLS

from localai_tw.frontend.service import FrontendService
from localai_tw.mux.session import Session
from localai_tw.tunnel.websocket import connectWebSocket
from tests.integration.test_frontend_service import TOKEN, options
from tests.integration.test_tunnel_harness import TestWorker, eventually, scripted, within
from tests.integration.tlscerts import make_ca_and_server


@pytest_twisted.async_yield_fixture
async def replicas(pg_dsn):
    """``await start(name, **options)``: a started FrontendService on the test's database."""
    services = []

    async def start(name, **overrides):
        service = FrontendService(options(pg_dsn, **{"instance-id": name, **overrides}),
                                  reactor=reactor)
        service.startService()
        services.append(service)
        await service.whenReady().addTimeout(30, reactor)
        return service

    yield start
    for service in reversed(services):
        if service.running:
            await service.stopService()


async def attach_worker_over_tls(owner, certs, host: str = "127.0.0.1") -> TestWorker:
    """A worker holding its tunnel on ``owner``, dialled over wss:// (the listener is TLS-only)."""
    worker = await TestWorker.register(owner.nodes, "w-1", scripted(("echo",)),
                                       token=TOKEN)
    port = owner.listener.tcp_port()
    trust = Certificate.loadPEM(certs.ca.read_bytes())
    session = await within(connectWebSocket(
        reactor, f"wss://127.0.0.1:{port}/api/cluster/connect?id={worker.node_id}",
        lambda: Session(client=True, acceptor=worker.acceptor, reactor=reactor),
        headers={"Authorization": f"Bearer {worker.credential}"},
        tls_options=optionsForClientTLS(host, trustRoot=trust)))
    worker.sessions.append(session)
    await eventually(lambda: owner.tunnels.held(worker.node_id) is not None,
                     what="the owner to hold the worker's tunnel")
    return worker


@pytest_twisted.ensureDeferred
async def test_a_worker_tunnel_opens_on_a_replica_listening_only_on_ssl(replicas, tmp_path):
    certs = make_ca_and_server(tmp_path / "tls")
    owner = await replicas("replica-a", listen=certs.listen())
    worker = await attach_worker_over_tls(owner, certs)
    worker.close()
