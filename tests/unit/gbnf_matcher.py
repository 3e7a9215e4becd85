"""A small GBNF recogniser for tests: does a grammar accept a text?  It reads the subset
``localai_tw.localai.gbnf`` writes (rules ``name ::= body``, literals with ``\\`` escapes,
character classes with ranges and ``^``, groups, ``|``, and ``?``/``*``/``+``), so a test can
check the generated grammar by what it accepts and refuses instead of by its exact text.
Backtracking over sets of end positions: fine for the short texts tests use.
"""

from __future__ import annotations

import re

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "]": "]", "[": "[",
            "-": "-", "^": "^", "/": "/"}


def _unescape(text: str, i: int) -> tuple[str, int]:
    """The character at ``text[i]`` (an escape starting with ``\\`` included) and the index
    after it."""
    if text[i] != "\\":
        return text[i], i + 1
    c = text[i + 1]
    if c == "x":
        return chr(int(text[i + 2:i + 4], 16)), i + 4
    if c == "u":
        return chr(int(text[i + 2:i + 6], 16)), i + 6
    return _ESCAPES.get(c, c), i + 2


class Grammar:
    def __init__(self, source: str):
        self.rules: dict[str, list] = {}
        for line in source.splitlines():
            if not line.strip():
                continue
            name, _, body = line.partition("::=")
            self.rules[name.strip()] = self._parse(body.strip())
        for name, body in self.rules.items():
            self._check(body, name)

    def _check(self, node, rule):
        kind = node[0]
        if kind == "ref" and node[1] not in self.rules:
            raise ValueError(f"rule {rule} refers to undefined rule {node[1]}")
        if kind in ("alt", "seq"):
            for child in node[1]:
                self._check(child, rule)
        if kind == "rep":
            self._check(node[1], rule)

    def _parse(self, body: str):
        self.text, self.pos = body, 0
        node = self._alternatives()
        self._space()
        if self.pos != len(self.text):
            raise ValueError(f"cannot parse {self.text[self.pos:][:40]!r}")
        return node

    def _space(self):
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def _alternatives(self):
        options = [self._sequence()]
        while True:
            self._space()
            if self.pos < len(self.text) and self.text[self.pos] == "|":
                self.pos += 1
                options.append(self._sequence())
            else:
                return ("alt", options)

    def _sequence(self):
        items = []
        while True:
            self._space()
            if self.pos >= len(self.text) or self.text[self.pos] in "|)":
                return ("seq", items)
            item = self._atom()
            self._space()
            if self.pos < len(self.text) and self.text[self.pos] in "?*+":
                low, high = {"?": (0, 1), "*": (0, None), "+": (1, None)}[self.text[self.pos]]
                self.pos += 1
                item = ("rep", item, low, high)
            items.append(item)

    def _atom(self):
        text = self.text
        c = text[self.pos]
        if c == '"':
            i, chars = self.pos + 1, []
            while text[i] != '"':
                ch, i = _unescape(text, i)
                chars.append(ch)
            self.pos = i + 1
            return ("lit", "".join(chars))
        if c == "[":
            i = self.pos + 1
            negate = text[i] == "^"
            if negate:
                i += 1
            ranges = []
            while text[i] != "]":
                low, i = _unescape(text, i)
                high = low
                if text[i] == "-" and text[i + 1] != "]":
                    high, i = _unescape(text, i + 1)
                ranges.append((low, high))
            self.pos = i + 1
            return ("cls", tuple(ranges), negate)
        if c == "(":
            self.pos += 1
            node = self._alternatives()
            self._space()
            assert text[self.pos] == ")", text[self.pos:]
            self.pos += 1
            return node
        match = re.compile(r"[A-Za-z][A-Za-z0-9-]*").match(text, self.pos)
        if match is None:
            raise ValueError(f"unexpected {text[self.pos:][:20]!r}")
        self.pos = match.end()
        return ("ref", match.group())

    def _ends(self, node, s: str, at: int, depth=0) -> set[int]:
        if depth > 400:
            raise RecursionError("grammar too deep for this recogniser")
        kind = node[0]
        if kind == "lit":
            return {at + len(node[1])} if s.startswith(node[1], at) else set()
        if kind == "cls":
            if at >= len(s):
                return set()
            inside = any(low <= s[at] <= high for low, high in node[1])
            return {at + 1} if inside != node[2] else set()
        if kind == "ref":
            return self._ends(self.rules[node[1]], s, at, depth + 1)
        if kind == "alt":
            out: set[int] = set()
            for option in node[1]:
                out |= self._ends(option, s, at, depth + 1)
            return out
        if kind == "seq":
            positions = {at}
            for item in node[1]:
                positions = set().union(*(self._ends(item, s, p, depth + 1) for p in positions)) \
                    if positions else set()
            return positions
        _, item, low, high = node
        positions, reached, count = {at}, set(), 0
        if low == 0:
            reached |= positions
        while positions and (high is None or count < high):
            positions = set().union(*(self._ends(item, s, p, depth + 1) for p in positions)) \
                - ({at} if count else set())
            count += 1
            if count >= low:
                reached |= positions
            if high is None and count > len(s) + 1:
                break
        return reached

    def accepts(self, s: str) -> bool:
        return len(s) in self._ends(("ref", "root"), s, 0)
