"""A worker tunnel whose carrier goes silent -- a TCP proxy between the worker and the frontend
stops forwarding without closing anything, as a dead NAT entry or a pulled cable does -- is
declared dead by the frontend within 10 s, and the worker redials.  Real sockets, a real
worker, the real frontend and PostgreSQL; the documented bound is pinned on a Clock in
tests/unit/test_tunnel_keepalive.py."""

from __future__ import annotations

import os

import pytest_twisted
from twisted.internet import protocol, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint

from localai_tw.config import PortRange
from localai_tw.tunnel.keepalive import DEAD_TUNNEL_DETECTION
from localai_tw.worker.service import makeWorkerService

from .inference_harness import TOKEN, _ports
from .support import eventually


class _Half(protocol.Protocol):
    """One side of a proxied connection: forwards to its peer until the proxy freezes."""

    def __init__(self, proxy):
        self.proxy = proxy
        self.peer: _Half | None = None
        self.pending = b""
        self.silent = False

    def connectionMade(self):
        self.proxy.halves.append(self)

    def dataReceived(self, data):
        if self.silent:
            return  # swallowed: the carrier is silent, nothing is closed
        if self.peer is None:
            self.pending += data
        else:
            self.peer.transport.write(data)

    def connectionLost(self, reason):
        if self.peer is not None and not self.silent:
            self.peer.transport.loseConnection()


class SilenceableProxy(protocol.Factory):
    """A TCP proxy to ``target_port`` whose open connections can be frozen: from then on no
    byte moves either way and no connection is closed (new connections still work)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.frozen_at: float | None = None
        self.halves: list[_Half] = []
        #: connections accepted while new ones are held: forwarded once released
        self.held: list | None = None

    def buildProtocol(self, addr):
        inbound = _Half(self)
        inbound.transport = None

        def connected(outbound: _Half):
            outbound.peer, inbound.peer = inbound, outbound
            if inbound.pending:
                outbound.transport.write(inbound.pending)
                inbound.pending = b""
            inbound.transport.resumeProducing()

        def forward():
            TCP4ClientEndpoint(reactor, "127.0.0.1", self.target_port).connect(
                protocol.Factory.forProtocol(lambda: _Half(self))).addCallbacks(
                connected, lambda _: inbound.transport.loseConnection())

        def made():
            _Half.connectionMade(inbound)
            inbound.transport.pauseProducing()
            if self.held is not None:
                self.held.append(forward)
            else:
                forward()

        inbound.connectionMade = made
        return inbound

    def hold_new(self) -> None:
        """Accept new connections but forward none until :meth:`release_new`."""
        self.held = []

    def release_new(self) -> None:
        held, self.held = self.held or [], None
        for forward in held:
            forward()

    def freeze(self) -> None:
        for half in self.halves:
            half.silent = True
            if half.transport is not None and half.transport.connected:
                half.transport.pauseProducing()  # and stop reading: the link is dead
        self.frozen_at = reactor.seconds()

    def close(self) -> None:
        for half in self.halves:
            if half.transport is not None:
                half.transport.abortConnection()


@pytest_twisted.ensureDeferred
async def test_a_silent_tunnel_is_declared_dead_within_10_seconds(cluster):
    frontend = await cluster.frontend("replica-a")
    proxy = SilenceableProxy(frontend.listener.tcp_port())
    listening = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(proxy)
    first = next(_ports)
    worker = makeWorkerService(
        {"register-to": f"http://127.0.0.1:{listening.getHost().port}",
         "registration-token": TOKEN, "node-name": "behind-proxy", "node-type": "backend",
         "backend-port-range": PortRange(first, first + 15), "labels": {},
         "data-dir": os.path.join(cluster.base_dir, "w-proxy")}, reactor)
    worker.startService()
    cluster.workers.append(worker)
    try:
        node_id = await eventually(lambda: worker.registrar.registration
                                   and worker.registrar.registration.node_id, timeout=20)
        await eventually(lambda: frontend.replica.tunnels.holds(node_id), timeout=20, what="tunnel held")

        # The worker's own keepalive sees the silence too, at about the same moment (each end
        # 10 s after the last byte it read, tunnel/keepalive.py); its redial, forwarded at
        # once, raced the frontend's detection and could replace the silent session before
        # the frontend dropped it.  The proxy holds new connections until the frontend has
        # spoken.
        proxy.hold_new()
        proxy.freeze()
        await eventually(lambda: not frontend.replica.tunnels.holds(node_id), timeout=30,
                         what="silent tunnel dropped")
        took = reactor.seconds() - proxy.frozen_at
        # the bound, plus what a real reactor adds (timer lateness, the 50 ms poll)
        assert took <= DEAD_TUNNEL_DETECTION + 0.5, f"silent tunnel seen after {took:.1f}s"
        # the worker saw it too and dialled again (through the proxy, which forwards anew)
        await eventually(lambda: proxy.held, timeout=30, what="worker redialling")
        proxy.release_new()
        await eventually(lambda: frontend.replica.tunnels.holds(node_id), timeout=30,
                         what="worker redialled")
    finally:
        await worker.stopService()
        proxy.close()
        await listening.stopListening()
