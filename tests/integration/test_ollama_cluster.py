"""Ollama's API end to end on a real cluster in one process: a FrontendService (its route
table, listener and key), a real worker (tunnel, supervisor, staging) and the ``echo`` backend
as a subprocess, driven by the official ``ollama`` client.  The first request cold-loads the
model; ``/api/ps`` then lists it from the cluster's ``node_models`` rows."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import threads

from .harness_echo import WEIGHTS, echo_model
from .inference_harness import ADMIN

ollama = pytest.importorskip("ollama")


@pytest_twisted.ensureDeferred
async def test_ollama_client_through_frontend_worker_and_echo_backend(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", echo_model("echo-chat"))
    frontend = await cluster.frontend("replica-ollama")
    await cluster.worker("w-ollama", frontend)
    host = cluster.base_url(frontend)

    def use_the_api():
        client = ollama.Client(host=host, headers={"Authorization": f"Bearer {ADMIN}"},
                               timeout=60)
        before = client.ps()
        listed = client.list()
        chat = client.chat(model="echo-chat:latest", stream=False,
                           messages=[{"role": "user", "content": "héllo wörld again"}])
        streamed = list(client.chat(model="echo-chat", stream=True,
                                    messages=[{"role": "user", "content": "one two three"}]))
        generated = client.generate(model="echo-chat", prompt="a b c d", stream=False,
                                    options={"num_predict": 2})
        embedded = client.embed(model="echo-chat", input=["x", "y z"])
        after = client.ps()
        try:
            ollama.Client(host=host, headers={"Authorization": "Bearer sk-wrong"}).list()
            refused = None
        except ollama.ResponseError as e:
            refused = (e.status_code, e.error)
        return before, listed, chat, streamed, generated, embedded, after, refused

    before, listed, chat, streamed, generated, embedded, after, refused = \
        await threads.deferToThread(use_the_api)
    assert before.models == []
    assert [m.model for m in listed.models] == ["echo-chat:latest"]
    assert chat.message.content == "héllo wörld again" and chat.done_reason == "stop"
    assert chat.eval_count == 3 and chat.prompt_eval_count == 3
    assert "".join(p.message.content for p in streamed) == "one two three"
    assert streamed[-1].done and streamed[-1].eval_count == 3
    assert generated.response == "a b" and generated.done_reason == "length"
    assert [len(v) for v in embedded.embeddings] == [6, 6]
    assert [m.model for m in after.models] == ["echo-chat:latest"]
    assert refused is not None and refused[0] == 401 and "sk-wrong" not in refused[1]
