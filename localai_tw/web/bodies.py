"""A request body bounded while it arrives, and the answer written before (the rest of) a body.

``twisted.web`` reads a whole body (into a temporary file past a size) before a resource sees
the request.  Both servers replace that: when the headers end they choose a
:class:`CappedBody` (or refuse with :func:`answer_early`, which writes a whole JSON answer on
the raw transport, stops reading and closes), so nothing past a cap is ever buffered.
"""

from __future__ import annotations

import io
import json
from typing import Any

from twisted.internet.interfaces import IPushProducer
from twisted.web.http import RESPONSES

from localai_tw.web.json import JSON_HEADERS, Headers, header_pairs


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"request body larger than the limit of {limit} bytes")


class CappedBody(io.BytesIO):
    """A request body in memory up to ``limit`` bytes; a write past it raises
    :meth:`over_limit` and keeps nothing of it."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self._size = 0

    def accepts(self, more: int) -> bool:
        return self._size + more <= self.limit

    def over_limit(self) -> Exception:
        return BodyTooLarge(self.limit)

    def write(self, data) -> int:  # type: ignore[override]
        if not self.accepts(len(data)):
            raise self.over_limit()
        written = super().write(data)
        self._size = max(self._size, self.tell())
        return written


class SpooledCappedBody:
    """A request body on disk (an anonymous temporary file, gone when closed) up to ``limit``
    bytes: for uploads that should not sit in memory.  The same interface as
    :class:`CappedBody`; a write past the limit raises :meth:`over_limit` and keeps nothing of
    it.  Writes are small appends of what the transport just delivered."""

    def __init__(self, limit: int, directory: str | None = None):
        import tempfile

        self.limit = limit
        self._size = 0
        self.file = tempfile.TemporaryFile(dir=directory, prefix="localai-upload-")

    def accepts(self, more: int) -> bool:
        return self._size + more <= self.limit

    def over_limit(self) -> Exception:
        return BodyTooLarge(self.limit)

    def write(self, data) -> int:
        if not self.accepts(len(data)):
            raise self.over_limit()
        written = self.file.write(data)
        self._size = max(self._size, self.file.tell())
        return written

    @property
    def size(self) -> int:
        return self._size

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def read(self, size: int = -1) -> bytes:
        return self.file.read(size)

    def close(self) -> None:
        self.file.close()

    @property
    def closed(self) -> bool:
        return self.file.closed


def pending_request_line(channel) -> tuple[bytes, bytes] | None:
    """The method and raw target of the request whose headers just ended, or None.

    ``twisted.web`` hands the request line to the request only after the whole body arrived,
    too late to choose where the body goes; the channel keeps it in ``_command`` and ``_path``
    meanwhile.  If a Twisted release renames them this returns None and the callers fall back to
    their small default cap (fail closed); tests pin that prefixes still work.
    """
    method = getattr(channel, "_command", None)
    target = getattr(channel, "_path", None)
    if isinstance(method, bytes) and isinstance(target, bytes):
        return method, target
    return None


def answer_early(channel, status: int, body: Any, headers: Headers = (), *,
                 stop_reading: bool = True) -> None:
    """Write a whole JSON answer on ``channel``'s transport, outside ``twisted.web``'s response
    machinery (the request has no body yet, or only part of it).

    ``stop_reading`` (refusals): pause the transport and close, since the rest of the request
    will never be processed.  Otherwise the caller drains the announced body and closes.
    """
    transport = channel.transport
    if transport is None:
        return
    channel.persistent = False
    payload = json.dumps(body).encode("utf-8")
    head = [b"HTTP/1.1 %d %s" % (status, RESPONSES.get(status, b"Unknown"))]
    head += [name + b": " + value for name, value in (*JSON_HEADERS, *header_pairs(headers))]
    head += [b"content-length: %d" % len(payload), b"connection: close"]
    transport.write(b"\r\n".join(head) + b"\r\n\r\n" + payload)
    if not stop_reading:
        return
    producer = IPushProducer(transport, None)
    if producer is not None:
        try:
            producer.pauseProducing()  # read no more of what we refused
        except Exception:  # a transport that cannot pause is still closed below
            pass
    channel.loseConnection()
