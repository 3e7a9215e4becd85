"""Benchmark of fairness on one tunnel session: a 1-byte RTT loop while a bulk transfer runs.

Usage:  python benchmarks/bench_bulk_fairness.py [--mib 1024] [--directions down,up] [--streams 1]
                                                 [--idle-seconds 3] [--window 256] [--frame 0]
                                                 [--bulk-budget 0] [--auto-window 0]
                                                 [--json PATH]

File staging and large gRPC messages ride the same yamux-over-WebSocket session as control
calls (issue 15 §3).  This script measures what a bulk stream does to a control stream on that
one session:

1. it starts the listening side of ``bench_transport.py`` (``--role server --transport ws``: a
   ``TunnelWebSocketResource`` running a yamux ``Session`` whose streams obey a one-command
   protocol) as a subprocess, and dials it from this process with ``connectWebSocket`` and a
   client ``Session``: ONE WebSocket, ONE session, as a worker's tunnel;
2. it opens an echo stream and runs a 1-byte request/response loop on it for
   ``--idle-seconds`` with nothing else on the session: the idle RTT, the baseline of this run;
3. for each direction it opens a second stream that moves ``--mib`` MiB ("down": listener ->
   dialler, i.e. frontend -> worker, the direction of file staging and of requests; "up":
   dialler -> listener, worker -> frontend, responses), split over ``--streams`` streams,
   while the same echo loop keeps running on the first stream; the RTT samples taken while
   the transfer runs are the loaded RTT.

It prints RTT p50/p99/max idle and during each transfer, the ratio, the bulk MB/s, and the
load average (and CPU pressure) before and after.  The machine is shared: a load average above
the core count makes the p99 and max figures mostly scheduling noise (a process waiting for a
core), so the script says so next to the figures.  This is a script, not a test: it asserts
nothing, but prints whether the target (RTT p99 under 5 ms during the transfer) was met.

Staging itself (``staging_client.py``) is an HTTP PUT whose body a ``FileBodyProducer`` writes
in 64 KiB chunks onto one stream of the same session: on the tunnel that is exactly the "down"
bulk stream here (a producer writing 64 KiB chunks, paused by the stream's window), so it is
not measured separately.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import bench_transport as bt  # the server role and the shared protocols

TARGET_P99_MS = 5.0


def _summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    if not ordered:
        return {"n": 0}
    return {"n": len(ordered), "p50_ms": bt.percentile(ordered, 50) * 1e3,
            "p99_ms": bt.percentile(ordered, 99) * 1e3, "max_ms": ordered[-1] * 1e3}


def _echo_loop_protocol():
    from twisted.internet import defer
    from twisted.internet.protocol import Protocol

    class EchoLoop(Protocol):
        """Sends 1 byte, waits for it to come back, records the round trip, repeats: one
        request in flight at a time, as a control call.  ``mark(label)`` files the following
        samples under ``label``."""

        def __init__(self):
            self.connected_d = defer.Deferred()
            self.samples: dict[str, list[float]] = {}
            self.label = None
            self._sent_at = 0.0
            self.stopped = False

        def connectionMade(self):
            self.connected_d.callback(self)

        def start(self, label):
            self.label = label
            self.transport.write(bt.COMMAND.pack(bt.OP_ECHO, 0))
            self._send()

        def mark(self, label):
            self.label = label

        def _send(self):
            self._sent_at = time.perf_counter()
            self.transport.write(b"x")

        def dataReceived(self, data):
            now = time.perf_counter()
            if self.label is not None:
                self.samples.setdefault(self.label, []).append(now - self._sent_at)
            if not self.stopped:
                self._send()

    return EchoLoop


async def _run(reactor, args, port: int) -> dict:
    from twisted.internet import defer, task

    from localai_tw.mux.session import Session
    from localai_tw.tunnel.websocket import connectWebSocket

    _, _, ClientSide = bt._protocols()
    config = bt._session_config(args)
    session = await connectWebSocket(
        reactor, f"ws://127.0.0.1:{port}/{bt.WS_PATH.decode()}",
        lambda: Session(client=True, config=config, reactor=reactor),
        headers={"Authorization": f"Bearer {bt.TOKEN}"})
    echo = _echo_loop_protocol()()
    session.openStream(echo)
    await echo.connected_d
    echo.start("warmup")
    await task.deferLater(reactor, 0.5, lambda: None)
    echo.mark("idle")
    await task.deferLater(reactor, args.idle_seconds, lambda: None)
    results = {"transfers": []}
    total = args.mib * 1024 * 1024
    for direction in args.directions.split(","):
        bulks = []
        for _ in range(args.streams):
            bulk = ClientSide()
            session.openStream(bulk)
            await bulk.connected_d
            bulks.append(bulk)
        label = f"during-{direction}"
        echo.mark(label)
        cpu0 = time.process_time()
        started = time.perf_counter()
        each = total // args.streams
        done = defer.gatherResults(
            [b.download(each) if direction == "down" else b.upload(each) for b in bulks],
            consumeErrors=True)
        await done.addTimeout(bt.TEST_TIMEOUT * 4, reactor)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu0
        echo.mark("between")
        for bulk in bulks:
            bulk.transport.loseConnection()
        results["transfers"].append({
            "direction": direction, "streams": args.streams, "bytes": each * args.streams,
            "seconds": elapsed,
            "mb_per_s": each * args.streams / elapsed / 1e6, "cpu_dialler": cpu / elapsed,
            "rtt": _summary(echo.samples.get(label, []))})
        await task.deferLater(reactor, 0.3, lambda: None)
    echo.mark("idle-after")
    await task.deferLater(reactor, args.idle_seconds, lambda: None)
    echo.stopped = True
    results["idle"] = _summary(echo.samples.get("idle", []))
    results["idle_after"] = _summary(echo.samples.get("idle-after", []))
    session.loseConnection()
    await task.deferLater(reactor, 0.1, lambda: None)  # let the close go out
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB moved per transfer")
    parser.add_argument("--directions", default="down,up",
                        help="down (listener -> dialler, staging), up, or both")
    parser.add_argument("--streams", type=int, default=1,
                        help="bulk streams sharing the transfer (each moves mib/streams MiB)")
    parser.add_argument("--idle-seconds", type=float, default=3.0,
                        help="seconds of the RTT loop on the idle session (before and after)")
    parser.add_argument("--window", type=int, default=256, help="yamux max window, KiB")
    parser.add_argument("--frame", type=int, default=0,
                        help="yamux max frame size, bytes (0: the library default)")
    parser.add_argument("--bulk-budget", type=int, default=0,
                        help="yamux bulk bytes in flight per session, KiB (0: no limit)")
    parser.add_argument("--auto-window", type=int, default=0,
                        help="yamux receive-window auto-tuning ceiling per stream, KiB (0: off)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    args = parser.parse_args()
    if args.streams < 1 or args.mib < 1:
        parser.error("--streams and --mib must be at least 1")
    for d in args.directions.split(","):
        if d not in ("down", "up"):
            parser.error(f"unknown direction {d!r}")

    from localai_tw.mux.session import SessionConfig

    args.frame = args.frame or SessionConfig().max_frame_size
    load_before = bt._loadavg()
    server_argv = [sys.executable, os.path.join(HERE, "bench_transport.py"), "--role", "server",
                   "--transport", "ws", "--mib", str(args.mib), "--window", str(args.window),
                   "--frame", str(args.frame),
                   "--bulk-budget", str(args.bulk_budget),
                   "--auto-window", str(args.auto_window)]
    server = subprocess.Popen(server_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        hello = json.loads(server.stdout.readline() or "null")
        if not hello:
            raise RuntimeError("the listening side did not start")
        from twisted.internet import defer, task

        out = {}

        def go(reactor):
            async def run():
                out.update(await _run(reactor, args, hello["port"]))
            return defer.ensureDeferred(run())

        try:
            task.react(go)
        except SystemExit as e:
            if e.code:
                raise
    finally:
        if server.poll() is None:
            server.stdin.close()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
        server.wait()
    report = {"machine": bt.machine(), "argv": sys.argv[1:], "mib": args.mib,
              "window_kib": args.window, "frame": args.frame,
              "bulk_budget_kib": args.bulk_budget, "auto_window_kib": args.auto_window,
              "loadavg_before": load_before,
              "loadavg_after": bt._loadavg(), **out}
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def render(report) -> str:
    m = report["machine"]
    lines = [f"Machine: {m['cpus']} CPUs, {m['cpu_model']}, Linux {m['kernel']}, "
             f"Python {m['python']}, Twisted {m['twisted']}, Autobahn {m['autobahn']}",
             f"One yamux/WebSocket session on 127.0.0.1, two processes; {report['mib']} MiB "
             f"per transfer; yamux max window {report['window_kib']} KiB, max frame "
             f"{report['frame']} bytes; bulk budget {report.get('bulk_budget_kib') or 'none'} KiB; "
             f"auto window {report.get('auto_window_kib') or 'off'} KiB; "
             "MB = 10**6 bytes.",
             f"Load average {report['loadavg_before']} before, {report['loadavg_after']} after."]
    try:
        load = float(report["loadavg_before"].split()[0])
    except (ValueError, IndexError):
        load = 0.0
    if load > 1.0:
        lines.append(f"NOTE: the machine is shared and busy (load average {load:g} on "
                     f"{m['cpus']} CPUs): p99 and max are mostly time spent waiting for a "
                     "core; compare with the idle RTT of the same run, and quote absolute "
                     "figures only from a quiet machine.")
    lines += ["", "| phase | samples | RTT p50 ms | RTT p99 ms | RTT max ms | bulk MB/s |",
              "|---|---:|---:|---:|---:|---:|"]

    def row(name, s, mbps="-"):
        if not s.get("n"):
            lines.append(f"| {name} | 0 | - | - | - | {mbps} |")
            return
        lines.append(f"| {name} | {s['n']} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
                     f"{s['max_ms']:.2f} | {mbps} |")

    idle = report["idle"]
    row("idle session", idle)
    for t in report["transfers"]:
        row(f"during {t['direction']} transfer, {t.get('streams', 1)} stream(s)", t["rtt"],
            f"{t['mb_per_s']:.0f}")
    row("idle session, after", report["idle_after"])
    lines.append("")
    for t in report["transfers"]:
        s = t["rtt"]
        if not s.get("n") or not idle.get("n"):
            continue
        met = s["p99_ms"] < TARGET_P99_MS
        lines.append(f"- {t['direction']}: RTT p50 {s['p50_ms'] / idle['p50_ms']:.1f}x idle, "
                     f"p99 {s['p99_ms'] / idle['p99_ms']:.1f}x idle; target p99 < "
                     f"{TARGET_P99_MS:g} ms during the transfer -> "
                     f"{'met' if met else 'MISSED'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
