"""``set_write_through`` (``web/sockets.py``), on real loopback sockets under a Twisted TCP
transport driven by hand: a write reaches the kernel in the same call when nothing waits
before it and the kernel's unsent bytes are below the gate; otherwise Twisted's buffered
write takes it, and bytes are never reordered, lost or doubled."""

from __future__ import annotations

import fcntl
import socket
import sys

import pytest
from twisted.internet import tcp
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactor

from localai_tw.web.sockets import not_sent_bytes, set_write_through

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the write-through's gate is a Linux ioctl")


class Pair:
    """A connected loopback pair: ``transport`` (Twisted's, over ``ours``) and ``peer`` (a
    plain blocking socket the test reads when it chooses)."""

    def __init__(self, sndbuf: int | None = None, rcvbuf: int | None = None):
        listener = socket.socket()
        if rcvbuf:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        self.ours = socket.socket()
        if sndbuf:
            self.ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.ours.connect(listener.getsockname())
        self.peer, _ = listener.accept()
        listener.close()
        self.ours.setblocking(False)
        self.reactor = MemoryReactor()
        self.transport = tcp.Connection(self.ours, Protocol(), self.reactor)
        self.transport.connected = True  # what tcp.Server/Client set once connected

    def buffered(self) -> int:
        """Bytes in Twisted's own buffer, not handed to the kernel yet."""
        t = self.transport
        return len(t.dataBuffer) - t.offset + t._tempDataLen

    def watched_for_writing(self) -> bool:
        return self.transport in self.reactor.getWriters()

    def flush(self) -> None:
        """What the reactor does when the socket turns writable, until Twisted holds nothing."""
        while self.buffered():
            self.transport.doWrite()
            if self.buffered():
                self.drain(1 << 20, wait=0.01)

    def drain(self, limit: int, wait: float = 5.0) -> bytes:
        self.peer.settimeout(wait)
        try:
            return self.peer.recv(limit)
        except TimeoutError:
            return b""

    def read_exactly(self, n: int) -> bytes:
        got = bytearray()
        while len(got) < n:
            self.flush_one()
            chunk = self.drain(n - len(got))
            assert chunk, f"the peer got {len(got)} of {n} bytes"
            got += chunk
        return bytes(got)

    def flush_one(self) -> None:
        if self.buffered():
            self.transport.doWrite()

    def close(self) -> None:
        self.ours.close()
        self.peer.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_a_write_with_nothing_waiting_reaches_the_peer_in_the_same_call(pair):
    assert set_write_through(pair.transport, not_sent_below=128 * 1024)
    pair.transport.write(b"ping")
    assert pair.buffered() == 0, "Twisted's buffer was used"
    assert not pair.watched_for_writing(), "a second reactor pass was asked for"
    assert pair.drain(100) == b"ping"


def test_without_it_twisted_buffers_until_the_reactor_finds_the_socket_writable(pair):
    """The baseline the fast path removes (and what the test above would see without it)."""
    pair.transport.write(b"ping")
    assert pair.buffered() == 4 and pair.watched_for_writing()
    pair.transport.doWrite()
    assert pair.drain(100) == b"ping"


def test_a_bulk_write_keeps_twisteds_buffer(pair):
    """Above ``largest`` (a bulk frame) the write waits for the reactor as before: sent at once,
    bulk frames kept the reactor from reading between them."""
    assert set_write_through(pair.transport, not_sent_below=128 * 1024, largest=1024)
    pair.transport.write(b"s" * 1024)
    assert pair.buffered() == 0
    pair.transport.write(b"b" * 1025)
    assert pair.buffered() == 1025 and pair.watched_for_writing()
    assert pair.read_exactly(2049) == b"s" * 1024 + b"b" * 1025


def test_a_kernel_queue_at_the_gate_sends_the_write_through_twisteds_buffer():
    """The low-water mark's promise holds: while the kernel already holds the gate's worth of
    unsent bytes, a write waits in Twisted's buffer (the producer above is paused from there)
    instead of growing a kernel queue no control frame can overtake."""
    pair = Pair(rcvbuf=64 * 1024)
    try:
        gate = 16 * 1024
        assert set_write_through(pair.transport, not_sent_below=gate)
        chunk = b"a" * 4096
        sent = 0
        while not_sent_bytes(pair.ours) < gate:  # the peer reads nothing meanwhile
            assert sent < 64 << 20, "the kernel never held the gate's worth unsent"
            pair.transport.write(chunk)
            sent += len(chunk)
            assert pair.buffered() == 0 or not_sent_bytes(pair.ours) >= gate
        before = pair.buffered()
        pair.transport.write(b"late")
        assert pair.buffered() == before + 4, "the write went past the gate into the kernel"
        assert pair.watched_for_writing()
        got = pair.read_exactly(sent + 4)
        assert got == chunk * (sent // len(chunk)) + b"late"
    finally:
        pair.close()


def test_small_writes_ask_the_kernel_only_when_they_could_reach_the_gate(pair, monkeypatch):
    """An idle tunnel's pings and answers (14 bytes every few seconds) cost no ioctl: the
    kernel is asked again only once the bytes written since its last answer could reach the
    gate.  The decisions are the ones asking every time would give (the gate test above)."""
    asked = []
    real_ioctl = fcntl.ioctl

    def counting_ioctl(fd, request, *rest):
        asked.append(request)
        return real_ioctl(fd, request, *rest)

    monkeypatch.setattr(fcntl, "ioctl", counting_ioctl)
    assert set_write_through(pair.transport, not_sent_below=1024)
    asked.clear()
    for _ in range(20):  # 280 bytes: the first write asks, the bound covers the rest
        pair.transport.write(b"p" * 14)
    assert len(asked) == 1, asked
    for _ in range(60):  # the bound passes 1024 once: asked again, the kernel sent them all
        pair.transport.write(b"q" * 14)
    assert len(asked) == 2, asked
    assert pair.buffered() == 0 and not pair.watched_for_writing()
    assert pair.read_exactly(80 * 14) == b"p" * 280 + b"q" * 840


def test_what_the_kernel_does_not_take_is_buffered_and_later_writes_queue_behind_it():
    """A partial send: the rest goes to Twisted's buffer, and every later write goes behind it
    (never straight to the socket past it) until Twisted has sent it all."""
    pair = Pair(sndbuf=16 * 1024, rcvbuf=16 * 1024)
    try:
        assert set_write_through(pair.transport, not_sent_below=1 << 30, largest=1 << 30)
        big = bytes(range(256)) * 4096  # 1 MiB: more than both buffers hold
        pair.transport.write(big)
        assert 0 < pair.buffered() < len(big), "expected a partial send"
        pair.transport.write(b"after")
        assert pair.buffered() > 5 and pair.transport._tempDataBuffer[-1] == b"after"
        assert pair.read_exactly(len(big) + 5) == big + b"after"
        pair.transport.write(b"again")  # drained: the fast path is back
        assert pair.buffered() == 0
        assert pair.drain(100) == b"again"
    finally:
        pair.close()


def test_a_broken_connection_is_left_to_twisteds_write_path(pair):
    """A send that fails (the peer reset the connection) raises nothing to the writer: the
    bytes go to Twisted's buffer and its ``doWrite`` reports the loss as it always does."""
    assert set_write_through(pair.transport, not_sent_below=128 * 1024)
    pair.peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    pair.peer.close()  # RST
    failed = False
    for _ in range(50):  # the first sends may still be accepted before the RST is seen
        pair.transport.write(b"x" * 1000)
        if pair.buffered():
            failed = True
            break
    assert failed, "no write ever failed over to Twisted's buffer"
    assert pair.transport.doWrite() is not None  # Twisted's own report of a lost connection


def test_only_a_tcp_transport_is_changed():
    assert not set_write_through(Protocol())
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        unix = tcp.Connection(a, Protocol(), MemoryReactor())
        assert not set_write_through(unix)
        assert "write" not in vars(unix)
    finally:
        a.close()
        b.close()
