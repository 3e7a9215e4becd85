"""The WebSocket carrier over real TCP loopback with real Autobahn at both ends."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import pytest_twisted
import treq
from twisted.internet import defer, error, protocol, reactor
from twisted.internet.interfaces import IPushProducer
from twisted.web.resource import Resource
from twisted.web.server import Site
from zope.interface import implementer

from localai_tw.tunnel import autobahn_compat as ab
from localai_tw.tunnel.websocket import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BearerTokenAuthorizer,
    ConnectRefused,
    HandshakeFailed,
    TunnelWebSocketResource,
    connectWebSocket,
)

TOKEN = "s3cret-token"
PATH = b"/api/cluster/connect"


class Collector(protocol.Protocol):
    """Keeps every byte and says when a number of them arrived and how the connection ended."""

    def __init__(self, expect: int = 0):
        self.received = bytearray()
        self.expect = expect
        self.got_all = defer.Deferred()
        self.ended = defer.Deferred()
        self.reads = 0

    def dataReceived(self, data):
        self.reads += 1
        self.received += data
        if self.expect and len(self.received) >= self.expect and not self.got_all.called:
            self.got_all.callback(bytes(self.received))

    def connectionLost(self, reason):
        self.ended.callback(reason.value)  # the exception, so the Deferred does not errback


class Echo(Collector):
    def dataReceived(self, data):
        super().dataReceived(data)
        self.transport.write(data)


class Server:
    """A twisted.web site with the carrier mounted under a nested path."""

    def __init__(self, inner_factory, authorizer):
        self.accepted = []

        def factory(request, authorization):
            inner = inner_factory()
            self.accepted.append((request.args, authorization, inner))
            return inner

        root = Resource()
        api = Resource()
        cluster = Resource()
        root.putChild(b"api", api)
        api.putChild(b"cluster", cluster)
        cluster.putChild(b"connect", TunnelWebSocketResource(factory, authorizer))
        self.port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.url = f"ws://127.0.0.1:{self.port.getHost().port}{PATH.decode()}"
        self.http_url = "http" + self.url[2:]

    def inner(self, index=0):
        return self.accepted[index][2]


@pytest.fixture
def servers():
    made = []

    def make(inner_factory=Echo, authorizer=None):
        server = Server(inner_factory, authorizer or BearerTokenAuthorizer(TOKEN))
        made.append(server)
        return server

    yield make
    for server in made:
        server.port.stopListening()


def bearer(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


@defer.inlineCallbacks
def raw_exchange(port: int, request: bytes):
    """Send ``request`` on a plain TCP connection; return every byte the server sent."""
    collector = Collector()
    endpoint_proto = yield protocol.ClientCreator(reactor, lambda: collector).connectTCP(
        "127.0.0.1", port
    )
    endpoint_proto.transport.write(request)
    yield collector.ended
    return bytes(collector.received)


UPGRADE_HEAD = (
    b"GET " + PATH + b"?id=n1 HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n"
)


@pytest_twisted.inlineCallbacks
def test_echo_over_the_inner_protocol(servers):
    server = servers()
    client = yield connectWebSocket(
        reactor, server.url + "?id=node-1", lambda: Collector(expect=11), headers=bearer()
    )
    client.transport.write(b"hello")
    client.transport.write(b" world")
    echoed = yield client.got_all
    assert echoed == b"hello world"
    args, authorization, _ = server.accepted[0]
    assert args == {b"id": [b"node-1"]} and authorization is None
    client.transport.loseConnection()
    client_end = yield client.ended
    server_end = yield server.inner().ended
    assert isinstance(client_end, error.ConnectionDone)
    assert isinstance(server_end, error.ConnectionDone)


@pytest_twisted.inlineCallbacks
def test_a_held_tunnel_keeps_neither_its_upgrade_request_nor_the_parsed_handshake(servers):
    """A fleet's idle tunnels cost memory each: the HTTP request that was upgraded (its channel,
    headers and buffers) is garbage once the inner protocol is built."""
    requests, inners = [], []

    def factory(request, authorization):
        requests.append(weakref.ref(request))
        inners.append(Echo())
        return inners[-1]

    server = servers()
    cluster = server.port.factory.resource.children[b"api"].children[b"cluster"]
    cluster.putChild(b"connect", TunnelWebSocketResource(factory, BearerTokenAuthorizer(TOKEN)))
    client = yield connectWebSocket(reactor, server.url, lambda: Collector(expect=2),
                                    headers=bearer())
    client.transport.write(b"hi")
    assert (yield client.got_all) == b"hi"
    gc.collect()
    assert len(requests) == 1 and requests[0]() is None
    # nor does Autobahn keep the request it parsed (its headers, the raw request and response)
    websocket = inners[0].transport._ws
    assert all(getattr(websocket, name) is None for name in ab.HANDSHAKE_LEFTOVERS)
    client.transport.loseConnection()
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_missing_credential_gets_plain_401_without_upgrade(servers):
    server = servers()
    response = yield treq.get(server.http_url)
    assert response.code == 401
    assert response.headers.getRawHeaders(b"www-authenticate") == [b"Bearer"]
    yield response.content()
    answer = yield raw_exchange(server.port.getHost().port, UPGRADE_HEAD + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 401 ")
    assert b" 101 " not in answer and b"Sec-WebSocket-Accept" not in answer
    assert server.accepted == []


@pytest.mark.parametrize(
    "header",
    [
        "Bearer wrong-token",
        "Basic " + TOKEN,
        "Bearer",
        "Bearer ",
        TOKEN,
    ],
)
@pytest_twisted.inlineCallbacks
def test_wrong_credential_is_refused_with_the_status_kept(servers, header):
    server = servers()
    with pytest.raises(HandshakeFailed) as caught:
        yield connectWebSocket(reactor, server.url, Collector, headers={"Authorization": header})
    assert caught.value.status == 401
    assert server.accepted == []


@pytest_twisted.inlineCallbacks
def test_scheme_is_case_insensitive(servers):
    server = servers()
    client = yield connectWebSocket(
        reactor, server.url, Collector, headers={"Authorization": f"bEaReR {TOKEN}"}
    )
    client.transport.loseConnection()
    yield client.ended


@pytest.mark.parametrize("header", ["Bearer ", "Bearer x", "Bearer s3cret-token"])
@pytest_twisted.inlineCallbacks
def test_empty_configured_token_refuses_everyone(servers, header):
    server = servers(authorizer=BearerTokenAuthorizer(""))
    with pytest.raises(HandshakeFailed) as caught:
        yield connectWebSocket(reactor, server.url, Collector, headers={"Authorization": header})
    assert caught.value.status == 401
    answer = yield raw_exchange(
        server.port.getHost().port,
        UPGRADE_HEAD + f"Authorization: {header}\r\n\r\n".encode(),
    )
    assert answer.startswith(b"HTTP/1.1 401 ")


@pytest_twisted.inlineCallbacks
def test_an_authorizer_chooses_its_status_and_may_answer_later(servers):
    def pending_node(request):
        return defer.fail(ConnectRefused(403, "awaiting approval"))

    later = defer.Deferred()
    server = servers(authorizer=pending_node)
    with pytest.raises(HandshakeFailed) as caught:
        yield connectWebSocket(reactor, server.url, Collector, headers=bearer())
    assert caught.value.status == 403

    slow = servers(authorizer=lambda request: later)
    dialling = connectWebSocket(reactor, slow.url, Collector, headers=bearer())
    reactor.callLater(0, later.callback, {"node": "n1"})
    client = yield dialling
    assert slow.accepted[0][1] == {"node": "n1"}
    client.transport.loseConnection()
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_authorizer_crash_is_a_500_never_an_upgrade(servers):
    def broken(request):
        raise KeyError("database row")

    server = servers(authorizer=broken)
    with pytest.raises(HandshakeFailed) as caught:
        yield connectWebSocket(reactor, server.url, Collector, headers=bearer())
    assert caught.value.status == 500
    assert server.accepted == []


@pytest_twisted.inlineCallbacks
def test_authorized_plain_get_is_told_to_upgrade(servers):
    server = servers()
    response = yield treq.get(server.http_url, headers=bearer())
    assert response.code == 426
    yield response.content()


@pytest_twisted.inlineCallbacks
def test_text_message_ends_the_session_as_a_protocol_error(servers):
    server = servers()
    client = yield connectWebSocket(reactor, server.url, Collector, headers=bearer())
    client.transport.write(b"binary is fine")
    client.transport._ws.sendMessage(b"but text is not", isBinary=False)
    server_end = yield server.inner().ended
    client_end = yield client.ended
    assert isinstance(server_end, error.ConnectionLost) and "text message" in str(server_end)
    assert bytes(server.inner().received) == b"binary is fine"
    assert isinstance(client_end, error.ConnectionLost)


@pytest_twisted.inlineCallbacks
def test_zero_length_messages_are_skipped(servers):
    server = servers()
    client = yield connectWebSocket(reactor, server.url, lambda: Collector(expect=2), headers=bearer())
    websocket = client.transport._ws
    websocket.sendMessage(b"", isBinary=True)
    websocket.sendMessage(b"a", isBinary=True)
    websocket.sendMessage(b"", isBinary=True)
    websocket.sendMessage(b"b", isBinary=True)
    got = yield client.got_all
    assert got == b"ab"
    assert server.inner().reads == 2  # the empty messages never reached the inner protocol
    client.transport.loseConnection()
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_stream_split_arbitrarily_across_messages_arrives_intact(servers):
    rng = random.Random(7)
    payload = bytes(rng.getrandbits(8) for _ in range(300_000))
    server = servers()
    client = yield connectWebSocket(
        reactor, server.url, lambda: Collector(expect=len(payload)), headers=bearer()
    )
    offset = 0
    while offset < len(payload):
        size = rng.choice([1, 2, 3, 11, 12, 13, 4096, 65_537])
        client.transport.write(payload[offset : offset + size])
        offset += size
    echoed = yield client.got_all
    assert echoed == payload
    client.transport.loseConnection()
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_a_write_larger_than_the_message_bound_is_split_not_refused(servers):
    payload = b"z" * (DEFAULT_MAX_MESSAGE_BYTES * 2 + 5)
    server = servers()
    client = yield connectWebSocket(
        reactor, server.url, lambda: Collector(expect=len(payload)), headers=bearer()
    )
    client.transport.write(payload)
    echoed = yield client.got_all
    assert echoed == payload
    client.transport.loseConnection()
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_a_message_above_the_bound_ends_the_connection(servers):
    server = servers()
    client = yield connectWebSocket(
        reactor,
        server.url,
        Collector,
        headers=bearer(),
        max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES * 4,
    )
    client.transport.write(b"y" * (DEFAULT_MAX_MESSAGE_BYTES + 1))
    server_end = yield server.inner().ended
    yield client.ended
    assert isinstance(server_end, error.ConnectionLost)
    assert len(server.inner().received) == 0


@implementer(IPushProducer)
class Flood:
    """A push producer writing ``total`` bytes as fast as its consumer lets it."""

    def __init__(self, transport, total: int, chunk: int = 16 * 1024):
        self.transport = transport
        self.total = total
        self.chunk = b"f" * chunk
        self.sent = 0
        self.paused = False
        self.was_paused = defer.Deferred()

    def pauseProducing(self):
        self.paused = True
        if not self.was_paused.called:
            self.was_paused.callback(self.sent)

    def resumeProducing(self):
        self.paused = False
        self.run()

    def stopProducing(self):
        self.paused = True

    def run(self):
        while not self.paused and self.sent < self.total:
            self.transport.write(self.chunk)
            self.sent += len(self.chunk)
        if self.sent >= self.total:
            self.transport.unregisterProducer()


class PausedAtStart(Collector):
    def connectionMade(self):
        self.transport.pauseProducing()


@pytest_twisted.inlineCallbacks
def test_backpressure_both_ways_a_paused_reader_parks_the_remote_writer(servers):
    total = 64 * 1024 * 1024
    server = servers(inner_factory=lambda: PausedAtStart(expect=total))
    client = yield connectWebSocket(reactor, server.url, Collector, headers=bearer())
    flood = Flood(client.transport, total)
    client.transport.registerProducer(flood, True)
    flood.run()
    sent_when_parked = yield flood.was_paused
    # The server's inner protocol paused its carrier, which stopped reading TCP; the socket
    # buffers filled and the client's TCP transport paused the producer registered with the
    # client carrier, long before everything was offered.
    assert sent_when_parked < total // 4
    carrier = server.inner().transport
    held = sum(map(len, carrier._inbound_held))
    assert held <= DEFAULT_MAX_MESSAGE_BYTES + 64 * 1024
    assert len(server.inner().received) == 0
    carrier.resumeProducing()
    received = yield server.inner().got_all
    assert len(received) == total
    client.transport.loseConnection()
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_refused_tcp_connection_fails_with_the_connection_error():
    port = reactor.listenTCP(0, protocol.Factory(), interface="127.0.0.1")
    number = port.getHost().port
    yield port.stopListening()
    with pytest.raises(error.ConnectError):
        yield connectWebSocket(reactor, f"ws://127.0.0.1:{number}/x", Collector)
