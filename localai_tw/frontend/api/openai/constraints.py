"""What a chat or completions request asks beyond plain text, read, checked against the model's
backend (``localai/capabilities.py``) and turned into ``PredictOptions`` fields, before any
backend is called: tools (``tools``/``tool_choice``/``parallel_tool_calls`` and the legacy
``functions``/``function_call``), structured output (``response_format`` ``json_object`` /
``json_schema``, and LocalAI's ``grammar`` extension: a GBNF text) and log probabilities
(``logprobs``/``top_logprobs``).

The rules (the tables in ``docs/openai-api.md``):

- tools are shown to the model through its chat template: the backend's own
  (``use_tokenizer_template`` on a backend that takes ``Tools``) or the config's
  ``template.function`` (or a ``chat`` template reading ``.Functions``); a model with neither
  is a 400.  ``tool_choice: none`` shows and parses nothing.
- ``tool_choice: required`` or a named function, ``json_object`` and ``json_schema`` are
  enforced by a GBNF grammar (``localai/gbnf.py``), so they need a backend that honours
  ``Grammar``; otherwise a 400 naming the model.  A schema outside the compiled subset, or a
  tool whose ``parameters`` is not a JSON Schema object, is a 400 naming the keyword.
- ``tool_choice: auto`` is constrained where the backend honours ``Grammar``, as LocalAI does:
  a call of one of the tools or of the no-action function (``function.no_action_*``, left out
  with ``function.disable_no_action``), whose call is an answer in words.  Elsewhere (or when
  the tools' schemas fall outside the subset) it is not constrained, never refused.
- ``logprobs`` needs a backend that returns them; otherwise a 400 naming the model.

After generation, :func:`check_output` validates a structured answer with ``jsonschema``: an
answer cut by the token budget (``finish_reason: length``) is returned as it is, as OpenAI
does; any other invalid answer is a 500 ``invalid_model_output`` that clients do not retry.

What this module must never do: send a request whose constraint the backend would ignore,
compile or validate a schema without bounding its depth and size first, or run a regex from a
request.
"""

from __future__ import annotations

import contextvars
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import jsonschema
from jsonschema.exceptions import SchemaError as MetaSchemaError

from localai_tw.localai.capabilities import Capabilities, capabilities_of
from localai_tw.localai.gbnf import JSON_OBJECT_GRAMMAR, SchemaError, schema_to_gbnf
from localai_tw.localai.templates import uses_functions
from localai_tw.localai.toolcalls import FunctionConfig, no_action_tool
from localai_tw.frontend.api.kit import printable
from localai_tw.frontend.api import offload
from localai_tw.frontend.api.openai.errors import NO_RETRY, OpenAIError, invalid

#: Most tools in one request (OpenAI's limit) and deepest schema accepted anywhere.
MAX_TOOLS = 128
MAX_SCHEMA_DEPTH = 48
MAX_SCHEMA_NODES = 4_000
#: Every schema of one request together (tools, functions, response_format): the meta-schema
#: check costs about 20 to 30 us a value on the reactor, so 128 tools of 4000 values each took
#: 13 s before this bound (issue 21 §1); 4000 in all is about 0.1 s at worst.
MAX_REQUEST_SCHEMA_NODES = 4_000
#: A validated schema (strict tool, json_schema) with every ``$ref`` expanded: a chain of
#: ``anyOf: [$ref next, $ref next]`` doubles the validation work per link (16 links: 11.6 s).
MAX_EXPANDED_SCHEMA_NODES = 8_000
#: A request whose schemas hold more values than this is planned (meta-schema checks, grammar
#: compilation: about 17 to 28 us a value, so up to 0.1 s at 4000) in the answer-checks thread
#: (``offload.py``), not on the reactor; smaller ones stay inline.
OFFLOAD_SCHEMA_NODES = 500
#: Keyword checks one answer's validation may make on the reactor (5 to 9 us each with
#: jsonschema's descent, so about 10 to 20 ms at most); an answer that needs more is validated
#: again in the replica's one thread for such work (``offload.py``) with
#: :data:`MAX_THREAD_VALIDATION_STEPS` (a few seconds of that thread), and past those it is a
#: 500 ``invalid_model_output`` naming the bound.
MAX_VALIDATION_STEPS = 2_000
MAX_THREAD_VALIDATION_STEPS = 500_000
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_GRAMMAR_CHARS = 64 * 1024
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict, ...]
    names: tuple[str, ...]
    choice: str                 # "auto", "required" or "function" (a named one)
    forced: str | None = None   # the named function
    parallel: bool = True
    #: With ``auto`` under a grammar: the no-action function's name (its tool is the last of
    #: ``tools``), whose call is an answer in words, not a tool call.
    no_action: str | None = None


@dataclass
class Plan:
    """What one request asks beyond plain text, checked (module docstring)."""

    tools: ToolPlan | None = None
    grammar: str = ""
    json_mode: str | None = None       # "json_object" or "json_schema"
    schema: Mapping[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    options: dict = field(default_factory=dict)   # PredictOptions fields


def _bounded(value: Any, limit: int) -> None:
    """``value`` nests at most ``limit`` deep and holds at most ``MAX_SCHEMA_NODES`` values, so
    the meta-schema check and the compiler do bounded work on the reactor thread."""
    stack, seen = [(value, 0)], 0
    while stack:
        node, at = stack.pop()
        seen += 1
        if seen > MAX_SCHEMA_NODES:
            raise ValueError(f"more than {MAX_SCHEMA_NODES} values in one schema")
        if at > limit:
            raise ValueError(f"nested deeper than {limit}")
        if isinstance(node, Mapping):
            stack.extend((v, at + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, at + 1) for v in node)


def request_schemas_bounded(body) -> int:
    """How many values the schemas a request carries hold together: at most
    :data:`MAX_REQUEST_SCHEMA_NODES` (a walk that stops at the bound, before any schema is
    checked or compiled).  :raises OpenAIError: 400 naming the bound."""
    stack = [body.raw(name) for name in ("tools", "functions", "response_format")]
    if stack[0] is None and stack[1] is None and stack[2] is None:
        return 3  # the walk's answer for three absent values, without its checks
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_REQUEST_SCHEMA_NODES + 3:
            param = next((name for name in ("tools", "functions") if body.raw(name)),
                         "response_format.json_schema.schema")
            raise invalid(f"{param!r} is not a valid JSON Schema: the tools and "
                          f"response_format of one request hold more than "
                          f"{MAX_REQUEST_SCHEMA_NODES} values in all (every key's value, list "
                          "item and nested schema counts); send fewer or smaller schemas",
                          param, code="invalid_value")
        if isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return seen


def _expanded_nodes(root: Mapping) -> int:
    """How many values ``root`` holds with every local ``$ref`` expanded (each target's size
    computed once; a recursive ``$ref`` counts once, validation then follows the answer's own
    depth).  :raises ValueError: past :data:`MAX_EXPANDED_SCHEMA_NODES`."""
    targets = {}
    for section in ("$defs", "definitions"):
        if isinstance(root.get(section), Mapping):
            targets.update({f"#/{section}/{name}": sub for name, sub in root[section].items()})
    sizes: dict[str, int] = {}
    resolving: set[str] = set()

    def size(node: Any) -> int:
        n = 1
        if isinstance(node, Mapping):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref in targets and ref not in resolving:
                if ref not in sizes:
                    resolving.add(ref)
                    sizes[ref] = size(targets[ref])
                    resolving.discard(ref)
                n += sizes[ref]
            for key, value in node.items():
                if node is root and key in ("$defs", "definitions"):
                    continue
                n += 1 if key in _DATA else size(value)
        elif isinstance(node, list):
            n += sum(size(v) for v in node)
        if n > MAX_EXPANDED_SCHEMA_NODES:
            raise ValueError(f"with its $refs expanded it holds more than "
                             f"{MAX_EXPANDED_SCHEMA_NODES} values (answers are validated "
                             "against it)")
        return n

    try:
        return size(root)
    except RecursionError:
        raise ValueError("its $refs chain too deeply to be validated") from None


def check_validated(schema: Mapping, param: str) -> None:
    """A schema answers will be validated against: bounded with its ``$ref`` s expanded.
    :raises OpenAIError: 400 naming ``param``."""
    try:
        _expanded_nodes(schema)
    except ValueError as e:
        raise invalid(f"{param!r} cannot be used: {e}; send a smaller schema", param,
                      code="unsupported_schema") from None


#: Keywords whose value is a regular expression.  A request's regex never runs here: Python's
#: ``re`` backtracks, holds the GIL and cannot be interrupted, so one pattern such as
#: ``^(a+)+$`` against a few dozen characters of model output froze a replica for seconds
#: (issue 21 §1).  Where a schema is validated (strict tools, JSON schema answers) these are
#: refused when the request is read; the validators below cannot run them at all.
REGEX_KEYWORDS = ("pattern", "patternProperties")

#: Keywords whose value maps names to subschemas (a key there is a name, not a keyword), and
#: keywords whose value is data, not a schema.
_NAME_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")
_DATA = ("const", "enum", "default", "examples")


def regex_keyword(schema: Any, path: str = "") -> str | None:
    """The JSON path of the first regex keyword in ``schema``, or None.  The walk is bounded by
    :func:`check_schema`'s limits, which run first."""
    stack = [(schema, path, False)]
    while stack:
        node, at, names = stack.pop()
        if isinstance(node, Mapping):
            if not names:
                for keyword in REGEX_KEYWORDS:
                    if keyword in node:
                        return f"{at}.{keyword}" if at else keyword
            for key, value in node.items():
                if not names and key in _DATA:
                    continue
                stack.append((value, f"{at}.{key}" if at else str(key),
                              not names and key in _NAME_MAPS))
        elif isinstance(node, list) and not names:
            stack.extend((v, f"{at}[{i}]", False) for i, v in enumerate(node))
    return None


def _no_regex(validator, value, instance, schema):
    """Stands in for ``pattern`` and ``patternProperties``: an answer is never matched against
    a request's regex (see :data:`REGEX_KEYWORDS`)."""
    yield jsonschema.exceptions.ValidationError(
        "a schema with a regular expression is not checked here")


class _OutOfSteps(Exception):
    """Validation made :data:`MAX_VALIDATION_STEPS` keyword checks."""


_STEPS: contextvars.ContextVar[list | None] = contextvars.ContextVar("steps", default=None)


def _counted(check):
    """``check`` (a jsonschema keyword function), counted against the steps left."""
    def counted(validator, value, instance, schema):
        left = _STEPS.get()
        if left is not None:
            left[0] -= 1
            if left[0] < 0:
                raise _OutOfSteps()
        return check(validator, value, instance, schema)
    return counted


def _canonical(value: Any) -> Any:
    """``value`` with JSON Schema's equality made plain: an integral float is its integer
    (``1.0`` equals ``1``; ``true`` stays distinct from ``1``, as JSON encodes it)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {key: _canonical(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    return value


def _unique_items(validator, unique, instance, schema):
    """``uniqueItems`` in linear time: jsonschema compares every pair of items that cannot be
    sorted (objects), so 5000 objects took 23.7 s in one keyword check on the reactor (issue
    21 §1).  Each item is written once as canonical JSON and looked up in a set; the items
    count against the steps left."""
    if not unique or not validator.is_type(instance, "array"):
        return
    left = _STEPS.get()
    if left is not None:
        left[0] -= len(instance)
        if left[0] < 0:
            raise _OutOfSteps()
    seen = set()
    for item in instance:
        key = json.dumps(_canonical(item), sort_keys=True, separators=(",", ":"))
        if key in seen:
            yield jsonschema.exceptions.ValidationError(
                f"{printable(key, 80)} appears twice, and the items must be unique")
            return
        seen.add(key)


def _first_error(schema: Mapping, instance: Any, steps: int):
    """The best validation error of ``instance`` under ``schema`` or None, within ``steps``
    keyword checks.  :raises _OutOfSteps:"""
    token = _STEPS.set([steps])
    try:
        return jsonschema.exceptions.best_match(
            _validator_class(schema)(schema).iter_errors(instance))
    finally:
        _STEPS.reset(token)


async def _validate(schema: Mapping, instance: Any, reactor):
    """:func:`_first_error`: on the reactor within :data:`MAX_VALIDATION_STEPS`, else in the
    answer-checks thread within :data:`MAX_THREAD_VALIDATION_STEPS`.  :raises _OutOfSteps:"""
    try:
        return _first_error(schema, instance, MAX_VALIDATION_STEPS)
    except _OutOfSteps:
        pass
    if reactor is None:
        from twisted.internet import reactor
    return await offload.run(reactor, _first_error, schema, instance,
                             MAX_THREAD_VALIDATION_STEPS)


def _validator_class(schema: Mapping):
    """The schema's own ``$schema`` draft, else Draft 7: its meta-schema check is about five
    times cheaper than 2020-12's (work done on the reactor thread), and every keyword of the
    compiled subset means the same in both (``$defs`` is reached as a JSON pointer).  Its
    regex keywords never run (:func:`_no_regex`); ``format`` is not asserted (no format
    checker is given), as JSON Schema's default is.  Every keyword check is counted
    (:func:`_first_error`), so no answer costs more than :data:`MAX_VALIDATION_STEPS`."""
    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    if base not in _WITHOUT_REGEX:
        checks = {keyword: _counted(check) for keyword, check in base.VALIDATORS.items()}
        checks.update({keyword: _counted(_no_regex) for keyword in REGEX_KEYWORDS})
        if "uniqueItems" in checks:
            checks["uniqueItems"] = _counted(_unique_items)
        _WITHOUT_REGEX[base] = jsonschema.validators.extend(base, checks)
    return _WITHOUT_REGEX[base]


_WITHOUT_REGEX: dict = {}


def check_schema(schema: Any, param: str, *, object_only: bool) -> dict:
    """``schema`` as a JSON Schema (checked against its meta-schema, depth bounded).
    :raises OpenAIError: 400 naming ``param``."""
    if not isinstance(schema, dict):
        raise invalid(f"{param!r} must be a JSON Schema object", param, code="invalid_value")
    try:
        _bounded(schema, MAX_SCHEMA_DEPTH)
        _validator_class(schema).check_schema(schema)
    except (ValueError, MetaSchemaError) as e:
        why = e.message if isinstance(e, MetaSchemaError) else str(e)
        raise invalid(f"{param!r} is not a valid JSON Schema: {printable(why, 300)}", param,
                      code="invalid_value") from None
    if object_only and schema.get("type", "object") != "object":
        raise invalid(f"{param!r} must be a JSON Schema of type 'object' (the arguments of a "
                      "function are an object)", param, code="invalid_value")
    return schema


def _grammar(schema: Any, param: str, prefix: str = "") -> str:
    try:
        return schema_to_gbnf(schema, prefix=prefix)
    except SchemaError as e:
        raise invalid(f"{param!r} cannot be enforced: {printable(str(e), 400)}; see the JSON "
                      f"Schema subset in docs/openai-api.md", param,
                      code="unsupported_schema") from None


def _refuse(model: str, param: str, why: str) -> OpenAIError:
    return invalid(f"model {printable(model)!r} cannot honour {param!r}: {why}", param,
                   code="unsupported_parameter")


# -- tools ----------------------------------------------------------------------------------------


def read_tools(body) -> tuple[list[dict], Any]:
    """The request's tools in OpenAI's shape (legacy ``functions`` converted) and its tool
    choice (legacy ``function_call`` converted).  :raises OpenAIError: 400 naming the field."""
    tools_raw, choice = body.raw("tools"), body.raw("tool_choice")
    functions_raw, function_call = body.raw("functions"), body.raw("function_call")
    if tools_raw is not None and functions_raw is not None:
        raise invalid("send 'tools' or the legacy 'functions', not both", "functions",
                      code="invalid_value")
    param = "tools"
    if functions_raw is not None:
        param = "functions"
        if not isinstance(functions_raw, list):
            raise invalid("'functions' must be a list", "functions", code="invalid_type")
        tools_raw = [{"type": "function", "function": f} for f in functions_raw]
        if choice is None and function_call is not None:
            choice = function_call if isinstance(function_call, str) else \
                {"type": "function", "function": function_call}
    elif function_call is not None and choice is None:
        choice = function_call
    if tools_raw is None:
        tools_raw = []
    if not isinstance(tools_raw, list):
        raise invalid("'tools' must be a list", "tools", code="invalid_type")
    if len(tools_raw) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} tools are accepted", param, code="invalid_value")
    tools, seen = [], set()
    for index, tool in enumerate(tools_raw):
        where = f"{param}[{index}]"
        if param == "functions":
            where_fn = where
            function = tool["function"]
        else:
            where_fn = f"{where}.function"
            if not isinstance(tool, dict):
                raise invalid(f"{where!r} must be an object", where, code="invalid_type")
            if tool.get("type", "function") != "function":
                raise invalid(f"'{where}.type' must be 'function' (the only tool type served)",
                              f"{where}.type", code="invalid_value")
            function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where_fn!r} must be an object with a name", where_fn,
                          code="invalid_type")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise invalid(f"'{where_fn}.name' must be 1 to 64 letters, digits, _ . : or -",
                          f"{where_fn}.name", code="invalid_value")
        if name in seen:
            raise invalid(f"'{where_fn}.name' {name!r} is given twice", f"{where_fn}.name",
                          code="invalid_value")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"'{where_fn}.description' must be a string",
                          f"{where_fn}.description", code="invalid_type")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        else:
            check_schema(parameters, f"{where_fn}.parameters", object_only=True)
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"'{where_fn}.strict' must be true or false", f"{where_fn}.strict",
                          code="invalid_type")
        if strict:
            where = regex_keyword(parameters)
            if where is not None:
                raise invalid(f"'{where_fn}.parameters' of a strict tool cannot use "
                              f"{where.rsplit('.', 1)[-1]!r} (at {printable(where, 200)}): the "
                              "arguments of strict tools are validated, and a request's "
                              "regular expression never runs here (docs/openai-api.md)",
                              f"{where_fn}.parameters", code="unsupported_schema")
            check_validated(parameters, f"{where_fn}.parameters")
        clean = {"name": name, "parameters": parameters}
        if description:
            clean["description"] = description
        if strict is not None:
            clean["strict"] = strict
        tools.append({"type": "function", "function": clean})
    return tools, choice


def read_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    """``tool_choice`` as ("none" | "auto" | "required" | "function", the named function)."""
    if choice is None:
        return ("auto" if names else "none"), None
    if not names and choice != "none":
        raise invalid("'tool_choice' is only allowed when 'tools' are given", "tool_choice",
                      code="invalid_value")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                          "tool_choice", code="invalid_value")
        if choice == "required" and not names:
            raise invalid("'tool_choice' is 'required' but no tools were given",
                          "tool_choice", code="invalid_value")
        return choice, None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if choice.get("type", "function") == "function" and isinstance(name, str):
            if name not in names:
                raise invalid(f"'tool_choice' names {printable(name, 64)!r}, which is not "
                              "one of the tools given", "tool_choice", code="invalid_value")
            return "function", name
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice",
                  code="invalid_value")


def _rebased(schema: Any, prefix: str, defs: dict) -> Any:
    """``schema`` with its ``$defs``/``definitions`` moved into ``defs`` under ``prefix`` and
    its ``$ref`` s rewritten to match (a function's parameters inside the call schema)."""
    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in ("$defs", "definitions") and node is schema and isinstance(value, dict):
                for name, sub in value.items():
                    defs[f"{prefix}{name}"] = walk(sub)
                continue
            if key == "$ref" and isinstance(value, str):
                match = re.fullmatch(r"#/(?:\$defs|definitions)/([^/]+)", value)
                out[key] = f"#/$defs/{prefix}{match.group(1)}" if match else value
                continue
            out[key] = walk(value)
        return out
    return walk(schema)


def call_schema(tools: list[dict], config: FunctionConfig, forced: str | None,
                parallel: bool) -> dict:
    """The JSON Schema of the answer when a call is required: ``{"name": ..., "arguments":
    {...}}`` for one of the tools (the config's key names), or a list of them when parallel."""
    defs: dict = {}
    options = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        if forced is not None and function["name"] != forced:
            continue
        arguments = _rebased(function["parameters"], f"f{index}-", defs)
        options.append({
            "type": "object",
            "properties": {config.name_key: {"const": function["name"]},
                           config.arguments_key: arguments},
            "required": [config.name_key, config.arguments_key],
        })
    call = options[0] if len(options) == 1 else {"oneOf": options}
    schema = {"anyOf": [call, {"type": "array", "items": call, "minItems": 1}]} \
        if parallel else dict(call)
    if defs:
        schema["$defs"] = defs
    return schema


def _auto_grammar(tools: list[dict], functions: FunctionConfig, parallel: bool) -> str:
    """LocalAI's grammar for ``tool_choice: auto``: a call to one of ``tools`` (the request's,
    and the no-action function unless the config disables it).  Empty when a tool's
    parameters fall outside the compiled subset: ``auto`` then runs unconstrained, as before,
    rather than refusing a request that asked for nothing to be enforced."""
    schema = call_schema(tools, functions, None, functions.parallel_calls and parallel)
    try:
        return schema_to_gbnf(schema, prefix=functions.grammar_prefix)
    except SchemaError:
        return ""


# -- the plan -------------------------------------------------------------------------------------


def _response_format(body, model: str, caps: Capabilities, plan: Plan) -> None:
    response_format = body.mapping("response_format")
    if response_format is None:
        return
    kind = response_format.get("type")
    if kind == "text":
        return
    if kind not in ("json_object", "json_schema"):
        raise invalid("'response_format.type' must be 'text', 'json_object' or "
                      "'json_schema'", "response_format.type", code="invalid_value")
    schema = None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("'response_format.json_schema' must be an object with name and "
                          "schema", "response_format.json_schema", code="invalid_type")
        name = spec.get("name")
        if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
            raise invalid("'response_format.json_schema.name' must be 1 to 64 letters, "
                          "digits, _ or -", "response_format.json_schema.name",
                          code="invalid_value")
        if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
            raise invalid("'response_format.json_schema.strict' must be true or false",
                          "response_format.json_schema.strict", code="invalid_type")
        schema = check_schema(spec.get("schema", {}), "response_format.json_schema.schema",
                              object_only=False)
        check_validated(schema, "response_format.json_schema.schema")
        grammar = _grammar(schema, "response_format.json_schema.schema")
    else:
        grammar = JSON_OBJECT_GRAMMAR
    if not caps.grammar:
        raise _refuse(model, "response_format", f"{kind} is enforced by a grammar, and this "
                      "model's backend does not constrain its output (see \"What each backend "
                      "honours\" in docs/openai-api.md)")
    plan.json_mode, plan.schema, plan.grammar = kind, schema, grammar


def _request_grammar(body, model: str, caps: Capabilities, plan: Plan) -> None:
    """LocalAI's ``grammar`` extension: a GBNF grammar given by the request itself (the backend
    parses it: one that does not parse is its 400 ``backend_refused_request``)."""
    grammar = body.string("grammar")
    if not grammar:
        return
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise invalid(f"'grammar' is longer than {MAX_GRAMMAR_CHARS} characters", "grammar",
                      code="invalid_value")
    if not caps.grammar:
        raise _refuse(model, "grammar", "its backend does not constrain its output")
    if plan.grammar:
        raise invalid("'grammar' cannot be combined with a JSON response_format or a required "
                      "tool call (each is a grammar of its own)", "grammar",
                      code="invalid_value")
    plan.grammar = grammar


async def planned(plan, body, *args, reactor=None, **kwargs) -> Plan:
    """``plan(body, *args, **kwargs)`` (:func:`plan_chat` or :func:`plan_completion`): inline
    when the request's schemas are small, else in the answer-checks thread
    (:data:`OFFLOAD_SCHEMA_NODES`).  :raises OpenAIError:"""
    if request_schemas_bounded(body) <= OFFLOAD_SCHEMA_NODES:
        return plan(body, *args, **kwargs)
    if reactor is None:
        from twisted.internet import reactor
    return await offload.run(reactor, plan, body, *args, **kwargs)


def plan_chat(body, model: str, view) -> Plan:
    """The checked plan of a chat request for the model ``view`` (a ``ModelView``).
    :raises OpenAIError: 400 for whatever the model cannot honour or the request got wrong."""
    caps = capabilities_of(view.backend, view.capabilities,
                           grammar_disabled=view.functions.grammar_disabled)
    request_schemas_bounded(body)
    plan = Plan()
    tools, choice_raw = read_tools(body)
    names = [t["function"]["name"] for t in tools]
    choice, forced = read_choice(choice_raw, names)
    parallel = body.boolean("parallel_tool_calls")
    _response_format(body, model, caps, plan)
    if tools and choice != "none":
        param = "tools" if body.has("tools") else "functions"
        if view.templates.use_tokenizer_template:
            if not caps.tools:
                raise _refuse(model, param, "its backend renders the chat template itself and "
                              "does not take tools into it (set capabilities.tools in its "
                              "config if it does)")
        elif not uses_functions(view.templates):
            raise _refuse(model, param, "its config has no template.function (and its chat "
                          "template does not read .Functions), so the tools cannot be shown "
                          "to the model")
        if plan.json_mode is not None:
            raise invalid("'response_format' json modes and tools cannot be combined here "
                          "(both need the grammar); send tool_choice: none or a text "
                          "response_format", "response_format", code="unsupported_parameter")
        functions = view.functions
        if choice in ("required", "function") and not caps.grammar:
            raise _refuse(model, "tool_choice", f"{choice_raw!r:.80} is enforced by a "
                          "grammar, and this model's backend does not constrain its output")
        grammar, no_action = "", None
        if choice in ("required", "function"):
            schema = call_schema(tools, functions, forced,
                                 functions.parallel_calls and parallel is not False)
            where = f"tools[{names.index(forced)}].function.parameters" if forced else "tools"
            grammar = _grammar(schema, where, functions.grammar_prefix)
        elif caps.grammar and not body.string("grammar"):
            # LocalAI: auto is a grammar over the tools plus the no-action function; a tool
            # of that name keeps its own meaning (its calls stay tool calls).
            extra = [] if functions.disable_no_action or functions.no_action_name in names \
                else [no_action_tool(functions)]
            grammar = _auto_grammar([*tools, *extra], functions, parallel is not False)
            if grammar and extra:
                no_action = functions.no_action_name
                tools = [*tools, *extra]
        plan.grammar = grammar or plan.grammar
        plan.tools = ToolPlan(tuple(tools), tuple(t["function"]["name"] for t in tools),
                              choice, forced, parallel if parallel is not None else True,
                              no_action)
        plan.options["Tools"] = json.dumps(tools, separators=(",", ":"), ensure_ascii=False)
        plan.options["ToolChoice"] = json.dumps(
            choice_raw if choice_raw is not None else "auto", separators=(",", ":"))
    _request_grammar(body, model, caps, plan)
    if plan.grammar:
        plan.options["Grammar"] = plan.grammar
    _logprobs_chat(body, model, caps, plan)
    return plan


def _logprobs_chat(body, model: str, caps: Capabilities, plan: Plan) -> None:
    wanted = bool(body.boolean("logprobs"))
    top = body.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs",
                      code="invalid_value")
    if wanted:
        if not caps.logprobs:
            raise _refuse(model, "logprobs", "its backend does not return log probabilities")
        plan.logprobs, plan.top_logprobs = True, top or 0
        plan.options.update(Logprobs=1, TopLogprobs=plan.top_logprobs)


def plan_completion(body, model: str, view, *, echo: bool) -> Plan:
    """The checked plan of a completions request: ``response_format`` as for chat (LocalAI
    accepts it there too), legacy ``logprobs`` (an integer, 0 to 5); tools are refused."""
    caps = capabilities_of(view.backend, view.capabilities,
                           grammar_disabled=view.functions.grammar_disabled)
    request_schemas_bounded(body)
    plan = Plan()
    for name in ("tools", "functions", "tool_choice", "function_call"):
        value = body.raw(name)
        if value not in (None, [], "none"):
            raise invalid(f"{name!r} is a chat feature; send it to /v1/chat/completions",
                          name, code="unsupported_parameter")
    _response_format(body, model, caps, plan)
    _request_grammar(body, model, caps, plan)
    if plan.grammar:
        plan.options["Grammar"] = plan.grammar
    top = body.integer("logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if top is not None:
        if not caps.logprobs:
            raise _refuse(model, "logprobs", "its backend does not return log probabilities")
        if echo:
            raise invalid("'logprobs' with 'echo' would need the prompt's log probabilities, "
                          "which backends do not return; send one of them", "logprobs",
                          code="unsupported_parameter")
        plan.logprobs, plan.top_logprobs = True, top
        plan.options.update(Logprobs=1, TopLogprobs=top)
    return plan


# -- after generation -----------------------------------------------------------------------------


_TOO_BIG = (f"the answer is too large to be checked against the schema within "
            f"{MAX_THREAD_VALIDATION_STEPS} keyword checks (docs/openai-api.md); ask for a "
            "smaller one")


def invalid_output(model: str, why: str) -> OpenAIError:
    return OpenAIError(500, f"model {printable(model)!r} answered outside the requested "
                       f"format: {printable(why, 400)}", "server_error",
                       code="invalid_model_output", headers=NO_RETRY)


async def check_output(plan: Plan, model: str, text: str, finish_reason: str,
                       reactor=None) -> None:
    """Validate a structured answer (module docstring; small answers on the reactor, big ones
    in the answer-checks thread: :func:`_validate`).  :raises OpenAIError: 500."""
    if plan.json_mode is None or finish_reason == "length":
        return
    try:
        value = json.loads(text)
    except ValueError as e:
        raise invalid_output(model, f"not JSON ({e})") from None
    if plan.json_mode == "json_object":
        if not isinstance(value, dict):
            raise invalid_output(model, "not a JSON object")
        return
    try:
        error = await _validate(plan.schema, value, reactor)
    except _OutOfSteps:
        raise invalid_output(model, _TOO_BIG) from None
    if error is not None:
        raise invalid_output(model, f"{error.message} (at {error.json_path})")


async def check_calls(plan: Plan, model: str, calls, reactor=None) -> None:
    """The arguments of each call to a ``strict`` tool must be valid under its parameters
    (OpenAI's promise for strict tools; a grammar enforces it when a call is required, this
    checks it always).  :raises OpenAIError: 500 ``invalid_model_output``."""
    if plan.tools is None:
        return
    strict = {t["function"]["name"]: t["function"]["parameters"] for t in plan.tools.tools
              if t["function"].get("strict")}
    for call in calls:
        schema = strict.get(call.name)
        if schema is None:
            continue
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            raise invalid_output(model, f"the arguments of the call to strict tool "
                                 f"{call.name!r} are not JSON") from None
        try:
            error = await _validate(schema, arguments, reactor)
        except _OutOfSteps:
            raise invalid_output(model, f"the arguments of the call to strict tool "
                                 f"{call.name!r}: {_TOO_BIG}") from None
        if error is not None:
            raise invalid_output(model, f"the arguments of the call to strict tool "
                                 f"{call.name!r}: {error.message} (at {error.json_path})")


def logprobs_content(raw: bytes) -> list[dict]:
    """``Reply.logprobs`` (LocalAI's JSON: ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs"}]}``) as OpenAI's ``logprobs.content`` entries; malformed is empty."""
    if not raw:
        return []
    try:
        data = json.loads(raw)
    except ValueError:
        return []
    entries = data.get("content") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return []
    return [_entry(e, top=True) for e in entries if isinstance(e, dict)]


def _entry(entry: dict, top: bool) -> dict:
    token = str(entry.get("token", ""))
    raw_bytes = entry.get("bytes")
    out = {"token": token, "logprob": float(entry.get("logprob", 0.0)),
           "bytes": raw_bytes if isinstance(raw_bytes, list) else list(token.encode("utf-8"))}
    if top:
        tops = entry.get("top_logprobs") or []
        out["top_logprobs"] = [_entry(t, top=False) for t in tops if isinstance(t, dict)]
    return out


def legacy_logprobs(content: list[dict], offset: int = 0) -> dict:
    """Chat-shaped logprobs entries as the completions API's legacy ``logprobs`` object."""
    tokens, logprobs, tops, offsets = [], [], [], []
    at = offset
    for entry in content:
        tokens.append(entry["token"])
        logprobs.append(entry["logprob"])
        tops.append({t["token"]: t["logprob"] for t in entry.get("top_logprobs", [])})
        offsets.append(at)
        at += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}


__all__ = ["Plan", "ToolPlan", "call_schema", "planned", "check_calls", "check_output", "check_schema",
           "legacy_logprobs", "logprobs_content", "plan_chat", "plan_completion", "read_tools"]
