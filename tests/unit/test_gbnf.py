"""JSON Schema -> GBNF (``localai_tw.localai.gbnf``): the generated grammar is checked by what
it accepts and refuses (``tests/unit/gbnf_matcher.py`` recognises GBNF), every accepted text is
valid under the schema (jsonschema), and everything outside the subset is refused naming the
keyword.  With llama-cpp-python and the tiny GGUF builder, llama.cpp parses each grammar too
(skipped without them, failed under CI=true)."""

from __future__ import annotations

import importlib.util
import json
import os

import jsonschema
import pytest

from localai_tw.localai.gbnf import (
    JSON_OBJECT_GRAMMAR,
    MAX_ITEMS,
    SchemaError,
    literal,
    schema_to_gbnf,
)

from .gbnf_matcher import Grammar

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city"],
    "additionalProperties": False,
}

CASES = [
    # (schema, accepted texts, refused texts)
    (WEATHER,
     ['{"city":"Paris"}', '{"city": "Paris", "unit": "celsius"}',
      '{"city":"Oslo","days":3}', '{"city":"Oslo","unit":"fahrenheit","days":-2}'],
     ['{}', '{"unit":"celsius"}', '{"city":"Paris","unit":"kelvin"}', '{"city":3}',
      '{"days":3,"city":"Oslo"}', '{"city":"Paris",}', '{"city":"Paris","other":1}']),
    ({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}},
     ['{}', '{"a":true}', '{"b":null}', '{"a":false,"b":null}'],
     ['{"a":1}', '{,"b":null}', '{"a":true,}']),
    ({"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
     ['[1]', '[1.5,-2e3]', '[0,1,2]'],
     ['[]', '[1,2,3,4]', '[01]', '["1"]']),
    ({"type": "array", "items": {"type": "integer"}},
     ['[]', '[1,2,3,4,5,6,7,8]'], ['[1.5]', '[1,]']),
    ({"type": ["string", "null"]}, ['"x"', 'null', '"a\\"b\\u00e9"'], ['1', '"\n"']),
    ({"const": {"k": [1, "two"]}}, ['{"k":[1,"two"]}'], ['{"k":[1]}']),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["a", "b"]}]},
     ['12', '"a"'], ['"c"', '1.5']),
    ({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                           "y": {"type": "number"}},
                          "required": ["x", "y"]}},
      "type": "array", "items": {"$ref": "#/$defs/point"}},
     ['[{"x":1,"y":2}]', '[]'], ['[{"x":1}]']),
    ({"type": "object", "additionalProperties": {"type": "integer"}},
     ['{}', '{"a":1,"b":2}'], ['{"a":"x"}']),
    ({"type": "object"}, ['{}', '{"a":{"b":[1,null,true,"x"]}}'], ['[]', '"x"']),
    ({}, ['1', '"x"', '[{}]', 'null'], ['', 'nul']),
    ({"title": "T", "description": "d", "type": "string", "default": "x"}, ['"y"'], ['1']),
]


@pytest.mark.parametrize("schema, accepted, refused", CASES)
def test_the_grammar_accepts_what_the_schema_accepts_and_refuses_the_rest(
        schema, accepted, refused):
    grammar = Grammar(schema_to_gbnf(schema))
    for text in accepted:
        assert grammar.accepts(text), text
        jsonschema.validate(json.loads(text), schema)  # the test's own cases are right
    for text in refused:
        assert not grammar.accepts(text), text


def test_required_properties_come_in_order_and_optional_ones_may_be_left_out():
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in "abcd"},
              "required": ["b", "d"]}
    grammar = Grammar(schema_to_gbnf(schema))
    assert grammar.accepts('{"b":1,"d":2}')
    assert grammar.accepts('{"a":0,"b":1,"c":3,"d":2}')
    assert grammar.accepts('{"b":1,"c":3,"d":2}')
    assert not grammar.accepts('{"b":1}')
    assert not grammar.accepts('{"d":2,"b":1}')


def test_a_prefix_leads_the_grammar():
    grammar = Grammar(schema_to_gbnf({"type": "integer"}, prefix="<tool_call>"))
    assert grammar.accepts("<tool_call>7")
    assert not grammar.accepts("7")


def test_json_object_grammar_is_any_object():
    grammar = Grammar(JSON_OBJECT_GRAMMAR)
    assert grammar.accepts('{"a":[1,{"b":"c"}]}')
    assert not grammar.accepts('[1]')
    assert not grammar.accepts('"x"')


def test_literal_escapes_what_gbnf_needs():
    assert literal('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    assert Grammar(f"root ::= {literal(chr(1) + 'é')}").accepts(chr(1) + "é")


def test_only_rules_in_use_are_emitted():
    text = schema_to_gbnf({"type": "string"})
    assert text == ("root ::= string\nstring ::= " + text.split("string ::= ", 1)[1])
    assert "number" not in text and "value" not in text


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "pattern": "^a$"}, "pattern"),
    ({"type": "string", "format": "date-time"}, "format"),
    ({"type": "integer", "minimum": 0}, "minimum"),
    ({"allOf": [{"type": "string"}]}, "allOf"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}, "maxLength"),
    ({"type": "array", "prefixItems": [{"type": "string"}]}, "prefixItems"),
    ({"type": "array", "items": [{"type": "string"}]}, "items"),
    ({"type": "array", "maxItems": MAX_ITEMS + 1}, "maxItems"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ({"type": "date"}, "type"),
    ({"enum": []}, "enum"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"$ref": "#/$defs/missing"}, "$ref"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
      "$ref": "#/$defs/n"}, "$ref"),
    ({"if": {"type": "string"}}, "if"),
])
def test_outside_the_subset_is_refused_naming_the_keyword(schema, keyword):
    with pytest.raises(SchemaError) as caught:
        schema_to_gbnf(schema)
    assert caught.value.keyword == keyword
    assert keyword in str(caught.value)


@pytest.mark.parametrize("schema", [[1], "string", 3, False, None])
def test_what_is_not_a_schema_is_refused(schema):
    with pytest.raises(SchemaError):
        schema_to_gbnf(schema)


def test_deep_nesting_is_refused_not_a_recursion_error():
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match="deeper"):
        schema_to_gbnf(schema)


def test_many_properties_stay_linear():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                               for i in range(200)}}
    text = schema_to_gbnf(schema)
    assert len(text) < 200 * 200  # quadratic would be ~ 200 * 200 * 20
    small = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}}
    assert Grammar(schema_to_gbnf(small)).accepts('{"p3":1,"p35":2}')


def _need(*modules: str) -> None:
    """Skip when ``modules`` are missing; fail instead under ``CI=true``."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        message = f"llama.cpp's grammar parser needs {', '.join(missing)}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " [failing because CI=true]", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="module")
def llama_vocab(tmp_path_factory):
    """A vocabulary for llama.cpp's grammar parser (it parses GBNF when a grammar sampler is
    made for a vocabulary): the tiny GGUF of ``localai_tw.tinygguf``, loaded vocab-only."""
    _need("llama_cpp", "numpy", "gguf", "localai_tw.tinygguf")
    import llama_cpp

    from localai_tw import tinygguf

    path = str(tmp_path_factory.mktemp("gguf") / "vocab.gguf")
    tinygguf.build(path)
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    yield llm
    llm.close()


def _llama_parses(llm, text: str) -> bool:
    import llama_cpp

    sampler = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, text.encode("utf-8"),
                                                   b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


@pytest.mark.parametrize("schema", [c[0] for c in CASES] + [None])
def test_llama_cpp_parses_the_grammars(schema, llama_vocab):
    text = JSON_OBJECT_GRAMMAR if schema is None else schema_to_gbnf(schema)
    assert _llama_parses(llama_vocab, text)
    assert not _llama_parses(llama_vocab, "root ::= undefined-rule")  # the check can fail
