"""A replica whose own reactor stalls (a long garbage collection, a thread holding the GIL)
must not end a pinging peer's tunnel for the silence it could not hear: timers run before the
reactor reads, so the peer's pings wait unread in the socket when the silence check runs late.
Real sockets and the real reactor, both ends in this process; the bound is shortened."""

from __future__ import annotations

import time

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.internet.protocol import Factory

from localai_tw.mux import Session, SessionConfig

from .support import sleep, within


@pytest_twisted.ensureDeferred
async def test_a_stall_of_our_own_longer_than_the_bound_does_not_end_a_pinging_peer():
    listening = SessionConfig(keepalive_interval=0.3, keepalive_timeout=0.3,
                              keepalive_peer_pings=True)
    pinging = SessionConfig(keepalive_interval=0.3, keepalive_timeout=5.0)
    accepted = []

    def build(addr):
        session = Session(False, listening)
        accepted.append(session)
        return session

    factory = Factory()
    factory.buildProtocol = build
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
    client = Session(True, pinging)
    try:
        await within(connectProtocol(
            TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port), client))
        await sleep(0.7)  # more than the bound: pings keep the session open
        [server] = accepted
        assert server.isOpen
        reactor.callLater(0, time.sleep, 1.5)  # our own stall: 2.5 times the 0.6 s bound
        await sleep(1.0)
        assert server.isOpen, f"ended for silence it could not hear: {server.ending!r}"
        assert client.isOpen
    finally:
        client.loseConnection()
        for session in accepted:
            session.loseConnection()
        await port.stopListening()
