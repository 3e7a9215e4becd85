"""Benchmark of one replica holding a fleet: N simulated workers (real registration, heartbeats
every 10 s and tunnels, no backends) against one ``twistd`` frontend, then a restart.

Usage:  python benchmarks/bench_fleet.py [--dsn DSN] [--workers 1000] [--idle 30]
                                         [--cheap-registration] [--gc-threshold T0,T1,T2]
                                         [--stall-profile DIR] [--json PATH] [--keep]

What it measures (issue 15 §4), in one run:

- **connect**: the time for N workers started at once (after N/10, at most 10, started first
  to warm the replica) to register and hold a tunnel, the registrations refused (429) or
  retried, the dials deferred (503);
- **idle** (``--idle`` seconds with every tunnel held): the frontend's RSS per tunnel (RSS
  with the fleet minus RSS with the warm-up workers, over the others), its file descriptors, its CPU (% of one core),
  the database's transactions per second in the run's database (every statement the replica
  issues outside a transaction is one), and ``/healthz`` latency p50 and max (a thread
  polling every 100 ms, outside this process's reactor);
- **list**: ``GET /api/nodes`` followed through every page: time and bytes;
- **restart**: SIGTERM to the replica (its stop time and the "release failed" lines it logged),
  a new replica on the same port and database, the time until every worker holds a tunnel
  again, and what ``/readyz`` answered meanwhile (not-200s in a row at most, and by kind: a
  status, or ``closed``/``refused``/``timeout`` before one).

``--stall-profile DIR`` adds what the frontend's main thread ran during its longest busy runs
at idle (py-spy) and its garbage collections of 5 ms or more (benchmarks/README.md).

The simulated worker is this process: ``localai_tw``'s own WebSocket and yamux client, one
session per worker, the registration and heartbeat bodies a real worker sends, as often as a
real worker sends them (every 10 s; every 60 s while its replica announced in the tunnel's
upgrade answer that it stamps the worker's liveness, ``cluster/liveness.py``, counted from the
last answered beat or stamp notice, ``tunnel/stampnotice.py``); a dial refused
with 503 or failed is retried with equal-jitter backoff (1 s doubling to 15 s), a 429 after its
``Retry-After``.  The frontend is a real ``twistd localai-frontend`` process on a fresh
database that is dropped at the end.

A script, not a test: asserts nothing; every process it started is reaped and the database
dropped, even on failure or Ctrl-C.  The load average before and after is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_inference as bi  # noqa: E402  (database, processes, machine facts)

API_KEY = bi.API_KEY
TOKEN = bi.TOKEN


# -- the frontend process, read from /proc ---------------------------------------------------


def proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def proc_cpu_seconds(pid: int) -> float:
    user, system = proc_cpu_split(pid)
    return user + system


def proc_cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid``: the system share is the kernel's work for the
    process (on loopback that includes much of the receiving end's TCP work for its sends)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def tunnel_bytes(port: int) -> tuple[float, float] | None:
    """``localai_tunnel_bytes`` (in, out) from the replica's /metrics, or None where the tree
    has no such counter."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    body = conn.getresponse().read().decode("utf-8", "replace")
    conn.close()
    found = {sample.labels.get("direction"): sample.value
             for family in text_string_to_metric_families(body)
             for sample in family.samples if sample.name == "localai_tunnel_bytes_total"}
    if "in" not in found or "out" not in found:
        return None
    return found["in"], found["out"]


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- probes in a thread (not delayed by this process's reactor) -------------------------------


class Poller(threading.Thread):
    """GETs ``path`` every ``interval`` (a new connection each time, as a load balancer's health
    check does) and records ``(status, seconds, when)`` until stopped.

    ``status`` is the HTTP status, or what went wrong before one arrived: ``"refused"`` (nothing
    listening), ``"closed"`` (the connection was accepted, then closed or reset before an
    answer: what a listener over its connection cap does), ``"timeout"`` (no answer within
    5 s), ``"error:<kind>"`` otherwise.  ``when`` is ``time.monotonic()`` at the start.
    """

    def __init__(self, port: int, path: str, interval: float = 0.1):
        super().__init__(daemon=True)
        self.port, self.path, self.interval = port, path, interval
        self.samples: list[tuple[int | str, float, float]] = []
        #: The body of each answer that was not 200 (the first 200 bytes), by status.
        self.reasons: dict[int, str] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            started = time.monotonic()
            status: int | str
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                try:
                    conn.request("GET", self.path)
                    response = conn.getresponse()
                    body = response.read()
                    status = response.status
                    if status != 200:
                        self.reasons[status] = body[:200].decode("utf-8", "replace")
                finally:
                    conn.close()
            except TimeoutError:
                status = "timeout"
            except ConnectionRefusedError:
                status = "refused"
            except (ConnectionResetError, BrokenPipeError, http.client.BadStatusLine):
                status = "closed"  # RemoteDisconnected is both of the first and the last
            except (OSError, http.client.HTTPException) as e:
                status = f"error:{type(e).__name__}"
            self.samples.append((status, time.monotonic() - started, started))
            self._stop_event.wait(self.interval)

    def stop(self) -> list[tuple[int, float]]:
        self._stop_event.set()
        self.join(10)
        return self.samples


def kinds(samples) -> dict[str, int]:
    """How many samples were not 200, by status or failure kind."""
    counts: dict[str, int] = {}
    for status, *_ in samples:
        if status != 200:
            counts[str(status)] = counts.get(str(status), 0) + 1
    return counts


def longest_run(samples, bad) -> int:
    best = run = 0
    for status, *_ in samples:
        run = run + 1 if bad(status) else 0
        best = max(best, run)
    return best


# -- the simulated fleet (runs on the reactor) -----------------------------------------------


class OwnClock:
    """A simulated worker's own view of the reactor.  The keepalives of every session of one
    reactor share a timer (``mux/wheel.py``): without this the fleet's sessions, all in this
    process, would ping on the same ticks, which a real fleet (a process per worker, each on its
    own phase) never does, and the replica would see its pings in bursts."""

    def __init__(self, reactor):
        self._reactor = reactor

    def __getattr__(self, name):
        return getattr(self._reactor, name)


class Fleet:
    def __init__(self, reactor, port: int, count: int):
        from twisted.web.client import HTTPConnectionPool

        self.reactor = reactor
        self.port = port
        self.count = count
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = 64
        self.workers = [{"name": f"fleet-{i:05d}", "session": None, "id": None,
                         "credential": None} for i in range(count)]
        self.counts = {"registered": 0, "register_429": 0, "register_failed": 0,
                       "dial_503": 0, "dial_failed": 0, "heartbeat_ok": 0,
                       "heartbeat_failed": 0, "heartbeat_skipped": 0, "stamp_notices": 0}
        #: the failed heartbeats by what came back: an HTTP status or an exception's type
        self.heartbeat_failures: Counter = Counter()
        self.running = True
        self.last_error = ""

    @property
    def connected(self) -> int:
        return sum(1 for w in self.workers if w["session"] is not None
                   and w["session"].isOpen)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _post(self, path: str, body: dict):
        import treq

        response = await treq.post(self.url(path), json=body, pool=self.pool,
                                   headers={"Authorization": f"Bearer {TOKEN}"},
                                   reactor=self.reactor).addTimeout(30, self.reactor)
        content = await treq.content(response)
        return response.code, content, response.headers

    async def register(self, worker) -> None:
        delay = 1.0
        while self.running:
            key = hashlib.sha256(worker["name"].encode()).hexdigest()
            try:
                code, content, headers = await self._post(
                    "/api/node/register", {"name": worker["name"], "node_key": key,
                                           "node_type": "backend"})
            except Exception as e:
                code, content, headers = None, b"", None
                self.last_error = repr(e)
            if code == 201:
                answer = json.loads(content)
                worker["id"], worker["credential"] = answer["id"], answer["tunnel_token"]
                self.counts["registered"] += 1
                return
            if code == 429:
                self.counts["register_429"] += 1
                wait = float((headers.getRawHeaders(b"retry-after") or [b"5"])[0])
            else:
                self.counts["register_failed"] += 1
                wait = delay * (0.5 + random.random() / 2)
                delay = min(delay * 2, 15.0)
            await self.sleep(wait)

    async def dial(self, worker) -> None:
        from localai_tw.mux.session import Session
        from localai_tw.tunnel.dialer import worker_session_config
        try:  # a tree whose workers say they ping (run against an older tree: they do not)
            from localai_tw.tunnel.keepalive import WORKER_PINGS, WORKER_PINGS_HEADER
            says = {WORKER_PINGS_HEADER: WORKER_PINGS}
        except ImportError:
            says = {}
        try:  # and that they take stamp notices (tunnel/stampnotice.py)
            from localai_tw.tunnel.stampnotice import STAMP_NOTICES, STAMP_NOTICES_HEADER
            says[STAMP_NOTICES_HEADER] = STAMP_NOTICES
            acceptor = self.notice_acceptor(worker)
        except ImportError:
            acceptor = None
        from localai_tw.tunnel.websocket import HandshakeFailed, connectWebSocket

        delay = 1.0
        while self.running:
            try:
                session = await connectWebSocket(
                    self.reactor,
                    f"ws://127.0.0.1:{self.port}/api/cluster/connect?id={worker['id']}",
                    # The real worker's keepalive (tunnel/keepalive.py), on a clock of its own.
                    lambda: Session(client=True, config=worker_session_config(),
                                    acceptor=acceptor, reactor=OwnClock(self.reactor)),
                    # What the real worker's dial sends (tunnel/dialer.py).
                    headers={"Authorization": f"Bearer {worker['credential']}", **says})
            except HandshakeFailed as e:
                self.counts["dial_503" if e.status == 503 else "dial_failed"] += 1
                self.last_error = repr(e)
            except Exception as e:
                self.counts["dial_failed"] += 1
                self.last_error = repr(e)
            else:
                worker["session"] = session
                session.whenClosed().addBoth(lambda _: self._lost(worker, session))
                return
            await self.sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, 15.0)

    def notice_acceptor(self, worker):
        """What a real worker's stream router does with the replica's ``stamped`` stream
        (``worker/streams.py``): answer ``ok``, then count every notice as an answered
        heartbeat; any other stream is refused ``unknown-tag`` (none comes at idle)."""
        from twisted.internet.protocol import Protocol

        from localai_tw.tunnel import preamble
        from localai_tw.tunnel.stampnotice import NoticeReader

        fleet = self

        def noticed(status: str) -> None:
            fleet.counts["stamp_notices"] += 1
            worker["beat_at"] = fleet.reactor.seconds()

        class StampedOnly(Protocol):
            def __init__(self):
                self.reader, self.notices = preamble.FrameReader(), None

            def dataReceived(self, data):
                if self.notices is not None:
                    self.notices.dataReceived(data)
                    return
                payload, rest = self.reader.feed(data)
                if payload is None:
                    return
                if preamble.parse_request(payload).tag != preamble.TAG_STAMPED:
                    self.transport.write(preamble.encode_refused(preamble.UNKNOWN_TAG, "idle"))
                    self.transport.loseConnection()
                    return
                self.transport.write(preamble.encode_accepted())
                self.notices = NoticeReader(noticed)
                self.notices.makeConnection(self.transport)
                if rest:
                    self.notices.dataReceived(rest)

        return lambda stream: StampedOnly()

    def _lost(self, worker, session) -> None:
        if worker["session"] is session:
            worker["session"] = None
            if self.running:
                from twisted.internet import defer

                defer.ensureDeferred(self.dial(worker))

    async def start_one(self, worker) -> None:
        await self.register(worker)
        await self.dial(worker)

    def liveness_by_tunnel(self, worker) -> bool:
        """The worker's tunnel is up and its replica said it stamps the worker's liveness
        (``X-LocalAI-Liveness: tunnel``): a real worker then beats over HTTP only on a capacity
        change (none here) or its slow refresh (``worker/service.py``)."""
        try:
            from localai_tw.tunnel.keepalive import LIVENESS_BY_TUNNEL, LIVENESS_HEADER
        except ImportError:  # a tree from before liveness by tunnel: always beat
            return False
        session = worker["session"]
        if session is None or not session.isOpen:
            return False
        headers = getattr(session.transport, "answer_headers", None) or {}
        return headers.get(LIVENESS_HEADER.lower()) == LIVENESS_BY_TUNNEL

    async def heartbeats(self) -> None:
        """Every worker's heartbeat turn comes every 10 s, spread evenly over the period; it
        beats as a real worker does: always, unless its tunnel carries liveness, then every
        ``CAPACITY_REFRESH_SECONDS`` (its capacity never changes here)."""
        from twisted.internet import defer

        try:
            await self._heartbeats()
        except defer.CancelledError:
            pass

    async def _heartbeats(self) -> None:
        while self.running:
            for worker in self.workers:
                if not self.running:
                    return
                if worker["id"] is not None:
                    from twisted.internet import defer

                    liveness = self.liveness_by_tunnel(worker)
                    if liveness and "beat_at" not in worker:
                        # The steady state: the fleet's refreshes spread evenly over the
                        # period, not every worker's first one inside the idle phase.
                        worker["beat_at"] = self.reactor.seconds() - \
                            random.random() * CAPACITY_REFRESH_SECONDS
                    if (liveness and self.reactor.seconds() - worker["beat_at"]
                            < CAPACITY_REFRESH_SECONDS):
                        self.counts["heartbeat_skipped"] += 1
                    else:
                        defer.ensureDeferred(self._beat(worker))
                await self.sleep(10.0 / self.count)

    async def _beat(self, worker) -> None:
        try:
            # What a real worker sends: its credential and its capacity.
            code, _, _ = await self._post(f"/api/node/{worker['id']}/heartbeat",
                                          {"tunnel_token": worker["credential"],
                                           "capacity": HEARTBEAT_CAPACITY})
        except Exception as e:
            code = type(e).__name__
        if code == 200:
            self.counts["heartbeat_ok"] += 1
            worker["beat_at"] = self.reactor.seconds()
        else:
            self.counts["heartbeat_failed"] += 1
            self.heartbeat_failures[str(code)] += 1

    def sleep(self, seconds: float):
        from twisted.internet import task

        return task.deferLater(self.reactor, seconds, lambda: None)

    async def wait_all_connected(self, timeout: float) -> float:
        started = time.monotonic()
        while self.connected < self.count:
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"only {self.connected} of {self.count} workers connected "
                                   f"after {timeout:g} s (last error: {self.last_error})")
            await self.sleep(0.1)
        return time.monotonic() - started

    async def close(self) -> None:
        self.running = False
        for worker in self.workers:
            if worker["session"] is not None:
                worker["session"].loseConnection()
        await self.pool.closeCachedConnections()


# -- the run ---------------------------------------------------------------------------------


def list_nodes(port: int) -> tuple[float, int, int]:
    """(seconds, bytes, nodes) of GET /api/nodes through every page."""
    started, size, nodes, after = time.monotonic(), 0, 0, None
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        path = "/api/nodes" + (f"?after={after}" if after else "")
        conn.request("GET", path, headers={"Authorization": f"Bearer {API_KEY}"})
        body = conn.getresponse().read()
        conn.close()
        size += len(body)
        page = json.loads(body)
        nodes += len(page["nodes"])
        after = page.get("next")
        if not after:
            return time.monotonic() - started, size, nodes


def xact_commits(bench) -> int:
    return int(bench.sql("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                         (bench.db_name,))[0][0])


#: A simulated worker whose tunnel carries liveness beats this often (``worker/service.py``'s
#: ``CAPACITY_REFRESH_SECONDS``, spelled here so the script also runs against older trees).
CAPACITY_REFRESH_SECONDS = 60.0

#: The capacity a simulated worker reports in each heartbeat (a real worker sends its own).
HEARTBEAT_CAPACITY = {"total_vram": 0, "available_vram": 0, "total_ram": 16 << 30,
                      "available_ram": 8 << 30, "total_disk": 100 << 30,
                      "available_disk": 50 << 30}


async def run(reactor, bench, args) -> dict:
    from twisted.internet import defer, threads

    models = os.path.join(bench.workdir, "models")
    os.makedirs(models)
    fe = start_frontend_on(bench, "replica", models, {"port": bi.free_port()})
    await threads.deferToThread(bench.wait_ready, fe)
    pid = fe["proc"].pid
    report: dict = {"workers": args.workers, "cheap_registration": args.cheap_registration,
                    "heartbeat_batch": args.heartbeat_batch,
                    "keepalive_every_interval": args.keepalive_every_interval,
                    "keepalive": args.keepalive,
                    "gc_threshold": args.gc_threshold}

    fleet = Fleet(reactor, fe["port"], args.workers)
    # A few workers first, so the RSS baseline includes what any first tunnel costs (imports,
    # pools); then the rest all at once.
    warm = min(10, args.workers // 10)
    for worker in fleet.workers[:warm]:
        await fleet.start_one(worker)
    await fleet.sleep(2)
    rss_before = proc_rss(pid)
    if args.snapshots:
        await threads.deferToThread(take_snapshot, pid, args.snapshots, 1)
        rss_before = proc_rss(pid)
    started = time.monotonic()
    for worker in fleet.workers[warm:]:
        defer.ensureDeferred(fleet.start_one(worker))
    report["connect_seconds"] = round(await fleet.wait_all_connected(args.timeout), 2)
    report["connect_counts"] = dict(fleet.counts)
    beating = defer.ensureDeferred(fleet.heartbeats())

    # idle
    await fleet.sleep(5)
    health = Poller(fe["port"], "/healthz")
    health.start()
    beats0 = dict(fleet.counts)
    wire0 = await threads.deferToThread(tunnel_bytes, fe["port"])
    split0, tx0, t0 = proc_cpu_split(pid), xact_commits(bench), time.monotonic()
    wall0 = time.time()
    spy = start_py_spy(args, pid, "idle") if args.stall_profile else None
    await fleet.sleep(args.idle)
    split1, tx1, t1 = proc_cpu_split(pid), xact_commits(bench), time.monotonic()
    wire1 = await threads.deferToThread(tunnel_bytes, fe["port"])
    cpu0, cpu1 = sum(split0), sum(split1)
    if spy is not None:
        report["stalls"] = await threads.deferToThread(stall_report, args, spy, wall0,
                                                       time.time(), fe["name"])
    health_samples = health.stop()
    samples = sorted(s for _, s, _ in health_samples)
    report["idle"] = {
        "rss_mib": round(proc_rss(pid) / 2**20, 1),
        "rss_per_tunnel_kib": round((proc_rss(pid) - rss_before)
                                    / max(1, args.workers - warm) / 1024, 1),
        "fds": proc_fds(pid),
        "cpu_percent_of_a_core": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
        "cpu_user_system_percent": [round(100 * (split1[i] - split0[i]) / (t1 - t0), 1)
                                    for i in (0, 1)],
        # yamux bytes a second through the tunnels (in: from workers); an idle tunnel's only
        # traffic is a 12-byte ping and its 12-byte answer
        "tunnel_bytes_per_second": None if wire0 is None or wire1 is None else [
            round((wire1[i] - wire0[i]) / (t1 - t0), 1) for i in (0, 1)],
        "transactions_per_second": round((tx1 - tx0) / (t1 - t0), 1),
        "heartbeats_ok_per_second": round(
            (fleet.counts["heartbeat_ok"] - beats0["heartbeat_ok"]) / (t1 - t0), 1),
        "heartbeats_failed": fleet.counts["heartbeat_failed"] - beats0["heartbeat_failed"],
        "heartbeat_failures_by_kind": dict(fleet.heartbeat_failures),
        "heartbeat_turns_skipped_per_second": round(
            (fleet.counts["heartbeat_skipped"] - beats0["heartbeat_skipped"]) / (t1 - t0), 1),
        "stamp_notices_per_second": round(
            (fleet.counts["stamp_notices"] - beats0["stamp_notices"]) / (t1 - t0), 1),
        "tunnels_carrying_liveness": sum(1 for w in fleet.workers
                                         if fleet.liveness_by_tunnel(w)),
        "healthz_p50_ms": round(1000 * bi.percentile(samples, 50), 1) if samples else None,
        "healthz_max_ms": round(1000 * samples[-1], 1) if samples else None,
        "healthz_not_200": kinds(health_samples),
        "healthz_slowest": [[round(1000 * s, 1), round(when - t0, 2)] for _, s, when
                            in sorted(health_samples, key=lambda x: -x[1])[:5]],
    }
    if args.snapshots:
        await threads.deferToThread(take_snapshot, pid, args.snapshots, 2)
        report["snapshots"] = snapshot_diff(args.snapshots, args.workers - warm)
        os.environ.pop("FLEET_SNAPSHOT_DIR")  # the replica of the restart runs untraced
    seconds, size, nodes = await threads.deferToThread(list_nodes, fe["port"])
    report["api_nodes"] = {"seconds": round(seconds, 3), "bytes": size, "nodes": nodes}

    if args.no_restart:
        fleet.running = False
        beating.cancel()
        await fleet.close()
        report["elapsed_seconds"] = round(time.monotonic() - started, 1)
        return report

    # restart
    ready = Poller(fe["port"], "/readyz")
    stopping = time.monotonic()
    fe["proc"].popen.send_signal(signal.SIGTERM)
    await threads.deferToThread(fe["proc"].popen.wait, 120)
    report["stop_seconds"] = round(time.monotonic() - stopping, 2)
    with open(fe["proc"].log_path, errors="replace") as f:
        log_text = f.read()
    report["stop_release_failed_lines"] = log_text.count("release failed")
    fleet.counts = dict.fromkeys(fleet.counts, 0)
    again = bench.start_frontend_on("replica-2", models, fe)
    restarted = time.monotonic()
    ready.start()
    await threads.deferToThread(bench.wait_ready, again)
    report["restart_ready_seconds"] = round(time.monotonic() - restarted, 2)
    await fleet.wait_all_connected(args.timeout)
    report["restart_all_connected_seconds"] = round(time.monotonic() - restarted, 2)
    await fleet.sleep(5)
    readyz = ready.stop()
    after_ready = [s for s in readyz if s[0] == 200]
    first_ready = readyz.index(after_ready[0]) if after_ready else len(readyz)
    serving = readyz[first_ready:]
    report["restart_readyz"] = {
        "samples_after_first_ready": len(serving),
        "not_ready_after_first_ready": sum(1 for s, *_ in serving if s != 200),
        "longest_not_ready_run_after_first_ready": longest_run(serving, lambda s: s != 200),
        "not_ready_kinds": kinds(serving),
        "not_ready_at_seconds_after_restart": [round(when - restarted, 2) for s, _, when
                                               in serving if s != 200][:40],
        "answers_not_200": {str(k): v for k, v in ready.reasons.items()},
        "slowest_ms": round(1000 * max((s for _, s, _ in serving), default=0), 1),
    }

    report["restart_counts"] = dict(fleet.counts)
    fleet.running = False
    beating.cancel()
    await fleet.close()
    report["elapsed_seconds"] = round(time.monotonic() - started, 1)
    return report


def take_snapshot(pid: int, directory: str, n: int) -> None:
    """Ask the frontend (started with ``--snapshots``) for snapshot ``n`` and wait for it."""
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(directory, f"{n}-done")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the frontend wrote no snapshot {n} in {directory}")
        time.sleep(0.2)


def snapshot_diff(directory: str, tunnels: int, top: int = 25) -> dict:
    """What grew between snapshot 1 (warm-up workers) and 2 (the fleet, idle), per tunnel:
    tracemalloc by file:line and live objects by type."""
    import tracemalloc

    first = tracemalloc.Snapshot.load(os.path.join(directory, "1-snap.pickle"))
    second = tracemalloc.Snapshot.load(os.path.join(directory, "2-snap.pickle"))
    stats = second.compare_to(first, "lineno")
    with open(os.path.join(directory, "1-types.json")) as f:
        types1 = json.load(f)
    with open(os.path.join(directory, "2-types.json")) as f:
        types2 = json.load(f)
    grown = sorted(((n - types1.get(t, 0), t) for t, n in types2.items()), reverse=True)
    return {
        "traced_bytes_per_tunnel": round(sum(s.size_diff for s in stats) / tunnels),
        "lines": [{"where": f"{s.traceback[0].filename}:{s.traceback[0].lineno}",
                   "bytes_per_tunnel": round(s.size_diff / tunnels, 1),
                   "blocks_per_tunnel": round(s.count_diff / tunnels, 2)}
                  for s in stats[:top]],
        "objects_per_tunnel": [{"type": t, "count": round(n / tunnels, 2)}
                               for n, t in grown[:top]],
    }


# -- --cheap-registration, --stall-profile: prepended to the frontend's program -------------

#: ``--cheap-registration``: the frontend's scrypt of each presented registration token at a
#: token cost (N=16 instead of 2**14, microseconds instead of about 50 ms of CPU).  Not the
#: product: for runs about the tunnels, the restart storm and idle costs on a busy machine,
#: where thousands of full-cost scrypts at once make the connect phase take many minutes.
#: ``--keepalive-every-interval``: both ends of a tunnel ping every interval whatever they read
#: (the rule before ``keepalive_when_quiet``), in the frontend and in the simulated fleet.
KEEPALIVE_EVERY_INTERVAL = """
import localai_tw.tunnel.keepalive as _keepalive
_keepalive.PING_ONLY_WHEN_QUIET = False
"""

#: ``--keepalive INTERVAL,TIMEOUT``: another keepalive for worker tunnels (an experiment; the
#: replica's liveness lag follows the detection bound, as it is read at import).
KEEPALIVE_TIMES = """
import localai_tw.tunnel.keepalive as _keepalive
_keepalive.TUNNEL_KEEPALIVE_INTERVAL = {interval}
_keepalive.TUNNEL_KEEPALIVE_TIMEOUT = {timeout}
_keepalive.DEAD_TUNNEL_DETECTION = {interval} + {timeout}
_keepalive.WORKER_PING_INTERVAL = {interval}
"""

CHEAP_REGISTRATION = """
import localai_tw.cluster.nodes as _nodes
_nodes._TOKEN_SCRYPT = {"n": 2 ** 4, "r": 8, "p": 1}
"""

# -- --stall-profile: what runs on the frontend's reactor when /healthz is slow ---------------

#: Prepended to the frontend's ``python -c`` program with ``--stall-profile``: every garbage
#: collection that takes 5 ms or more is written to ``$BENCH_GC_LOG`` (wall time, generation,
#: milliseconds, objects collected).
GC_HOOK = """
import gc as _gc, os as _os, time as _time
_gc_file = open(_os.environ["BENCH_GC_LOG"], "a", buffering=1)
_gc_started = [0.0]
def _gc_timer(phase, info):
    if phase == "start":
        _gc_started[0] = _time.perf_counter()
        return
    took = _time.perf_counter() - _gc_started[0]
    if took >= 0.005:
        _gc_file.write("%.3f %d %.1f %d\\n" % (_time.time(), info["generation"], took * 1000,
                                               info["collected"]))
_gc.callbacks.append(_gc_timer)
"""


def start_py_spy(args, pid: int, phase: str):
    """``py-spy record`` of ``pid`` for ``args.idle`` seconds (speedscope, 100 Hz, without
    pausing the process, idle samples kept so the timeline is whole)."""
    import subprocess

    output = os.path.join(args.stall_profile, f"{phase}.speedscope.json")
    popen = subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--duration", str(max(1, int(args.idle))),
         "--rate", "100", "--nonblocking", "--idle", "--format", "speedscope",
         "--output", output], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return popen, output


#: A main-thread sample whose innermost frame is one of these is the reactor waiting (py-spy
#: names methods ``Class.method``).
_IDLE_FRAMES = {"doPoll", "doSelect"}


def stall_report(args, spy, wall0: float, wall1: float, name: str) -> dict:
    """The longest runs of consecutive busy samples of the frontend's main thread (each sample
    is 10 ms), with the frames most of each run was in, and the garbage collections of 5 ms or
    more during the same window."""
    from collections import Counter

    popen, output = spy
    _, err = popen.communicate(timeout=args.idle + 60)
    report: dict = {"py_spy": output}
    try:
        with open(output) as f:
            data = json.load(f)
    except (OSError, ValueError):
        report["py_spy_error"] = err.decode(errors="replace")[-500:]
        return report
    frames = data["shared"]["frames"]
    main = next((p for p in data["profiles"] if "MainThread" in p["name"]), None)
    if main is None:
        report["py_spy_error"] = "no MainThread in the profile"
        return report
    runs: list[tuple[int, int]] = []  # (start index, length)
    start = None
    samples = main["samples"]
    for i, stack in enumerate(samples + [[]]):
        busy = bool(stack) and \
            frames[stack[-1]]["name"].rsplit(".", 1)[-1] not in _IDLE_FRAMES
        if busy and start is None:
            start = i
        elif not busy and start is not None:
            runs.append((start, i - start))
            start = None
    runs.sort(key=lambda r: -r[1])
    report["main_thread_samples"] = len(samples)
    report["busy_fraction"] = round(sum(n for _, n in runs) / max(1, len(samples)), 3)
    longest = []
    for first, length in runs[:5]:
        counts: Counter = Counter()
        for stack in samples[first:first + length]:
            for index in set(stack):
                frame = frames[index]
                counts[f"{frame['name']} ({os.path.basename(frame['file'])}:{frame['line']})"] += 1
        reactor = {"run", "mainLoop", "runUntilCurrent", "doIteration", "<module>",
                   "runReactorWithLogging", "startReactor", "runApp", "postApplication",
                   "doPoll", "_doReadOrWrite"}
        top = [f"{what} {n}" for what, n in counts.most_common(40)
               if what.split(" ")[0].rsplit(".", 1)[-1] not in reactor][:12]
        longest.append({"ms": length * 10, "at_seconds": round(first / 100, 2), "frames": top})
    report["longest_busy_runs"] = longest
    gc_log = os.environ.get("BENCH_GC_LOG")
    pauses = []
    if gc_log and os.path.exists(gc_log):
        with open(gc_log) as f:
            for line in f:
                when, generation, ms, collected = line.split()
                if wall0 <= float(when) <= wall1:
                    pauses.append((float(ms), int(generation), int(collected)))
    report["gc_pauses_5ms_or_more"] = len(pauses)
    report["gc_longest"] = sorted(pauses, reverse=True)[:5]
    return report


def start_frontend_on(bench, name: str, models_dir: str, previous: dict) -> dict:
    """A replica on ``previous``'s port and database (a restart), with a new instance id."""
    import uuid

    port = previous["port"]
    data_dir = os.path.join(bench.workdir, name)
    os.makedirs(data_dir)
    instance_id = f"{name}-{uuid.uuid4().hex[:8]}"
    proc = bench._spawn(name, [
        "localai-frontend", "--listen", f"tcp:{port}:interface=127.0.0.1",
        "--database-url", bench.dsn, "--instance-id", instance_id,
        "--advertise-address", f"127.0.0.1:{port}", "--single-host",
        "--registration-token", TOKEN, "--api-key", API_KEY,
        "--data-dir", data_dir, "--models-dir", models_dir,
        "--registration-limit", str(bench.args.registration_limit),
        *(["--heartbeat-batch", bench.args.heartbeat_batch]
          if bench.args.heartbeat_batch is not None else [])])
    return {"name": name, "proc": proc, "port": port, "instance_id": instance_id,
            "data_dir": data_dir}


def render(report: dict) -> str:
    idle = report["idle"]
    rows = [
        ("workers", report["workers"]),
        ("registration's scrypt", "N=16 (--cheap-registration, not the product's cost)"
         if report.get("cheap_registration") else "the product's (N=2**14)"),
        ("frontend's gc.set_threshold", report.get("gc_threshold")
         or "its own (frontend/tap.py GC_THRESHOLDS; Python's default before it had one)"),
        ("all registered and connected (s)", report["connect_seconds"]),
        ("registrations refused 429 / failed; dials deferred 503 / failed",
         "{register_429} / {register_failed}; {dial_503} / {dial_failed}".format(
             **report["connect_counts"])),
        ("frontend RSS (MiB); per idle tunnel (KiB)",
         f"{idle['rss_mib']}; {idle['rss_per_tunnel_kib']}"),
        ("frontend fds", idle["fds"]),
        ("frontend CPU at idle (% of a core)", idle["cpu_percent_of_a_core"]),
        ("of which user / system (% of a core)",
         " / ".join(str(x) for x in idle["cpu_user_system_percent"])),
        ("tunnel bytes/s at idle in / out (yamux; a ping and its answer: 12 bytes each)",
         " / ".join(str(x) for x in idle["tunnel_bytes_per_second"])
         if idle["tunnel_bytes_per_second"] else "not counted by this tree"),
        ("database transactions/s at idle", idle["transactions_per_second"]),
        ("heartbeats answered 200 per second at idle; failed (whole run, by kind)",
         f"{idle['heartbeats_ok_per_second']}; {idle['heartbeats_failed']}"
         f" ({idle['heartbeat_failures_by_kind'] or 'none'})"),
        ("tunnels carrying liveness; heartbeat turns skipped per second",
         f"{idle['tunnels_carrying_liveness']}; {idle['heartbeat_turns_skipped_per_second']}"),
        ("stamp notices received per second (tunnel/stampnotice.py)",
         idle["stamp_notices_per_second"]),
        ("frontend's --heartbeat-batch", report.get("heartbeat_batch") or "its default"),
        ("tunnel keepalive", ("every interval, both ends (--keepalive-every-interval)"
                              if report.get("keepalive_every_interval")
                              else "when quiet (the product's)")
         + (f", interval,timeout {report['keepalive']} s (--keepalive)"
            if report.get("keepalive") else "")),
        ("/healthz p50 / max (ms)", f"{idle['healthz_p50_ms']} / {idle['healthz_max_ms']}"),
        ("GET /api/nodes, every page (s; bytes)",
         f"{report['api_nodes']['seconds']}; {report['api_nodes']['bytes']}"),
    ]
    restart_rows = [
        ("stop (s); 'release failed' lines", f"{report['stop_seconds']}; "
                                              f"{report['stop_release_failed_lines']}"),
        ("restart: ready (s); all connected again (s)",
         f"{report['restart_ready_seconds']}; {report['restart_all_connected_seconds']}"),
        ("/readyz not 200 after first ready (samples; longest run)",
         f"{report['restart_readyz']['not_ready_after_first_ready']} of "
         f"{report['restart_readyz']['samples_after_first_ready']}; "
         f"{report['restart_readyz']['longest_not_ready_run_after_first_ready']}"),
        ("/readyz not 200 after first ready, by kind; at s after restart",
         f"{report['restart_readyz']['not_ready_kinds'] or '-'}; "
         f"{report['restart_readyz']['not_ready_at_seconds_after_restart'] or '-'}"),
        ("/readyz slowest answer after first ready (ms)", report["restart_readyz"]["slowest_ms"]),
        ("restart: dials deferred 503 / failed",
         "{dial_503} / {dial_failed}".format(**report["restart_counts"])),
    ] if "stop_seconds" in report else []
    lines = ["| what | value |", "|---|---|"]
    lines += [f"| {what} | {value} |" for what, value in rows + restart_rows]
    if restart_rows and report["restart_readyz"]["answers_not_200"]:
        lines.append("")
        lines += [f"/readyz answered {status}: {body}" for status, body
                  in report["restart_readyz"]["answers_not_200"].items()]
    if idle["healthz_not_200"]:
        lines.append(f"/healthz not 200 at idle: {idle['healthz_not_200']}")
    lines.append(f"/healthz slowest at idle (ms, at s into the idle phase): "
                 f"{idle['healthz_slowest']}")
    stalls = report.get("stalls")
    if stalls:
        lines.append("")
        lines.append(f"stall profile ({stalls.get('py_spy')}): main thread busy "
                     f"{stalls.get('busy_fraction')} of {stalls.get('main_thread_samples')} "
                     f"samples; {stalls.get('py_spy_error', '')}")
        for run in stalls.get("longest_busy_runs", []):
            lines.append(f"- {run['ms']} ms busy from {run['at_seconds']} s into the idle phase: "
                         + "; ".join(run["frames"]))
        lines.append(f"garbage collections of 5 ms or more during the idle phase: "
                     f"{stalls.get('gc_pauses_5ms_or_more')}; longest (ms, generation, "
                     f"collected): {stalls.get('gc_longest')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("LOCALAI_TEST_DSN") or bi.DEFAULT_DSN,
                        help="maintenance DSN where CREATE DATABASE is allowed")
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--idle", type=float, default=30.0,
                        help="seconds measured with every tunnel held")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds allowed for the fleet to connect")
    parser.add_argument("--registration-limit", type=int, default=0,
                        help="the replica's --registration-limit (default 0, no limit: every "
                        "simulated worker registers from 127.0.0.1, which a real fleet does "
                        "not; give the product's default, 1200, to see a NAT'd fleet)")
    parser.add_argument("--cheap-registration", action="store_true",
                        help="the frontend's scrypt of each registration token at a token "
                        "cost (N=16): not the product's registration cost; for runs about the "
                        "tunnels, the restart storm and idle figures on a busy machine")
    parser.add_argument("--gc-threshold", metavar="T0,T1,T2",
                        help="the frontend's gc.set_threshold (Python's default: 700,10,10; "
                        "the product's: frontend/tap.py GC_THRESHOLDS), set before it starts: "
                        "an experiment on the garbage collector, not an option of the product")
    parser.add_argument("--stall-profile", metavar="DIR",
                        help="find the /healthz stalls: record the frontend with py-spy "
                        "during the idle phase (DIR/idle.speedscope.json; needs py-spy, "
                        "not a project dependency) and time its garbage collections "
                        "(DIR/gc-*.log); the report adds the longest busy runs of its main "
                        "thread and the longest collections. Costs the frontend some CPU.")
    parser.add_argument("--heartbeat-batch", metavar="DURATION",
                        help="the frontend's --heartbeat-batch (default: the frontend's own; "
                             "0: each heartbeat its own statements, the path before batching)")
    parser.add_argument("--keepalive-every-interval", action="store_true",
                        help="both ends of every tunnel ping every interval whatever they read "
                             "(the rule before keepalive_when_quiet): the same-run baseline")
    parser.add_argument("--keepalive", metavar="INTERVAL,TIMEOUT",
                        help="an experiment: the worker tunnel's keepalive interval and timeout "
                             "in seconds on both ends (the product's: the worker pings every 5 s "
                             "and the bound is 10 s; the frontend pings an older worker 3,7; "
                             "their sum is the detection bound)")
    parser.add_argument("--no-restart", action="store_true",
                        help="stop after the idle phase (no stop, restart and reconnect storm)")
    parser.add_argument("--json", help="also write the report as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--snapshots", metavar="DIR",
                        help="run the first replica with tracemalloc and write two snapshots "
                        "into DIR (after the warm-up workers, at the end of the idle phase); "
                        "the report then attributes the growth per tunnel by file:line and "
                        "by object type (tracemalloc slows the replica: keep its CPU and "
                        "connect figures out of comparisons)")
    args = parser.parse_args()
    args.profile = None
    if args.snapshots:
        args.snapshots = os.path.abspath(args.snapshots)
        os.makedirs(args.snapshots, exist_ok=True)
        os.environ["FLEET_SNAPSHOT_DIR"] = args.snapshots
        hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fleet_snapshot")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (hook, os.environ.get("PYTHONPATH")) if p)

    from twisted.internet import defer, task

    if args.stall_profile:
        args.stall_profile = os.path.abspath(args.stall_profile)
        os.makedirs(args.stall_profile, exist_ok=True)
        os.environ["BENCH_GC_LOG"] = os.path.join(args.stall_profile, f"gc-{os.getpid()}.log")
        bi._TWISTD = GC_HOOK + bi._TWISTD  # read by Bench._spawn at each start
    if args.cheap_registration:
        bi._TWISTD = CHEAP_REGISTRATION + bi._TWISTD
    if args.keepalive_every_interval:
        bi._TWISTD = KEEPALIVE_EVERY_INTERVAL + bi._TWISTD
        exec(KEEPALIVE_EVERY_INTERVAL, {})  # the simulated fleet's end too
    if args.keepalive:
        interval, timeout = (float(v) for v in args.keepalive.split(","))
        prelude = KEEPALIVE_TIMES.format(interval=interval, timeout=timeout)
        bi._TWISTD = prelude + bi._TWISTD
        exec(prelude, {})  # the simulated fleet's end too
    if args.gc_threshold:
        thresholds = tuple(int(t) for t in args.gc_threshold.split(","))
        bi._TWISTD = (  # the product's makeService sets tap.GC_THRESHOLDS: replaced too
            f"import gc as _gc\n_gc.set_threshold(*{thresholds!r})\n"
            f"import localai_tw.frontend.tap as _tap\n_tap.GC_THRESHOLDS = {thresholds!r}\n"
            + bi._TWISTD)
    bench = bi.Bench(args)
    bench.start_frontend_on = lambda name, models, previous: start_frontend_on(
        bench, name, models, previous)
    loadavg_before = bi._loadavg()
    outcome: dict = {}

    async def main_async(reactor):
        bench.create_database()
        try:
            outcome["report"] = await run(reactor, bench, args)
        finally:
            outcome["problems"] = bench.close()

    try:
        task.react(lambda r: defer.ensureDeferred(main_async(r)))
    except SystemExit as e:
        if e.code not in (0, None):
            print(f"bench_fleet failed (exit {e.code})", file=sys.stderr)
    report = outcome.get("report")
    if report is None:
        sys.exit(1)
    report["loadavg_before"], report["loadavg_after"] = loadavg_before, bi._loadavg()
    report["machine"] = bi.machine()
    m = report["machine"]
    print(render(report))
    print()
    if report.get("snapshots"):
        snap = report["snapshots"]
        print(f"tracemalloc growth per tunnel: {snap['traced_bytes_per_tunnel']} bytes")
        for line in snap["lines"]:
            print(f"  {line['bytes_per_tunnel']:>9} B {line['blocks_per_tunnel']:>7} blocks  "
                  f"{line['where']}")
        print("live objects per tunnel:")
        for row in snap["objects_per_tunnel"]:
            print(f"  {row['count']:>7}  {row['type']}")
        print()
    print(f"{m['cpus']} CPUs ({m['cpu_model']}), Python {m['python']}, Twisted {m['twisted']}; "
          f"load average {report['loadavg_before']} before, {report['loadavg_after']} after.")
    for problem in outcome.get("problems") or []:
        print(f"# cleanup: {problem}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
