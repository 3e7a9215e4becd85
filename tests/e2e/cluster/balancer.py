"""A tiny HTTP load balancer for the cluster e2e suite (plain sockets and threads).

One :class:`Balancer` sits in front of the frontend replicas for one worker, as in the Go suite
(ref §10): it forwards each connection to the *preferred* upstream and falls through to the
others, in order, when a connection to it is refused (a killed replica).  It reads only the
request head, to classify the connection:

- a WebSocket upgrade to ``/api/cluster/connect`` is a **tunnel dial**.  It is counted, and while
  the tunnel is *blocked* it is answered ``503`` and closed (never forwarded).  A forwarded
  tunnel is remembered so :meth:`Balancer.drop_tunnels` can cut it (both sockets shut down);
- ``/api/node/{id}/heartbeat`` is a **heartbeat**; while heartbeats are blocked it is answered
  ``503`` (the worker keeps its tunnel);
- everything else (registration, heartbeats) is forwarded with ``Connection: close`` forced on the
  request, so each connection carries exactly one request and the next one is routed afresh.

Everything is controllable from the test thread: :meth:`prefer`, :meth:`block_tunnel`,
:meth:`unblock_tunnel`, :meth:`block_heartbeats`, :meth:`drop_tunnels`; counters show what passed.
The upstream list is the harness's shared list of frontend addresses, read at each connection.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

MAX_HEAD = 64 * 1024
_REFUSED_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                b"Content-Length: 26\r\nConnection: close\r\n\r\nblocked by the e2e balancer")
_NO_UPSTREAM_502 = (b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\n"
                    b"Content-Length: 11\r\nConnection: close\r\n\r\nno upstream")


@dataclass
class Counters:
    tunnel_dials: int = 0          # upgrade requests to /api/cluster/connect seen
    tunnel_refused: int = 0        # ... answered 503 because the tunnel was blocked
    tunnel_forwarded: list = field(default_factory=list)  # upstream index per forwarded dial
    heartbeats: int = 0            # heartbeat requests forwarded
    heartbeats_refused: int = 0
    other: int = 0                 # other requests forwarded (registration ...)


class Balancer:
    """Listens on ``127.0.0.1:<port>``; ``upstreams`` is a list of ``(host, port)`` (shared,
    may grow); ``preferred`` an index into it."""

    def __init__(self, upstreams: list, preferred: int = 0, name: str = "balancer"):
        self.upstreams = upstreams
        self.name = name
        self._lock = threading.Lock()
        self._preferred = preferred
        self._tunnel_blocked = False
        self._heartbeats_blocked = False
        self._tunnels: set[tuple[socket.socket, socket.socket]] = set()
        self._open: set[socket.socket] = set()
        self.counters = Counters()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._stopped = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- control ---------------------------------------------------------------------------

    def prefer(self, index: int) -> None:
        with self._lock:
            self._preferred = index

    def block_tunnel(self) -> None:
        with self._lock:
            self._tunnel_blocked = True

    def unblock_tunnel(self) -> None:
        with self._lock:
            self._tunnel_blocked = False

    def block_heartbeats(self) -> None:
        with self._lock:
            self._heartbeats_blocked = True

    def unblock_heartbeats(self) -> None:
        with self._lock:
            self._heartbeats_blocked = False

    def drop_tunnels(self) -> int:
        """Cut every forwarded tunnel connection (the worker sees its session end)."""
        with self._lock:
            tunnels, self._tunnels = list(self._tunnels), set()
        for pair in tunnels:
            for s in pair:
                _shutdown(s)
        return len(tunnels)

    def live_tunnels(self) -> int:
        with self._lock:
            return len(self._tunnels)

    def stop(self) -> None:
        self._stopped = True
        _shutdown(self._listener)
        self._listener.close()
        with self._lock:
            sockets = list(self._open)
        for s in sockets:
            _shutdown(s)
        self._thread.join(timeout=5)

    # -- serving ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True,
                             name=f"{self.name}-conn").start()

    def _order(self) -> list[int]:
        with self._lock:
            preferred = self._preferred
        count = len(self.upstreams)
        first = preferred % count if count else 0
        return [first] + [i for i in range(count) if i != first]

    def _serve(self, client: socket.socket) -> None:
        self._track(client)
        upstream = None
        try:
            client.settimeout(30)
            head, rest = _read_head(client)
            if head is None:
                return
            request_line, _, header_block = head.partition(b"\r\n")
            parts = request_line.split(b" ")
            target = parts[1] if len(parts) >= 2 else b"/"
            path = target.split(b"?", 1)[0]
            headers = [h for h in header_block.split(b"\r\n") if h]
            names = {h.split(b":", 1)[0].strip().lower(): h.split(b":", 1)[1].strip().lower()
                     for h in headers if b":" in h}
            upgrade = b"upgrade" in names and b"upgrade" in names.get(b"connection", b"")
            tunnel = upgrade and path.rstrip(b"/").endswith(b"/api/cluster/connect")
            heartbeat = path.startswith(b"/api/node/") and path.rstrip(b"/").endswith(
                b"/heartbeat")
            with self._lock:
                if tunnel:
                    self.counters.tunnel_dials += 1
                    if self._tunnel_blocked:
                        self.counters.tunnel_refused += 1
                        refuse = True
                    else:
                        refuse = False
                elif heartbeat and self._heartbeats_blocked:
                    self.counters.heartbeats_refused += 1
                    refuse = True
                else:
                    refuse = False
            if refuse:
                client.sendall(_REFUSED_503)
                return
            if not upgrade:
                headers = [h for h in headers
                           if h.split(b":", 1)[0].strip().lower()
                           not in (b"connection", b"keep-alive")]
                headers.append(b"Connection: close")
                head = b"\r\n".join([request_line] + headers)
            chosen = None
            for index in self._order():
                try:
                    upstream = socket.create_connection(self.upstreams[index], timeout=5)
                    chosen = index
                    break
                except OSError:
                    continue
            if upstream is None:
                client.sendall(_NO_UPSTREAM_502)
                return
            self._track(upstream)
            with self._lock:
                if tunnel:
                    self.counters.tunnel_forwarded.append(chosen)
                    self._tunnels.add((client, upstream))
                elif heartbeat:
                    self.counters.heartbeats += 1
                else:
                    self.counters.other += 1
            client.settimeout(None)
            upstream.settimeout(None)
            upstream.sendall(head + b"\r\n\r\n" + rest)
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True,
                                    name=f"{self.name}-back")
            back.start()
            _pump(client, upstream)
            back.join()
        except OSError:
            pass
        finally:
            with self._lock:
                self._tunnels = {p for p in self._tunnels if client not in p}
            for s in (client, upstream):
                if s is not None:
                    _shutdown(s)
                    s.close()
                    self._untrack(s)

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._open.add(s)

    def _untrack(self, s: socket.socket) -> None:
        with self._lock:
            self._open.discard(s)


def _read_head(s: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
        if len(data) > MAX_HEAD:
            return None, b""
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy until either side ends; then end both (a half-open WebSocket is no use)."""
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _shutdown(src)
        _shutdown(dst)


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
