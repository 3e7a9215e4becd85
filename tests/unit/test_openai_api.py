"""The OpenAI API resources over raw HTTP (StringTransport) with a fake IInferenceRouter:
bad input, auth, chat/completions/embeddings/models, streaming shape, backpressure and
cancellation on disconnect."""

from __future__ import annotations

import base64
import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer

from localai_tw.backends import backend_pb2
from localai_tw.frontend.api.openai import OpenAIResource
from localai_tw.frontend.api.kit import APIKeyGuard

from .support_openai import Client, FakeRouter, assert_error, call, make_site, model_config


@pytest.fixture
def router():
    return FakeRouter([
        model_config("chatty", template={"chat_message": "{{.RoleName}}: {{.Content}}",
                                         "chat": "{{.Input}}\nassistant:",
                                         "completion": "Q: {{.Input}}\nA:"},
                     parameters={"temperature": 0.2, "top_k": 7, "max_tokens": 50,
                                 "stop": ["</s>"]}),
        model_config("hf", template={"use_tokenizer_template": True}),
        model_config("embedder", embeddings=True),
    ])


@pytest.fixture
def site(router):
    return make_site(router)


def chat(model="chatty", **more):
    body = {"model": model, "messages": [{"role": "user", "content": "hi there"}]}
    body.update(more)
    return body


# -- bad input ------------------------------------------------------------------------------


def test_malformed_json_is_400(site, router):
    response = call(site, "POST", "/v1/chat/completions", raw=b'{"model": "chatty",')
    error = assert_error(response, 400, "invalid_request_error")
    assert "not valid JSON" in error["message"]
    assert router.calls == []


@pytest.mark.parametrize("raw", [b"[1, 2]", b"", b"\xff\xfe{}", b'{"a": NaN}'])
def test_non_object_bodies_are_400(site, raw):
    assert_error(call(site, "POST", "/v1/chat/completions", raw=raw or None), 400)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a\ud800b"}]),
     "messages[0].content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a\u0000b"}]),
     "messages[0].content"),
    ("/v1/chat/completions", chat(stop=["ok", "\udfff"]), "stop[1]"),
    ("/v1/chat/completions", chat(metadata={"k": "v\u0000"}), "metadata.k"),
    ("/v1/completions", {"model": "chatty", "prompt": "x\ud83d"}, "prompt"),
    ("/v1/embeddings", {"model": "embedder", "input": ["fine", "\u0000"]}, "input[1]"),
    ("/v1/embeddings", {"model": "embedder\ud800", "input": "x"}, "model"),
])
def test_nul_and_lone_surrogates_are_400_naming_the_field(site, router, path, body, param):
    # JSON can spell both as escapes; neither can cross gRPC (UTF-8) or PostgreSQL (NUL).
    raw = json.dumps(body).encode()  # ensure_ascii keeps them as \\u escapes
    error = assert_error(call(site, "POST", path, raw=raw), 400, "invalid_request_error",
                         param=param)
    assert param in error["message"]
    assert router.calls == []


def test_non_json_content_type_is_415_saying_what_was_sent_and_what_to_send(site, router):
    body = json.dumps(chat()).encode("utf-8")  # what `curl -d` sends, as a form
    response = call(site, "POST", "/v1/chat/completions", raw=body,
                    headers={"Content-Type": "application/x-www-form-urlencoded"})
    error = assert_error(response, 415, "invalid_request_error", code="unsupported_media_type")
    assert "'application/x-www-form-urlencoded'" in error["message"]
    assert "Content-Type: application/json" in error["message"]
    assert router.calls == []


def test_a_json_body_without_content_type_is_refused(site, router):
    """Issue 21 §7: a web page can POST a body without a Content-Type (or as text/plain)
    without the browser asking first; with the API open (no key) that drove it.  A JSON body
    must say so."""
    raw = json.dumps({"model": "embedder", "input": "hi"}).encode("utf-8")
    for content_type in (b"", b"Content-Type: text/plain\r\n"):
        client = Client(site)
        client.channel.dataReceived(b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\n"
                                    + content_type
                                    + b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
        response = client.response()
        assert response.status == 415, response.raw_body
        assert "Content-Type: application/json" in response.json()["error"]["message"]


def test_missing_model_is_400_naming_model(site):
    body = chat()
    del body["model"]
    assert_error(call(site, "POST", "/v1/chat/completions", body), 400,
                 param="model", code="missing_required_parameter")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat(model="nope")),
    ("/v1/completions", {"model": "nope", "prompt": "x"}),
    ("/v1/embeddings", {"model": "nope", "input": "x"}),
])
def test_unknown_model_is_404_model_not_found(site, router, path, body):
    error = assert_error(call(site, "POST", path, body), 404, "invalid_request_error",
                         param="model", code="model_not_found")
    assert "nope" in error["message"]
    assert router.calls == []


@pytest.mark.parametrize("field, value, param", [
    ("model", 5, "model"),
    ("messages", "hi", "messages"),
    ("messages", [], "messages"),
    ("messages", [{"content": "x"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": 3}], "messages[0].content"),
    ("messages", [{"role": "user", "content": [{"type": "video"}]}],
     "messages[0].content[0].type"),
    ("messages", [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}],
     "messages[0].content[0].image_url.url"),
    ("temperature", "hot", "temperature"),
    ("temperature", 7, "temperature"),
    ("top_p", True, "top_p"),
    ("max_tokens", 1.5, "max_tokens"),
    ("max_tokens", -1, "max_tokens"),
    ("n", 0, "n"),
    ("stop", 5, "stop"),
    ("stop", ["a", 1], "stop"),
    ("stream", "yes", "stream"),
    ("seed", "1", "seed"),
    ("stream_options", {"include_usage": True}, "stream_options"),
    ("tools", {"a": 1}, "tools"),
    ("metadata", {"a": 1}, "metadata"),
])
def test_wrong_types_are_400_naming_the_param(site, router, field, value, param):
    response = call(site, "POST", "/v1/chat/completions", chat(**{field: value}))
    assert_error(response, 400, "invalid_request_error", param=param)
    assert router.calls == []


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"tools": [TOOL]}, "tools"),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"functions": [TOOL["function"]]}, "functions"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/completions", {"logprobs": 0}, "logprobs"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"suffix": "tail"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_cannot_be_honoured_is_refused_naming_field_and_model(site, router, path,
                                                                   extra, param, stream):
    """``chatty`` runs on ``echo``: no grammar, no log probabilities, and its templates cannot
    show tools to the model."""
    body = chat(**extra) if path.endswith("chat/completions") else \
        {"model": "chatty", "prompt": "hi", **extra}
    body["stream"] = stream
    error = assert_error(call(site, "POST", path, body), 400, "invalid_request_error",
                         param=param, code="unsupported_parameter")
    assert "'chatty'" in error["message"] and "cannot honour" in error["message"]
    assert router.calls == []


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function",
                                              "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"tools": [TOOL]}, "tools"),
])
def test_requests_that_make_no_sense_are_400_naming_the_field(site, router, path, extra,
                                                              param):
    body = chat(**extra) if path.endswith("chat/completions") else \
        {"model": "chatty", "prompt": "hi", **extra}
    assert_error(call(site, "POST", path, body), 400, "invalid_request_error", param=param)
    assert router.calls == []


@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"tools": [], "tool_choice": "none", "logprobs": False,
                              "response_format": {"type": "text"}, "top_logprobs": 0,
                              "user": "u-1", "service_tier": "auto", "store": False,
                              "parallel_tool_calls": False, "modalities": ["text"]}),
    ("/v1/completions", {"response_format": {"type": "text"}, "best_of": 1, "suffix": "",
                         "user": "u-1"}),
])
def test_harmless_spellings_and_metadata_are_accepted(site, router, path, extra):
    body = chat(**extra) if path.endswith("chat/completions") else \
        {"model": "chatty", "prompt": "hi", **extra}
    assert call(site, "POST", path, body).status == 200
    assert len(router.calls) == 1


@pytest.mark.parametrize("role", ["bot", "User", "narrator\u0007"])
def test_an_unknown_role_is_400_naming_it_and_the_roles(site, router, role):
    body = chat(messages=[{"role": "system", "content": "x"}, {"role": role, "content": "y"}])
    error = assert_error(call(site, "POST", "/v1/chat/completions", body), 400,
                         "invalid_request_error", param="messages[1].role",
                         code="invalid_value")
    assert repr(role.replace("\u0007", "?")) in error["message"]
    assert "system, developer, user, assistant, tool, function" in error["message"]
    assert router.calls == []


def test_every_openai_role_is_accepted(site, router):
    body = chat(messages=[{"role": r, "content": r} for r in
                          ("system", "developer", "user", "assistant", "tool", "function")])
    assert call(site, "POST", "/v1/chat/completions", body).status == 200


def test_streaming_more_than_one_choice_is_400(site):
    assert_error(call(site, "POST", "/v1/chat/completions", chat(stream=True, n=2)), 400,
                 param="n")


@pytest.mark.parametrize("body, param", [
    ({"model": "chatty"}, "prompt"),
    ({"model": "chatty", "prompt": 3}, "prompt"),
    ({"model": "chatty", "prompt": [[1, 2]]}, "prompt"),
    ({"model": "chatty", "prompt": ["a", "b"], "stream": True}, "prompt"),
])
def test_completion_bad_prompts(site, body, param):
    assert_error(call(site, "POST", "/v1/completions", body), 400, param=param)


@pytest.mark.parametrize("body, param", [
    ({"model": "embedder"}, "input"),
    ({"model": "embedder", "input": 3}, "input"),
    ({"model": "embedder", "input": []}, "input"),
    ({"model": "embedder", "input": ""}, "input"),
    ({"model": "embedder", "input": ["ok", 3]}, "input[1]"),
    ({"model": "embedder", "input": [[1, -2]]}, "input[0]"),
    ({"model": "embedder", "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "embedder", "input": "x", "dimensions": 3}, "dimensions"),
])
def test_embedding_bad_inputs(site, body, param):
    assert_error(call(site, "POST", "/v1/embeddings", body), 400, param=param)


def test_body_over_the_limit_is_413_before_the_router(router):
    site = make_site(router, limit=1024)
    body = chat(messages=[{"role": "user", "content": "x" * 2000}])
    response = call(site, "POST", "/v1/chat/completions", body)
    error = assert_error(response, 413, "invalid_request_error", code="request_too_large")
    assert "1024" in error["message"]
    assert router.calls == []


def test_default_body_limit_is_8_mib(router):
    site = make_site(router)
    assert site.body_limit_for(b"/v1/chat/completions") == 8 * 1024 * 1024
    big = chat(messages=[{"role": "user", "content": "y " * (100 * 1024)}])
    assert call(site, "POST", "/v1/chat/completions", big).status == 200


def test_unknown_endpoint_and_wrong_method(site):
    assert_error(call(site, "POST", "/v1/nothing", {}), 404, code="unknown_url")
    response = call(site, "GET", "/v1/chat/completions")
    assert_error(response, 405, code="method_not_allowed")
    assert response.header("allow") == "POST"


# -- auth -----------------------------------------------------------------------------------


def test_with_keys_configured_requests_need_a_valid_bearer_key(router):
    site = make_site(router, api_keys=APIKeyGuard(["sekrit-1", "sekrit-2"]))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        response = call(site, "POST", "/v1/chat/completions", chat(), headers=headers)
        error = assert_error(response, 401, "authentication_error", code="invalid_api_key")
        assert "sekrit" not in error["message"] and "wrong" not in error["message"]
        assert response.header("www-authenticate") == "Bearer"
    assert_error(call(site, "GET", "/v1/models"), 401)
    assert router.calls == []
    ok = call(site, "POST", "/v1/chat/completions", chat(),
              headers={"Authorization": "Bearer sekrit-2"})
    assert ok.status == 200


def test_without_keys_the_api_is_open(router):
    site = make_site(router, api_keys=APIKeyGuard([]))
    assert call(site, "POST", "/v1/chat/completions", chat()).status == 200


# -- chat -------------------------------------------------------------------------------------


def test_chat_non_stream_renders_template_and_merges_sampling(site, router):
    body = chat(messages=[{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "hi there"}],
                temperature=0.5, stop="END", seed=42, max_tokens=9,
                presence_penalty=0.5, frequency_penalty=-0.5)
    router.answer = "Hello, wörld"
    response = call(site, "POST", "/v1/chat/completions", body)
    assert response.status == 200
    assert response.header("x-localai-node") == "node-a"
    assert response.header("content-type") == "application/json"
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["model"] == "chatty"
    assert answer["id"].startswith("chatcmpl-") and answer["created"] == 1700000000
    assert answer["choices"] == [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                  "message": {"role": "assistant", "content": "Hello, wörld"}}]
    (verb, name, options), = router.calls
    assert (verb, name) == ("predict", "chatty")
    assert options.Prompt == "system: be brief\nuser: hi there\nassistant:"
    assert not options.UseTokenizerTemplate and not options.Messages
    assert options.Temperature == pytest.approx(0.5)     # request over model default
    assert options.TopK == 7                              # model default
    assert options.TopP == pytest.approx(0.95)            # LocalAI default
    assert options.Tokens == 9 and options.Seed == 42
    assert list(options.StopPrompts) == ["</s>", "END"]
    assert options.PresencePenalty == pytest.approx(0.5)
    assert options.FrequencyPenalty == pytest.approx(-0.5)
    assert answer["usage"] == {"prompt_tokens": len(options.Prompt.split()),
                               "completion_tokens": 2,
                               "total_tokens": len(options.Prompt.split()) + 2}


def test_chat_defaults_from_model_and_finish_reason_length(site, router):
    router.tokens = 50
    response = call(site, "POST", "/v1/chat/completions", chat())
    (_, _, options), = router.calls
    assert options.Temperature == pytest.approx(0.2) and options.Tokens == 50
    assert 0 <= options.Seed <= 2**31 - 1
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_wins_over_max_tokens(site, router):
    call(site, "POST", "/v1/chat/completions", chat(max_tokens=5, max_completion_tokens=3))
    assert router.calls[0][2].Tokens == 3


def test_chat_with_tokenizer_template_sends_messages(site, router):
    body = chat(model="hf", messages=[
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "look "},
                                     {"type": "text", "text": "here"},
                                     {"type": "image_url",
                                      "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    ], tools=[], tool_choice="none", response_format={"type": "text"}, logprobs=False)
    response = call(site, "POST", "/v1/chat/completions", body)
    assert response.status == 200
    (_, _, options), = router.calls
    assert options.Prompt == "" and options.UseTokenizerTemplate
    assert [(m.role, m.content) for m in options.Messages] == [("system", "sys"),
                                                               ("user", "look here")]
    assert list(options.Images) == ["AAAA"]
    assert options.Tools == "" and options.ToolChoice == ""
    assert response.json()["choices"][0]["message"]["content"] == "look here"


def test_chat_n_choices_are_n_calls_with_distinct_seeds(site, router):
    # n choices at temperature 1 must be n samples, not n copies of one.
    response = call(site, "POST", "/v1/chat/completions", chat(n=3, temperature=1))
    assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2]
    assert len(router.calls) == 3
    assert len({options.Seed for _, _, options in router.calls}) == 3


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat(n=3, seed=2**31 - 2)),
    ("/v1/completions", {"model": "chatty", "prompt": "hi", "n": 3, "seed": 2**31 - 2}),
])
def test_a_given_seed_gives_choice_i_seed_plus_i(site, router, path, body):
    # Reproducible: the same request gives the same n answers (wrapped to int32).
    call(site, "POST", path, body)
    assert [options.Seed for _, _, options in router.calls] == [2**31 - 2, 2**31 - 1, -2**31]


def test_completions_n_is_n_choices_per_prompt(site, router):
    body = {"model": "chatty", "prompt": ["one", "two words"], "n": 2}
    response = call(site, "POST", "/v1/completions", body)
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == ["Q: one\nA:"] * 2 + ["Q: two words\nA:"] * 2
    assert [options.Prompt for _, _, options in router.calls] == \
        ["Q: one\nA:"] * 2 + ["Q: two words\nA:"] * 2
    seeds = [options.Seed for _, _, options in router.calls]
    assert seeds[0] != seeds[1] and seeds[2] != seeds[3]  # distinct samples of each prompt
    assert response.json()["usage"]["completion_tokens"] == 3 + 3 + 4 + 4  # summed


@pytest.mark.parametrize("body", [
    {"model": "chatty", "prompt": "hi", "n": 2, "stream": True},
    {"model": "chatty", "prompt": ["p"] * 40, "n": 2},
])
def test_completions_n_bounds(site, router, body):
    assert_error(call(site, "POST", "/v1/completions", body), 400, param="n",
                 code="invalid_value")
    assert router.calls == []


def test_invalid_model_template_is_500_template_error(router):
    router.configs["broken"] = model_config("broken", template={"chat": "{{define \"x\"}}"})
    response = call(make_site(router), "POST", "/v1/chat/completions", chat(model="broken"))
    error = assert_error(response, 500, "server_error", code="template_error")
    assert "template.chat" in error["message"] and "define" in error["message"]


def test_a_template_reading_a_field_it_lacks_is_left_out_as_localai_does(router):
    router.configs["broken"] = model_config("broken", template={"chat": "{{.Nope}}"})
    response = call(make_site(router), "POST", "/v1/chat/completions", chat(model="broken"))
    assert response.status == 200, response.raw_body
    assert router.calls[-1][2].Prompt == "hi there"  # the joined messages, as LocalAI sends


# -- streaming ------------------------------------------------------------------------------------


def test_chat_stream_sse_shape_order_and_split_utf8(site, router):
    # "é" is C3 A9 and "€" is E2 82 AC: both split across replies.
    router.stream_pieces = [b"caf\xc3", b"\xa9 ", b"", b"\xe2\x82", b"\xac!"]
    body = chat(stream=True, stream_options={"include_usage": True}, max_tokens=100)
    response = call(site, "POST", "/v1/chat/completions", body)
    assert response.status == 200 and response.complete
    assert response.header("content-type") == "text/event-stream; charset=utf-8"
    assert response.header("x-localai-node") == "node-a"
    events = response.events()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert deltas == ["caf", "é ", "€!"]  # complete characters only; empty pieces skipped
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "stop" and finish["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert router.calls[0][0] == "predict_stream"


def test_stream_incomplete_utf8_at_the_end_becomes_a_replacement_character(site, router):
    router.stream_pieces = [b"ok\xe2\x82"]
    events = call(site, "POST", "/v1/chat/completions", chat(stream=True)).events()
    assert [e["choices"][0]["delta"].get("content") for e in events[1:-2]] == ["ok", "\ufffd"]


def test_stream_without_include_usage_has_no_usage_chunk(site, router):
    events = call(site, "POST", "/v1/chat/completions", chat(stream=True)).events()
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_completion_stream_and_echo(site, router):
    body = {"model": "chatty", "prompt": "2+2", "stream": True, "echo": True}
    events = call(site, "POST", "/v1/completions", body).events()
    assert events[-1] == "[DONE]"
    assert {e["object"] for e in events[:-1]} == {"text_completion"}
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["2+2", "Hello", " world", ""]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert router.calls[0][2].Prompt == "Q: 2+2\nA:"


def test_stream_failure_before_start_is_a_json_error(site, router):
    from localai_tw.frontend.inference.interfaces import NoNodeAvailable
    router.fail_with = NoNodeAvailable("chatty", "no backend node matches")
    response = call(site, "POST", "/v1/chat/completions", chat(stream=True))
    assert_error(response, 503, "service_unavailable", code="no_node_available")


def test_stream_failure_after_start_is_an_error_event_without_done(site, router):
    from localai_tw.errors import BackendAnswer
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/chat/completions", chat(stream=True))
    stream, = router.streams
    stream.start()
    stream.push(b"par")
    stream.fail(BackendAnswer("node-a", "INTERNAL", "CUDA out of memory"))
    response = client.response()
    assert response.status == 200 and response.complete
    events = response.events()
    assert events[1]["choices"][0]["delta"]["content"] == "par"
    assert events[-1]["error"]["code"] == "backend_error"
    assert "CUDA out of memory" in events[-1]["error"]["message"]
    assert "[DONE]" not in events


def test_stream_backpressure_waits_for_the_transport(site, router):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/chat/completions", chat(stream=True))
    stream, = router.streams
    stream.start()
    assert stream.push(b"one ") is None  # transport not paused
    client.transport.producer.pauseProducing()      # the transport's buffer is full
    waiting = stream.push(b"two ")
    assert isinstance(waiting, defer.Deferred) and not waiting.called
    client.transport.producer.resumeProducing()
    assert waiting.called
    stream.end()
    events = client.response().events()
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["one ", "two "]


def test_disconnect_mid_stream_cancels_the_router_call(site, router):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/chat/completions", chat(stream=True))
    stream, = router.streams
    stream.start()
    stream.push(b"partial")
    client.transport.producer.pauseProducing()
    waiting = stream.push(b" more")
    failures = []
    waiting.addErrback(failures.append)
    client.disconnect()
    assert stream.cancelled
    assert failures, "the pending backpressure wait fails when the client leaves"
    later = stream.push(b"late")  # a reply racing the cancel is refused, not written
    later.addErrback(lambda _: None)
    assert later.called


def test_disconnect_while_waiting_cancels_predict(site, router):
    router.hold = True
    client = Client(site).send("POST", "/v1/chat/completions", chat())
    assert len(router.pending) == 1
    client.disconnect()
    assert router.cancelled == ["predict"]


def test_disconnect_while_waiting_cancels_embeddings(site, router):
    router.hold = True
    client = Client(site).send("POST", "/v1/embeddings",
                               {"model": "embedder", "input": ["a", "b", "c"]})
    client.disconnect()
    assert router.cancelled == ["embed"]
    assert len(router.calls) == 1  # no further inputs are sent


# -- completions -----------------------------------------------------------------------------------


def test_completions_one_call_per_prompt(site, router):
    body = {"model": "chatty", "prompt": ["one", "two"], "stop": ["x", "y"]}
    response = call(site, "POST", "/v1/completions", body)
    answer = response.json()
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert [c["text"] for c in answer["choices"]] == ["Q: one\nA:", "Q: two\nA:"]
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert [o.Prompt for _, _, o in router.calls] == ["Q: one\nA:", "Q: two\nA:"]
    assert list(router.calls[0][2].StopPrompts) == ["</s>", "x", "y"]
    assert answer["usage"]["completion_tokens"] == 6


def test_completion_without_template_sends_the_raw_prompt(site, router):
    call(site, "POST", "/v1/completions", {"model": "hf", "prompt": "raw text"})
    assert router.calls[0][2].Prompt == "raw text"
    assert not router.calls[0][2].UseTokenizerTemplate


# -- embeddings ---------------------------------------------------------------------------------


def test_embeddings_float_one_call_per_input(site, router):
    body = {"model": "embedder", "input": ["first text", "second"]}
    response = call(site, "POST", "/v1/embeddings", body)
    answer = response.json()
    assert answer["object"] == "list" and answer["model"] == "embedder"
    assert [d["index"] for d in answer["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 4 for d in answer["data"])
    assert [o.Embeddings for _, _, o in router.calls] == ["first text", "second"]
    assert answer["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert response.header("x-localai-node") == "node-a"


def test_embeddings_base64_is_little_endian_float32(site, router):
    floats = call(site, "POST", "/v1/embeddings",
                  {"model": "embedder", "input": "abc"}).json()["data"][0]["embedding"]
    encoded = call(site, "POST", "/v1/embeddings",
                   {"model": "embedder", "input": "abc", "encoding_format": "base64"}
                   ).json()["data"][0]["embedding"]
    raw = base64.b64decode(encoded)
    assert len(raw) == 16
    assert list(struct.unpack("<4f", raw)) == pytest.approx(floats)


def test_embeddings_token_arrays_go_in_embedding_tokens(site, router):
    call(site, "POST", "/v1/embeddings", {"model": "embedder", "input": [[1, 2], [3]]})
    assert [list(o.EmbeddingTokens) for _, _, o in router.calls] == [[1, 2], [3]]
    router.calls.clear()
    call(site, "POST", "/v1/embeddings", {"model": "embedder", "input": [5, 6, 7]})
    assert [list(o.EmbeddingTokens) for _, _, o in router.calls] == [[5, 6, 7]]


def test_per_token_embeddings_are_refused(site, router):
    router.embedding_layout = backend_pb2.EMBEDDING_LAYOUT_PER_TOKEN
    response = call(site, "POST", "/v1/embeddings", {"model": "embedder", "input": "x"})
    assert_error(response, 500, code="unsupported_embedding_layout")
    assert response.header("x-should-retry") == "false"  # the backend would answer the same


# -- models --------------------------------------------------------------------------------------


def test_models_list_and_one_model(site):
    answer = call(site, "GET", "/v1/models").json()
    assert answer["object"] == "list"
    assert [m["id"] for m in answer["data"]] == ["chatty", "embedder", "hf"]
    assert all(m["object"] == "model" and m["owned_by"] for m in answer["data"])
    assert call(site, "GET", "/v1/models/hf").json()["id"] == "hf"
    assert_error(call(site, "GET", "/v1/models/none"), 404, code="model_not_found")


def test_resource_accepts_a_router_object_directly(router):
    from twisted.web.resource import Resource
    from localai_tw.web.listener import BoundedSite
    root = Resource()
    root.putChild(b"v1", OpenAIResource(router))
    assert call(BoundedSite(root, timeout=None), "GET", "/v1/models").status == 200


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_stream_reassembles_any_text_split_at_any_byte(text, cuts):
    router = FakeRouter([model_config("m")])
    data = text.encode("utf-8")
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    router.stream_pieces = [data[a:b] for a, b in zip(points, points[1:])]
    events = call(make_site(router), "POST", "/v1/chat/completions",
                  chat(model="m", stream=True)).events()
    deltas = [e["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert all(deltas)  # every event carries at least one whole character
    assert "".join(deltas) == text


def test_stream_starting_on_a_full_transport_waits_at_once(site, router):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/chat/completions", chat(stream=True))
    stream, = router.streams
    client.transport.producer.pauseProducing()  # full before the stream registers
    stream.start()
    waiting = stream.push(b"x")
    assert isinstance(waiting, defer.Deferred) and not waiting.called
    client.transport.producer.resumeProducing()
    assert waiting.called


# -- X-LocalAI-Node names the node -------------------------------------------------------


def named_site(router, lookup):
    from twisted.web.resource import Resource
    from localai_tw.web.listener import BoundedSite
    root = Resource()
    root.putChild(b"v1", OpenAIResource(router, node_names=lookup, now=lambda: 1700000000))
    return BoundedSite(root, timeout=None)


def test_node_header_names_the_node_and_asks_once_per_node(router):
    asked = []

    def lookup(node_id):
        asked.append(node_id)
        return defer.succeed({"node-a": "gpu-box-1"}.get(node_id))

    site = named_site(router, lookup)
    assert call(site, "POST", "/v1/chat/completions", chat()).header("x-localai-node") == \
        "gpu-box-1"
    embedded = call(site, "POST", "/v1/embeddings", {"model": "embedder", "input": ["a", "b"]})
    assert embedded.header("x-localai-node") == "gpu-box-1"
    assert asked == ["node-a"]  # remembered: a node keeps its name under its id


def test_a_stream_starts_only_once_the_node_is_named(router):
    router.manual_streams = True
    naming = defer.Deferred()
    site = named_site(router, lambda node_id: naming)
    client = Client(site).send("POST", "/v1/chat/completions", chat(stream=True))
    stream = router.streams[0]
    stream.start()
    waiting = stream.push(b"Hi")
    assert isinstance(waiting, defer.Deferred) and client.transport.value() == b""
    naming.callback("gpu-box-1")
    stream.end()
    response = client.response()
    assert response.header("x-localai-node") == "gpu-box-1"
    assert [e["choices"][0]["delta"].get("content") for e in response.events()[:2]] == ["", "Hi"]


def test_a_failed_name_lookup_falls_back_to_the_id(router):
    site = named_site(router, lambda node_id: defer.fail(RuntimeError("database down")))
    assert call(site, "POST", "/v1/chat/completions", chat()).header("x-localai-node") == \
        "node-a"


# -- embeddings usage counts tokens ------------------------------------------------------------


def test_embeddings_usage_is_the_backends_token_count_without_extra_calls(site, router):
    response = call(site, "POST", "/v1/embeddings",
                    {"model": "embedder", "input": ["one two three", "four"]})
    assert response.json()["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert [verb for verb, _, _ in router.calls] == ["embed", "embed"]


def uncounted(router):
    """Make the fake backend report no token count, like backends that predate it."""
    embed = router.embed

    def embed_without_count(name, options, deadline=None):
        def strip(served):
            served.value.prompt_tokens = 0
            return served
        return embed(name, options, deadline).addCallback(strip)

    router.embed = embed_without_count


def test_embeddings_usage_asks_tokenize_when_the_backend_reports_no_count(site, router):
    uncounted(router)
    response = call(site, "POST", "/v1/embeddings",
                    {"model": "embedder", "input": ["one two three", "four five"]})
    assert response.json()["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    tokenized = [o.Prompt for verb, _, o in router.calls if verb == "tokenize"]
    assert tokenized == ["one two three", "four five"]


def test_token_ids_a_backend_did_not_evaluate_are_a_400_naming_input(site, router):
    # LocalAI's Python backends read Embeddings (text) only: ids they ignore embed nothing
    uncounted(router)
    ids = call(site, "POST", "/v1/embeddings", {"model": "embedder", "input": [[1, 2, 3], [4]]})
    error = assert_error(ids, 400, param="input", code="unsupported_parameter")
    assert "takes text only" in error["message"]
    assert "check_embedding_ctx_length=False" in error["message"]


def test_token_ids_as_langchain_sends_them_are_embedded(site, router):
    ids = call(site, "POST", "/v1/embeddings", {"model": "embedder", "input": [[1, 2, 3], [4]]})
    assert ids.status == 200, ids.raw_body
    assert [list(o.EmbeddingTokens) for verb, _, o in router.calls if verb == "embed"] == \
        [[1, 2, 3], [4]]


def test_a_backend_that_cannot_count_gives_zero_usage_not_a_failure(site, router):
    from localai_tw.errors import BackendAnswer

    uncounted(router)
    asked = []

    def tokenize(name, options, deadline=None):
        asked.append(options.Prompt)
        return defer.fail(BackendAnswer("node-a", "UNIMPLEMENTED", "no TokenizeString"))

    router.tokenize = tokenize
    response = call(site, "POST", "/v1/embeddings", {"model": "embedder", "input": ["a", "b"]})
    assert response.status == 200 and len(response.json()["data"]) == 2
    assert response.json()["usage"] == {"prompt_tokens": 0, "total_tokens": 0}
    assert asked == ["a"]  # asked once per request


# -- tokenize -----------------------------------------------------------------------------------


def test_tokenize_is_one_tokenize_string_call_in_localais_shape(site, router):
    response = call(site, "POST", "/v1/tokenize", {"model": "chatty", "content": "a b c"})
    assert response.status == 200, response.raw_body
    assert response.json() == {"tokens": [0, 1, 2]}
    assert [(verb, name, o.Prompt) for verb, name, o in router.calls] == \
        [("tokenize", "chatty", "a b c")]
    assert response.header("x-localai-node") == "node-a"


@pytest.mark.parametrize("body, status, param", [
    ({"content": "x"}, 400, "model"),
    ({"model": "chatty"}, 400, "content"),
    ({"model": "chatty", "content": ["x"]}, 400, "content"),
    ({"model": "nope", "content": "x"}, 404, "model"),
])
def test_tokenize_bad_requests_never_reach_the_router(site, router, body, status, param):
    assert_error(call(site, "POST", "/v1/tokenize", body), status, param=param)
    assert router.calls == []


def test_tokenize_is_post_only(site):
    assert_error(call(site, "GET", "/v1/tokenize"), 405, code="method_not_allowed")


# -- detokenize ---------------------------------------------------------------------------------


def test_detokenize_is_one_detokenize_call_in_localais_shape(site, router):
    response = call(site, "POST", "/v1/detokenize", {"model": "chatty", "tokens": [3, 0, 7]})
    assert response.status == 200, response.raw_body
    assert response.json() == {"content": "t3 t0 t7"}
    [(verb, name, sent)] = router.calls
    assert (verb, name, list(sent.tokens)) == ("detokenize", "chatty", [3, 0, 7])
    assert response.header("x-localai-node") == "node-a"


@pytest.mark.parametrize("body, status, param", [
    ({"tokens": [1]}, 400, "model"),
    ({"model": "chatty"}, 400, "tokens"),
    ({"model": "chatty", "tokens": []}, 400, "tokens"),
    ({"model": "chatty", "tokens": "1 2"}, 400, "tokens"),
    ({"model": "chatty", "tokens": [1, -1]}, 400, "tokens[1]"),
    ({"model": "chatty", "tokens": [1, 2**31]}, 400, "tokens[1]"),
    ({"model": "chatty", "tokens": [1.5]}, 400, "tokens[0]"),
    ({"model": "chatty", "tokens": [True]}, 400, "tokens[0]"),
    ({"model": "chatty", "tokens": ["1"]}, 400, "tokens[0]"),
    ({"model": "nope", "tokens": [1]}, 404, "model"),
])
def test_detokenize_bad_requests_never_reach_the_router(site, router, body, status, param):
    assert_error(call(site, "POST", "/v1/detokenize", body), status, param=param)
    assert router.calls == []


def test_a_backend_without_detokenize_is_501_and_not_retried(site, router):
    from localai_tw.errors import BackendAnswer

    router.fail_with = BackendAnswer("Detokenize on worker w port 1", "UNIMPLEMENTED",
                                     "Method not implemented!")
    response = call(site, "POST", "/v1/detokenize", {"model": "chatty", "tokens": [1]})
    assert_error(response, 501, code="not_implemented_by_backend")
    assert response.header("x-should-retry") == "false"


def test_detokenize_is_post_only(site):
    assert_error(call(site, "GET", "/v1/detokenize"), 405, code="method_not_allowed")


# -- capabilities -------------------------------------------------------------------------------


def test_capabilities_list_every_model_with_what_its_endpoints_accept():
    router = FakeRouter([
        model_config("echo-all"),
        model_config("gen", backend="transformers"),
        model_config("embedder", backend="bert-numpy", embeddings=True),
        model_config("outside", backend="external"),
        model_config("voice", backend="external", known_usecases=["tts", "FLAG_TRANSCRIPT"]),
    ])
    response = call(make_site(router), "GET", "/v1/models/capabilities")
    assert response.status == 200, response.raw_body
    listing = response.json()
    assert listing["object"] == "list"
    entries = {entry["id"]: entry for entry in listing["data"]}
    assert [entry["id"] for entry in listing["data"]] == \
        [m["id"] for m in call(make_site(router), "GET", "/v1/models").json()["data"]]
    assert entries["echo-all"] == {
        "id": "echo-all", "object": "model",
        "capabilities": ["chat", "completion", "embeddings", "rerank", "tokenize"],
        "input_modalities": ["text"], "output_modalities": ["text"]}
    assert entries["gen"]["capabilities"] == ["chat", "completion", "tokenize"]
    assert entries["embedder"]["capabilities"] == ["embeddings", "rerank", "tokenize"]
    assert entries["embedder"]["output_modalities"] == []
    # a backend this package does not ship: what it may be asked, no tokenize promise
    assert entries["outside"]["capabilities"] == ["chat", "completion", "embeddings"]
    # known_usecases adds to what the backend is guessed to do (LocalAI's HasUsecases)
    assert entries["voice"]["capabilities"] == ["chat", "completion", "embeddings",
                                                "transcript", "tts"]
    assert entries["voice"]["input_modalities"] == ["text", "audio"]
    assert entries["voice"]["output_modalities"] == ["text", "audio"]
    assert router.calls == []


def test_capabilities_is_get_only_and_is_not_a_model_named_capabilities(site, router):
    assert_error(call(site, "POST", "/v1/models/capabilities", {}), 405,
                 code="method_not_allowed")
    assert call(site, "GET", "/v1/models/capabilities/").status == 200
    assert_error(call(site, "GET", "/v1/models/capabilities/x"), 404, code="model_not_found")


def test_a_capability_not_listed_is_still_asked_of_the_backend():
    # LocalAI's rule: the list picks and shows, it never refuses; the backend answers
    router = FakeRouter([model_config("gen", backend="transformers"),
                         model_config("embedder", backend="sentence-transformers")])
    site = make_site(router)
    listing = call(site, "GET", "/v1/models/capabilities").json()["data"]
    asks = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            "embeddings": ("/v1/embeddings", {"input": "x"}),
            "rerank": ("/v1/rerank", {"query": "q", "documents": ["a"]})}
    unlisted = 0
    for entry in listing:
        for capability, (path, body) in asks.items():
            unlisted += capability not in entry["capabilities"]
            response = call(site, "POST", path, {"model": entry["id"], **body})
            assert response.status == 200, (entry, path, response.raw_body)
    assert unlisted == 3 and len(router.calls) == 6


# -- routes without /v1 ---------------------------------------------------------------------------


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/chat/completions", chat()),
    ("POST", "/completions", {"model": "chatty", "prompt": "a b"}),
    ("POST", "/embeddings", {"model": "embedder", "input": "a b"}),
    ("GET", "/models", None),
    ("GET", "/models/capabilities", None),
])
def test_localais_unprefixed_routes_answer_as_their_v1_twins(router, method, path, body):
    site = make_site(router, api_keys=APIKeyGuard(["sekrit"]))
    key = {"Authorization": "Bearer sekrit"}
    plain = call(site, method, path, body, headers=key)
    prefixed = call(site, method, "/v1" + path, body, headers=key)
    assert plain.status == prefixed.status == 200, plain.raw_body
    drop = ("id", "created", "embedding")
    strip = lambda d: {k: v for k, v in d.items() if k not in drop}  # noqa: E731
    if path != "/embeddings":
        assert strip(plain.json()) == strip(prefixed.json())
    assert_error(call(site, method, path, body), 401, code="invalid_api_key")


@pytest.mark.parametrize("alias, twin", [
    ("/tts", "/v1/audio/speech"), ("/audio/speech", "/v1/audio/speech"),
    ("/images/generations", "/v1/images/generations")])
def test_the_media_aliases_answer_as_their_v1_twin_whatever_it_is(site, router, alias, twin):
    """The same answer at both paths (a bad request here: no model).  /audio/transcriptions
    parses its form in a thread, so its alias is checked against a real replica
    (tests/integration/test_media_endpoints.py)."""
    plain, prefixed = call(site, "POST", alias, {}), call(site, "POST", twin, {})
    assert plain.status == prefixed.status != 200
    assert plain.json()["error"]["code"] == prefixed.json()["error"]["code"]
    assert router.calls == []


@pytest.mark.parametrize("path", ["/rerank", "/tokenize", "/detokenize"])
def test_paths_localai_serves_only_under_v1_are_not_served_without_it(site, router, path):
    assert call(site, "POST", path, {"model": "chatty", "content": "x"}).status == 404
    assert router.calls == []


@pytest.mark.parametrize("path", ["/models/chatty", "/chat", "/chat/other", "/completions/x"])
def test_other_paths_under_an_unprefixed_root_are_openai_404s(site, router, path):
    assert_error(call(site, "POST", path, {"model": "chatty"}), 404, code="unknown_url")
    assert router.calls == []


def test_an_unprefixed_body_has_the_v1_cap(router):
    site = make_site(router, limit=1024)
    response = call(site, "POST", "/chat/completions", chat(messages=[
        {"role": "user", "content": "x" * 2048}]))
    assert_error(response, 413, "invalid_request_error", code="request_too_large")
    assert router.calls == []


def test_a_chunked_body_over_the_limit_is_an_openai_413_too(router):
    site = make_site(router, limit=1024)
    client = Client(site)
    head = ("POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    client.channel.dataReceived(head.encode())
    chunk = b'{"input": "' + b"z" * 2000 + b'"}'
    client.channel.dataReceived(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    assert_error(client.response(), 413, "invalid_request_error", code="request_too_large")
    assert router.calls == []


def test_unprefixed_requests_count_under_their_v1_label():
    from localai_tw import metrics as replica_metrics
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    counted = replica_metrics.ReplicaMetrics(registry=registry)
    router = FakeRouter([model_config("chatty")])
    root_site = make_site(router)
    root = root_site.resource
    openai = OpenAIResource(router, metrics=counted, now=lambda: 0)
    root.putChild(b"v1", openai)
    for name in (b"chat", b"models"):
        root.putChild(name, openai.unprefixed())
    call(root_site, "POST", "/chat/completions", chat(model="chatty"))
    call(root_site, "POST", "/v1/chat/completions", chat(model="chatty"))
    call(root_site, "GET", "/models/whatever-a-prober-sends")
    samples = {(s.labels["endpoint"], s.labels["status"]): s.value
               for metric in registry.collect() for s in metric.samples
               if s.name == "localai_requests_total"}
    assert samples[("chat", "200")] == 2
    assert samples[("other", "404")] == 1
    assert {endpoint for endpoint, _ in samples} <= {"chat", "other"}


# -- rerank -------------------------------------------------------------------------------------


def test_rerank_answers_the_jina_shape_best_first_with_the_request_texts(site, router):
    body = {"model": "embedder", "query": "q", "documents": ["aa", "a", "aaa"], "top_n": 2}
    response = call(site, "POST", "/v1/rerank", body)
    assert response.status == 200, response.raw_body
    assert response.json() == {
        "model": "embedder",
        "results": [{"index": 2, "document": {"text": "aaa"}, "relevance_score": 0.75},
                    {"index": 0, "document": {"text": "aa"}, "relevance_score": 0.5}],
        "usage": {"total_tokens": 9, "prompt_tokens": 9}}
    [(verb, name, sent)] = router.calls
    assert (verb, name, sent.query, list(sent.documents), sent.top_n) == \
        ("rerank", "embedder", "q", ["aa", "a", "aaa"], 2)
    assert response.header("x-localai-node") == "node-a"


def test_rerank_without_top_n_ranks_every_document_and_clamps_a_large_one(site, router):
    call(site, "POST", "/v1/rerank", {"model": "embedder", "query": "q", "documents": ["a", "b"]})
    call(site, "POST", "/v1/rerank",
         {"model": "embedder", "query": "q", "documents": ["a", "b"], "top_n": 50})
    assert [sent.top_n for _, _, sent in router.calls] == [2, 2]


@pytest.mark.parametrize("body, param", [
    ({"query": "q", "documents": ["a"]}, "model"),
    ({"model": "embedder", "documents": ["a"]}, "query"),
    ({"model": "embedder", "query": "", "documents": ["a"]}, "query"),
    ({"model": "embedder", "query": "q"}, "documents"),
    ({"model": "embedder", "query": "q", "documents": []}, "documents"),
    ({"model": "embedder", "query": "q", "documents": "a"}, "documents"),
    ({"model": "embedder", "query": "q", "documents": ["a", 3]}, "documents[1]"),
    ({"model": "embedder", "query": "q", "documents": ["a", ""]}, "documents[1]"),
    ({"model": "embedder", "query": "q", "documents": ["a"] * 1025}, "documents"),
    ({"model": "embedder", "query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
])
def test_rerank_bad_requests_are_400_and_never_reach_the_router(site, router, body, param):
    assert_error(call(site, "POST", "/v1/rerank", body), 400, param=param)
    assert router.calls == []


def test_rerank_on_a_backend_without_rerank_is_its_unimplemented_answer():
    from localai_tw.errors import BackendAnswer

    router = FakeRouter([model_config("gen", backend="transformers")])
    router.fail_with = BackendAnswer("node-a", "UNIMPLEMENTED", "Method not implemented!")
    body = {"model": "gen", "query": "q", "documents": ["a"]}
    error = assert_error(call(make_site(router), "POST", "/v1/rerank", body), 501,
                         code="not_implemented_by_backend")
    assert "Method not implemented!" in error["message"]
    assert [verb for verb, _, _ in router.calls] == ["rerank"]


def test_a_backend_index_the_request_did_not_have_is_a_500_not_a_crash(site, router):
    router.rerank_answer = [backend_pb2.DocumentResult(index=7, relevance_score=1.0)]
    response = call(site, "POST", "/v1/rerank",
                    {"model": "embedder", "query": "q", "documents": ["a"]})
    assert_error(response, 500, code="bad_backend_answer")
