"""JSON Schema -> GBNF: the grammar llama.cpp (``PredictOptions.Grammar``) samples under, so
``response_format: json_schema``, ``json_object`` and ``tool_choice: required`` / a named
function are enforced while the model generates, not only checked afterwards.

The subset compiled (anything else is a :class:`SchemaError` naming the keyword and where it
is, answered as a 400 by the API, so a schema is never half-enforced in silence):

- ``type``: ``object``, ``array``, ``string``, ``number``, ``integer``, ``boolean``, ``null``,
  or a list of them (any of);
- ``object``: ``properties`` (generated in the order given), ``required`` (each must be a listed
  property), ``additionalProperties`` (``false``; or, without ``properties``, a schema or
  ``true`` for the values of free keys).  Properties not listed are never generated, which every
  ``additionalProperties`` setting allows;
- ``array``: ``items`` (one schema), ``minItems``, ``maxItems`` (at most :data:`MAX_ITEMS`);
- ``enum`` and ``const`` (any JSON values), ``anyOf`` / ``oneOf`` (alternatives: ``oneOf``'s
  "exactly one" is left to the validation after generation);
- ``$ref`` to ``#/$defs/NAME`` or ``#/definitions/NAME`` of the root schema, without cycles;
- annotations, ignored: ``title``, ``description``, ``default``, ``examples``, ``$comment``,
  ``$schema``, ``$id``, ``deprecated``, ``readOnly``, ``writeOnly``, ``$defs``,
  ``definitions``, and ``strict``;
- ``{}`` or ``true``: any JSON value.

The grammar writes compact JSON (at most one space after ``:`` and ``,``), so a model cannot
spend its tokens on whitespace.  Rules are named ``root`` and ``r<N>`` / ``ref-<name>``; the
JSON primitives (``string``, ``number``, ...) are shared rules.

What this module must never do: follow a ``$ref`` outside the schema (no URL, no file), loop on
a recursive schema, or produce a grammar larger than :data:`MAX_RULES` rules or
:data:`MAX_GRAMMAR_CHARS` characters for any input: a request chooses the schema, and the
compiler runs on the reactor, so its work must stay linear in the schema and small (a 500 KB
schema of 256 long ``enum`` strings under ``maxItems: 64`` compiled to a 33 MB grammar in 4 s
before the bound, issue 21 §1).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

#: Deepest schema nesting compiled, most rules one grammar may hold, most array items a
#: ``minItems``/``maxItems`` may ask for, most alternatives of an ``enum``.
MAX_DEPTH = 32
MAX_RULES = 2000
MAX_ITEMS = 64
MAX_ENUM = 256
MAX_PROPERTIES = 256
#: Longest grammar text one schema may compile to (the backend parses it again: llama.cpp's
#: own limit is far above what a sane schema needs).
MAX_GRAMMAR_CHARS = 256 * 1024

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id",
    "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict",
})
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
#: Keywords the compiler acts on, by the type they belong to.
_OBJECT_KEYS = {"properties", "required", "additionalProperties"}
_ARRAY_KEYS = {"items", "minItems", "maxItems"}
_GENERAL_KEYS = {"type", "enum", "const", "anyOf", "oneOf", "$ref"}
_SUPPORTED = _OBJECT_KEYS | _ARRAY_KEYS | _GENERAL_KEYS

#: The JSON primitives every grammar may use (only those referred to are emitted).
PRIMITIVES = {
    "ws": '| " "',
    "value": "object | array | string | number | boolean | null",
    "object": '"{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}"',
    "array": '"[" ws ( value ( "," ws value )* )? "]"',
    "string": r'"\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F] '
              r'[0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] ) )* "\""',
    "number": '"-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?',
    "integer": '"-"? ( "0" | [1-9] [0-9]* )',
    "boolean": '"true" | "false"',
    "null": '"null"',
}
_PRIMITIVE_USES = {
    "value": ("object", "array", "string", "number", "boolean", "null"),
    "object": ("ws", "string", "value"), "array": ("ws", "value"),
}


class SchemaError(ValueError):
    """A schema outside the compiled subset (or not a schema); ``keyword`` names the keyword
    and ``where`` the JSON pointer of the schema that holds it."""

    def __init__(self, message: str, *, keyword: str | None = None, where: str = "#"):
        super().__init__(f"{message} (at {where})")
        self.keyword = keyword
        self.where = where


_ESCAPES = {ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r",
            ord("\t"): "\\t", 0x7F: "\\x7F",
            **{c: f"\\x{c:02X}" for c in range(0x20) if chr(c) not in "\n\r\t"}}


def literal(text: str) -> str:
    """``text`` as a GBNF string literal (one ``str.translate``: linear, in C)."""
    return '"' + text.translate(_ESCAPES) + '"'


def json_literal(value: Any) -> str:
    """A JSON value's compact text as a GBNF literal (``const``/``enum`` members)."""
    return literal(json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                              sort_keys=False))


_RULE_NAME = re.compile(r"[^A-Za-z0-9]+")


class _Compiler:
    def __init__(self, root: Any):
        self.root = root
        self.rules: dict[str, str] = {}
        self.used: set[str] = set()
        self.refs: dict[str, str] = {}   # "#/$defs/X" -> rule name
        self.resolving: list[str] = []   # $ref stack, for cycles
        self.counter = 0
        self.size = 0                    # characters of the rules and literals made so far

    def grow(self, chars: int) -> None:
        """Count ``chars`` more characters of grammar; :raises SchemaError: past the bound.
        Every rule body and literal is counted when made (an inline expression is counted
        again when its rule is stored: at most twice, still linear)."""
        self.size += chars
        if self.size > MAX_GRAMMAR_CHARS:
            raise SchemaError(f"the schema compiles to a grammar longer than "
                              f"{MAX_GRAMMAR_CHARS} characters; send a smaller schema (fewer "
                              "or shorter enum values, smaller maxItems)")

    def fresh(self, body: str) -> str:
        if len(self.rules) >= MAX_RULES:
            raise SchemaError(f"the schema needs more than {MAX_RULES} grammar rules")
        self.grow(len(body))
        self.counter += 1
        name = f"r{self.counter}"
        self.rules[name] = body
        return name

    def literal_of(self, value: Any) -> str:
        text = json_literal(value)
        self.grow(len(text))
        return text

    def use(self, primitive: str) -> str:
        self.used.add(primitive)
        return primitive

    def compile(self, schema: Any, where: str, depth: int) -> str:
        """A GBNF expression (a rule name or an alternation in parentheses) for ``schema``."""
        if depth > MAX_DEPTH:
            raise SchemaError(f"the schema is nested deeper than {MAX_DEPTH}", where=where)
        if schema is True or schema == {}:
            return self.use("value")
        if schema is False:
            raise SchemaError("the schema false admits no value", where=where)
        if not isinstance(schema, Mapping):
            raise SchemaError("a schema must be an object or a boolean", where=where)
        for key in schema:
            if not isinstance(key, str):
                raise SchemaError("schema keys must be strings", where=where)
            if key not in _SUPPORTED and key not in ANNOTATIONS:
                raise SchemaError(f"the keyword {key!r} is not supported for constrained "
                                  f"output (supported: {', '.join(sorted(_SUPPORTED))})",
                                  keyword=key, where=where)
        if "$ref" in schema:
            others = set(schema) - ANNOTATIONS - {"$ref"}
            if others:
                raise SchemaError("$ref beside other keywords is not supported",
                                  keyword=sorted(others)[0], where=where)
            return self.ref(schema["$ref"], where, depth)
        if "const" in schema:
            return self.literal_of(schema["const"])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError("enum must be a non-empty list", keyword="enum", where=where)
            if len(values) > MAX_ENUM:
                raise SchemaError(f"enum holds more than {MAX_ENUM} values", keyword="enum",
                                  where=where)
            return "( " + " | ".join(self.literal_of(v) for v in values) + " )"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{key} must be a non-empty list of schemas",
                                      keyword=key, where=where)
                rest = set(schema) - ANNOTATIONS - {key}
                if rest:
                    raise SchemaError(f"{key} beside other keywords is not supported",
                                      keyword=sorted(rest)[0], where=where)
                parts = [self.compile(s, f"{where}/{key}/{i}", depth + 1)
                         for i, s in enumerate(options)]
                return "( " + " | ".join(parts) + " )"
        kinds = schema.get("type")
        if kinds is None:
            if set(schema) & _OBJECT_KEYS:
                kinds = "object"
            elif set(schema) & _ARRAY_KEYS:
                kinds = "array"
            else:
                return self.use("value")
        if isinstance(kinds, str):
            kinds = [kinds]
        if not isinstance(kinds, list) or not kinds or \
                not all(isinstance(k, str) and k in TYPES for k in kinds):
            raise SchemaError(f"type must be one of {', '.join(TYPES)} or a list of them",
                              keyword="type", where=where)
        parts = [self.typed(kind, schema, where, depth) for kind in dict.fromkeys(kinds)]
        return parts[0] if len(parts) == 1 else "( " + " | ".join(parts) + " )"

    def typed(self, kind: str, schema: Mapping, where: str, depth: int) -> str:
        if kind == "object":
            return self.object(schema, where, depth)
        if kind == "array":
            return self.array(schema, where, depth)
        return self.use(kind)

    def ref(self, target: Any, where: str, depth: int) -> str:
        if not isinstance(target, str):
            raise SchemaError("$ref must be a string", keyword="$ref", where=where)
        match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", target)
        if match is None:
            raise SchemaError(f"$ref {target[:80]!r} is not supported (only #/$defs/NAME and "
                              "#/definitions/NAME of this schema)", keyword="$ref", where=where)
        if target in self.refs:
            return self.refs[target]
        if target in self.resolving:
            raise SchemaError(f"$ref {target[:80]!r} is recursive; recursive schemas are not "
                              "supported", keyword="$ref", where=where)
        section = self.root.get(match.group(1)) if isinstance(self.root, Mapping) else None
        name = match.group(2).replace("~1", "/").replace("~0", "~")
        if not isinstance(section, Mapping) or name not in section:
            raise SchemaError(f"$ref {target[:80]!r} names no definition in the schema",
                              keyword="$ref", where=where)
        self.resolving.append(target)
        try:
            body = self.compile(section[name], target, depth + 1)
        finally:
            self.resolving.pop()
        rule = "ref-" + (_RULE_NAME.sub("-", name).strip("-")[:40] or "x")
        while rule in self.rules:
            rule += "-x"
        if len(self.rules) >= MAX_RULES:
            raise SchemaError(f"the schema needs more than {MAX_RULES} grammar rules")
        self.grow(len(body))
        self.rules[rule] = body
        self.refs[target] = rule
        return rule

    def object(self, schema: Mapping, where: str, depth: int) -> str:
        properties = schema.get("properties")
        required = schema.get("required", [])
        additional = schema.get("additionalProperties", True)
        if properties is None:
            properties = {}
        if not isinstance(properties, Mapping):
            raise SchemaError("properties must be an object", keyword="properties",
                              where=where)
        if len(properties) > MAX_PROPERTIES:
            raise SchemaError(f"more than {MAX_PROPERTIES} properties", keyword="properties",
                              where=where)
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError("required must be a list of property names", keyword="required",
                              where=where)
        missing = [r for r in required if r not in properties]
        if missing:
            raise SchemaError(f"required names {missing[0][:64]!r}, which is not in "
                              "properties", keyword="required", where=where)
        if not isinstance(additional, (bool, Mapping)):
            raise SchemaError("additionalProperties must be a boolean or a schema",
                              keyword="additionalProperties", where=where)
        if not properties:
            if additional is False:
                return literal("{") + " ws " + literal("}")
            if additional is True or additional == {}:
                return self.use("object")
            value = self.compile(additional, f"{where}/additionalProperties", depth + 1)
            pair = f'{self.use("string")} ":" ws {value}'
            self.use("ws")
            return self.fresh(f'"{{" ws ( {pair} ( "," ws {pair} )* )? "}}"')
        pairs = []
        for key, sub in properties.items():
            value = self.compile(sub, f"{where}/properties/{key}", depth + 1)
            pairs.append((f'{literal(json.dumps(key, ensure_ascii=False))} ":" ws {value}',
                          key in required))
        self.use("ws")
        # A[i]: the properties from i on when one was already written (each behind a comma);
        # S[i]: the same when none was written yet.  One rule each keeps the grammar linear.
        after = ""
        start = ""
        for i in range(len(pairs) - 1, -1, -1):
            pair, needed = pairs[i]
            taken = f"{pair} {after}".strip()
            if needed:
                start = taken
            else:
                start = f"( {taken} | {start} )" if start else f"( {taken} )?"
            start = self.fresh(start) if i else start
            item = f'"," ws {pair}' if needed else f'( "," ws {pair} )?'
            after = self.fresh(f"{item} {after}".strip())
        return self.fresh(f'"{{" ws {start} "}}"')

    def array(self, schema: Mapping, where: str, depth: int) -> str:
        items = schema.get("items", True)
        if isinstance(items, list):
            raise SchemaError("items as a list (tuple validation) is not supported",
                              keyword="items", where=where)
        low = schema.get("minItems", 0)
        high = schema.get("maxItems")
        for key, value in (("minItems", low), ("maxItems", high)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SchemaError(f"{key} must be a non-negative integer", keyword=key,
                                  where=where)
            if value > MAX_ITEMS:
                raise SchemaError(f"{key} above {MAX_ITEMS} is not supported", keyword=key,
                                  where=where)
        if high is not None and high < low:
            raise SchemaError("maxItems is below minItems", keyword="maxItems", where=where)
        item = self.compile(items, f"{where}/items", depth + 1)
        self.use("ws")
        more = f'"," ws {item}'
        if high == 0:
            return self.fresh('"[" ws "]"')
        optional = 0 if high is None else high - max(low, 1)
        # the item is written once per required and optional place: count before building
        self.grow(len(more) * (max(low, 1) + optional))
        first = [item] + [more] * max(0, low - 1)
        if high is None:
            tail = f"( {more} )*"
        else:  # ( more ( more ( more )? )? )?, built in one pass
            tail = "".join(f"( {more} " for _ in range(optional)) + \
                " ".join(")?" for _ in range(optional))
        body = " ".join(first) + (f" {tail}" if tail else "")
        if low == 0:
            body = f"( {body} )?"
        return self.fresh(f'"[" ws {body} "]"')

    def grammar(self, prefix: str = "") -> str:
        root = self.compile(self.root, "#", 0)
        head = (literal(prefix) + " " if prefix else "") + root
        lines = [f"root ::= {head}"]
        reachable = _reachable(head, self.rules)
        lines += [f"{name} ::= {body}" for name, body in self.rules.items()
                  if name in reachable]
        needed = {p for p in self.used if p in reachable}
        while True:
            grown = needed | {u for p in needed for u in _PRIMITIVE_USES.get(p, ())}
            if grown == needed:
                break
            needed = grown
        lines += [f"{name} ::= {PRIMITIVES[name]}" for name in PRIMITIVES if name in needed]
        return "\n".join(lines) + "\n"


_LITERALS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9-]*")


def _names(body: str) -> set[str]:
    """The rule names a rule body refers to (its literals and character classes removed)."""
    return set(_WORD.findall(_LITERALS.sub(" ", body)))


def _reachable(head: str, rules: Mapping[str, str]) -> set[str]:
    """Every name reachable from ``head`` through ``rules`` (primitives included as names)."""
    seen: set[str] = set()
    todo = list(_names(head))
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in rules:
            todo.extend(_names(rules[name]))
    return seen


def schema_to_gbnf(schema: Any, *, prefix: str = "") -> str:
    """The GBNF grammar whose sentences are JSON texts ``schema`` accepts (module docstring for
    the subset), optionally led by the literal ``prefix``.  :raises SchemaError:"""
    return _Compiler(schema).grammar(prefix)


#: Any JSON object (``response_format: json_object``).
JSON_OBJECT_GRAMMAR = schema_to_gbnf({"type": "object"})


__all__ = ["JSON_OBJECT_GRAMMAR", "SchemaError", "json_literal", "literal", "schema_to_gbnf"]
