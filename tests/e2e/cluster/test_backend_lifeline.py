"""Backend processes die with the twistd process that started them (``kill -9`` included), and a
worker restarted on the same data directory kills what its previous run recorded and left
running.  Real frontends, workers and backend processes; nothing mocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from localai_tw.backends.ledger import LEDGER_FILE, ProcessLedger

from . import harness

#: A LocalAI-compatible program that does NOT watch its parent: the echo backend with its own
#: parent watch turned off, run as the ``external`` backend.  Only the spawning path can make it
#: die with the worker.
EXTERNAL_WITHOUT_WATCH = {
    "backend": "external", "model": "lifeline-external",
    "options": {"command": [sys.executable, "-m", "localai_tw.backends.builtin.echo"],
                "env": {"LOCALAI_BACKEND_PARENT_WATCH": "off"}},
}
BUILTIN_ECHO = {"backend": "echo", "model": "lifeline-echo",
                "load": {"Model": "lifeline-echo"}}


def gone(pid: int) -> bool:
    """No such process, or a zombie no init collected yet (dead all the same)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start_backends(cluster: harness.Cluster, fe: harness.Frontend, node: str,
                   parent_pid: int) -> list[int]:
    for request in (BUILTIN_ECHO, EXTERNAL_WITHOUT_WATCH):
        answer = cluster.control(fe, node, "backend.start", request)
        assert answer.get("reply", {}).get("success"), answer
    listed = cluster.control(fe, node, "backend.list")["reply"]["backends"]
    pids = [b["pid"] for b in listed if b["state"] == "ready"]
    assert len(pids) == 2, listed
    for pid in pids:
        assert psutil.Process(pid).ppid() == parent_pid
    return pids


def assert_gone_soon(pids: list[int], killed: str) -> None:
    try:
        harness.wait_for(lambda: all(gone(pid) for pid in pids), 5.0,
                         f"the backends {pids} to die with the killed {killed}", interval=0.1)
    finally:  # a red run leaves nothing behind (each backend leads its own process group)
        for pid in [pid for pid in pids if not gone(pid)]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_backends_die_with_a_killed_worker(make_cluster):
    cluster = make_cluster()
    fe = cluster.start_frontend()
    worker = cluster.start_worker(prefer=0)
    node = cluster.wait_registered(worker)
    cluster.wait_owned(worker, by=fe)
    pids = start_backends(cluster, fe, node, worker.pid)
    record = json.loads((worker.data_dir / LEDGER_FILE).read_text())
    assert sorted(p["pid"] for p in record["processes"]) == sorted(pids)

    worker.kill()
    assert_gone_soon(pids, "worker")


def test_backends_die_with_a_killed_frontend_running_the_local_worker(make_cluster, workdir):
    cluster = make_cluster()
    data_dir = workdir / "frontend-data"
    fe = cluster.start_frontend(extra_args=("--local-worker", "--data-dir", str(data_dir)))
    node = harness.wait_for(
        lambda: (cluster.sql("SELECT id FROM backend_nodes") or [[None]])[0][0], 60,
        "the local worker registered")
    harness.wait_for(lambda: cluster.owner(node), 60,
                     "the local worker's tunnel held")
    pids = start_backends(cluster, fe, node, fe.pid)

    fe.kill()
    assert_gone_soon(pids, "frontend")


def test_a_restarted_worker_kills_recorded_leftovers_and_spares_a_recycled_pid(make_cluster):
    cluster = make_cluster()
    fe = cluster.start_frontend()
    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    leftover = subprocess.Popen(sleep, start_new_session=True)
    unrelated = subprocess.Popen(sleep, start_new_session=True)
    try:
        name = "restarted"
        data_dir = cluster.workdir / f"{name}-data"
        previous_run = ProcessLedger(str(data_dir / LEDGER_FILE))
        previous_run.add(leftover.pid, "left#0", "echo", sleep)
        previous_run.add(unrelated.pid, "recycled#0", "echo", sleep)
        # The second pid was recycled: the process holding it now started at another time.
        record = json.loads((data_dir / LEDGER_FILE).read_text())
        record["processes"][1]["create_time"] -= 3600
        (data_dir / LEDGER_FILE).write_text(json.dumps(record))

        worker = cluster.start_worker(prefer=0, name=name)
        cluster.wait_registered(worker)
        harness.wait_for(lambda: leftover.poll() is not None, 10.0, "the leftover killed")
        assert leftover.returncode == -signal.SIGKILL
        time.sleep(0.5)
        assert unrelated.poll() is None, "a pid that belongs to another process was killed"
        reaped = cluster.grep(worker, "killed leftover backend left#0")
        assert len(reaped) == 1 and str(leftover.pid) in reaped[0], worker.log()
        assert not cluster.grep(worker, "killed leftover backend recycled#0")
        assert json.loads((data_dir / LEDGER_FILE).read_text())["processes"] == []
    finally:
        for proc in (leftover, unrelated):
            proc.kill()
            proc.wait(timeout=10)
