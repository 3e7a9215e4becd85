"""The carrier's own data path: writes coalesced per reactor turn, binary frames built and
parsed without Autobahn's per-message machinery, and Autobahn still in charge of everything
else (control frames, fragments, violations).  Real Autobahn at one end, and either real
Autobahn or a hand-written RFC 6455 client at the other."""

from __future__ import annotations

import os
import random
import struct

import pytest
import pytest_twisted
from autobahn.websocket.xormasker import create_xor_masker
from twisted.internet import defer, error, protocol, reactor
from twisted.internet.task import deferLater
from twisted.web.resource import Resource
from twisted.web.server import Site

from localai_tw.tunnel import wsframes
from localai_tw.tunnel.websocket import (
    DEFAULT_COALESCE_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    BearerTokenAuthorizer,
    TunnelWebSocketResource,
    connectWebSocket,
)

TOKEN = "frames-token"
PATH = b"/connect"


class Collector(protocol.Protocol):
    def __init__(self, expect: int = 0):
        self.received = bytearray()
        self.sizes: list[int] = []
        self.expect = expect
        self.got_all = defer.Deferred()
        self.ended = defer.Deferred()

    def dataReceived(self, data):
        self.sizes.append(len(data))
        self.received += data
        if self.expect and len(self.received) >= self.expect and not self.got_all.called:
            self.got_all.callback(bytes(self.received))

    def connectionLost(self, reason):
        self.ended.callback(reason.value)


class Echo(Collector):
    def dataReceived(self, data):
        super().dataReceived(data)
        self.transport.write(data)


@pytest.fixture
def server():
    accepted = []

    def factory(request, authorization):
        inner = server.inner_factory()
        accepted.append(inner)
        return inner

    root = Resource()
    root.putChild(b"connect", TunnelWebSocketResource(factory, BearerTokenAuthorizer(TOKEN)))
    port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")

    class server:
        inner_factory = Collector
        url = f"ws://127.0.0.1:{port.getHost().port}{PATH.decode()}"
        inners = accepted
        tcp_port = port.getHost().port

    yield server
    port.stopListening()


def bearer():
    return {"Authorization": f"Bearer {TOKEN}"}


def turn():
    return deferLater(reactor, 0, lambda: None)


# -- masking -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 13, 255, 256, 257, 1000, 65_536, 300_001])
@pytest.mark.parametrize("start", [0, 2, 14])
def test_masking_in_place_matches_autobahns_masker(size, start):
    rng = random.Random(size * 31 + start)
    payload = bytes(rng.getrandbits(8) for _ in range(min(size, 4096))) * (size // 4096 + 1)
    payload = payload[:size]
    key = os.urandom(4)
    buf = bytearray(b"h" * start + payload)
    wsframes.mask_in_place(buf, start, key)
    expected = create_xor_masker(key, size).process(payload) if size else b""
    assert bytes(buf) == b"h" * start + expected


@pytest.mark.parametrize("length,header", [
    (1, b"\x82\x01"), (125, b"\x82\x7d"), (126, b"\x82\x7e\x00\x7e"),
    (65_535, b"\x82\x7e\xff\xff"), (65_536, b"\x82\x7f" + struct.pack("!Q", 65_536)),
])
def test_binary_frame_headers_use_the_minimal_length_form(length, header):
    assert wsframes.binary_frame_header(length, False) == header
    masked = wsframes.binary_frame_header(length, True)
    assert masked[0] == header[0] and masked[1] == header[1] | 0x80 and masked[2:] == header[2:]


# -- coalescing --------------------------------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_the_writes_of_one_turn_are_one_message_and_keep_their_order(server):
    client = yield connectWebSocket(reactor, server.url, Collector, headers=bearer())
    yield turn()
    pieces = [bytes([65 + i]) * (i + 1) for i in range(20)]
    for piece in pieces:
        client.transport.write(piece)
    inner = None
    while inner is None or len(inner.received) < sum(map(len, pieces)):
        yield turn()
        inner = server.inners[0] if server.inners else None
    assert bytes(inner.received) == b"".join(pieces)
    assert inner.sizes == [sum(map(len, pieces))]  # one message, one dataReceived
    client.transport.loseConnection()
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_coalesced_messages_stay_within_the_coalescing_bound(server):
    total = 40 * 64 * 1024
    server.inner_factory = lambda: Collector(expect=total)
    client = yield connectWebSocket(reactor, server.url, Collector, headers=bearer())
    yield turn()
    chunk = os.urandom(64 * 1024)
    for _ in range(40):  # all in one turn: far more than one message may carry
        client.transport.write(chunk)
    assert client.transport._out_size < DEFAULT_COALESCE_BYTES  # flushed as it filled
    got = yield server.inners[0].got_all
    assert got == chunk * 40
    assert max(server.inners[0].sizes) <= DEFAULT_COALESCE_BYTES
    # Count messages, not deliveries: the receiver hands each read's part of a message over
    # as it arrives, so one message may take several dataReceived calls.
    stats = server.inners[0].transport._ws.trafficStats
    assert stats.incomingWebSocketMessages < 40
    assert stats.incomingOctetsAppLevel == total
    client.transport.loseConnection()
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_data_written_just_before_loseconnection_arrives_before_the_close(server):
    payload = os.urandom(100_000)
    server.inner_factory = lambda: Collector(expect=len(payload))
    client = yield connectWebSocket(reactor, server.url, Collector, headers=bearer())
    yield turn()
    client.transport.write(payload[:1000])
    client.transport.write(payload[1000:])
    client.transport.loseConnection()  # same turn: the held writes go out first
    end = yield server.inners[0].ended
    assert isinstance(end, error.ConnectionDone)
    assert bytes(server.inners[0].received) == payload
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_a_frame_autobahn_sends_itself_never_overtakes_held_data(server):
    client = yield connectWebSocket(reactor, server.url, Collector, headers=bearer())
    yield turn()
    client.transport.write(b"first")
    client.transport._ws.sendMessage(b"text", isBinary=False)  # Autobahn's own frame
    end = yield server.inners[0].ended
    assert isinstance(end, error.ConnectionLost) and "text message" in str(end)
    assert bytes(server.inners[0].received) == b"first"
    yield client.ended


@pytest_twisted.inlineCallbacks
def test_an_echo_of_every_size_round_trips_through_both_fast_paths(server):
    server.inner_factory = Echo
    sizes = [1, 2, 124, 125, 126, 127, 255, 256, 257, 65_535, 65_536, 65_537, 300_000]
    total = sum(sizes)
    client = yield connectWebSocket(reactor, server.url, lambda: Collector(expect=total),
                                    headers=bearer())
    rng = random.Random(3)
    sent = bytearray()
    for size in sizes:  # one turn per write: one message each, of exactly that size
        data = bytes(rng.getrandbits(8) for _ in range(min(size, 1024))) * (size // 1024 + 1)
        client.transport.write(data[:size])
        sent += data[:size]
        yield turn()
    echoed = yield client.got_all
    assert echoed == bytes(sent)
    client.transport.loseConnection()
    yield client.ended


class TypeCollector(Collector):
    """Records the type of every ``dataReceived`` argument; reads ``bytes`` only."""

    def __init__(self, expect: int = 0):
        super().__init__(expect)
        self.types: set[type] = set()

    def dataReceived(self, data):
        self.types.add(type(data))
        super().dataReceived(data)


class BufferCollector(TypeCollector):
    """Declares ``readsBuffers``, as a yamux session does."""

    readsBuffers = True


@pytest_twisted.inlineCallbacks
@pytest.mark.parametrize("inner,expected",
                         [(BufferCollector, {memoryview}), (TypeCollector, {bytes})])
def test_the_dialler_gets_unmasked_payload_without_a_copy_only_if_it_reads_views(
        server, inner, expected):
    """The server's frames are not masked: a protocol that reads views (a yamux session) is
    handed slices of the reads themselves; any other protocol still gets bytes."""
    server.inner_factory = Echo
    size = 600_000  # several messages, each over several reads
    client = yield connectWebSocket(reactor, server.url, lambda: inner(expect=size),
                                    headers=bearer())
    data = os.urandom(size)
    for start in range(0, size, 50_000):
        client.transport.write(data[start:start + 50_000])
        yield turn()
    echoed = yield client.got_all
    assert echoed == data
    assert client.types == expected
    client.transport.loseConnection()
    yield client.ended


class PausedBufferCollector(BufferCollector):
    """Reads buffers and holds its carrier paused from the start: every payload waits in the
    carrier while later reads arrive."""

    def connectionMade(self):
        self.transport.pauseProducing()


@pytest_twisted.inlineCallbacks
def test_held_payloads_survive_frame_headers_cut_across_reads(server):
    """A payload the paused carrier holds must not be a view of the buffer that keeps the start
    of a frame cut in its header (``_rx``): later reads change that buffer (a held view of it
    made them fail with BufferError and would have exposed bytes changed under it)."""
    client = yield connectWebSocket(reactor, server.url, PausedBufferCollector, headers=bearer())
    rng = random.Random(5)
    payloads = [bytes(rng.getrandbits(8) for _ in range(n)) for n in (3, 200, 70_000, 1, 126)]
    wire = b"".join(frame(p, mask=False) + p for p in payloads)
    ws = client.transport._ws
    # inside the header of every frame: f1 [0,5), f2 head [5,9), f3 head [209,219), f4 head
    # [70219,70221), f5 head [70222,70226)
    cuts = [1, 7, 212, 70_220, 70_224]
    assert len(wire) == 70_352
    for a, b in zip([0] + cuts, cuts + [len(wire)]):
        ws.dataReceived(wire[a:b])
    client.transport.resumeProducing()
    yield turn()
    assert bytes(client.received) == b"".join(payloads)
    client.transport.loseConnection()
    yield client.ended


# -- the fast receive path against a hand-written client ---------------------------------------


class RawClient(protocol.Protocol):
    """Speaks RFC 6455 by hand after a real upgrade, to send frames Autobahn never would."""

    def __init__(self):
        self.buffer = b""
        self.upgraded = defer.Deferred()
        self.ended = defer.Deferred()

    def connectionMade(self):
        self.transport.write(
            b"GET " + PATH + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")

    def dataReceived(self, data):
        self.buffer += data
        if not self.upgraded.called and b"\r\n\r\n" in self.buffer:
            head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101")
            self.upgraded.callback(None)

    def connectionLost(self, reason):
        self.ended.callback(reason.value)


def frame(payload: bytes, opcode: int = 2, fin: bool = True, mask: bool = True,
          length_form: str = "minimal") -> bytes:
    b0 = (0x80 if fin else 0) | opcode
    n = len(payload)
    if length_form == "16" or (length_form == "minimal" and 126 <= n <= 0xFFFF):
        head = struct.pack("!BBH", b0, 126, n)
    elif length_form == "64" or (length_form == "minimal" and n > 0xFFFF):
        head = struct.pack("!BBQ", b0, 127, n)
    else:
        head = bytes((b0, n))
    if not mask:
        return head
    head = bytes((head[0], head[1] | 0x80)) + head[2:]
    key = os.urandom(4)
    return head + key + (create_xor_masker(key, n).process(payload) if n else b"")


@defer.inlineCallbacks
def raw_client(server):
    client = RawClient()
    yield protocol.ClientCreator(reactor, lambda: client).connectTCP("127.0.0.1", server.tcp_port)
    yield client.upgraded
    while not server.inners:
        yield turn()
    return client


@pytest_twisted.inlineCallbacks
def test_frames_cut_at_every_byte_and_mixed_with_control_frames_and_fragments(server):
    rng = random.Random(11)
    parts = [bytes(rng.getrandbits(8) for _ in range(n)) for n in (1, 125, 126, 70_000, 9)]
    wire = (frame(parts[0]) + frame(b"ping!", opcode=9) + frame(parts[1])
            + frame(parts[2][:60], fin=False) + frame(parts[2][60:], opcode=0)  # fragmented
            + frame(parts[3]) + frame(b"", opcode=2) + frame(parts[4]))
    expected = b"".join(parts)
    server.inner_factory = lambda: Collector(expect=len(expected))
    client = yield raw_client(server)
    offset = 0
    while offset < len(wire):  # cut anywhere: inside headers, lengths, keys and payloads
        step = rng.choice([1, 2, 3, 7, 100, 5000])
        client.transport.write(wire[offset:offset + step])
        offset += step
        yield turn()
    got = yield server.inners[0].got_all
    assert got == expected
    # Autobahn answered the ping (an unmasked pong with the same payload).
    while b"\x8a\x05ping!" not in client.buffer:
        yield turn()
    client.transport.loseConnection()
    yield server.inners[0].ended


@pytest_twisted.inlineCallbacks
def test_a_frame_is_unmasked_and_delivered_read_by_read_not_collected_whole(server):
    """Each read's part of a frame's payload reaches the inner protocol at once, unmasked at
    the key's running offset (1, 2, 3 and 0 mod 4), before the rest of the frame arrives; the
    frame after it, cut inside its header, still parses."""
    rng = random.Random(5)
    payload = bytes(rng.getrandbits(8) for _ in range(200_000))
    tail = b"after"
    wire = frame(payload) + frame(tail)
    head = 2 + 8 + 4  # 64-bit length form, masking key
    server.inner_factory = lambda: Collector(expect=len(payload) + len(tail))
    client = yield raw_client(server)
    inner = server.inners[0]
    offset, delivered = 0, 0
    for step in (head + 1, 2, 3, 4, 5, 65_536, 7, 100_000):
        client.transport.write(wire[offset:offset + step])
        offset += step
        deadline = reactor.seconds() + 10  # every payload byte sent so far (bounded: no hang)
        while len(inner.received) < offset - head and reactor.seconds() < deadline:
            yield deferLater(reactor, 0.001, lambda: None)
        delivered = offset - head
        assert bytes(inner.received) == payload[:delivered]
    client.transport.write(wire[offset:len(payload) + head + 3])  # the next header, cut
    offset = len(payload) + head + 3
    deadline = reactor.seconds() + 10
    while len(inner.received) < len(payload) and reactor.seconds() < deadline:
        yield deferLater(reactor, 0.001, lambda: None)
    assert bytes(inner.received) == payload
    client.transport.write(wire[offset:])
    got = yield inner.got_all
    assert got == payload + tail
    assert inner.transport._ws.trafficStats.incomingWebSocketMessages == 2
    client.transport.loseConnection()
    yield inner.ended


@pytest.mark.parametrize("bad", [
    pytest.param(frame(b"x" * 10, mask=False), id="unmasked-from-client"),
    pytest.param(frame(b"x" * 10, length_form="16"), id="non-minimal-16-bit-length"),
    pytest.param(frame(b"x" * 200, length_form="64"), id="non-minimal-64-bit-length"),
    pytest.param(bytes((0x82 | 0x40, 0x81)) + b"\0" * 5, id="rsv-bit"),
    pytest.param(bytes((0x83, 0x81)) + b"\0" * 5, id="reserved-opcode"),
    pytest.param(struct.pack("!BBQ", 0x82, 0xFF, DEFAULT_MAX_MESSAGE_BYTES + 1) + b"\0" * 4,
                 id="above-bound-refused-at-its-header"),
])
@pytest_twisted.inlineCallbacks
def test_a_frame_autobahn_refuses_still_ends_the_connection(server, bad):
    client = yield raw_client(server)
    client.transport.write(frame(b"good") + bad)
    end = yield server.inners[0].ended
    assert isinstance(end, error.ConnectionLost)
    assert bytes(server.inners[0].received) == b"good"
    yield client.ended


class TypeEcho(TypeCollector):
    def dataReceived(self, data):
        super().dataReceived(data)
        self.transport.write(bytes(data))


class BufferEcho(TypeEcho):
    readsBuffers = True


@pytest.mark.parametrize("reads_buffers", [False, True], ids=["bytes-reader", "buffer-reader"])
@pytest_twisted.inlineCallbacks
def test_an_inner_protocol_gets_bytes_unless_it_reads_buffers(server, reads_buffers):
    """The fast paths hand the carrier the unmasked payload as a buffer (the server side: masked
    frames; the client side: unmasked ones); an inner protocol that does not declare
    ``readsBuffers`` still gets ``bytes`` from both, and one that does gets the same bytes."""
    kind = BufferCollector if reads_buffers else TypeCollector
    server.inner_factory = BufferEcho if reads_buffers else TypeEcho
    rng = random.Random(9)
    sent = b"".join(bytes(rng.getrandbits(8) for _ in range(n)) for n in (1, 300, 70_000))
    client = yield connectWebSocket(reactor, server.url, lambda: kind(expect=len(sent)),
                                    headers=bearer())
    for start, stop in ((0, 1), (1, 301), (301, len(sent))):
        client.transport.write(sent[start:stop])
        yield turn()
    echoed = yield client.got_all
    assert echoed == sent
    assert bytes(server.inners[0].received) == sent
    if not reads_buffers:
        assert server.inners[0].types == {bytes}
        assert client.types == {bytes}
    client.transport.loseConnection()
    yield client.ended
