"""Untrusted text made safe to show: the one rule, in two renderings.

A value an anonymous client, a worker or a backend chose (a query argument, a header, a name it
claims, an error text) must never forge lines or flood what shows it: every character that is
not printable (CR, LF, ESC, NUL, lone surrogates ...) is replaced, and the result is bounded.

- :func:`untrusted`, for a log line: such characters become visible escapes (an operator can
  tell what was sent).
- :func:`printable`, for a message a client or an admin reads (an error body, a row of
  ``/api/nodes``): such characters become ``?``.

Wire protocols that admit only printable ASCII validate instead of cleaning
(``tunnel/preamble.py``, ``worker/control/replies.py``).
"""

from __future__ import annotations

MAX_LOGGED_CHARS = 120


def untrusted(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """``value`` as printable text on one line, at most ``limit`` characters plus a marker."""
    if isinstance(value, bytes):
        text = value.decode("utf-8", "backslashreplace")
    else:
        text = str(value)
    clipped = text[:limit]
    escaped = "".join(c if c.isprintable() else _escape(c) for c in clipped)
    return escaped + (f"...(+{len(text) - limit} chars)" if len(text) > limit else "")


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, limit: int | None = None, *, replacement: str = "?") -> str:
    """``text`` with every character that is not printable replaced, at most ``limit``
    characters (None: all) followed by ``...`` when cut."""
    clipped = text if limit is None else text[:limit]
    cleaned = "".join(c if c.isprintable() else replacement for c in clipped)
    return cleaned + ("..." if limit is not None and len(text) > limit else "")
