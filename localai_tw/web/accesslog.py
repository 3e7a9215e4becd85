"""The replica's access log lines: formatted directly, written a batch at a time.

One line per API request is the largest single cost of the frontend's own HTTP path when each
line goes ``twisted.web``'s way (``combinedLogFormatter``, the legacy log file, a
``twisted.logger`` event, the text observer's time formatting, a write and a flush).  Here:

- :func:`combined_line` makes the same text as ``twisted.web.http.combinedLogFormatter``
  (the combined log format operators parse), escaping every client-sent field the same way:
  control characters, quotes and bytes outside printable ASCII become ``\\xNN``-style escapes
  (a ``repr``), so an injected newline or terminal sequence never reaches a log file raw;
- :class:`AccessLog` holds the framed lines of a short window (:data:`FLUSH_DELAY`, or
  :data:`MAX_BUFFERED_CHARS`, whichever comes first) and writes them in one write and one
  flush.  :meth:`AccessLog.stop` writes what is held and makes later lines go out at once, so
  nothing is lost when the listener stops.

Without a direct text sink (JSON logs, syslog, a ``--logger``, outside twistd), the site
writes each line the old way, one log event each.  This module never decides which requests
get a line (``listener.BoundedSite.log`` does) and never blocks the reactor beyond the write
of a batch to the log file, as the log observer itself does.
"""

from __future__ import annotations

import re
from typing import Any

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.logger import Logger

log = Logger()

#: Seconds a line may wait for the others of its batch.
FLUSH_DELAY = 0.05
#: Characters held at most before the batch is written at once (a few hundred lines; request
#: targets are bounded by twisted.web's 16 KiB head).
MAX_BUFFERED_CHARS = 64 * 1024

#: Seconds between two reports of failed writes (a full disk fails every batch).
FAILURE_REPORT_INTERVAL = 60.0

#: Bytes that make a field need the slow, escaping path: anything outside printable ASCII,
#: the double quote (the field delimiter) and the backslash (the escape character).
_NEEDS_ESCAPE = re.compile(rb'[^\x20\x21\x23-\x5b\x5d-\x7e]')


def escape_field(value: bytes | str) -> str:
    """``value`` as it appears between the double quotes of a combined log line: printable
    ASCII as is; else Python's ``repr`` of the bytes without its quotes, a double quote
    written ``\\"`` and a single quote unescaped (the text ``twisted.web`` writes)."""
    if not isinstance(value, bytes):
        value = value.encode("ascii", "backslashreplace")
    if _NEEDS_ESCAPE.search(value) is None:
        return value.decode("ascii")
    text = repr(value)[1:]  # drop the b prefix
    if text[0] == "'":
        return text[1:-1].replace('"', '\\"').replace("\\'", "'")
    return text[1:-1]  # repr chose double quotes: the value has a ' and no "


def combined_line(timestamp: str, request: Any) -> str:
    """The combined log line of ``request`` (``timestamp`` as ``[04/Dec/2026:15:57:16
    +0000]``), the text of ``twisted.web.http.combinedLogFormatter``."""
    address = request.getClientAddress()
    ip = escape_field(address.host) if isinstance(address, (IPv4Address, IPv6Address)) else "-"
    get_header = request.getHeader
    return (f'"{ip}" - - {timestamp} "{escape_field(request.method)} '
            f'{escape_field(request.uri)} {escape_field(request.clientproto)}" '
            f'{request.code:d} {request.sentLength or "-"} '
            f'"{escape_field(get_header(b"referer") or b"-")}" '
            f'"{escape_field(get_header(b"user-agent") or b"-")}"')


class AccessLog:
    """Access lines framed by ``sink`` (``logs.TextLines``) and written in batches.

    :param clock: the reactor (``seconds``, ``callLater``).
    :param sink: ``frame(text, now) -> str`` and ``write(framed)``.
    """

    def __init__(self, clock, sink, *, delay: float = FLUSH_DELAY,
                 max_chars: int = MAX_BUFFERED_CHARS):
        self._clock = clock
        self.sink = sink
        self._delay = delay
        self._max_chars = max_chars
        self._held: list[str] = []
        self._held_chars = 0
        self._call = None
        self._stopped = False
        #: Lines a failed write dropped (a full disk, a closed file), since the last report.
        self.dropped = 0
        self._reported: float | None = None

    def add(self, text: str) -> None:
        """One line; written within :data:`FLUSH_DELAY` (at once once stopped)."""
        framed = self.sink.frame(text, self._clock.seconds())
        self._held.append(framed)
        self._held_chars += len(framed)
        if self._stopped or self._held_chars >= self._max_chars:
            self.flush()
        elif self._call is None:
            self._call = self._clock.callLater(self._delay, self.flush)

    def flush(self) -> None:
        """Write the held lines now."""
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()
        if not self._held:
            return
        framed = "".join(self._held)
        count = len(self._held)
        self._held.clear()
        self._held_chars = 0
        try:
            self.sink.write(framed)
        except Exception:
            # Not retried: held lines stay bounded.  Told at most once a minute, through the
            # log's other path (which may well fail the same way; it is the one left).
            self.dropped += count
            now = self._clock.seconds()
            if self._reported is None or now - self._reported >= FAILURE_REPORT_INTERVAL:
                log.failure("writing access lines to the log file failed; {dropped} line(s) "
                            "dropped", dropped=self.dropped)
                self._reported, self.dropped = now, 0

    def start(self) -> None:
        """Hold lines for a batch again (the listener started again)."""
        self._stopped = False

    def stop(self) -> None:
        """Write what is held; later lines are written as they come (requests still finishing
        on connections the stopped listener had)."""
        self._stopped = True
        self.flush()
