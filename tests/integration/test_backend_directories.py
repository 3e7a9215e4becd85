"""LocalAI backend directories on a real worker (``--backends-path``): a ``run.sh`` is started
as LocalAI starts it (argv, cwd, environment, auth token, readiness by Health), and each bad
directory is a clear error naming the file, to the API caller and in one worker log line,
leaving no process and no port behind, the worker serving on.

The good backend here is a ``run.sh`` that records how it was started and then execs this
package's ``echo`` backend, so these tests need no torch; LocalAI's own transformers backend
runs in ``test_localai_transformers_backend.py``."""

from __future__ import annotations

import json
import os
import sys

import pytest_twisted
from twisted.internet import threads
from twisted.logger import globalLogPublisher

from localai_tw.backends.builtin import PACKAGE_ROOT
from localai_tw.backends.ledger import LEDGER_FILE

from .inference_harness import ADMIN, supervisor_of

import openai  # noqa: E402  (the official client, as a LocalAI user's program would call)

RECORDING_RUN_SH = f"""#!/bin/sh
# How was I started?  Then become the echo backend (a LocalAI-compatible program).
printf '%s\\n' "$(pwd)" "$*" "${{LOCALAI_GRPC_AUTH_TOKEN:+token-set}}" "$HF_HOME" > started.txt
PYTHONPATH={PACKAGE_ROOT} exec {sys.executable} -m localai_tw.backends.builtin.echo "$@"
"""


def install(backends, name, run_sh=None, mode=0o755):
    d = backends / name
    d.mkdir(parents=True)
    (d / "backend.py").write_text("# a LocalAI backend would be here\n")
    if run_sh is not None:
        (d / "run.sh").write_text(run_sh)
        (d / "run.sh").chmod(mode)
    return d


class WorkerLog:
    """The worker's log lines about backends that did not start."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, event):
        fmt = event.get("log_format") or ""
        if "did not start" in fmt or "exited with" in fmt or fmt.startswith("backend {key} ("):
            from twisted.logger import formatEvent
            self.lines.append(formatEvent(event))

    def __enter__(self):
        globalLogPublisher.addObserver(self)
        return self

    def __exit__(self, *exc):
        globalLogPublisher.removeObserver(self)


def models(cluster, *names):
    for name in names:
        cluster.write_model(f"{name}.yaml", (
            f"name: {name}\nbackend: {name}\nparameters:\n  model: {name}-weights\n"
            "known_usecases: [chat, completion]\n"
            "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"))


@pytest_twisted.ensureDeferred
async def test_a_backend_directory_runs_as_localai_runs_it_and_bad_ones_are_clear_errors(
        cluster, tmp_path):
    backends = tmp_path / "localai-backends"
    good = install(backends, "my-echo", RECORDING_RUN_SH)
    no_run = install(backends, "no-run")
    not_exec = install(backends, "not-exec", RECORDING_RUN_SH, mode=0o644)
    dies = install(backends, "dies", "#!/bin/sh\necho 'ImportError: no module named torch' >&2"
                                     "\nexit 3\n")
    program = install(tmp_path / "opt", "ext", RECORDING_RUN_SH) / "run.sh"
    models(cluster, "my-echo", "no-run", "not-exec", "dies", "ext-echo", "external")
    owner = await cluster.frontend("replica-owner")
    other = await cluster.frontend("replica-other")  # every request below crosses the relay
    worker = await cluster.worker("w-dirs", owner, **{
        "backends-path": str(backends),
        "external-grpc-backends": [("ext-echo", str(program))]})
    supervisor = supervisor_of(worker)
    base = cluster.base_url(other) + "/v1"

    def use_the_api():
        client = openai.OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=60)
        failures = {}
        for name in ("no-run", "not-exec", "dies", "external"):
            for attempt in (1, 2):
                try:
                    client.completions.create(model=name, prompt="hello", max_tokens=3)
                    failures[name, attempt] = None
                except openai.APIStatusError as e:
                    failures[name, attempt] = (e.status_code, e.code, e.message,
                                               e.response.headers.get("retry-after"))
        chat = client.chat.completions.create(
            model="my-echo", messages=[{"role": "user", "content": "one two three"}])
        external = client.completions.create(model="ext-echo", prompt="four five")
        return failures, chat, external

    with WorkerLog() as logged:
        failures, chat, external = await threads.deferToThread(use_the_api)

    # The good directory: served, started the way LocalAI starts a backend.
    assert chat.choices[0].message.content == "one two three"
    cwd, args, token, hf_home = (good / "started.txt").read_text().splitlines()
    assert cwd == str(good)
    port = int(args.split(":")[-1])
    assert args == f"--addr 127.0.0.1:{port}"
    assert token == "token-set"  # LOCALAI_GRPC_AUTH_TOKEN, the process's own token
    assert hf_home == (os.environ.get("HF_HOME") or os.path.join(worker.data_dir, "models"))

    # --external-grpc-backends NAME:PATH: the program, started the same way.
    assert external.choices[0].text == "four five"
    assert (program.parent / "started.txt").read_text().splitlines()[0] == str(program.parent)
    # "external" in a config cannot carry a command: the error says what to do instead.
    status, code, message, _ = failures["external", 1]
    assert (status, code) == (500, "model_load_failed")
    assert "register the program on the worker with --external-grpc-backends NAME:PATH" \
        in message

    # Each bad directory: a clear error naming the file, not "does not exist", no retry storm;
    # the client reads the names (issue 21 §7: no host path), the worker's log the paths.
    answered = {
        "no-run": "run.sh does not exist: no-run is not an installed LocalAI backend",
        "not-exec": "run.sh is not executable",
        "dies": "(run.sh) exited with code 3 before it was ready; last output: "
                "ImportError: no module named torch",
    }
    expected = {
        "no-run": f"{no_run}/run.sh does not exist: {no_run} is not an installed LocalAI "
                  f"backend",
        "not-exec": f"{not_exec}/run.sh is not executable",
        "dies": f"({dies}/run.sh) exited with code 3 before it was ready; last output: "
                f"ImportError: no module named torch",
    }
    for name, says in answered.items():
        status, code, message, retry_after = failures[name, 1]
        assert (status, code) == (500, "model_load_failed"), failures[name, 1]
        assert says in message, message
        assert "does not exist (" not in message and "model_not_found" != code
        assert str(backends) not in message
        again = failures[name, 2]
        assert again[:2] == (500, "model_load_failed") and says in again[2]
        assert again[3] is not None  # remembered: told when it is tried again, not retried
    # One worker log line per failed start, naming the file; each start tried once.
    for name, says in expected.items():
        mine = [line for line in logged.lines if f"backend {name}#0" in line]
        assert len(mine) == 1, logged.lines
        assert "did not start" in mine[0] and str(backends / name) in mine[0]
        assert "\n" not in mine[0]

    # Nothing half-started: no process for a directory that could not run, the one that died
    # is gone with its port, the process record lists only the good backend.
    assert sorted(r["model"] for r in supervisor.list()) == ["ext-echo", "my-echo"]
    ended = {r.model: (r.state, r.pid is None) for r in supervisor._ended}
    assert ended == {"no-run": ("failed", True), "not-exec": ("failed", True),
                     "dies": ("crashed", False), "external": ("failed", True)}
    assert not os.path.exists(not_exec / "started.txt")
    assert sorted(supervisor.ports.held().values()) == ["ext-echo#0", "my-echo#0"]
    assert supervisor.ports.holder(port) == "my-echo#0"
    with open(os.path.join(worker.data_dir, LEDGER_FILE)) as f:
        assert sorted(p["key"] for p in json.load(f)["processes"]) == ["ext-echo#0",
                                                                      "my-echo#0"]
    assert worker.running and worker.dialer.readiness() is None
