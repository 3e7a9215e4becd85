"""Every TCP connection that carries tunnel, relay or API traffic has ``TCP_NODELAY`` set, read
back from the kernel on real sockets: the frontend listener's accepted HTTP connections, both
ends of a worker's tunnel, both ends of a peer link (plain and TLS), and the worker's
connection to a backend port.  The tunnel's and the peer links' sockets also have
``TCP_NOTSENT_LOWAT`` (bulk bytes wait in the yamux streams, where control frames overtake them,
not in the kernel's send queue; issue 15 §3), and write through (``set_write_through``: a write
goes to the kernel in the same reactor turn while its unsent bytes are below that mark).

Without it a streamed token that follows another one waits for the peer's delayed ACK (36-40 ms
on loopback).  These tests assert the socket option, not a time: the latency itself is
measured by ``benchmarks/bench_streaming.py``.
"""

from __future__ import annotations

import socket

import pytest_twisted
from twisted.internet import defer, reactor, tcp
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol

from localai_tw.config import PortRange
from localai_tw.web.sockets import TUNNEL_NOT_SENT_LOWAT
from localai_tw.worker.streams import StreamRouter

from .support import eventually, within
from .tlscerts import make_ca_and_server


def nodelay(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def not_sent_lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)


def tcp_transport_under(transport) -> tcp.Connection:
    """The TCP transport under ``transport`` (TLS and other wrappers skipped)."""
    for _ in range(5):
        if isinstance(transport, tcp.Connection):
            return transport
        transport = transport.transport
    raise AssertionError(f"no TCP transport under {transport!r}")


def tcp_socket_under(transport) -> socket.socket:
    """The socket of the TCP transport under ``transport`` (TLS and other wrappers skipped)."""
    return tcp_transport_under(transport).getHandle()


def socket_of_session(session) -> socket.socket:
    """The TCP socket carrying a yamux session over the WebSocket carrier."""
    carrier = session.transport
    return tcp_socket_under(carrier._ws.transport)


def write_through_gate(session) -> int | None:
    """The not-sent gate of the write-through set on the TCP transport carrying ``session``
    (None: Twisted's own buffered write)."""
    transport = tcp_transport_under(session.transport._ws.transport)
    return getattr(transport.write, "not_sent_below", None)


def accepted_connection(listening_port: int, client_port: int) -> socket.socket:
    """The server side, in this process's reactor, of the connection from ``client_port``."""
    for transport in set(reactor.getReaders()) | set(reactor.getWriters()):
        if isinstance(transport, tcp.Server) and transport.getHost().port == listening_port \
                and transport.getPeer().port == client_port:
            return transport.getHandle()
    raise AssertionError(f"no accepted connection from port {client_port}")


class _Answer(Protocol):
    def __init__(self):
        self.answered = defer.Deferred()

    def dataReceived(self, data: bytes) -> None:
        if not self.answered.called:
            self.answered.callback(data)


@pytest_twisted.ensureDeferred
async def test_the_listener_sets_nodelay_on_an_accepted_api_connection(cluster):
    frontend = await cluster.frontend("replica-a")
    port = frontend.listener.tcp_port()
    client = await within(connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port),
                                          _Answer()))
    try:
        client.transport.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert (await within(client.answered)).startswith(b"HTTP/1.1 ")
        assert nodelay(accepted_connection(port, client.transport.getHost().port))
    finally:
        client.transport.loseConnection()


@pytest_twisted.ensureDeferred
async def test_a_worker_tunnel_has_nodelay_at_both_ends(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w-nodelay", frontend)
    dialled = socket_of_session(worker.dialer.session)
    accepted = socket_of_session(frontend.replica.tunnels.session_for(worker.node_id))
    assert dialled.getsockname() == accepted.getpeername()  # the two ends of one connection
    assert nodelay(dialled), "the worker's tunnel dial"
    assert nodelay(accepted), "the tunnel accepted by the frontend's listener"
    assert not_sent_lowat(dialled) == TUNNEL_NOT_SENT_LOWAT, "the worker's tunnel dial"
    assert not_sent_lowat(accepted) == TUNNEL_NOT_SENT_LOWAT, "the accepted tunnel"
    assert write_through_gate(worker.dialer.session) == TUNNEL_NOT_SENT_LOWAT
    assert write_through_gate(
        frontend.replica.tunnels.session_for(worker.node_id)) == TUNNEL_NOT_SENT_LOWAT


async def _peer_link(caller, callee):
    """Open a peer link from ``caller`` to ``callee``; (dialled socket, accepted socket).  Both
    ends write through, at the low-water mark."""
    callee_id = callee.replica.instance_id
    await within(caller.replica.peer_pool.open_stream(callee_id, Protocol()))
    dialled = caller.replica.peer_pool._sessions[callee_id]
    accepted = await eventually(
        lambda: callee.replica.peer_links.sessions().get(caller.replica.instance_id),
        what="the callee to hold the peer link")
    assert write_through_gate(dialled) == TUNNEL_NOT_SENT_LOWAT, "the dialled peer link"
    assert write_through_gate(accepted) == TUNNEL_NOT_SENT_LOWAT, "the accepted peer link"
    return socket_of_session(dialled), socket_of_session(accepted)


@pytest_twisted.ensureDeferred
async def test_a_peer_link_has_nodelay_at_both_ends(cluster):
    owner = await cluster.frontend("replica-a")
    relaying = await cluster.frontend("replica-b")
    dialled, accepted = await _peer_link(relaying, owner)
    assert dialled.getsockname() == accepted.getpeername()
    assert nodelay(dialled), "the relaying replica's dial"
    assert nodelay(accepted), "the owner's accepted peer link"
    assert not_sent_lowat(dialled) == TUNNEL_NOT_SENT_LOWAT, "the relaying replica's dial"
    assert not_sent_lowat(accepted) == TUNNEL_NOT_SENT_LOWAT, "the owner's accepted peer link"


@pytest_twisted.ensureDeferred
async def test_a_peer_link_over_tls_has_nodelay_at_both_ends(cluster, tmp_path):
    certs = make_ca_and_server(tmp_path / "tls")
    owner = await cluster.frontend("replica-a", listen=certs.listen())
    relaying = await cluster.frontend("replica-b", **{"peer-ca-file": str(certs.ca)})
    dialled, accepted = await _peer_link(relaying, owner)
    assert dialled.getsockname() == accepted.getpeername()
    assert nodelay(dialled), "the relaying replica's wss:// dial"
    assert nodelay(accepted), "the owner's accepted peer link, under TLS"
    assert not_sent_lowat(dialled) == TUNNEL_NOT_SENT_LOWAT, "the wss:// dial"
    assert not_sent_lowat(accepted) == TUNNEL_NOT_SENT_LOWAT, "the accepted link, under TLS"


@pytest_twisted.ensureDeferred
async def test_the_workers_connection_to_a_backend_port_has_nodelay():
    backend = reactor.listenTCP(0, Factory.forProtocol(Protocol), interface="127.0.0.1")
    port = backend.getHost().port
    router = StreamRouter(control_site=None, backend_ports=PortRange(port, port),
                          reactor=reactor)
    try:
        protocol = await within(router.connect_backend(port, Protocol()))
        try:
            assert nodelay(protocol.transport.getHandle())
        finally:
            protocol.transport.loseConnection()
    finally:
        await backend.stopListening()


def test_a_tunnel_read_takes_more_than_twisteds_64_kib():
    """``set_read_size`` (what the WebSocket carrier sets on its socket when it opens): one
    ``doRead`` takes up to ``TUNNEL_READ_SIZE`` of what is queued, not Twisted's 64 KiB, and
    still reports the peer's close as Twisted does."""
    import select

    from twisted.internet import main

    from localai_tw.web.sockets import TUNNEL_READ_SIZE, set_read_size

    class Reads(Protocol):
        def __init__(self):
            self.sizes = []

        def dataReceived(self, data):
            self.sizes.append(len(data))

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * TUNNEL_READ_SIZE)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    peer = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    listener.close()
    accepted.setblocking(False)
    reads = Reads()
    transport = tcp.Connection(accepted, reads, reactor)
    try:
        assert set_read_size(transport)
        queued = TUNNEL_READ_SIZE + 1000
        peer.sendall(b"x" * queued)
        got = 0
        while got < TUNNEL_READ_SIZE:  # everything sent is queued (loopback), read by read
            select.select([accepted], [], [], 10)
            assert transport.doRead() is None
            got = sum(reads.sizes)
        assert reads.sizes[0] > 65536
        assert max(reads.sizes) <= TUNNEL_READ_SIZE
        peer.close()
        while (ending := transport.doRead()) is None:
            select.select([accepted], [], [], 10)
        assert ending is main.CONNECTION_DONE
        assert sum(reads.sizes) == queued
    finally:
        peer.close()
        accepted.close()
