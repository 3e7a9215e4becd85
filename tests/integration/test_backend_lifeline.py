"""Backend processes do not outlive the process that started them, whatever their stdio, and
a restarted worker kills what its record says a previous run left running.  Real processes
throughout; every process started here is killed by the test's finalizer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from localai_tw.backends import builtin
from localai_tw.backends.ledger import ProcessLedger


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody collected (there may be no init here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def started():
    """Processes the test started (Popen objects or pids): killed at the end, whatever."""
    things: list = []
    yield things
    for thing in things:
        pid = thing if isinstance(thing, int) else thing.pid
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not isinstance(thing, int):
            thing.wait(timeout=10)


#: A parent that starts the echo backend directly (no spawn wrapper, so no parent-death
#: signal) with stdout and stderr piped to itself, prints the backend's pid and never reads.
PIPING_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-m", "localai_tw.backends.builtin.echo",
                          "--addr", "127.0.0.1:" + sys.argv[1]],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
print(child.pid, flush=True)
time.sleep(300)
"""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_builtin_backend_exits_when_its_parent_dies_even_with_stderr_a_dead_pipe(started):
    env = dict(os.environ, PYTHONPATH=builtin.PACKAGE_ROOT,
               LOCALAI_BACKEND_PARENT_WATCH_INTERVAL="200ms")
    env.pop("LOCALAI_BACKEND_PARENT_WATCH", None)
    parent = subprocess.Popen([sys.executable, "-c", PIPING_PARENT, str(free_port())],
                              stdout=subprocess.PIPE, env=env, start_new_session=True)
    started.append(parent)
    backend = int(parent.stdout.readline())
    started.append(backend)
    time.sleep(1.5)  # past the backend's start: its parent watch is running
    assert not gone(backend)
    parent.kill()
    parent.wait(timeout=10)
    assert wait_gone(backend, 10.0), \
        "the backend outlived its parent: its parent watch died on the write to stderr"


# -- the record of started processes ----------------------------------------------------------


def sleeper(started) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                            start_new_session=True)
    started.append(proc)
    return proc


def test_the_record_lists_live_backends_and_forgets_ended_ones(tmp_path, started):
    path = str(tmp_path / "backend-processes.json")
    ledger = ProcessLedger(path)
    one, two = sleeper(started), sleeper(started)
    ledger.add(one.pid, "a#0", "echo", ["echo-program", "--addr", "127.0.0.1:1"])
    ledger.add(two.pid, "b#0", "echo", ["echo-program", "--addr", "127.0.0.1:2"])
    ledger.remove(one.pid)
    recorded = json.load(open(path))["processes"]
    assert [(p["pid"], p["key"], p["command"][0]) for p in recorded] == \
        [(two.pid, "b#0", "echo-program")]
    assert recorded[0]["create_time"] > 0
    ledger.remove(two.pid)
    assert json.load(open(path))["processes"] == []


def test_reaping_kills_recorded_leftovers_and_spares_a_recycled_pid(tmp_path, started):
    path = str(tmp_path / "backend-processes.json")
    leftover, unrelated = sleeper(started), sleeper(started)
    previous = ProcessLedger(path)
    previous.add(leftover.pid, "left#0", "echo", ["left"])
    previous.add(unrelated.pid, "recycled#0", "echo", ["recycled"])
    # The second pid now belongs to a process that started at another time than the recorded.
    data = json.load(open(path))
    data["processes"][1]["create_time"] -= 3600
    json.dump(data, open(path, "w"))

    reaped = ProcessLedger(path).reap()

    assert [entry["pid"] for entry in reaped] == [leftover.pid]
    assert leftover.wait(timeout=10) == -signal.SIGKILL
    assert unrelated.poll() is None
    assert json.load(open(path))["processes"] == []
