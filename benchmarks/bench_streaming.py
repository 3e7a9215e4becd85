"""Benchmark of streamed completions: the delay between two tokens as the client sees it, when
the backend paces its tokens, through the tunnel and the relay against direct gRPC.

Usage:  python benchmarks/bench_streaming.py [--dsn DSN] [--tokens 300] [--interval-ms 5]
                                             [--streams 8] [--rounds 4] [--json PATH] [--keep]

The cluster is ``bench_inference.py``'s, built by its code (two ``twistd`` frontend replicas,
one ``twistd`` worker whose tunnel is held by replica A, the built-in ``echo`` backend, a fresh
database dropped at the end), except that the echo model is paced: ``echo.delay_ms`` makes
the backend sleep ``--interval-ms`` before each token of ``PredictStream``.  A stream is one
completion of ``--tokens`` words (prompt of as many words, ``max_tokens`` as many).

Paths, each measured in the same run (client: this process, one stream at a time):

========== ============================================================================
grpc       **baseline**: ``PredictStream`` straight to the echo backend's TCP port
grpc-owner ``PredictStream`` through the owner replica's gRPC bridge (Unix socket) and
           the worker's tunnel: what the tunnel adds
grpc-relay the same through the other replica's bridge: peer link + relay + tunnel
http-owner ``POST /v1/completions`` with ``stream: true`` (SSE) at the owner replica
http-relay the same at the other replica
========== ============================================================================

Inter-token delay = time between two consecutive tokens arriving at the client (the first
token of a stream, which includes the request's own latency, is not counted).  Reported per
path: p50, p99 and max inter-token delay, the gaps over 20 ms and those in the 35-55 ms band
(where a delayed ACK lands: a stall of Nagle's algorithm, not of a busy core), and the p50/p99
differences against direct gRPC measured in the same run.  ``--rounds`` rounds, each running ``--streams`` / ``--rounds``
streams per path, paths interleaved (reversed every other round), pooled.  The load average
before and after is printed: the machine is shared, and a busy core shows as p99.

Target (``docs/benchmarks.md``, "Streaming"): the tunnel and the relay add under 1 ms to the
p99 inter-token delay.  With Nagle's algorithm on a hop, a token written right after another
waited for the peer's delayed ACK: about 40 ms.

A script, not a test: asserts nothing; every process it started is reaped and the database
dropped, even on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_inference as bi  # noqa: E402  (the cluster, its processes and its helpers)

PATHS = ("grpc", "grpc-owner", "grpc-relay", "http-owner", "http-relay")
LABELS = {
    "grpc": "gRPC direct (baseline)",
    "grpc-owner": "gRPC via owner bridge + tunnel",
    "grpc-relay": "gRPC via other replica: relay + tunnel",
    "http-owner": "HTTP SSE at owner",
    "http-relay": "HTTP SSE at other replica",
}
STREAM_TIMEOUT = 120.0


def words(count: int) -> str:
    return " ".join(f"w{i}" for i in range(count))


def grpc_stream(target: str, identity: str, tokens: int, token: str):
    """A callable running one ``PredictStream``; returns the arrival times of its tokens."""
    import grpc

    from localai_tw.backends import backend_pb2, backend_pb2_grpc

    channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)])
    stub = backend_pb2_grpc.BackendStub(channel)
    request = backend_pb2.PredictOptions(Prompt=words(tokens), Tokens=tokens,
                                         ModelIdentity=identity)
    metadata = (("authorization", f"Bearer {token}"),)  # the backend process's own token

    def one() -> list[float]:
        clock, arrivals = time.perf_counter, []
        for reply in stub.PredictStream(request, timeout=STREAM_TIMEOUT, metadata=metadata):
            if reply.message:
                arrivals.append(clock())
        return arrivals

    one.close = channel.close
    return one


def sse_stream(port: int, tokens: int):
    """A callable running one streamed ``/v1/completions`` on a keep-alive connection."""
    body = json.dumps({"model": bi.MODEL, "prompt": words(tokens), "max_tokens": tokens,
                       "stream": True}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {bi.API_KEY}"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=STREAM_TIMEOUT)

    def one() -> list[float]:
        clock, arrivals = time.perf_counter, []
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        while True:
            line = response.readline()
            if not line:
                break
            if line.startswith(b"data: {"):
                now = clock()
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    arrivals.append(now)
            elif line.startswith(b"data: [DONE]"):
                response.read()
                break
        return arrivals

    one.close = conn.close
    return one


def run(bench: bi.Bench, args) -> dict:
    report = {"machine": bi.machine(), "argv": sys.argv[1:], "loadavg_before": bi._loadavg(),
              "tokens": args.tokens, "interval_ms": args.interval_ms, "rounds": args.rounds}
    info = bi.setup(bench, model_options=(f"echo.delay_ms:{args.interval_ms:g}",))
    report["cluster"] = {k: v for k, v in info.items() if k != "watched"}
    identity = info["model_identity"]
    streams = {}
    for path in args.paths:
        kind, target = info["targets"][path]
        if kind == "grpc":
            streams[path] = grpc_stream(target, identity, args.tokens, bench.backend_token)
        else:
            streams[path] = sse_stream(int(target.rsplit(":", 1)[1]), args.tokens)
    try:
        for path in args.paths:  # one unrecorded stream each: connections up, code warm
            streams[path]()
        gaps: dict[str, list[float]] = {path: [] for path in args.paths}
        counts: dict[str, list[int]] = {path: [] for path in args.paths}
        per_round = max(1, args.streams // args.rounds)
        for r in range(args.rounds):
            order = list(args.paths) if r % 2 == 0 else list(reversed(args.paths))
            for path in order:
                for _ in range(per_round):
                    arrivals = streams[path]()
                    counts[path].append(len(arrivals))
                    gaps[path].extend(b - a for a, b in zip(arrivals, arrivals[1:]))
            print(f"# round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for one in streams.values():
            one.close()
    report["loadavg_after"] = bi._loadavg()
    report["gaps_us"] = {p: [round(g * 1e6, 1) for g in v] for p, v in gaps.items()}
    report["tokens_per_stream"] = counts
    return report


def summarise(report: dict) -> dict:
    rows = {}
    for path, gaps in report["gaps_us"].items():
        ordered = sorted(gaps)
        rows[path] = {"gaps": len(ordered),
                      "p50_ms": bi.percentile(ordered, 50) / 1e3,
                      "p99_ms": bi.percentile(ordered, 99) / 1e3,
                      "max_ms": ordered[-1] / 1e3,
                      "over_20ms": sum(1 for g in ordered if g > 20_000),
                      "ack_band": sum(1 for g in ordered if 35_000 <= g <= 55_000),
                      "tokens": sorted(set(report["tokens_per_stream"][path]))}
    return rows


def render(report: dict, rows: dict) -> str:
    m = report["machine"]
    base = rows.get("grpc")
    lines = [f"Machine: {m['cpus']} CPUs, {m['cpu_model']}, Linux {m['kernel']}, Python "
             f"{m['python']}, Twisted {m['twisted']}, grpcio {m['grpcio']}; load average "
             f"{report['loadavg_before']} before, {report['loadavg_after']} after.",
             f"Streams of {report['tokens']} tokens paced at {report['interval_ms']:g} ms by "
             f"the echo backend; tunnel owner {report['cluster']['owner']}, relaying replica "
             f"{report['cluster']['relay']}; {report['rounds']} interleaved rounds, pooled.",
             "",
             "| path | gaps | p50 ms | p99 ms | max ms | gaps > 20 ms | gaps 35-55 ms | "
             "p50 vs gRPC | p99 vs gRPC |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for path in PATHS:
        row = rows.get(path)
        if row is None:
            continue
        d50 = d99 = "-"
        if base is not None and path != "grpc":
            d50 = f"{row['p50_ms'] - base['p50_ms']:+.3f} ms"
            d99 = f"{row['p99_ms'] - base['p99_ms']:+.3f} ms"
        lines.append(f"| {LABELS[path]} | {row['gaps']} | {row['p50_ms']:.3f} | "
                     f"{row['p99_ms']:.3f} | {row['max_ms']:.3f} | {row['over_20ms']} | "
                     f"{row['ack_band']} | {d50} | {d99} |")
    if base is not None:
        lines += ["", "Target: the tunnel and the relay add < 1 ms to the p99 inter-token delay"]
        for path in ("grpc-owner", "grpc-relay", "http-owner", "http-relay"):
            if path in rows:
                added = rows[path]["p99_ms"] - base["p99_ms"]
                lines.append(f"- {LABELS[path]}: {added:+.3f} ms -> "
                             f"{'met' if added < 1.0 else 'MISSED'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("LOCALAI_TEST_DSN") or bi.DEFAULT_DSN,
                        help="maintenance DSN where CREATE DATABASE is allowed")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per stream")
    parser.add_argument("--interval-ms", type=float, default=5.0,
                        help="the backend's pause before each token")
    parser.add_argument("--streams", type=int, default=8, help="measured streams per path")
    parser.add_argument("--rounds", type=int, default=4,
                        help="interleaved rounds (the streams are split)")
    parser.add_argument("--paths", default=",".join(PATHS), help="subset of " + ",".join(PATHS))
    parser.add_argument("--json", metavar="PATH", help="also write every gap as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}")
    # What bench_inference's Bench and setup() read: no profiling, no load-client processes
    # (the streams are read here, one at a time).
    cluster_args = argparse.Namespace(dsn=args.dsn, keep=args.keep, profile=None, paths=[])

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)

    bench = bi.Bench(cluster_args)
    report = None
    try:
        report = run(bench, args)
    except BaseException:
        for proc in bench.procs:
            if proc.log_path:
                print(f"===== {proc.name} (last lines) =====\n{proc.tail()}", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for problem in bench.close():
            print(f"# cleanup: {problem}", file=sys.stderr)
    rows = summarise(report)
    print(render(report, rows))
    if args.json:
        report["summary"] = rows
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
