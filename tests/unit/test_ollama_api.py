"""Ollama's API over a fake router, raw HTTP through the route table's rows: the key checked
before the body and answered in Ollama's shape, the listener's refusals in that shape too,
each field honoured or refused (``docs/ollama-api.md``), the "load" requests, a failure after a
stream started, and the translation of requests into the shared turn's OpenAI-shaped body.
"""

from __future__ import annotations

import base64
import json

import pytest
import pytest_twisted

from localai_tw.errors import BackendAnswer
from localai_tw.frontend.api.jsonbody import INLINE_JSON_VALUES
from localai_tw.frontend.api.kit import APIKeyGuard
from localai_tw.frontend.api.ollama import translate

from tests.unit.support_ollama import make_ollama_site
from tests.unit.support_openai import Client, FakeRouter, call, call_settled, model_config

KEY = {"Authorization": "Bearer sk-1"}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()


@pytest.fixture
def router():
    return FakeRouter([
        model_config("chatty", template={"chat_message": "{{.RoleName}}: {{.Content}}",
                                         "chat": "{{.Input}}"}),
        model_config("embedder", embeddings=True),
    ])


@pytest.fixture
def site(router):
    return make_ollama_site(router, APIKeyGuard(["sk-1"]))


def chat(**more):
    return {"model": "chatty", "messages": [{"role": "user", "content": "hi"}],
            "stream": False, **more}


def error_of(response, status: int) -> str:
    assert response.status == status, response.raw_body
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


# -- the key, the listener, methods ----------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/api/embed",
                                  "/api/embeddings", "/api/show"])
def test_the_key_is_checked_before_the_body_in_ollamas_shape(site, router, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        client = Client(site)
        client.channel.dataReceived((
            f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: 100000\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
            .encode("latin-1"))
        response = client.response()  # answered with no body byte sent
        message = error_of(response, 401)
        assert "wrong" not in message
        assert response.header("www-authenticate") == "Bearer"
    assert router.calls == []


@pytest.mark.parametrize("path", ["/api/tags", "/api/ps", "/api/version"])
def test_gets_need_the_key_too(site, path):
    error_of(call(site, "GET", path), 401)
    assert call(site, "GET", path, headers=KEY).status == 200


def test_without_a_configured_key_the_api_is_open_as_v1_is(router):
    site = make_ollama_site(router, APIKeyGuard([]))
    assert call(site, "GET", "/api/tags").status == 200


def test_a_body_over_the_cap_is_a_413_in_ollamas_shape(site, router):
    response = call(site, "POST", "/api/show", {"model": "x" * 70000}, headers=KEY)
    error_of(response, 413)


def test_methods_and_paths(site):
    response = call(site, "GET", "/api/chat", headers=KEY)
    error_of(response, 405)
    assert response.header("allow") == "POST"
    error_of(call(site, "POST", "/api/version", {}, headers=KEY), 405)
    error_of(call(site, "POST", "/api/chat/more", chat(), headers=KEY), 404)
    assert call(site, "HEAD", "/api/version", headers=KEY).status == 200


def test_a_body_that_is_not_json_is_a_400(site):
    error_of(call(site, "POST", "/api/chat", raw=b"{nope", headers=KEY), 400)


# -- fields honoured or refused ---------------------------------------------------------------


@pytest.mark.parametrize("options,named", [
    ({"num_ctx": 4096}, "options.num_ctx"),  # chatty sets no context_size
    ({"repeat_penalty": -1}, "options.repeat_penalty"),
    ({"mirostat": 3}, "options.mirostat"),
    ({"tfs_z": 1.0}, "options.tfs_z"),
    ({"penalize_newline": True}, "options.penalize_newline"),
    ({"num_gpu": 1}, "options.num_gpu"),
    ({"use_mmap": True}, "options.use_mmap"),
    ({"frobnicate": 1}, "options.frobnicate"),
    ({"temperature": "hot"}, "options.temperature"),
    ({"top_k": 1.5}, "options.top_k"),
    ({"stop": [1]}, "options.stop"),
    ({"num_predict": -3}, "options.num_predict"),
])
def test_options_not_honoured_are_refused_by_name(site, router, options, named):
    assert named in error_of(call(site, "POST", "/api/chat", chat(options=options),
                                  headers=KEY), 400)
    assert router.calls == []


@pytest.mark.parametrize("path,body,named", [
    ("/api/chat", chat(think=True), "think"),
    ("/api/chat", chat(logprobs=True), "logprobs"),
    ("/api/chat", chat(keep_alive="soon"), "keep_alive"),
    ("/api/chat", chat(format="yaml"), "format"),
    ("/api/chat", chat(tools="all"), "tools"),
    ("/api/chat", chat(unknown=1), "unknown"),
    ("/api/chat", chat(messages=[{"role": "robot", "content": "x"}]), "role"),
    ("/api/chat", chat(messages=[{"role": "user", "content": "x", "images": ["%%%"]}]),
     "messages[0].images[0]"),
    ("/api/generate", {"model": "chatty", "prompt": "x", "template": "{{.Prompt}}"},
     "template"),
    ("/api/generate", {"model": "chatty", "prompt": "x", "raw": True}, "raw"),
    ("/api/generate", {"model": "chatty", "prompt": "x", "suffix": "y"}, "suffix"),
    ("/api/generate", {"model": "chatty", "prompt": "x", "context": [1, 2]}, "context"),
    ("/api/generate", {"model": "chatty", "prompt": "x", "stream": "yes"}, "stream"),
    ("/api/embed", {"model": "embedder", "input": "x", "truncate": True}, "truncate"),
    ("/api/embed", {"model": "embedder", "input": "x", "dimensions": 2}, "dimensions"),
    ("/api/embed", {"model": "embedder", "input": "x", "options": {"num_ctx": 9}},
     "options.num_ctx"),
    ("/api/embed", {"model": "embedder", "input": [1, 2]}, "input"),
    ("/api/embeddings", {"model": "embedder", "prompt": 3}, "prompt"),
    ("/api/show", {"model": "chatty", "extra": 1}, "extra"),
])
def test_fields_not_honoured_are_refused_by_name(site, router, path, body, named):
    assert named in error_of(call(site, "POST", path, body, headers=KEY), 400)
    assert router.calls == []


def test_an_unknown_model_is_a_404_naming_it(site, router):
    assert "nope" in error_of(call(site, "POST", "/api/chat", chat(model="nope"),
                                   headers=KEY), 404)
    assert "nope" in error_of(call(site, "POST", "/api/embed",
                                   {"model": "nope:latest", "input": "x"}, headers=KEY), 404)
    # a tag other than latest is part of the name
    error_of(call(site, "POST", "/api/chat", chat(model="chatty:7b"), headers=KEY), 404)


def test_the_load_requests_answer_at_once(site, router):
    loaded = call(site, "POST", "/api/chat", chat(messages=[]), headers=KEY).json()
    assert loaded["done"] is True and loaded["done_reason"] == "load"
    assert loaded["message"] == {"role": "assistant", "content": ""}
    generated = call(site, "POST", "/api/generate", {"model": "chatty"}, headers=KEY).json()
    assert generated["done_reason"] == "load" and generated["response"] == ""
    error_of(call(site, "POST", "/api/generate", {"model": "nope"}, headers=KEY), 404)
    empty = call(site, "POST", "/api/embeddings", {"model": "embedder", "prompt": ""},
                 headers=KEY).json()
    assert empty == {"embedding": []}
    assert router.calls == []


def test_images_reach_the_backend(site, router):
    body = chat(messages=[{"role": "user", "content": "what?", "images": [PNG]}])
    assert call(site, "POST", "/api/chat", body, headers=KEY).status == 200
    assert list(router.calls[0][2].Images) == [PNG]
    body = {"model": "chatty", "prompt": "what?", "images": [PNG], "stream": False}
    assert call(site, "POST", "/api/generate", body, headers=KEY).status == 200
    assert list(router.calls[1][2].Images) == [PNG]


def test_a_failure_after_the_stream_started_is_an_error_line(site, router):
    router.manual_streams = True
    client = Client(site).send("POST", "/api/chat", chat(stream=True), headers=KEY)
    stream, = router.streams
    stream.start()
    stream.push(b"par")
    stream.fail(BackendAnswer("node-a", "INTERNAL", "CUDA out of memory"))
    response = client.response()
    assert response.status == 200 and response.complete
    assert response.header("content-type").startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.raw_body.decode().splitlines() if line]
    assert lines[0]["message"]["content"] == "par" and lines[0]["done"] is False
    assert set(lines[-1]) == {"error"} and "CUDA out of memory" in lines[-1]["error"]


def test_the_last_streamed_line_carries_counts_and_durations(site, router):
    router.manual_streams = True
    client = Client(site).send("POST", "/api/generate",
                               {"model": "chatty", "prompt": "x"}, headers=KEY)
    stream, = router.streams
    stream.start()
    stream.push(b"a", tokens=1, prompt_tokens=5)
    stream.push(b"b", tokens=2, prompt_tokens=5)
    stream.end()
    lines = [json.loads(line) for line in client.response().raw_body.decode().splitlines()]
    assert [line["response"] for line in lines] == ["a", "b", ""]
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] == "stop"
    assert (last["prompt_eval_count"], last["eval_count"]) == (5, 2)
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[key], int) and last[key] >= 0
    assert last["created_at"] == "2023-11-14T22:13:20Z"


# -- translation -------------------------------------------------------------------------------


def test_options_and_format_map_onto_the_openai_body():
    translated = translate.chat_request({
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "options": {"temperature": 0.2, "top_p": 0.9, "top_k": 10, "min_p": 0.05,
                    "seed": 3, "stop": "END", "presence_penalty": 0.1,
                    "frequency_penalty": 0.2, "num_predict": 12},
        "format": {"type": "object"}, "keep_alive": "1h30m"}, "m")
    body = translated.body
    assert translated.stream is True and translated.predict == {} and not translated.num_ctx
    assert body["temperature"] == 0.2 and body["top_k"] == 10 and body["seed"] == 3
    assert body["stop"] == ["END"] and body["max_tokens"] == 12
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    body = translate.chat_request({"model": "m", "messages": [],
                                   "options": {"num_predict": -1}, "format": "json"}, "m").body
    assert "max_tokens" not in body and body["response_format"] == {"type": "json_object"}


def test_sampling_options_beyond_the_openai_body_reach_the_backend(router):
    router.configs["sized"] = model_config("sized", context_size=1024)
    site = make_ollama_site(router, APIKeyGuard(["sk-1"]))
    options = {"repeat_penalty": 1.2, "repeat_last_n": 32, "typical_p": 0.8, "mirostat": 2,
               "mirostat_tau": 4.0, "mirostat_eta": 0.2, "num_ctx": 512}
    assert call(site, "POST", "/api/chat", chat(model="sized", options=options),
                headers=KEY).status == 200
    sent = router.calls[0][2]
    assert (sent.Penalty, sent.Repeat, sent.Mirostat) == (pytest.approx(1.2), 32, 2)
    assert sent.TypicalP == pytest.approx(0.8) and sent.MirostatTAU == pytest.approx(4.0)
    assert sent.MirostatETA == pytest.approx(0.2)
    message = error_of(call(site, "POST", "/api/chat", chat(model="sized",
                                                            options={"num_ctx": 2048}),
                            headers=KEY), 400)
    assert "options.num_ctx" in message and "1024" in message
    assert len(router.calls) == 1


def test_tool_calls_both_ways():
    messages = translate.chat_messages([
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "ok", "tool_name": "f"}])
    call = messages[0]["tool_calls"][0]
    assert call["type"] == "function" and json.loads(call["function"]["arguments"]) == {"a": 1}
    assert messages[1]["name"] == "f"

    class Call:
        id, name, arguments = "call_1", "f", '{"a": 1}'

    assert translate.tool_calls_out([Call()]) == [
        {"id": "call_1", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}]


def test_model_names():
    known = {"a", "b:7b", "c:latest"}.__contains__
    assert translate.model_name("a:latest", known) == "a"
    assert translate.model_name("a", known) == "a"
    assert translate.model_name("b:7b", known) == "b:7b"
    assert translate.model_name("c:latest", known) == "c:latest"
    assert translate.model_name("z:latest", known) == "z:latest"
    assert translate.display_name("a") == "a:latest"
    assert translate.display_name("b:7b") == "b:7b"


@pytest.mark.parametrize("value", [None, 0, -1, 300, 1.5, "5m", "0", "-1", "1h30m", "10s",
                                   "250ms"])
def test_keep_alive_durations_are_accepted(value):
    translate.check_keep_alive(value)


@pytest.mark.parametrize("value", [True, "soon", "5 m", "m", [], "1" * 80])
def test_keep_alive_that_is_not_a_duration_is_refused(value):
    with pytest.raises(translate.Refused):
        translate.check_keep_alive(value)


def test_image_media_types():
    assert translate.image_url(PNG, "x").startswith("data:image/png;base64,")
    jpeg = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\0" * 8).decode()
    assert translate.image_url(jpeg, "x").startswith("data:image/jpeg;base64,")


def test_a_router_failure_is_answered_in_ollamas_shape_without_its_insides(site, router):
    router.fail_with = RuntimeError("secret /srv/models/internal detail")
    message = error_of(call(site, "POST", "/api/chat", chat(), headers=KEY), 500)
    assert "secret" not in message and "Traceback" not in message
    router.fail_with = None
    missing = error_of(call(site, "POST", "/api/chat", chat(model="nope"), headers=KEY), 404)
    assert missing.count("not found") <= 1, missing


@pytest_twisted.ensureDeferred
async def test_a_big_body_is_decoded_off_the_reactor_and_answered_by_the_endpoint(site):
    body = chat(options={"stop": ["x"] * (INLINE_JSON_VALUES + 10)})
    response = await call_settled(site, "POST", "/api/chat", body, headers=KEY)
    assert "options.stop" in error_of(response, 400)  # not the listener's 413


def test_a_client_that_leaves_a_stream_cancels_the_backend_call(site, router):
    router.manual_streams = True
    client = Client(site).send("POST", "/api/generate", {"model": "chatty", "prompt": "x"},
                               headers=KEY)
    stream, = router.streams
    stream.start()
    stream.push(b"a")
    client.disconnect()
    assert stream.cancelled
