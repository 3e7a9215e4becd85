"""Request bodies read as JSON objects, at a cost the reactor can bear whatever the body holds.

Decoding 8 MiB of JSON is up to a second of C code that holds the GIL (``[[1],[1],...]``:
two million lists, most of the time in the cyclic garbage collector), and the check for NUL
and lone surrogates walks every value in Python after it.  So a body's cost is bounded before
it is decoded, from two byte counts that take microseconds:

- at most :data:`MAX_JSON_CONTAINERS` ``[`` and ``{`` in the body (an upper bound on its
  arrays and objects, which are what the garbage collector and deallocation pay for): beyond
  it, a 413 that says to send fewer items a request;
- up to :data:`INLINE_JSON_VALUES` values (commas plus containers bound them), the body is
  decoded on the reactor by the C decoder (a few milliseconds at most);
- beyond that, :func:`prepare_json_body` decodes it in the replica's one thread for such work
  (:mod:`.offload`) with the pure-Python decoder, which runs bytecode and so hands the GIL
  back to the reactor every switch interval: the request takes longer (seconds for 8 MiB of
  small numbers), ``/healthz`` does not (``tests/integration/test_cpu_attacks.py``).

:func:`read_json_object` then answers from what :func:`prepare_json_body` decoded.  A route
whose body cap admits more than :data:`INLINE_JSON_VALUES` values must call
:func:`prepare_json_body` first; one that does not gets a 413 for such a body, never a stall.

What this module must never do: decode a body past the inline bound on the reactor, or accept
a string that no backend, gRPC message or database row can carry.
"""

from __future__ import annotations

import json
import json.scanner
from typing import Any


from localai_tw.frontend.api import offload
from localai_tw.web.errors import APIError, bad_request, too_large
from localai_tw.web.listener import MAX_BODY_BYTES
from localai_tw import logsafe

#: Values (an upper bound: commas plus ``[`` and ``{``) decoded on the reactor.
INLINE_JSON_VALUES = 65_536
#: ``[`` and ``{`` characters a body may hold (an upper bound on its arrays and objects).
MAX_JSON_CONTAINERS = 262_144

#: Where :func:`prepare_json_body` leaves the decoded body (or the error to answer).
_DECODED = "ltw_decoded_json"


def _raw_body(request) -> bytes:
    content = request.content
    if content is None:
        return b""
    limit = getattr(content, "limit", MAX_BODY_BYTES)
    content.seek(0, 0)
    raw = content.read(limit + 1)
    if len(raw) > limit:
        raise too_large(limit)
    return raw


def _is_json(request) -> bool:
    content_type = request.getHeader(b"content-type")
    return (content_type or b"").split(b";", 1)[0].strip().lower() == b"application/json"


def _values_bound(raw: bytes) -> tuple[int, int]:
    """(containers, values): upper bounds read from byte counts, strings included."""
    containers = raw.count(b"[") + raw.count(b"{")
    return containers, containers + raw.count(b",") + 1


def _too_complex(containers: int) -> APIError:
    return APIError(413, f"the request body holds {containers} '[' and '{{' characters; at "
                    f"most {MAX_JSON_CONTAINERS} arrays and objects are accepted in one "
                    "request: send fewer items a request (split the batch)",
                    "request_too_large", code="request_too_complex")


async def prepare_json_body(request, reactor=None) -> None:
    """Decode the JSON body once, for :func:`read_json_object` to answer from: a small one
    here, a big one off the reactor.  Does nothing for an empty body or one that is not
    ``application/json`` (read_json_object decides about those)."""
    if not _is_json(request):
        return
    try:
        raw = _raw_body(request)
        if not raw.strip():
            return
        containers, values = _values_bound(raw)
        if containers > MAX_JSON_CONTAINERS:
            raise _too_complex(containers)
        if values <= INLINE_JSON_VALUES:
            decoded = _decode(raw)
        else:
            if reactor is None:
                from twisted.internet import reactor
            decoded = await offload.run(reactor, _decode, raw, slowly=True)
    except APIError as e:
        decoded = e
    setattr(request, _DECODED, decoded)


def read_json_object(request, *, required: bool = True) -> dict:
    """The request body as a JSON object.

    :param required: False lets an empty body stand for ``{}``.
    :raises APIError: 413 over the cap (a backstop: ``BoundedRequest`` refuses earlier) or
        over the bounds above, 415 for a body whose Content-Type is not ``application/json``
        (a missing one too: a web page can send a body without a Content-Type, or as
        ``text/plain``, to any address without asking the browser first, so an API reachable
        without a key, the loopback default, would be driven by any page its user opens),
        400 for a body that is not UTF-8 JSON or not an object.
    """
    content_type = request.getHeader(b"content-type")
    if not _is_json(request) and _has_body(request):
        media = (content_type or b"").split(b";", 1)[0].strip().lower()
        sent = (f"Content-Type {logsafe.printable(media.decode('latin-1'), 64)!r} is"
                if content_type is not None else "a body without a Content-Type is")
        raise APIError(415, f"{sent} not accepted: the body must be JSON sent with "
                       "Content-Type: application/json (curl: -H 'Content-Type: "
                       "application/json')", "unsupported_media_type",
                       code="unsupported_media_type")
    decoded = getattr(request, _DECODED, None)
    if isinstance(decoded, APIError):
        raise decoded
    if decoded is None:
        raw = _raw_body(request)
        if not raw.strip():
            if required:
                raise bad_request("the request body is empty; a JSON object is expected")
            return {}
        containers, values = _values_bound(raw)
        if containers > MAX_JSON_CONTAINERS:
            raise _too_complex(containers)
        if values > INLINE_JSON_VALUES:
            raise APIError(413, f"the request body holds up to {values} JSON values; this "
                           f"route accepts at most {INLINE_JSON_VALUES}", "request_too_large",
                           code="request_too_complex")
        decoded = _decode(raw)
    return decoded


def _decode(raw: bytes, slowly: bool = False) -> dict:
    """Decode and check a body (``slowly``: with the pure-Python decoder, in the thread)."""
    if not raw.strip():
        raise bad_request("the request body is empty; a JSON object is expected")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8") from None
    decoder = json.JSONDecoder(parse_constant=_refuse_constant)
    if slowly:
        decoder.scan_once = json.scanner.py_make_scanner(decoder)
    try:
        decoded = decoder.decode(text)
    except (ValueError, RecursionError) as e:
        detail = f": {e.msg} at character {e.pos}" if isinstance(e, json.JSONDecodeError) else ""
        raise bad_request(f"the request body is not valid JSON{detail}") from None
    if not isinstance(decoded, dict):
        raise bad_request("the request body must be a JSON object")
    unsafe = _first_unsafe_string(decoded, "")
    if unsafe is not None:
        where, what = unsafe
        raise bad_request(f"{where or 'a field name'} contains {what}, which no backend, "
                          f"gRPC message or database row can carry", field=where or None)
    return decoded


def _has_body(request) -> bool:
    content = request.content
    if content is None:
        return False
    position = content.tell()
    content.seek(0, 2)
    size = content.tell()
    content.seek(position, 0)
    return size > 0


def _first_unsafe_string(value: Any, path: str) -> tuple[str, str] | None:
    """The JSON path of the first key or string holding a NUL or a lone surrogate, and which.

    JSON may spell both (``"\\u0000"``, ``"\\ud800"``); neither survives the trip on: protobuf
    strings must be valid UTF-8 and PostgreSQL text refuses NUL, so they are refused here, at
    the door, instead of failing deep inside with a 500.  Nesting is already bounded by the
    JSON decoder's recursion limit (a deeper body is a 400 above).
    """
    if isinstance(value, str):
        if "\x00" in value:
            return path, "a NUL character (\\u0000)"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, "a lone surrogate (an unpaired \\ud800-\\udfff escape)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = _first_unsafe_string(key, path) or _first_unsafe_string(item, where)
            if found is not None:
                return logsafe.printable(found[0], 64), found[1]
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _first_unsafe_string(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
