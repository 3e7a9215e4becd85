"""Splice between real TCP loopback connections: a relay in front of a backend."""

from __future__ import annotations

import hashlib

import pytest_twisted
from twisted.internet import defer, endpoints, error, protocol, reactor
from twisted.internet.interfaces import IHalfCloseableProtocol
from zope.interface import implementer

from localai_tw.splice import EndingKind, Splice

from .harness_tcp import HashBack


class Dropper(protocol.Protocol):
    """A backend that reads a little and then resets the connection."""

    def dataReceived(self, data):
        self.transport.abortConnection()


@implementer(IHalfCloseableProtocol)
class Client(protocol.Protocol):
    def __init__(self):
        self.received = bytearray()
        self.ended = defer.Deferred()

    def dataReceived(self, data):
        self.received += data

    def readConnectionLost(self):
        self.transport.loseConnection()

    def writeConnectionLost(self):
        pass

    def connectionLost(self, reason):
        self.ended.callback(reason.value)


class Relay:
    """Listens; splices every accepted connection to the backend."""

    def __init__(self, backend_port: int):
        self.splices: list[Splice] = []
        backend = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", backend_port)

        def accepted():
            splice = Splice()
            self.splices.append(splice)
            endpoints.connectProtocol(backend, splice.b).addErrback(splice.abandon)
            return splice.a

        self.port = reactor.listenTCP(
            0, protocol.Factory.forProtocol(accepted), interface="127.0.0.1"
        )


def listen(proto_class):
    return reactor.listenTCP(0, protocol.Factory.forProtocol(proto_class), interface="127.0.0.1")


@pytest_twisted.inlineCallbacks
def test_request_half_close_and_response_through_a_tcp_relay():
    backend = listen(HashBack)
    relay = Relay(backend.getHost().port)
    try:
        client = Client()
        yield endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", relay.port.getHost().port), client
        )
        body = bytes(range(256)) * 8192  # 2 MiB
        client.transport.write(body)
        client.transport.loseWriteConnection()  # EOF client->backend; backend->client continues
        reason = yield client.ended
        assert bytes(client.received) == b"banner\n" + hashlib.sha256(body).hexdigest().encode()
        assert isinstance(reason, error.ConnectionDone)
        ending = yield relay.splices[0].whenDone()
        assert ending.kind is EndingKind.NORMAL
    finally:
        yield relay.port.stopListening()
        yield backend.stopListening()


@pytest_twisted.inlineCallbacks
def test_backend_reset_closes_the_client_and_is_a_transport_failure():
    backend = listen(Dropper)
    relay = Relay(backend.getHost().port)
    try:
        client = Client()
        yield endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", relay.port.getHost().port), client
        )
        client.transport.write(b"x" * 100_000)
        yield client.ended
        ending = yield relay.splices[0].whenDone()
        assert ending.kind is EndingKind.TRANSPORT_FAILURE
    finally:
        yield relay.port.stopListening()
        yield backend.stopListening()


@pytest_twisted.inlineCallbacks
def test_backend_that_cannot_be_dialled_abandons_the_splice():
    gone = listen(protocol.Protocol)
    port = gone.getHost().port
    yield gone.stopListening()
    relay = Relay(port)
    try:
        client = Client()
        yield endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", relay.port.getHost().port), client
        )
        yield client.ended
        ending = yield relay.splices[0].whenDone()
        assert ending.kind is EndingKind.TRANSPORT_FAILURE
        assert "never connected" in ending.cause
    finally:
        yield relay.port.stopListening()
