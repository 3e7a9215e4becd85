"""Prompt rendering for chat and completion requests, LocalAI style, with a safe template subset.

A model config's ``template`` block says how a request becomes backend input
(contract sheet §3):

- ``use_tokenizer_template: true``: chat requests send no prompt; the conversation goes in
  ``PredictOptions.Messages`` with ``UseTokenizerTemplate=true`` and the backend applies the
  model's own chat template.  Completion prompts are sent as they are.  When it was guessed
  (a ``llama-cpp`` config with no template, as LocalAI guesses it), the prompt rendered as
  below is sent as well: the backend uses it when the model file has no chat template.
- otherwise each chat message is rendered through ``chat_message`` (or, without one, prefixed
  with its role's prefix from ``roles``), the pieces are joined by ``join`` (``"\\n"``), and
  the result is wrapped by ``chat`` as ``{{.Input}}``.  No template at all: the joined text is
  the prompt.  A completion prompt is wrapped by ``completion`` the same way, or sent raw.

Templates are written in a **small subset of Go text/template**, the language of LocalAI model
files, so existing templates work unchanged:

- output: ``{{.Field}}``, field chains (``{{.FunctionCall.Name}}``), ``{{.}}``, variables
  (``{{$x}}``, ``$`` is the top-level data), string literals (``"..."`` or raw ```...```),
  integers, ``true``/``false``/``nil``;
- ``{{if COND}} ... {{else if COND}} ... {{else}} ... {{end}}``, nestable;
- ``{{range [$i,] [$v :=] X}} ... [{{else}} ...] {{end}}`` over a list, a mapping (keys in
  order, as Go) or an integer; ``{{with X}} ... [{{else}} ...] {{end}}``;
- ``{{$x := EXPR}}`` declares, ``{{$x = EXPR}}`` assigns (scoped to the enclosing block, as Go);
- functions: ``eq A B [C ...]`` (A equals any of the rest), ``ne``, ``lt``, ``le``, ``gt``,
  ``ge``, ``not``, ``and``, ``or`` (Go truthiness: empty, 0, false and nil are false), ``len``,
  ``index``, ``print`` (``fmt.Sprint``), and the Sprig helpers LocalAI's gallery calls:
  ``toJson`` (``json.Marshal``: compact, map keys sorted, ``<>&`` escaped) and ``add1``;
  parentheses;
- ``{{/* comments */}}`` and the whitespace trimming markers ``{{- `` and `` -}}``.

Fields of a chat message: ``.RoleName`` (the role as sent), ``.Role`` (its prefix from
``roles``), ``.Content``, ``.FunctionName`` (``name``), ``.FunctionCall`` (the tool calls as a
list that prints as their JSON text, or nil), ``.MessageIndex``, ``.LastMessage``,
``.Function`` (true on the last message when the answer is constrained by a grammar),
``.SystemPrompt``.  Fields of a chat or completion prompt: ``.Input``, ``.SystemPrompt``,
``.SuppressSystemPrompt`` (the request carries its own system message), ``.Instruction``,
``.Functions`` (the request's tools when they are shown to the model, each with ``.Name``,
``.Description``, ``.Strict``, ``.Parameters``; else nil), ``.MessageIndex`` (0),
``.ReasoningEffort``, ``.Metadata``.  With tools, the ``function`` template (LocalAI's
``template.function``) renders the prompt in place of ``chat`` when the config has one.
A field of a nested mapping that is missing is nil (Go's zero value); a field
the top level does not have is an error.

What this module must never do: evaluate code (no ``eval``/``exec``, no attribute access:
fields are read from mappings only, no function other than those listed), read files, or
touch the network.  An unsupported construct is a :class:`TemplateError` naming it, raised when
the template is compiled; an unknown field or a function applied to the wrong kind of value is
a :class:`TemplateError` when rendered.  Compiling is linear in the template; a rendering runs
at most ``MAX_STEPS`` actions and range iterations and produces at most ``MAX_OUTPUT_CHARS``
characters (``range`` can multiply work), its function calls handle at most
``MAX_WORK_CHARS`` characters, all of it counted per request (:class:`RenderBudget`), else it
is a :class:`TemplateError`.

One module of about 1000 lines, because it is one small language: its scanner, its parsed nodes,
their evaluation and the one budget every step is charged to are read together when a rule
changes (a construct is admitted in all three or in none); the prompt assembly that uses it is
the last hundred lines.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

from twisted.logger import Logger

log = Logger()

#: The longest template text accepted (model files are small; this bounds compile work).
MAX_TEMPLATE_CHARS = 64 * 1024
#: Deepest ``if`` nesting and parenthesised-expression depth accepted.
MAX_NESTING = 32


class TemplateError(ValueError):
    """A template is not in the supported subset, or refers to an unknown field."""


# -- the template language ----------------------------------------------------------------------

_SPACE = " \t\r\n"


def _actions(text: str):
    """Each action of ``text`` as ``(start, end, trim_left, body, trim_right)``, found in one
    linear pass: quoted strings inside an action are whole units (``{{`{{x}}`}}`` holds a raw
    string with braces), as Go's lexer reads them.  :raises TemplateError: an action or a string
    in one is not closed."""
    pos = 0
    while True:
        start = text.find("{{", pos)
        if start < 0:
            return
        i = start + 2
        trim_left = text.startswith("-", i) and i + 1 < len(text) and text[i + 1] in _SPACE
        if trim_left:
            i += 2
        body_start = i
        if text.startswith("/*", i):
            close = text.find("*/", i + 2)
            if close < 0:
                raise TemplateError("a comment must be {{/* ... */}}")
            i = close + 2
        while True:
            if i >= len(text):
                raise TemplateError("an action '{{' is not closed with '}}'")
            c = text[i]
            if c == '"':
                i += 1
                while i < len(text) and text[i] not in '"\n':
                    i += 2 if text[i] == "\\" else 1
                if i >= len(text) or text[i] != '"':
                    raise TemplateError("a string in an action is not closed")
                i += 1
            elif c == "`":
                close = text.find("`", i + 1)
                if close < 0:
                    raise TemplateError("a raw string in an action is not closed")
                i = close + 1
            elif text.startswith("}}", i):
                break
            else:
                i += 1
        body_end = i
        trim_right = body_end - 2 >= body_start and text[body_end - 1] == "-" and \
            text[body_end - 2] in _SPACE
        if trim_right:
            body_end -= 2
        yield start, i + 2, trim_left, text[body_start:body_end], trim_right
        pos = i + 2


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<declare>:=)
      | (?P<assign>=)
      | (?P<comma>,)
      | (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
      | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+)
      | (?P<dot>\.)
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
#: The functions templates may call: name -> (fewest, most) arguments (None: no limit).  Go's
#: built-ins, and the Sprig helpers LocalAI's gallery templates call (``toJson``, ``add1``).
_FUNCTIONS: dict[str, tuple[int, int | None]] = {
    "eq": (2, None), "ne": (2, 2), "lt": (2, 2), "le": (2, 2), "gt": (2, 2), "ge": (2, 2),
    "not": (1, 1), "and": (1, None), "or": (1, None), "len": (1, 1), "index": (1, None),
    "print": (0, None), "toJson": (1, 1), "add1": (1, 1),
}
#: Most output one request's renderings may produce, and most actions and range iterations
#: they may run (``range`` multiplies): 0.7 to 0.9 us each, so 50 000 are under 50 ms of the
#: reactor, and a conversation of 4096 messages through a ``chat_message`` of a dozen actions
#: (LocalAI's gallery templates run fewer) fits.
MAX_OUTPUT_CHARS = 4 * 1024 * 1024
MAX_STEPS = 50_000
#: Most characters one request's function calls may read and write (string arguments, and
#: what ``toJson`` and ``print`` return): a call costs its text, and a loop of calls whose
#: result is never emitted (``{{range 1000000}}{{$x := toJson $.Input}}{{end}}``) is not
#: bounded by the output.  That loop with a 100 KB prompt ran 77 s on the reactor before this
#: bound (issue 21 §1); 8 Mi characters of ``toJson`` take 40 to 50 ms.
MAX_WORK_CHARS = 8 * 1024 * 1024


@dataclass(frozen=True)
class _Field:
    """``.A.B`` (``path`` ("A", "B")) from the dot, or from variable ``var`` (``$`` is the data);
    ``.`` alone is the empty path."""

    path: tuple
    var: str | None = None


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


@dataclass
class _Range:
    """``{{range [$i,] [$v :=] EXPR}} body {{else}} otherwise {{end}}``."""

    names: tuple  # () or (value,) or (index, value): variable names without "$"
    expression: Any
    body: list = field(default_factory=list)
    otherwise: list | None = None


@dataclass
class _With:
    expression: Any
    body: list = field(default_factory=list)
    otherwise: list | None = None


@dataclass(frozen=True)
class _Set:
    """``{{$x := EXPR}}`` (``declare``) or ``{{$x = EXPR}}``; prints nothing."""

    name: str
    expression: Any
    declare: bool


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


def _variable(text: str) -> _Field:
    name, *path = text[1:].split(".")
    return _Field(tuple(path), var=name)


class _ExpressionParser:
    """``expr := operand | FUNC operand*``; ``operand := field | $var | . | literal | ( expr )``."""

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
        if self.pos >= len(self.tokens):
            raise self.fail("an expression ends early")
        kind, text = self.tokens[self.pos]
        if kind == "ident" and text in _FUNCTIONS:
            self.pos += 1
            args = []
            while self.pos < len(self.tokens) and self.tokens[self.pos][0] != "close":
                args.append(self.operand(depth))
            fewest, most = _FUNCTIONS[text]
            if len(args) < fewest or (most is not None and len(args) > most):
                count = f"{fewest}" if fewest == most else \
                    f"at least {fewest}" if most is None else f"{fewest} to {most}"
                raise self.fail(f"{text} takes {count} argument(s)")
            return _Call(text, tuple(args))
        return self.operand(depth)

    def operand(self, depth: int):
        if self.pos >= len(self.tokens):
            raise self.fail("an expression ends early")
        kind, text = self.tokens[self.pos]
        self.pos += 1
        if kind == "field":
            return _Field(tuple(text[1:].split(".")))
        if kind == "dot":
            return _Field(())
        if kind == "var":
            return _variable(text)
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
                            f"{', '.join(sorted(_FUNCTIONS))}, if, else, end, range, with)")
        raise self.fail(f"unexpected {text!r}")


def _parse_expression(source: str):
    return _ExpressionParser(_tokens(source), source).parse()


def _declaration(source: str, allow_index: bool) -> tuple[tuple, Any]:
    """``[$i ,] $v := EXPR`` -> (("i", "v"), expr); a plain ``EXPR`` -> ((), expr)."""
    tokens = _tokens(source)
    for names_end in ((3, 1) if allow_index else (1,)):
        if len(tokens) > names_end and tokens[names_end][0] == "declare":
            names = tokens[:names_end:2]
            if names_end == 3 and tokens[1][0] != "comma":
                break
            if not all(k == "var" and "." not in t and len(t) > 1 for k, t in names):
                raise TemplateError(f"a variable to declare must be $name in "
                                    f"{{{{{source.strip()[:60]}}}}}")
            rest = _ExpressionParser(tokens[names_end + 1:], source).parse()
            return tuple(t[1:] for _, t in names), rest
    if any(k in ("declare", "assign", "comma") for k, _ in tokens):
        raise TemplateError(f"unsupported declaration in {{{{{source.strip()[:60]}}}}}")
    return (), _ExpressionParser(tokens, source).parse()


_KEYWORD = re.compile(r"([A-Za-z]+)(?:\s+|$)(.*)", re.DOTALL)
_SET = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)\s*(:=|=)\s*(.*)", re.DOTALL)


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
        # stack of (node list being filled, the block node it belongs to or None)
        stack: list[tuple[list, Any]] = [(root, None)]
        pos = 0
        pending_trim_left = False
        for start, end, trim_left, body, trim_right in _actions(text):
            literal = text[pos:start]
            if pending_trim_left:
                literal = literal.lstrip()
            if trim_left:
                literal = literal.rstrip()
            if literal:
                stack[-1][0].append(literal)
            pos = end
            pending_trim_left = trim_right
            action = body.strip()
            if action.startswith("/*"):
                if not action.endswith("*/"):
                    raise TemplateError("a comment must be {{/* ... */}}")
                continue
            keyword_match = _KEYWORD.fullmatch(action)
            keyword, rest = (keyword_match.group(1), keyword_match.group(2).strip()) \
                if keyword_match else ("", action)
            if keyword in ("if", "range", "with"):
                if len(stack) > MAX_NESTING:
                    raise TemplateError(f"{keyword} blocks nested too deeply")
                if keyword == "if":
                    node: Any = _If([(_parse_expression(rest), [])])
                    body = node.branches[0][1]
                elif keyword == "range":
                    names, expression = _declaration(rest, allow_index=True)
                    node = _Range(names, expression)
                    body = node.body
                else:
                    node = _With(_parse_expression(rest))
                    body = node.body
                stack[-1][0].append(node)
                stack.append((body, node))
            elif keyword == "else":
                node = stack[-1][1]
                if node is None or node.otherwise is not None:
                    raise TemplateError("{{else}} without a matching {{if}}, {{range}} or "
                                        "{{with}}")
                stack.pop()
                if rest.startswith("if ") or rest == "if":
                    if not isinstance(node, _If):
                        raise TemplateError("{{else if}} belongs to an {{if}}")
                    body = []
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
                    raise TemplateError("{{end}} without a matching {{if}}, {{range}} or "
                                        "{{with}}")
                stack.pop()
            elif keyword in ("define", "template", "block", "break", "continue"):
                raise TemplateError(f"{{{{{keyword}}}}} is not supported (only if, else, end, "
                                    "range, with and variables)")
            elif _SET.match(action):
                name, operator, expression = _SET.match(action).groups()
                stack[-1][0].append(_Set(name, _parse_expression(expression), operator == ":="))
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
            raise TemplateError("an {{if}}, {{range}} or {{with}} is not closed with {{end}}")
        return root

    def render(self, data: Mapping[str, Any], budget: "RenderBudget | None" = None) -> str:
        """The text; ``budget``: shared by every rendering of one request (render_chat renders
        ``chat_message`` once per message), else this rendering's own."""
        run = _Run(data, budget if budget is not None else RenderBudget())
        run.block(self._body, data, [{}])
        return "".join(run.out)


class TemplateBudgetExceeded(TemplateError):
    """A rendering passed its request's :class:`RenderBudget`: the request is refused, never
    answered with the template left out (a bound is not a template's mistake)."""


class RenderBudget:
    """The work one request's renderings may do together: :data:`MAX_STEPS` actions and range
    iterations, :data:`MAX_OUTPUT_CHARS` of output, :data:`MAX_WORK_CHARS` handled by
    function calls.  One budget per request, not per rendering: ``chat_message`` renders once
    per message (up to 4096), and nested empty ranges ran no action at all (``{{range 300}}
    {{range 200000}}{{end}}{{end}}``: 51 s on the reactor before, issue 21 §1)."""

    __slots__ = ("steps", "size", "work")

    def __init__(self):
        self.steps = 0
        self.size = 0
        self.work = 0


class _Run:
    """One rendering: its output, charged to the request's :class:`RenderBudget`."""

    def __init__(self, data: Mapping[str, Any], budget: RenderBudget):
        self.data = data
        self.out: list[str] = []
        self.budget = budget

    def tick(self) -> None:
        self.budget.steps += 1
        if self.budget.steps > MAX_STEPS:
            raise TemplateBudgetExceeded(f"the template runs more than {MAX_STEPS} actions")

    def spend(self, chars: int) -> None:
        self.budget.work += chars
        if self.budget.work > MAX_WORK_CHARS:
            raise TemplateBudgetExceeded(f"the template's functions handle more than "
                                         f"{MAX_WORK_CHARS} characters (toJson or print in a "
                                         "loop?)")

    def emit(self, text: str) -> None:
        self.budget.size += len(text)
        if self.budget.size > MAX_OUTPUT_CHARS:
            raise TemplateBudgetExceeded(f"the rendered text would exceed {MAX_OUTPUT_CHARS} "
                                         "characters")
        self.out.append(text)

    def block(self, nodes: list, dot, scopes: list) -> None:
        scopes = scopes + [{}]  # variables declared inside a block end with it, as in Go
        for node in nodes:
            self.tick()
            if isinstance(node, str):
                self.emit(node)
            elif isinstance(node, _Output):
                self.emit(_printed(self.value(node.expression, dot, scopes)))
            elif isinstance(node, _Set):
                self.assign(node, self.value(node.expression, dot, scopes), scopes)
            elif isinstance(node, _If):
                for condition, body in node.branches:
                    if _truthy(self.value(condition, dot, scopes)):
                        self.block(body, dot, scopes)
                        break
                else:
                    if node.otherwise is not None:
                        self.block(node.otherwise, dot, scopes)
            elif isinstance(node, _With):
                value = self.value(node.expression, dot, scopes)
                if _truthy(value):
                    self.block(node.body, value, scopes)
                elif node.otherwise is not None:
                    self.block(node.otherwise, dot, scopes)
            else:
                self.range(node, dot, scopes)

    def range(self, node: _Range, dot, scopes: list) -> None:
        value = self.value(node.expression, dot, scopes)
        if isinstance(value, Mapping):
            try:
                items = [(k, value[k]) for k in sorted(value)]  # Go ranges maps in key order
            except TypeError:
                raise TemplateError("range over a mapping with unsortable keys") from None
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            items = ((i, i) for i in range(max(0, min(value, MAX_STEPS + 1))))
        elif value is None:
            items = []
        else:
            raise TemplateError(f"range cannot iterate over {_kind(value)}")
        ran = False
        for key, item in items:
            self.tick()  # an iteration is work even when its body is empty
            ran = True
            names = dict(zip(node.names[::-1], (item, key)))  # ($v) or ($i, $v)
            self.block(node.body, item, scopes + [names])
        if not ran and node.otherwise is not None:
            self.block(node.otherwise, dot, scopes)

    @staticmethod
    def assign(node: _Set, value, scopes: list) -> None:
        if node.declare:
            scopes[-1][node.name] = value
            return
        for scope in reversed(scopes):
            if node.name in scope:
                scope[node.name] = value
                return
        raise TemplateError(f"undefined variable ${node.name}")

    def value(self, expression, dot, scopes: list):
        if isinstance(expression, _Literal):
            return expression.value
        if isinstance(expression, _Field):
            return self.field(expression, dot, scopes)
        function, args = expression.function, expression.args
        if function == "not":
            return not _truthy(self.value(args[0], dot, scopes))
        if function in ("and", "or"):
            value = None
            for arg in args:  # Go returns the deciding argument and stops there
                value = self.value(arg, dot, scopes)
                if _truthy(value) == (function == "or"):
                    return value
            return value
        values = [self.value(a, dot, scopes) for a in args]
        self.spend(sum(len(v) for v in values if isinstance(v, str)))
        try:
            result = _call(function, values)
        except TemplateError as e:
            raise TemplateError(f"{function}: {e}") from None
        if isinstance(result, str):
            self.spend(len(result))
        return result

    def field(self, expression: _Field, dot, scopes: list):
        if expression.var is None:
            value = dot
        elif expression.var == "":
            value = self.data
        else:
            for scope in reversed(scopes):
                if expression.var in scope:
                    value = scope[expression.var]
                    break
            else:
                raise TemplateError(f"undefined variable ${expression.var}")
        for name in expression.path:
            if value is self.data:
                if name not in value:
                    raise TemplateError(f"unknown field .{name}; this template may use "
                                        f"{', '.join('.' + k for k in sorted(value))}")
                value = value[name]
            elif isinstance(value, Mapping):
                value = value.get(name)  # Go: a map's missing key is its zero value
            elif value is None:
                return None
            else:
                raise TemplateError(f"cannot read field .{name} of {_kind(value)}")
        return value


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    return "a mapping" if isinstance(value, Mapping) else "a value"


def _call(function: str, values: list):
    if function in ("eq", "ne"):
        equal = any(_equal(values[0], v) for v in values[1:])
        return equal if function == "eq" else not equal
    if function in ("lt", "le", "gt", "ge"):
        a, b = values
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if not numbers and not all(isinstance(v, str) for v in values):
            raise TemplateError(f"compares two numbers or two strings, not "
                                f"{_kind(a)} and {_kind(b)}")
        return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[function]
    if function == "len":
        if not isinstance(values[0], (str, list, tuple, Mapping)):
            raise TemplateError(f"cannot take the length of {_kind(values[0])}")
        return len(values[0])
    if function == "index":
        value = values[0]
        for key in values[1:]:
            if isinstance(value, Mapping):
                value = value.get(key)
            elif isinstance(value, (list, tuple, str)) and isinstance(key, int) and \
                    not isinstance(key, bool):
                if not 0 <= key < len(value):
                    raise TemplateError(f"index {key} out of range")
                value = value[key]
            else:
                raise TemplateError(f"cannot index {_kind(value)} with {_kind(key)}")
        return value
    if function == "print":  # fmt.Sprint: a space between operands when neither is a string
        out = []
        for i, value in enumerate(values):
            if i and not isinstance(value, str) and not isinstance(values[i - 1], str):
                out.append(" ")
            out.append(_printed(value))
        text = "".join(out)
        if len(text) > MAX_OUTPUT_CHARS:  # a variable doubled in a loop never reaches emit()
            raise TemplateBudgetExceeded(f"the text would exceed {MAX_OUTPUT_CHARS} characters")
        return text
    if function == "add1":
        value = values[0]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TemplateError(f"cannot add 1 to {_kind(value)}")
        return value + 1
    return _to_json(values[0])  # toJson


def _to_json(value) -> str:
    """Sprig's ``toJson``: Go's ``json.Marshal`` (compact, map keys sorted, ``<``, ``>`` and
    ``&`` escaped)."""
    try:
        text = json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        raise TemplateError(f"cannot encode {_kind(value)}") from None
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


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
    if isinstance(value, ToolCalls):
        return str(value)
    if isinstance(value, (list, tuple)):  # as Go's fmt prints them
        return "[" + " ".join(_printed(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "map[" + " ".join(f"{_printed(k)}:{_printed(value[k])}"
                                 for k in sorted(value, key=str)) + "]"
    return str(value)


class ToolCalls(list):
    """A message's tool calls as data (``range``, ``index``, ``toJson``) that print as the
    compact JSON text LocalAI templates expect from ``{{.FunctionCall}}``."""

    def __init__(self, calls, text: str):
        super().__init__(calls)
        self.text = text

    def __str__(self) -> str:
        return self.text


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
    function: str = ""  # the chat template when the request's tools are shown to the model
    #: ``use_tokenizer_template`` guessed, not written: the plain prompt goes too, so a model
    #: file without a chat template is still answered (from the messages joined).
    tokenizer_template_guessed: bool = False

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
                   completion=str(read("completion", "")), function=str(read("function", "")),
                   use_tokenizer_template=bool(read("use_tokenizer_template", False)),
                   tokenizer_template_guessed=bool(read("tokenizer_template_guessed", False)),
                   roles=dict(roles if roles is not None else read("roles", {}) or {}),
                   join=str(join), system_prompt=str(system_prompt or ""))


@dataclass(frozen=True)
class RenderedChat:
    """What a chat request sends: ``prompt`` (empty with the tokenizer template), or
    ``messages`` with ``use_tokenizer_template`` true."""

    prompt: str
    messages: tuple[ChatMessage, ...] = ()
    use_tokenizer_template: bool = False


def _prompt_data(templates: PromptTemplates, text: str, *, suppress_system: bool,
                 functions: list | None = None) -> dict:
    return {
        "Input": text, "Instruction": "", "SystemPrompt": templates.system_prompt,
        "SuppressSystemPrompt": suppress_system, "Functions": functions, "MessageIndex": 0,
        "ReasoningEffort": "", "Metadata": None,
    }


class GoFunction(dict):
    """One tool as LocalAI's templates see it (``functions.Function``): its Go field names
    (``.Name``, ``.Description``, ``.Strict``, ``.Parameters``) read its JSON keys, and
    ``toJson`` writes the JSON keys (``name``, ``description``, ``strict``, ``parameters``),
    as Go's struct tags do."""

    _GO = {"Name": "name", "Description": "description", "Strict": "strict",
           "Parameters": "parameters"}

    def get(self, key, default=None):
        return super().get(self._GO.get(key, key), default)


def template_functions(tools: Sequence[Mapping[str, Any]]) -> list[GoFunction]:
    """The request's ``tools`` (OpenAI's shape) as ``.Functions`` of a template."""
    out = []
    for tool in tools:
        function = tool.get("function") or {}
        out.append(GoFunction(name=function.get("name", ""),
                              description=function.get("description", "") or "",
                              strict=bool(function.get("strict", False)),
                              parameters=function.get("parameters") or {}))
    return out


def uses_functions(templates: PromptTemplates) -> bool:
    """Whether the request's tools reach the model through these templates: the
    ``function`` template, or a ``chat`` template that reads ``.Functions``."""
    if templates.function:
        return True
    return bool(templates.chat) and "Functions" in template_fields(templates.chat)


def render_chat(templates: PromptTemplates, messages: Sequence[ChatMessage],
                functions: Sequence[Mapping[str, Any]] | None = None, *,
                grammar: bool = False) -> RenderedChat:
    """The backend input for ``messages`` under ``templates`` (LocalAI's rules, module
    docstring).  ``functions``: the request's tools to show the model (then the ``function``
    template, when set, renders the prompt in place of ``chat``, with ``.Functions``);
    ``grammar``: the answer is constrained (``.Function`` of the last message is true, as
    LocalAI sets it).  :raises TemplateError: a field the template names does not exist."""
    messages = tuple(messages)
    if templates.use_tokenizer_template:
        prompt = ""
        if templates.tokenizer_template_guessed:  # the fallback for a file with no template
            prompt = render_chat(replace(templates, use_tokenizer_template=False), messages,
                                 functions, grammar=grammar).prompt
        return RenderedChat(prompt=prompt, messages=messages, use_tokenizer_template=True)
    pieces: list[str] = []
    last = len(messages) - 1
    budget = RenderBudget()  # one for the whole conversation, not one per message
    message_template = _compiled(templates, "chat_message") \
        if templates.chat_message else None
    for index, message in enumerate(messages):
        role = message.role
        if message.tool_calls and role == "assistant" and \
                templates.roles.get("assistant_function_call"):
            role = "assistant_function_call"
        prefix = templates.roles.get(role, "")
        if message_template is not None:
            rendered = _rendered(message_template, "chat_message", {
                "SystemPrompt": templates.system_prompt, "Role": prefix, "RoleName": role,
                "Content": message.content, "FunctionName": message.name,
                "FunctionCall": _tool_calls(message.tool_calls), "MessageIndex": index,
                "LastMessage": index == last, "Function": grammar and index == last,
            }, None, budget)
            if rendered is not None:  # None: it failed, the message is rendered without it
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
    which = "function" if functions and templates.function else "chat"
    if getattr(templates, which):
        suppress = any(m.role == "system" for m in messages)
        joined = _rendered(_compiled(templates, which), which, _prompt_data(
            templates, joined, suppress_system=suppress,
            functions=template_functions(functions) if functions else None), joined, budget)
    return RenderedChat(prompt=joined)


def render_completion(templates: PromptTemplates, prompt: str) -> str:
    """The backend prompt for a completion ``prompt``: wrapped by the ``completion`` template,
    or as it is.  :raises TemplateError:"""
    if not templates.completion:
        return prompt
    return _rendered(_compiled(templates, "completion"), "completion",
                     _prompt_data(templates, prompt, suppress_system=False), prompt,
                     RenderBudget())


#: (template, error) pairs already logged: a failing template is logged once, not per request.
_LOGGED: set[tuple[str, str]] = set()
MAX_LOGGED = 256


def _compiled(templates: PromptTemplates, name: str) -> "Template":
    """``template.<name>`` compiled when it is used, so one bad template of a model never
    blocks its others.  :raises TemplateError: naming ``template.<name>``."""
    try:
        return compile_template(getattr(templates, name))
    except TemplateError as e:
        raise TemplateError(f"template.{name}: {e}") from None


def _rendered(template: "Template", name: str, data, fallback, budget: "RenderBudget"):
    """``template`` rendered with ``data``; when the rendering fails on its data (a field the
    data does not have, a function on the wrong kind of value), ``fallback``, as LocalAI's
    evaluator goes on without a template that fails, and the failure is logged once.
    :raises TemplateBudgetExceeded: the request's budget is spent (refused, not left out)."""
    try:
        return template.render(data, budget)
    except TemplateBudgetExceeded:
        raise
    except TemplateError as e:
        key = (f"{name}:{template.text[:200]}", str(e)[:200])
        if key not in _LOGGED and len(_LOGGED) < MAX_LOGGED:
            _LOGGED.add(key)
            log.warn("template.{name} cannot be rendered ({error}); the prompt goes on "
                     "without it, as LocalAI's", name=name, error=str(e)[:200])
        return fallback


def template_fields(text: str) -> set[str]:
    """The top-level field names a template refers to (``.X`` where the dot is the data, and
    ``$.X``), for diagnostics and tests."""
    found: set[str] = set()

    def walk(nodes: Iterable, at_root: bool):
        for node in nodes:
            if isinstance(node, (_Output, _Set)):
                expr(node.expression, at_root)
            elif isinstance(node, _If):
                for condition, body in node.branches:
                    expr(condition, at_root)
                    walk(body, at_root)
                walk(node.otherwise or (), at_root)
            elif isinstance(node, (_Range, _With)):
                expr(node.expression, at_root)
                walk(node.body, False)  # the dot is the element there
                walk(node.otherwise or (), at_root)

    def expr(e, at_root: bool):
        if isinstance(e, _Field) and e.path and (e.var == "" or (e.var is None and at_root)):
            found.add(e.path[0])
        elif isinstance(e, _Call):
            for a in e.args:
                expr(a, at_root)

    walk(compile_template(text)._body, True)
    return found


def _tool_calls(text: str):
    """``.FunctionCall`` of a message: its tool calls as data that prints as their JSON text
    (LocalAI passes the decoded calls; templates ``toJson``, ``range`` or print them)."""
    if not text:
        return None
    try:
        calls = json.loads(text)
    except ValueError:
        return text
    return ToolCalls(calls, text) if isinstance(calls, list) else text


def tool_calls_json(tool_calls: Any) -> str:
    """A message's ``tool_calls`` as compact JSON text (``""`` when absent or empty)."""
    if not tool_calls:
        return ""
    return json.dumps(tool_calls, separators=(",", ":"), ensure_ascii=False)


__all__ = [
    "ChatMessage",
    "ToolCalls",
    "PromptTemplates",
    "RenderedChat",
    "Template",
    "TemplateBudgetExceeded",
    "TemplateError",
    "compile_template",
    "GoFunction",
    "render_chat",
    "render_completion",
    "template_functions",
    "uses_functions",
    "template_fields",
    "tool_calls_json",
]
