"""Cold load through the owner replica with a real worker and the echo backend: backend.start,
file staging with sha256, LoadModel, Predict / PredictStream / Embedding / TokenizeString, and
the node_models rows with the right states."""

from __future__ import annotations

import os

import pytest
import pytest_twisted
from twisted.internet import defer, task

from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.interfaces import (
    IInferenceRouter,
    ModelLoadFailed,
    ModelNotFound,
    NoNodeAvailable,
)

from .inference_harness import sha256_hex

WEIGHTS = b"tiny weights " * 1000


def tiny_model(digest: str, name: str = "tiny", extra: str = "") -> str:
    return (f"name: {name}\nbackend: echo\nparameters:\n  model: tiny.bin\n"
            f"files:\n  - path: tiny.bin\n    sha256: '{digest}'\n"
            f"context_size: 128\noptions: ['echo.dim:4']\n{extra}")


@pytest_twisted.ensureDeferred
async def test_cold_load_stages_loads_and_serves_on_the_owner(cluster):
    cluster.write_file("tiny.bin", WEIGHTS)
    cluster.write_model("tiny.yaml", tiny_model(sha256_hex(WEIGHTS)))
    frontend = await cluster.frontend("replica-a")
    router = frontend.replica.inference
    assert IInferenceRouter.providedBy(router)
    assert [m.name for m in router.models()] == ["tiny"]
    worker = await cluster.worker("w1", frontend)

    # the states the row passes through, sampled while the load runs
    seen_states = set()
    sampling = task.LoopingCall(lambda: defer.ensureDeferred(cluster.rows("tiny")).addCallback(
        lambda rows: seen_states.update(r[2] for r in rows)))
    sampling.start(0.01)
    served = await router.predict("tiny", backend_pb2.PredictOptions(Prompt="hello there world"))
    sampling.stop()
    assert served.served_by == worker.node_id
    assert served.value.message == b"hello there world"

    rows = await cluster.rows("tiny")
    assert len(rows) == 1
    node_id, _, state, address, loaded_model = rows[0]
    assert (node_id, state) == (worker.node_id, "loaded")
    assert address.startswith("127.0.0.1:")
    # the model was loaded from the staged worker-side path (key models/tiny/tiny.bin)
    assert loaded_model.startswith(worker.data_dir) and loaded_model.endswith("/tiny/tiny.bin")
    with open(loaded_model, "rb") as f:
        assert f.read() == WEIGHTS
    assert seen_states <= {"staging", "loading", "loaded"}

    # the warm path: no second load
    replies = []
    done = await router.predict_stream("tiny", backend_pb2.PredictOptions(Prompt="a b c"),
                                       replies.append)
    assert done.served_by == worker.node_id and done.value is None
    assert b"".join(r.message for r in replies).split() == [b"a", b"b", b"c"]
    embedded = await router.embed("tiny", backend_pb2.PredictOptions(Embeddings="x"))
    assert len(embedded.value.embeddings) == 4
    tokens = await router.tokenize("tiny", backend_pb2.PredictOptions(Prompt="one two"))
    assert tokens.value.length == 2
    assert len(await cluster.rows("tiny")) == 1
    # no load lock left behind
    db = frontend.database_service.database
    assert await db.runQuery("SELECT * FROM model_load_jobs") == []


@pytest_twisted.ensureDeferred
async def test_unknown_model_no_node_and_failed_load(cluster):
    cluster.write_model("bad.yaml", "name: bad\nbackend: echo\noptions: ['echo.fail_load:no "
                                    "weights here']\n")
    frontend = await cluster.frontend("replica-a")
    router = frontend.replica.inference
    with pytest.raises(ModelNotFound):
        await router.predict("nope", backend_pb2.PredictOptions())
    with pytest.raises(NoNodeAvailable, match="no healthy backend node"):
        await router.predict("bad", backend_pb2.PredictOptions(Prompt="x"))
    worker = await cluster.worker("w1", frontend)
    with pytest.raises(ModelLoadFailed, match="no weights here") as caught:
        await router.predict("bad", backend_pb2.PredictOptions(Prompt="x"))
    assert caught.value.node_id == worker.node_id
    assert await cluster.rows("bad") == []  # a failed load leaves no row
    assert await frontend.database_service.database.runQuery(
        "SELECT * FROM model_load_jobs") == []


@pytest_twisted.ensureDeferred
async def test_a_file_that_does_not_match_its_sha256_is_not_staged(cluster):
    from localai_tw.frontend.inference.coldload import ModelFileMismatch

    cluster.write_file("tiny.bin", WEIGHTS)
    cluster.write_model("tiny.yaml", tiny_model("00" * 32))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    with pytest.raises(ModelFileMismatch, match="the config says 0000"):
        await frontend.replica.inference.predict("tiny", backend_pb2.PredictOptions(Prompt="x"))
    assert await cluster.rows("tiny") == []


@pytest_twisted.ensureDeferred
async def test_a_model_file_that_is_a_symlink_out_of_the_models_dir_is_not_staged(
        cluster, tmp_path):
    """issue 9 §6: ``files: [{path: tiny.bin}]`` where tiny.bin links to a file outside."""
    import os

    from localai_tw.frontend.inference.coldload import ModelFileMismatch

    outside = tmp_path / "outside-secret.bin"
    outside.write_bytes(WEIGHTS)
    os.symlink(outside, os.path.join(cluster.models_dir, "tiny.bin"))
    cluster.write_model("tiny.yaml", tiny_model(sha256_hex(WEIGHTS)))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    with pytest.raises(ModelFileMismatch, match="resolves outside the models directory"):
        await frontend.replica.inference.predict("tiny", backend_pb2.PredictOptions(Prompt="x"))
    assert await cluster.rows("tiny") == []


@pytest_twisted.ensureDeferred
async def test_a_config_with_localai_keys_loads_and_serves(cluster):
    # LocalAI's keys reach the real LoadModel (f16, mmap, threads, gpu_layers, type); one it
    # does not act on (function) and one nobody knows are warnings, not a skipped model.
    cluster.write_file("tiny.bin", WEIGHTS)
    cluster.write_model("tiny.yaml", tiny_model(sha256_hex(WEIGHTS), extra=(
        "f16: true\nmmap: true\nthreads: 2\ngpu_layers: 0\ntype: EchoModel\n"
        "stopwords: ['</s>']\nfunction: {grammar: {disable: true}}\nnot_a_localai_key: 1\n")))
    frontend = await cluster.frontend("replica-a")
    router = frontend.replica.inference
    [model] = router.models()
    assert model.model_options["Type"] == "EchoModel"
    worker = await cluster.worker("w1", frontend)
    served = await router.predict("tiny", backend_pb2.PredictOptions(Prompt="still served"))
    assert (served.served_by, served.value.message) == (worker.node_id, b"still served")


@pytest_twisted.ensureDeferred
async def test_one_file_named_by_five_models_crosses_the_tunnel_once(cluster):
    """issue 26 §4: five configs naming one file leave one copy on the worker, and the file
    is uploaded once: the other four keys are linked from the worker's content store."""
    from twisted.logger import globalLogPublisher

    cluster.write_file("tiny.bin", WEIGHTS)
    names = [f"tiny{i}" for i in range(5)]
    for name in names:
        cluster.write_model(f"{name}.yaml", tiny_model(sha256_hex(WEIGHTS), name=name))
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        for name in names:
            served = await frontend.replica.inference.predict(
                name, backend_pb2.PredictOptions(Prompt="hi"))
            assert served.served_by == worker.node_id
    finally:
        globalLogPublisher.removeObserver(events.append)
    staged = [(await cluster.rows(name))[0][4] for name in names]
    assert len(set(staged)) == 5  # five names ...
    first = staged[0]
    assert all(os.path.samefile(first, other) for other in staged[1:])  # ... one file
    assert os.stat(first).st_nlink == 6  # and the worker's content store
    uploads = [e for e in events if e.get("log_format", "").startswith("staged {key} (")]
    links = [e for e in events if "nothing transferred" in e.get("log_format", "")]
    assert (len(uploads), len(links)) == (1, 4)
