"""Tools, structured output and log probabilities on /v1/chat/completions and /v1/completions:
tool calls read out of answers (every format LocalAI's configs name; stream and non-stream),
tools shown to the model through the templates, grammars sent only to backends that honour
them (and what each grammar accepts), structured answers validated, and every request a model
cannot honour refused with a 400 before any backend is called.  The router is the fake of
``support_openai`` (answers are scripted)."""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from localai_tw.backends import backend_pb2
from localai_tw.localai.model_config import parse_model_config
from localai_tw.frontend.api.openai import constraints
from localai_tw.localai.toolcalls import (
    FunctionConfig,
    FunctionConfigError,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
    split_no_action,
)

from .gbnf_matcher import Grammar
from .support_openai import (
    FakeRouter,
    assert_error,
    call,
    call_settled,
    make_site,
    model_config,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = ["get_weather", "get_time"]
FUNCTION_TEMPLATE = ("Tools:{{range .Functions}} {{.Name}}({{toJson .Parameters}}){{end}}\n"
                     "{{.Input}}")


# -- reading calls out of text --------------------------------------------------------------------


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "",
     [("get_weather", '{"city":"Paris"}')]),
    ('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
     '"arguments": {}}]', "", [("get_weather", '{"city":"Oslo"}'), ("get_time", "{}")]),
    ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
     '</tool_call>', "I will look.", [("get_weather", '{"city":"Rome"}')]),
    ('<tool_call>{"name":"get_time","arguments":{}}</tool_call><tool_call>{"name":'
     '"get_weather","arguments":{"city":"Bern"}}</tool_call>', "",
     [("get_time", "{}"), ("get_weather", '{"city":"Bern"}')]),
    ('<function=get_weather>{"city": "Lima"}</function>', "",
     [("get_weather", '{"city": "Lima"}')]),
    ('{"name": "get_weather", "parameters": {"city": "Kyiv"}}', "",
     [("get_weather", '{"city":"Kyiv"}')]),
    ('{"type": "function", "function": {"name": "get_time", "arguments": "{}"}}', "",
     [("get_time", "{}")]),
    ('{"function": "get_time", "arguments": {}}', "", [("get_time", "{}")]),
    ('{"name": "Bob", "arguments": 3}', '{"name": "Bob", "arguments": 3}', []),  # no such tool
    ("The weather is fine.", "The weather is fine.", []),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
])
def test_calls_are_read_from_the_common_formats(text, content, calls):
    parsed = parse_tool_calls(text, FunctionConfig(), NAMES)
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert parsed.content == content
    assert all(c.id.startswith("call_") for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


def test_response_regex_names_the_function_and_arguments():
    config = FunctionConfig.from_yaml({"response_regex": [
        r"<<(?P<name>\w+)>>\s*(?P<arguments>\{.*?\})"]})
    parsed = parse_tool_calls('ok <<get_weather>> {"city": "Nice"} and <<nope>> {}',
                              config, NAMES)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather",
                                                              '{"city": "Nice"}')]


def test_json_regex_match_and_custom_keys_and_replacements():
    config = FunctionConfig.from_yaml({
        "json_regex_match": [r"(?s)<calls>(.*?)</calls>"],
        "function_name_key": "function", "function_arguments_key": "args",
        "replace_function_results": [{"key": "'", "value": '"'}],
        "replace_llm_results": [{"key": r"^\s*Answer:\s*", "value": ""}]})
    parsed = parse_tool_calls("<calls>{'function': 'get_time', 'args': {'tz': 'UTC'}}"
                              "</calls>", config, NAMES)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_time", '{"tz":"UTC"}')]


@pytest.mark.parametrize("raw, field", [
    ({"response_regex": ["(unclosed"]}, "function.response_regex[0]"),
    ({"json_regex_match": 3}, "function.json_regex_match"),
    ({"replace_function_results": [{"key": "a", "value": 1}]},
     "function.replace_function_results[0].value"),
    ({"grammar": {"disable": "yes"}}, "function.grammar.disable"),
    ("text", "function"),
])
def test_a_bad_function_section_names_the_key(raw, field):
    with pytest.raises(FunctionConfigError) as caught:
        FunctionConfig.from_yaml(raw)
    assert caught.value.field == field


def test_a_bad_function_section_refuses_the_model_file():
    with pytest.raises(ValueError, match=r"m.yaml: function.response_regex\[0\]"):
        parse_model_config({"name": "m", "backend": "echo",
                            "function": {"response_regex": ["(?P<x"]}}, "m.yaml")


def stream_through(pieces, config=FunctionConfig()):
    splitter = ToolCallStream(config, NAMES)
    sent = "".join(splitter.feed(p) for p in pieces)
    rest, calls = splitter.end()
    return sent, rest, [(c.name, c.arguments) for c in calls]


def test_a_stream_of_plain_text_is_sent_as_it_comes():
    splitter = ToolCallStream(FunctionConfig(), NAMES)
    assert splitter.feed("Hello") == "Hello"
    assert splitter.feed(" world") == " world"
    assert splitter.end() == ("", ())


def test_a_stream_that_opens_json_is_held_and_read_as_calls():
    sent, rest, calls = stream_through(['{"name": "get_', 'weather", "arguments": ',
                                        '{"city": "Paris"}}'])
    assert (sent, rest) == ("", "")
    assert calls == [("get_weather", '{"city":"Paris"}')]


def test_a_stream_holds_a_possible_tag_and_streams_the_text_before_it():
    splitter = ToolCallStream(FunctionConfig(), NAMES)
    assert splitter.feed("Let me check.<tool") == "Let me check."
    assert splitter.feed('_call>{"name": "get_time", "arguments": {}}') == ""
    rest, calls = splitter.end()
    assert rest == "" and [c.name for c in calls] == ["get_time"]


def test_held_text_that_is_no_call_is_sent_at_the_end():
    assert stream_through(["[1, 2", ", 3]"]) == ("", "[1, 2, 3]", [])
    assert stream_through(["a <tool", "box> b"]) == ("a <toolbox> b", "", [])


def test_a_json_call_after_prose_is_found_at_the_end_as_without_streaming():
    sent, rest, calls = stream_through(["Sure. ", '{"name": "get_time", ', '"arguments": {}}',
                                        " Done."])
    assert sent == 'Sure. {"name": "get_time", "arguments": {}} Done.'  # already streamed
    assert (rest, calls) == ("", [("get_time", "{}")])


def test_with_response_regex_the_whole_stream_is_held():
    config = FunctionConfig.from_yaml({"response_regex": [r"CALL (?P<name>\w+)"]})
    assert stream_through(["Sure. ", "CALL get_time"], config) == ("", "Sure.",
                                                                   [("get_time", "{}")])


# -- the API --------------------------------------------------------------------------------------


@pytest.fixture
def router():
    return FakeRouter([
        model_config("tooly", template={"chat": "{{.Input}}", "function": FUNCTION_TEMPLATE,
                                        "chat_message": "{{.RoleName}}: {{.Content}}"}),
        model_config("plain", template={"chat": "{{.Input}}"}),
        model_config("llama", backend="llama-cpp",
                     template={"chat": "{{.Input}}", "function": FUNCTION_TEMPLATE}),
        model_config("llama-parallel", backend="llama-cpp", function={
            "grammar": {"parallel_calls": True, "prefix": "<tool_call>"}},
            template={"chat": "{{.Input}}", "function": FUNCTION_TEMPLATE}),
        model_config("llama-nogrammar", backend="llama-cpp",
                     function={"grammar": {"disable": True}},
                     template={"use_tokenizer_template": True}),
        model_config("hf", backend="transformers", template={"use_tokenizer_template": True}),
        model_config("echo-hf", template={"use_tokenizer_template": True},
                     capabilities={"tools": True, "logprobs": True}),
    ])


@pytest.fixture
def site(router):
    return make_site(router)


def chat(model="tooly", **more):
    body = {"model": model, "messages": [{"role": "user", "content": "weather in Paris?"}]}
    body.update(more)
    return body


def test_tools_reach_the_prompt_through_the_function_template(site, router):
    router.answer = "no call here"
    response = call(site, "POST", "/v1/chat/completions", chat(tools=[WEATHER, TIME]))
    assert response.status == 200, response.raw_body
    [(_, _, options)] = router.calls
    assert options.Prompt.startswith('Tools: get_weather({"additionalProperties":false,')
    assert " get_time(" in options.Prompt and options.Prompt.endswith("user: weather in Paris?")
    assert json.loads(options.Tools)[0]["function"]["name"] == "get_weather"
    assert json.loads(options.ToolChoice) == "auto"
    assert options.Grammar == ""  # auto is not constrained
    choice = response.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "no call here"}
    assert choice["finish_reason"] == "stop"


def test_without_tools_the_chat_template_renders(site, router):
    call(site, "POST", "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="none"))
    [(_, _, options)] = router.calls
    assert options.Prompt == "user: weather in Paris?"  # none: not shown, not parsed


def test_a_call_in_the_answer_becomes_tool_calls(site, router):
    router.answer = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                     '</tool_call>')
    body = call(site, "POST", "/v1/chat/completions", chat(tools=[WEATHER])).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    [tool_call] = message["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}


def test_legacy_functions_are_tools(site, router):
    router.answer = '{"name": "get_time", "arguments": {}}'
    body = call(site, "POST", "/v1/chat/completions",
                chat(functions=[TIME["function"]], function_call="auto")).json()
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_tool_calls_stream_as_openai_deltas(site, router):
    router.stream_pieces = [b"Checking. ", b"<tool_call>", b'{"name": "get_weather", ',
                            b'"arguments": {"city": "Paris"}}', b"</tool_call>"]
    events = call(site, "POST", "/v1/chat/completions",
                  chat(tools=[WEATHER, TIME], stream=True)).events()
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking. "
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city":"Paris"}'}}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_streamed_answer_without_a_call_is_plain_content(site, router):
    router.stream_pieces = [b"It is ", b"sunny."]
    events = call(site, "POST", "/v1/chat/completions",
                  chat(tools=[WEATHER], stream=True)).events()
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def delta(content="", calls=()):
    return backend_pb2.ChatDelta(content=content, tool_calls=[
        backend_pb2.ToolCallDelta(index=i, id=c_id, name=name, arguments=args)
        for i, c_id, name, args in calls])


def test_calls_a_backend_parsed_itself_win_over_the_text(site, router):
    router.answer = "<|tool|>get_weather Paris<|/tool|>"  # a format this frontend cannot read
    router.reply_deltas = [delta("Looking."), delta(calls=[(0, "b1", "get_weather", '{"ci')]),
                           delta(calls=[(0, "", "", 'ty": "Paris"}')]),
                           delta(calls=[(1, "b2", "nope", "{}")])]
    choice = call(site, "POST", "/v1/chat/completions",
                  chat(tools=[WEATHER])).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Looking."
    assert choice["message"]["tool_calls"] == [{
        "id": "b1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


def test_streamed_calls_a_backend_parsed_itself_are_sent_as_tool_calls(site, router):
    router.stream_pieces = [b"<|tool|>get_weather", b" Paris<|/tool|>"]
    router.stream_deltas = [[], [delta(calls=[(0, "b1", "get_weather", '{"city":"Paris"}')])]]
    events = call(site, "POST", "/v1/chat/completions",
                  chat(tools=[WEATHER], stream=True)).events()
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    # text this frontend did not recognise as a call was streamed as content before the
    # backend's parsed call arrived (documented); the call itself comes from the backend
    assert "".join(d.get("content") or "" for d in deltas) == \
        "<|tool|>get_weather Paris<|/tool|>"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"] == "b1" and calls[0]["function"]["name"] == "get_weather"
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_messages_and_assistant_calls_reach_the_template(site, router):
    router.answer = "It is sunny."
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert call(site, "POST", "/v1/chat/completions",
                chat("echo-hf", messages=messages, tools=[WEATHER])).status == 200
    [(_, _, options)] = router.calls
    assert options.UseTokenizerTemplate and json.loads(options.Tools)
    sent = options.Messages
    assert json.loads(sent[1].tool_calls) == calls
    assert (sent[2].role, sent[2].tool_call_id, sent[2].content) == ("tool", "call_1", "sunny")


def test_required_on_a_grammar_backend_sends_a_grammar_for_the_calls(site, router):
    router.answer = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    response = call(site, "POST", "/v1/chat/completions",
                    chat("llama", tools=[WEATHER, TIME], tool_choice="required"))
    assert response.status == 200, response.raw_body
    [(_, _, options)] = router.calls
    grammar = Grammar(options.Grammar)
    assert grammar.accepts('{"name":"get_weather","arguments":{"city":"Paris"}}')
    assert grammar.accepts('{"name":"get_time","arguments":{}}')
    assert not grammar.accepts('{"name":"get_weather","arguments":{}}')  # city is required
    assert not grammar.accepts('[{"name":"get_time","arguments":{}}]')  # not parallel
    assert not grammar.accepts("Sure!")
    assert response.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_function_is_the_only_one_the_grammar_allows(site, router):
    router.answer = '{"name": "get_time", "arguments": {}}'
    call(site, "POST", "/v1/chat/completions", chat(
        "llama", tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}))
    grammar = Grammar(router.calls[0][2].Grammar)
    assert grammar.accepts('{"name":"get_time","arguments":{}}')
    assert not grammar.accepts('{"name":"get_weather","arguments":{"city":"x"}}')


def test_parallel_calls_and_the_prefix_of_the_config_shape_the_grammar(site, router):
    router.answer = '<tool_call>[{"name": "get_time", "arguments": {}}]'
    response = call(site, "POST", "/v1/chat/completions",
                    chat("llama-parallel", tools=[TIME], tool_choice="required"))
    grammar = Grammar(router.calls[0][2].Grammar)
    assert grammar.accepts('<tool_call>[{"name":"get_time","arguments":{}},'
                           '{"name":"get_time","arguments":{}}]')
    assert not grammar.accepts('[{"name":"get_time","arguments":{}}]')
    assert response.json()["choices"][0]["message"]["tool_calls"]
    router.calls.clear()
    call(site, "POST", "/v1/chat/completions", chat(
        "llama-parallel", tools=[TIME], tool_choice="required", parallel_tool_calls=False))
    assert not Grammar(router.calls[0][2].Grammar).accepts(
        '<tool_call>[{"name":"get_time","arguments":{}}]')


def test_required_without_a_call_in_the_answer_is_a_500_not_retried(site, router):
    router.answer = "I refuse."
    response = call(site, "POST", "/v1/chat/completions",
                    chat("llama", tools=[WEATHER], tool_choice="required"))
    assert_error(response, 500, "server_error", code="invalid_model_output")
    assert response.header("x-should-retry") == "false"


@pytest.mark.parametrize("model, body, param, words", [
    ("tooly", {"tools": [WEATHER], "tool_choice": "required"}, "tool_choice",
     ["'tooly'", "grammar"]),
    ("plain", {"tools": [WEATHER]}, "tools", ["'plain'", "template.function"]),
    ("hf", {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                "function": {"name": "get_weather"}}},
     "tool_choice", ["'hf'", "grammar"]),
    ("llama-nogrammar", {"tools": [WEATHER], "tool_choice": "required"}, "tool_choice",
     ["'llama-nogrammar'"]),
    ("echo-hf", {"response_format": {"type": "json_object"}}, "response_format",
     ["'echo-hf'", "grammar"]),
    ("tooly", {"logprobs": True}, "logprobs", ["'tooly'", "log probabilities"]),
])
def test_what_the_backend_cannot_do_is_a_400_naming_the_model(site, router, model, body,
                                                             param, words):
    for stream in (False, True):
        error = assert_error(call(site, "POST", "/v1/chat/completions",
                                  chat(model, stream=stream, **body)), 400,
                             "invalid_request_error", param=param,
                             code="unsupported_parameter")
        assert all(w in error["message"] for w in words), error["message"]
    assert router.calls == []


@pytest.mark.parametrize("body, param, words", [
    # issue 21 §1: a strict tool's arguments are validated, so a regex in its parameters would
    # run on model output in the event loop; refused when the request is read, whatever
    # tool_choice says.
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}}}],
      "tool_choice": "auto"},
     "tools[0].function.parameters", ["'pattern'", "properties.a.pattern", "strict"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "patternProperties": {"^(a+)+$": {"type": "string"}}}}}]},
     "tools[0].function.parameters", ["'patternProperties'"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}]},
     "tools[0].function.parameters", ["not a valid JSON Schema"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters", ["type 'object'"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", ["JSON Schema object"]),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name", []),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", ["twice"]),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", []),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", []),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", ["not one of the tools"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "date"}}}}}],
      "tool_choice": "required"}, "tools", ["'format'"]),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "string", "pattern": "^a"}}}},
     "response_format.json_schema.schema", ["'pattern'", "cannot be enforced"]),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", ["not a valid JSON Schema"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", []),
    ({"response_format": {"type": "xml"}}, "response_format.type", []),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", []),
])
def test_bad_tools_and_schemas_are_400_before_any_backend(site, router, body, param, words):
    error = assert_error(call(site, "POST", "/v1/chat/completions", chat("llama", **body)),
                         400, "invalid_request_error", param=param)
    assert all(w in error["message"] for w in words), error["message"]
    assert router.calls == []


@pytest.mark.parametrize("tool_calls", ["x", ["x"], [{}] * 129])
def test_assistant_tool_calls_of_the_wrong_shape_are_400(site, router, tool_calls):
    messages = [{"role": "assistant", "content": "", "tool_calls": tool_calls}]
    assert_error(call(site, "POST", "/v1/chat/completions", chat(messages=messages)), 400,
                 param="messages[0].tool_calls")
    assert router.calls == []


def test_a_huge_schema_is_a_400_before_it_is_checked(site, router):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                               for i in range(2100)}}
    error = assert_error(call(site, "POST", "/v1/chat/completions", chat(
        "llama", response_format={"type": "json_schema",
                                  "json_schema": {"name": "d", "schema": schema}})),
        400, param="response_format.json_schema.schema")
    assert "more than 4000 values" in error["message"]


@pytest_twisted.ensureDeferred
async def test_a_deeply_nested_schema_is_a_400_not_a_crash(site, router):
    schema: dict = {"type": "object"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"x": schema}}
    # 600 values: planned in the answer-checks thread (constraints.OFFLOAD_SCHEMA_NODES)
    assert_error(await call_settled(site, "POST", "/v1/chat/completions", chat(
        "llama", response_format={"type": "json_schema",
                                  "json_schema": {"name": "d", "schema": schema}})),
        400, param="response_format.json_schema.schema")


# -- JSON mode ------------------------------------------------------------------------------------

PERSON = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}}


def test_json_schema_sends_the_grammar_and_returns_a_valid_answer(site, router):
    router.answer = '{"name": "Ada", "age": 36}'
    response = call(site, "POST", "/v1/chat/completions",
                    chat("llama", response_format=PERSON))
    assert response.status == 200, response.raw_body
    assert json.loads(response.json()["choices"][0]["message"]["content"]) == {
        "name": "Ada", "age": 36}
    grammar = Grammar(router.calls[0][2].Grammar)
    assert grammar.accepts('{"name":"Ada","age":36}')
    assert not grammar.accepts('{"name":"Ada"}')


def test_json_object_sends_the_object_grammar(site, router):
    router.answer = '{"ok": true}'
    response = call(site, "POST", "/v1/completions", {
        "model": "llama", "prompt": "x", "response_format": {"type": "json_object"}})
    assert response.status == 200
    assert Grammar(router.calls[0][2].Grammar).accepts('{"a":[1]}')


@pytest.mark.parametrize("answer, words", [
    ('{"name": "Ada"}', "'age' is a required property"),
    ("not json", "not JSON"),
])
def test_an_answer_outside_the_schema_is_a_500_not_retried(site, router, answer, words):
    router.answer = answer
    response = call(site, "POST", "/v1/chat/completions", chat("llama", response_format=PERSON))
    error = assert_error(response, 500, "server_error", code="invalid_model_output")
    assert words in error["message"] and "'llama'" in error["message"]
    assert response.header("x-should-retry") == "false"


def test_an_answer_cut_by_the_token_budget_is_returned_as_it_is(site, router):
    router.answer, router.tokens = '{"name": "Ad', 5
    body = call(site, "POST", "/v1/chat/completions",
                chat("llama", response_format=PERSON, max_tokens=5)).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == '{"name": "Ad'


def test_a_streamed_answer_outside_the_schema_ends_with_an_error_event(site, router):
    router.stream_pieces = [b'{"name": ', b'"Ada"}']
    events = call(site, "POST", "/v1/chat/completions",
                  chat("llama", response_format=PERSON, stream=True)).events()
    assert events[-1]["error"]["code"] == "invalid_model_output"
    assert "[DONE]" not in events


# -- log probabilities ----------------------------------------------------------------------------

LOGPROBS = json.dumps({"content": [
    {"id": 1, "token": "Hi", "logprob": -0.25,
     "top_logprobs": [{"id": 1, "token": "Hi", "logprob": -0.25},
                      {"id": 2, "token": "Yo", "logprob": -1.5}]},
    {"id": 3, "token": "!", "logprob": -0.5, "bytes": [33], "top_logprobs": []}]}).encode()


def test_chat_logprobs_come_back_in_openai_shape(site, router):
    router.answer, router.reply_logprobs = "Hi!", LOGPROBS
    response = call(site, "POST", "/v1/chat/completions",
                    chat("hf", logprobs=True, top_logprobs=2))
    assert response.status == 200, response.raw_body
    [(_, _, options)] = router.calls
    assert (options.Logprobs, options.TopLogprobs) == (1, 2)
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["content"][0] == {
        "token": "Hi", "logprob": -0.25, "bytes": [72, 105],
        "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                         {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}]}
    assert logprobs["content"][1]["token"] == "!"


def test_streamed_logprobs_ride_on_their_chunks(site, router):
    router.stream_pieces = [b"Hi", b"!"]
    router.stream_logprobs = [
        json.dumps({"content": [{"token": "Hi", "logprob": -0.25}]}).encode(),
        json.dumps({"content": [{"token": "!", "logprob": -0.5}]}).encode()]
    events = call(site, "POST", "/v1/chat/completions",
                  chat("hf", logprobs=True, stream=True)).events()
    tokens = [entry["token"] for e in events[:-1] if e["choices"] and e["choices"][0]["logprobs"]
              for entry in e["choices"][0]["logprobs"]["content"]]
    assert tokens == ["Hi", "!"]


def test_completions_logprobs_come_back_in_the_legacy_shape(site, router):
    router.answer, router.reply_logprobs = "Hi!", LOGPROBS
    body = call(site, "POST", "/v1/completions",
                {"model": "hf", "prompt": "x", "logprobs": 2}).json()
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Hi", "!"], "token_logprobs": [-0.25, -0.5],
        "top_logprobs": [{"Hi": -0.25, "Yo": -1.5}, {}], "text_offset": [0, 2]}
    assert router.calls[0][2].TopLogprobs == 2


def test_completions_logprobs_with_echo_is_refused(site, router):
    assert_error(call(site, "POST", "/v1/completions",
                      {"model": "hf", "prompt": "x", "logprobs": 1, "echo": True}),
                 400, param="logprobs", code="unsupported_parameter")
    assert router.calls == []


def test_streamed_completions_logprobs_carry_their_text_offsets(site, router):
    router.stream_pieces = [b"Hi", b"!"]
    router.stream_logprobs = [
        json.dumps({"content": [{"token": "Hi", "logprob": -0.25}]}).encode(),
        json.dumps({"content": [{"token": "!", "logprob": -0.5,
                                 "top_logprobs": [{"token": "!", "logprob": -0.5}]}]}).encode()]
    events = call(site, "POST", "/v1/completions",
                  {"model": "hf", "prompt": "x", "logprobs": 1, "stream": True}).events()
    pieces = [e["choices"][0]["logprobs"] for e in events[:-1]
              if e["choices"] and e["choices"][0]["logprobs"]]
    assert pieces == [
        {"tokens": ["Hi"], "token_logprobs": [-0.25], "top_logprobs": [{}], "text_offset": [0]},
        {"tokens": ["!"], "token_logprobs": [-0.5], "top_logprobs": [{"!": -0.5}],
         "text_offset": [2]}]


def test_the_last_message_knows_the_answer_is_constrained(router):
    router.configs["flagged"] = model_config(
        "flagged", backend="llama-cpp", template={
            "chat": "{{.Input}}", "function": "{{.Input}}",
            "chat_message": "{{.RoleName}}{{if .Function}} (answer with a call){{end}}"})
    router.answer = '{"name": "get_time", "arguments": {}}'
    site = make_site(router)
    call(site, "POST", "/v1/chat/completions", chat("flagged", tools=[TIME],
                                                    tool_choice="none"))
    call(site, "POST", "/v1/chat/completions", chat("flagged", tools=[TIME],
                                                    tool_choice="required"))
    call(site, "POST", "/v1/chat/completions", chat("flagged", tools=[TIME]))  # auto
    assert [c[2].Prompt for c in router.calls] == [
        "user", "user (answer with a call)", "user (answer with a call)"]


def test_a_request_grammar_goes_to_a_grammar_backend_and_is_refused_elsewhere(site, router):
    router.answer = "yes"
    assert call(site, "POST", "/v1/completions", {
        "model": "llama", "prompt": "x", "grammar": 'root ::= "yes" | "no"'}).status == 200
    assert router.calls[0][2].Grammar == 'root ::= "yes" | "no"'
    assert_error(call(site, "POST", "/v1/chat/completions", chat(grammar="root ::= x")), 400,
                 param="grammar", code="unsupported_parameter")
    assert_error(call(site, "POST", "/v1/chat/completions", chat(
        "llama", grammar="root ::= x", response_format={"type": "json_object"})), 400,
        param="grammar")
    assert_error(call(site, "POST", "/v1/chat/completions", chat(
        "llama", grammar="x" * (64 * 1024 + 1))), 400, param="grammar")
    assert len(router.calls) == 1


STRICT = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": WEATHER["function"]["parameters"]}}


@pytest.mark.parametrize("stream", [False, True])
def test_calls_to_a_strict_tool_are_checked_against_its_parameters(site, router, stream):
    bad = '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>'
    router.answer, router.stream_pieces = bad, [bad.encode()]
    response = call(site, "POST", "/v1/chat/completions",
                    chat(tools=[STRICT], stream=stream))
    if stream:
        error = response.events()[-1]["error"]
    else:
        error = assert_error(response, 500, "server_error")
    assert error["code"] == "invalid_model_output"
    assert "strict tool 'get_weather'" in error["message"] and "'city'" in error["message"]
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    router.answer = good
    assert call(site, "POST", "/v1/chat/completions", chat(tools=[STRICT])).status == 200


def test_a_property_named_pattern_is_no_regex():
    """Names under ``properties`` and data under ``enum``/``const`` are not keywords."""
    schema = {"type": "object", "properties": {"pattern": {"type": "string",
              "enum": [{"pattern": "x"}]}}, "$defs": {"patternProperties": {"type": "null"}}}
    assert constraints.regex_keyword(schema) is None
    assert constraints.regex_keyword({"anyOf": [{"pattern": "x"}]}) == "anyOf[0].pattern"


def test_output_validation_never_runs_a_requests_regex():
    """The attack of issue 21 §1 against the validator itself: with Python's ``re`` this pattern
    against 25 characters holds the GIL for seconds (each character more doubles it, and no
    thread-based timeout can interrupt it), then answers "does not match"; the validators
    refuse to match it instead."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}
    validator = constraints._validator_class(schema)(schema)
    errors = list(validator.iter_errors({"a": "a" * 24 + "!"}))
    assert [e.message for e in errors] == ["a schema with a regular expression is not checked here"]


# -- tool_choice auto under a grammar: the tools plus LocalAI's no-action function --------------


def test_auto_on_a_grammar_backend_allows_a_call_or_the_no_action_answer(site, router):
    router.answer = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    response = call(site, "POST", "/v1/chat/completions", chat("llama", tools=[WEATHER, TIME]))
    assert response.status == 200, response.raw_body
    [(_, _, options)] = router.calls
    grammar = Grammar(options.Grammar)
    assert grammar.accepts('{"name":"get_weather","arguments":{"city":"Paris"}}')
    assert grammar.accepts('{"name":"get_time","arguments":{}}')
    assert grammar.accepts('{"name":"answer","arguments":{"message":"Hello!"}}')
    assert not grammar.accepts('{"name":"answer","arguments":{}}')  # message is required
    assert not grammar.accepts('[{"name":"get_time","arguments":{}}]')  # not parallel
    assert not grammar.accepts("Hello!")
    # the model is shown the no-action function with the tools
    assert " answer(" in options.Prompt
    shown = json.loads(options.Tools)
    assert [t["function"]["name"] for t in shown] == ["get_weather", "get_time", "answer"]
    assert shown[2]["function"]["description"] == \
        "use this action to answer without performing any action"
    assert json.loads(options.ToolChoice) == "auto"
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city":"Paris"}'}


def test_a_call_of_the_no_action_function_is_a_plain_answer(site, router):
    router.answer = '{"name": "answer", "arguments": {"message": "Hello there!"}}'
    body = call(site, "POST", "/v1/chat/completions", chat("llama", tools=[WEATHER])).json()
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello there!"}
    assert choice["finish_reason"] == "stop"


def test_a_streamed_no_action_answer_is_content_and_a_streamed_call_is_deltas(site, router):
    router.stream_pieces = [b'{"name": "answer", ', b'"arguments": {"message": "Hi!"}}']
    events = call(site, "POST", "/v1/chat/completions",
                  chat("llama", tools=[WEATHER], stream=True)).events()
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Hi!"
    assert not any("tool_calls" in d for d in deltas)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    router.stream_pieces = [b'{"name": "get_weather", ', b'"arguments": {"city": "Oslo"}}']
    events = call(site, "POST", "/v1/chat/completions",
                  chat("llama", tools=[WEATHER], stream=True)).events()
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city":"Oslo"}'}}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_no_action_function_takes_the_configs_name_and_description(router):
    router.configs["named"] = model_config(
        "named", backend="llama-cpp", function={
            "no_action_function_name": "reply", "no_action_description_name": "say it"},
        template={"chat": "{{.Input}}", "function": FUNCTION_TEMPLATE})
    router.answer = '{"name": "reply", "arguments": {"message": "Fine."}}'
    body = call(make_site(router), "POST", "/v1/chat/completions",
                chat("named", tools=[WEATHER])).json()
    options = router.calls[0][2]
    grammar = Grammar(options.Grammar)
    assert grammar.accepts('{"name":"reply","arguments":{"message":"x"}}')
    assert not grammar.accepts('{"name":"answer","arguments":{"message":"x"}}')
    assert json.loads(options.Tools)[-1]["function"]["description"] == "say it"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Fine."}


def test_disable_no_action_leaves_only_the_tools_in_the_grammar(router):
    router.configs["no-answer"] = model_config(
        "no-answer", backend="llama-cpp", function={"disable_no_action": True},
        template={"chat": "{{.Input}}", "function": FUNCTION_TEMPLATE})
    router.answer = '{"name": "get_time", "arguments": {}}'
    body = call(make_site(router), "POST", "/v1/chat/completions",
                chat("no-answer", tools=[TIME])).json()
    options = router.calls[0][2]
    grammar = Grammar(options.Grammar)  # LocalAI: a call is then the only answer
    assert grammar.accepts('{"name":"get_time","arguments":{}}')
    assert not grammar.accepts('{"name":"answer","arguments":{"message":"x"}}')
    assert [t["function"]["name"] for t in json.loads(options.Tools)] == ["get_time"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("model, tools", [
    ("llama-nogrammar", [WEATHER]),   # function.grammar.disable
    ("tooly", [WEATHER]),             # a backend that takes no grammar
])
def test_auto_without_a_grammar_renders_the_tools_and_parses_the_answer(site, router, model,
                                                                        tools):
    router.answer = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}' \
                    '</tool_call>'
    body = call(site, "POST", "/v1/chat/completions", chat(model, tools=tools)).json()
    options = router.calls[0][2]
    assert options.Grammar == ""
    assert [t["function"]["name"] for t in json.loads(options.Tools)] == ["get_weather"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_a_tool_named_like_the_no_action_function_stays_a_tool(site, router):
    answer_tool = {"type": "function", "function": {"name": "answer", "parameters": {
        "type": "object", "properties": {"message": {"type": "string"}}}}}
    router.answer = '{"name": "answer", "arguments": {"message": "sent"}}'
    body = call(site, "POST", "/v1/chat/completions",
                chat("llama", tools=[answer_tool])).json()
    assert [t["function"]["name"] for t in json.loads(router.calls[0][2].Tools)] == ["answer"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "answer"


def test_auto_with_parameters_the_grammar_cannot_compile_runs_unconstrained(site, router):
    loose = {"type": "function", "function": {"name": "look", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "minLength": 2}}}}}
    router.answer = "plain words"
    body = call(site, "POST", "/v1/chat/completions", chat("llama", tools=[loose])).json()
    assert router.calls[0][2].Grammar == ""
    assert body["choices"][0]["message"]["content"] == "plain words"


def test_parallel_tool_calls_shape_the_auto_grammar(site, router):
    router.answer = '<tool_call>{"name": "answer", "arguments": {"message": "ok"}}'
    call(site, "POST", "/v1/chat/completions", chat("llama-parallel", tools=[TIME]))
    grammar = Grammar(router.calls[0][2].Grammar)
    assert grammar.accepts('<tool_call>[{"name":"get_time","arguments":{}},'
                           '{"name":"answer","arguments":{"message":"ok"}}]')
    router.calls.clear()
    call(site, "POST", "/v1/chat/completions",
         chat("llama-parallel", tools=[TIME], parallel_tool_calls=False))
    grammar = Grammar(router.calls[0][2].Grammar)
    assert not grammar.accepts('<tool_call>[{"name":"get_time","arguments":{}}]')
    assert grammar.accepts('<tool_call>{"name":"get_time","arguments":{}}')


def test_a_request_grammar_replaces_the_auto_grammar(site, router):
    router.answer = "yes"
    call(site, "POST", "/v1/chat/completions",
         chat("llama", tools=[TIME], grammar='root ::= "yes" | "no"'))
    options = router.calls[0][2]
    assert options.Grammar == 'root ::= "yes" | "no"'
    assert [t["function"]["name"] for t in json.loads(options.Tools)] == ["get_time"]


def test_split_no_action_keeps_real_calls_and_reads_the_message():
    real = ToolCall("get_time", "{}")
    said = ToolCall("answer", '{"message": "hi"}')
    assert split_no_action([said], "answer") == ((), "hi")
    assert split_no_action([said, real], "answer") == ((real,), None)
    assert split_no_action([ToolCall("answer", "{}")], "answer") == ((), "")
    assert split_no_action([ToolCall("answer", "not json")], "answer") == ((), "")
    assert split_no_action([said], None) == ((said,), None)
    assert split_no_action([], "answer") == ((), None)


@pytest.mark.parametrize("raw, field", [
    ({"no_action_function_name": "has space"}, "function.no_action_function_name"),
    ({"no_action_function_name": 3}, "function.no_action_function_name"),
    ({"disable_no_action": "yes"}, "function.disable_no_action"),
    ({"no_action_description_name": ["x"]}, "function.no_action_description_name"),
])
def test_a_bad_no_action_setting_names_the_key(raw, field):
    with pytest.raises(FunctionConfigError) as caught:
        FunctionConfig.from_yaml(raw)
    assert caught.value.field == field


def test_the_no_action_settings_are_read_without_a_warning():
    warnings: list[str] = []
    config = FunctionConfig.from_yaml({"disable_no_action": True,
                                       "no_action_function_name": "reply",
                                       "no_action_description_name": "say"}, warnings)
    assert (config.disable_no_action, config.no_action_name, config.no_action_description) \
        == (True, "reply", "say")
    assert warnings == []
    assert FunctionConfig().no_action_name == "answer"


@pytest.mark.parametrize("text, expected", [
    ('{"name": "answer", "arguments": {"message": "The sea is', "The sea is"),
    ('{ "name":"answer","arguments":{ "message":"a \\"b\\" \\u00e9 c\\', 'a "b" é c'),
    ('{"name":"answer","arguments":{"message":"x\\u00', "x"),
    ('{"name":"answer","arguments":{"message":"', ""),
    ('{"name":"get_time","arguments":{', None),        # a real call cut: not a message
    ('{"name":"answer","arguments":{"message":"done"}', None),  # the string closed
    ("plain words", None),
])
def test_a_no_action_answer_cut_by_max_tokens_reads_as_cut_words(text, expected):
    from localai_tw.localai.toolcalls import cut_no_action_message

    assert cut_no_action_message(text, FunctionConfig(), "answer") == expected


def test_a_cut_no_action_answer_is_its_words_streamed_and_not(site, router):
    router.answer, router.tokens = '{"name": "answer", "arguments": {"message": "It is a sto', 9
    router.stream_pieces = [b'{"name": "answer", ', b'"arguments": {"message": "It is a sto']
    body = call(site, "POST", "/v1/chat/completions",
                chat("llama", tools=[WEATHER], max_tokens=9)).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is a sto"}
    assert body["choices"][0]["finish_reason"] == "length"
    events = call(site, "POST", "/v1/chat/completions",
                  chat("llama", tools=[WEATHER], stream=True, max_tokens=2)).events()
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "It is a sto"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("prefix, text, expected", [
    ("<tool_call>", '<tool_call> [ {"name":"answer","arguments":{"message":"Hi th', "Hi th"),
    ("", '[{"name": "answer", "arguments": {"message": "Hi', "Hi"),
    ("", " " * 100_000 + "x", None),  # a long run that never opens the call: one pass
])
def test_a_cut_answer_after_the_prefix_or_in_a_list_is_read(prefix, text, expected):
    from localai_tw.localai.toolcalls import cut_no_action_message

    assert cut_no_action_message(text, FunctionConfig(grammar_prefix=prefix), "answer") == \
        expected
