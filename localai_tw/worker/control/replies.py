"""Writing the control plane's replies: JSON answers and problems (:mod:`localai_tw.web.json`),
the 404 of an unknown verb path, and the NDJSON stream of a streaming verb (progress lines,
then one reply line), paced by the caller's reading."""

from __future__ import annotations

import json
from typing import Any, Iterable

from twisted.internet import defer

from localai_tw.web import json as web_json
from localai_tw.web.streaming import MAX_UNREAD_BYTES, PacedWriter

#: How much of an unknown path a 404 echoes back.
MAX_ECHOED_PATH_BYTES = 128
#: Bytes of NDJSON a streaming verb may write without waiting while the peer is not reading
#: before the stream is dropped (the frontend reads progress promptly; a stuck reader must not
#: grow memory).
MAX_UNREAD_STREAM_BYTES = MAX_UNREAD_BYTES

JSON_TYPE = b"application/json"
NDJSON_TYPE = b"application/x-ndjson"


# -- writing replies ------------------------------------------------------------------------------


def write_json(request, code: int, body: Any, headers: Iterable[tuple[bytes, bytes]] = ()):
    """Finish ``request`` with a JSON body (unless the caller already left)."""
    web_json.write_json(request, code, body, headers)


def write_no_content(request):
    if web_json.caller_left(request):
        return
    request.setResponseCode(204)
    request.finish()


def write_problem(request, code: int, problem: str, headers=()):
    write_json(request, code, {"problem": problem}, headers)


def _printable_echo(raw: bytes, limit: int = MAX_ECHOED_PATH_BYTES) -> str:
    clipped = raw[:limit]
    return "".join(chr(b) if 0x21 <= b <= 0x7E else "?" for b in clipped)


def write_unknown_control_path(request):
    """404 under the prefix: the worker does not serve this verb."""
    if web_json.caller_left(request):
        return
    payload = ("unknown worker control path " + _printable_echo(request.path)).encode("ascii")
    request.setResponseCode(404)
    request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    request.setHeader(b"x-content-type-options", b"nosniff")
    request.setHeader(b"content-length", b"%d" % len(payload))
    if request.method != b"HEAD":
        request.write(payload)
    request.finish()


class NDJSONReplyStream:
    """The body of a streaming verb's reply: progress lines, then exactly one reply line,
    written through the shared :class:`~localai_tw.web.streaming.PacedWriter`.

    The status line and headers go out with the first line, so a verb that fails before its
    first progress still gets a plain status (400, 503, 500).  While the caller is not reading,
    :meth:`progress` returns a Deferred that fires when it reads again and fails
    (``ConnectionClosed``) when it leaves, so an awaiting verb stops; writing more than
    :data:`MAX_UNREAD_STREAM_BYTES` without waiting drops the connection.
    """

    def __init__(self, request, verb: str, max_unread_bytes: int = MAX_UNREAD_STREAM_BYTES):
        self.request = request
        self.verb = verb
        self.writer = PacedWriter(request, f"control verb {verb}", max_unread_bytes)
        self.replied = False

    @property
    def started(self) -> bool:
        return self.writer.started

    @property
    def gone(self) -> bool:
        """Whether the caller's connection is lost (it left, or was dropped)."""
        return self.writer.gone

    def _write_line(self, obj: dict) -> defer.Deferred | None:
        line = json.dumps(obj).encode("utf-8") + b"\n"  # TypeError for a non-JSON value
        if not self.writer.started and not self.writer.gone:
            request = self.request
            request.setResponseCode(200)
            request.setHeader(b"content-type", NDJSON_TYPE)
            request.setHeader(b"x-content-type-options", b"nosniff")
            request.setHeader(b"cache-control", b"no-store")
        return self.writer.write(line)

    def progress(self, value: Any) -> defer.Deferred:
        if self.replied:
            raise RuntimeError("progress after the reply line")
        waiting = self._write_line({"progress": value})
        return defer.succeed(None) if waiting is None else waiting

    def reply(self, value: Any) -> None:
        if self.replied:
            raise RuntimeError("a streaming verb replies exactly once")
        waiting = self._write_line({"reply": {} if value is None else value})
        if waiting is not None:
            waiting.addErrback(lambda _: None)  # the last line: nothing waits on its pace
        self.replied = True
        self.writer.finish()
