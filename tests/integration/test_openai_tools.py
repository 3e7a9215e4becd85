"""Tools, JSON modes and log probabilities end to end, driven by the official ``openai``
client through a RELAYING replica: the client talks to replica B, the worker's tunnel is held
by replica A, so every request crosses the relay.

- ``echo`` (a scripted backend: it answers the last message, word by word when streamed):
  tool calls parsed from its answer, non-stream and stream deltas; tools shown through the
  config's ``template.function``; what it cannot honour refused with a 400 naming the model;
  JSON answers validated after generation (a bad one a 500 the client does not retry).
- ``transformers`` with a tiny model whose chat template renders tools (marker ``heavy``):
  the tools reach the template (the prompt grows by their tokens), log probabilities in the
  chat and legacy completions shapes, streamed and not.
- ``llama-cpp`` with a tiny GGUF (marker ``heavy``): a JSON schema and a required tool call
  enforced by the grammar the frontend compiled.  It needs llama-cpp-python and the built-in
  ``llama-cpp`` backend; without them it skips, and with ``CI=true`` it FAILS instead.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from twisted.internet import threads

from .harness_backends import require_extra
from .inference_harness import ADMIN

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL_TEXT = ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '</tool_call>')


async def relaying(cluster, tag: str):
    """Replica A holds the worker's tunnel; the client's base URL is replica B's."""
    a = await cluster.frontend(f"replica-{tag}-a")
    b = await cluster.frontend(f"replica-{tag}-b")
    await cluster.worker(f"w-{tag}", a)
    return cluster.base_url(b) + "/v1"


def client(base: str):
    return openai.OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=120)


@pytest_twisted.ensureDeferred
async def test_tool_calls_from_a_scripted_backend_through_a_relaying_replica(cluster):
    cluster.write_model("echo-tools.yaml", (
        "name: echo-tools\nbackend: echo\nparameters:\n  model: echo\n"
        "template:\n  use_tokenizer_template: true\n"
        "capabilities: {tools: true}\n"))
    cluster.write_model("echo-fn.yaml", (
        "name: echo-fn\nbackend: echo\nparameters:\n  model: echo\n"
        "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"
        "  function: 'tools:{{range .Functions}} {{.Name}}{{end}}. {{.Input}}'\n"))
    base = await relaying(cluster, "tools")

    def use_the_api():
        api = client(base)
        ask = [{"role": "user", "content": CALL_TEXT}]
        raw = api.chat.completions.with_raw_response.create(
            model="echo-tools", messages=ask, tools=[WEATHER, TIME])
        called = raw.parse()
        chunks = list(api.chat.completions.create(model="echo-tools", messages=ask,
                                                  tools=[WEATHER, TIME], stream=True))
        follow_up = api.chat.completions.create(model="echo-tools", tools=[WEATHER], messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None,
             "tool_calls": [c.model_dump() for c in called.choices[0].message.tool_calls]},
            {"role": "tool", "tool_call_id": called.choices[0].message.tool_calls[0].id,
             "content": "sunny and warm"}])
        shown = api.chat.completions.create(
            model="echo-fn", messages=[{"role": "user", "content": "hello"}],
            tools=[WEATHER, TIME])
        refused = {}
        for model, extra in (("echo-fn", {"tool_choice": "required"}),
                             ("echo-fn", {"response_format": {"type": "json_object"}}),
                             ("echo-fn", {"logprobs": True})):
            try:
                api.chat.completions.create(model=model, messages=ask, tools=[WEATHER],
                                            **extra)
            except openai.BadRequestError as e:
                refused[next(iter(extra))] = (e.status_code, e.code, e.param, e.message)
        try:
            api.chat.completions.create(model="echo-fn", messages=ask, tools=[{
                "type": "function", "function": {"name": "f", "parameters": {
                    "type": "object", "properties": {"x": {"type": "bogus"}}}}}])
        except openai.BadRequestError as e:
            refused["schema"] = (e.status_code, e.code, e.param, e.message)
        return raw.headers.get("x-localai-node"), called, chunks, follow_up, shown, refused

    node, called, chunks, follow_up, shown, refused = await threads.deferToThread(use_the_api)
    assert node == "w-tools"
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
    # streamed: the content at once, then the call as OpenAI's deltas
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() == "Checking."
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the tool's result went back as a tool message (echo answers the last message)
    assert follow_up.choices[0].message.content == "sunny and warm"
    assert follow_up.choices[0].finish_reason == "stop"
    # template.function showed the tools to the model (echo answers its whole prompt)
    assert shown.choices[0].message.content == "tools: get_weather get_time. hello"
    for param in ("tool_choice", "response_format", "logprobs"):
        status, code, where, message = refused[param]
        assert (status, code, where) == (400, "unsupported_parameter", param), refused[param]
        assert "'echo-fn'" in message
    status, code, where, message = refused["schema"]
    assert (status, where) == (400, "tools[0].function.parameters")
    assert "not a valid JSON Schema" in message


TOOLS_TEMPLATE = ("{% if tools %}{% for t in tools %}tool {{ t['function']['name'] }} "
                  "{% endfor %}{% endif %}{% for m in messages %}{{ m['role'] }} : "
                  "{{ m['content'] }} {% endfor %}"
                  "{% if add_generation_prompt %}assistant : {% endif %}")


@pytest.mark.heavy
@pytest_twisted.ensureDeferred
async def test_tools_and_logprobs_with_the_transformers_backend(cluster, tmp_path):
    require_extra("torch", "transformers", "tokenizers",
             what="the transformers extra (torch, transformers)")
    from localai_tw.tinychat import build

    directory = str(tmp_path / "tiny-tools")
    await threads.deferToThread(build, directory, 0, TOOLS_TEMPLATE)
    plain_directory = str(tmp_path / "tiny-plain")
    await threads.deferToThread(build, plain_directory)  # its template never reads tools
    for name, where in (("tiny", directory), ("tiny-plain", plain_directory)):
        cluster.write_model(f"{name}.yaml", (
            f"name: {name}\nbackend: transformers\nparameters:\n  model: {where}\n"
            "  temperature: 0\n  max_tokens: 6\ntemplate:\n  use_tokenizer_template: true\n"))
    base = await relaying(cluster, "hf")

    def use_the_api():
        api = client(base)
        ask = [{"role": "user", "content": "hello cat"}]
        plain = api.chat.completions.create(model="tiny", messages=ask)
        with_tools = api.chat.completions.create(model="tiny", messages=ask,
                                                 tools=[WEATHER, TIME])
        scored = api.chat.completions.create(model="tiny", messages=ask, logprobs=True,
                                             top_logprobs=2)
        chunks = list(api.chat.completions.create(model="tiny", messages=ask, logprobs=True,
                                                  top_logprobs=2, stream=True))
        legacy = api.completions.create(model="tiny", prompt="the cat", logprobs=3)
        try:
            api.chat.completions.create(model="tiny-plain", messages=ask, tools=[WEATHER])
            ignored = None
        except openai.BadRequestError as e:
            ignored = (e.status_code, e.code, e.message)
        return plain, with_tools, scored, chunks, legacy, ignored

    plain, with_tools, scored, chunks, legacy, ignored = \
        await threads.deferToThread(use_the_api)
    # a template that never renders tools: refused, not silently ignored
    assert ignored[:2] == (400, "backend_refused_request"), ignored
    assert "does not render tools" in ignored[2]
    # "tool get_weather tool get_time": four more prompt tokens when the tools are rendered
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens + 4
    content = scored.choices[0].logprobs.content
    assert len(content) == scored.usage.completion_tokens == 6
    assert "".join(e.token for e in content).replace(" ", "") == \
        scored.choices[0].message.content.replace(" ", "")
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the likeliest token
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in content]
    legacy_logprobs = legacy.choices[0].logprobs
    assert len(legacy_logprobs.tokens) == len(legacy_logprobs.token_logprobs) == 6
    assert all(len(top) == 3 for top in legacy_logprobs.top_logprobs)
    assert legacy_logprobs.text_offset[0] == 0


@pytest.mark.heavy
@pytest_twisted.ensureDeferred
async def test_json_schema_and_required_tools_are_enforced_by_llama_cpp_grammar(
        cluster, tmp_path):
    require_extra("llama_cpp", "numpy", "gguf",
             what="the llama extra (llama-cpp-python) for the built-in llama-cpp backend")
    require_extra("localai_tw.tinygguf", what="the built-in llama-cpp backend (localai_tw.tinygguf)")
    from localai_tw import tinygguf

    path = str(tmp_path / "tiny.gguf")
    await threads.deferToThread(tinygguf.build, path)
    cluster.write_model("gguf.yaml", (
        f"name: gguf\nbackend: llama-cpp\nparameters:\n  model: {path}\n"
        "  temperature: 0.8\n  max_tokens: 120\ntemplate:\n  use_tokenizer_template: true\n"
        f"context_size: {tinygguf.N_CTX}\n"))
    base = await relaying(cluster, "gguf")
    answer_schema = {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"], "additionalProperties": False}
    clock_tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}}

    def use_the_api():
        api = client(base)
        ask = [{"role": "user", "content": "is it a good day?"}]
        answers = [api.chat.completions.create(
            model="gguf", messages=ask, seed=seed, response_format={
                "type": "json_schema",
                "json_schema": {"name": "verdict", "strict": True, "schema": answer_schema}})
            for seed in (1, 2, 3)]
        objects = api.chat.completions.create(model="gguf", messages=ask, seed=4,
                                              response_format={"type": "json_object"},
                                              max_tokens=60)
        called = api.chat.completions.create(model="gguf", messages=ask, seed=5,
                                             tools=[clock_tool, WEATHER],
                                             tool_choice={"type": "function",
                                                          "function": {"name": "get_time"}})
        scored = api.chat.completions.create(model="gguf", messages=ask, logprobs=True,
                                             top_logprobs=2, max_tokens=4)
        return answers, objects, called, scored

    answers, objects, called, scored = await threads.deferToThread(use_the_api)
    import jsonschema

    for answer in answers:  # a random model, and still only what the schema allows
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), answer_schema)
    if objects.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(objects.choices[0].message.content), dict)
    else:
        assert objects.choices[0].message.content.startswith("{")
    assert called.choices[0].finish_reason == "tool_calls"
    [tool_call] = called.choices[0].message.tool_calls
    assert tool_call.function.name == "get_time"
    assert json.loads(tool_call.function.arguments)["tz"] in ("UTC", "CET")
    assert len(scored.choices[0].logprobs.content) == scored.usage.completion_tokens


@pytest_twisted.ensureDeferred
async def test_json_answers_are_validated_and_a_bad_one_is_not_retried_by_the_client(cluster):
    # echo constrains nothing: the config claims grammar so that the validation after
    # generation is what stands between a wrong answer and the client
    cluster.write_model("echo-json.yaml", (
        "name: echo-json\nbackend: echo\nparameters:\n  model: echo\n"
        "template:\n  use_tokenizer_template: true\ncapabilities: {grammar: true}\n"))
    base = await relaying(cluster, "json")
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}},
        "required": ["name"]}}}

    def use_the_api():
        api = openai.OpenAI(base_url=base, api_key=ADMIN, timeout=60)  # default retries
        good = api.chat.completions.create(
            model="echo-json", response_format=person,
            messages=[{"role": "user", "content": '{"name": "Ada"}'}])
        try:
            api.chat.completions.create(
                model="echo-json", response_format=person,
                messages=[{"role": "user", "content": '{"age": 36}'}])
            bad = None
        except openai.InternalServerError as e:
            bad = (e.status_code, e.code, e.message, e.response.headers.get("x-should-retry"))
        try:
            api.chat.completions.create(
                model="echo-json", messages=[{"role": "user", "content": "x"}],
                response_format={"type": "json_schema", "json_schema": {
                    "name": "r", "schema": {"type": "string", "format": "email"}}})
            uncompilable = None
        except openai.BadRequestError as e:
            uncompilable = (e.status_code, e.code, e.param, e.message)
        return good, bad, uncompilable

    good, bad, uncompilable = await threads.deferToThread(use_the_api)
    assert json.loads(good.choices[0].message.content) == {"name": "Ada"}
    status, code, message, retry = bad
    assert (status, code, retry) == (500, "invalid_model_output", "false")
    assert "'name' is a required property" in message
    status, code, param, message = uncompilable
    assert (status, code, param) == (400, "unsupported_schema",
                                     "response_format.json_schema.schema")
    assert "'format'" in message
