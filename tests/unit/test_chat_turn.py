"""The chat-turn seam (``frontend/api/openai/turn.py``) as a protocol adapter uses it: an
adapter's own events, named SSE events and NDJSON framing, tool calls held back and handed
over once, a failure before the stream started raised to the adapter, after it written by the
adapter's ``failed``.  The adapter here is a test route added to the OpenAI route table."""

from __future__ import annotations

import json

import pytest

from localai_tw.errors import BackendAnswer
from localai_tw.frontend.api.openai import resource
from localai_tw.frontend.api.openai.requests import read_body
from localai_tw.frontend.api.openai.turn import (
    NDJSONStream,
    SSEEvent,
    SSEStream,
    TurnEvents,
    complete_turn,
    prepare_turn,
    stream_turn,
)

from .support_openai import Client, FakeRouter, call, make_site, model_config

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


class _NamedEvents(TurnEvents):
    """Anthropic-like: every payload a named event."""

    def start(self):
        return [SSEEvent("begin", {"n": 0}), SSEEvent("ping", {})]

    def text(self, delta, logprobs):
        return [SSEEvent("text", {"delta": delta})]

    def calls(self, calls):
        return [SSEEvent("call", {"name": c.name, "arguments": json.loads(c.arguments)})
                for c in calls]

    def end(self, reason, logprobs):
        return [SSEEvent("end", {"reason": reason})]

    def done(self, usage):
        return [SSEEvent("usage", usage)]

    def failed(self, error):
        return [SSEEvent("error", {"message": error.message})]


class _LineEvents(_NamedEvents):
    """Ollama-like: one JSON object per line."""

    def start(self):
        return []

    def text(self, delta, logprobs):
        return [{"piece": delta, "done": False}]

    def end(self, reason, logprobs):
        return []

    def done(self, usage):
        return [{"done": True, "eval_count": usage["completion_tokens"]}]


async def _adapter(context, request, exchange):
    body = read_body(request)
    framing = body.raw("framing")
    turn = await prepare_turn(context, body, exchange)
    if framing == "ndjson":
        await stream_turn(context, exchange, turn, _LineEvents(), framing=NDJSONStream)
    elif framing == "sse":
        await stream_turn(context, exchange, turn, _NamedEvents(), framing=SSEStream)
    else:
        said = await complete_turn(context, exchange, turn)
        exchange.send_json(200, {"content": said.content, "reason": said.finish_reason,
                                 "calls": [c.name for c in said.calls],
                                 "usage": said.usage.body()})


@pytest.fixture
def router():
    return FakeRouter([model_config("chatty", template={
        "chat_message": "{{.RoleName}}: {{.Content}}", "chat": "{{.Input}}\nassistant:",
        "function": "Tools:{{range .Functions}} {{.Name}}{{end}}\n{{.Input}}"})])


@pytest.fixture
def site(router, monkeypatch):
    routes = dict(resource.ROUTES)
    routes[(b"turn-test",)] = (b"POST", _adapter)
    monkeypatch.setattr(resource, "ROUTES", routes)
    return make_site(router)


def _body(**more):
    return {"model": "chatty", "messages": [{"role": "user", "content": "hi"}], **more}


def _named_events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        out.append((name_line[7:], json.loads(data_line[6:])))
    return out


def test_named_sse_events_in_order_with_split_characters(site, router):
    router.stream_pieces = [b"caf\xc3", b"\xa9!"]
    response = call(site, "POST", "/v1/turn-test", _body(framing="sse"))
    assert response.status == 200 and response.complete
    assert response.header("content-type") == "text/event-stream; charset=utf-8"
    events = _named_events(response.raw_body)
    assert [name for name, _ in events] == ["begin", "ping", "text", "text", "end", "usage"]
    assert [data["delta"] for name, data in events if name == "text"] == ["caf", "é!"]
    assert events[-1][1]["completion_tokens"] > 0


def test_ndjson_framing_is_one_object_per_line(site, router):
    router.stream_pieces = [b"Hello", b" world"]
    response = call(site, "POST", "/v1/turn-test", _body(framing="ndjson"))
    assert response.status == 200
    assert response.header("content-type") == "application/x-ndjson"
    lines = response.raw_body.decode("utf-8").splitlines()
    objects = [json.loads(line) for line in lines]
    assert objects[:2] == [{"piece": "Hello", "done": False}, {"piece": " world", "done": False}]
    assert objects[-1]["done"] is True and len(objects) == 3


def test_streamed_tool_calls_are_held_back_and_handed_over_once(site, router):
    router.stream_pieces = [b'{"name": "get_weather", ', b'"arguments": {"city": "Oslo"}}']
    response = call(site, "POST", "/v1/turn-test",
                    _body(framing="sse", tools=TOOLS, tool_choice="auto"))
    events = _named_events(response.raw_body)
    names = [name for name, _ in events]
    assert "text" not in names  # the call's markup never reaches the client as text
    assert [data for name, data in events if name == "call"] == [
        {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert ("end", {"reason": "tool_calls"}) in events


def test_non_streamed_answer_is_neutral(site, router):
    router.answer = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    response = call(site, "POST", "/v1/turn-test", _body(tools=TOOLS, tool_choice="auto"))
    assert response.status == 200, response.raw_body
    assert response.json()["calls"] == ["get_weather"]
    assert response.json()["reason"] == "tool_calls"


def test_a_failure_before_the_stream_starts_is_raised_to_the_adapter(site, router):
    response = call(site, "POST", "/v1/turn-test", _body(model="nonesuch", framing="sse"))
    assert response.status == 404  # the adapter's error shape decides; here OpenAI's
    assert response.json()["error"]["code"] == "model_not_found"


def test_a_failure_after_the_stream_started_is_the_adapters_event(site, router):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/turn-test", _body(framing="sse"))
    stream, = router.streams
    stream.start()
    stream.push(b"partial")
    stream.fail(BackendAnswer("node-a", "INTERNAL", "CUDA out of memory"))
    response = client.response()
    assert response.status == 200 and response.complete
    events = _named_events(response.raw_body)
    assert events[2] == ("text", {"delta": "partial"})
    assert events[-1][0] == "error" and "CUDA out of memory" in events[-1][1]["message"]
    assert "end" not in [name for name, _ in events]  # never a finish after a failure
