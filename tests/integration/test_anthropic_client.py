"""The official ``anthropic`` Python client against a real twisted.web Site on loopback, with
the fake IInferenceRouter behind ``/v1/messages``: messages streamed and not, a tool_use turn
then its tool_result turn (streamed and not), refusals as the client's exception classes, and
both ways of presenting the key (``x-api-key``, ``Authorization: Bearer``).

The client is synchronous (httpx), so each call runs in a thread while the reactor serves.
``anthropic`` is in the ``test`` extra: missing, the tests skip locally and fail in CI
(``tests/heavy.py``).
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor, threads

from localai_tw.frontend.api.kit import APIKeyGuard

from tests.heavy import missing, skip_or_fail
from tests.integration.harness_echo import WEIGHTS, echo_model
from tests.integration.inference_harness import ADMIN
from tests.unit.support_anthropic import make_messages_site
from tests.unit.support_openai import FakeRouter, model_config

TOOLS = [{"name": "get_weather", "description": "the weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
CALL = b'{"name": "get_weather", "arguments": {"city": "Oslo"}}'


@pytest.fixture
def anthropic():
    if missing("anthropic"):
        skip_or_fail("the anthropic client is not installed (pip install -e '.[test]')")
    import anthropic
    return anthropic


@pytest.fixture
def router():
    return FakeRouter([model_config("chatty", template={
        "chat_message": "{{.RoleName}}: {{.Content}}", "chat": "{{.Input}}\nassistant:",
        "function": "Tools:{{range .Functions}} {{.Name}}{{end}}\n{{.Input}}"})], node="node-7")


@pytest_twisted.async_yield_fixture
async def server(router):
    site = make_messages_site(router, api_keys=APIKeyGuard(["sk-test"]))
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{port.getHost().port}"
    finally:
        await port.stopListening()


def client(anthropic, base_url: str, key: str | None = "sk-test", **more):
    return anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=10,
                               **more)


def in_thread(fn, *args, **kwargs):
    return threads.deferToThread(fn, *args, **kwargs)


@pytest_twisted.ensureDeferred
async def test_a_message_not_streamed(anthropic, server, router):
    router.answer = "bonjour à tous"

    def ask():
        raw = client(anthropic, server).messages.with_raw_response.create(
            model="chatty", max_tokens=32, system="Be brief.", stop_sequences=["\n\nHuman:"],
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"temperature": 0.1, "top_k": 5})  # no longer in create()'s signature
        return raw.headers.get("x-localai-node"), raw.parse()

    node, message = await in_thread(ask)
    assert node == "node-7"
    assert message.role == "assistant" and message.model == "chatty"
    assert message.content[0].type == "text" and message.content[0].text == "bonjour à tous"
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 3 and message.usage.input_tokens > 0
    options = router.calls[0][2]
    assert options.Prompt.startswith("system: Be brief.\nuser: hi")
    assert list(options.StopPrompts) == ["\n\nHuman:"] and options.Tokens == 32
    assert options.Temperature == pytest.approx(0.1) and options.TopK == 5


@pytest_twisted.ensureDeferred
async def test_a_message_streamed(anthropic, server, router):
    router.stream_pieces = [b"\xf0\x9f", b"\x98\x80 ok", b" d\xc3", b"\xa9j\xc3\xa0"]

    def ask():
        with client(anthropic, server).messages.stream(
                model="chatty", max_tokens=32,
                messages=[{"role": "user", "content": "hi"}]) as stream:
            pieces = list(stream.text_stream)
            return pieces, stream.get_final_message()

    pieces, message = await in_thread(ask)
    assert "".join(pieces) == "😀 ok déjà"
    assert message.content[0].text == "😀 ok déjà"
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 4 and message.usage.input_tokens == 3


@pytest_twisted.ensureDeferred
async def test_a_raw_stream_has_anthropics_event_sequence(anthropic, server, router):
    router.stream_pieces = [b"Hello", b" world"]

    def ask():
        events = client(anthropic, server).messages.create(
            model="chatty", max_tokens=32, stream=True,
            messages=[{"role": "user", "content": "hi"}])
        return [event.type for event in events]

    assert await in_thread(ask) == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]  # the client drops ping


@pytest_twisted.ensureDeferred
async def test_a_tool_use_turn_then_its_tool_result_turn(anthropic, server, router):
    router.answer = CALL.decode()

    def first():
        return client(anthropic, server).messages.create(
            model="chatty", max_tokens=64, tools=TOOLS, tool_choice={"type": "auto"},
            messages=[{"role": "user", "content": "weather in Oslo?"}])

    message = await in_thread(first)
    assert message.stop_reason == "tool_use"
    use = next(block for block in message.content if block.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": "Oslo"}

    router.answer = "Sunny in Oslo."

    def second():
        return client(anthropic, server).messages.create(
            model="chatty", max_tokens=64, tools=TOOLS, messages=[
                {"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": message.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "sunny, 21 C"}]}])

    answer = await in_thread(second)
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "Sunny in Oslo."
    assert "sunny, 21 C" in router.calls[-1][2].Prompt


@pytest_twisted.ensureDeferred
async def test_a_streamed_tool_use(anthropic, server, router):
    router.stream_pieces = [CALL[:20], CALL[20:]]

    def ask():
        with client(anthropic, server).messages.stream(
                model="chatty", max_tokens=64, tools=TOOLS,
                messages=[{"role": "user", "content": "weather in Oslo?"}]) as stream:
            return stream.get_final_message()

    message = await in_thread(ask)
    assert message.stop_reason == "tool_use"
    use, = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Oslo"}


@pytest_twisted.ensureDeferred
async def test_refusals_are_the_clients_exception_classes(anthropic, server, router):
    def ask(key="sk-test", **fields):
        request = {"model": "chatty", "max_tokens": 16,
                   "messages": [{"role": "user", "content": "hi"}], **fields}
        try:
            client(anthropic, server, key).messages.create(**request)
        except anthropic.APIStatusError as e:
            return type(e), e.status_code, e.body
        return None

    kind, status, body = await in_thread(ask, key="sk-wrong")
    assert kind is anthropic.AuthenticationError and status == 401
    assert body["error"]["type"] == "authentication_error"
    kind, status, body = await in_thread(ask, model="nonesuch")
    assert kind is anthropic.NotFoundError and body["error"]["type"] == "not_found_error"
    kind, status, body = await in_thread(ask, thinking={"type": "enabled",
                                                        "budget_tokens": 1024})
    assert kind is anthropic.BadRequestError and "thinking" in body["error"]["message"]
    assert not router.calls


@pytest_twisted.ensureDeferred
async def test_the_key_in_x_api_key(anthropic, server, router):
    router.answer = "ok"

    def ask(key):
        c = client(anthropic, server, None, default_headers={"x-api-key": key})
        try:
            return c.messages.create(model="chatty", max_tokens=8,
                                     messages=[{"role": "user", "content": "hi"}])
        except anthropic.AuthenticationError as e:
            return e.status_code

    assert (await in_thread(ask, "sk-test")).content[0].text == "ok"
    assert await in_thread(ask, "sk-wrong") == 401


@pytest_twisted.ensureDeferred
async def test_a_real_replica_serves_it_through_an_echo_worker(anthropic, cluster):
    """The route table's own rows on a real replica: the key guard, the mount under /v1 and
    at the root, and a real worker's echo backend through the tunnel, streamed and not."""
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", echo_model("echo-chat"))
    frontend = await cluster.frontend("replica-anth")
    await cluster.worker("w-anthropic", frontend)
    base = cluster.base_url(frontend)

    def ask():
        c = client(anthropic, base, ADMIN)
        message = c.messages.create(model="echo-chat", max_tokens=16,
                                    messages=[{"role": "user", "content": "hello there"}])
        with client(anthropic, base, None, default_headers={"x-api-key": ADMIN}) \
                .messages.stream(model="echo-chat", max_tokens=16,
                                 messages=[{"role": "user", "content": "again"}]) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        try:
            client(anthropic, base, "sk-wrong").messages.create(
                model="echo-chat", max_tokens=16, messages=[{"role": "user", "content": "x"}])
        except anthropic.AuthenticationError as e:
            refused = e.body
        return message, streamed, final, refused

    message, streamed, final, refused = await in_thread(ask)
    assert "hello there" in message.content[0].text and message.stop_reason == "end_turn"
    assert message.usage.output_tokens > 0
    assert "again" in streamed and final.content[0].text == streamed
    assert refused["type"] == "error" and refused["error"]["type"] == "authentication_error"

    unprefixed = await treq.post(base + "/messages", json.dumps({
        "model": "echo-chat", "max_tokens": 16,
        "messages": [{"role": "user", "content": "at the root"}]}).encode(),
        headers={"x-api-key": ADMIN, "Content-Type": "application/json"})
    answer = json.loads(await treq.content(unprefixed))
    assert unprefixed.code == 200 and "at the root" in answer["content"][0]["text"]
