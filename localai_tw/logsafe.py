"""Untrusted text made safe for one log line.

A value an anonymous client chose (a query argument, a header, a name it claims) must never
forge log lines or flood the log: control characters (CR, LF, ESC, NUL ...) and lone surrogates
become visible escapes, and the result is bounded.  Used wherever such a value reaches a log
event before it has been authenticated or validated.
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
