"""Benchmark of one yamux stream over a long link: fixed vs auto-tuned receive windows (issue 25 §4).

Usage:  python benchmarks/bench_long_link.py [--rtts 50,150] [--mib 1024] [--fixed-mib 16]
                                             [--rate 50] [--auto-window 32768] [--json PATH]

``tc netem`` is not available on these machines, so this script brings its own link: a delay
proxy on loopback, run as a subprocess (``--role proxy``) so it never shares a core's turn with
the endpoints.  Each direction of a proxied connection behaves as a link of ``--rate`` MB/s and
a one-way delay of RTT/2: a chunk read at ``t`` leaves the link at ``max(t, link free) +
len/rate + RTT/2``; the proxy stops reading a side once more than one bandwidth-delay product
plus 1 MiB is queued (the link's buffer), so a sender sees the backpressure a real bottleneck
gives it.

For each RTT, in one sitting, a staged file (a sparse temporary file of ``--mib`` MiB, read by
Twisted's ``FileSender``) is sent through the proxy:

1. on a raw TCP connection: the baseline, what the proxy passes;
2. on one yamux stream (yamux over TCP) with the fixed 256 KiB window (yamux's and Go's
   default; ``--fixed-mib`` MiB only, as it moves one window per round trip);
3. on one yamux stream with ``SessionConfig.auto_window`` (the receiver grows the window
   toward the bandwidth-delay product, ``mux/autowindow.py``).

It prints MB/s and the ratio of each to raw TCP in the same run, the window the stream ended
with, and the load average before and after.  The goal is yamux auto >= 50 % of raw TCP.  The
machine is shared: figures are noisy, compare only within one run.  Every subprocess is reaped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

MIB = 1024 * 1024


# -- the delay proxy (its own process) ---------------------------------------------------------


def run_proxy(args) -> None:
    from collections import deque

    from twisted.internet import protocol, reactor

    rate = args.rate * 1e6
    delay = args.rtt / 2000.0
    cap = int(rate * args.rtt / 1000.0) + MIB

    class Direction:
        """One direction of the link: reads from ``source``, writes to ``sink`` when due."""

        def __init__(self):
            self.source = None
            self.sink = None
            self.queue = deque()  # (due, bytes)
            self.queued = 0
            self.free_at = 0.0
            self.timer = None
            self.paused = False
            self.eof = False

        def push(self, data: bytes) -> None:
            now = reactor.seconds()
            leave = max(now, self.free_at) + len(data) / rate
            self.free_at = leave
            self.queue.append((leave + delay, data))
            self.queued += len(data)
            if self.queued > cap and not self.paused:
                self.paused = True
                self.source.transport.pauseProducing()
            self._arm()

        def _arm(self) -> None:
            if self.timer is None and self.queue:
                self.timer = reactor.callLater(
                    max(0.0, self.queue[0][0] - reactor.seconds()), self._release)

        def _release(self) -> None:
            self.timer = None
            now = reactor.seconds()
            out = []
            while self.queue and self.queue[0][0] <= now:
                _, data = self.queue.popleft()
                self.queued -= len(data)
                out.append(data)
            if out and self.sink.transport is not None:
                self.sink.transport.write(b"".join(out))
            if self.paused and self.queued <= cap // 2:
                self.paused = False
                self.source.transport.resumeProducing()
            if self.eof and not self.queue:
                self.sink.transport.loseConnection()
            self._arm()

        def close(self) -> None:
            self.eof = True
            if not self.queue and self.sink.transport is not None:
                self.sink.transport.loseConnection()

    class Side(protocol.Protocol):
        def __init__(self, out: Direction, back: Direction):
            self.out, self.back = out, back

        def dataReceived(self, data):
            self.out.push(data)

        def connectionLost(self, reason=None):
            self.out.close()

    class Inbound(Side):
        def connectionMade(self):
            self.transport.pauseProducing()
            self.transport.setTcpNoDelay(True)
            up, down = Direction(), Direction()
            self.out, self.back = up, down
            up.source = self
            down.sink = self
            outbound = Side(down, up)
            down.source = outbound
            up.sink = outbound
            factory = protocol.ClientFactory()
            factory.buildProtocol = lambda addr: outbound

            def connected():
                outbound.transport.setTcpNoDelay(True)
                self.transport.resumeProducing()

            outbound.connectionMade = connected
            reactor.connectTCP("127.0.0.1", args.target, factory)

    factory = protocol.Factory()
    factory.buildProtocol = lambda addr: Inbound(None, None)
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")
    print(port.getHost().port, flush=True)
    reactor.run()


# -- the endpoints (this process) --------------------------------------------------------------


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def transfer(reactor, mode: str, path: str, size: int, rtt: int, args) -> dict:
    """Send ``size`` bytes of ``path`` from the listening side to the dialling side (as the
    frontend stages a file to a worker) through a fresh proxy; returns MB/s and the window."""
    from twisted.internet import defer, endpoints, protocol
    from twisted.protocols.basic import FileSender

    from localai_tw.mux.session import Session, SessionConfig

    done = defer.Deferred()
    sent = defer.Deferred()
    state = {"received": 0, "window": None, "end": None, "start": None}

    class Staged:
        """The first ``size`` bytes of the staged file."""

        def __init__(self):
            self.file = open(path, "rb")
            self.left = size

        def read(self, n):
            data = self.file.read(min(n, self.left))
            self.left -= len(data)
            return data

        def close(self):
            self.file.close()

    class Source(protocol.Protocol):
        def connectionMade(self):
            state["start"] = time.perf_counter()
            f = Staged()
            d = FileSender().beginFileTransfer(f, self.transport)
            d.addBoth(lambda r: (f.close(), sent.callback(None)))

    class Sink(protocol.Protocol):
        def dataReceived(self, data):
            state["received"] += len(data)
            if state["received"] >= size and not done.called:
                state["end"] = time.perf_counter()
                state["window"] = getattr(self.transport, "_window", None)
                done.callback(None)

    auto = args.auto_window * 1024 if mode == "yamux-auto" else 0
    receiver_config = SessionConfig(keepalive_interval=None, auto_window=auto)
    sender_config = SessionConfig(keepalive_interval=None)

    def sender_session(*_):
        return Session(client=False, config=sender_config, acceptor=lambda stream: Source(),
                       reactor=reactor)

    if mode == "tcp":
        server_factory = protocol.Factory.forProtocol(Source)
    elif args.carrier == "tcp":
        server_factory = protocol.Factory()
        server_factory.buildProtocol = sender_session
    else:
        from twisted.web.resource import Resource
        from twisted.web.server import Site

        from localai_tw.tunnel.websocket import BearerTokenAuthorizer, TunnelWebSocketResource

        root = Resource()
        root.putChild(b"tunnel", TunnelWebSocketResource(
            sender_session, BearerTokenAuthorizer("bench-long-link")))
        server_factory = Site(root)
        server_factory.log = lambda request: None
    listening = reactor.listenTCP(0, server_factory, interface="127.0.0.1")
    proxy = subprocess.Popen(
        [sys.executable, __file__, "--role", "proxy", "--target", str(listening.getHost().port),
         "--rtt", str(rtt), "--rate", str(args.rate)], stdout=subprocess.PIPE, text=True)
    client = None
    try:
        proxy_port = int(proxy.stdout.readline())
        endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", proxy_port)
        if mode == "tcp":
            client = await endpoints.connectProtocol(endpoint, Sink())
        elif args.carrier == "tcp":
            client = await endpoints.connectProtocol(
                endpoint, Session(client=True, config=receiver_config, reactor=reactor))
            client.openStream(Sink())
        else:
            from localai_tw.tunnel.websocket import connectWebSocket

            client = await connectWebSocket(
                reactor, f"ws://127.0.0.1:{proxy_port}/tunnel",
                lambda: Session(client=True, config=receiver_config, reactor=reactor),
                headers={"Authorization": "Bearer bench-long-link"})
            client.openStream(Sink())
        await done
        await sent
        elapsed = state["end"] - state["start"]
        return {"mode": mode, "carrier": args.carrier, "rtt_ms": rtt, "mib": size / MIB,
                "seconds": elapsed, "mb_s": size / elapsed / 1e6,
                "window_kib": (state["window"] or 0) // 1024}
    finally:
        if client is not None:
            client.transport.loseConnection() if mode == "tcp" else client.loseConnection()
        proxy.terminate()
        proxy.wait()
        await listening.stopListening()


async def main(reactor, args) -> None:
    print(f"load average before: {load_average()}  (cores: {os.cpu_count()})")
    print(f"yamux carrier: {args.carrier}; link: {args.rate} MB/s each way, RTTs {args.rtts} ms; staged file {args.mib} MiB "
          f"(fixed window: {args.fixed_mib} MiB); auto_window ceiling {args.auto_window} KiB")
    results = []
    with tempfile.NamedTemporaryFile(prefix="long-link-") as staged:
        staged.truncate(args.mib * MIB)  # sparse: the page cache serves it, no disk write
        staged.flush()
        for rtt in [int(x) for x in args.rtts.split(",")]:
            row = {}
            for mode, mib in (("tcp", args.mib), ("yamux-fixed", args.fixed_mib),
                              ("yamux-auto", args.mib)):
                figure = await transfer(reactor, mode, staged.name, mib * MIB, rtt, args)
                row[mode] = figure
                results.append(figure)
            base = row["tcp"]["mb_s"]
            print(f"RTT {rtt:4d} ms: raw TCP {base:7.1f} MB/s | yamux fixed 256 KiB "
                  f"{row['yamux-fixed']['mb_s']:7.2f} MB/s ({row['yamux-fixed']['mb_s'] / base:.3f}x)"
                  f" | yamux auto {row['yamux-auto']['mb_s']:7.1f} MB/s "
                  f"({row['yamux-auto']['mb_s'] / base:.3f}x, window ended at "
                  f"{row['yamux-auto']['window_kib']} KiB)", flush=True)
    print(f"load average after: {load_average()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "load_average_after": load_average()}, f, indent=1)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("bench", "proxy"), default="bench")
    parser.add_argument("--target", type=int, help="proxy: the port it forwards to")
    parser.add_argument("--rtt", type=int, default=50, help="proxy: round trip, ms")
    parser.add_argument("--rtts", default="50,150", help="round trips to measure, ms")
    parser.add_argument("--rate", type=float, default=50.0, help="link rate each way, MB/s")
    parser.add_argument("--mib", type=int, default=1024, help="staged file, MiB")
    parser.add_argument("--fixed-mib", type=int, default=16,
                        help="MiB sent with the fixed window (one window per round trip)")
    parser.add_argument("--auto-window", type=int, default=32 * 1024,
                        help="per-stream auto-tuning ceiling, KiB (the tunnel's: 32 MiB)")
    parser.add_argument("--carrier", choices=("tcp", "ws"), default="ws",
                        help="yamux over plain TCP, or over the tunnel's WebSocket carrier")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.role == "proxy":
        run_proxy(args)
    else:
        from twisted.internet import defer, task

        task.react(lambda reactor: defer.ensureDeferred(main(reactor, args)))
