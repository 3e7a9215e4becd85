"""The OpenAI API end to end on a real cluster in one process: a FrontendService, a real
worker (tunnel, supervisor, staging) and the ``echo`` backend as a subprocess, driven by the
official ``openai`` client.  The first request cold-loads the model through the router."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import threads

from .inference_harness import ADMIN, sha256_hex

openai = pytest.importorskip("openai")

WEIGHTS = b"echo weights " * 100


@pytest_twisted.ensureDeferred
async def test_openai_client_through_frontend_worker_and_echo_backend(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", (
        "name: echo-chat\nbackend: echo\nparameters:\n  model: echo.bin\n  max_tokens: 64\n"
        f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"
        "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"
        "options: ['echo.dim:6']\n"))
    frontend = await cluster.frontend("replica-o")
    await cluster.worker("w-openai", frontend)
    base = cluster.base_url(frontend) + "/v1"

    def use_the_api():
        client = openai.OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=60)
        models = [m.id for m in client.models.list()]
        raw = client.chat.completions.with_raw_response.create(
            model="echo-chat", messages=[{"role": "user", "content": "héllo wörld again"}])
        chat = raw.parse()
        streamed = client.chat.completions.create(
            model="echo-chat", messages=[{"role": "user", "content": "one two three"}],
            stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        completion = client.completions.create(model="echo-chat", prompt="a b c d",
                                               max_tokens=2)
        embedded = client.embeddings.create(model="echo-chat", input=["x", "y z"])
        try:
            openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0).models.list()
            refused = None
        except openai.AuthenticationError as e:
            refused = e.status_code
        return models, raw.headers.get("x-localai-node"), chat, chunks, completion, \
            embedded, refused

    models, node, chat, chunks, completion, embedded, refused = \
        await threads.deferToThread(use_the_api)
    assert models == ["echo-chat"]
    assert node == "w-openai"  # the node by its name (its id stays internal)
    assert chat.choices[0].message.content == "héllo wörld again"
    assert chat.usage.completion_tokens == 3 and chat.usage.prompt_tokens == 3
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 3
    assert completion.choices[0].text == "a b"
    assert completion.choices[0].finish_reason == "length"
    assert [len(d.embedding) for d in embedded.data] == [6, 6]
    assert embedded.data[0].embedding != embedded.data[1].embedding
    assert refused == 401


@pytest_twisted.ensureDeferred
async def test_what_the_backend_cannot_honour_is_a_bad_request_for_the_official_client(
        cluster):
    # An agent or a structured-output caller must learn at once that its tools / JSON mode /
    # logprobs are not honoured, instead of getting plain text it cannot use.
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", (
        "name: echo-chat\nbackend: echo\nparameters:\n  model: echo.bin\n"
        f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"
        "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"))
    frontend = await cluster.frontend("replica-r")
    await cluster.worker("w-refuse", frontend)
    base = cluster.base_url(frontend) + "/v1"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    asks = {
        "tools": dict(tools=[tool]),
        "response_format": dict(response_format={"type": "json_object"}),
        "logprobs": dict(logprobs=True, top_logprobs=2),
    }

    def use_the_api():
        client = openai.OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "weather in Paris?"}]
        refused = {}
        for param, extra in asks.items():
            try:
                client.chat.completions.create(model="echo-chat", messages=messages,
                                               **extra)
                refused[param] = None
            except openai.BadRequestError as e:
                refused[param] = (e.status_code, e.code, e.param, e.message)
        try:
            client.completions.create(model="echo-chat", prompt="a b", logprobs=1)
            refused["completions.logprobs"] = None
        except openai.BadRequestError as e:
            refused["completions.logprobs"] = (e.status_code, e.code, e.param, e.message)
        fine = client.chat.completions.create(
            model="echo-chat", messages=messages, tools=[], tool_choice="none",
            response_format={"type": "text"})
        return refused, fine

    refused, fine = await threads.deferToThread(use_the_api)
    for param in ("tools", "response_format", "logprobs", "completions.logprobs"):
        status, code, where, message = refused[param]
        assert (status, code) == (400, "unsupported_parameter"), refused[param]
        assert where == param.split(".")[-1]
        assert "'echo-chat'" in message and "cannot honour" in message
    assert fine.choices[0].message.content == "weather in Paris?"


@pytest_twisted.ensureDeferred
async def test_tokenize_reaches_the_backends_tokenize_string_through_the_router(cluster):
    import json
    import urllib.request

    from localai_tw.backends.builtin.echo import token_id

    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", (
        "name: echo-chat\nbackend: echo\nparameters:\n  model: echo.bin\n"
        f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"))
    frontend = await cluster.frontend("replica-t")
    await cluster.worker("w-tokenize", frontend)
    url = cluster.base_url(frontend) + "/v1/tokenize"

    def tokenize():
        request = urllib.request.Request(
            url, data=json.dumps({"model": "echo-chat", "content": "héllo wörld"}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.headers.get("x-localai-node"), json.loads(response.read())

    node, answer = await threads.deferToThread(tokenize)
    assert node == "w-tokenize"
    assert answer == {"tokens": [token_id("héllo"), token_id("wörld")]}


@pytest_twisted.ensureDeferred
async def test_rerank_reaches_the_backends_rerank_through_the_router(cluster):
    import json
    import urllib.request

    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", (
        "name: echo-rank\nbackend: echo\nparameters:\n  model: echo.bin\n"
        f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"))
    frontend = await cluster.frontend("replica-r")
    await cluster.worker("w-rerank", frontend)
    url = cluster.base_url(frontend) + "/v1/rerank"
    body = {"model": "echo-rank", "query": "red apple", "top_n": 2,
            "documents": ["green pear", "red apple pie", "a red car"]}

    def rerank():
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.headers.get("x-localai-node"), json.loads(response.read())

    node, answer = await threads.deferToThread(rerank)
    assert node == "w-rerank"
    # echo scores the share of the query's words a document holds
    assert answer["results"] == [
        {"index": 1, "document": {"text": "red apple pie"}, "relevance_score": 1.0},
        {"index": 2, "document": {"text": "a red car"}, "relevance_score": 0.5}]
    assert answer["model"] == "echo-rank"
    assert answer["usage"] == {"prompt_tokens": 10, "total_tokens": 10}
