"""Benchmark of the bus: claim throughput and publish-to-deliver latency.

Usage:  python benchmarks/bench_bus.py [DSN]      (or set LOCALAI_TEST_DSN)

Environment: BENCH_JOBS (jobs per claim run, default 2000); BENCH_REPEATS (drains per consumer
count, default 3; the median is reported); BENCH_ASYNC_COMMIT=1 runs on a
scratch database with synchronous_commit = off, to show how much of the claim cost is the WAL
flush of each commit (diagnostic; the queue itself does not turn it off).

The DSN names a maintenance database on a server where this script may CREATE DATABASE; it
creates a scratch database, migrates it, measures, and drops it.  Results are printed as a
markdown table on stdout.  This is a script, not a test; it only refuses to report a claim
run that did not handle every row exactly once.

- claims: N jobs drained by 1, 4 and 16 ClaimConsumers, each on its own pool (size 2) with its
  own live instance id, max 4 in flight, a handler that returns at once.  Two rates per run,
  both from starting the consumers: claims/s (rows claimed, to the last claim) and cycles/s
  (rows claimed, handled and completed, to the last complete: the drain rate).  A consumer
  claims its free slots in one statement and completes finished rows in batches, so the
  statements per job are printed too.  Each run checks every row was handled exactly once and
  the table is empty.
- latency: two PgBus instances on separate pools in this process; one publishes, one
  subscribes; time from calling publish to the handler running, one message at a time
  (inline: a small payload; spilled: a 9000-byte payload, the size of a gallery install's
  snapshot with a long description, which the product spills).
- product jobs: the product's own job traffic on one replica's pool (4 connections, as the
  frontend opens): BENCH_PRODUCT_JOBS jobs (default 500) submitted through ``JobStore.submit``
  (what ``POST /api/jobs`` writes: the job row and its claim in one transaction, then the wake
  hint on the bus), 16 at a time, then drained by the replica's consumer (4 slots) with the
  dispatcher's statements for a successful run minus the worker: ``begin``, ``started``, one
  progress event, ``finish``, and the claim's own claim and complete.  Reported: submits/s,
  jobs/s drained, statements per job.
"""

from __future__ import annotations

import os
import platform
import statistics
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
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
CONSUMER_COUNTS = (1, 4, 16)
INLINE_MESSAGES = 1000
SPILLED_MESSAGES = 300


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


class _TimedQueue(ClaimQueue):
    """A ClaimQueue that notes when rows were last claimed and last completed (bench only)."""

    def __init__(self, db, marks):
        super().__init__(db)
        self.marks = marks

    async def claim_many(self, owner, kinds, limit):
        claims = await super().claim_many(owner, kinds, limit)
        if claims:
            self.marks["claimed"] += len(claims)
            self.marks["last_claim"] = time.perf_counter()
        return claims

    async def complete_many(self, claims):
        done = await super().complete_many(claims)
        n = sum(done)
        if n:
            self.marks["completed"] += n
            self.marks["last_complete"] = time.perf_counter()
        return done


async def bench_claims(reactor, dsn: str, consumers: int) -> dict[str, float]:
    """One drain of JOBS_PER_RUN rows by ``consumers`` consumers.

    - claims/s: rows claimed / time from starting the consumers to the last row claimed;
    - cycles/s: rows completed / time to the last complete (claim + no-op handler + complete:
      the rate at which the queue is actually drained).
    Both are checked, not assumed: every row claimed exactly once, the table empty at the end.
    """
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
    marks = {"claimed": 0, "completed": 0, "last_claim": 0.0, "last_complete": 0.0}
    seen: dict[str, int] = {}

    def handler(claim):
        seen[claim.id] = seen.get(claim.id, 0) + 1
        return None

    services = [ClaimConsumer(_TimedQueue(p, marks), o, ["task"], handler, max_in_flight=4,
                              poll_interval=2.0, reactor=reactor)
                for p, o in zip(pools, owners)]

    def check():
        if os.environ.get("BENCH_DEBUG"):
            print(marks, [s.stats for s in services][:2], file=sys.stderr)
        if marks["completed"] >= JOBS_PER_RUN and not finished.called:
            finished.callback(None)

    watcher = task.LoopingCall(check)
    watcher.clock = reactor
    started = time.perf_counter()
    for s in services:
        s.startService()
    watcher.start(0.5 if os.environ.get('BENCH_DEBUG') else 0.005)
    await finished
    watcher.stop()
    for s in services:
        await s.stopService()
    for p in pools:
        p.close()
    left = (await admin.runQuery("SELECT count(*) FROM work_claims"))[0][0]
    admin.close()
    if left or len(seen) != JOBS_PER_RUN or set(seen.values()) != {1}:
        raise SystemExit(f"benchmark run is wrong: {left} rows left, {len(seen)} distinct "
                         f"rows handled, repeats {set(seen.values())}")
    stats = [s.stats for s in services]
    return {
        "claims": marks["claimed"] / (marks["last_claim"] - started),
        "cycles": marks["completed"] / (marks["last_complete"] - started),
        "claim_statements": sum(st["claim_statements"] for st in stats),
        "complete_statements": sum(st["complete_statements"] for st in stats),
    }


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


PRODUCT_JOBS = int(os.environ.get("BENCH_PRODUCT_JOBS", "500"))


class _CountingDatabase(Database):
    """Counts the statements and transactions the product code issues (bench only)."""

    statements = 0

    def runQuery(self, *args, **kwargs):
        self.statements += 1
        return super().runQuery(*args, **kwargs)

    def runOperation(self, *args, **kwargs):
        self.statements += 1
        return super().runOperation(*args, **kwargs)

    def runInteraction(self, *args, **kwargs):
        self.statements += 1
        return super().runInteraction(*args, **kwargs)


async def bench_product_jobs(reactor, dsn: str) -> dict[str, float]:
    from localai_tw.frontend.jobs.store import CLAIM_KIND, JobStore

    db = _CountingDatabase(dsn, size=4, reactor=reactor)
    await db.start()
    owner = "bench-replica"
    await db.runOperation("INSERT INTO instances (id, last_seen) VALUES (%s, now())"
                          " ON CONFLICT (id) DO UPDATE SET last_seen = now()", (owner,))
    bus = PgBus(db, reactor=reactor)
    bus.startService()
    await bus.whenConnected()
    queue = ClaimQueue(db, bus)
    store = JobStore(db, queue)
    db.statements = 0
    started = time.perf_counter()
    ids: list[str] = []
    for start in range(0, PRODUCT_JOBS, 16):
        batch = await defer.gatherResults([
            defer.ensureDeferred(store.submit("embed-batch", {"texts": ["a", "b"]}))
            for _ in range(start, min(PRODUCT_JOBS, start + 16))])
        ids += [job["id"] for job in batch]
    submit_seconds = time.perf_counter() - started
    submit_statements = db.statements
    finished = defer.Deferred()
    done: dict[str, int] = {}

    async def handler(claim):
        job_id = claim.payload.decode("ascii")
        if await store.begin(job_id) is None:
            return
        await store.started(job_id)
        await store.add_event(job_id, {"event": "progress", "done": 1, "total": 1})
        await store.finish(job_id, "succeeded", result={"vectors": 2})
        done[job_id] = done.get(job_id, 0) + 1
        if len(done) == len(ids) and not finished.called:
            finished.callback(None)

    db.statements = 0
    consumer = ClaimConsumer(queue, owner, [CLAIM_KIND], handler, bus=bus, max_in_flight=4,
                             reactor=reactor)
    started = time.perf_counter()
    consumer.startService()
    await finished
    drain_seconds = time.perf_counter() - started
    await consumer.stopService()
    drain_statements = db.statements
    states = await db.runQuery("SELECT state, count(*) FROM jobs GROUP BY state")
    left = (await db.runQuery("SELECT count(*) FROM work_claims"))[0][0]
    await bus.stopService()
    db.close()
    if dict(states) != {"succeeded": len(ids)} or left or set(done.values()) != {1}:
        raise SystemExit(f"product jobs run is wrong: states {dict(states)}, {left} claims left")
    return {"submits": len(ids) / submit_seconds, "drained": len(ids) / drain_seconds,
            "submit_statements": submit_statements / len(ids),
            "drain_statements": drain_statements / len(ids)}


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
            runs = []
            for _ in range(REPEATS):
                runs.append(await bench_claims(reactor, dsn, n))
                print(f"# {n} consumers: {runs[-1]['claims']:.0f} claims/s, "
                      f"{runs[-1]['cycles']:.0f} cycles/s, "
                      f"{runs[-1]['claim_statements']} claim and "
                      f"{runs[-1]['complete_statements']} complete statements", file=sys.stderr)
            claims[n] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        latency = await bench_latency(reactor, dsn)
        product = await bench_product_jobs(reactor, dsn)
    finally:
        conn.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()

    print(f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, Python "
          f"{platform.python_version()}, PostgreSQL {server_version} on the same host\n")
    print("| measure | value |")
    print("|---|---|")
    for n in CONSUMER_COUNTS:
        c = claims[n]
        who = f"{n} consumer{'s' if n > 1 else ''}"
        print(f"| claims/s, {who} ({JOBS_PER_RUN} jobs, median of {REPEATS}) "
              f"| {c['claims']:.0f} |")
        print(f"| cycles/s (claim + no-op + complete), {who} | {c['cycles']:.0f} |")
        print(f"| statements per job (claim + complete), {who} "
              f"| {c['claim_statements'] / JOBS_PER_RUN:.2f} + "
              f"{c['complete_statements'] / JOBS_PER_RUN:.2f} |")
    for label, count in (("inline", INLINE_MESSAGES), ("spilled", SPILLED_MESSAGES)):
        p50, p99 = latency[label]
        print(f"| publish-to-deliver {label}, p50 / p99 ({count} msgs) "
              f"| {p50:.2f} ms / {p99:.2f} ms |")
    print(f"| product jobs: submitted per second (JobStore.submit, 16 at a time, "
          f"{PRODUCT_JOBS} jobs) | {product['submits']:.0f} |")
    print(f"| product jobs: drained per second (4 slots; begin, started, 1 event, finish, "
          f"claim, complete) | {product['drained']:.0f} |")
    print(f"| product jobs: statements per job, submit + drain "
          f"| {product['submit_statements']:.2f} + {product['drain_statements']:.2f} |")
    try:
        with open("/proc/loadavg") as f:
            print(f"\nLoad average at the end: {' '.join(f.read().split()[:3])}")
    except OSError:
        pass


if __name__ == "__main__":
    dsn_arg = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LOCALAI_TEST_DSN")
    if not dsn_arg:
        sys.exit("usage: bench_bus.py DSN   (or set LOCALAI_TEST_DSN)")
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, dsn_arg)))
