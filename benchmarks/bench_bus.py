"""Benchmark of the bus: claim throughput and publish-to-deliver latency.

Usage:  python benchmarks/bench_bus.py [DSN]      (or set LOCALAI_TEST_DSN)

Environment: BENCH_JOBS (jobs per claim run, default 2000); BENCH_ASYNC_COMMIT=1 runs on a
scratch database with synchronous_commit = off, to show how much of the claim cost is the WAL
flush of each commit (diagnostic; the queue itself does not turn it off).

The DSN names a maintenance database on a server where this script may CREATE DATABASE; it
creates a scratch database, migrates it, measures, and drops it.  Results are printed as a
markdown table on stdout.  This is a script, not a test: nothing here asserts.

- claims/s: N jobs drained by 1, 4 and 16 ClaimConsumers, each on its own pool (size 2) with its
  own live instance id, max 4 in flight, a handler that returns at once.  Each job costs one
  claim statement and one complete statement.
- latency: two PgBus instances on separate pools in this process; one publishes, one
  subscribes; time from calling publish to the handler running, one message at a time
  (inline: a small payload; spilled: a 9000-byte payload).
"""

from __future__ import annotations

import os
import platform
import sys
import time
import uuid

import psycopg2
from twisted.internet import defer, task

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from localai_tw.bus.claims import ClaimConsumer, ClaimQueue
from localai_tw.bus.pgbus import PgBus
from localai_tw.db.migrate import migrate
from localai_tw.db.pool import Database, dsn_with

JOBS_PER_RUN = int(os.environ.get("BENCH_JOBS", "2000"))
CONSUMER_COUNTS = (1, 4, 16)
INLINE_MESSAGES = 1000
SPILLED_MESSAGES = 300


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


async def bench_claims(reactor, dsn: str, consumers: int) -> float:
    admin = Database(dsn, size=2, reactor=reactor)
    await admin.start()
    await admin.runOperation("DELETE FROM work_claims")
    await admin.runOperation(
        "INSERT INTO work_claims (id, kind, payload)"
        " SELECT 'b-' || g, 'task', '\\x00' FROM generate_series(1, %s) g", (JOBS_PER_RUN,))
    owners = [f"bench-{consumers}-{i}" for i in range(consumers)]
    for o in owners:
        await admin.runOperation(
            "INSERT INTO instances (id, last_seen) VALUES (%s, now())"
            " ON CONFLICT (id) DO UPDATE SET last_seen = now()", (o,))
    await admin.runOperation("ANALYZE work_claims")
    pools = []
    for _ in owners:
        pool = Database(dsn, size=2, reactor=reactor)
        await pool.start()
        pools.append(pool)
    finished = defer.Deferred()
    done = [0]

    def handler(claim):
        return None

    services = [ClaimConsumer(ClaimQueue(p), o, ["task"], handler, max_in_flight=4,
                              poll_interval=2.0, reactor=reactor)
                for p, o in zip(pools, owners)]

    def check():
        done[0] = sum(s.stats["completed"] for s in services)
        if os.environ.get("BENCH_DEBUG"):
            print(done[0], [s.stats for s in services][:2], file=sys.stderr)
        if done[0] >= JOBS_PER_RUN and not finished.called:
            finished.callback(None)

    watcher = task.LoopingCall(check)
    watcher.clock = reactor
    started = time.perf_counter()
    for s in services:
        s.startService()
    watcher.start(0.5 if os.environ.get('BENCH_DEBUG') else 0.005)
    await finished
    elapsed = time.perf_counter() - started
    watcher.stop()
    for s in services:
        await s.stopService()
    for p in pools:
        p.close()
    admin.close()
    return JOBS_PER_RUN / elapsed


async def bench_latency(reactor, dsn: str) -> dict[str, tuple[float, float]]:
    db_pub = Database(dsn, size=4, reactor=reactor)
    db_sub = Database(dsn, size=4, reactor=reactor)
    await db_pub.start()
    await db_sub.start()
    pub = PgBus(db_pub, reactor=reactor)
    sub = PgBus(db_sub, reactor=reactor)
    pub.startService()
    sub.startService()
    await pub.whenConnected()
    await sub.whenConnected()
    arrived: dict[int, float] = {}
    waiting: dict[int, defer.Deferred] = {}

    def on_message(subject, payload):
        n = payload["n"]
        arrived[n] = time.perf_counter()
        d = waiting.pop(n, None)
        if d is not None:
            d.callback(None)

    await sub.subscribe("state.bench", on_message)
    results = {}
    n = 0
    for label, count, pad in (("inline", INLINE_MESSAGES, 16), ("spilled", SPILLED_MESSAGES, 9000)):
        samples = []
        for _ in range(count):
            n += 1
            d = waiting[n] = defer.Deferred()
            t0 = time.perf_counter()
            await pub.publish("state.bench", {"n": n, "pad": "x" * pad})
            await d
            samples.append((arrived[n] - t0) * 1000)
        results[label] = (percentile(samples, 50), percentile(samples, 99))
    await pub.stopService()
    await sub.stopService()
    db_pub.close()
    db_sub.close()
    return results


async def main(reactor, admin_dsn: str) -> None:
    name = "ltw_bench_" + uuid.uuid4().hex[:12]
    conn = psycopg2.connect(admin_dsn)
    conn.autocommit = True
    conn.cursor().execute(f'CREATE DATABASE "{name}"')
    if os.environ.get("BENCH_ASYNC_COMMIT"):
        # Diagnostic only: how much of the claim cost is waiting for the WAL flush.
        conn.cursor().execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    dsn = dsn_with(admin_dsn, dbname=name)
    try:
        db = Database(dsn, size=2, reactor=reactor)
        await db.start()
        await migrate(db)
        (server_version,) = (await db.runQuery("SHOW server_version"))[0]
        db.close()
        claims = {}
        for n in CONSUMER_COUNTS:
            claims[n] = await bench_claims(reactor, dsn, n)
            print(f"# {n} consumers: {claims[n]:.0f} claims/s", file=sys.stderr)
        latency = await bench_latency(reactor, dsn)
    finally:
        conn.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()

    print(f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, Python "
          f"{platform.python_version()}, PostgreSQL {server_version} on the same host\n")
    print("| measure | value |")
    print("|---|---|")
    for n in CONSUMER_COUNTS:
        print(f"| claims/s, {n} consumer{'s' if n > 1 else ''} ({JOBS_PER_RUN} jobs) "
              f"| {claims[n]:.0f} |")
    for label, count in (("inline", INLINE_MESSAGES), ("spilled", SPILLED_MESSAGES)):
        p50, p99 = latency[label]
        print(f"| publish-to-deliver {label}, p50 / p99 ({count} msgs) "
              f"| {p50:.2f} ms / {p99:.2f} ms |")


if __name__ == "__main__":
    dsn_arg = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LOCALAI_TEST_DSN")
    if not dsn_arg:
        sys.exit("usage: bench_bus.py DSN   (or set LOCALAI_TEST_DSN)")
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, dsn_arg)))
