"""The CPU work a request's schemas cause on the reactor is bounded (issue 21 §1): all the
schemas of one request together, a validated schema with its ``$ref`` s expanded, the grammar
one schema compiles to, and the validation of one answer.  Each refusal is a clear 4xx (or, for
an answer, a 500 ``invalid_model_output``) naming the bound."""

from __future__ import annotations

import json
import threading

import pytest
import pytest_twisted

from localai_tw.frontend.api.openai import constraints
from localai_tw.frontend.api.openai.errors import OpenAIError
from localai_tw.localai import gbnf

from .support_openai import FakeRouter, assert_error, call, call_settled, make_site, model_config

FUNCTION_TEMPLATE = "Tools:{{range .Functions}} {{.Name}}{{end}}\n{{.Input}}"


@pytest.fixture
def router():
    return FakeRouter([
        model_config("tooly", template={"chat": "{{.Input}}", "function": FUNCTION_TEMPLATE}),
        model_config("llama", backend="llama-cpp",
                     template={"chat": "{{.Input}}", "function": FUNCTION_TEMPLATE}),
    ])


@pytest.fixture
def site(router):
    return make_site(router)


def chat(model="tooly", **more):
    body = {"model": model, "messages": [{"role": "user", "content": "weather in Paris?"}]}
    body.update(more)
    return body


def tool(i: int, properties: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string", "description": "d"}
                                         for j in range(properties)}}}}


@pytest_twisted.ensureDeferred
async def test_many_tools_together_are_a_400_before_any_is_checked(site, router):
    # 128 tools of 40 properties: each within the per-schema bound, 15 000 values together
    # (128 tools of 1300 properties took 13 s of meta-schema checks on the reactor).
    error = assert_error(call(site, "POST", "/v1/chat/completions", chat(
        tools=[tool(i, 40) for i in range(128)])), 400, param="tools")
    assert f"more than {constraints.MAX_REQUEST_SCHEMA_NODES} values in all" in \
        error["message"]
    # the same tools, fewer of them, are fine (1230 values: planned in the answer-checks
    # thread, constraints.OFFLOAD_SCHEMA_NODES)
    response = await call_settled(site, "POST", "/v1/chat/completions",
                                  chat(tools=[tool(i, 40) for i in range(10)]))
    assert response.status == 200


def doubling(links: int) -> dict:
    """``a0 = anyOf[$ref a1, $ref a1]``, ...: 2 ** links paths to validate, 3 values a link."""
    defs = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/a{i + 1}"}]}
            for i in range(links)}
    defs[f"a{links}"] = {"type": "string"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "$defs": defs}


def test_a_schema_whose_refs_double_is_refused_where_answers_are_validated(
        site, router):
    # 15 links compile to a small grammar, but validating one wrong answer walked 2 ** 15
    # paths (16 links: 11.6 s).
    strict = {"type": "function", "function": {"name": "f", "strict": True,
                                               "parameters": doubling(15)}}
    error = assert_error(call(site, "POST", "/v1/chat/completions", chat(tools=[strict])),
                         400, param="tools[0].function.parameters")
    assert error["code"] == "unsupported_schema"
    assert "with its $refs expanded" in error["message"]
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "d", "schema": doubling(15)}}
    error = assert_error(call(site, "POST", "/v1/chat/completions",
                              chat("llama", response_format=response_format)),
                         400, param="response_format.json_schema.schema")
    assert "with its $refs expanded" in error["message"]
    # a few links are fine
    response_format["json_schema"]["schema"] = doubling(4)
    router.answer = '{"x": "y"}'
    assert call(site, "POST", "/v1/chat/completions",
                chat("llama", response_format=response_format)).status == 200


def test_a_schema_that_compiles_to_a_huge_grammar_is_a_400(site, router):
    # 256 enum strings of 2000 characters under maxItems 64: a 33 MB grammar in 4 s before.
    schema = {"type": "object", "properties": {"x": {
        "type": "array", "maxItems": 64,
        "items": {"enum": ["x" * 2000 + str(i) for i in range(256)]}}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "d", "schema": schema}}
    error = assert_error(call(site, "POST", "/v1/chat/completions",
                              chat("llama", response_format=response_format)),
                         400, param="response_format.json_schema.schema")
    assert error["code"] == "unsupported_schema"
    assert f"longer than {gbnf.MAX_GRAMMAR_CHARS} characters" in error["message"]


def test_maxitems_repetition_is_still_exact():
    grammar = gbnf.schema_to_gbnf({"type": "array", "items": {"type": "integer"},
                                   "minItems": 1, "maxItems": 3})
    assert '( "," ws integer ( "," ws integer )? )?' in grammar


ROWS = {"type": "object", "properties": {"rows": {"type": "array", "items": {
    "type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(20)}}}}}
ROW = {f"k{i}": "v" for i in range(20)}


@pytest_twisted.ensureDeferred
async def test_a_big_answer_is_validated_in_the_answer_checks_thread(monkeypatch):
    # 2000 rows: about 40 000 keyword checks, past the reactor's 2000: validated again in the
    # one answer-checks thread (5 to 9 us a check would hold the reactor 0.2 to 0.4 s).
    plan = constraints.Plan(json_mode="json_schema", schema=ROWS)
    where = []
    first_error = constraints._first_error

    def recording(schema, instance, steps):
        where.append((threading.current_thread() is threading.main_thread(), steps))
        return first_error(schema, instance, steps)

    monkeypatch.setattr(constraints, "_first_error", recording)
    await constraints.check_output(plan, "m", json.dumps({"rows": [ROW] * 2000}), "stop")
    assert where == [(True, constraints.MAX_VALIDATION_STEPS),
                     (False, constraints.MAX_THREAD_VALIDATION_STEPS)]
    bad = [ROW] * 1999 + [dict(ROW, k7=7)]
    with pytest.raises(OpenAIError) as caught:
        await constraints.check_output(plan, "m", json.dumps({"rows": bad}), "stop")
    assert caught.value.code == "invalid_model_output"
    assert "7 is not of type 'string'" in str(caught.value)
    # small answers never leave the reactor
    where.clear()
    await constraints.check_output(plan, "m", json.dumps({"rows": [ROW] * 3}), "stop")
    assert where == [(True, constraints.MAX_VALIDATION_STEPS)]


@pytest_twisted.ensureDeferred
async def test_an_answer_too_big_for_the_thread_too_is_a_500_naming_the_bound(monkeypatch):
    monkeypatch.setattr(constraints, "MAX_THREAD_VALIDATION_STEPS", 20_000)
    plan = constraints.Plan(json_mode="json_schema", schema=ROWS)
    with pytest.raises(OpenAIError) as caught:
        await constraints.check_output(plan, "m", json.dumps({"rows": [ROW] * 2000}), "stop")
    assert caught.value.code == "invalid_model_output"
    assert "too large to be checked against the schema" in str(caught.value)


class _Body:
    def __init__(self, tools):
        self.tools = tools

    def raw(self, name):
        return self.tools if name == "tools" else None


@pytest_twisted.ensureDeferred
async def test_a_request_with_big_schemas_is_planned_in_the_answer_checks_thread():
    # Meta-schema checks cost 17 to 28 us a value: 4000 values would hold the reactor about
    # 0.1 s, so a request past OFFLOAD_SCHEMA_NODES is planned in the one answer-checks thread.
    on_reactor = []

    def plan(body, model):
        on_reactor.append(threading.current_thread() is threading.main_thread())
        return model

    assert await constraints.planned(plan, _Body([tool(0, 3)]), "small") == "small"
    assert await constraints.planned(plan, _Body([tool(i, 40) for i in range(10)]),
                                     "big") == "big"
    assert on_reactor == [True, False]


@pytest.mark.parametrize("items, unique", [
    ([{"a": i} for i in range(5000)], True),
    ([{"a": 1}, {"a": 1.0}], False),            # JSON Schema: 1.0 equals 1
    ([1, True], True),                          # ... but true is not 1
    ([{"a": 1, "b": 2}, {"b": 2, "a": 1}], False),
    ([[1, {"b": 2}], [1, {"b": 2.0}]], False),
    (["x", "y", "x"], False),
])
def test_unique_items_keeps_json_schemas_equality(items, unique):
    # jsonschema compares every pair of objects: 5000 of them took 23.7 s in one keyword check
    # on the reactor; the replacement writes each item once (issue 21 §1).
    schema = {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}
    error = constraints._first_error(schema, {"x": items}, constraints.MAX_THREAD_VALIDATION_STEPS)
    assert (error is None) == unique, error and error.message
    if not unique:
        assert "appears twice" in error.message
