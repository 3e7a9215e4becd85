"""Use cases as LocalAI decides them, through a real replica and real backend processes: a
config's ``known_usecases`` lists, it never refuses; the backend serving the model answers
what it cannot do, as its own error (docs/models.md, "What a model is for")."""

from __future__ import annotations

import json

import pytest_twisted

from .harness_echo import WEIGHTS, echo_model, post

CHAT_ONLY = echo_model("chat-only") + "known_usecases: [chat]\n"
PAINTER = "name: painter\nbackend: hash-image\nparameters:\n  model: painter\n"


async def serving(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("chat-only.yaml", CHAT_ONLY)
    cluster.write_model("painter.yaml", PAINTER)
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    return cluster.base_url(frontend)


@pytest_twisted.ensureDeferred
async def test_a_chat_only_config_is_served_on_completions_and_embeddings(cluster):
    base = await serving(cluster)
    status, raw = await post(base + "/v1/completions",
                             {"model": "chat-only", "prompt": "one two three"})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["text"] == "one two three"

    status, raw = await post(base + "/v1/embeddings", {"model": "chat-only", "input": "x"})
    assert status == 200, raw
    assert len(json.loads(raw)["data"][0]["embedding"]) == 6  # echo.dim:6, the echo backend's


@pytest_twisted.ensureDeferred
async def test_a_backend_that_cannot_embed_answers_with_its_own_error(cluster):
    base = await serving(cluster)
    status, raw = await post(base + "/v1/embeddings", {"model": "painter", "input": "x"})
    error = json.loads(raw)["error"]
    assert status == 501, raw  # the backend's UNIMPLEMENTED, not a 500 and not a refusal
    assert error["code"] == "not_implemented_by_backend"
    assert "does not implement this call" in error["message"]
    # the model still does what it does
    status, raw = await post(base + "/v1/images/generations",
                             {"model": "painter", "prompt": "a red square", "size": "64x64",
                              "response_format": "b64_json"})
    assert status == 200, raw


#: An echo model whose config claims log probabilities: the echo backend fills none, as
#: LocalAI's own transformers backend does under the built-in's name.
CLAIMS_LOGPROBS = echo_model("claims-logprobs") + "capabilities: {logprobs: true}\n"


@pytest_twisted.ensureDeferred
async def test_logprobs_a_backend_does_not_return_are_a_400_naming_them(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("claims.yaml", CLAIMS_LOGPROBS)
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    base = cluster.base_url(frontend)
    chat = {"model": "claims-logprobs", "logprobs": True,
            "messages": [{"role": "user", "content": "one two"}]}
    for body in (chat, {**chat, "stream": True},
                 {"model": "claims-logprobs", "prompt": "one two", "logprobs": 1}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, raw = await post(base + path, body)
        assert status == 400, (body, raw)  # never an empty list with 200
        error = json.loads(raw)["error"]
        assert error["param"] == "logprobs" and "does not honour logprobs" in error["message"]
    status, raw = await post(base + "/v1/chat/completions", {**chat, "logprobs": False})
    assert status == 200, raw  # the same model without logprobs
