"""A LocalAI user's backends directory on the real command line: ``twistd localai-frontend
--single-host --local-worker`` with LocalAI's own variable ``LOCALAI_BACKENDS_PATH`` set, as a
LocalAI installation's environment carries it.  A model config's ``backend: my-echo`` runs
``<backends>/my-echo/run.sh`` in the local worker (a run.sh that records how it was started and
execs this package's ``echo`` backend, so no torch is needed), and a directory without
``run.sh`` is answered naming the file while the process serves on.  Every process is reaped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.e2e.support import free_port
from tests.e2e.userenv import user_environment

TWISTD = [str(Path(sys.executable).with_name("twistd"))]

RUN_SH = f"""#!/bin/sh
printf '%s\\n' "$(pwd)" "$*" > started.txt
exec {sys.executable} -m localai_tw.backends.builtin.echo "$@"
"""


def request(base: str, path: str, body=None, timeout: float = 60.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_localai_backends_path_reaches_the_local_worker(tmp_path, pg_dsn):
    backends = tmp_path / "localai" / "backends"
    good = backends / "my-echo"
    good.mkdir(parents=True)
    (good / "run.sh").write_text(RUN_SH)
    (good / "run.sh").chmod(0o755)
    (backends / "half-installed").mkdir()
    models = tmp_path / "models"
    models.mkdir()
    for name, backend in (("echo-chat", "my-echo"), ("broken", "half-installed")):
        (models / f"{name}.yaml").write_text(
            f"name: {name}\nbackend: {backend}\nknown_usecases: [chat, completion]\n"
            "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = user_environment(LOCALAI_BACKENDS_PATH=str(backends))
    log_path = tmp_path / "twistd.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            TWISTD + ["-n", "--pidfile=", "localai-frontend", "--single-host", "--local-worker",
                      "--listen", f"tcp:{port}:interface=127.0.0.1", "--data-dir",
                      str(tmp_path / "data"), "--models-dir", str(models), "--database-url",
                      pg_dsn],
            cwd=tmp_path, env=env, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if request(base, "/readyz", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-5000:]
            time.sleep(0.25)

        status, body = request(base, "/v1/chat/completions", {
            "model": "echo-chat", "messages": [{"role": "user", "content": "from run.sh"}]})
        assert status == 200, (body, log_path.read_text()[-5000:])
        assert body["choices"][0]["message"]["content"] == "from run.sh"
        cwd, args = (good / "started.txt").read_text().splitlines()
        assert cwd == str(good) and args.startswith("--addr 127.0.0.1:")

        status, body = request(base, "/v1/completions", {"model": "broken", "prompt": "x"})
        assert status == 500 and body["error"]["code"] == "model_load_failed"
        # The client reads names, not the worker's paths (issue 21 §7); the log has the path.
        message = body["error"]["message"]
        assert "run.sh does not exist: half-installed is not an installed" in message, message
        assert str(backends) not in message
        assert request(base, "/readyz")[0] == 200  # still serving

        log = log_path.read_text()
        assert f"LocalAI backends directory {backends}: half-installed, my-echo" in log
        assert f"{backends}/half-installed/run.sh does not exist" in log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Traceback" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.poll() is None:
            proc.wait()
