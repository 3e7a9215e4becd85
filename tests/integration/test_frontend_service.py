"""FrontendService composed for real: PostgreSQL, a TCP listener, a worker tunnel over WebSocket."""

from __future__ import annotations

import re
from pathlib import Path

import pytest_twisted
from twisted.internet import reactor

from localai_tw.frontend.service import FrontendService
from localai_tw.mux.session import Session
from localai_tw.tunnel.websocket import connectWebSocket

from .harness_frontend import ADMIN, TOKEN, Client, options
from .support import eventually


@pytest_twisted.async_yield_fixture
async def started(pg_dsn):
    services = []

    async def start(**overrides):
        service = FrontendService(options(pg_dsn, **overrides), reactor=reactor)
        service.startService()
        services.append(service)
        await service.whenReady().addTimeout(30, reactor)
        return service, Client(f"http://127.0.0.1:{service.listener.tcp_port()}")

    yield start
    for service in services:
        if service.running:
            await service.stopService()


@pytest_twisted.ensureDeferred
async def test_a_replica_serves_probes_apis_and_tunnels_and_stops_in_order(started):
    service, client = await started()
    port = service.listener.tcp_port()
    assert await client.call("GET", "/healthz") == (200, b"ok")
    assert await client.call("GET", "/readyz") == (200, {"ready": True})

    status, instances = await client.call("GET", "/api/cluster/instances", token=ADMIN)
    assert status == 200
    assert [(i["id"], i["advertised_addr"], i["self"]) for i in instances["instances"]] == [
        ("replica-a", f"127.0.0.1:{port}", True)]  # single-host: loopback allowed

    w1_key = "w1-node-key-" + "k" * 32
    status, node = await client.call("POST", "/api/node/register",
                                     {"name": "w1", "node_type": "backend", "node_key": w1_key},
                                     token=TOKEN)
    assert status == 201
    session = await connectWebSocket(
        reactor, f"ws://127.0.0.1:{port}/api/cluster/connect?id={node['id']}",
        lambda: Session(client=True),
        headers={"Authorization": f"Bearer {node['tunnel_token']}"}).addTimeout(10, reactor)
    await eventually(lambda: service.replica.tunnels.holds(node["id"]))
    status, view = await client.call("GET", f"/api/nodes/{node['id']}", token=ADMIN)
    assert view["presence"] == "connected" and view["owner"]["replica"] == "replica-a"

    # re-registration (same node key) rotates the credential: the tunnel held with the old one
    # is closed
    status, again = await client.call("POST", "/api/node/register",
                                      {"name": "w1", "node_key": w1_key}, token=TOKEN)
    assert status == 201 and again["id"] == node["id"]
    await session.whenClosed().addTimeout(10, reactor)
    await eventually(lambda: not service.replica.tunnels.holds(node["id"]))

    # a new tunnel with the new credential, then a clean stop in the documented order
    await connectWebSocket(
        reactor, f"ws://127.0.0.1:{port}/api/cluster/connect?id={node['id']}",
        lambda: Session(client=True),
        headers={"Authorization": f"Bearer {again['tunnel_token']}"}).addTimeout(10, reactor)
    await eventually(lambda: service.replica.tunnels.holds(node["id"]))
    order = []

    def record(name, fn):
        def wrapper(*args, **kwargs):
            order.append(name)
            return fn(*args, **kwargs)
        return wrapper

    replica = service.replica
    service.listener.stopService = record("listener", service.listener.stopService)
    replica.tunnels.close = record("tunnels", replica.tunnels.close)
    replica.peer_links.close = record("peer links", replica.peer_links.close)
    replica.peer_pool.close = record("peer pool", replica.peer_pool.close)
    replica.backend_clients.close = record("grpc bridges", replica.backend_clients.close)
    replica.worker_http.close = record("worker http pools", replica.worker_http.close)
    replica.membership.stopService = record("membership", replica.membership.stopService)
    replica.health.stopService = record("health", replica.health.stopService)
    db = service.database_service.database
    row_after_tunnels = []
    original_close = replica.tunnels.close

    async def close_then_look():
        await original_close()
        row_after_tunnels.extend(await db.runQuery(
            "SELECT owner_instance_id FROM node_connections WHERE node_id = %s",
            (node["id"],)))
        row_after_tunnels.extend(await db.runQuery("SELECT id FROM instances"))

    replica.tunnels.close = close_then_look
    service.database_service.stopService = record("database",
                                                  service.database_service.stopService)
    await service.stopService()
    assert order == ["listener", "tunnels", "peer links", "peer pool", "grpc bridges",
                     "worker http pools", "membership", "health", "database"]
    # the tunnel was released (departure recorded) while this replica was still a member
    assert row_after_tunnels == [("",), ("replica-a",)]


@pytest_twisted.ensureDeferred
async def test_without_a_dialable_address_the_replica_still_starts(started, pg_dsn):
    service, client = await started(**{"single-host": False, "instance-id": "replica-x"})
    # loopback database: nothing to advertise
    assert service.replica.identity.advertised_addr == ""
    assert await client.call("GET", "/readyz") == (200, {"ready": True})


@pytest_twisted.ensureDeferred
async def test_a_configured_address_is_published(started):
    service, client = await started(**{"advertise-address": ("10.1.2.3", 9000),
                                       "single-host": False, "instance-id": "replica-c"})
    status, instances = await client.call("GET", "/api/cluster/instances", token=ADMIN)
    assert instances["instances"][0]["advertised_addr"] == "10.1.2.3:9000"


@pytest_twisted.ensureDeferred
async def test_departure_subscribers_include_the_worker_http_pools(started):
    service, _ = await started(**{"instance-id": "replica-d"})
    assert set(service.replica.notifier.subscribers) == {"worker-http-connections",
                                                         "placement-cache", "prefix-index"}
    # minted once
    assert service.replica.identity.peer_secret == service.config.identity_seed.peer_secret
    assert service.replica.health.grace == 90.0


@pytest_twisted.ensureDeferred
async def test_the_listener_has_a_backlog_for_a_fleet():
    """``--listen`` without ``backlog=`` listens with 1024, not Twisted's 50 (issue 15 §4:
    1000 workers starting at once overflowed 50).  Remove with_fleet_backlog: this fails."""
    from twisted.web.server import Site
    from twisted.web.resource import Resource

    from localai_tw.frontend.parts import ListeningService

    listener = ListeningService(reactor, "tcp:0:interface=127.0.0.1", Site(Resource()))
    listener.startService()
    try:
        port = await listener.whenListening()
        assert port.backlog == 1024
    finally:
        await listener.stopService()


def documented_replica_services() -> list[str]:
    """The children of ``ReplicaService`` as docs/architecture.md's service tree lists them."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    tree = text.split("## The frontend replica as a service tree", 1)[1].split("```", 2)[1]
    inside = tree.split("  ReplicaService", 1)[1].split("\n  ListeningService", 1)[0]
    return [m.group(1) for m in re.finditer(r"^    (\w+)", inside, re.MULTILINE)]


@pytest_twisted.ensureDeferred
async def test_docs_architecture_lists_the_replica_services_in_start_order(started):
    """The service tree in docs/architecture.md is the one a real replica starts."""
    service, _ = await started()
    running = [type(child).__name__ for child in service.replica.services()]
    documented = documented_replica_services()
    assert set(running) <= set(documented), (
        f"docs/architecture.md's service tree lacks {sorted(set(running) - set(documented))}")
    assert [name for name in documented if name in running] == running
