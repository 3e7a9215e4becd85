"""The official ``openai`` Python client against a real twisted.web Site on loopback, with a
fake IInferenceRouter behind it: chat (streamed and not), completions, embeddings, models,
errors as the client's exception classes, and a client that closes a stream mid-way.

The client is synchronous (httpx), so each call runs in a thread while the reactor serves.
Skipped when ``openai`` is not installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import reactor, threads

from localai_tw.frontend.inference.interfaces import NoNodeAvailable
from localai_tw.frontend.api.kit import APIKeyGuard

from tests.integration.support import eventually
from tests.unit.support_openai import FakeRouter, make_site, model_config

openai = pytest.importorskip("openai")


@pytest.fixture
def router():
    return FakeRouter([
        model_config("chatty", template={"chat_message": "{{.RoleName}}: {{.Content}}",
                                         "chat": "{{.Input}}"}),
        model_config("embedder", embeddings=True),
    ], node="node-7")


@pytest_twisted.async_yield_fixture
async def server(router):
    site = make_site(router, api_keys=APIKeyGuard(["sk-test"]))
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{port.getHost().port}/v1"
    finally:
        await port.stopListening()


def client(base_url: str, key: str = "sk-test"):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=10)


def in_thread(fn, *args, **kwargs):
    return threads.deferToThread(fn, *args, **kwargs)


@pytest_twisted.ensureDeferred
async def test_chat_not_streamed(server, router):
    router.answer = "bonjour à tous"

    def ask():
        raw = client(server).chat.completions.with_raw_response.create(
            model="chatty", messages=[{"role": "user", "content": "hi"}], temperature=0.1,
            max_tokens=20, stop=["\n\n"])
        return raw.headers.get("x-localai-node"), raw.parse()

    node, answer = await in_thread(ask)
    assert node == "node-7"
    assert answer.choices[0].message.content == "bonjour à tous"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == 3
    options = router.calls[0][2]
    assert options.Prompt == "user: hi" and list(options.StopPrompts) == ["\n\n"]


@pytest_twisted.ensureDeferred
async def test_chat_streamed_with_split_utf8(server, router):
    router.stream_pieces = [b"\xf0\x9f", b"\x98\x80 ok", b" d\xc3", b"\xa9j\xc3\xa0"]

    def ask():
        stream = client(server).chat.completions.create(
            model="chatty", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True})
        return list(stream)

    chunks = await in_thread(ask)
    roles = [c.choices[0].delta.role for c in chunks if c.choices]
    assert roles[0] == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "😀 ok déjà"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.total_tokens == 7


@pytest_twisted.ensureDeferred
async def test_completions_and_streamed_completion(server, router):
    def ask():
        c = client(server)
        plain = c.completions.create(model="chatty", prompt=["a b", "c"])
        streamed = "".join(chunk.choices[0].text for chunk in
                           c.completions.create(model="chatty", prompt="x", stream=True))
        return plain, streamed

    plain, streamed = await in_thread(ask)
    assert [choice.text for choice in plain.choices] == ["a b", "c"]
    assert streamed == "Hello world"


@pytest_twisted.ensureDeferred
async def test_embeddings_default_and_float(server, router):
    def ask():
        c = client(server)
        default = c.embeddings.create(model="embedder", input=["one", "two words"])
        floats = c.embeddings.create(model="embedder", input="one", encoding_format="float")
        return default, floats

    default, floats = await in_thread(ask)
    assert [d.index for d in default.data] == [0, 1]
    assert len(default.data[0].embedding) == 4
    assert default.data[0].embedding == pytest.approx(floats.data[0].embedding)
    assert default.usage.prompt_tokens == 3
    assert [o.Embeddings for verb, _, o in router.calls] == ["one", "two words", "one"]


@pytest_twisted.ensureDeferred
async def test_models_and_errors_as_client_exceptions(server, router):
    def ask():
        c = client(server)
        ids = [m.id for m in c.models.list()]
        outcomes = {}
        for name, call in {
            "missing": lambda: c.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]),
            "bad-key": lambda: client(server, "sk-wrong").models.list(),
            "bad-type": lambda: c.chat.completions.create(
                model="chatty", messages=[{"role": "user", "content": "x"}],
                extra_body={"temperature": "hot"}),
        }.items():
            try:
                call()
            except openai.APIStatusError as e:
                outcomes[name] = (type(e).__name__, e.status_code, e.code,
                                  (e.body or {}).get("param"))
        return ids, outcomes

    ids, outcomes = await in_thread(ask)
    assert ids == ["chatty", "embedder"]
    assert outcomes == {
        "missing": ("NotFoundError", 404, "model_not_found", "model"),
        "bad-key": ("AuthenticationError", 401, "invalid_api_key", None),
        "bad-type": ("BadRequestError", 400, "invalid_type", "temperature"),
    }


@pytest_twisted.ensureDeferred
async def test_routing_failure_is_503_and_stream_error_event_raises(server, router):
    router.fail_with = NoNodeAvailable("chatty", "no backend node matches")

    def ask():
        try:
            client(server).chat.completions.create(
                model="chatty", messages=[{"role": "user", "content": "x"}])
        except openai.InternalServerError as e:
            return e.status_code, e.code

    assert await in_thread(ask) == (503, "no_node_available")

    router.fail_with = None
    router.manual_streams = True

    def consume():
        stream = client(server).chat.completions.create(
            model="chatty", messages=[{"role": "user", "content": "x"}], stream=True)
        seen = []
        try:
            for chunk in stream:
                seen.append(chunk.choices[0].delta.content)
        except openai.APIError as e:
            return seen, str(e)
        return seen, None

    consuming = in_thread(consume)
    await eventually(lambda: router.streams)
    stream = router.streams[0]
    stream.start()
    stream.push(b"half")
    from localai_tw.errors import TransportFailure
    stream.fail(TransportFailure("the tunnel stream was reset"))
    seen, error = await consuming
    assert seen == ["", "half"]
    assert error and "reset" in error


@pytest_twisted.ensureDeferred
async def test_the_client_does_not_retry_a_deterministic_failure(server, router):
    # The official client retries every 5xx twice by default: a failure the same request
    # would meet again must reach the caller at once, a transient one is still retried.
    from localai_tw.errors import BackendAnswer
    from localai_tw.frontend.inference.interfaces import ModelLoadFailed

    def ask():
        retrying = openai.OpenAI(base_url=server, api_key="sk-test", timeout=10)  # 2 retries
        try:
            retrying.chat.completions.create(
                model="chatty", messages=[{"role": "user", "content": "x"}])
        except openai.APIStatusError as e:
            return e.status_code, e.code

    for error, status, code in [
            (BackendAnswer("n1", "UNKNOWN", "Unexpected ValueError: boom"), 500, "backend_error"),
            (ModelLoadFailed("chatty", "n1", "weights corrupt", retry_in=30), 500,
             "model_load_failed")]:
        router.fail_with, router.calls = error, []
        assert await in_thread(ask) == (status, code)
        assert len(router.calls) == 1, code

    router.fail_with, router.calls = BackendAnswer("n1", "UNAVAILABLE", "restarting"), []
    assert await in_thread(ask) == (503, "backend_unavailable")
    assert len(router.calls) == 3  # retried twice, honouring Retry-After: 1


@pytest_twisted.ensureDeferred
async def test_client_closing_the_stream_cancels_the_backend_call(server, router):
    router.manual_streams = True
    got_first = []

    def consume():
        stream = client(server).chat.completions.create(
            model="chatty", messages=[{"role": "user", "content": "x"}], stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got_first.append(chunk.choices[0].delta.content)
                break
        stream.close()  # closes the HTTP connection mid-stream

    consuming = in_thread(consume)
    await eventually(lambda: router.streams)
    stream = router.streams[0]
    stream.start()
    stream.push(b"first ")
    await consuming
    assert got_first == ["first "]
    await eventually(lambda: stream.cancelled)
