"""Prompt rendering for chat and completion requests, LocalAI style, with a safe template subset.

A model config's ``template`` block says how a request becomes backend input
(contract sheet §3):

- ``use_tokenizer_template: true``: chat requests send no prompt; the conversation goes in
  ``PredictOptions.Messages`` with ``UseTokenizerTemplate=true`` and the backend applies the
  model's own chat template.  Completion prompts are sent as they are.
- otherwise each chat message is rendered through ``chat_message`` (or, without one, prefixed
  with its role's prefix from ``roles``), the pieces are joined by ``join`` (``"\\n"``), and
  the result is wrapped by ``chat`` as ``{{.Input}}``.  No template at all: the joined text is
  the prompt.  A completion prompt is wrapped by ``completion`` the same way, or sent raw.

Templates are written in a **small subset of Go text/template**, the language of LocalAI model
files, so existing templates work unchanged:

- output: ``{{.Field}}``, string literals (``"..."`` or raw ```...```), integers,
  ``true``/``false``;
- ``{{if COND}} ... {{else if COND}} ... {{else}} ... {{end}}``, nestable;
- conditions: a field or literal (Go truthiness: empty string, 0, false and nil are false),
  ``eq A B [C ...]`` (A equals any of the rest), ``ne A B``, ``not A``, ``and A B ...``,
  ``or A B ...``, and parentheses;
- ``{{/* comments */}}`` and the whitespace trimming markers ``{{- `` and `` -}}``.

Fields of a chat message: ``.RoleName`` (the role as sent), ``.Role`` (its prefix from
``roles``), ``.Content``, ``.FunctionName`` (``name``), ``.FunctionCall`` (tool calls as JSON,
or nil), ``.MessageIndex``, ``.LastMessage``, ``.Function`` (always false here),
``.SystemPrompt``.  Fields of a chat or completion prompt: ``.Input``, ``.SystemPrompt``,
``.SuppressSystemPrompt`` (the request carries its own system message), ``.Instruction``,
``.Functions`` (nil), ``.MessageIndex`` (0), ``.ReasoningEffort``, ``.Metadata``.

What this module must never do: evaluate code (no ``eval``/``exec``, no attribute or item
access beyond the fixed fields above, no function other than those listed), read files, or
touch the network.  An unsupported construct is a :class:`TemplateError` naming it, raised when
the template is compiled; an unknown field is a :class:`TemplateError` when rendered.  Every
function here is pure and runs in time linear in the template and the input.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

#: The longest template text accepted (model files are small; this bounds compile work).
MAX_TEMPLATE_CHARS = 64 * 1024
#: Deepest ``if`` nesting and parenthesised-expression depth accepted.
MAX_NESTING = 32


class TemplateError(ValueError):
    """A template is not in the supported subset, or refers to an unknown field."""


# -- the template language ----------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-[ \t\r\n])?(.*?)([ \t\r\n]-)?\}\}", re.DOTALL)
_TOKEN = re.compile(
    r"""\s*(?:
        (?P<field>\.[A-Za-z_][A-Za-z0-9_]*)
      | (?P<string>"(?:[^"\\\n]|\\.)*")
      | (?P<raw>`[^`]*`)
      | (?P<number>-?[0-9]+)
      | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<open>\()
      | (?P<close>\))
    )""",
    re.VERBOSE | re.DOTALL,
)
_STRING_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'",
                   "0": "\0", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}
_FUNCTIONS = frozenset({"eq", "ne", "not", "and", "or"})


@dataclass(frozen=True)
class _Field:
    name: str


@dataclass(frozen=True)
class _Literal:
    value: Any


@dataclass(frozen=True)
class _Call:
    function: str
    args: tuple


@dataclass
class _If:
    branches: list  # [(condition, body)]
    otherwise: list | None = None


@dataclass(frozen=True)
class _Output:
    expression: Any


def _unquote(text: str) -> str:
    out, i = [], 1
    while i < len(text) - 1:
        c = text[i]
        if c == "\\":
            nxt = text[i + 1]
            if nxt not in _STRING_ESCAPES:
                raise TemplateError(f"unsupported escape \\{nxt} in a string literal")
            out.append(_STRING_ESCAPES[nxt])
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _tokens(source: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(source):
        if source[pos:].strip() == "":
            break
        match = _TOKEN.match(source, pos)
        if match is None or match.end() == pos:
            raise TemplateError(f"unsupported syntax {source[pos:].strip()[:40]!r} in "
                                f"{{{{{source.strip()[:60]}}}}}")
        kind = match.lastgroup
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


class _ExpressionParser:
    """``expr := operand | FUNC operand+``; ``operand := field | literal | ( expr )``."""

    def __init__(self, tokens: list[tuple[str, str]], action: str):
        self.tokens = tokens
        self.pos = 0
        self.action = action

    def fail(self, why: str) -> TemplateError:
        return TemplateError(f"{why} in {{{{{self.action.strip()[:60]}}}}}")

    def parse(self):
        if not self.tokens:
            raise self.fail("an empty expression")
        expr = self.expression(0)
        if self.pos != len(self.tokens):
            raise self.fail(f"unexpected {self.tokens[self.pos][1]!r}")
        return expr

    def expression(self, depth: int):
        if depth > MAX_NESTING:
            raise self.fail("expression nested too deeply")
        kind, text = self.tokens[self.pos]
        if kind == "ident" and text in _FUNCTIONS:
            self.pos += 1
            args = []
            while self.pos < len(self.tokens) and self.tokens[self.pos][0] != "close":
                args.append(self.operand(depth))
            minimum = {"not": 1, "eq": 2, "ne": 2, "and": 1, "or": 1}[text]
            if len(args) < minimum or (text in ("not", "ne") and len(args) != minimum):
                raise self.fail(f"{text} takes {'exactly' if text in ('not', 'ne') else 'at least'}"
                                f" {minimum} argument(s)")
            return _Call(text, tuple(args))
        return self.operand(depth)

    def operand(self, depth: int):
        if self.pos >= len(self.tokens):
            raise self.fail("an expression ends early")
        kind, text = self.tokens[self.pos]
        self.pos += 1
        if kind == "field":
            return _Field(text[1:])
        if kind == "string":
            return _Literal(_unquote(text))
        if kind == "raw":
            return _Literal(text[1:-1])
        if kind == "number":
            return _Literal(int(text))
        if kind == "ident" and text in ("true", "false"):
            return _Literal(text == "true")
        if kind == "ident" and text == "nil":
            return _Literal(None)
        if kind == "open":
            inner = self.expression(depth + 1)
            if self.pos >= len(self.tokens) or self.tokens[self.pos][0] != "close":
                raise self.fail("a '(' is not closed")
            self.pos += 1
            return inner
        if kind == "ident":
            raise self.fail(f"unsupported function or keyword {text!r} (supported: "
                            f"{', '.join(sorted(_FUNCTIONS))}, if, else, end)")
        raise self.fail(f"unexpected {text!r}")


def _parse_expression(source: str):
    return _ExpressionParser(_tokens(source), source).parse()


class Template:
    """A compiled template; :meth:`render` fills it from a mapping of field values."""

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise TemplateError("a template must be text")
        if len(text) > MAX_TEMPLATE_CHARS:
            raise TemplateError(f"a template is longer than {MAX_TEMPLATE_CHARS} characters")
        self.text = text
        self._body = self._compile(text)

    @staticmethod
    def _compile(text: str) -> list:
        root: list = []
        # stack of (node list being filled, the _If it belongs to or None)
        stack: list[tuple[list, _If | None]] = [(root, None)]
        pos = 0
        pending_trim_left = False
        for match in _ACTION.finditer(text):
            literal = text[pos:match.start()]
            if pending_trim_left:
                literal = literal.lstrip()
            if match.group(1):
                literal = literal.rstrip()
            if literal:
                stack[-1][0].append(literal)
            pos = match.end()
            pending_trim_left = bool(match.group(3))
            action = match.group(2).strip()
            if action.startswith("/*"):
                if not action.endswith("*/"):
                    raise TemplateError("a comment must be {{/* ... */}}")
                continue
            keyword, _, rest = action.partition(" ")
            rest = rest.strip()
            if keyword == "if":
                if len(stack) > MAX_NESTING:
                    raise TemplateError("if blocks nested too deeply")
                node = _If([(_parse_expression(rest), [])])
                stack[-1][0].append(node)
                stack.append((node.branches[0][1], node))
            elif keyword == "else":
                node = stack[-1][1]
                if node is None or node.otherwise is not None:
                    raise TemplateError("{{else}} without a matching {{if}}")
                stack.pop()
                if rest.startswith("if ") or rest == "if":
                    body: list = []
                    node.branches.append((_parse_expression(rest[2:].strip()), body))
                elif rest:
                    raise TemplateError(f"unsupported {{{{else {rest[:40]}}}}}")
                else:
                    body = node.otherwise = []
                stack.append((body, node))
            elif keyword == "end":
                if rest:
                    raise TemplateError("{{end}} takes nothing")
                if stack[-1][1] is None:
                    raise TemplateError("{{end}} without a matching {{if}}")
                stack.pop()
            elif keyword in ("range", "with", "define", "template", "block", "break",
                             "continue"):
                raise TemplateError(f"{{{{{keyword}}}}} is not supported (only if/else/end)")
            else:
                stack[-1][0].append(_Output(_parse_expression(action)))
        tail = text[pos:]
        if pending_trim_left:
            tail = tail.lstrip()
        if "{{" in tail:
            raise TemplateError("an action '{{' is not closed with '}}'")
        if tail:
            stack[-1][0].append(tail)
        if len(stack) != 1:
            raise TemplateError("an {{if}} is not closed with {{end}}")
        return root

    def render(self, data: Mapping[str, Any]) -> str:
        out: list[str] = []
        self._run(self._body, data, out)
        return "".join(out)

    def _run(self, nodes: list, data: Mapping[str, Any], out: list[str]) -> None:
        for node in nodes:
            if isinstance(node, str):
                out.append(node)
            elif isinstance(node, _Output):
                out.append(_printed(_evaluate(node.expression, data)))
            else:
                for condition, body in node.branches:
                    if _truthy(_evaluate(condition, data)):
                        self._run(body, data, out)
                        break
                else:
                    if node.otherwise is not None:
                        self._run(node.otherwise, data, out)


def _evaluate(expression, data: Mapping[str, Any]):
    if isinstance(expression, _Literal):
        return expression.value
    if isinstance(expression, _Field):
        if expression.name not in data:
            raise TemplateError(f"unknown field .{expression.name}; this template may use "
                                f"{', '.join('.' + k for k in sorted(data))}")
        return data[expression.name]
    function, args = expression.function, expression.args
    if function == "not":
        return not _truthy(_evaluate(args[0], data))
    if function in ("eq", "ne"):
        first = _evaluate(args[0], data)
        equal = any(_equal(first, _evaluate(a, data)) for a in args[1:])
        return equal if function == "eq" else not equal
    value = None
    for arg in args:  # and / or: Go returns the deciding argument
        value = _evaluate(arg, data)
        if _truthy(value) == (function == "or"):
            return value
    return value


def _equal(a, b) -> bool:
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    return a == b


def _truthy(value) -> bool:
    return bool(value) if value is not None else False


def _printed(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@lru_cache(maxsize=256)
def compile_template(text: str) -> Template:
    """The compiled :class:`Template` for ``text`` (cached by text).  :raises TemplateError:"""
    return Template(text)


# -- chat and completion prompts ---------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat request, flattened to text.

    :param tool_calls: the message's ``tool_calls`` as a JSON array text, or ``""``.
    """

    role: str
    content: str = ""
    name: str = ""
    tool_call_id: str = ""
    tool_calls: str = ""
    reasoning_content: str = ""


@dataclass(frozen=True)
class PromptTemplates:
    """The template settings of one model (all optional; see the module docstring)."""

    chat: str = ""
    chat_message: str = ""
    completion: str = ""
    use_tokenizer_template: bool = False
    roles: Mapping[str, str] = field(default_factory=dict)
    join: str = "\n"
    system_prompt: str = ""

    def __post_init__(self):
        for name in ("chat", "chat_message", "completion"):
            text = getattr(self, name)
            if text:
                try:
                    compile_template(text)
                except TemplateError as e:
                    raise TemplateError(f"template.{name}: {e}") from None

    @classmethod
    def from_config(cls, template: Any, *, roles: Mapping[str, str] | None = None,
                    system_prompt: str = "") -> "PromptTemplates":
        """Settings from a model config's ``template`` (a mapping or an object with the
        attributes ``chat``, ``chat_message``, ``completion``, ``use_tokenizer_template`` and
        optionally ``roles`` and ``join_chat_messages_by_character``).
        :raises TemplateError: a template outside the supported subset."""

        def read(name, default):
            if template is None:
                return default
            if isinstance(template, Mapping):
                value = template.get(name, default)
            else:
                value = getattr(template, name, default)
            return default if value is None else value

        join = read("join_chat_messages_by_character", "\n")
        return cls(chat=str(read("chat", "")), chat_message=str(read("chat_message", "")),
                   completion=str(read("completion", "")),
                   use_tokenizer_template=bool(read("use_tokenizer_template", False)),
                   roles=dict(roles if roles is not None else read("roles", {}) or {}),
                   join=str(join), system_prompt=str(system_prompt or ""))


@dataclass(frozen=True)
class RenderedChat:
    """What a chat request sends: ``prompt`` (empty with the tokenizer template), or
    ``messages`` with ``use_tokenizer_template`` true."""

    prompt: str
    messages: tuple[ChatMessage, ...] = ()
    use_tokenizer_template: bool = False


def _prompt_data(templates: PromptTemplates, text: str, *, suppress_system: bool) -> dict:
    return {
        "Input": text, "Instruction": "", "SystemPrompt": templates.system_prompt,
        "SuppressSystemPrompt": suppress_system, "Functions": None, "MessageIndex": 0,
        "ReasoningEffort": "", "Metadata": None,
    }


def render_chat(templates: PromptTemplates, messages: Sequence[ChatMessage]) -> RenderedChat:
    """The backend input for ``messages`` under ``templates`` (LocalAI's rules, module
    docstring).  :raises TemplateError: a field the template names does not exist."""
    messages = tuple(messages)
    if templates.use_tokenizer_template:
        return RenderedChat(prompt="", messages=messages, use_tokenizer_template=True)
    pieces: list[str] = []
    last = len(messages) - 1
    message_template = compile_template(templates.chat_message) \
        if templates.chat_message else None
    for index, message in enumerate(messages):
        role = message.role
        if message.tool_calls and role == "assistant" and \
                templates.roles.get("assistant_function_call"):
            role = "assistant_function_call"
        prefix = templates.roles.get(role, "")
        if message_template is not None:
            rendered = message_template.render({
                "SystemPrompt": templates.system_prompt, "Role": prefix, "RoleName": role,
                "Content": message.content, "FunctionName": message.name,
                "FunctionCall": message.tool_calls or None, "MessageIndex": index,
                "LastMessage": index == last, "Function": False,
            })
            if rendered:
                pieces.append(rendered)
            continue  # LocalAI skips a message its chat_message template renders empty
        content = message.content
        if message.tool_calls:
            calls = (f"{prefix} {message.tool_calls}" if prefix else message.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        elif prefix and content:
            content = prefix + content
        pieces.append(content)
    joined = templates.join.join(pieces)
    if templates.chat:
        suppress = any(m.role == "system" for m in messages)
        joined = compile_template(templates.chat).render(
            _prompt_data(templates, joined, suppress_system=suppress))
    return RenderedChat(prompt=joined)


def render_completion(templates: PromptTemplates, prompt: str) -> str:
    """The backend prompt for a completion ``prompt``: wrapped by the ``completion`` template,
    or as it is.  :raises TemplateError:"""
    if not templates.completion:
        return prompt
    return compile_template(templates.completion).render(
        _prompt_data(templates, prompt, suppress_system=False))


def template_fields(text: str) -> set[str]:
    """The field names a template refers to (for diagnostics and tests)."""
    found: set[str] = set()

    def walk(nodes: Iterable):
        for node in nodes:
            if isinstance(node, _Output):
                expr(node.expression)
            elif isinstance(node, _If):
                for condition, body in node.branches:
                    expr(condition)
                    walk(body)
                walk(node.otherwise or ())

    def expr(e):
        if isinstance(e, _Field):
            found.add(e.name)
        elif isinstance(e, _Call):
            for a in e.args:
                expr(a)

    walk(compile_template(text)._body)
    return found


def tool_calls_json(tool_calls: Any) -> str:
    """A message's ``tool_calls`` as compact JSON text (``""`` when absent or empty)."""
    if not tool_calls:
        return ""
    return json.dumps(tool_calls, separators=(",", ":"), ensure_ascii=False)


__all__ = [
    "ChatMessage",
    "PromptTemplates",
    "RenderedChat",
    "Template",
    "TemplateError",
    "compile_template",
    "render_chat",
    "render_completion",
    "template_fields",
    "tool_calls_json",
]
