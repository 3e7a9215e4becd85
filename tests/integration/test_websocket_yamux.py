"""yamux sessions over the WebSocket carrier, and a yamux stream spliced to a TCP backend after
its preamble: the path a frontend's gRPC or HTTP call takes to a worker's backend."""

from __future__ import annotations

import hashlib
import random

import pytest_twisted
from twisted.internet import defer, endpoints, protocol, reactor
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.web.resource import Resource
from twisted.web.server import Site
from zope.interface import implementer

from localai_tw.mux.session import Session
from localai_tw.splice import EndingKind, HandoffProtocol, Splice
from localai_tw.tunnel import preamble
from localai_tw.tunnel.websocket import BearerTokenAuthorizer, TunnelWebSocketResource, connectWebSocket
from tests.integration.harness_tcp import HashBack

TOKEN = "tunnel-credential"


def random_bytes(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@implementer(IHalfCloseableProtocol)
class HashingPeer(protocol.Protocol):
    """Sends ``outgoing`` then half-closes; hashes what it receives until the peer's EOF."""

    def __init__(self, outgoing: bytes = b""):
        self.outgoing = outgoing
        self.digest = hashlib.sha256()
        self.count = 0
        self.done = defer.Deferred()

    def connectionMade(self):
        if self.outgoing:
            for start in range(0, len(self.outgoing), 100_000):
                self.transport.write(self.outgoing[start : start + 100_000])
        self.transport.loseWriteConnection()

    def dataReceived(self, data):
        self.digest.update(data)
        self.count += len(data)

    def readConnectionLost(self):
        if not self.done.called:
            self.done.callback((self.count, self.digest.hexdigest()))

    def writeConnectionLost(self):
        pass

    def connectionLost(self, reason):
        if not self.done.called:
            self.done.errback(reason)


@defer.inlineCallbacks
def tunnel(worker_acceptor):
    """A frontend (yamux server) behind the carrier and a worker (yamux client) that dialled it.
    Returns (frontend session, worker session, listening port)."""
    frontend = defer.Deferred()

    def serve(request, authorization):
        session = Session(False)
        frontend.callback(session)
        return session

    root = Resource()
    root.putChild(b"connect", TunnelWebSocketResource(serve, BearerTokenAuthorizer(TOKEN)))
    port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
    worker = yield connectWebSocket(
        reactor,
        f"ws://127.0.0.1:{port.getHost().port}/connect",
        lambda: Session(True, acceptor=worker_acceptor),
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    server = yield frontend
    return server, worker, port


@pytest_twisted.inlineCallbacks
def test_a_yamux_session_over_websocket_moves_mebibytes_both_ways_intact():
    down = random_bytes(3 * 1024 * 1024, 1)
    up = random_bytes(5 * 1024 * 1024 + 17, 2)
    worker_side = []

    def accept(stream):
        peer = HashingPeer(up)
        worker_side.append(peer)
        return peer

    frontend, worker, port = yield tunnel(accept)
    try:
        frontend_peer = HashingPeer(down)
        frontend.openStream(frontend_peer)
        got_up = yield frontend_peer.done
        got_down = yield worker_side[0].done
        assert got_up == (len(up), hashlib.sha256(up).hexdigest())
        assert got_down == (len(down), hashlib.sha256(down).hexdigest())
    finally:
        frontend.loseConnection()
        yield worker.whenClosed()
        yield port.stopListening()


class WorkerStream(HandoffProtocol):
    """The worker's side of one stream: read the request frame, dial the backend, answer, then
    splice the stream to the backend with the bytes that followed the frame."""

    def __init__(self, backend_port: int, splices: list):
        self.backend_port = backend_port
        self.splices = splices
        self.reader = preamble.FrameReader()
        self.leftover = b""

    def preludeReceived(self, data):
        if self.reader.done:
            self.leftover += data  # arrived while dialling (the stream is paused meanwhile)
            return
        payload, rest = self.reader.feed(data)
        if payload is None:
            return
        request = preamble.parse_request(payload)
        assert request.tag == "grpc"
        self.leftover = rest
        self.transport.pauseProducing()
        splice = Splice()
        self.splices.append(splice)
        endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.backend_port)
        endpoints.connectProtocol(endpoint, splice.b).addCallbacks(
            lambda _: self.dialled(splice), lambda failure: splice.abandon(failure)
        )

    def dialled(self, splice):
        self.transport.write(preamble.encode_accepted())
        self.handOff(splice.a, self.leftover)
        self.transport.resumeProducing()


@implementer(IHalfCloseableProtocol)
class FrontendCall(protocol.Protocol):
    """Writes the request frame and the body in one go, half-closes, reads the reply frame and
    then the backend's answer."""

    def __init__(self, body: bytes):
        self.body = body
        self.reader = preamble.FrameReader()
        self.reply = None
        self.answer = bytearray()
        self.done = defer.Deferred()

    def connectionMade(self):
        # Body bytes right behind the frame: the worker must not swallow them.
        self.transport.write(preamble.encode_request("grpc", "127.0.0.1:1") + self.body[:1000])
        self.transport.write(self.body[1000:])
        self.transport.loseWriteConnection()

    def dataReceived(self, data):
        if self.reply is None:
            payload, data = self.reader.feed(data)
            if payload is None:
                return
            self.reply = preamble.parse_reply(payload)
        self.answer += data

    def readConnectionLost(self):
        self.done.callback(None)

    def writeConnectionLost(self):
        pass


@pytest_twisted.inlineCallbacks
def test_a_yamux_stream_spliced_to_a_tcp_backend_after_its_preamble():
    backend = reactor.listenTCP(0, protocol.Factory.forProtocol(HashBack), interface="127.0.0.1")
    splices: list[Splice] = []
    frontend, worker, port = yield tunnel(
        lambda stream: WorkerStream(backend.getHost().port, splices)
    )
    try:
        body = random_bytes(4 * 1024 * 1024, 3)
        call = FrontendCall(body)
        frontend.openStream(call)
        yield call.done
        assert call.reply.accepted
        assert bytes(call.answer) == b"banner\n" + hashlib.sha256(body).hexdigest().encode()
        ending = yield splices[0].whenDone()
        assert ending.kind is EndingKind.NORMAL, ending
    finally:
        frontend.loseConnection()
        yield worker.whenClosed()
        yield port.stopListening()
        yield backend.stopListening()
