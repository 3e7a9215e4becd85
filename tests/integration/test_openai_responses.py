"""The Responses API (``/v1/responses``) driven by the official ``openai`` client against two
real replicas on one PostgreSQL database, with a worker running the ``echo`` backend (it
answers its whole prompt, or the last message with ``use_tokenizer_template``):

- ``responses.create``, ``retrieve``, ``input_items.list`` and ``delete``; a conversation
  continued by ``previous_response_id`` on the OTHER replica (the stored conversation is in the
  database), and one key never reading another key's response;
- streaming (``responses.stream``): the typed event sequence with increasing
  ``sequence_number``, and the streamed response retrievable at once from the other replica;
- function tools (calls read out of the answer, ``function_call_output`` sent back);
- ``responses.parse`` with a pydantic model (``text.format`` json_schema);
- ``background: true`` cancelled through the replica that does not run it;
- fields this server cannot honour refused with OpenAI's error shape.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from twisted.internet import threads

from localai_tw.frontend.api.openai import response_store, responses_api

from .inference_harness import ADMIN
from .support import eventually

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

OTHER = "sk-responses-other"
CALL_TEXT = ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '</tool_call>')
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


async def two_replicas(cluster, tag: str, **models: str):
    """Replica A holds the worker's tunnel; both take ADMIN and OTHER as inference keys.
    ``models``: more model configs (name -> YAML), written before the replicas start."""
    cluster.write_model("echo-chat.yaml", (
        "name: echo-chat\nbackend: echo\nparameters:\n  model: echo\n"
        "template:\n  chat_message: '{{.RoleName}}={{.Content}}'\n  chat: '{{.Input}}'\n"))
    for name, text in models.items():
        cluster.write_model(f"{name}.yaml", f"name: {name}\n{text}")
    keys = {"api-key": [ADMIN, OTHER]}
    a = await cluster.frontend(f"replica-{tag}-a", **keys)
    b = await cluster.frontend(f"replica-{tag}-b", **keys)
    await cluster.worker(f"w-{tag}", a)
    return a, b, cluster.base_url(a) + "/v1", cluster.base_url(b) + "/v1"


def running(frontend) -> list[str]:
    """The background responses a replica runs now."""
    return frontend.replica.responses.runs.running()


def client(base: str, key: str = ADMIN):
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)


@pytest_twisted.ensureDeferred
async def test_create_retrieve_continue_on_another_replica_and_delete(cluster):
    a, b, base_a, base_b = await two_replicas(cluster, "conv")

    def converse():
        first = client(base_a).responses.create(
            model="echo-chat", input="first words", instructions="be brief",
            metadata={"topic": "test"})
        second = client(base_b).responses.create(
            model="echo-chat", input=[{"role": "user", "content": "second words"}],
            previous_response_id=first.id)
        fetched = client(base_b).responses.retrieve(first.id)
        unprefixed = client(cluster.base_url(a)).responses.retrieve(first.id)  # LocalAI's path
        items = client(base_a).responses.input_items.list(second.id)
        many = client(base_a).responses.create(
            model="echo-chat", store=True,
            input=[{"role": "user", "content": str(n)} for n in range(5)])
        page = client(base_b).responses.input_items.list(many.id, order="asc", limit=2)
        rest = client(base_b).responses.input_items.list(many.id, order="asc",
                                                         after=page.last_id)
        try:
            client(base_b, OTHER).responses.retrieve(first.id)
            stranger = None
        except openai.NotFoundError as e:
            stranger = e.status_code
        try:
            client(base_a, OTHER).responses.create(model="echo-chat", input="x",
                                                  previous_response_id=first.id)
            stranger_continues = None
        except openai.NotFoundError as e:
            stranger_continues = (e.status_code, e.body.get("param"))
        client(base_b).responses.delete(first.id)
        try:
            client(base_a).responses.retrieve(first.id)
            after_delete = None
        except openai.NotFoundError as e:
            after_delete = e.status_code
        return (first, second, fetched, items, stranger, stranger_continues, after_delete,
                unprefixed, page, rest)

    (first, second, fetched, items, stranger, stranger_continues, after_delete,
     unprefixed, page, rest) = await threads.deferToThread(converse)
    assert first.status == "completed" and first.object == "response"
    assert first.id.startswith("resp_")
    assert first.output_text.split() == ["system=be", "brief", "user=first", "words"]
    assert first.usage.output_tokens == 4 and first.usage.total_tokens > 4
    assert first.metadata == {"topic": "test"} and first.instructions == "be brief"
    # the second turn, on the other replica: the first turn's input and output, not its
    # instructions (they do not carry over)
    assert second.previous_response_id == first.id
    words = second.output_text.split()
    assert words[:2] == ["user=first", "words"] and "user=second" in words
    assert "system=be" not in words[:1]
    assert fetched.id == first.id and fetched.output_text == first.output_text
    assert unprefixed.id == first.id
    assert [item.type for item in items.data] == ["message"]
    assert items.data[0].content[0].text == "second words"
    assert stranger == 404 and stranger_continues == (404, "previous_response_id")
    assert [i.content[0].text for i in page.data] == ["0", "1"] and page.has_more
    assert [i.content[0].text for i in rest.data] == ["2", "3", "4"] and not rest.has_more
    assert after_delete == 404


@pytest_twisted.ensureDeferred
async def test_stream_event_sequence_and_retrieve_from_the_other_replica(cluster,
                                                                        monkeypatch):
    a, b, base_a, base_b = await two_replicas(cluster, "stream")

    def stream():
        with client(base_a).responses.stream(model="echo-chat", input="one two three") as s:
            events = list(s)
            final = s.get_final_response()
        raw = list(client(base_a).responses.create(model="echo-chat", input="four five",
                                                   stream=True, store=False))
        return events, final, client(base_b).responses.retrieve(final.id), raw

    events, final, fetched, raw = await threads.deferToThread(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.split() == ["user=one", "two", "three"]
    assert final.status == "completed" and final.output_text == text
    assert final.usage.output_tokens == 3
    # stored before response.completed was sent: the other replica has it
    assert fetched.status == "completed" and fetched.output_text == text
    assert [e.type for e in raw][-1] == "response.completed"
    # a stored conversation over the bound is not continued (the bound made tiny here)
    monkeypatch.setattr(responses_api, "MAX_CONVERSATION_BYTES", 10)

    def continue_it():
        try:
            client(base_b).responses.create(model="echo-chat", input="more",
                                            previous_response_id=final.id)
        except openai.BadRequestError as e:
            return e.code, e.param

    assert await threads.deferToThread(continue_it) == (
        "context_length_exceeded", "previous_response_id")


@pytest_twisted.ensureDeferred
async def test_function_tools_and_their_output(cluster):
    a, b, base_a, base_b = await two_replicas(cluster, "tools", **{"echo-tools": (
        "backend: echo\nparameters:\n  model: echo\n"
        "template:\n  use_tokenizer_template: true\ncapabilities: {tools: true}\n")})

    def use_tools():
        api = client(base_b)
        called = api.responses.create(model="echo-tools", input=CALL_TEXT, tools=[WEATHER])
        call = next(item for item in called.output if item.type == "function_call")
        answered = api.responses.create(
            model="echo-tools", tools=[WEATHER], previous_response_id=called.id,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "sunny and warm"}])
        with api.responses.stream(model="echo-tools", input=CALL_TEXT, tools=[WEATHER]) as s:
            events = list(s)
        refused = {}
        for name, extra in (("tools", {"tools": [{"type": "web_search"}]}),
                            ("reasoning", {"reasoning": {"effort": "high"}}),
                            ("truncation", {"truncation": "auto"})):
            try:
                api.responses.create(model="echo-tools", input="x", **extra)
            except openai.BadRequestError as e:
                refused[name] = (e.status_code, e.code, e.param)
        try:
            api.responses.create(model="echo-tools", input="x", extra_body={"bogus": 1})
        except openai.BadRequestError as e:
            refused["bogus"] = (e.status_code, e.code, e.param)
        return called, call, answered, events, refused

    called, call, answered, events, refused = await threads.deferToThread(use_tools)
    assert called.status == "completed"
    assert [item.type for item in called.output] == ["message", "function_call"]
    assert called.output[0].content[0].text == "Checking."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_")
    assert answered.output_text == "sunny and warm"
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    assert kinds[-1] == "response.completed"
    assert refused["tools"] == (400, "unsupported_parameter", "tools[0].type")
    assert refused["reasoning"] == (400, "unsupported_parameter", "reasoning")
    assert refused["truncation"] == (400, "unsupported_parameter", "truncation")
    assert refused["bogus"] == (400, "unknown_parameter", "bogus")


class City(pydantic.BaseModel):
    name: str
    population: int


@pytest_twisted.ensureDeferred
async def test_parse_into_a_pydantic_model(cluster):
    a, b, base_a, base_b = await two_replicas(cluster, "parse", **{"echo-json": (
        "backend: echo\nparameters:\n  model: echo\n"
        "template:\n  use_tokenizer_template: true\ncapabilities: {grammar: true}\n")})

    def parse():
        api = client(base_a)
        parsed = api.responses.parse(model="echo-json", text_format=City,
                                     input='{"name": "Paris", "population": 2100000}')
        try:
            api.responses.parse(model="echo-json", text_format=City, input="not json")
            bad = None
        except openai.APIStatusError as e:
            bad = e.status_code
        return parsed, bad

    parsed, bad = await threads.deferToThread(parse)
    assert parsed.output_parsed == City(name="Paris", population=2100000)
    assert parsed.text.format.type == "json_schema"
    assert bad == 500  # the answer did not match the schema: never passed on as if it did


SLOW = ("backend: echo\nparameters:\n  model: echo\noptions: ['echo.delay_ms:200']\n"
        "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n")
FAST = ("backend: echo\nparameters:\n  model: echo\n"
        "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n")


async def runner(frontends, response_id: str):
    """The replica whose consumer claimed and runs ``response_id``."""
    return await eventually(
        lambda: next((f for f in frontends if response_id in running(f)), None),
        timeout=30, what=f"a replica runs {response_id}")


@pytest_twisted.ensureDeferred
async def test_background_cancelled_through_a_replica_that_does_not_run_it(cluster,
                                                                          monkeypatch):
    a, b, base_a, base_b = await two_replicas(cluster, "bg", **{"echo-slow": SLOW,
                                                               "echo-fast": FAST})
    started = await threads.deferToThread(lambda: client(base_a).responses.create(
        model="echo-slow", input=" ".join(["word"] * 300), background=True))
    assert started.status == "queued" and started.background is True
    running_it = await runner((a, b), started.id)
    other = cluster.base_url(b if running_it is a else a) + "/v1"
    # one key's open background responses are bounded (the bound made 1 here)
    monkeypatch.setattr(response_store, "MAX_OPEN_BACKGROUND_PER_OWNER", 1)

    def one_more():
        try:
            client(base_b).responses.create(model="echo-fast", input="x", background=True)
        except openai.RateLimitError as e:
            return e.status_code, e.code

    assert await threads.deferToThread(one_more) == (429, "too_many_background_responses")
    monkeypatch.undo()
    cancelled = await threads.deferToThread(lambda: client(other).responses.cancel(started.id))
    assert cancelled.status == "cancelled"
    await eventually(lambda: started.id not in running(running_it), timeout=30,
                     what="the run stopped")
    fetched = await threads.deferToThread(lambda: client(base_a).responses.retrieve(started.id))
    assert fetched.status == "cancelled" and fetched.output == []

    done = await threads.deferToThread(lambda: client(base_b).responses.create(
        model="echo-fast", input="quick answer", background=True))

    async def finished():
        got = await threads.deferToThread(lambda: client(base_a).responses.retrieve(done.id))
        return got if got.status == "completed" else None

    got = await eventually(finished, timeout=60, what="the background response completed")
    assert got.output_text.split() == ["quick", "answer"]
    again = await threads.deferToThread(_cancel, base_a, got.id)
    assert again == (200, "completed")  # a finished response is answered as it is


def _cancel(base: str, response_id: str):
    answer = client(base).responses.with_raw_response.cancel(response_id)
    return answer.status_code, answer.parse().status


@pytest_twisted.ensureDeferred
async def test_a_background_response_moves_on_when_its_replica_stops(cluster):
    """On the claim queue: the replica running it stops, another runs it again."""
    a, b, base_a, base_b = await two_replicas(cluster, "move", **{"echo-slow": SLOW})
    c = await cluster.frontend("replica-move-c", **{"api-key": [ADMIN, OTHER]})
    # A holds the worker's tunnel and must stay: only B and C run background responses
    await a.replica.responses.consumer.stopService()
    started = await threads.deferToThread(lambda: client(base_a).responses.create(
        model="echo-slow", input="one two three four five six seven eight", background=True))
    first = await runner((b, c), started.id)
    await first.stopService()

    async def completed():
        got = await threads.deferToThread(
            lambda: client(base_a).responses.retrieve(started.id))
        return got if got.status == "completed" else None

    got = await eventually(completed, timeout=90, what="the response completed elsewhere")
    assert got.output_text.split() == ["one", "two", "three", "four", "five", "six",
                                       "seven", "eight"]
