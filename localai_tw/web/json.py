"""Writing a JSON answer on a ``twisted.web`` request: the same headers everywhere
(``application/json``, ``no-store``, ``nosniff``), a ``Content-Length``, no body for ``HEAD``,
nothing at all once the caller left."""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Union

#: The headers of every JSON answer, early ones included.
JSON_HEADERS = (
    (b"content-type", b"application/json"),
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
)
#: ``json.dumps`` separators without spaces (the frontend's API answers).
COMPACT = (",", ":")

Headers = Union[Mapping[str, str], Iterable[tuple[bytes, bytes]]]


def header_pairs(headers: Headers) -> list[tuple[bytes, bytes]]:
    """``headers`` as ``(name, value)`` bytes, from a ``{str: str}`` mapping or bytes pairs."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return [(n.encode("ascii") if isinstance(n, str) else n,
             v.encode("ascii") if isinstance(v, str) else v) for n, v in pairs]


def caller_left(request) -> bool:
    """Whether ``request`` is answered already or its connection is gone (``twisted.web``
    drops the channel then)."""
    return bool(request.finished or getattr(request, "_disconnected", False)
                or getattr(request, "channel", False) is None)


def json_body(request, status: int, body: Any, headers: Headers = (),
              separators: tuple[str, str] | None = None) -> bytes:
    """Set ``status`` and the JSON headers on ``request`` and return the bytes to send (empty
    for ``HEAD``): for a synchronous ``render``."""
    payload = json.dumps(body, separators=separators).encode("utf-8")
    request.setResponseCode(status)
    for name, value in (*JSON_HEADERS, *header_pairs(headers)):
        request.setHeader(name, value)
    request.setHeader(b"content-length", b"%d" % len(payload))
    return b"" if request.method == b"HEAD" else payload


def write_json(request, status: int, body: Any, headers: Headers = (),
               separators: tuple[str, str] | None = None) -> None:
    """Finish ``request`` with a JSON answer, unless the caller already left."""
    if caller_left(request):
        return
    payload = json_body(request, status, body, headers, separators)
    if payload:
        request.write(payload)
    request.finish()
