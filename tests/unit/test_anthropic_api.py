"""Anthropic's Messages API (``/v1/messages``, ``/messages``) over the shared chat turn: the
request translated (system, multi-turn, tools, tool_use and tool_result blocks, tool_choice,
sampling, stop sequences), the message and its SSE event sequence, Anthropic's error shape
(the listener's early answers included), and the key read from ``x-api-key`` or
``Authorization``."""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from localai_tw.errors import BackendAnswer
from localai_tw.frontend.api.kit import APIKeyGuard

from .support_anthropic import assert_anthropic_error, make_messages_site, named_events
from .support_openai import Client, FakeRouter, call, call_settled, model_config

TOOLS = [{"name": "get_weather", "description": "the weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
HEADERS = {"anthropic-version": "2023-06-01"}


@pytest.fixture
def router():
    template = {"chat_message": "{{.RoleName}}: {{.Content}}", "chat": "{{.Input}}\nassistant:",
                "function": "Tools:{{range .Functions}} {{.Name}}{{end}}\n{{.Input}}"}
    return FakeRouter([model_config("chatty", template=template),
                       model_config("llama", backend="llama-cpp", template=template)])


@pytest.fixture
def site(router):
    return make_messages_site(router)


def _body(**more):
    return {"model": "chatty", "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}], **more}


def _post(site, body, path="/v1/messages", headers=None):
    return call(site, "POST", path, body, {**HEADERS, **(headers or {})})


def test_a_message_answer_with_system_sampling_and_stop_sequences(site, router):
    router.answer = "bonjour à tous"
    response = _post(site, _body(system=[{"type": "text", "text": "Be brief."}],
                                 temperature=0.2, top_p=0.5, top_k=7,
                                 stop_sequences=["\n\nHuman:"]))
    assert response.status == 200, response.raw_body
    answer = response.json()
    assert answer["id"].startswith("msg_") and answer["type"] == "message"
    assert answer["role"] == "assistant" and answer["model"] == "chatty"
    assert answer["content"] == [{"type": "text", "text": "bonjour à tous"}]
    assert answer["stop_reason"] == "end_turn" and answer["stop_sequence"] is None
    assert answer["usage"]["output_tokens"] == 3 and answer["usage"]["input_tokens"] > 0
    options = router.calls[0][2]
    assert options.Prompt == "system: Be brief.\nuser: hi\nassistant:"
    assert options.Tokens == 64 and options.TopK == 7
    assert options.Temperature == pytest.approx(0.2) and options.TopP == pytest.approx(0.5)
    assert list(options.StopPrompts) == ["\n\nHuman:"]


def test_the_unprefixed_path_is_the_same_api(site, router):
    router.answer = "ok"
    response = _post(site, _body(), path="/messages")
    assert response.status == 200 and response.json()["content"][0]["text"] == "ok"


def test_max_tokens_reached_is_max_tokens(site, router):
    router.answer, router.tokens = "one two", 2
    response = _post(site, _body(max_tokens=2))
    assert response.json()["stop_reason"] == "max_tokens"


def test_a_tool_use_then_a_tool_result_turn(site, router):
    router.answer = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    first = _post(site, _body(tools=TOOLS, tool_choice={"type": "auto"}))
    assert first.status == 200, first.raw_body
    answer = first.json()
    assert answer["stop_reason"] == "tool_use"
    use, = [block for block in answer["content"] if block["type"] == "tool_use"]
    assert use["name"] == "get_weather" and use["input"] == {"city": "Oslo"}
    assert use["id"].startswith("toolu_")
    assert json.loads(router.calls[0][2].Tools)[0]["function"]["name"] == "get_weather"

    router.answer = "It is sunny in Oslo."
    second = _post(site, _body(tools=TOOLS, messages=[
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny, 21 C"},
            {"type": "text", "text": "thanks"}]}]))
    assert second.status == 200, second.raw_body
    assert second.json()["content"] == [{"type": "text", "text": "It is sunny in Oslo."}]
    assert second.json()["stop_reason"] == "end_turn"
    prompt = router.calls[1][2].Prompt
    assert "sunny, 21 C" in prompt and prompt.index("sunny, 21 C") < prompt.index("thanks")


def test_tool_choice_maps_onto_the_turns_rules(site, router):
    router.answer = "plain words"
    none = _post(site, _body(tools=TOOLS, tool_choice={"type": "none"}))
    assert none.status == 200 and not router.calls[-1][2].Tools  # tools not shown
    router.answer = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    forced = _post(site, _body(model="llama", tools=TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"}))
    assert forced.status == 200, forced.raw_body
    assert router.calls[-1][2].Grammar  # a forced call is enforced by a grammar
    assert json.loads(router.calls[-1][2].ToolChoice) == {
        "type": "function", "function": {"name": "get_weather"}}
    anything = _post(site, _body(model="llama", tools=TOOLS, tool_choice={"type": "any"}))
    assert anything.status == 200 and json.loads(router.calls[-1][2].ToolChoice) == "required"
    unknown = _post(site, _body(model="llama", tools=TOOLS,
                                tool_choice={"type": "tool", "name": "nope"}))
    assert_anthropic_error(unknown, 400, "invalid_request_error")


def test_the_streamed_event_sequence(site, router):
    router.stream_pieces = [b"caf\xc3", b"\xa9 ok"]
    response = _post(site, _body(stream=True))
    assert response.status == 200 and response.complete
    assert response.header("content-type").startswith("text/event-stream")
    events = named_events(response.raw_body)
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["model"] == "chatty"
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") \
        == "café ok"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 2 and delta["usage"]["input_tokens"] == 3


def test_a_streamed_tool_call_is_a_tool_use_block(site, router):
    router.stream_pieces = [b'{"name": "get_weather", ', b'"arguments": {"city": "Oslo"}}']
    response = _post(site, _body(stream=True, tools=TOOLS))
    events = named_events(response.raw_body)
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    block = events[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["id"].startswith("toolu_") and block["input"] == {}
    delta = events[3][1]["delta"]
    assert delta["type"] == "input_json_delta"
    assert json.loads(delta["partial_json"]) == {"city": "Oslo"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_failure_after_the_stream_started_is_an_error_event(site, router):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/messages", _body(stream=True), HEADERS)
    stream, = router.streams
    stream.start()
    stream.push(b"partial")
    stream.fail(BackendAnswer("node-a", "INTERNAL", "CUDA out of memory"))
    response = client.response()
    assert response.status == 200 and response.complete
    events = named_events(response.raw_body)
    name, data = events[-1]
    assert name == "error" and data["type"] == "error"
    assert data["error"]["type"] == "api_error" and "CUDA" in data["error"]["message"]
    assert "message_stop" not in [n for n, _ in events]


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"container": "c1"}, "container"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/cat.png"}}]}]}, "source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "document"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"stop_sequences": "STOP"}, "stop_sequences"),
    ({"tool_choice": {"type": "any"}}, "tools"),
])
def test_what_cannot_be_honoured_is_refused_naming_it(site, router, body, words):
    request = _body()
    request.update(body)
    if request.get("max_tokens") is None:
        del request["max_tokens"]
    message = assert_anthropic_error(_post(site, request), 400, "invalid_request_error")
    assert words in message
    assert not router.calls


def test_an_image_is_passed_as_base64(site, router):
    router.answer = "a cat"
    response = _post(site, _body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "aGVsbG8="}},
        {"type": "text", "text": "what is it?"}]}]))
    assert response.status == 200, response.raw_body
    assert list(router.calls[0][2].Images) == ["aGVsbG8="]


def test_errors_are_anthropics_shape(site, router):
    assert_anthropic_error(_post(site, _body(model="nonesuch")), 404, "not_found_error")
    assert_anthropic_error(call(site, "POST", "/v1/messages", raw=b"{not json"), 400,
                           "invalid_request_error")
    wrong = call(site, "GET", "/v1/messages")
    assert_anthropic_error(wrong, 405, "invalid_request_error")
    assert wrong.header("allow") == "POST"
    assert_anthropic_error(_post(site, _body(), path="/v1/messages/batches"), 404,
                           "not_found_error")
    router.fail_with = BackendAnswer("node-a", "UNAVAILABLE", "restarting")
    busy = _post(site, _body())
    assert_anthropic_error(busy, 503, "overloaded_error")
    assert busy.header("retry-after") == "1"


def test_a_body_over_the_cap_is_refused_before_it_is_read_in_anthropics_shape(site):
    client = Client(site)
    head = ("POST /v1/messages HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {64 * 1024 * 1024}\r\n\r\n")
    client.channel.dataReceived(head.encode("latin-1"))
    assert_anthropic_error(client.response(), 413, "request_too_large")


@pytest.fixture
def keyed(router):
    return make_messages_site(router, api_keys=APIKeyGuard(["sk-infer"],
                                                           admin_keys=["sk-admin"]))


@pytest.mark.parametrize("headers", [
    {"x-api-key": "sk-infer"}, {"Authorization": "Bearer sk-infer"}, {"x-api-key": "sk-admin"},
])
def test_either_key_header_of_either_scope_is_accepted(keyed, router, headers):
    router.answer = "ok"
    assert _post(keyed, _body(), headers=headers).status == 200
    assert _post(keyed, _body(), path="/messages", headers=headers).status == 200


@pytest.mark.parametrize("headers", [
    {}, {"x-api-key": "sk-wrong"}, {"Authorization": "Bearer sk-wrong"},
    {"x-api-key": "sk-infer", "Authorization": "Bearer sk-infer"},  # two credentials
    {"x-api-key": ""},
])
def test_a_missing_wrong_or_ambiguous_key_is_refused_before_the_body(keyed, router, headers):
    client = Client(keyed)
    head = ["POST /v1/messages HTTP/1.1", "Host: test", "Content-Length: 100000"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    client.channel.dataReceived(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
    response = client.response()  # answered with no body byte sent
    assert_anthropic_error(response, 401, "authentication_error")
    assert not router.calls


def test_the_openai_routes_keep_their_own_shape_and_bearer_rule(keyed, router):
    response = call(keyed, "POST", "/v1/chat/completions",
                    {"model": "chatty", "messages": [{"role": "user", "content": "hi"}]},
                    {"x-api-key": "sk-infer"})
    assert response.status == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_null_fields_of_blocks_a_client_got_back_count_as_absent(site, router):
    router.answer = "fine"
    response = _post(site, _body(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look.", "citations": None},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo"}, "caller": None}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "rain"}],
                                      "is_error": True}]}], tools=TOOLS))
    assert response.status == 200, response.raw_body
    assert "Error: rain" in router.calls[0][2].Prompt


@pytest_twisted.ensureDeferred
async def test_a_big_body_is_decoded_off_the_reactor_and_answered(router, monkeypatch):
    from localai_tw.frontend.api import jsonbody

    decoded = []
    real_decode = jsonbody._decode
    monkeypatch.setattr(jsonbody, "_decode",
                        lambda *a, **k: decoded.append(1) or real_decode(*a, **k))
    router.answer = "big"
    site = make_messages_site(router)
    blocks = [{"type": "text", "text": "a"}] * (jsonbody.INLINE_JSON_VALUES // 2)  # past it
    body = _body(messages=[{"role": "user", "content": blocks}])
    response = await call_settled(site, "POST", "/v1/messages", body, HEADERS)
    assert response.status == 200, response.raw_body[:300]
    assert response.json()["content"][0]["text"] == "big"
    assert decoded  # in the offload thread, not on the reactor


@pytest_twisted.ensureDeferred
async def test_a_body_of_too_many_containers_is_refused_in_anthropics_shape(router):
    from localai_tw.frontend.api import jsonbody

    site = make_messages_site(router)
    raw = b'{"model": "chatty", "max_tokens": 8, "x": ' + \
        b"[" + b"[]," * (jsonbody.MAX_JSON_CONTAINERS + 1) + b"[]]}"
    response = await call_settled(site, "POST", "/v1/messages", raw=raw, headers=HEADERS)
    assert_anthropic_error(response, 413, "request_too_large")
    assert not router.calls


# -- stop sequences ----------------------------------------------------------------------------


def test_an_answer_ended_on_a_stop_sequence_says_which(site, router):
    router.answer, router.stopping_word = "one, two,", "three"
    response = _post(site, _body(stop_sequences=["three", "four"]))
    assert response.status == 200, response.raw_body
    answer = response.json()
    assert answer["stop_reason"] == "stop_sequence" and answer["stop_sequence"] == "three"
    assert answer["content"] == [{"type": "text", "text": "one, two,"}]


def test_a_stop_word_of_the_models_config_is_the_model_ending_its_turn(site, router):
    router.answer, router.stopping_word = "done", "<|im_end|>"  # not the client's
    answer = _post(site, _body(stop_sequences=["three"])).json()
    assert answer["stop_reason"] == "end_turn" and answer["stop_sequence"] is None


def test_a_stop_sequence_in_the_text_is_not_guessed_to_be_the_stop(site, router):
    router.answer = "it ends with three"  # the backend names no stop string
    answer = _post(site, _body(stop_sequences=["three"])).json()
    assert answer["stop_reason"] == "end_turn" and answer["stop_sequence"] is None


def test_a_streamed_answer_ended_on_a_stop_sequence_says_which(site, router):
    router.stream_pieces, router.stopping_word = [b"one, ", b"two,"], "three"
    events = named_events(_post(site, _body(stream=True,
                                            stop_sequences=["three"])).raw_body)
    name, delta = events[-2]
    assert name == "message_delta"
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "three"}


# -- count_tokens ------------------------------------------------------------------------------


def _count(site, body, path="/v1/messages/count_tokens", headers=None):
    return call(site, "POST", path, body, {**HEADERS, **(headers or {})})


def _count_body(**more):
    return {"model": "chatty", "messages": [{"role": "user", "content": "hi there"}], **more}


def test_count_tokens_tokenizes_the_prompt_the_messages_path_renders(site, router):
    router.answer = "ok"
    body = _count_body(system="Be brief.", tools=TOOLS)
    counted = _count(site, body)
    assert counted.status == 200, counted.raw_body
    (verb, name, options), = router.calls
    assert verb == "tokenize" and name == "chatty"  # no generation
    assert options.TokenizeAsEvaluated  # the prompt as a generation evaluates it (BOS too)
    assert counted.json() == {"input_tokens": len(options.Prompt.split())}  # the backend's
    # the same options a message of the same request sends: template, tools shown
    answered = _post(site, {**body, "max_tokens": 8})
    assert options.Prompt == router.calls[-1][2].Prompt
    assert "get_weather" in options.Prompt and "Be brief." in options.Prompt
    assert answered.json()["usage"]["input_tokens"] == counted.json()["input_tokens"]


def test_count_tokens_sends_the_tokenizer_templates_messages(router):
    router.configs["gguf"] = model_config("gguf", backend="llama-cpp",
                                          template={"use_tokenizer_template": True})
    counted = _count(make_messages_site(router), _count_body(model="gguf", system="Be brief."))
    assert counted.status == 200, counted.raw_body
    options = router.calls[-1][2]
    assert options.UseTokenizerTemplate and not options.Prompt
    assert [(m.role, m.content) for m in options.Messages] == [
        ("system", "Be brief."), ("user", "hi there")]


def test_count_tokens_on_the_unprefixed_path(site, router):
    assert _count(site, _count_body(), path="/messages/count_tokens").json() == \
        {"input_tokens": 4}


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": 8}, "max_tokens"),
    ({"stream": True}, "stream"),
    ({"temperature": 0.5}, "temperature"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
    ({"model": ""}, "model"),
])
def test_count_tokens_refuses_what_the_messages_path_refuses(site, router, body, words):
    message = assert_anthropic_error(_count(site, {**_count_body(), **body}), 400,
                                     "invalid_request_error")
    assert words in message
    assert not router.calls


def test_count_tokens_errors_are_anthropics_shape(site, router):
    assert_anthropic_error(_count(site, _count_body(model="nonesuch")), 404, "not_found_error")
    wrong = call(site, "GET", "/v1/messages/count_tokens")
    assert_anthropic_error(wrong, 405, "invalid_request_error")
    router.fail_with = BackendAnswer("node-a", "UNAVAILABLE", "restarting")
    assert_anthropic_error(_count(site, _count_body()), 503, "overloaded_error")
    router.fail_with = BackendAnswer("node-a", "UNIMPLEMENTED", "Method not found!")
    cannot = assert_anthropic_error(_count(site, _count_body()), 501, "api_error")
    assert "does not implement" in cannot


def test_count_tokens_needs_the_key_before_the_body(keyed, router):
    client = Client(keyed)
    head = ["POST /v1/messages/count_tokens HTTP/1.1", "Host: test", "Content-Length: 100000"]
    client.channel.dataReceived(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
    assert_anthropic_error(client.response(), 401, "authentication_error")
    assert _count(keyed, _count_body(), headers={"x-api-key": "sk-infer"}).status == 200
    assert not [c for c in router.calls if c[0] != "tokenize"]


def test_a_count_tokens_body_over_the_cap_is_refused_before_it_is_read(site):
    client = Client(site)
    head = ("POST /v1/messages/count_tokens HTTP/1.1\r\nHost: test\r\n"
            f"Content-Type: application/json\r\nContent-Length: {64 * 1024 * 1024}\r\n\r\n")
    client.channel.dataReceived(head.encode("latin-1"))
    assert_anthropic_error(client.response(), 413, "request_too_large")
