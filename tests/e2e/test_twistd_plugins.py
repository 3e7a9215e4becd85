"""The real ``twistd`` finds and runs ``localai-frontend`` and ``localai-worker``.

Each test starts the installed ``twistd`` script beside this interpreter, with no PYTHONPATH, so
the plugins are found only if the install put them where Twisted's discovery looks (see setup.py;
``test_user_install.py`` checks the same in a fresh virtualenv).  It runs in a temporary
working directory so nothing (logs, pid files) lands in the repository.  Every process started is
terminated, waited for and, if need be, killed in a finalizer.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tests.e2e.support import free_port
from tests.e2e.userenv import user_environment

REPO_ROOT = Path(__file__).resolve().parents[2]
# The installed twistd script beside this interpreter, as a user runs it (no PYTHONPATH).
TWISTD = [str(Path(sys.executable).with_name("twistd"))]


def flat(text: str) -> str:
    return " ".join(text.split()).replace("- ", "-")


@pytest.fixture
def twistd(tmp_path):
    """``run(args, env=None, wait=True)``: run twistd here; with ``wait=False`` a Popen whose
    output goes to ``<tmp>/twistd-N.log`` and which is always reaped at the end."""
    processes: list[subprocess.Popen] = []

    def environment(extra):
        return user_environment(**(extra or {}))

    def run(args, env=None, wait=True, timeout=60):
        if wait:
            return subprocess.run(TWISTD + args, cwd=tmp_path, env=environment(env),
                                  capture_output=True, text=True, timeout=timeout)
        log_path = tmp_path / f"twistd-{len(processes)}.log"
        log_file = open(log_path, "w")
        proc = subprocess.Popen(TWISTD + args, cwd=tmp_path, env=environment(env),
                                stdout=log_file, stderr=subprocess.STDOUT)
        log_file.close()
        proc.log_path = log_path
        processes.append(proc)
        return proc

    yield run
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def data_dir():
    """A data directory outside pytest's tmp_path: as root, pgserver runs PostgreSQL as the
    user ``pgserver``, and any pytest starting on this machine resets ``/tmp/pytest-of-root``
    to 0700, which would lock that user out of a server running below it."""
    path = Path(tempfile.mkdtemp(prefix="ltw-e2e-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until_ready(proc, port: int, timeout: float = 60.0) -> list[tuple[int, bytes]]:
    """Poll /readyz until 200; returns every answer seen.  Fails if the process exits."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"twistd exited with {proc.returncode}:\n{proc.log_path.read_text()}")
        try:
            status, body = get(f"http://127.0.0.1:{port}/readyz")
        except OSError:
            time.sleep(0.2)
            continue
        seen.append((status, body))
        if status == 200:
            return seen
        time.sleep(0.2)
    pytest.fail(f"not ready after {timeout}s; answers {seen[-3:]}\n{proc.log_path.read_text()}")


def stop(proc, timeout: float = 30.0) -> None:
    """SIGTERM, then expect a clean shutdown.  twistd ends a run stopped by a signal by
    re-raising that signal on itself, so a clean stop exits "killed by SIGTERM"."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=timeout) in (0, -signal.SIGTERM)
    log = proc.log_path.read_text()
    assert "Server Shut Down" in log
    assert "Traceback" not in log and "Unhandled" not in log, log


def test_twistd_lists_both_plugins(twistd):
    result = twistd(["--help"])
    assert result.returncode == 0, result.stderr
    assert "localai-frontend" in result.stdout
    assert "localai-worker" in result.stdout


def test_frontend_help_shows_variables_and_defaults(twistd):
    result = twistd(["-n", "localai-frontend", "--help"])
    assert result.returncode == 0, result.stderr
    text = flat(result.stdout)
    for expected in ("--listen=", "[env: LOCALAI_LISTEN, default: tcp:8080:interface=127.0.0.1]",
                     "--database-url=", "[env: LOCALAI_DATABASE_URL, default: embedded",
                     "--data-dir=", "LOCALAI_DATA_DIR",
                     "--reconnect-grace=", "[env: LOCALAI_RECONNECT_GRACE, default: 90s]",
                     "--api-key=", "LOCALAI_API_KEY", "--registration-token=",
                     "--single-host", "--require-approval", "--instance-id=",
                     "--advertise-address=", "--nats-url=", "LOCALAI_NATS_URL"):
        assert expected in text


def test_worker_help_shows_variables_and_defaults(twistd):
    result = twistd(["-n", "localai-worker", "--help"])
    assert result.returncode == 0, result.stderr
    text = flat(result.stdout)
    for expected in ("--register-to=", "LOCALAI_REGISTER_TO", "--node-type=",
                     "[env: LOCALAI_NODE_TYPE, default: backend]",
                     "[env: LOCALAI_BACKEND_PORT_RANGE, default: 30000-30999]",
                     "--label=", "LOCALAI_NODE_LABELS", "--node-name="):
        assert expected in text


@pytest.mark.parametrize("args, env, named", [
    (["localai-frontend", "--reconnect-grace", "soon"], {}, "--reconnect-grace:"),
    (["localai-frontend"], {"LOCALAI_LISTEN": "tcp:notaport"},
     "--listen (from LOCALAI_LISTEN):"),
    (["localai-worker", "--register-to", "ftp://x"], {}, "--register-to:"),
    (["localai-worker"], {}, "--register-to is required"),
    (["localai-frontend", "--no-such-option"], {}, "option --no-such-option not recognized"),
])
def test_bad_option_fails_naming_it(twistd, args, env, named):
    """One line on stderr, program and option first; not twistd's 60 lines of help."""
    result = twistd(["-n", "--pidfile="] + args, env=env)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{args[0]}: {named}"), result.stderr
    assert lines[0].endswith(f"(see twistd -n {args[0]} --help)")
    assert "Usage:" not in result.stdout


def test_frontend_with_configured_database_serves_and_stops(twistd, pg_dsn):
    port = free_port()
    proc = twistd(["-n", "--pidfile=", "localai-frontend",
                   "--listen", f"tcp:{port}:interface=127.0.0.1",
                   "--database-url", pg_dsn, "--api-key", "sk-e2e-secret",
                   "--nats-url", "nats://127.0.0.1:1"], wait=False)
    wait_until_ready(proc, port)
    assert get(f"http://127.0.0.1:{port}/healthz") == (200, b"ok")
    status, body = get(f"http://127.0.0.1:{port}/readyz")
    assert (status, json.loads(body)) == (200, {"ready": True})
    assert get(f"http://127.0.0.1:{port}/v1/models?x=%0a")[0] == 401
    stop(proc)
    log = proc.log_path.read_text()
    assert "Server Shut Down" in log
    # The access line, written by the replica to the text log in a batch (web/accesslog.py),
    # framed as the log's other lines, and there when the process has stopped.
    assert re.search(r'^\S+ \[twisted\.python\.log#info\] "127\.0\.0\.1" - - \[[^]]+\] '
                     r'"GET /v1/models\?x=%0a HTTP/1\.1" 401 \d+ "-" "[^"]*"$', log, re.M), log
    assert "sk-e2e-secret" not in log
    assert "--nats-url is accepted for compatibility and ignored" in log
    assert (f"localai-frontend listening on 127.0.0.1:{port}: the OpenAI API needs an API key "
            "(1 configured)") in log
    assert "GET /readyz" not in log and "GET /healthz" not in log  # probes: no access lines
    assert "#debug]" not in log


def test_log_level_warn_leaves_out_info(twistd, data_dir):
    proc = twistd(["-n", "localai-worker", "--register-to", "http://127.0.0.1:1",
                   "--log-level", "warn"], env={"LOCALAI_DATA_DIR": str(data_dir)}, wait=False)
    deadline = time.monotonic() + 30
    while "registration of node" not in proc.log_path.read_text():
        assert proc.poll() is None, proc.log_path.read_text()
        assert time.monotonic() < deadline, proc.log_path.read_text()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    log = proc.log_path.read_text()
    assert "#warn] registration of node" in log
    assert "#info]" not in log, log


def test_log_format_json_writes_one_json_object_per_line(twistd, pg_dsn):
    """For machine readers: every line of the log is one JSON object with the event's fields
    and its text, the configuration report and access lines included."""
    port = free_port()
    proc = twistd(["-n", "--pidfile=", "localai-frontend",
                   "--listen", f"tcp:{port}:interface=127.0.0.1",
                   "--database-url", pg_dsn, "--api-key", "sk-e2e-secret"],
                  env={"LOCALAI_LOG_FORMAT": "json"}, wait=False)
    wait_until_ready(proc, port)
    assert get(f"http://127.0.0.1:{port}/v1/models")[0] == 401
    stop(proc)
    lines = proc.log_path.read_text().splitlines()
    events = [json.loads(line) for line in lines]  # every line, or this fails
    texts = [event["text"] for event in events]
    assert all(isinstance(event["log_time"], float) for event in events)
    assert "localai-frontend --log-format = json (env)" in texts
    assert any('"GET /v1/models HTTP/1.1" 401' in text for text in texts), texts
    assert any(text.startswith("localai-frontend listening on") for text in texts)


def test_frontend_embedded_database_end_to_end(twistd, data_dir):
    port = free_port()
    proc = twistd(["-n", "--pidfile=", "localai-frontend",
                   "--listen", f"tcp:{port}:interface=127.0.0.1"],
                  env={"LOCALAI_DATA_DIR": str(data_dir)}, wait=False)
    answers = wait_until_ready(proc, port)
    for status, body in answers[:-1]:  # while PostgreSQL was starting
        assert status == 503 and json.loads(body)["ready"] is False
    pgdata = data_dir / "postgres"
    assert (pgdata / "postmaster.pid").exists()
    stop(proc)
    log = proc.log_path.read_text()
    assert f"embedded PostgreSQL is running in {pgdata}" in log
    assert f'--database-url "host={pgdata}' in log
    assert "embedded PostgreSQL in" in log and "stopped" in log
    assert not (pgdata / "postmaster.pid").exists(), "the embedded server outlived twistd"


def test_frontend_exits_with_failure_when_the_database_is_unreachable(twistd):
    port = free_port()
    result = twistd(["-n", "--pidfile=", "localai-frontend",
                     "--listen", f"tcp:{port}:interface=127.0.0.1",
                     "--database-url", "postgresql://postgres:hunter2@127.0.0.1:1/x"])
    assert result.returncode == 1
    assert "cannot start" in result.stdout and "--database-url" in result.stdout
    assert "hunter2" not in result.stdout + result.stderr


def test_worker_starts_logs_its_configuration_and_stops(twistd):
    proc = twistd(["-n", "--pidfile=", "localai-worker", "--register-to", "http://127.0.0.1:1",
                   "--registration-token", "tok-e2e-secret", "--label", "gpu=none",
                   "--backend-port-range", "40000-40099"], wait=False)
    deadline = time.monotonic() + 30
    # The configuration is logged when the service starts, before the reactor runs and
    # installs twistd's SIGTERM handler; a failed registration attempt is logged by the
    # running reactor, so a SIGTERM after it is a clean stop, not the signal's default action.
    while not ("--label = gpu=none" in proc.log_path.read_text()
               and "registration of node" in proc.log_path.read_text()):
        assert proc.poll() is None, proc.log_path.read_text()
        assert time.monotonic() < deadline, proc.log_path.read_text()
        time.sleep(0.2)
    stop(proc)
    log = proc.log_path.read_text()
    assert "tok-e2e-secret" not in log
    assert "--registration-token = <set>" in log
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ephemeral.exists():
        first, last = (int(p) for p in ephemeral.read_text().split())
        if first <= 40099 and 40000 <= last:
            assert "overlaps the kernel's ephemeral port range" in log


def test_two_frontends_and_a_worker_start_from_one_directory(twistd, pg_dsn, tmp_path):
    """No --pidfile: each process keeps its pidfile in its own data directory, so the commands
    of the quickstart work from one working directory; a second process on the *same* data
    directory is refused naming --data-dir."""
    ports = [free_port(), free_port()]
    frontends = [
        twistd(["-n", "localai-frontend", "--listen", f"tcp:{port}:interface=127.0.0.1",
                "--database-url", pg_dsn],
               env={"LOCALAI_DATA_DIR": str(tmp_path / f"replica-{i}")}, wait=False)
        for i, port in enumerate(ports)]
    for proc, port in zip(frontends, ports):
        wait_until_ready(proc, port)
    assert (tmp_path / "replica-0" / "localai-frontend.pid").read_text().strip() == \
        str(frontends[0].pid)
    worker = twistd(["-n", "localai-worker", "--register-to", f"http://127.0.0.1:{ports[0]}"],
                    env={"LOCALAI_DATA_DIR": str(tmp_path / "worker")}, wait=False)
    deadline = time.monotonic() + 30
    while not (tmp_path / "worker" / "localai-worker.pid").exists():
        assert worker.poll() is None, worker.log_path.read_text()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    again = twistd(["-n", "localai-frontend",
                    "--listen", f"tcp:{free_port()}:interface=127.0.0.1",
                    "--database-url", pg_dsn],
                   env={"LOCALAI_DATA_DIR": str(tmp_path / "replica-0")})
    assert again.returncode == 1
    assert again.stderr.startswith(
        f"localai-frontend: --data-dir: another localai-frontend (pid {frontends[0].pid})")
    assert not (tmp_path / "twistd.pid").exists()
    for proc in [worker] + frontends:
        stop(proc)


def test_frontend_exits_with_failure_when_its_port_is_taken(twistd, pg_dsn, data_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = twistd(["-n", "localai-frontend", "--listen",
                         f"tcp:{port}:interface=127.0.0.1", "--database-url", pg_dsn],
                        env={"LOCALAI_DATA_DIR": str(data_dir)}, timeout=30)
    assert result.returncode == 1, result.stdout
    assert time.monotonic() - started < 20
    assert (f"localai-frontend cannot start: --listen tcp:{port}:interface=127.0.0.1: "
            f"127.0.0.1:{port} is already in use by another process; stop it or choose another "
            f"port with --listen") in result.stdout
    assert not (data_dir / "localai-frontend.pid").exists()


@pytest.mark.parametrize("program", ["localai-frontend", "localai-worker"])
def test_version(twistd, program):
    from importlib import metadata

    result = twistd(["-n", program, "--version"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{program} (localai-tw) {metadata.version('localai-tw')}\n"


def test_open_listener_is_refused_without_a_key_and_keys_come_from_files(twistd, pg_dsn,
                                                                          tmp_path):
    port = free_port()
    refused = twistd(["-n", "localai-frontend", "--listen", f"tcp:{port}",
                      "--database-url", pg_dsn],
                     env={"LOCALAI_DATA_DIR": str(tmp_path / "a")})
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"localai-frontend: --listen: tcp:{port} accepts "
                                     "connections on every interface and no --api-key is set")
    assert "--allow-open-api" in refused.stderr
    keys = tmp_path / "api-keys"
    keys.write_text("sk-from-file\n")
    # Issue 21 §6: with a key but no registration token, a reachable listener is refused too.
    refused = twistd(["-n", "localai-frontend", "--listen", f"tcp:{port}",
                      "--database-url", pg_dsn, "--api-key-file", str(keys)],
                     env={"LOCALAI_DATA_DIR": str(tmp_path / "c")})
    assert refused.returncode == 1
    assert "no --registration-token is set" in refused.stderr
    assert "--registration-token-file" in refused.stderr
    assert "--allow-open-registration" in refused.stderr
    proc = twistd(["-n", "localai-frontend", "--listen", f"tcp:{port}",
                   "--database-url", pg_dsn, "--api-key-file", str(keys),
                   "--allow-open-registration"],
                  env={"LOCALAI_DATA_DIR": str(tmp_path / "b")}, wait=False)
    wait_until_ready(proc, port)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/nodes",
                                     headers={"Authorization": "Bearer sk-from-file"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200
    stop(proc)
    assert "sk-from-file" not in proc.log_path.read_text()


def test_frontend_keeps_its_instance_id_and_leaves_no_run_directory(twistd, pg_dsn,
                                                                      data_dir):
    # data_dir: a short path, so the bridge sockets live in <data-dir>/run (not a mkdtemp).
    tmp_path = data_dir
    run = tmp_path / "replica" / "run"
    (run / "grpc-leftover").mkdir(parents=True)  # an earlier process's, empty
    ids = []
    for _ in range(2):
        port = free_port()
        proc = twistd(["-n", "localai-frontend", "--listen", f"tcp:{port}:interface=127.0.0.1",
                       "--database-url", pg_dsn],
                      env={"LOCALAI_DATA_DIR": str(tmp_path / "replica")}, wait=False)
        wait_until_ready(proc, port)
        assert [p.name for p in run.iterdir()] == ["grpc-" + instance_id(proc)[:12]]
        stop(proc)
        assert list(run.iterdir()) == []
        line = next(line for line in proc.log_path.read_text().splitlines()
                    if "localai-frontend --instance-id = " in line)
        ids.append(line.split(" = ", 1)[1])
    assert ids[0] == ids[1]
    assert ids[0].endswith(" (data-dir)")
    assert (tmp_path / "replica" / "instance-id").read_text().strip() == ids[0].split()[0]


def instance_id(proc) -> str:
    line = next(line for line in proc.log_path.read_text().splitlines()
                if "localai-frontend --instance-id = " in line)
    return line.split(" = ", 1)[1].split()[0]
