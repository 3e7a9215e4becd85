"""A worker that holds a tunnel credential floods a real frontend with requests for answers (yamux
pings, WebSocket pings, SYNs) and never reads: the frontend's buffers and memory stay flat and
another worker's tunnel is served throughout.

The flooder is a plain blocking socket in a thread (a real client on a real connection to the
frontend's real listening port), with a small receive buffer so the frontend's answers back up
fast, as they would behind a slow or hostile peer on the internet.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task, threads
from twisted.internet.protocol import Protocol

from localai_tw.mux.frame import FLAG_SYN, Frame, encode
from tests.integration.support import eventually, within
from tests.integration.harness_tunnel import EchoBackend

MiB = 1024 * 1024
FLOOD_SECONDS = 5.0


def masked_frame(opcode: int, payload: bytes) -> bytes:
    """A client frame (RFC 6455 5.2) with a zero masking key: the payload goes as it is."""
    n = len(payload)
    if n <= 125:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n <= 0xFFFF:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return head + b"\0\0\0\0" + payload


def flood_chunk(kind: str) -> bytes:
    """About 64 KiB of requests for answers, as the flooder sends them again and again."""
    if kind == "yamux pings":
        return masked_frame(2, b"".join(encode(Frame.ping(i)) for i in range(5400)))
    if kind == "websocket pings":
        return b"".join(masked_frame(9, os.urandom(125)) for _ in range(500))
    if kind == "SYNs":
        return masked_frame(2, b"".join(encode(Frame.window_update(1 + 2 * i, 0, FLAG_SYN))
                                        for i in range(5400)))
    raise ValueError(kind)


class Flooder:
    """Upgrades with the worker's credential, then sends ``kind`` for ``seconds``, reading
    nothing."""

    def __init__(self, address: str, node_id: str, credential: str, kind: str):
        host, port = address.split(":")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, int(port)))
        self.sock.sendall(
            f"GET /api/cluster/connect?id={node_id} HTTP/1.1\r\nHost: {address}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            f"Authorization: Bearer {credential}\r\n\r\n".encode())
        self.chunk = flood_chunk(kind)
        self.sent = 0
        self.seconds = 0.0  # how long the frontend let us send
        self.stopped = threading.Event()

    def upgrade(self) -> bytes:
        head = b""
        while b"\r\n\r\n" not in head:
            data = self.sock.recv(4096)
            if not data:
                break
            head += data
        return head

    def flood(self, seconds: float) -> int:
        self.sock.settimeout(0.1)
        view = memoryview(self.chunk)
        offset = 0
        started = time.monotonic()
        deadline = started + seconds
        while time.monotonic() < deadline and not self.stopped.is_set():
            try:
                n = self.sock.send(view[offset:])
            except socket.timeout:
                continue  # the frontend stopped reading us: good
            except OSError:
                break     # the frontend dropped us: good too
            self.sent += n
            offset = (offset + n) % len(self.chunk)
            self.seconds = time.monotonic() - started
        return self.sent

    def close(self):
        self.stopped.set()
        self.sock.close()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def buffered(session) -> int:
    """Bytes the frontend holds for this tunnel's peer: the carrier's message being built and
    the TCP transport's write buffer (the kernel's buffers are not ours)."""
    carrier = session.transport
    tcp = carrier._ws.transport
    return (carrier._out_size + len(tcp.dataBuffer) - tcp.offset + tcp._tempDataLen)


class Collector(Protocol):
    def __init__(self, expect: bytes):
        self.expect = expect
        self.received = b""
        self.done = defer.Deferred()

    def dataReceived(self, data):
        self.received += data
        if self.received == self.expect and not self.done.called:
            self.done.callback(None)


@pytest.mark.parametrize("kind", ["yamux pings", "websocket pings", "SYNs"])
@pytest_twisted.ensureDeferred
async def test_a_worker_that_never_reads_does_not_grow_the_frontend(db, frontends, workers,
                                                                   kind):
    frontend = await frontends("replica-a")
    served = await workers(frontend.nodes, "w-served", lambda stream: EchoBackend())
    await served.attach_to(frontend)
    hostile = await workers(frontend.nodes, "w-hostile", lambda stream: EchoBackend())

    flooder = Flooder(frontend.address, hostile.node_id, hostile.credential, kind)
    try:
        head = await threads.deferToThread(flooder.upgrade)
        assert head.startswith(b"HTTP/1.1 101")
        await eventually(lambda: frontend.registry.held(hostile.node_id) is not None,
                         what="the hostile tunnel to be attached")
        session = frontend.registry.held(hostile.node_id).session
        rss_before = rss_bytes()
        samples = []

        def sample():
            samples.append((buffered(session) if session.isOpen else 0, rss_bytes()))

        sampling = task.LoopingCall(sample)
        sampling.start(0.05)
        flooding = threads.deferToThread(flooder.flood, FLOOD_SECONDS)
        round_trips = []
        until = reactor.seconds() + FLOOD_SECONDS
        while not flooding.called or reactor.seconds() < until:
            # Another worker's tunnel is served throughout.
            started = reactor.seconds()
            entry = frontend.registry.held(served.node_id)
            collector = Collector(b"ping %d" % len(round_trips))
            stream = entry.session.openStream(collector, collector.expect)
            await within(collector.done, 2)
            stream.loseConnection()
            round_trips.append(reactor.seconds() - started)
            await task.deferLater(reactor, 0.1, lambda: None)
        sent = await flooding
        sampling.stop()
        sample()
    finally:
        flooder.close()

    most_buffered = max(b for b, _ in samples)
    rss_growth = max(r for _, r in samples) - rss_before
    print(f"\n{kind}: flooder sent {sent / MiB:.1f} MiB in {flooder.seconds:.1f} s; "
          f"frontend buffered at most {most_buffered / 1024:.0f} KiB, "
          f"RSS +{rss_growth / MiB:.1f} MiB; "
          f"{len(round_trips)} round trips on the other tunnel, slowest "
          f"{max(round_trips) * 1000:.0f} ms; session open: {session.isOpen}")
    assert most_buffered < 1 * MiB
    assert rss_growth < 16 * MiB
    assert len(round_trips) >= 10  # one every 0.1 s, each within 2 s
    if kind == "SYNs":
        assert "protocol error" in str(session.ending)
