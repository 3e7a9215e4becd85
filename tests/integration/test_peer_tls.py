"""Peer links over TLS between two real replicas (FrontendService, one database): a replica whose
``--listen`` is ``ssl:`` advertises ``wss://``, its peers dial it over TLS and check its
certificate against ``--peer-ca-file``; a certificate from another CA is refused as an
unreachable peer, with a log line that says why.  The certificates are made in the test."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.ssl import Certificate, optionsForClientTLS
from twisted.logger import formatEvent, globalLogPublisher

from localai_tw import errors
from localai_tw.frontend.service import FrontendService
from localai_tw.mux.session import Session
from localai_tw.tunnel.websocket import connectWebSocket
from tests.integration.harness_frontend import TOKEN, options
from tests.integration.harness_tunnel import Collect, TestWorker, only_condition, scripted
from tests.integration.support import eventually, failure_of, within
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


@pytest.fixture
def log_lines():
    lines: list[str] = []

    def observe(event):
        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)


async def attach_worker_over_tls(owner, certs, host: str = "127.0.0.1") -> TestWorker:
    """A worker holding its tunnel on ``owner``, dialled over wss:// (the listener is TLS-only)."""
    worker = await TestWorker.register(owner.replica.nodes, "w-1", scripted(("echo",)),
                                       token=TOKEN)
    port = owner.listener.tcp_port()
    trust = Certificate.loadPEM(certs.ca.read_bytes())
    session = await within(connectWebSocket(
        reactor, f"wss://127.0.0.1:{port}/api/cluster/connect?id={worker.node_id}",
        lambda: Session(client=True, acceptor=worker.acceptor, reactor=reactor),
        headers={"Authorization": f"Bearer {worker.credential}"},
        tls_options=optionsForClientTLS(host, trustRoot=trust)))
    worker.sessions.append(session)
    await eventually(lambda: owner.replica.tunnels.held(worker.node_id) is not None,
                     what="the owner to hold the worker's tunnel")
    return worker


@pytest_twisted.ensureDeferred
async def test_a_worker_tunnel_opens_on_a_replica_listening_only_on_ssl(replicas, tmp_path):
    certs = make_ca_and_server(tmp_path / "tls")
    owner = await replicas("replica-a", listen=certs.listen())
    worker = await attach_worker_over_tls(owner, certs)
    worker.close()


@pytest_twisted.ensureDeferred
async def test_a_relay_to_a_tls_only_replica_goes_over_wss_checked_against_the_named_ca(
        replicas, tmp_path):
    certs = make_ca_and_server(tmp_path / "tls")
    owner = await replicas("replica-a", listen=certs.listen())
    port = owner.listener.tcp_port()
    assert owner.replica.identity.advertised_addr == f"wss://127.0.0.1:{port}"
    other = await replicas("replica-b", **{"peer-ca-file": str(certs.ca)})
    worker = await attach_worker_over_tls(owner, certs)
    try:
        caller = Collect(11)
        await within(other.replica.dialer.open(worker.node_id, "http", "", caller))
        caller.transport.write(b"hello relay")
        assert await within(caller.done) == b"hello relay"
        # The relay went through the owner's TLS-only listener: no plain ws:// was possible.
        assert other.replica.peer_pool.cached_peers() == ["replica-a"]
        assert not other.replica.tunnels.holds(worker.node_id)
        assert list(owner.replica.peer_links.sessions()) == ["replica-b"]
    finally:
        worker.close()


@pytest_twisted.ensureDeferred
async def test_a_peer_certificate_from_another_ca_is_an_unreachable_peer_with_a_clear_log(
        replicas, tmp_path, log_lines):
    certs = make_ca_and_server(tmp_path / "tls")
    stranger = make_ca_and_server(tmp_path / "other", name="other")
    owner = await replicas("replica-a", listen=certs.listen())
    other = await replicas("replica-b", **{"peer-ca-file": str(stranger.ca)})
    worker = await attach_worker_over_tls(owner, certs)
    try:
        error = await failure_of(other.replica.dialer.open(worker.node_id, "http", "", Collect(1)))
        only_condition(error, errors.PeerUnreachable)
        assert not isinstance(error, errors.PeerRejected)
        assert "TLS certificate" in str(error)
        refused = [line for line in log_lines if "its TLS certificate was refused" in line]
        assert refused, "\n".join(log_lines[-20:])
        assert "replica-a" in refused[0] and str(stranger.ca) in refused[0]
        assert "not signed by the trusted CA" in refused[0]
        assert other.replica.peer_pool.cached_peers() == []
        assert not owner.replica.peer_links.sessions()
    finally:
        worker.close()


@pytest_twisted.ensureDeferred
async def test_a_peer_certificate_for_another_name_is_refused_even_from_the_named_ca(
        replicas, tmp_path, log_lines):
    certs = make_ca_and_server(tmp_path / "tls", names=("peer.example",))
    owner = await replicas("replica-a", listen=certs.listen())
    other = await replicas("replica-b", **{"peer-ca-file": str(certs.ca)})
    worker = await attach_worker_over_tls(owner, certs, host="peer.example")
    try:
        error = await failure_of(other.replica.dialer.open(worker.node_id, "http", "", Collect(1)))
        only_condition(error, errors.PeerUnreachable)
        refused = [line for line in log_lines if "its TLS certificate was refused" in line]
        assert refused and "does not name 127.0.0.1" in refused[0], "\n".join(log_lines[-20:])
        assert not owner.replica.peer_links.sessions()
    finally:
        worker.close()
