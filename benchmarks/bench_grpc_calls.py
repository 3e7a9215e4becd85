"""Benchmark of one grpcio unary call at a time in future mode, as the worker makes a backend
call: grpcio's own completion thread (started for each call that finds the channel idle)
against the one kept for the channel's life (``localai_tw/backends/grpcthread.py``).

Usage:  python benchmarks/bench_grpc_calls.py [--calls 3000] [--rounds 4] [--payload 64]

The server is a separate process (a grpcio server echoing the request), so the figure is the
calling process's CPU alone: ``time.process_time`` per call, and the wall time per call,
around ``--calls`` sequential calls, each ``.future()`` with a done callback that the caller
waits for (what ``deferred_from_future`` does on the reactor's behalf).  The two modes alternate
``--rounds`` times on fresh channels after a warm-up; the medians and their ratio are printed,
with the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

SERVICE = "localai.bench.Echo"

SERVER = f"""
import sys, grpc
from concurrent import futures
srv = grpc.server(futures.ThreadPoolExecutor(4))
srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("{SERVICE}", {{
    "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}}),))
print(srv.add_insecure_port("127.0.0.1:0"), flush=True)
srv.start()
sys.stdin.read()
"""


def one_round(address: str, keep: bool, calls: int, payload: bytes) -> tuple[float, float]:
    import grpc

    from localai_tw.backends.grpcthread import keep_completion_thread

    channel = grpc.insecure_channel(address)
    try:
        if keep and not keep_completion_thread(channel):
            sys.exit("this grpcio lacks what backends/grpcthread.py needs")
        call = channel.unary_unary(f"/{SERVICE}/Echo")
        for _ in range(100):  # connect, warm up
            call(payload, timeout=10)
        done = threading.Event()
        started_cpu, started = time.process_time(), time.perf_counter()
        for _ in range(calls):
            done.clear()
            future = call.future(payload, timeout=10)
            future.add_done_callback(lambda f: done.set())
            done.wait(10)
            future.result()
        return ((time.process_time() - started_cpu) / calls * 1e6,
                (time.perf_counter() - started) / calls * 1e6)
    finally:
        channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="sequential calls per round")
    parser.add_argument("--rounds", type=int, default=4, help="alternated rounds per mode")
    parser.add_argument("--payload", type=int, default=64, help="request bytes")
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{int(server.stdout.readline())}"
        payload = b"x" * args.payload
        load_before = os.getloadavg()
        figures = {"grpcio": [], "kept": []}
        for i in range(args.rounds):
            order = ("grpcio", "kept") if i % 2 == 0 else ("kept", "grpcio")
            for mode in order:
                figures[mode].append(one_round(address, mode == "kept", args.calls, payload))
        load_after = os.getloadavg()
    finally:
        server.stdin.close()
        server.wait(10)
    print(f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)}")
    print(f"{args.calls} sequential unary calls per round, {args.rounds} rounds per mode, "
          f"alternated; the calling process only")
    print("| completion thread | CPU us per call (each round) | median | wall us per call, median |")
    print("|---|---|---:|---:|")
    medians = {}
    for mode, rows in figures.items():
        cpu = [c for c, _ in rows]
        medians[mode] = statistics.median(cpu)
        print(f"| {mode} | {', '.join(f'{c:.0f}' for c in cpu)} | {medians[mode]:.0f} | "
              f"{statistics.median(w for _, w in rows):.0f} |")
    print(f"ratio kept / grpcio (CPU per call, medians): {medians['kept'] / medians['grpcio']:.2f}x")


if __name__ == "__main__":
    main()
