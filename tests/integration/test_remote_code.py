"""A model's own code runs only where the worker's operator allows it (issue 21 §2): a config
with ``trust_remote_code: true`` for the ``transformers`` backend fails to load on a worker
started without ``--allow-remote-code``, naming the flag; the backend process is told the
worker's decision in its environment, whatever the worker's own environment says.

A real frontend replica, a real PostgreSQL and a real worker spawning the backend process.
Red before the check (``huggingface.py`` ``_load``): the load went on with
``trust_remote_code=True`` (here to the hub lookup of the model id)."""

from __future__ import annotations

import pytest
import pytest_twisted

from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.interfaces import ModelLoadFailed

from .inference_harness import supervisor_of
from .support import process_environ as _environ

CONFIG = ("name: remote\nbackend: transformers\ntrust_remote_code: true\n"
          "parameters:\n  model: someone/model-with-code\n")


@pytest_twisted.ensureDeferred
async def test_remote_code_is_refused_unless_the_worker_allows_it(cluster, monkeypatch):
    monkeypatch.setenv("LOCALAI_ALLOW_REMOTE_CODE", "1")  # inherited: must not decide
    monkeypatch.setenv("LOCALAI_REGISTRATION_TOKEN", "cluster-secret-in-env")
    monkeypatch.setenv("LOCALAI_API_TOKEN", "api-secret-in-env")
    cluster.write_model("remote.yaml", CONFIG)
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    with pytest.raises(ModelLoadFailed, match="--allow-remote-code"):
        await frontend.replica.inference.predict("remote",
                                                 backend_pb2.PredictOptions(Prompt="x"))
    supervisor = supervisor_of(worker)
    assert supervisor.allow_remote_code is False
    # a backend that stays up, spawned the same way: what its environment says
    cluster.write_model("plain.yaml", "name: plain\nbackend: echo\nparameters:\n"
                                      "  model: plain\n")
    await frontend.replica.inference.predict("plain", backend_pb2.PredictOptions(Prompt="x"))
    running = [r for r in supervisor._live.values() if r.pid]
    assert running, "the echo backend is running"
    for record in running:
        environ = _environ(record.pid)
        assert environ["LOCALAI_ALLOW_REMOTE_CODE"] == "0"
        # the worker's own secrets in its environment are not inherited (the backend's own
        # gRPC token is given: tests/integration/test_backend_tokens.py)
        assert "LOCALAI_REGISTRATION_TOKEN" not in environ
        assert "LOCALAI_API_TOKEN" not in environ
        assert "cluster-secret-in-env" not in environ.values()
