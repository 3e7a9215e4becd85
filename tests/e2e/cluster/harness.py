"""Real ``twistd`` frontends and workers on loopback, one shared PostgreSQL database.

Everything here is synchronous (no reactor in the test process): processes are
``subprocess.Popen``, the database is read with ``psycopg2``, HTTP is ``http.client``.  Every wait
is a poll with a generous bound (:func:`wait_for`); nothing asserts a duration.

- :class:`Cluster` starts frontends (``twistd -n --pidfile= localai-frontend``, each with a
  unique ``--instance-id`` and ``--data-dir``, a free loopback port, ``--single-host``, ``--advertise-address
  127.0.0.1:<port>``, the shared ``--database-url``, registration token, API key and
  ``--reconnect-grace``) and workers (``twistd -n --pidfile= localai-worker``, each registered to
  its own :class:`~tests.e2e.cluster.balancer.Balancer` that prefers one frontend).
- Frontends are started through :mod:`tests.e2e.cluster.probe` unless ``probe=False``: the real
  runner and plugin plus one test route, ``/e2e-probe``, the only way for a test to make a given
  replica call a control verb or stage a file on a worker (see that module for why).
- Each process writes stdout+stderr to ``<workdir>/<name>.log``; :func:`failure_report` gives
  the tail of every log of every open cluster (the conftest attaches it to a failed test).
- :meth:`Cluster.close` ALWAYS reaps: SIGTERM, wait, SIGKILL, wait -- for every process ever
  started, including ones a test killed.  An ``atexit`` hook does the same for anything a broken
  session left behind.
"""

from __future__ import annotations

import atexit
import http.client as httpclient
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil
import psycopg2

from .balancer import Balancer
from tests.e2e.userenv import user_environment

REPO_ROOT = Path(__file__).resolve().parents[3]
_TWISTD = "from twisted.scripts.twistd import run; run()"
# The probe is loaded from its file, so the processes import localai_tw and the plugins from the
# installed package (no PYTHONPATH, no checkout on the path), as a user's twistd does.
_PROBE_FILE = Path(__file__).with_name("probe.py")
_PROBED_TWISTD = (
    "import importlib.util as u; s = u.spec_from_file_location('ltw_probe', %r); "
    "p = u.module_from_spec(s); s.loader.exec_module(p); p.install(); " % str(_PROBE_FILE)
) + _TWISTD
#: Liveness window of a replica (``instances.last_seen``), as the library uses it (ref §6.1).
INSTANCE_LIVENESS_SECONDS = 30
TOKEN = "e2e-registration-token"
API_KEY = "sk-e2e-admin-key"

#: Every cluster not closed yet (for failure reports and the atexit safety net).
OPEN_CLUSTERS: list["Cluster"] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after
    ``timeout`` seconds (a bound, not a performance claim)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what} "
                                 f"(last value {last!r})")
        time.sleep(interval)


def hold_for(check: Callable[[], None], seconds: float, interval: float = 1.0) -> int:
    """Run ``check`` (which asserts) repeatedly for ``seconds``; returns how many times it ran."""
    deadline = time.monotonic() + seconds
    runs = 0
    while True:
        check()
        runs += 1
        if time.monotonic() >= deadline:
            return runs
        time.sleep(interval)


# -- HTTP -------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(method: str, port: int, path: str, body: Any = None, headers: dict | None = None,
         timeout: float = 90.0) -> Answer:
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = None
        hdrs = dict(headers or {})
        if body is not None:
            payload = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=payload, headers=hdrs)
        response = conn.getresponse()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()},
                      response.read())
    finally:
        conn.close()


def raw_exchange(port: int, request: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, return everything up to the end of the response head (or the close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def upgrade_request(path: str, bearer: str | None = None, extra: dict | None = None) -> bytes:
    """A WebSocket upgrade request head for ``path``."""
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Upgrade: websocket",
             "Connection: Upgrade", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
             "Sec-WebSocket-Version: 13"]
    if bearer is not None:
        lines.append(f"Authorization: Bearer {bearer}")
    for k, v in (extra or {}).items():
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_of(raw: bytes) -> int:
    line = raw.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


# -- processes --------------------------------------------------------------------------------


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL (a crash: no deregistration, no tunnel release) and reap."""
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def reap(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=30)
        else:
            self.popen.wait()


@dataclass
class Frontend(Process):
    index: int = 0
    port: int = 0
    instance_id: str = ""


@dataclass
class Worker(Process):
    balancer: Balancer | None = None
    data_dir: Path | None = None
    node_id: str | None = None


def listening_sockets(pid: int) -> list:
    """Listening TCP and bound UDP sockets of ``pid`` and its children."""
    found = []
    proc = psutil.Process(pid)
    for p in [proc] + proc.children(recursive=True):
        getter = getattr(p, "net_connections", None) or p.connections
        for c in getter(kind="inet"):
            if c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM:
                found.append((p.pid, c))
        for c in getter(kind="unix"):
            if c.status == psutil.CONN_LISTEN:
                found.append((p.pid, c))
    return found


class Cluster:
    """Frontends, workers and their balancers on one fresh database."""

    def __init__(self, dsn: str, workdir: Path, *, grace: str = "90s",
                 token: str = TOKEN, api_key: str = API_KEY):
        self.dsn = dsn
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.grace = grace
        self.token = token
        self.api_key = api_key
        self.frontends: list[Frontend] = []
        self.workers: list[Worker] = []
        self.processes: list[Process] = []
        self.balancers: list[Balancer] = []
        self.upstreams: list[tuple[str, int]] = []
        self._db = None
        self._closed = False
        #: The drop-in plugin directory every frontend and worker is given (``--plugin-dir``,
        #: as an operator adds one), or None: :meth:`install_plugin` makes it.
        self.plugin_dir: Path | None = None
        OPEN_CLUSTERS.append(self)

    # -- starting ----------------------------------------------------------------------------

    def install_plugin(self, module: str, source: str) -> None:
        """Write a drop-in plugin module that the processes started from now on load, given
        with ``--plugin-dir`` as an operator does (the user's environment: no PYTHONPATH)."""
        self.plugin_dir = self.workdir / "plugins"
        self.plugin_dir.mkdir(exist_ok=True)
        (self.plugin_dir / f"{module}.py").write_text(source)

    def _spawn(self, name: str, code: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
        log_path = self.workdir / f"{name}.log"
        if self.plugin_dir is not None:
            for command in ("localai-frontend", "localai-worker"):
                if command in args:
                    at = args.index(command) + 1
                    args = [*args[:at], "--plugin-dir", str(self.plugin_dir), *args[at:]]
        with open(log_path, "w") as log_file:
            popen = subprocess.Popen([sys.executable, "-c", code] + args, cwd=self.workdir,
                                     env=user_environment(PYTHONUNBUFFERED="1"),
                                     stdout=log_file, stderr=subprocess.STDOUT)
        return popen, log_path

    def start_frontend(self, *, grace: str | None = None, require_approval: bool = False,
                       probe: bool = True, wait: bool = True,
                       extra_args: tuple[str, ...] = ()) -> Frontend:
        index = len(self.frontends)
        port = free_port()
        instance_id = f"fe{index}-{uuid.uuid4().hex[:12]}"
        # A data directory of its own: the data-directory lock refuses a second process on one
        # (and the user's real ~/.local/share/localai-tw is no place for a test's replicas).
        data_dir = self.workdir / f"frontend{index}-data"
        data_dir.mkdir(exist_ok=True)
        args = ["-n", "--pidfile=", "localai-frontend",
                "--data-dir", str(data_dir),
                "--listen", f"tcp:{port}:interface=127.0.0.1",
                "--database-url", self.dsn,
                "--instance-id", instance_id,
                "--advertise-address", f"127.0.0.1:{port}",
                "--single-host",
                "--registration-token", self.token,
                "--api-key", self.api_key,
                "--reconnect-grace", grace or self.grace]
        if require_approval:
            args.append("--require-approval")
        args.extend(extra_args)
        name = f"frontend{index}"
        popen, log_path = self._spawn(name, _PROBED_TWISTD if probe else _TWISTD, args)
        fe = Frontend(name, popen, log_path, index=index, port=port, instance_id=instance_id)
        self.processes.append(fe)
        self.frontends.append(fe)
        self.upstreams.append(("127.0.0.1", port))
        if wait:
            self.wait_ready(fe)
        return fe

    def wait_ready(self, fe: Frontend, timeout: float = 60.0) -> None:
        def ready():
            if not fe.alive():
                raise AssertionError(f"{fe.name} exited with {fe.popen.returncode}:\n{fe.log()}")
            try:
                return request("GET", fe.port, "/readyz", timeout=5).status == 200
            except OSError:
                return False
        wait_for(ready, timeout, f"{fe.name} /readyz = 200", interval=0.2)

    def start_worker(self, prefer: int, *, name: str | None = None,
                     tunnel_blocked: bool = False, extra_args: tuple[str, ...] = ()) -> Worker:
        """A worker registered to its own balancer preferring frontend ``prefer``
        (``tunnel_blocked``: its tunnel dials are refused from the very first one)."""
        index = len(self.workers)
        name = name or f"worker{index}-{uuid.uuid4().hex[:6]}"
        balancer = Balancer(self.upstreams, preferred=prefer, name=f"lb-{name}")
        if tunnel_blocked:
            balancer.block_tunnel()
        self.balancers.append(balancer)
        data_dir = self.workdir / f"{name}-data"
        data_dir.mkdir(exist_ok=True)  # a test may have put files there first
        first = 29000 + 20 * (index % 40)  # below the ephemeral range; no backend runs here
        args = ["-n", "--pidfile=", "localai-worker",
                "--register-to", balancer.url,
                "--registration-token", self.token,
                "--node-name", name,
                "--node-type", "backend",
                "--backend-port-range", f"{first}-{first + 9}",
                "--data-dir", str(data_dir), *extra_args]
        popen, log_path = self._spawn(f"w{index}-{name}", _TWISTD, args)
        worker = Worker(name, popen, log_path, balancer=balancer, data_dir=data_dir)
        self.processes.append(worker)
        self.workers.append(worker)
        return worker

    def start_agent(self, prefer: int, *, name: str | None = None,
                    max_jobs: int = 4) -> Worker:
        """An agent worker (``--node-type agent``) registered to its own balancer preferring
        frontend ``prefer``; its jobs call the cluster's API through that balancer."""
        index = len(self.workers)
        name = name or f"agent{index}-{uuid.uuid4().hex[:6]}"
        balancer = Balancer(self.upstreams, preferred=prefer, name=f"lb-{name}")
        self.balancers.append(balancer)
        data_dir = self.workdir / f"{name}-data"
        data_dir.mkdir(exist_ok=True)
        args = ["-n", "--pidfile=", "localai-worker",
                "--register-to", balancer.url,
                "--registration-token", self.token,
                "--node-name", name,
                "--node-type", "agent",
                "--api-token", self.api_key,
                "--max-jobs", str(max_jobs),
                "--data-dir", str(data_dir)]
        popen, log_path = self._spawn(f"w{index}-{name}", _TWISTD, args)
        worker = Worker(name, popen, log_path, balancer=balancer, data_dir=data_dir)
        self.processes.append(worker)
        self.workers.append(worker)
        return worker

    def start_twistd(self, name: str, args: list[str]) -> Process:
        """Any ``twistd`` command line (``args`` after ``twistd``), logged and reaped like
        the others: for a process a test starts with options of its own (a wrong token, a
        shared data directory)."""
        popen, log_path = self._spawn(name, _TWISTD, args)
        proc = Process(name, popen, log_path)
        self.processes.append(proc)
        return proc

    def wait_registered(self, worker: Worker, timeout: float = 60.0) -> str:
        def registered():
            if not worker.alive():
                raise AssertionError(f"{worker.name} exited:\n{worker.log()}")
            rows = self.sql("SELECT id FROM backend_nodes WHERE name = %s", (worker.name,))
            return rows[0][0] if rows else None
        worker.node_id = wait_for(registered, timeout, f"{worker.name} registered")
        return worker.node_id

    def wait_owned(self, worker: Worker, by: Frontend | None = None,
                   timeout: float = 60.0) -> tuple[str, int]:
        """Until the worker's tunnel is held by a live replica (``by`` if given)."""
        node = worker.node_id or self.wait_registered(worker)

        def owned():
            owner = self.owner(node)
            if owner and (by is None or owner[0] == by.instance_id):
                return owner
            return None
        return wait_for(owned, timeout, f"{worker.name} owned by "
                        f"{by.instance_id if by else 'a live replica'}")

    # -- database ----------------------------------------------------------------------------

    def sql(self, query: str, params: tuple = ()) -> list[tuple]:
        for attempt in (0, 1):
            if self._db is None or self._db.closed:
                self._db = psycopg2.connect(self.dsn)
                self._db.autocommit = True
            try:
                with self._db.cursor() as cur:
                    cur.execute(query, params)
                    return cur.fetchall() if cur.description else []
            except psycopg2.OperationalError:
                self._db = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def owner(self, node_id: str) -> tuple[str, int] | None:
        """``(owner, epoch)`` of a held row whose owner is a LIVE instance (the read to act on,
        as ``OwnershipFence.owner``), else None."""
        rows = self.sql(
            "SELECT c.owner_instance_id, c.epoch FROM node_connections c"
            " JOIN instances i ON i.id = c.owner_instance_id"
            " WHERE c.node_id = %s AND c.owner_instance_id <> ''"
            " AND i.last_seen > now() - make_interval(secs => %s)",
            (node_id, INSTANCE_LIVENESS_SECONDS))
        return (rows[0][0], rows[0][1]) if rows else None

    def owner_row(self, node_id: str) -> tuple | None:
        """The raw ``node_connections`` row (owner, epoch, disconnected_at), for diagnostics."""
        rows = self.sql("SELECT owner_instance_id, epoch, disconnected_at FROM node_connections"
                        " WHERE node_id = %s", (node_id,))
        return rows[0] if rows else None

    def node_status(self, node_id: str) -> str:
        return self.sql("SELECT status FROM backend_nodes WHERE id = %s", (node_id,))[0][0]

    def heartbeat_age(self, node_id: str) -> float:
        return float(self.sql("SELECT EXTRACT(EPOCH FROM now() - last_heartbeat)"
                              " FROM backend_nodes WHERE id = %s", (node_id,))[0][0])

    def live_instances(self) -> set[str]:
        return {r[0] for r in self.sql(
            "SELECT id FROM instances WHERE last_seen > now() - make_interval(secs => %s)",
            (INSTANCE_LIVENESS_SECONDS,))}

    def frontend_of(self, instance_id: str) -> Frontend:
        return next(fe for fe in self.frontends if fe.instance_id == instance_id)

    # -- HTTP to replicas --------------------------------------------------------------------

    def admin(self, fe: Frontend, method: str, path: str, body: Any = None) -> Answer:
        return request(method, fe.port, path, body,
                    headers={"Authorization": f"Bearer {self.api_key}"})

    def control(self, fe: Frontend, node_id: str, verb: str, body: dict | None = None) -> dict:
        """Make replica ``fe`` call ``verb`` on the worker (probe route); the answer says which
        replica served and whether it held the tunnel, and carries ``reply`` or ``error``."""
        answer = self.admin(fe, "POST", f"/e2e-probe/control/{node_id}/{verb}", body or {})
        assert answer.status == 200, (answer.status, answer.body)
        return answer.json()

    def upload(self, fe: Frontend, node_id: str, key: str, path: Path) -> dict:
        answer = self.admin(fe, "POST", f"/e2e-probe/upload/{node_id}",
                            {"key": key, "path": str(path)})
        assert answer.status == 200, (answer.status, answer.body)
        return answer.json()

    # -- logs --------------------------------------------------------------------------------

    def grep(self, proc: Process, text: str) -> list[str]:
        return [line for line in proc.log().splitlines() if text in line]

    def report(self, tail: int = 120) -> str:
        parts = []
        for proc in self.processes:
            lines = proc.log().splitlines()
            state = "running" if proc.alive() else f"exited {proc.popen.returncode}"
            parts.append(f"===== {proc.name} (pid {proc.pid}, {state}) {proc.log_path} "
                         f"-- last {min(tail, len(lines))} of {len(lines)} lines =====")
            parts.extend(lines[-tail:])
        for b in self.balancers:
            parts.append(f"===== {b.name}: {b.counters}")
        return "\n".join(parts)

    # -- stopping ----------------------------------------------------------------------------

    def close(self) -> None:
        """Reap every process (workers first, then frontends), stop the balancers, close the
        database connection.  Safe to call twice; never raises before everything was tried."""
        if self._closed:
            return
        self._closed = True
        problems = []
        for proc in [w for w in self.processes if isinstance(w, Worker)] + \
                [f for f in self.processes if not isinstance(f, Worker)]:
            try:
                proc.reap()
            except Exception as e:  # keep reaping the others
                problems.append(f"{proc.name}: {e!r}")
                try:
                    proc.popen.kill()
                    proc.popen.wait(timeout=30)
                except Exception:
                    pass
        for b in self.balancers:
            try:
                b.stop()
            except Exception as e:
                problems.append(f"{b.name}: {e!r}")
        if self._db is not None:
            try:
                self._db.close()
            except Exception:
                pass
        if self in OPEN_CLUSTERS:
            OPEN_CLUSTERS.remove(self)
        assert not problems, problems


def failure_report() -> str:
    return "\n\n".join(c.report() for c in OPEN_CLUSTERS)


@atexit.register
def _reap_leftovers() -> None:
    for cluster in list(OPEN_CLUSTERS):
        try:
            cluster.close()
        except Exception:
            pass
