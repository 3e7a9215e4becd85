"""Small peers over loopback TCP: a backend that hashes what it reads and needs a half-close
(``test_splice_tcp.py``, ``test_websocket_yamux.py``), and a raw client that keeps every byte
it is sent until the connection closes (``test_worker_control_tcp.py``,
``test_worker_staging_tcp.py``)."""

from __future__ import annotations

import hashlib

from twisted.internet import defer, protocol, reactor
from twisted.internet.interfaces import IHalfCloseableProtocol
from zope.interface import implementer


@implementer(IHalfCloseableProtocol)
class HashBack(protocol.Protocol):
    """A backend that speaks first (a banner), reads until EOF, answers with the sha256 of what
    it read, and closes: it needs the relay to half-close, not close."""

    def connectionMade(self):
        self.digest = hashlib.sha256()
        self.transport.write(b"banner\n")

    def dataReceived(self, data):
        self.digest.update(data)

    def readConnectionLost(self):
        self.transport.write(self.digest.hexdigest().encode())
        self.transport.loseConnection()

    def writeConnectionLost(self):
        pass


TIMEOUT = 10


def with_timeout(d):
    return d.addTimeout(TIMEOUT, reactor)


class RawClient(protocol.Protocol):
    def __init__(self):
        self.received = b""
        self.closed = defer.Deferred()

    def dataReceived(self, data):
        self.received += data

    def connectionLost(self, reason):
        self.closed.callback(self.received)


async def raw_exchange(port: int, data: bytes) -> RawClient:
    client = RawClient()
    await with_timeout(protocol.ClientCreator(reactor, lambda: client).connectTCP(
        "127.0.0.1", port))
    client.transport.write(data)
    return client
