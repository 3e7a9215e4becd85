"""The OpenAI API end to end on a real cluster in one process: a FrontendService, a real
worker (tunnel, supervisor, staging) and the ``echo`` backend as a subprocess, driven by the
official ``openai`` client.  The first request cold-loads the model through the router."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import threads

from .harness_echo import WEIGHTS, echo_model
from .inference_harness import ADMIN, sha256_hex

openai = pytest.importorskip("openai")


@pytest_twisted.ensureDeferred
async def test_openai_client_through_frontend_worker_and_echo_backend(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", echo_model("echo-chat"))
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


@pytest_twisted.ensureDeferred
async def test_detokenize_capabilities_and_unprefixed_routes_through_a_relaying_replica(cluster):
    """The replica that serves these requests does not hold the worker's tunnel: tokenize and
    detokenize reach the echo backend's RPCs across the relay (and read back), capabilities
    and the unprefixed routes are answered with the /v1 key check and body cap."""
    import json
    import urllib.error
    import urllib.request

    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", (
        "name: echo-chat\nbackend: echo\nparameters:\n  model: echo.bin\n"
        f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"
        "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"))
    owner = await cluster.frontend("replica-owner")
    relaying = await cluster.frontend("replica-relaying")
    worker = await cluster.worker("w-detok", owner)
    assert not relaying.replica.tunnels.holds(worker.node_id)
    root = cluster.base_url(relaying)

    def send(method, path, body=None, key=ADMIN, raw=None):
        data = raw if raw is not None else (json.dumps(body).encode() if body else None)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(root + path, data=data, method=method,
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.headers.get("x-localai-node"), \
                    json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, None, json.loads(e.read() or b"null")

    def use_the_api():
        out = {}
        out["tokenize"] = send("POST", "/v1/tokenize",
                               {"model": "echo-chat", "content": "héllo wörld héllo"})
        tokens = out["tokenize"][2]["tokens"]
        out["detokenize"] = send("POST", "/v1/detokenize",
                                 {"model": "echo-chat", "tokens": tokens[::-1]})
        out["unknown-id"] = send("POST", "/v1/detokenize",
                                 {"model": "echo-chat", "tokens": [tokens[0], 49999]})
        out["empty"] = send("POST", "/v1/detokenize", {"model": "echo-chat", "tokens": []})
        out["capabilities"] = send("GET", "/v1/models/capabilities")
        out["capabilities-root"] = send("GET", "/models/capabilities")
        out["models-root"] = send("GET", "/models")
        out["chat-root"] = send("POST", "/chat/completions", {
            "model": "echo-chat", "messages": [{"role": "user", "content": "at the root"}]})
        out["chat-root-no-key"] = send("POST", "/chat/completions", {"model": "echo-chat"},
                                       key=None)
        out["chat-root-200k"] = send("POST", "/chat/completions", {
            "model": "echo-chat", "messages": [{"role": "user", "content": "y" * 200000}]})
        out["announced-9m-no-key"] = head_only("/chat/completions", None)
        out["announced-9m"] = head_only("/embeddings", ADMIN)
        return out

    def head_only(path, key):
        """Headers announcing a 9 MiB body, and no body: the answer comes before it."""
        import socket

        host, port = root.rsplit("/", 1)[-1].split(":")
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                 f"Content-Length: {9 << 20}"] + \
            ([f"Authorization: Bearer {key}"] if key else [])
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return int(head.split()[1]), error["code"]

    out = await threads.deferToThread(use_the_api)
    status, node, answer = out["tokenize"]
    assert status == 200 and node == "w-detok" and len(answer["tokens"]) == 3
    assert out["detokenize"] == (200, "w-detok", {"content": "héllo wörld héllo"})
    status, _, answer = out["unknown-id"]
    assert (status, answer["error"]["code"]) == (400, "backend_refused_request")
    assert "49999" in answer["error"]["message"]
    status, _, answer = out["empty"]
    assert (status, answer["error"]["param"]) == (400, "tokens")
    listing = {"object": "list", "data": [{
        "id": "echo-chat", "object": "model",
        "capabilities": ["chat", "completion", "embeddings", "rerank", "tokenize"],
        "input_modalities": ["text"], "output_modalities": ["text"]}]}
    assert out["capabilities"] == (200, None, listing)
    assert out["capabilities-root"] == (200, None, listing)
    assert out["models-root"][2]["data"][0]["id"] == "echo-chat"
    status, node, answer = out["chat-root"]
    assert (status, node) == (200, "w-detok")
    assert answer["choices"][0]["message"]["content"] == "at the root"
    status, _, answer = out["chat-root-no-key"]
    assert (status, answer["error"]["code"]) == (401, "invalid_api_key")
    assert out["chat-root-200k"][0] == 200  # the 8 MiB cap of /v1, not the 64 KiB default
    # the key is checked when the headers end, before the size: no body byte is read
    assert out["announced-9m-no-key"] == (401, "invalid_api_key")
    assert out["announced-9m"] == (413, "request_too_large")  # the OpenAI shape
    # every backend call crossed the relay: the owner made none
    assert owner.replica.backend_clients.bridges.bridges_of(worker.node_id) == []
