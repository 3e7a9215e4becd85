"""Writing the control plane's replies: JSON answers and problems (:mod:`localai_tw.web.json`),
the 404 of an unknown verb path, and the NDJSON stream of a streaming verb (progress lines,
then one reply line), paced by the caller's reading."""

from __future__ import annotations

import json
from typing import Any, Iterable

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from zope.interface import implementer

from localai_tw.web import json as web_json

log = Logger()

#: How much of an unknown path a 404 echoes back.
MAX_ECHOED_PATH_BYTES = 128
#: Bytes of NDJSON a streaming verb may write while the peer is not reading before the stream
#: is dropped (the frontend reads progress promptly; a stuck reader must not grow memory).
MAX_UNREAD_STREAM_BYTES = 4 * 1024 * 1024

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


@implementer(IPushProducer)
class NDJSONReplyStream:
    """The body of a streaming verb's reply: progress lines, then exactly one reply line.

    The status line and headers go out with the first line, so a verb that fails before its
    first progress still gets a plain status (400, 503, 500).  Registered as the request's
    producer, it learns when the caller stops reading: :meth:`progress` then returns a
    Deferred that fires on resume, and writing more than :data:`MAX_UNREAD_STREAM_BYTES` while
    paused drops the connection.
    """

    def __init__(self, request, verb: str, max_unread_bytes: int = MAX_UNREAD_STREAM_BYTES):
        self.request = request
        self.verb = verb
        self.max_unread_bytes = max_unread_bytes
        self.started = False
        self.replied = False
        self.paused = False
        self.unread_bytes = 0
        self._resumed_waiters: list[defer.Deferred] = []

    def _gone(self) -> bool:
        return self.request.finished or getattr(self.request, "_disconnected", False)

    def _start(self):
        self.started = True
        request = self.request
        request.setResponseCode(200)
        request.setHeader(b"content-type", NDJSON_TYPE)
        request.setHeader(b"x-content-type-options", b"nosniff")
        request.setHeader(b"cache-control", b"no-store")
        request.registerProducer(self, True)

    def _write_line(self, obj: dict) -> None:
        line = json.dumps(obj).encode("utf-8") + b"\n"  # TypeError for a non-JSON value
        if self._gone():
            return
        if not self.started:
            self._start()
        self.request.write(line)
        if self.paused:
            self.unread_bytes += len(line)
            if self.unread_bytes > self.max_unread_bytes:
                log.warn(
                    "control verb {verb}: caller stopped reading; dropping the stream",
                    verb=self.verb,
                )
                transport = self.request.channel.transport if self.request.channel else None
                if transport is not None:
                    abort = getattr(transport, "abortConnection", transport.loseConnection)
                    abort()

    def progress(self, value: Any) -> defer.Deferred:
        if self.replied:
            raise RuntimeError("progress after the reply line")
        self._write_line({"progress": value})
        if self.paused and not self._gone():
            waiter = defer.Deferred()
            self._resumed_waiters.append(waiter)
            return waiter
        return defer.succeed(None)

    def reply(self, value: Any) -> None:
        if self.replied:
            raise RuntimeError("a streaming verb replies exactly once")
        self._write_line({"reply": {} if value is None else value})
        self.replied = True
        self._finish()

    def _finish(self):
        self._release_waiters()
        if self._gone():
            return
        if self.started:
            self.request.unregisterProducer()
        self.request.finish()

    def _release_waiters(self):
        waiters, self._resumed_waiters = self._resumed_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    # IPushProducer: the request's channel tells us when the caller stops and starts reading.
    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False
        self.unread_bytes = 0
        self._release_waiters()

    def stopProducing(self):
        self.paused = False
        self._release_waiters()
