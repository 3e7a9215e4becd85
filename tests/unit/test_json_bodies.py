"""Request bodies read as JSON at a bounded cost to the reactor (``frontend/api/jsonbody.py``):
small bodies decoded inline, big ones in the offload thread with the same answers, too many
arrays and objects a 413 before any decoding, and a route that forgot to prepare a big body
refusing it rather than decoding it on the reactor."""

from __future__ import annotations

import io
import json

import pytest
from twisted.internet import reactor

from localai_tw.frontend.api import jsonbody
from localai_tw.frontend.api.jsonbody import (
    INLINE_JSON_VALUES,
    MAX_JSON_CONTAINERS,
    prepare_json_body,
    read_json_object,
)
from localai_tw.web.errors import APIError

from .support_openai import FakeRouter, assert_error, call, call_settled, make_site, model_config


class _Body(io.BytesIO):
    limit = 8 * 1024 * 1024  # as the listener's capped body of a /v1 route says


class _Request:
    """What the body reader uses of a request: its headers and its content."""

    def __init__(self, body: bytes, content_type: bytes | None = b"application/json"):
        self.content = _Body(body)
        self.headers = {b"content-type": content_type} if content_type else {}

    def getHeader(self, name: bytes):
        return self.headers.get(name.lower())


def _big(**fields) -> bytes:
    """A JSON object past the inline bound: ``tokens`` holds that many numbers."""
    body = {"tokens": [1] * (INLINE_JSON_VALUES + 10), **fields}
    return json.dumps(body).encode()


@pytest.fixture
def site():
    return make_site(FakeRouter([model_config("chatty")]))


def test_a_small_body_is_decoded_inline():
    assert read_json_object(_Request(b'{"a": [1, 2]}')) == {"a": [1, 2]}


def test_a_big_body_is_never_decoded_on_the_reactor_unprepared():
    with pytest.raises(APIError) as caught:
        read_json_object(_Request(_big()))
    assert caught.value.status == 413 and caught.value.code == "request_too_complex"


async def test_a_big_body_is_decoded_off_the_reactor_with_the_same_result():
    request = _Request(_big(model="m"))
    await prepare_json_body(request, reactor)
    decoded = read_json_object(request)
    assert decoded["model"] == "m" and len(decoded["tokens"]) == INLINE_JSON_VALUES + 10


@pytest.mark.parametrize("body, message", [
    (b'{"tokens": [' + b"1," * INLINE_JSON_VALUES + b'1', "not valid JSON"),
    (b'{"a\\u0000": [' + b"1," * INLINE_JSON_VALUES + b'1]}', "NUL"),
    (b'[' + b"1," * INLINE_JSON_VALUES + b'1]', "must be a JSON object"),
    (b'{"x": "\xff", "t": [' + b"1," * INLINE_JSON_VALUES + b'1]}', "not UTF-8"),
], ids=["truncated", "nul", "array", "latin-1"])
async def test_a_big_body_gets_the_same_400s_as_a_small_one(body, message):
    request = _Request(body)
    await prepare_json_body(request, reactor)
    with pytest.raises(APIError) as caught:
        read_json_object(request)
    assert caught.value.status == 400 and message in caught.value.message


def test_too_many_arrays_and_objects_are_413_before_decoding(monkeypatch):
    monkeypatch.setattr(jsonbody, "_decode", lambda *a, **k: pytest.fail("decoded"))
    body = b'{"a": [' + b"[]," * MAX_JSON_CONTAINERS + b'[]]}'
    with pytest.raises(APIError) as caught:
        read_json_object(_Request(body))
    assert caught.value.status == 413 and "split the batch" in caught.value.message


async def test_too_many_arrays_and_objects_through_the_api_is_an_openai_413(site):
    body = {"model": "chatty", "input": [[1]] * (MAX_JSON_CONTAINERS + 1)}
    error = assert_error(await call_settled(site, "POST", "/v1/embeddings", body), 413)
    assert "split the batch" in error["message"]


async def test_a_big_token_batch_through_the_api_is_checked_as_a_small_one(site):
    # 262 145 token ids: past the inline bound, so decoded in the thread; the detokenize
    # bound still answers, in OpenAI's shape.
    response = await call_settled(site, "POST", "/v1/detokenize",
                                  {"model": "chatty", "tokens": [0] * 262145})
    assert_error(response, 400, param="tokens")


def test_an_unprepared_route_gets_the_same_refusal_through_the_api(site):
    # call() runs no reactor: a body the resource prepares waits on the thread, so an
    # answer here would mean it was decoded inline.
    assert call(site, "POST", "/v1/detokenize", {"model": "chatty", "tokens": [0] * 10}
                ).status == 200
