"""Benchmark of inference through the tunnel: what the frontend and the worker's tunnel add to
a small completion from a fast backend.

Usage:  python benchmarks/bench_inference.py [--dsn DSN] [--requests-c1 2000]
                                             [--requests-c16 4000] [--rounds 4] [--json PATH]
                                             [--profile DIR] [--keep]
                                             [--concurrency 1,16] [--paths grpc,...]
                                             [--access-log all|errors|off]
                                             [--backend-calls tunnel|grpc]
                                             [--baseline-json PATH]

The DSN (``--dsn``, else ``LOCALAI_TEST_DSN``, else ``postgresql://postgres@127.0.0.1:5432/
postgres``) names a maintenance database on a server where this script may CREATE DATABASE: it
creates a fresh database for the cluster and drops it at the end, whatever happened.

The cluster is real processes, as deployed on one host:

- two frontend replicas, A and B: ``twistd -n --pidfile= localai-frontend`` with
  ``--single-host``, ``--advertise-address 127.0.0.1:<port>``, the fresh database, a
  registration token, an API key and a shared ``--models-dir`` holding one model YAML for the
  built-in ``echo`` backend;
- one worker: ``twistd -n --pidfile= localai-worker --register-to http://127.0.0.1:<A>``, so
  its tunnel is held by A (read from ``node_connections``, not assumed); the worker starts the
  echo backend (its own subprocess) when the first request cold-loads the model.

Five ways to the same backend process are measured, each at concurrency 1 and 16, in one run:

========== ============================================================================
path       what a request crosses
========== ============================================================================
grpc       **baseline**: a grpcio client -> TCP -> the echo backend (its address from
           ``node_models``; the very process the other paths reach)
grpc-owner the same grpcio client -> the owner replica's gRPC bridge (its private Unix
           socket, ``<data-dir>/run/grpc-<replica>/<sha256(node:port)[:16]>.sock``) ->
           splice -> yamux stream over the worker's WebSocket tunnel -> worker -> TCP ->
           backend.  Only the tunnel differs from the baseline: this isolates it.
grpc-relay the same, through the *other* replica's bridge: its stream is relayed to the
           owner over a peer link, then the tunnel.  grpc-relay minus grpc-owner = the relay.
http-owner ``POST /v1/completions`` at the owner: HTTP + JSON + the router (placement reads
           in PostgreSQL) + the frontend's call (``--backend-calls tunnel``: one framed
           request on a ``call`` stream, the worker making the gRPC call; ``grpc``: the
           frontend's own gRPC client, ``BridgedBackendClient``, and the bridge) + the tunnel.
           The full path an OpenAI client sees.
http-relay the same at the other replica.
========== ============================================================================

The same request everywhere: prompt ``PROMPT`` with ``max_tokens`` 4 (``Tokens`` = 4 and the
model identity on gRPC), so the backend does identical work; the answer is checked once per
client.  The bridges exist once each replica has served one HTTP request (the warm-up, which
also cold-loads the model); the benchmark's gRPC client then connects to those sockets like the
frontend's own channel does (same user; the socket directory is 0700).

Load: one client process per path, started once and kept for the whole run (so each keeps its
connections, as a real client would): ``C`` threads, each with its own keep-alive
``http.client`` connection (HTTP) or all sharing one grpcio channel (gRPC: the frontend also
uses one channel per backend, i.e. one HTTP/2 connection, one tunnel stream).  Each
measurement first sends ``--warmup`` requests (not recorded), then waits for the coordinator
to snapshot CPU times, then sends its share of the requests and reports every latency.  The
requests of each concurrency are split into ``--rounds`` rounds, interleaved across the paths,
and pooled, so drifting load from other processes on the machine hits every path alike.

Reported per path and concurrency: requests/s (requests / measured wall time), p50 and p99
latency, the p50 added against the baseline (and the relay against the owner), and the CPU
time (user + system) per request of the client and of every cluster process (psutil deltas
around the measured part only): the client's own cost is there to be subtracted, and the CPU
columns say where a path's time goes even on a busy machine.  ``--profile DIR`` runs the
frontends and the worker under cProfile, timed by the CPU time of the reactor thread
(``time.thread_time``: what the main thread spends, not its waits), in ``DIR/<name>.prof``,
written at their clean shutdown; profiling slows everything, do not quote those figures.

How the replicas call the backend is ``--backend-calls`` (the frontends' option, default
``tunnel``: one framed request on a ``call`` stream, the worker making the gRPC call; ``grpc``:
the frontend's grpcio channel through its bridge, as before issue 25 §2).  One replica cannot
run both, and a ``tunnel`` replica makes no bridge, so the two are measured as two runs in one
sitting: first ``--backend-calls grpc --json grpc.json`` (which has the ``grpc-owner``
reference), then ``--backend-calls tunnel --baseline-json grpc.json --paths
grpc,http-owner,http-relay``.  The second run reports the issue's ratio (HTTP at the owner over
gRPC through the owner's tunnel, c=16) against the first run's ``grpc-owner``, scaled by how the
direct ``grpc`` baseline (measured in both runs) moved between them, so a machine that got
busier in between does not flatter or blame either path.

This is a script, not a test: it asserts nothing, but prints whether the targets of
``docs/benchmarks.md`` ("Inference") are met.  Every process it started is reaped (SIGTERM,
wait, SIGKILL) and the database dropped, even on failure or Ctrl-C; ``--keep`` keeps the work
directory (logs) only.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import itertools
import json
import os
import platform
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
TOKEN = "bench-inference-registration-token"
#: How the load client is told the backend's own gRPC token.
BACKEND_TOKEN_ENV = "LOCALAI_BENCH_BACKEND_TOKEN"
API_KEY = "sk-bench-inference"
MODEL = "echo-bench"
MODEL_IDENTIFIER = "echo-bench-model"
PROMPT = "the quick brown fox jumps over the lazy dog"
MAX_TOKENS = 4
EXPECTED = " ".join(PROMPT.split()[:MAX_TOKENS])
PATHS = ("grpc", "grpc-owner", "grpc-relay", "http-owner", "http-relay")
LABELS = {
    "grpc": "gRPC direct (baseline)",
    "grpc-owner": "gRPC via owner bridge + tunnel",
    "grpc-relay": "gRPC via other replica: relay + tunnel",
    "http-owner": "HTTP /v1/completions at owner",
    "http-relay": "HTTP /v1/completions at other replica",
}
#: What each path is compared with: (reference path, what the difference is).
ADDED = {
    "grpc-owner": ("grpc", "tunnel (owner)"),
    "grpc-relay": ("grpc-owner", "relay"),
    "http-owner": ("grpc", "frontend + tunnel"),
    "http-relay": ("http-owner", "relay (HTTP)"),
}
_TWISTD = "from twisted.scripts.twistd import run; run()"
#: twistd under cProfile with the CPU time of the reactor thread (``time.thread_time``), not wall
#: time: idle waits and waits for the GIL do not count.  Written when twistd is done, before it
#: re-raises the SIGTERM that stopped it (``app._exitWithSignal``).
_TWISTD_PROFILED = (
    "import cProfile, time\n"
    "from twisted.application import app\n"
    "from twisted.scripts.twistd import run\n"
    "profile = cProfile.Profile(time.thread_time)\n"
    "def dump():\n"
    "    profile.disable()\n"
    "    profile.dump_stats({path!r})\n"
    "exit_with_signal = app._exitWithSignal\n"
    "def dump_then_exit(sig):\n"
    "    dump()\n"
    "    exit_with_signal(sig)\n"
    "app._exitWithSignal = dump_then_exit\n"
    "profile.enable()\n"
    "run()\n"
    "dump()\n")
CALL_TIMEOUT = 30.0


def percentile(ordered: list[float], p: float) -> float:
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def cpu_seconds_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- the load client (one process per path) ----------------------------------------------------


def backend_token(pid: int) -> str:
    """The gRPC token of the backend process ``pid`` (``LOCALAI_GRPC_AUTH_TOKEN`` in its
    environment; readable by its owner and root, as this benchmark is)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            name, _, value = item.partition(b"=")
            if name == b"LOCALAI_GRPC_AUTH_TOKEN":
                return value.decode()
    return ""


class GrpcLoad:
    """Unary ``Predict`` on one shared channel (thread-safe in grpcio)."""

    def __init__(self, target: str, identity: str):
        import grpc

        from localai_tw.backends import backend_pb2, backend_pb2_grpc

        self._grpc = grpc
        self.channel = grpc.insecure_channel(target, options=[
            ("grpc.enable_http_proxy", 0),
            ("grpc.max_receive_message_length", 50 * 1024 * 1024)])
        self.stub = backend_pb2_grpc.BackendStub(self.channel)
        self.request = backend_pb2.PredictOptions(Prompt=PROMPT, Tokens=MAX_TOKENS,
                                                  ModelIdentity=identity)
        token = os.environ.get(BACKEND_TOKEN_ENV, "")
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def session(self):
        predict, request, metadata = self.stub.Predict, self.request, self.metadata

        def one() -> None:
            predict(request, timeout=CALL_TIMEOUT, metadata=metadata)
        return one

    def check(self) -> None:
        reply = self.stub.Predict(self.request, timeout=CALL_TIMEOUT, metadata=self.metadata)
        if reply.message.decode() != EXPECTED:
            raise RuntimeError(f"unexpected answer {reply.message!r}")

    def close(self) -> None:
        self.channel.close()


class HttpLoad:
    """``POST /v1/completions``, one keep-alive connection per thread."""

    def __init__(self, target: str, identity: str):
        host, port = target.rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.body = json.dumps({"model": MODEL, "prompt": PROMPT,
                                "max_tokens": MAX_TOKENS}).encode()
        self.headers = {"Content-Type": "application/json",
                        "Authorization": f"Bearer {API_KEY}"}
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=CALL_TIMEOUT)
            self._local.conn = conn
        return conn

    def _post(self) -> tuple[int, bytes]:
        conn = self._connection()
        try:
            conn.request("POST", "/v1/completions", body=self.body, headers=self.headers)
            response = conn.getresponse()
            return response.status, response.read()
        except (http.client.HTTPException, OSError):
            conn.close()
            self._local.conn = None
            raise

    def session(self):
        post = self._post

        def one() -> None:
            status, body = post()
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
        return one

    def check(self) -> None:
        status, body = self._post()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
        text = json.loads(body)["choices"][0]["text"]
        if text != EXPECTED:
            raise RuntimeError(f"unexpected answer {text!r}")

    def close(self) -> None:
        pass


def _drive(load, concurrency: int, total: int, record: bool) -> tuple[list[float], int, float]:
    """``total`` requests from ``concurrency`` threads; (latencies in s, errors, wall s)."""
    counter = itertools.count()
    per_thread: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    start = threading.Barrier(concurrency + 1)

    def worker(index: int) -> None:
        one = load.session()
        samples = per_thread[index]
        clock = time.perf_counter
        start.wait()
        while next(counter) < total:
            t0 = clock()
            try:
                one()
            except Exception as e:  # counted; the connection is re-made by the next call
                errors[index] += 1
                if errors[index] <= 3:
                    print(f"load error: {e!r}", file=sys.stderr, flush=True)
                continue
            if record:
                samples.append(clock() - t0)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(concurrency)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return [s for samples in per_thread for s in samples], sum(errors), wall


def run_load(args) -> None:
    """Commands on stdin, one per line: ``run C N W`` -> W warm-up requests, ``ready``, wait for
    ``go``, N measured requests, one JSON line.  EOF ends the process."""
    load = (GrpcLoad if args.kind == "grpc" else HttpLoad)(args.target, args.identity)
    load.check()
    print(json.dumps({"hello": os.getpid()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        _, concurrency, total, warmup = words[0], int(words[1]), int(words[2]), int(words[3])
        _, warm_errors, _ = _drive(load, concurrency, max(warmup, concurrency), record=False)
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            break
        cpu0 = cpu_seconds_self()
        samples, errors, wall = _drive(load, concurrency, total, record=True)
        cpu = cpu_seconds_self() - cpu0
        print(json.dumps({"latencies_us": [round(s * 1e6, 1) for s in samples],
                          "errors": errors, "warm_errors": warm_errors, "wall": wall,
                          "client_cpu": cpu}), flush=True)
    load.close()


# -- processes ---------------------------------------------------------------------------------


class Proc:
    def __init__(self, name: str, popen: subprocess.Popen, log_path: str | None):
        self.name, self.popen, self.log_path = name, popen, log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def reap(self, grace: float = 20.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        self.popen.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_block(size: int = 10) -> int:
    """First port of ``size`` free loopback ports below the ephemeral range."""
    for _ in range(200):
        first = random.randrange(20000, 29000, size)
        try:
            for port in range(first, first + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError("no free block of backend ports")


def http_get(port: int, path: str, timeout: float = 5.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def wait_for(predicate, timeout: float, what: str, procs=(), interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode} while waiting "
                                   f"for {what}:\n{p.tail()}")
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class Bench:
    """The cluster, the load clients and the database; :meth:`close` undoes everything."""

    def __init__(self, args):
        self.args = args
        self.workdir = tempfile.mkdtemp(prefix="bi-")  # short: bridge sockets live under it
        self.procs: list[Proc] = []
        self.loads: dict[str, tuple[Proc, object]] = {}
        self.backend_pid: int | None = None
        #: the echo backend's own gRPC token (each backend process has one), for the direct
        #: gRPC baseline: read from the process's environment, as its owner can
        self.backend_token = ""
        self.db_name = f"bench_inference_{uuid.uuid4().hex[:10]}"
        self.admin_dsn = args.dsn
        self.dsn = None
        self._db = None
        self.frontends: dict[str, dict] = {}

    # -- database --------------------------------------------------------------------------

    def create_database(self) -> None:
        import psycopg2
        from psycopg2.extensions import make_dsn

        admin = psycopg2.connect(self.admin_dsn)
        admin.autocommit = True
        try:
            with admin.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{self.db_name}"')
        finally:
            admin.close()
        self.dsn = make_dsn(self.admin_dsn, dbname=self.db_name)

    def sql(self, query: str, params: tuple = ()) -> list[tuple]:
        import psycopg2

        if self._db is None or self._db.closed:
            self._db = psycopg2.connect(self.dsn)
            self._db.autocommit = True
        with self._db.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description else []

    def drop_database(self) -> None:
        import psycopg2

        if self._db is not None:
            try:
                self._db.close()
            except Exception:
                pass
        if self.dsn is None:
            return
        admin = psycopg2.connect(self.admin_dsn)
        admin.autocommit = True
        try:
            with admin.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
        finally:
            admin.close()
        self.dsn = None

    # -- processes -------------------------------------------------------------------------

    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
        env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, name: str, twistd_args: list[str]) -> Proc:
        log_path = os.path.join(self.workdir, f"{name}.log")
        argv = [sys.executable, "-c", _TWISTD, "-n", "--pidfile="]
        if self.args.profile:
            os.makedirs(self.args.profile, exist_ok=True)
            target = f"{os.path.join(os.path.abspath(self.args.profile), name)}.prof"
            argv = [sys.executable, "-c", _TWISTD_PROFILED.format(path=target), "-n",
                    "--pidfile="]
        with open(log_path, "w") as log_file:
            popen = subprocess.Popen(argv + twistd_args, cwd=self.workdir, env=self._env(),
                                     stdin=subprocess.DEVNULL, stdout=log_file,
                                     stderr=subprocess.STDOUT)
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def _frontend_options(self) -> list[str]:
        access_log = getattr(self.args, "access_log", None)  # bench_streaming has no such option
        options = ["--access-log", access_log] if access_log else []
        backend_calls = getattr(self.args, "backend_calls", None)
        return options + (["--backend-calls", backend_calls] if backend_calls else [])

    def start_frontend(self, name: str, models_dir: str) -> dict:
        port = free_port()
        instance_id = f"{name}-{uuid.uuid4().hex[:8]}"
        data_dir = os.path.join(self.workdir, name)
        os.makedirs(data_dir)
        proc = self._spawn(name, [
            "localai-frontend", "--listen", f"tcp:{port}:interface=127.0.0.1",
            "--database-url", self.dsn, "--instance-id", instance_id,
            "--advertise-address", f"127.0.0.1:{port}", "--single-host",
            "--registration-token", TOKEN, "--api-key", API_KEY,
            "--data-dir", data_dir, "--models-dir", models_dir,
            *self._frontend_options()])
        fe = {"name": name, "proc": proc, "port": port, "instance_id": instance_id,
              "data_dir": data_dir}
        self.frontends[instance_id] = fe
        return fe

    def wait_ready(self, fe: dict) -> None:
        def ready():
            try:
                return http_get(fe["port"], "/readyz") == 200
            except OSError:
                return False
        wait_for(ready, 90, f"{fe['name']} /readyz", procs=[fe["proc"]])

    def start_worker(self, register_to: int) -> Proc:
        first = free_block(10)
        data_dir = os.path.join(self.workdir, "worker")
        os.makedirs(data_dir)
        self.worker_name = f"bench-worker-{uuid.uuid4().hex[:6]}"
        return self._spawn("worker", [
            "localai-worker", "--register-to", f"http://127.0.0.1:{register_to}",
            "--registration-token", TOKEN, "--node-name", self.worker_name,
            "--node-type", "backend", "--backend-port-range", f"{first}-{first + 9}",
            "--data-dir", data_dir])

    def start_load(self, path: str, kind: str, target: str, identity: str) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "--role", "load", "--kind", kind,
                "--target", target, "--identity", identity]
        # the backend process's own gRPC token, in the environment (not on a command line)
        env = dict(self._env(), **{BACKEND_TOKEN_ENV: self.backend_token})
        popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=env)
        proc = Proc(f"load-{path}", popen, None)
        self.procs.append(proc)
        hello = popen.stdout.readline()
        if not hello:
            raise RuntimeError(f"the {path} load client failed to start (exit "
                               f"{popen.wait()})")
        self.loads[path] = proc

    def close(self) -> list[str]:
        """Reap everything (load clients, worker, frontends, a leftover backend), drop the
        database.  Never raises before everything was tried; returns the problems."""
        problems = []
        order = ([p for p in self.procs if p.name.startswith("load-")]
                 + [p for p in self.procs if p.name == "worker"]
                 + [p for p in self.procs if not p.name.startswith("load-")
                    and p.name != "worker"])
        for proc in order:
            try:
                if proc.popen.stdin:
                    try:
                        proc.popen.stdin.close()
                    except OSError:
                        pass
                proc.reap()
            except Exception as e:
                problems.append(f"{proc.name}: {e!r}")
                try:
                    proc.popen.kill()
                    proc.popen.wait(timeout=30)
                except Exception:
                    pass
        if self.backend_pid is not None:
            try:
                import psutil

                backend = psutil.Process(self.backend_pid)
                backend.terminate()
                backend.wait(timeout=10)
                problems.append(f"backend {self.backend_pid} outlived its worker (terminated)")
            except Exception:
                pass  # gone, as it should be
        try:
            self.drop_database()
        except Exception as e:
            problems.append(f"dropping {self.db_name}: {e!r}")
        if self.args.keep:
            print(f"# work directory kept: {self.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return problems


# -- the coordinator ---------------------------------------------------------------------------


def completion(port: int, timeout: float = 120.0) -> tuple[int, dict, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions",
                     body=json.dumps({"model": MODEL, "prompt": PROMPT,
                                      "max_tokens": MAX_TOKENS}),
                     headers={"Content-Type": "application/json",
                              "Authorization": f"Bearer {API_KEY}"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        conn.close()


def bridge_socket(fe: dict, node_id: str, port: int) -> str:
    """The replica's bridge socket for (node, port) (``frontend/inference/grpcbridge.py``)."""
    name = hashlib.sha256(f"{node_id}:{port}".encode()).hexdigest()[:16] + ".sock"
    path = os.path.join(fe["data_dir"], "run", f"grpc-{fe['instance_id'][:12]}", name)
    if os.path.exists(path):
        return path
    # The replica fell back to a private mkdtemp directory: find the socket it listens on.
    import psutil

    for conn in psutil.Process(fe["proc"].pid).net_connections(kind="unix"):
        if conn.laddr and conn.laddr.endswith("/" + name):
            return conn.laddr
    raise RuntimeError(f"no bridge socket {name} at {fe['name']}")


def setup(bench: Bench, model_options: tuple[str, ...] = ()) -> dict:
    """The cluster, warmed up, and a load client per ``bench.args.paths``.  ``model_options``:
    the echo model's ``options`` (``bench_streaming.py`` paces the backend with them)."""
    args = bench.args
    bench.create_database()
    models_dir = os.path.join(bench.workdir, "models")
    os.makedirs(models_dir)
    with open(os.path.join(models_dir, f"{MODEL}.yaml"), "w") as f:
        f.write(f"name: {MODEL}\nbackend: echo\nparameters:\n  model: {MODEL_IDENTIFIER}\n")
        if model_options:
            f.write(f"options: {json.dumps(list(model_options))}\n")
    a = bench.start_frontend("frontend-a", models_dir)
    bench.wait_ready(a)  # A first: it migrates the fresh database
    b = bench.start_frontend("frontend-b", models_dir)
    bench.wait_ready(b)
    worker = bench.start_worker(a["port"])
    cluster = [a["proc"], b["proc"], worker]
    node_id = wait_for(lambda: (bench.sql("SELECT id FROM backend_nodes WHERE name = %s",
                                          (bench.worker_name,)) or [[None]])[0][0],
                       60, "the worker registered", procs=cluster)

    def owner():
        rows = bench.sql(
            "SELECT c.owner_instance_id FROM node_connections c JOIN instances i"
            " ON i.id = c.owner_instance_id WHERE c.node_id = %s"
            " AND c.owner_instance_id <> '' AND i.last_seen > now() - interval '30 seconds'",
            (node_id,))
        return rows[0][0] if rows else None
    owner_id = wait_for(owner, 60, "the worker's tunnel owned", procs=cluster)
    owner_fe = bench.frontends[owner_id]
    relay_fe = next(fe for iid, fe in bench.frontends.items() if iid != owner_id)
    print(f"# worker {node_id}: tunnel owned by {owner_fe['name']} ({owner_id}); relaying "
          f"replica {relay_fe['name']}", file=sys.stderr, flush=True)

    # Warm-up: the first request cold-loads the model (the worker starts the echo backend);
    # one request at each replica creates its bridge.
    for fe in (owner_fe, relay_fe):
        started = time.perf_counter()
        status, headers, body = completion(fe["port"])
        if status != 200:
            raise RuntimeError(f"warm-up at {fe['name']}: HTTP {status}: {body[:500]}")
        served_by = {k.lower(): v for k, v in headers.items()}.get("x-localai-node")
        print(f"# warm-up at {fe['name']}: {time.perf_counter() - started:.2f} s, served by "
              f"{served_by}", file=sys.stderr, flush=True)
    rows = bench.sql("SELECT address, loaded_model FROM node_models WHERE node_id = %s AND"
                     " model_name = %s AND state = 'loaded'", (node_id, MODEL))
    if not rows:
        raise RuntimeError("no loaded node_models row after the warm-up")
    address, identity = rows[0]
    backend_port = int(address.rsplit(":", 1)[1])
    if owner() != owner_id:
        raise RuntimeError("the tunnel changed owner during the warm-up")

    import psutil

    worker_ps = psutil.Process(worker.pid)
    backends = [c for c in worker_ps.children(recursive=True)
                if any("echo" in part for part in c.cmdline())]
    if backends:
        bench.backend_pid = backends[-1].pid
        bench.backend_token = backend_token(bench.backend_pid)
    targets = {
        "grpc": lambda: ("grpc", address),
        "grpc-owner": lambda: ("grpc", "unix:" + bridge_socket(owner_fe, node_id,
                                                                backend_port)),
        "grpc-relay": lambda: ("grpc", "unix:" + bridge_socket(relay_fe, node_id,
                                                                backend_port)),
        "http-owner": lambda: ("http", f"127.0.0.1:{owner_fe['port']}"),
        "http-relay": lambda: ("http", f"127.0.0.1:{relay_fe['port']}"),
    }
    targets = {path: make() for path, make in targets.items() if path in args.paths}
    for path in args.paths:
        kind, target = targets[path]
        bench.start_load(path, kind, target, identity)
    watched = {"owner": owner_fe["proc"].pid, "relay": relay_fe["proc"].pid,
               "worker": worker.pid,
               # the reactor (main) thread of each replica: the part of its CPU that serialises
               "owner.reactor": owner_fe["proc"].pid, "relay.reactor": relay_fe["proc"].pid}
    if bench.backend_pid:
        watched["backend"] = bench.backend_pid
    return {"node_id": node_id, "owner": owner_fe["name"], "relay": relay_fe["name"],
            "backend_address": address, "model_identity": identity, "targets": targets,
            "watched": watched}


def cpu_times(pids: dict) -> dict:
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            if name.endswith(".reactor"):
                main = [t for t in psutil.Process(pid).threads() if t.id == pid]
                out[name] = main[0].user_time + main[0].system_time if main else float("nan")
                continue
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = float("nan")
    return out


def measure(bench: Bench, info: dict, path: str, concurrency: int, total: int) -> dict:
    proc = bench.loads[path]
    pipe_in, pipe_out = proc.popen.stdin, proc.popen.stdout
    pipe_in.write(f"run {concurrency} {total} {bench.args.warmup}\n")
    pipe_in.flush()
    if pipe_out.readline().strip() != "ready":
        raise RuntimeError(f"the {path} load client failed (exit {proc.popen.poll()})")
    before = cpu_times(info["watched"])
    pipe_in.write("go\n")
    pipe_in.flush()
    line = pipe_out.readline()
    after = cpu_times(info["watched"])
    if not line:
        raise RuntimeError(f"the {path} load client died (exit {proc.popen.wait()})")
    result = json.loads(line)
    result["cluster_cpu"] = {k: after[k] - before[k] for k in before}
    return result


def run(bench: Bench) -> dict:
    args = bench.args
    report = {"machine": machine(), "argv": sys.argv[1:], "loadavg_before": _loadavg(),
              "backend_calls": args.backend_calls,
              "rounds": args.rounds, "warmup": args.warmup, "results": {}}
    info = setup(bench)
    report["cluster"] = {k: v for k, v in info.items() if k != "watched"}
    for concurrency in args.concurrency:
        total = args.requests_c1 if concurrency == 1 else args.requests_c16 \
            if concurrency == 16 else args.requests_c16
        per_round = max(1, total // args.rounds)
        for r in range(args.rounds):
            order = list(args.paths) if r % 2 == 0 else list(reversed(args.paths))
            for path in order:
                started = time.perf_counter()
                result = measure(bench, info, path, concurrency, per_round)
                report["results"].setdefault(f"{path}@{concurrency}", []).append(result)
                print(f"# c={concurrency} round {r + 1}/{args.rounds} {path}: "
                      f"{per_round / result['wall']:.0f} req/s, errors {result['errors']}, "
                      f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    report["loadavg_after"] = _loadavg()
    return report


def summarise(report: dict) -> dict:
    rows = {}
    for key, rounds in report["results"].items():
        path, concurrency = key.split("@")
        samples = sorted(s for r in rounds for s in r["latencies_us"])
        n = len(samples)
        wall = sum(r["wall"] for r in rounds)
        requests = n + sum(r["errors"] for r in rounds)
        cpu = {}
        for r in rounds:
            for name, seconds in r["cluster_cpu"].items():
                cpu[name] = cpu.get(name, 0.0) + seconds
        rows[key] = {
            "path": path, "concurrency": int(concurrency), "requests": requests,
            "errors": sum(r["errors"] for r in rounds),
            "rps": requests / wall if wall else 0.0,
            "p50_ms": percentile(samples, 50) / 1e3 if samples else float("nan"),
            "p99_ms": percentile(samples, 99) / 1e3 if samples else float("nan"),
            "round_p50_ms": [percentile(sorted(r["latencies_us"]), 50) / 1e3
                             for r in rounds if r["latencies_us"]],
            "client_cpu_us": sum(r["client_cpu"] for r in rounds) / requests * 1e6,
            "client_cores": sum(r["client_cpu"] for r in rounds) / wall,
            "cpu_us": {name: seconds / requests * 1e6 for name, seconds in cpu.items()},
        }
    return rows


def render(report: dict, rows: dict) -> str:
    m = report["machine"]
    c = report["cluster"]
    lines = [f"Machine: {m['cpus']} CPUs, {m['cpu_model']}, Linux {m['kernel']}, Python "
             f"{m['python']}, Twisted {m['twisted']}, grpcio {m['grpcio']}, "
             f"Autobahn {m['autobahn']}; load average {report['loadavg_before']} before, "
             f"{report['loadavg_after']} after.",
             f"Tunnel owner: {c['owner']}; relaying replica: {c['relay']}; backend "
             f"{c['backend_address']}.  Request: prompt of {len(PROMPT.split())} words, "
             f"max_tokens {MAX_TOKENS}.  {report['rounds']} interleaved rounds per "
             f"concurrency, pooled; {report['warmup']} unrecorded requests before each round.  "
             f"Replicas' --backend-calls: {report.get('backend_calls', 'tunnel')}.",
             "",
             "| path | c | requests | req/s | p50 ms | p99 ms | p50 added | added over |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    concurrencies = sorted({r["concurrency"] for r in rows.values()})
    for conc in concurrencies:
        for path in PATHS:
            row = rows.get(f"{path}@{conc}")
            if row is None:
                continue
            added, over = "-", "(baseline)" if path == "grpc" else "-"
            if path in ADDED and f"{ADDED[path][0]}@{conc}" in rows:
                ref = rows[f"{ADDED[path][0]}@{conc}"]
                added = f"{row['p50_ms'] - ref['p50_ms']:+.3f} ms"
                over = f"{ADDED[path][0]}: {ADDED[path][1]}"
            errors = f" ({row['errors']} errors)" if row["errors"] else ""
            lines.append(f"| {LABELS[path]} | {conc} | {row['requests']}{errors} | "
                         f"{row['rps']:.0f} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} | "
                         f"{added} | {over} |")
    names = ["owner", "relay", "worker", "backend"]
    lines += ["", "CPU (user + system) per request, us, during the measured requests only; "
              "'client' is the load process (its share of a core in brackets); the cluster "
              "columns are the owner replica, the relaying replica, the worker and the echo "
              "backend; 'owner reactor' and 'relay reactor' are the main thread of each "
              "replica (part of the replica's figure):", "",
              "| path | c | client | " + " | ".join(names)
              + " | cluster total | owner reactor | relay reactor |",
              "|---|---:|---:|" + "---:|" * (len(names) + 3)]
    for conc in concurrencies:
        for path in PATHS:
            row = rows.get(f"{path}@{conc}")
            if row is None:
                continue
            cells = [f"{row['cpu_us'].get(n, float('nan')):.0f}" for n in names]
            total = sum(v for k, v in row["cpu_us"].items()
                        if v == v and not k.endswith(".reactor"))
            reactors = [f"{row['cpu_us'].get(n + '.reactor', float('nan')):.0f}"
                        for n in ("owner", "relay")]
            lines.append(f"| {LABELS[path]} | {conc} | {row['client_cpu_us']:.0f} "
                         f"({row['client_cores']:.2f}) | " + " | ".join(cells)
                         + f" | {total:.0f} | " + " | ".join(reactors) + " |")
    lines += ["", "Targets (p50):"]
    for conc in concurrencies:
        for path, goal in (("grpc-owner", "the tunnel adds < 1 ms on the owner path"),
                           ("grpc-relay", "the relay adds < 1 ms more")):
            row, ref = rows.get(f"{path}@{conc}"), rows.get(f"{ADDED[path][0]}@{conc}")
            if row and ref:
                added = row["p50_ms"] - ref["p50_ms"]
                lines.append(f"- c={conc}: {goal}: {added:+.3f} ms -> "
                             f"{'met' if added < 1.0 else 'MISSED'}")
    lines += _http_targets(rows, report.get("baseline"))
    return "\n".join(lines)


def _http_targets(rows: dict, baseline: dict | None = None) -> list[str]:
    """The HTTP path's targets (issue 15 section 2, issue 25 section 2), where the run has the
    rows; ``baseline`` is an earlier run's summary (``--baseline-json``) for ``grpc-owner``."""
    lines = []
    if baseline and "grpc-owner@16" not in rows:
        reference = baseline.get("grpc-owner@16")
        then, now = baseline.get("grpc@16"), rows.get("grpc@16")
        http16 = rows.get("http-owner@16")
        if reference and http16 and then and now and reference["rps"] and then["rps"]:
            drift = now["rps"] / then["rps"]
            ratio = http16["rps"] / (reference["rps"] * drift)
            lines.append(f"- HTTP at owner, c=16: {http16['rps']:.0f} req/s = {ratio:.2f}x gRPC "
                         f"via owner bridge of the baseline run ({reference['rps']:.0f} req/s, "
                         f"scaled by {drift:.2f}: the direct gRPC baseline's drift) (target >= "
                         f"0.7x) -> {'met' if ratio >= 0.7 else 'MISSED'}")
    http1, grpc1 = rows.get("http-owner@1"), rows.get("grpc-owner@1")
    if http1:
        cpu = http1["cpu_us"].get("owner", float("nan"))
        lines.append(f"- HTTP at owner, c=1: owner replica CPU {cpu:.0f} us per request "
                     f"(target <= 400) -> {'met' if cpu <= 400 else 'MISSED'}")
    if http1 and grpc1:
        added = http1["p50_ms"] - grpc1["p50_ms"]
        lines.append(f"- HTTP at owner, c=1: p50 added over gRPC via owner bridge "
                     f"{added:+.3f} ms (target <= +0.5) -> {'met' if added <= 0.5 else 'MISSED'}")
    http16, grpc16 = rows.get("http-owner@16"), rows.get("grpc-owner@16")
    if http16 and grpc16 and grpc16["rps"]:
        ratio = http16["rps"] / grpc16["rps"]
        lines.append(f"- HTTP at owner, c=16: {http16['rps']:.0f} req/s = {ratio:.2f}x gRPC via "
                     f"owner bridge (target >= 0.7x) -> {'met' if ratio >= 0.7 else 'MISSED'}")
    return lines


def machine() -> dict:
    import grpc
    import twisted

    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import autobahn
        autobahn_version = autobahn.__version__
    except ImportError:
        autobahn_version = "-"
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "twisted": twisted.__version__, "grpcio": grpc.__version__,
            "autobahn": autobahn_version, "kernel": platform.release()}


def _loadavg() -> str:
    text = "?"
    try:
        with open("/proc/loadavg") as f:
            text = " ".join(f.read().split()[:3])
        with open("/proc/pressure/cpu") as f:
            some = dict(kv.split("=") for kv in f.readline().split()[1:])
        text += f", cpu pressure {some['avg60']}%"
    except (OSError, KeyError, ValueError):
        pass
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("LOCALAI_TEST_DSN") or DEFAULT_DSN,
                        help="maintenance DSN where CREATE DATABASE is allowed")
    parser.add_argument("--requests-c1", type=int, default=2000,
                        help="measured requests per path at concurrency 1")
    parser.add_argument("--requests-c16", type=int, default=4000,
                        help="measured requests per path at concurrency 16 (and any other)")
    parser.add_argument("--concurrency", default="1,16",
                        help="comma-separated client concurrencies")
    parser.add_argument("--rounds", type=int, default=4,
                        help="interleaved rounds per concurrency (the requests are split)")
    parser.add_argument("--warmup", type=int, default=100,
                        help="unrecorded requests before each round of each path")
    parser.add_argument("--paths", default=",".join(PATHS), help="subset of " + ",".join(PATHS))
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--profile", metavar="DIR",
                        help="cProfile the frontends and the worker (CPU time of the reactor "
                             "thread)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument("--access-log", choices=("all", "errors", "off"),
                        help="the frontends' --access-log (default: theirs, all)")
    parser.add_argument("--backend-calls", choices=("tunnel", "grpc"), default="tunnel",
                        help="the frontends' --backend-calls (grpc-owner and grpc-relay need "
                             "grpc: a tunnel replica makes no bridge)")
    parser.add_argument("--baseline-json", metavar="PATH",
                        help="a --backend-calls grpc run's --json: its grpc-owner row is the "
                             "reference of this run's HTTP ratio")
    parser.add_argument("--role", choices=("load",), help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=("grpc", "http"), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--identity", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.role == "load":
        run_load(args)
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}")
    bridged = {"grpc-owner", "grpc-relay"} & set(args.paths)
    if args.backend_calls == "tunnel" and bridged:
        parser.error(f"paths {sorted(bridged)} need --backend-calls grpc (a replica calling "
                     "backends on call streams makes no bridge to measure)")

    # SIGTERM (and SIGHUP) unwind like Ctrl-C, so the finally below always reaps.
    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)

    bench = Bench(args)
    report = None
    try:
        report = run(bench)
    except BaseException:
        for proc in bench.procs:
            if proc.log_path:
                print(f"===== {proc.name} (last lines) =====\n{proc.tail()}", file=sys.stderr)
        raise
    finally:
        # Ignore further Ctrl-C while reaping: a half-reaped cluster is what must not happen.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        problems = bench.close()
        for problem in problems:
            print(f"# cleanup: {problem}", file=sys.stderr)
    rows = summarise(report)
    if args.baseline_json:
        with open(args.baseline_json) as f:
            report["baseline"] = json.load(f).get("summary")
    print(render(report, rows))
    if args.json:
        report["summary"] = rows
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
