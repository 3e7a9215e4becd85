"""Benchmark of the "last used" touches: database writes per request, batched against the
per-request write it replaced (issue 13 §4), measured in the same run.

Usage:  python benchmarks/bench_touches.py [DSN]      (or set LOCALAI_TEST_DSN)

It starts what the integration tests start, in this process: a real frontend and a real worker
with the ``echo`` backend on a scratch database of the server at DSN (created and dropped), and
sends BENCH_REQUESTS (default 400) Predict calls through the replica's router, BENCH_PARALLEL
(default 8) at a time, twice:

- ``per-request``: the router without its ``ModelUse`` (the behaviour before: one
  ``UPDATE node_models SET last_used`` per request, ``NodeChooser.touch``);
- ``batched``: the replica as built (``ModelUse``: touches in memory, one statement a second).

It counts the statements that write ``last_used`` (wrapping the replica's
``Database.runOperation``) and prints a markdown table: requests, seconds, requests/s, writes,
writes per request.  A script, not a test.
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout: localai_tw, tests

from twisted.internet import defer, task  # noqa: E402

from localai_tw.backends import backend_pb2  # noqa: E402
from scratch_cluster import scratch_cluster  # noqa: E402 (benchmarks/, beside this)



async def measure(reactor, frontend, requests: int, parallel: int, batched: bool):
    router = frontend.replica.inference
    db = frontend.database_service.database
    saved = router.use
    if not batched:
        router.use = None  # NodeChooser.touch: one write per request
    writes = [0]
    original = db.runOperation

    def counting(sql, *args, **kwargs):
        if "last_used = now()" in sql:
            writes[0] += 1
        return original(sql, *args, **kwargs)

    db.runOperation = counting
    try:
        remaining = [requests]

        async def client():
            while remaining[0] > 0:
                remaining[0] -= 1
                await router.predict("m", backend_pb2.PredictOptions(Prompt="one two"))

        started = time.monotonic()
        await defer.gatherResults([defer.ensureDeferred(client()) for _ in range(parallel)])
        seconds = time.monotonic() - started
        if saved is not None:
            await saved.flush()  # what is pending is written too: count it
        await task.deferLater(reactor, 0.2, lambda: None)
    finally:
        db.runOperation = original
        router.use = saved
    return seconds, writes[0]


async def main(reactor, dsn: str) -> None:
    requests = int(os.environ.get("BENCH_REQUESTS", "400"))
    parallel = int(os.environ.get("BENCH_PARALLEL", "8"))
    cluster, dispose = scratch_cluster(dsn, "touches")
    try:
        cluster.write_model("m.yaml", "name: m\nbackend: echo\noptions: ['echo.dim:4']\n")
        frontend = await cluster.frontend("bench")
        await cluster.worker("w1", frontend)
        await frontend.replica.inference.predict("m", backend_pb2.PredictOptions(Prompt="x"))
        rows = []
        for label, batched in (("per-request (before)", False), ("batched (now)", True)):
            seconds, writes = await measure(reactor, frontend, requests, parallel, batched)
            rows.append((label, requests, seconds, requests / seconds, writes,
                         writes / requests))
        print(f"{requests} Predict calls, {parallel} at a time, one model on one worker\n")
        print("| touches | requests | seconds | requests/s | last_used writes | "
              "writes/request |")
        print("|---|---|---|---|---|---|")
        for label, n, seconds, rate, writes, per in rows:
            print(f"| {label} | {n} | {seconds:.1f} | {rate:.0f} | {writes} | {per:.3f} |")
    finally:
        await dispose()


if __name__ == "__main__":
    dsn = (sys.argv[1] if len(sys.argv) > 1 else
           os.environ.get("LOCALAI_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"))
    task.react(main, (dsn,))
