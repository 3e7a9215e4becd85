"""The Responses API without a database: requests read into chat requests
(``response_input.py``), refusals in OpenAI's shape, the answer and stream shapes over a
``FakeRouter`` (``store: false``), routes and methods.  Storage, ``previous_response_id``
across replicas, background runs and the official client: tests/integration/
test_openai_responses.py."""

from __future__ import annotations

import json

import pytest

from localai_tw.frontend.api.openai.errors import OpenAIError
from localai_tw.frontend.api.openai.requests import Fields
from localai_tw.frontend.api.openai.response_input import continue_from, read_request

from .support_openai import Client, FakeRouter, assert_error, call, make_site, model_config


@pytest.fixture
def router():
    return FakeRouter([model_config(
        "chatty", template={"chat_message": "{{.RoleName}}: {{.Content}}",
                            "chat": "{{.Input}}"})])


@pytest.fixture
def site(router):
    return make_site(router)


def ask(**more):
    body = {"model": "chatty", "input": "hi there", "store": False}
    body.update(more)
    return body


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        out.append((payload["type"], payload))
    return out


# -- the request, read ---------------------------------------------------------------------------


def test_items_become_chat_messages():
    request = read_request(Fields({
        "model": "m", "instructions": "be brief", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "calling"}]},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "x", "strict": True,
                            "schema": {"type": "object"}}},
        "max_output_tokens": 12, "temperature": 0.5}))
    chat = request.chat
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}
    assert chat["max_tokens"] == 12 and chat["temperature"] == 0.5
    # the instructions are not part of the conversation a later response continues
    assert request.messages == chat["messages"][1:]
    assert [item["type"] for item in request.input_items] == [
        "message", "message", "function_call", "function_call", "function_call_output"]
    assert all(item["id"] for item in request.input_items)


def test_a_continuation_puts_the_stored_conversation_after_the_new_instructions():
    request = read_request(Fields({"model": "m", "input": "again", "instructions": "new"}))
    continue_from(request, [{"role": "user", "content": "before"},
                            {"role": "assistant", "content": "answer"}])
    assert [m["content"] for m in request.chat["messages"]] == [
        "new", "before", "answer", "again"]


@pytest.mark.parametrize("field,value,param,code", [
    ("bogus", 1, "bogus", "unknown_parameter"),
    ("reasoning", {"effort": "low"}, "reasoning", "unsupported_parameter"),
    ("include", ["message.output_text.logprobs"], "include", "unsupported_parameter"),
    ("truncation", "auto", "truncation", "unsupported_parameter"),
    ("service_tier", "flex", "service_tier", "unsupported_parameter"),
    ("top_logprobs", 3, "top_logprobs", "unsupported_parameter"),
    ("prompt", {"id": "p"}, "prompt", "unsupported_parameter"),
    ("conversation", "c", "conversation", "unsupported_parameter"),
    ("max_tool_calls", 2, "max_tool_calls", "unsupported_parameter"),
    ("tools", [{"type": "web_search"}], "tools[0].type", "unsupported_parameter"),
    ("tool_choice", {"type": "web_search"}, "tool_choice", "unsupported_parameter"),
    ("input", [{"type": "item_reference", "id": "x"}], "input[0].type",
     "unsupported_parameter"),
    ("input", [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
     "input[0].content[0].type", "unsupported_parameter"),
    ("input", [], "input", "invalid_value"),
    ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format.schema",
     "missing_required_parameter"),
    ("text", {"verbosity": "low"}, "text.verbosity", "unsupported_parameter"),
    ("metadata", {str(i): "v" for i in range(17)}, "metadata", "invalid_value"),
    ("background", True, "background", "invalid_value"),  # with store: false
    ("previous_response_id", "not an id!", "previous_response_id", "invalid_value"),
    ("max_output_tokens", 0, "max_output_tokens", "invalid_value"),
])
def test_what_is_not_honoured_is_refused_in_openais_shape(site, router, field, value, param,
                                                           code):
    response = call(site, "POST", "/v1/responses", ask(**{field: value}))
    assert_error(response, 400, "invalid_request_error", param=param, code=code)
    assert router.calls == []  # refused before any backend call


def test_stored_responses_need_a_store(site, router):
    body = ask()
    del body["store"]
    assert_error(call(site, "POST", "/v1/responses", body), 400, param="store",
                 code="unsupported_parameter")
    assert_error(call(site, "POST", "/v1/responses", ask(previous_response_id="resp_1")), 400,
                 param="previous_response_id", code="unsupported_parameter")


# -- the answer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/responses", "/responses"])
def test_an_answer_not_stored(site, router, path):
    response = call(site, "POST", path, ask(instructions="short", metadata={"k": "v"}))
    assert response.status == 200, response.raw_body
    body = response.json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["id"].startswith("resp_") and body["created_at"] == 1700000000
    assert body["model"] == "chatty" and body["store"] is False
    assert body["instructions"] == "short" and body["metadata"] == {"k": "v"}
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "output_text"
    assert message["content"][0]["text"] == "system: short\nuser: hi there"
    assert body["usage"]["output_tokens"] == body["usage"]["total_tokens"] - \
        body["usage"]["input_tokens"]
    assert router.calls[0][2].Prompt == "system: short\nuser: hi there"


def test_max_output_tokens_reached_is_incomplete(site, router):
    router.answer = "one two three"
    router.tokens = 5
    body = call(site, "POST", "/v1/responses", ask(max_output_tokens=5)).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert router.calls[0][2].Tokens == 5


def test_the_stream_is_the_typed_event_sequence(site, router):
    router.stream_pieces = [b"caf\xc3", b"\xa9 ", b"ok"]
    response = call(site, "POST", "/v1/responses", ask(stream=True))
    assert response.status == 200 and response.complete
    events = sse_events(response.raw_body)
    kinds = [kind for kind, _ in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    # complete characters only
    assert [data["delta"] for kind, data in events if kind.endswith(".delta")] == [
        "caf", "é ", "ok"]
    final = events[-1][1]["response"]
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "café ok"
    assert final["usage"]["output_tokens"] == 3
    item_ids = {data.get("item_id") or data.get("item", {}).get("id")
                for kind, data in events[2:-1]}
    assert len(item_ids) == 1


def test_a_failure_after_the_stream_started_is_response_failed(site, router):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/responses", ask(stream=True))
    [stream] = router.streams
    stream.start()
    stream.push(b"partial ")
    stream.fail(RuntimeError("the backend broke"))
    events = sse_events(client.response().raw_body)
    kinds = [kind for kind, _ in events]
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-1][1]["response"]["status"] == "failed"
    assert events[-1][1]["response"]["error"]["message"]
    assert "traceback" not in client.response().raw_body.decode().lower()


# -- routes and methods ---------------------------------------------------------------------------


def test_stored_routes_without_a_store_and_wrong_methods(site):
    assert_error(call(site, "GET", "/v1/responses/resp_1"), 404, code="not_found")
    assert_error(call(site, "GET", "/v1/responses/" + "a" * 200), 404, code="not_found")
    assert_error(call(site, "GET", "/v1/responses/r%C3%A9sp"), 404, code="not_found")
    assert_error(call(site, "GET", "/v1/responses/resp_1/input_items"), 404, code="not_found")
    assert_error(call(site, "PUT", "/v1/responses/resp_1"), 405, code="method_not_allowed")
    assert_error(call(site, "GET", "/v1/responses/resp_1/cancel"), 405,
                 code="method_not_allowed")
    assert_error(call(site, "GET", "/v1/responses/resp_1/other"), 404, code="unknown_url")
    assert_error(call(site, "GET", "/v1/responses"), 405, code="method_not_allowed")
    # LocalAI's unprefixed twins answer the same
    assert_error(call(site, "GET", "/responses/resp_1"), 404, code="not_found")
    assert_error(call(site, "GET", "/responses/resp_1/cancel"), 405, code="method_not_allowed")


def test_an_openai_error_is_what_the_module_raises():
    with pytest.raises(OpenAIError) as raised:
        read_request(Fields({"model": "m"}))
    assert raised.value.param == "input"


# -- background runs -----------------------------------------------------------------------------


def test_a_cancelled_run_fails_with_cancelled_error_whatever_its_work_raises():
    """A txpostgres query cancelled mid-way raises from ``cancel()`` (``_CancelInProgress``)
    and ends the work with that error inside the cancel: the run still reads as cancelled, so
    the claim consumer treats it as stopped, not as a failed response."""
    from twisted.internet import defer

    from localai_tw.frontend.api.openai.response_store import BackgroundRuns

    class Refuses(Exception):
        pass

    def refuse(_):
        raise Refuses()

    query = defer.Deferred(refuse)

    async def work():
        return await query

    runs = BackgroundRuns()
    outcome = runs.run("resp_1", work)
    assert runs.running() == ["resp_1"]
    outcome.cancel()
    failures = []
    outcome.addErrback(failures.append)
    assert failures[0].check(defer.CancelledError)
    assert runs.running() == [] and not runs.was_cancelled("resp_1")

    finished = runs.run("resp_2", lambda: defer.ensureDeferred(_value()))
    assert finished.result == "done"


async def _value():
    return "done"
