"""PortAllocator against real sockets: a port held by a listener is never handed out."""

from __future__ import annotations

import socket

from twisted.internet import task

from localai_tw.backends.ports import PortAllocator, probe_bind


def _listener_on_free_port(reuse: bool) -> socket.socket:
    s = socket.socket()
    if reuse:
        # What grpc's C-core does: SO_REUSEPORT lets a second reuseport socket share the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_a_port_held_by_a_real_listener_is_skipped_and_quarantined():
    for reuse in (False, True):
        holder = _listener_on_free_port(reuse)
        try:
            held = holder.getsockname()[1]
            if held == 65535:
                continue
            alloc = PortAllocator(held, held + 1, clock=task.Clock(),
                                  ephemeral_range_file="/nonexistent")
            try:
                probe_bind("127.0.0.1", held + 1)
            except OSError:
                continue  # the neighbour is busy on this machine; nothing to learn here
            assert alloc.allocate("m#0") == held + 1
            assert alloc.quarantined()[held][1] == "unbindable"
        finally:
            holder.close()


def test_probe_leaves_the_port_free():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    probe_bind("127.0.0.1", port)
    again = socket.socket()
    try:
        again.bind(("127.0.0.1", port))
    finally:
        again.close()
