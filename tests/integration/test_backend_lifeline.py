"""Backend processes do not outlive the process that started them, whatever their stdio.  Real
processes throughout; every process started here is killed by the test's finalizer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from localai_tw.backends import builtin


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
