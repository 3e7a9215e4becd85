"""Socket options for every TCP connection that carries tunnel, relay or API traffic (and,
for the tunnel's WebSocket alone, ``TCP_NOTSENT_LOWAT``, a larger read and writes that go to
the kernel at once: see ``set_not_sent_lowat``, ``set_read_size`` and ``set_write_through``).

``TCP_NODELAY``: with Nagle's algorithm a small write waits while an earlier small write is
unacknowledged, and the peer delays its ACK (36-40 ms measured on Linux loopback).  A streamed
token is such a small write on every hop (worker -> owner over the tunnel, owner -> relaying
replica over the peer link, replica -> client), so Nagle put a delayed ACK between tokens.  The
batching Nagle stood in for is done above TCP: the WebSocket carrier coalesces the writes of one
reactor turn into one message (``tunnel/websocket.py``), and ``splice`` writes what one read
brought.

What this module must never do: fail a connection because an option cannot be set (a Unix
socket, a yamux stream, a test transport, a socket already closed): it then does nothing.
"""

from __future__ import annotations

import fcntl
import socket

from twisted.internet import main, tcp
from twisted.protocols.policies import ProtocolWrapper

_TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def set_no_delay(transport) -> bool:
    """Turn ``TCP_NODELAY`` on for the TCP socket under ``transport``: the TCP transport itself,
    or one under protocol wrappers (TLS, the listener's connection count).  Returns whether it
    was set (False for anything that is not a TCP socket)."""
    while isinstance(transport, ProtocolWrapper):
        transport = transport.transport
    if not isinstance(transport, tcp.Connection):
        return False
    try:
        if transport.getHandle().family not in _TCP_FAMILIES:  # unix.Server is a tcp.Server
            return False
        transport.setTcpNoDelay(True)
    except OSError:  # closed meanwhile: nothing to speed up
        return False
    return True


#: ``TCP_NOTSENT_LOWAT`` for the sockets under a tunnel's WebSocket (see ``set_not_sent_lowat``).
TUNNEL_NOT_SENT_LOWAT = 128 * 1024


def set_not_sent_lowat(transport, nbytes: int = TUNNEL_NOT_SENT_LOWAT) -> bool:
    """Let the kernel hold at most about ``nbytes`` of not-yet-sent data for the TCP socket
    under ``transport`` (``TCP_NOTSENT_LOWAT``; Linux and macOS).  Beyond that the socket is not
    writable, Twisted's buffer fills and pauses its producer (the yamux session), and the bulk
    bytes wait in the streams, where the session's order (control streams first) still applies,
    instead of in a kernel queue nothing can overtake.  Bytes already sent are not affected (the
    peer's receive buffer is bounded by the yamux windows).  Returns whether it was set."""
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    while isinstance(transport, ProtocolWrapper):
        transport = transport.transport
    if option is None or not isinstance(transport, tcp.Connection):
        return False
    try:
        handle = transport.getHandle()
        if handle.family not in _TCP_FAMILIES:
            return False
        handle.setsockopt(socket.IPPROTO_TCP, option, nbytes)
    except OSError:
        return False
    return True


#: How much one read of the socket under a tunnel's WebSocket may take (``set_read_size``).
TUNNEL_READ_SIZE = 128 * 1024


def set_read_size(transport, nbytes: int = TUNNEL_READ_SIZE) -> bool:
    """Let each read of the TCP socket under ``transport`` take up to ``nbytes`` (Twisted reads
    at most ``bufferSize``, 64 KiB, per ``doRead``).  A tunnel's bulk arrives faster than the
    reactor takes it, and every read pays the whole parse and dispatch chain above it (the
    WebSocket frame, the yamux frames, the stream, the window grants): twice the bytes per read
    is half of those passes.  Not more than half a stream's default window (256 KiB): a read of
    a whole window would take it all at once, and the sender would wait for the grant instead
    of sending the second half meanwhile (measured: 256 KiB reads made the listener slower).
    Only the read changes: ``bufferSize`` also sets when Twisted's write buffer counts as full
    (the producer pause that keeps control frames ahead of bulk), which stays at 64 KiB.  The
    read's buffer is the one ``recv`` returns, freed once handled: nothing is held between
    reads.  Returns whether it was set."""
    while isinstance(transport, ProtocolWrapper):
        transport = transport.transport
    if not isinstance(transport, tcp.Connection):
        return False
    try:
        if transport.getHandle().family not in _TCP_FAMILIES:
            return False
    except OSError:
        return False
    recv = transport.socket.recv
    received = transport._dataReceived

    def doRead():
        # tcp.Connection.doRead with the larger read
        try:
            data = recv(nbytes)
        except OSError as e:
            if e.args[0] == tcp.EWOULDBLOCK:
                return None
            return main.CONNECTION_LOST
        return received(data)

    transport.doRead = doRead
    return True


#: Linux's ioctl for the bytes of a TCP socket's send queue not sent yet (``SIOCOUTQNSD``,
#: linux/sockios.h); what ``TCP_NOTSENT_LOWAT`` compares to decide the socket is writable.
SIOCOUTQNSD = 0x894B
_INT_BUFFER = bytes(4)


def not_sent_bytes(sock: socket.socket) -> int:
    """The bytes the kernel holds for ``sock`` that it has not sent yet (Linux; OSError
    elsewhere)."""
    return int.from_bytes(fcntl.ioctl(sock.fileno(), SIOCOUTQNSD, _INT_BUFFER), "little")


#: The largest write ``set_write_through`` sends at once (see there).
WRITE_THROUGH_MAX = 16 * 1024


def set_write_through(transport, not_sent_below: int = TUNNEL_NOT_SENT_LOWAT,
                      largest: int = WRITE_THROUGH_MAX) -> bool:
    """Let a write of up to ``largest`` bytes to the TCP socket under ``transport`` go to the
    kernel at once when Twisted holds nothing unsent and the kernel holds fewer than
    ``not_sent_below`` bytes not yet sent (the condition under which ``TCP_NOTSENT_LOWAT``
    calls the socket writable).  Otherwise, and for whatever the kernel does not take,
    Twisted's own buffered write, as before: its order, its producer pause and its error
    handling unchanged.

    Why: Twisted's ``write`` only buffers and asks the reactor to watch for writability, so
    every message costs a second reactor pass, two ``epoll_ctl`` calls and a copy before
    ``send``.  For a small message that pass is most of its cost: a 1-byte round trip on a
    tunnel 231 -> 186 us on loopback, and a bulk stream 388 -> 594 MB/s because the receiver's
    window updates reach the sender a pass sooner (docs/benchmarks.md).  Bulk frames (above
    ``largest``) keep Twisted's buffer: sent at once they kept the reactor from reading
    between them, and a control stream's round trip during a transfer doubled.  The gate
    keeps what ``set_not_sent_lowat`` is for: bytes wait above the kernel, where control
    frames can overtake them.  The gate's ioctl is asked only when the bytes written since it
    last answered could have reached it (an idle tunnel's pings never ask: 8 % of an idle
    replica's busy time at 4000 workers).  Linux only (the gate's ioctl); returns whether it
    was set."""
    while isinstance(transport, ProtocolWrapper):
        transport = transport.transport
    if not isinstance(transport, tcp.Connection):
        return False
    try:
        sock = transport.getHandle()
        if sock.family not in _TCP_FAMILIES:
            return False
        not_sent_bytes(sock)  # the gate's ioctl works here
    except OSError:
        return False
    fd = sock.fileno()
    send = sock.send
    ioctl = fcntl.ioctl
    buffered_write = transport.write
    buffered_write_sequence = transport.writeSequence
    # At most this many bytes are unsent in the kernel: what the gate's ioctl last said plus
    # what went through since (the kernel only drains; nothing else writes to the socket while
    # Twisted holds nothing).  The ioctl is asked only when that bound could reach the gate, so
    # an idle tunnel's pings and their answers (a few bytes every few seconds) never ask; the
    # decision is the same as asking every time.  None: not known (Twisted's own path sent
    # bytes since, or nothing was asked yet).
    at_most = None

    def write(data):
        nonlocal at_most
        size = len(data)
        if (size > largest or transport._tempDataLen or transport.dataBuffer or not data
                or not transport.connected or transport._writeDisconnected):
            at_most = None
            return buffered_write(data)
        try:
            if at_most is None or at_most + size >= not_sent_below:
                at_most = int.from_bytes(ioctl(fd, SIOCOUTQNSD, _INT_BUFFER), "little")
                if at_most >= not_sent_below:
                    at_most = None
                    return buffered_write(data)
            sent = send(data)
        except OSError:  # would block, or the connection broke: Twisted's path finds out
            at_most = None
            return buffered_write(data)
        if sent < size:
            at_most = None
            buffered_write(data[sent:])
        else:
            at_most += sent
        return None

    def writeSequence(data):
        nonlocal at_most
        at_most = None
        return buffered_write_sequence(data)

    write.not_sent_below = not_sent_below  # what tests read back: the limits in force
    write.largest = largest
    transport.write = write
    transport.writeSequence = writeSequence
    return True
