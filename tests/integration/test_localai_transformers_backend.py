"""LocalAI's own transformers backend, unmodified, under the worker.

Marker ``heavy`` (torch, transformers, sentence-transformers, scipy, grpcio-tools; failed instead
of skipped with ``CI=true``).  ``tests/fixtures/localai-backends/transformers/`` holds LocalAI's
``run.sh``, ``backend.py``, ``backend.proto`` and ``common/`` helpers as LocalAI ships them
(commit 82c191a; README there).  The test installs that directory into a backends directory as
LocalAI's ``install.sh`` would leave it, offline: the gRPC stubs generated from LocalAI's proto,
and a ``venv/`` (here with the system site-packages, where torch already is, instead of
``uv pip install -r requirements.txt``).  Then LocalAI's ``run.sh`` (through its
``libbackend.sh``) execs ``venv/bin/python backend.py --addr ...`` in that directory, and a
model config's ``backend: transformers`` reaches it through a relaying replica: completion,
chat (prompt rendered by the frontend's template), streaming, embeddings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv

import grpc
import pytest
import pytest_twisted
from twisted.internet import threads

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from tests.heavy import missing, skip_or_fail

from .inference_harness import ADMIN, supervisor_of

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.heavy

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures",
                       "localai-backends", "transformers")


@pytest.fixture
def localai_backend_deps():
    needed = ("torch", "transformers", "sentence_transformers", "scipy", "grpc_tools")
    absent = missing(*needed)
    if absent:
        skip_or_fail(f"LocalAI's transformers backend needs {', '.join(absent)} (pip install "
                     f"'localai-tw[transformers,sentence-transformers,test]')")


def install_localai_backend(backends_dir: str) -> str:
    """What LocalAI's install.sh leaves behind, done offline: the directory, its stubs (from
    its own backend.proto, as libbackend.sh's runProtogen does) and its venv."""
    target = os.path.join(backends_dir, "transformers")
    shutil.copytree(FIXTURE, target)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                    "--grpc_python_out=.", "backend.proto"], cwd=target, check=True)
    venv.create(os.path.join(target, "venv"), system_site_packages=True, with_pip=False)
    return target


def chat_config(model_dir: str) -> str:
    return (f"name: localai-tiny\nbackend: transformers\ntype: AutoModelForCausalLM\n"
            f"context_size: 128\nparameters:\n  model: {model_dir}\n"
            "known_usecases: [chat, completion]\n"
            # LocalAI's backend cannot apply the tokenizer's chat template on current
            # transformers (docs/backends.md): the frontend renders the prompt.
            "template:\n  chat_message: '{{.RoleName}} : {{.Content}}'\n"
            "  chat: '{{.Input}} assistant :'\n")


def embed_config(model_dir: str) -> str:
    return (f"name: localai-tiny-embed\nbackend: transformers\ntype: AutoModel\n"
            f"embeddings: true\nparameters:\n  model: {model_dir}\n")


@pytest.mark.usefixtures("localai_backend_deps")
@pytest_twisted.ensureDeferred
async def test_localai_transformers_backend_serves_through_a_relaying_replica(cluster,
                                                                               tmp_path):
    from localai_tw.tinychat import build

    backends = str(tmp_path / "backends")
    backend_dir = await threads.deferToThread(install_localai_backend, backends)
    model_dir = str(tmp_path / "tiny")
    await threads.deferToThread(build, model_dir)
    cluster.write_model("tiny.yaml", chat_config(model_dir))
    cluster.write_model("tiny-embed.yaml", embed_config(model_dir))
    owner = await cluster.frontend("replica-owner")
    other = await cluster.frontend("replica-other")
    worker = await cluster.worker("w-localai", owner, **{"backends-path": backends})
    base = cluster.base_url(other) + "/v1"  # the replica without the tunnel: all relayed

    def use_the_api():
        client = openai.OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=300)
        completion = client.completions.create(model="localai-tiny", prompt="the cat sat",
                                               max_tokens=4, temperature=0)
        streamed = client.completions.create(model="localai-tiny", prompt="the cat sat",
                                             max_tokens=4, temperature=0, stream=True)
        pieces = [c.choices[0].text for c in streamed if c.choices]
        chat = client.chat.completions.create(
            model="localai-tiny", messages=[{"role": "user", "content": "hello"}],
            max_tokens=4, temperature=0)
        chat_stream = client.chat.completions.create(
            model="localai-tiny", messages=[{"role": "user", "content": "hello"}],
            max_tokens=4, temperature=0, stream=True)
        chat_pieces = [c.choices[0].delta.content or "" for c in chat_stream if c.choices]
        embedded = client.embeddings.create(model="localai-tiny-embed",
                                            input=["the dog", "a cat ran"])
        # the built-in transformers' logprobs claim is not this program's: its answer says so
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="localai-tiny", messages=[{"role": "user", "content": "hello"}],
                max_tokens=4, temperature=0, logprobs=True)
        # token ids (LangChain's default): LocalAI's backend reads text only, so a 400
        with pytest.raises(openai.BadRequestError) as ids:
            client.embeddings.create(model="localai-tiny-embed", input=[[464, 3797]])
        assert ids.value.param == "input" and "takes text only" in ids.value.message
        return completion, pieces, chat, chat_pieces, embedded, refused.value

    completion, pieces, chat, chat_pieces, embedded, refused = \
        await threads.deferToThread(use_the_api)
    assert refused.param == "logprobs" and "does not honour logprobs" in refused.message

    text = completion.choices[0].text
    assert text.strip()  # random weights: gibberish, but greedy and so repeatable
    assert "".join(pieces) == text  # the stream relays the same greedy answer
    assert len([p for p in pieces if p]) >= 2  # ... in several pieces
    answer = chat.choices[0].message.content
    assert answer.strip() and "".join(chat_pieces) == answer
    assert [len(d.embedding) for d in embedded.data] == [32, 32]  # GPT-2's hidden size
    assert embedded.data[0].embedding != embedded.data[1].embedding

    # It was LocalAI's run.sh (its libbackend.sh) and backend.py that served, in its directory.
    supervisor = supervisor_of(worker)
    record = supervisor.find("localai-tiny")
    assert record.program == os.path.join(backend_dir, "run.sh")
    lines = supervisor.logs("localai-tiny")
    assert "Initializing libbackend for transformers" in lines
    assert any(line.startswith("Server started. Listening on: 127.0.0.1:") for line in lines)

    # Where LocalAI's backend breaks on current transformers: with UseTokenizerTemplate it
    # hands the proto Messages to apply_chat_template, which wants dicts (docs/backends.md).
    def tokenizer_template():
        channel = grpc.insecure_channel(record.address)
        try:
            backend_pb2_grpc.BackendStub(channel).Predict(backend_pb2.PredictOptions(
                UseTokenizerTemplate=True, Tokens=2,
                Messages=[backend_pb2.Message(role="user", content="hello")]),
                timeout=60, metadata=[("authorization", f"Bearer {record.grpc_token}")])
        except grpc.RpcError as e:
            return e.code(), e.details()
        return None

    code, details = await threads.deferToThread(tokenizer_template)
    assert code == grpc.StatusCode.UNKNOWN
    assert "Chat messages should be dicts" in details
