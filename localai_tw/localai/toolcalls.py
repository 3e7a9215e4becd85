"""Tool calls out of model text: the ``function`` section of a model config as this project
acts on it (:class:`FunctionConfig`), :func:`parse_tool_calls` for a whole answer, and
:class:`ToolCallStream`, which decides while a stream runs which text is content (sent at once)
and which may be a tool call (held back until the end, then parsed).

The formats read, in LocalAI's order (``pkg/functions/parse.go``):

1. ``function.replace_function_results`` rewrites the text first (regex -> replacement);
2. ``function.response_regex``: named groups ``name`` / ``arguments`` (the keys
   ``function_name_key`` / ``function_arguments_key`` rename them) give one call per match;
3. otherwise the JSON found in the text: what ``function.json_regex_match`` captures (group 1
   of every match of the first regex that matches), else the tagged forms
   ``<tool_call>{...}</tool_call>`` and ``<function=NAME>{...}</function>``, else every JSON
   object or array in the text.  An object with the name and arguments keys (``name`` and
   ``arguments``; ``parameters`` is read too, as Llama 3.1 writes it, and ``function`` for the
   name, as LocalAI's older grammars wrote it) is one call, an array
   one call per such object.

A backend that parses calls itself and sends them in ``Reply.chat_deltas`` (LocalAI's
llama.cpp backend does) is believed first (:func:`calls_from_deltas`).

A call is kept only when it names one of the request's tools, so a JSON answer that happens to
hold a ``name`` is not taken for a call.  What remains of the text around the calls is the
message content.

What this module must never do: run a regex from a request, or a config's regex with Python's
``re`` (config regexes are RE2, compiled once when the config loads:
:mod:`localai_tw.localai.configregex`), or hold back more than :data:`MAX_HELD_CHARS` of a
stream that is plainly content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from localai_tw.localai.configregex import MAX_REGEX_CHARS, ConfigRegex, GoTemplate, RegexError

#: Longest regex list a config may hold.
MAX_REGEXES = 16
#: Most tool calls read out of one answer, and most places in it where JSON is tried and
#: fails (so a text full of brackets costs linear work, not quadratic).
MAX_CALLS = 64
MAX_MISSES = 64

#: LocalAI's no-action function: offered with the tools when ``tool_choice: auto`` is
#: constrained by a grammar, so the model can answer in words; its ``message`` argument is the
#: answer.  The name and description are LocalAI's defaults.
NO_ACTION_NAME = "answer"
NO_ACTION_DESCRIPTION = "use this action to answer without performing any action"
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

#: The tags that open a tool call in the text (the common tagged forms).
TAGS = ("<tool_call>", "<function=")
#: Most of a stream held back while it may still turn into a tool call tag.
MAX_HELD_CHARS = max(len(t) for t in TAGS)

#: ``function`` keys this project acts on; the others LocalAI knows are accepted with a
#: warning (``docs/models.md``).
ACTED_ON = ("response_regex", "json_regex_match", "function_name_key",
            "function_arguments_key", "replace_function_results", "replace_llm_results",
            "grammar", "disable_no_action", "no_action_function_name",
            "no_action_description_name")
GRAMMAR_ACTED_ON = ("disable", "parallel_calls", "prefix")
LOCALAI_FUNCTION_KEYS = frozenset({
    "argument_regex", "argument_regex_key_name", "argument_regex_value_name",
    "capture_llm_results", "xml_format_preset", "xml_format",
    "automatic_tool_parsing_fallback", "disable_peg_parser",
})
LOCALAI_GRAMMAR_KEYS = frozenset({
    "disable_parallel_new_lines", "mixed_mode", "no_mixed_free_string",
    "expect_strings_after_json", "properties_order", "schema_type", "triggers",
})


class FunctionConfigError(ValueError):
    """A ``function`` section key of the wrong shape; ``field`` names it."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name
        self.problem = problem


@dataclass(frozen=True)
class FunctionConfig:
    """The ``function`` section of a model config, as acted on here (module docstring)."""

    response_regex: tuple[ConfigRegex, ...] = ()
    json_regex_match: tuple[ConfigRegex, ...] = ()
    name_key: str = "name"
    arguments_key: str = "arguments"
    replace_function_results: tuple[tuple[ConfigRegex, GoTemplate], ...] = ()
    replace_llm_results: tuple[tuple[ConfigRegex, GoTemplate], ...] = ()
    grammar_disabled: bool = False
    parallel_calls: bool = False
    grammar_prefix: str = ""
    disable_no_action: bool = False
    no_action_name: str = NO_ACTION_NAME
    no_action_description: str = NO_ACTION_DESCRIPTION

    @classmethod
    def from_yaml(cls, raw: Any, warnings: list[str] | None = None) -> "FunctionConfig":
        """Read a config's ``function`` mapping.  :raises FunctionConfigError: a key of the
        wrong shape (a regex that does not compile, a list that is not strings, ...)."""
        warnings = warnings if warnings is not None else []
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise FunctionConfigError("function", "must be a mapping")
        for key in raw:
            if key not in ACTED_ON:
                what = "a LocalAI key localai-tw does not act on" \
                    if key in LOCALAI_FUNCTION_KEYS else "unknown key"
                warnings.append(f"function.{str(key)[:64]}: {what}; ignored")
        grammar = raw.get("grammar") or {}
        if not isinstance(grammar, Mapping):
            raise FunctionConfigError("function.grammar", "must be a mapping")
        for key in grammar:
            if key not in GRAMMAR_ACTED_ON:
                what = "a LocalAI key localai-tw does not act on" \
                    if key in LOCALAI_GRAMMAR_KEYS else "unknown key"
                warnings.append(f"function.grammar.{str(key)[:64]}: {what}; ignored")
        return cls(
            response_regex=_regexes(raw.get("response_regex"), "function.response_regex"),
            json_regex_match=_regexes(raw.get("json_regex_match"),
                                      "function.json_regex_match"),
            name_key=_text(raw.get("function_name_key"), "function.function_name_key") or
            "name",
            arguments_key=_text(raw.get("function_arguments_key"),
                                "function.function_arguments_key") or "arguments",
            replace_function_results=_replacements(raw.get("replace_function_results"),
                                                   "function.replace_function_results"),
            replace_llm_results=_replacements(raw.get("replace_llm_results"),
                                              "function.replace_llm_results"),
            grammar_disabled=_flag(grammar.get("disable"), "function.grammar.disable"),
            parallel_calls=_flag(grammar.get("parallel_calls"),
                                 "function.grammar.parallel_calls"),
            grammar_prefix=_text(grammar.get("prefix"), "function.grammar.prefix"),
            disable_no_action=_flag(raw.get("disable_no_action"), "function.disable_no_action"),
            no_action_name=_function_name(raw.get("no_action_function_name"),
                                          "function.no_action_function_name"),
            no_action_description=_text(raw.get("no_action_description_name"),
                                        "function.no_action_description_name") or
            NO_ACTION_DESCRIPTION,
        )


def _text(value, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_REGEX_CHARS:
        raise FunctionConfigError(where, f"must be a string (at most {MAX_REGEX_CHARS})")
    return value


def _function_name(value, where: str) -> str:
    """A function name as requests' tools are named (the grammar writes it as a JSON string)."""
    if value is None or value == "":
        return NO_ACTION_NAME
    if not isinstance(value, str) or not _FUNCTION_NAME.match(value):
        raise FunctionConfigError(where, "must be 1 to 64 of A-Z a-z 0-9 _ . : -")
    return value


def _flag(value, where: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise FunctionConfigError(where, "must be true or false")
    return value


def _compile(text: Any, where: str) -> ConfigRegex:
    try:
        return ConfigRegex(text)  # RE2: Go's syntax and semantics, linear time
    except RegexError as e:
        raise FunctionConfigError(where, str(e)) from None


def _regexes(raw, where: str) -> tuple[ConfigRegex, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or len(raw) > MAX_REGEXES:
        raise FunctionConfigError(where, f"must be a list of at most {MAX_REGEXES} regular "
                                  "expressions")
    return tuple(_compile(r, f"{where}[{i}]") for i, r in enumerate(raw))


def _replacements(raw, where: str) -> tuple[tuple[ConfigRegex, GoTemplate], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_REGEXES:
        raise FunctionConfigError(where, f"must be a list of at most {MAX_REGEXES} "
                                  "{key, value} mappings")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise FunctionConfigError(f"{where}[{i}]", "must be a mapping with key and value")
        value = item.get("value", "")
        if not isinstance(value, str) or len(value) > MAX_REGEX_CHARS:
            raise FunctionConfigError(f"{where}[{i}].value",
                                      f"must be a string (at most {MAX_REGEX_CHARS})")
        out.append((_compile(item.get("key"), f"{where}[{i}].key"), GoTemplate(value)))
    return tuple(out)


# -- reading calls out of text -------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def body(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[ToolCall, ...]


def _arguments_text(value: Any) -> str:
    if value is None:
        return "{}"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _calls_in(value: Any, config: FunctionConfig, names: Sequence[str] | None) -> list[ToolCall]:
    if isinstance(value, list):
        return [c for item in value for c in _calls_in(item, config, names)]
    if not isinstance(value, Mapping):
        return []
    if isinstance(value.get("function"), Mapping) and config.name_key == "name":
        value = value["function"]  # OpenAI's own {"type": "function", "function": {...}}
    name = value.get(config.name_key)
    if name is None and config.name_key == "name":
        name = value.get("function")  # LocalAI's older grammars wrote {"function": NAME, ...}
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return []
    arguments = value.get(config.arguments_key)
    if arguments is None and config.arguments_key == "arguments":
        arguments = value.get("parameters")
    return [ToolCall(name, _arguments_text(arguments))]


_DECODER = json.JSONDecoder()


def _json_values(text: str) -> list[tuple[int, int, Any]]:
    """Every top-level JSON object or array in ``text`` as (start, end, value), left to right
    (text between them is skipped, as LocalAI's ``ParseJSON`` does)."""
    found, at, misses = [], 0, 0
    while len(found) < MAX_CALLS and misses < MAX_MISSES:
        starts = [i for i in (text.find("{", at), text.find("[", at)) if i >= 0]
        if not starts:
            break
        start = min(starts)
        try:
            value, end = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deep
            at = start + 1
            misses += 1
            continue
        found.append((start, end, value))
        at = end
    return found


# No ``\s*`` around the lazy group: with one on each side, a tag followed by spaces and no
# closing tag backtracked quadratically (20000 spaces of model output: 3 s on the reactor).
# The body is stripped in Python instead.
_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION_TAG = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)


def parse_tool_calls(text: str, config: FunctionConfig,
                     names: Sequence[str] | None) -> Parsed:
    """The tool calls in ``text`` and the content around them (module docstring for the
    formats).  ``names``: the request's tool names (None accepts any name)."""
    for pattern, replacement in config.replace_function_results:
        text = pattern.sub(replacement, text)
    calls: list[ToolCall] = []
    spans: list[tuple[int, int]] = []
    if config.response_regex:
        for pattern in config.response_regex:
            for match in pattern.finditer(text):
                groups = match.groupdict()
                name = groups.get(config.name_key) or ""
                if not name or (names is not None and name not in names):
                    continue
                calls.append(ToolCall(name, (groups.get(config.arguments_key) or "{}").strip()))
                spans.append(match.span())
        return _result(text, calls, spans)
    if config.json_regex_match:
        for pattern in config.json_regex_match:
            matches = list(pattern.finditer(text)) if pattern.groups else []
            if not matches:
                continue
            for match in matches:
                for _, _, value in _json_values(match.group(1) or "") or []:
                    calls.extend(_calls_in(value, config, names))
                spans.append(match.span())
            return _result(text, calls, spans)
    for match in _FUNCTION_TAG.finditer(text):
        name = match.group(1)
        if names is not None and name not in names:
            continue
        body = match.group(2).strip() or "{}"
        calls.append(ToolCall(name, body))
        spans.append(match.span())
    for match in _TAGGED.finditer(text):
        values = _json_values(match.group(1))
        found = [c for _, _, v in values for c in _calls_in(v, config, names)]
        if found:
            calls.extend(found)
            spans.append(match.span())
    if not calls:
        for start, end, value in _json_values(text):
            found = _calls_in(value, config, names)
            if found:
                calls.extend(found)
                spans.append((start, end))
    return _result(text, calls, spans)


def _result(text: str, calls: list[ToolCall], spans: list[tuple[int, int]]) -> Parsed:
    if not calls:
        return Parsed(text, ())
    pieces, at = [], 0
    for start, end in sorted(spans):
        if start >= at:
            pieces.append(text[at:start])
            at = end
    pieces.append(text[at:])
    return Parsed("".join(pieces).strip(), tuple(calls[:MAX_CALLS]))


def calls_from_deltas(deltas: Iterable[Any], names: Sequence[str] | None) -> list[ToolCall]:
    """Tool calls a backend parsed itself (``Reply.chat_deltas``, as LocalAI's llama.cpp
    backend sends them): the pieces of each ``index`` joined (name and id as last given,
    arguments concatenated), in index order; calls naming no requested tool are dropped."""
    by_index: dict[int, dict] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            call = by_index.setdefault(int(piece.index), {"name": "", "id": "",
                                                          "arguments": ""})
            if piece.name:
                call["name"] = piece.name
            if piece.id:
                call["id"] = piece.id
            call["arguments"] += piece.arguments
            if len(by_index) > MAX_CALLS:
                break
    calls = []
    for index in sorted(by_index):
        call = by_index[index]
        if not call["name"] or (names is not None and call["name"] not in names):
            continue
        extra = {"id": call["id"]} if call["id"] else {}
        calls.append(ToolCall(call["name"], call["arguments"] or "{}", **extra))
    return calls


def no_action_tool(config: FunctionConfig) -> dict:
    """The no-action function as a tool in OpenAI's shape (LocalAI's: one string argument,
    ``message``, here required so the grammar always writes it)."""
    return {"type": "function", "function": {
        "name": config.no_action_name, "description": config.no_action_description,
        "parameters": {"type": "object", "properties": {"message": {
            "type": "string", "description": "The message to reply the user with"}},
            "required": ["message"]}}}


def split_no_action(calls: Sequence[ToolCall], no_action: str | None
                    ) -> tuple[tuple[ToolCall, ...], str | None]:
    """The real calls, and the no-action answer when the model called only that function:
    its ``message`` argument (``""`` when it has none), else None.  A no-action call next to
    real calls is dropped, as LocalAI does."""
    if no_action is None:
        return tuple(calls), None
    real = tuple(c for c in calls if c.name != no_action)
    if real or not calls:
        return real, None
    try:
        arguments = json.loads(calls[0].arguments)
    except ValueError:
        return (), ""
    message = arguments.get("message") if isinstance(arguments, dict) else None
    return (), message if isinstance(message, str) else ""


def cut_no_action_message(text: str, config: FunctionConfig, name: str) -> str | None:
    """The part of the no-action ``message`` written before ``max_tokens`` cut the answer
    (the whole call's JSON never closed), or None when ``text`` is not such a start.  So an
    answer in words that runs out of tokens reads as a cut answer, not as broken JSON."""
    head = ["{", json.dumps(config.name_key), ":", json.dumps(name), ",",
            json.dumps(config.arguments_key), ":", "{", '"message"', ":", '"']
    at = _after_space(text, 0)
    if config.grammar_prefix and text.startswith(config.grammar_prefix, at):
        at = _after_space(text, at + len(config.grammar_prefix))
    if text.startswith("[", at):
        at = _after_space(text, at + 1)
    for token in head:  # one pass: no position is looked at twice
        if not text.startswith(token, at):
            return None
        at = at + len(token) if token == '"' else _after_space(text, at + len(token))
    rest = text[at:]
    rest = re.sub(r'\\u[0-9a-fA-F]{0,3}$', "", rest)  # an escape cut in the middle
    if (len(rest) - len(rest.rstrip("\\"))) % 2:
        rest = rest[:-1]
    try:
        value = json.loads(f'"{rest}"')
    except ValueError:  # the string closed, or holds what JSON does not: not a cut message
        return None
    return value if isinstance(value, str) else None


def _after_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def clean_content(text: str, config: FunctionConfig) -> str:
    """``function.replace_llm_results`` applied to an answer's content."""
    for pattern, replacement in config.replace_llm_results:
        text = pattern.sub(replacement, text)
    return text


class ToolCallStream:
    """Splits a streamed answer into content sent at once and a tail held back because it is,
    or may become, a tool call; :meth:`end` parses the tail.

    An answer whose first visible character opens JSON (``{`` or ``[``) is held whole, and so
    is every answer when the config reads calls with regexes; otherwise text streams as
    content until a tool call tag (:data:`TAGS`) starts, holding back at most a possible
    tag's first characters meanwhile.  A call found only in text already sent (JSON after some
    prose) is still returned by :meth:`end`, as the answer not streamed would hold it.
    """

    def __init__(self, config: FunctionConfig, names: Sequence[str] | None):
        self.config = config
        self.names = names
        self.whole = bool(config.response_regex or config.json_regex_match)
        self.sent = ""        # content already released
        self.held = ""        # text not released yet
        self.holding = False  # a tag or JSON started: hold everything from here on

    def feed(self, text: str) -> str:
        """The content to send now for the next piece of text (possibly empty)."""
        self.held += text
        if self.whole or self.holding:
            return ""
        if not self.sent and not self.held.strip():
            return ""
        if not self.sent and self.held.lstrip()[:1] in ("{", "["):
            self.holding = True
            return ""
        at = min((i for i in (self.held.find(tag) for tag in TAGS) if i >= 0), default=-1)
        if at >= 0:
            release, self.held = self.held[:at], self.held[at:]
            self.holding = True
            self.sent += release
            return release
        keep = _partial_tag_suffix(self.held)
        release = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        self.sent += release
        return release

    def end(self) -> tuple[str, tuple[ToolCall, ...]]:
        """The content still to send and the calls found in what was held."""
        parsed = parse_tool_calls(self.held, self.config, self.names) if self.held \
            else Parsed("", ())
        if parsed.calls:
            return (" " + parsed.content if parsed.content and self.sent else parsed.content,
                    parsed.calls)
        if self.sent:  # a call in the middle of text already sent (JSON after prose)
            whole = parse_tool_calls(self.sent + self.held, self.config, self.names)
            if whole.calls:
                held = self.held.strip()
                return (self.held if held and held in whole.content else "", whole.calls)
        return self.held, ()


def _partial_tag_suffix(text: str) -> int:
    """How many of ``text``'s last characters could start a tag (0 if none)."""
    for length in range(min(len(text), MAX_HELD_CHARS), 0, -1):
        tail = text[-length:]
        if any(tag.startswith(tail) for tag in TAGS):
            return length
    return 0


def tool_names(tools: Iterable[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


__all__ = ["FunctionConfig", "FunctionConfigError", "NO_ACTION_NAME", "Parsed", "ToolCall",
           "ToolCallStream", "calls_from_deltas", "clean_content", "cut_no_action_message",
           "no_action_tool",
           "parse_tool_calls", "split_no_action", "tool_names"]
