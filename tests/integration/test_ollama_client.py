"""The official ``ollama`` Python client against Ollama's API on a real twisted.web Site on
loopback (the ``/api/<name>`` rows of the route table, guarded and capped by it), with a fake
``IInferenceRouter`` behind it: chat streamed and not (tools too), generate, embed and the
older embeddings, list (tags), show, ps, version, and errors as the client's
``ResponseError``.

The client is synchronous (httpx), so each call runs in a thread while the reactor serves.
Skipped when ``ollama`` is not installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from twisted.internet import reactor, threads

from localai_tw.frontend.api.kit import APIKeyGuard

from tests.unit.support_ollama import make_ollama_site
from tests.unit.support_openai import FakeRouter, model_config

ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")

KEY = "sk-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def router():
    return FakeRouter([
        model_config("chatty", template={"chat_message": "{{.RoleName}}: {{.Content}}",
                                         "chat": "{{.Input}}"},
                     parameters={"temperature": 0.3}, context_size=2048,
                     capabilities={"grammar": True}),
        model_config("embedder", embeddings=True),
        model_config("tooly", template={"use_tokenizer_template": True},
                     capabilities={"tools": True}),
    ], node="node-7")


@pytest_twisted.async_yield_fixture
async def server(router):
    async def loaded():
        return ["chatty"]

    site = make_ollama_site(router, APIKeyGuard([KEY]), loaded=loaded)
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{port.getHost().port}"
    finally:
        await port.stopListening()


def client(host: str, key: str = KEY):
    return ollama.Client(host=host, headers={"Authorization": f"Bearer {key}"}, timeout=10)


def in_thread(fn, *args, **kwargs):
    return threads.deferToThread(fn, *args, **kwargs)


@pytest_twisted.ensureDeferred
async def test_chat_not_streamed_with_latest_tag_and_options(server, router):
    router.answer = "bonjour à tous"

    answer = await in_thread(lambda: client(server).chat(
        model="chatty:latest", messages=[{"role": "user", "content": "hi"}], stream=False,
        options={"temperature": 0.1, "num_predict": 20, "stop": ["\n\n"], "seed": 7},
        keep_alive="5m"))
    assert answer.model == "chatty:latest"
    assert answer.message.role == "assistant" and answer.message.content == "bonjour à tous"
    assert answer.done is True and answer.done_reason == "stop"
    assert answer.eval_count == 3 and answer.prompt_eval_count is not None
    assert answer.total_duration >= 0 and answer.created_at
    verb, name, options = router.calls[0]
    assert name == "chatty" and options.Prompt == "user: hi"
    assert options.Temperature == pytest.approx(0.1) and options.Tokens == 20
    assert list(options.StopPrompts) == ["\n\n"] and options.Seed == 7


@pytest_twisted.ensureDeferred
async def test_chat_streamed_is_ndjson_by_default(server, router):
    router.stream_pieces = [b"\xf0\x9f", b"\x98\x80 ok", b" d\xc3", b"\xa9j\xc3\xa0"]

    parts = await in_thread(lambda: list(client(server).chat(
        model="chatty", messages=[{"role": "user", "content": "hi"}], stream=True)))
    assert "".join(p.message.content for p in parts) == "😀 ok déjà"
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count == 4
    assert options_temperature(router) == pytest.approx(0.3)  # the model's default

    def raw():  # the default (no "stream" field) streams, as application/x-ndjson
        with httpx.stream("POST", server + "/api/chat", headers={
                "Authorization": f"Bearer {KEY}"}, json={
                "model": "chatty", "messages": [{"role": "user", "content": "x"}]}) as r:
            return r.headers["content-type"], [json.loads(line) for line in r.iter_lines()
                                               if line]

    content_type, lines = await in_thread(raw)
    assert content_type.startswith("application/x-ndjson")
    assert len(lines) > 1 and lines[-1]["done"] is True


def options_temperature(router):
    return router.calls[-1][2].Temperature


@pytest_twisted.ensureDeferred
async def test_chat_with_tools_streamed_and_not(server, router):
    router.answer = CALL_TEXT
    router.stream_pieces = [CALL_TEXT.encode()[:20], CALL_TEXT.encode()[20:]]
    ask = [{"role": "user", "content": "weather in Paris?"}]

    def use():
        c = client(server)
        plain = c.chat(model="tooly", messages=ask, tools=[WEATHER], stream=False)
        streamed = list(c.chat(model="tooly", messages=ask, tools=[WEATHER], stream=True))
        follow = c.chat(model="tooly", stream=False, messages=ask + [
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"}])
        return plain, streamed, follow

    router.answer = CALL_TEXT
    plain, streamed, follow = await in_thread(use)
    call = plain.message.tool_calls[0].function
    assert (call.name, dict(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert plain.done_reason == "stop"
    calls = [c for p in streamed for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert streamed[-1].done is True
    sent = router.calls[-1][2].Messages
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    assert json.loads(sent[1].tool_calls)[0]["function"]["name"] == "get_weather"
    assert sent[2].content == "sunny" and sent[2].name == "get_weather"
    assert follow.done is True


@pytest_twisted.ensureDeferred
async def test_generate_streamed_and_not_with_system_and_format(server, router):
    router.answer = '{"a": 1}'

    def use():
        c = client(server)
        plain = c.generate(model="chatty", prompt="why?", system="be brief", format="json",
                           stream=False)
        streamed = list(c.generate(model="chatty", prompt="why?", stream=True))
        return plain, streamed

    plain, streamed = await in_thread(use)
    assert plain.response == '{"a": 1}' and plain.done and plain.done_reason == "stop"
    assert router.calls[0][2].Prompt == "system: be brief\nuser: why?"
    assert router.calls[0][2].Grammar  # format: json is the turn's JSON grammar
    assert "".join(p.response for p in streamed) == "Hello world"
    assert streamed[-1].done and streamed[-1].eval_count is not None


@pytest_twisted.ensureDeferred
async def test_embed_and_embeddings(server, router):
    def use():
        c = client(server)
        return (c.embed(model="embedder", input=["one", "two words"]),
                c.embeddings(model="embedder:latest", prompt="one"))

    embed, single = await in_thread(use)
    assert len(embed.embeddings) == 2 and len(embed.embeddings[0]) == 4
    assert sum(x * x for x in embed.embeddings[0]) == pytest.approx(1.0)  # L2-normalised
    assert embed.prompt_eval_count == 3
    assert len(single.embedding) == 4
    assert [o.Embeddings for verb, _, o in router.calls] == ["one", "two words", "one"]


@pytest_twisted.ensureDeferred
async def test_list_show_ps_and_version(server):
    def use():
        c = client(server)
        version = httpx.get(server + "/api/version",
                            headers={"Authorization": f"Bearer {KEY}"}).json()
        return c.list(), c.show("chatty:latest"), c.ps(), version

    listing, shown, running, version = await in_thread(use)
    assert [m.model for m in listing.models] == ["chatty:latest", "embedder:latest",
                                                 "tooly:latest"]
    assert listing.models[0].details.family == "echo"
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert "temperature 0.3" in shown.parameters
    assert shown.modelinfo["general.context_length"] == 2048
    assert [m.model for m in running.models] == ["chatty:latest"]
    assert version["version"]


@pytest_twisted.ensureDeferred
async def test_errors_are_ollama_shaped(server, router):
    def use():
        outcomes = {}
        for name, call in {
            "missing": lambda: client(server).chat(
                model="nope", messages=[{"role": "user", "content": "x"}], stream=False),
            "missing-streamed": lambda: list(client(server).chat(
                model="nope", messages=[{"role": "user", "content": "x"}])),
            "bad-key": lambda: client(server, "sk-wrong").list(),
            "num_ctx": lambda: client(server).chat(
                model="chatty", messages=[{"role": "user", "content": "x"}], stream=False,
                options={"num_ctx": 4096}),
            "think": lambda: client(server).generate(model="chatty", prompt="x", think=True,
                                                     stream=False),
            "show-missing": lambda: client(server).show("nope"),
        }.items():
            try:
                call()
            except ollama.ResponseError as e:
                outcomes[name] = (e.status_code, e.error)
        return outcomes

    outcomes = await in_thread(use)
    assert outcomes["missing"][0] == 404 and "nope" in outcomes["missing"][1]
    assert outcomes["missing-streamed"][0] == 404
    assert outcomes["bad-key"][0] == 401
    assert outcomes["num_ctx"][0] == 400 and "options.num_ctx" in outcomes["num_ctx"][1]
    assert outcomes["think"][0] == 400 and "think" in outcomes["think"][1]
    assert outcomes["show-missing"][0] == 404
    assert router.calls == []
