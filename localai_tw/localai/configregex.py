"""Regular expressions from model configs (``function.response_regex``,
``function.json_regex_match``, ``function.replace_function_results`` /
``replace_llm_results``), matched with RE2 against model output.

Why RE2 and not Python's ``re``: a model config is not only the operator's (a gallery install
writes one, and the model's output is steered by whoever writes the prompt), and ``re``
backtracks: ``^(a+)+$`` against a few dozen characters holds the GIL for seconds, freezing the
replica's reactor (issue 21 §1).  RE2 matches in time linear in the text and releases the GIL
while it does.  It is also the faithful engine: LocalAI is Go, and Go's ``regexp`` is RE2
syntax and semantics (leftmost-first, ``.`` stops at a newline unless ``(?s)``, ``$`` is the
end of the text unless ``(?m)``, no backreferences or lookaround).  A replacement is Go's
``ReplaceAllString`` template: ``$1``, ``${1}``, ``$name``, ``${name}``, ``$$``.

Bounds: an expression of at most :data:`MAX_REGEX_CHARS` characters that compiles to at most
:data:`MAX_PROGRAM_SIZE` RE2 instructions in at most :data:`MAX_MEMORY` bytes, refused when the
config loads (:class:`RegexError`, naming why); at most :data:`MAX_MATCHES` matches used per
expression and text, so each use costs at most that many linear scans of the text.

What this module must never do: hand a config's expression to ``re``; the project's own fixed
expressions stay on ``re`` (they are written here, not read).
"""

from __future__ import annotations

from typing import Iterator

import re2

#: Longest expression text a config may hold, most RE2 instructions it may compile to, and the
#: memory RE2 may use for it (program and DFA cache).
MAX_REGEX_CHARS = 1024
MAX_PROGRAM_SIZE = 5000
MAX_MEMORY = 2 << 20
#: Most matches of one expression used in one text (LocalAI's configs expect a handful).
MAX_MATCHES = 64


class RegexError(ValueError):
    """An expression RE2 cannot take (backreference, lookaround, too large, ...)."""


def _options() -> re2.Options:
    options = re2.Options()
    options.max_mem = MAX_MEMORY
    options.log_errors = False  # the caller reports the error, naming the config key
    return options


class ConfigRegex:
    """One compiled expression of a model config."""

    __slots__ = ("pattern", "_regex")

    def __init__(self, pattern: str):
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_REGEX_CHARS:
            raise RegexError(f"must be a regular expression (1 to {MAX_REGEX_CHARS} "
                             "characters)")
        try:
            regex = re2.compile(pattern, _options())
        except re2.error as e:
            why = e.args[0] if e.args else "does not compile"
            if isinstance(why, bytes):
                why = why.decode("utf-8", "replace")
            raise RegexError(f"is not a regular expression RE2 (Go's regexp) accepts: "
                             f"{str(why)[:200]} (backreferences and lookaround are not "
                             "RE2)") from None
        if regex.programsize > MAX_PROGRAM_SIZE:
            raise RegexError(f"compiles to {regex.programsize} RE2 instructions, more than "
                             f"{MAX_PROGRAM_SIZE}: use a smaller expression")
        self.pattern = pattern
        self._regex = regex

    @property
    def groups(self) -> int:
        return self._regex.groups

    def finditer(self, text: str) -> Iterator:
        """The first :data:`MAX_MATCHES` non-overlapping matches, left to right (``re``'s
        match objects: ``span``, ``group``, ``groups``, ``groupdict``)."""
        for count, match in enumerate(self._regex.finditer(_usable(text))):
            if count >= MAX_MATCHES:
                return
            yield match

    def sub(self, template: "GoTemplate", text: str) -> str:
        """Go's ``ReplaceAllString`` for the first :data:`MAX_MATCHES` matches."""
        text = _usable(text)
        pieces, at = [], 0
        for match in self.finditer(text):
            start, end = match.span()
            pieces.append(text[at:start])
            pieces.append(template.expand(match))
            at = end
        if not pieces:
            return text
        pieces.append(text[at:])
        return "".join(pieces)

    def __repr__(self) -> str:
        return f"ConfigRegex({self.pattern!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ConfigRegex) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)


def _usable(text: str) -> str:
    """``text`` encodable as UTF-8 (RE2's input): a lone surrogate becomes U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


class GoTemplate:
    """A Go ``regexp`` replacement template, parsed once: ``$name`` takes the longest run of
    letters, digits and ``_`` (``$1x`` is the group named ``1x``), ``${name}`` brackets it,
    ``$$`` is a ``$``; a name that is a number is a group index; a group that does not exist
    or did not take part is empty; any other ``$`` is kept as it is."""

    __slots__ = ("text", "_pieces")

    def __init__(self, text: str):
        self.text = text
        pieces: list[tuple[bool, str | int]] = []  # (is_group, literal or group)
        literal, i = [], 0
        while i < len(text):
            c = text[i]
            if c != "$" or i + 1 == len(text):
                literal.append(c)
                i += 1
                continue
            if text[i + 1] == "$":
                literal.append("$")
                i += 2
                continue
            if text[i + 1] == "{":
                close = text.find("}", i + 2)
                name = text[i + 2:close] if close > 0 else ""
                if not name or not all(ch.isalnum() or ch == "_" for ch in name):
                    literal.append(c)
                    i += 1
                    continue
                end = close + 1
            else:
                end = i + 1
                while end < len(text) and (text[end].isalnum() or text[end] == "_"):
                    end += 1
                name = text[i + 1:end]
                if not name:
                    literal.append(c)
                    i += 1
                    continue
            if literal:
                pieces.append((False, "".join(literal)))
                literal = []
            pieces.append((True, int(name) if name.isdigit() else name))
            i = end
        if literal:
            pieces.append((False, "".join(literal)))
        self._pieces = tuple(pieces)

    def expand(self, match) -> str:
        out = []
        for is_group, value in self._pieces:
            if not is_group:
                out.append(value)
                continue
            try:
                out.append(match.group(value) or "")
            except (IndexError, KeyError):
                pass  # Go: a group that does not exist is empty
        return "".join(out)

    def __repr__(self) -> str:
        return f"GoTemplate({self.text!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, GoTemplate) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


__all__ = ["ConfigRegex", "GoTemplate", "MAX_MATCHES", "MAX_PROGRAM_SIZE", "MAX_REGEX_CHARS",
           "RegexError"]
