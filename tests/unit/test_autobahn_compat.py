"""One test per Autobahn internal the carrier relies on (``localai_tw/tunnel/autobahn_compat.py``
lists them), each named after its entry there: an Autobahn that renamed or changed one fails
the test of that name, instead of an integration test at random.  Real Autobahn protocols,
connected to each other through in-memory transports; bytes are fed through their public
``dataReceived`` except in the test of ``parse``."""

from __future__ import annotations

import os
import re
from pathlib import Path

from autobahn.twisted.websocket import (
    WebSocketClientFactory,
    WebSocketClientProtocol,
    WebSocketServerFactory,
    WebSocketServerProtocol,
)
from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport

from localai_tw.tunnel import autobahn_compat as ab

PACKAGE = Path(__file__).resolve().parents[2] / "localai_tw"


class Transport(StringTransport):
    """A TCP transport's tolerance: Autobahn unregisters a producer it may never have set."""

    def unregisterProducer(self):
        self.producer = None


class Server(WebSocketServerProtocol):
    def onConnect(self, request):
        self.messages = []

    def onMessage(self, payload, isBinary):
        self.messages.append((payload, isBinary))


class Client(WebSocketClientProtocol):
    refused = None

    def failHandshake(self, reason):
        self.refused = ab.refusal_status(self)
        return super().failHandshake(reason)


def factories(server_options=None, **options):
    clock = task.Clock()
    server = WebSocketServerFactory(reactor=clock)
    server.protocol = Server
    client = WebSocketClientFactory("ws://127.0.0.1:9/t", reactor=clock)
    client.protocol = Client
    # logging is a factory attribute the protocol copies, not a protocol option
    attributes = {k: options.pop(k) for k in ("logFrames", "logOctets") if k in options}
    for factory in (server, client):
        factory.setProtocolOptions(**{"openHandshakeTimeout": 0, "autoPingInterval": 0, **options})
        for name, value in attributes.items():
            setattr(factory, name, value)
    server.setProtocolOptions(**(server_options or {}))
    return server, client


def unopened(server_options=None, **options):
    """A server and a client protocol on in-memory transports, before the opening handshake."""
    server_factory, client_factory = factories(server_options, **options)
    server = server_factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
    client = client_factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 9))
    server.makeConnection(Transport())
    client.makeConnection(Transport())
    return server, client


def opened(server_options=None, **options):
    """The same pair after the opening handshake; both transports emptied."""
    server, client = unopened(server_options, **options)
    server.dataReceived(client.transport.value())
    client.transport.clear()
    client.dataReceived(server.transport.value())
    server.transport.clear()
    assert ab.is_open(server) and ab.is_open(client)
    return server, client


def client_frame(payload: bytes, **kwargs) -> bytes:
    """The frame(s) the client sends for one binary message, as Autobahn writes them."""
    server, client = opened(**kwargs)
    client.sendMessage(payload, isBinary=True)
    return client.transport.value()


def test_state_constants():
    constants = {ab.STATE_OPEN, ab.STATE_CONNECTING, ab.STATE_PROXY_CONNECTING,
                 ab.SEND_STATE_GROUND}
    assert all(isinstance(c, int) for c in constants)
    assert len(constants - {ab.SEND_STATE_GROUND}) == 3
    server, client = unopened()
    assert server.state == ab.STATE_CONNECTING
    assert not ab.is_open(server) and not ab.receive_ready(server)
    server, client = opened()
    assert ab.is_open(server) and server.state == ab.STATE_OPEN
    assert ab.receive_ready(server) and ab.send_ready(server, False)
    server.beginMessage(isBinary=True)  # Autobahn in the middle of a message of its own
    assert not ab.send_ready(server, False)
    client.sendClose(code=1000)
    assert not ab.is_open(client) and not ab.receive_ready(client)


def test_parse():
    server, client = opened()
    frame = client_frame(b"payload")
    ab.parse(server, frame[:3])
    assert server.messages == []
    ab.parse(server, frame[3:])
    assert server.messages == [(b"payload", True)]


def test_receive_buffer():
    server, client = opened()
    frame = client_frame(b"held")
    server.dataReceived(frame[:1])  # not even a header: Autobahn holds the byte
    assert ab.take_received(server) == frame[:1]
    assert ab.take_received(server) == b""  # taken: Autobahn holds nothing now
    ab.give_received(server, frame)
    assert server.messages == []  # held only, until parsed
    ab.consume_received(server)
    assert server.messages == [(b"held", True)]


def test_receive_position():
    server, client = opened()
    frame = client_frame(b"x" * 100)
    server.dataReceived(frame[:-10])  # inside the frame
    assert not ab.receive_ready(server)
    server.dataReceived(frame[-10:])
    assert ab.receive_ready(server)
    # a fragmented message: after its first (non-final) frame Autobahn is inside the message
    server, client = opened()
    client.beginMessage(isBinary=True)
    client.sendMessageFrame(b"first")
    server.dataReceived(client.transport.value())
    assert server.messages == [] and not ab.receive_ready(server)


def compressed():
    """A server that negotiated permessage-deflate with its client."""
    from autobahn.websocket.compress import PerMessageDeflateOffer, PerMessageDeflateOfferAccept

    server_factory, client_factory = factories()
    server_factory.setProtocolOptions(
        perMessageCompressionAccept=lambda offers: PerMessageDeflateOfferAccept(offers[0]))
    client_factory.setProtocolOptions(perMessageCompressionOffers=[PerMessageDeflateOffer()])
    server = server_factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
    server.makeConnection(Transport())
    client = client_factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 9))
    client.makeConnection(Transport())
    server.dataReceived(client.transport.value())
    assert ab.is_open(server)
    return server


def test_features():
    server, client = opened()
    assert ab.receive_ready(server) and ab.send_ready(server, False)
    assert ab.send_ready(client, True) and not ab.writes_itself(client)
    for plain_only in (opened(logFrames=True)[0], opened(logOctets=True)[0], compressed()):
        assert not ab.receive_ready(plain_only) and not ab.send_ready(plain_only, False)
    assert ab.writes_itself(opened(logOctets=True)[0])
    timed, _ = opened()
    timed.setTrackTimings(True)
    assert not ab.receive_ready(timed) and not ab.send_ready(timed, False)
    server.send_queue.append((b"x", True))  # what a sync send leaves for later
    assert ab.writes_itself(server) and not ab.send_ready(server, False)
    # an auto-ping waiting for its pong
    server, client = opened(autoPingTimeout=5)
    server._sendAutoPing()  # what Autobahn's auto-ping timer calls
    assert server.transport.value()[:1] == b"\x89"  # the ping went out
    assert not ab.receive_ready(server)
    server.autoPingTimeoutCall.cancel()


def test_options():
    server, client = opened(maxFramePayloadSize=1000, maxMessagePayloadSize=2000)
    assert ab.receive_rules(server) == (True, 1000, 2000)
    assert ab.receive_rules(client) == (False, 1000, 2000)
    assert ab.send_masked(client) and not ab.send_masked(server)
    lax, _ = opened({"requireMaskedClientFrames": False})
    assert ab.receive_rules(lax)[0] is None
    _, unmasking = opened(applyMask=False)
    assert not ab.send_ready(unmasking, True) and ab.send_ready(unmasking, False)
    # the bound is Autobahn's: a frame above it fails the connection
    server, client = opened(maxFramePayloadSize=10, maxMessagePayloadSize=10)
    server.dataReceived(client_frame(b"y" * 11))
    assert server.messages == [] and not ab.is_open(server)


def stats(protocol) -> dict:
    return dict(protocol.trafficStats.__json__())


def test_traffic_stats():
    # received: the counters Autobahn moves for one binary message are the ones we move
    frame = client_frame(b"z" * 300)
    by_autobahn, _ = opened()
    before = stats(by_autobahn)
    by_autobahn.dataReceived(frame)
    ours, _ = opened()
    ab.count_wire_in(ours, len(frame))
    ab.count_message_in(ours, 300)
    assert stats(ours) == stats(by_autobahn) != before
    # sent, as the server (unmasked) and as the client (masked)
    for side in (0, 1):
        by_autobahn = opened()[side]
        by_autobahn.sendMessage(b"w" * 300, isBinary=True)
        ours = opened()[side]
        ab.count_message_out(ours, 300, len(by_autobahn.transport.value()))
        assert stats(ours) == stats(by_autobahn)
    # Autobahn's own frames (sendData): the wire counter, before and after the open
    by_autobahn, _ = opened()
    by_autobahn.sendPing(b"p")
    ours, _ = opened()
    ab.count_wire_out(ours, len(by_autobahn.transport.value()))
    assert stats(ours) == stats(by_autobahn)
    ours, _ = unopened()
    ab.count_wire_out(ours, 7)
    assert ours.trafficStats.preopenOutgoingOctetsWireLevel == 7


def test_send_data_hook():
    class Hooked(Server):
        def sendData(self, data, sync=False, chopsize=None):
            sent.append(data)
            super().sendData(data, sync, chopsize)

    sent = []
    server, client = opened()
    server.__class__ = Hooked
    client.sendPing(b"ping")
    server.dataReceived(client.transport.value())  # Autobahn answers with a pong
    assert len(sent) == 1 and sent[0][0] == 0x8A and sent[0].endswith(b"ping")
    server.sendClose(code=1000)
    assert len(sent) == 2 and sent[1][0] == 0x88


def test_refusal_status():
    _, client = unopened()
    client.dataReceived(b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\n"
                        b"Content-Length: 0\r\n\r\n")
    assert client.refused == 401
    _, client = unopened()
    client.dataReceived(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                        b"Connection: Upgrade\r\nSec-WebSocket-Accept: wrong\r\n\r\n")
    assert client.refused is None  # a bad 101 is no refusal status


def test_drop():
    server, client = opened()
    ab.drop(server)
    assert server.transport.disconnecting
    assert server.transport.value() == b""  # no close frame: dropped, not closed


def test_c_masker():
    assert ab.C_MASKER, "Autobahn's NVX C masker (_nvx_xormasker) is missing"
    key = os.urandom(4)
    data = os.urandom(5000)
    buf = bytearray(b"head" + data)
    ab.c_mask_in_place(buf, 4, len(data), key)
    assert bytes(buf) == b"head" + ab.py_mask(key, data)


def test_py_mask():
    key = bytes([1, 2, 3, 4])
    data = bytes(range(10))
    assert ab.py_mask(key, data) == bytes(b ^ key[i % 4] for i, b in enumerate(data))


def test_forget_handshake():
    server, client = opened()
    kept = {name: getattr(server, name) for name in ab.HANDSHAKE_LEFTOVERS}
    assert kept["http_headers"] and kept["http_request_data"], "the names moved"
    assert all(value is not None for value in kept.values()), kept
    ab.forget_handshake(server)
    assert all(getattr(server, name) is None for name in ab.HANDSHAKE_LEFTOVERS)
    client.sendMessage(b"still open", isBinary=True)  # Autobahn needs none of it once open
    server.dataReceived(client.transport.value())
    assert server.messages == [(b"still open", True)]
    server.sendMessage(b"back", isBinary=True)
    assert server.transport.value()


#: What only autobahn_compat may spell: Autobahn's internal modules and names.
INTERNALS = re.compile(
    r"autobahn\.websocket\.(protocol|xormasker)|_nvx_xormasker|WebSocketProtocol\.|"
    r"\._dataReceived\b|\.consumeData\b|\.current_frame\b|\.inside_message\b|"
    r"_perMessageCompress|\.logFrames\b|\.logOctets\b|\.trackedTimings\b|autoPingTimeoutCall|"
    r"\.send_queue\b|\.send_state\b|\.trafficStats\b|http_status_line|\.dropConnection\(|"
    r"\.maskServerFrames\b|\.maskClientFrames\b|\.applyMask\b|requireMaskedClientFrames|"
    r"\.maxFramePayloadSize\b|\.maxMessagePayloadSize\b|\.isServer\b|\bself\.state\b|"
    r"\bself\.data\b"
)


def test_only_the_compat_module_uses_autobahn_internals():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "autobahn_compat.py":
            continue
        text = path.read_text()
        if "autobahn" not in text:  # neither imports Autobahn nor the compat module
            continue
        for number, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if INTERNALS.search(code):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert offenders == []
