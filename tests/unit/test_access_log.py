"""The replica's access log written directly (web/accesslog.py): the same line text as
twisted.web's combined log format through the plugin's text observer, client-sent control
characters escaped, lines batched but never lost when the listener stops, none for
``--access-log off``."""

from __future__ import annotations

import io
import re

from hypothesis import given, settings, strategies as st
from twisted.internet import task
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.logger import LogPublisher, textFileLogObserver, Logger
from twisted.python.log import LoggingFile
from twisted.web.http import combinedLogFormatter

from localai_tw.logs import TextLines
from localai_tw.web.accesslog import AccessLog, combined_line
from localai_tw.web.listener import BoundedSite


class Request:
    def __init__(self, uri=b"/v1/completions", *, method=b"POST", code=200, sent=123,
                 headers=None, address=None, proto=b"HTTP/1.1"):
        self.uri, self.method, self.code, self.sentLength = uri, method, code, sent
        self.path = uri.split(b"?", 1)[0]
        self.clientproto = proto
        self.headers = headers or {}
        self.address = address or IPv4Address("TCP", "127.0.0.1", 40000)

    def getClientAddress(self):
        return self.address

    def getHeader(self, name):
        return self.headers.get(name)


HOSTILE = [
    Request(b"/v1/completions?x=\r\n\"200\" fake line\x1b[31m", headers={
        b"user-agent": b"curl\n\"127.0.0.1\" - - forged", b"referer": b"it's \\ \xff"}),
    Request(b"/v1/models", method=b"GET", code=404, sent=0,
            address=IPv6Address("TCP", "::1", 40000), headers={b"user-agent": b"a'\"b"}),
    Request(b"/v1/chat/completions", headers={b"user-agent": b"python-requests/2.31"}),
]


@settings(max_examples=300, deadline=None)
@given(uri=st.binary(max_size=60), agent=st.binary(max_size=30),
       method=st.binary(min_size=1, max_size=8), code=st.integers(100, 599),
       sent=st.integers(0, 10**9))
def test_the_line_is_twisted_webs_combined_format(uri, agent, method, code, sent):
    request = Request(uri, method=method, code=code, sent=sent,
                      headers={b"user-agent": agent})
    stamp = "[04/Dec/2026:15:57:16 +0000]"
    assert combined_line(stamp, request) == combinedLogFormatter(stamp, request)


def test_client_sent_control_characters_never_reach_the_file_raw():
    out = io.StringIO()
    site = BoundedSite(None)
    site._logDateTime = "[04/Dec/2026:15:57:16 +0000]"
    site.write_access_lines_to(TextLines(out))
    for request in HOSTILE:
        site.log(request)
    site.stopFactory()
    lines = out.getvalue().split("\n")
    assert lines[-1] == "" and len(lines) == 1 + len(HOSTILE)  # one line per request
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()
    assert '\\r\\n\\"200\\" fake line\\x1b[31m' in lines[0]
    assert '"curl\\n\\"127.0.0.1\\" - - forged"' in lines[0]
    assert "it's \\\\ \\xff" in lines[0]


def test_the_file_holds_what_the_text_observer_wrote_for_the_old_path():
    """Byte for byte, but for the time: the line an operator greps did not change."""
    old = io.StringIO()
    publisher = LogPublisher(textFileLogObserver(old))
    legacy = LoggingFile(Logger(namespace="twisted.python.log", observer=publisher))
    stamp = "[04/Dec/2026:15:57:16 +0000]"
    for request in HOSTILE:
        legacy.write(combinedLogFormatter(stamp, request) + "\n")
    new = io.StringIO()
    site = BoundedSite(None)
    site._logDateTime = stamp
    site.write_access_lines_to(TextLines(new))
    for request in HOSTILE:
        site.log(request)
    site.stopFactory()
    time = re.compile(r"^\S+ ", re.M)
    assert time.sub("", new.getvalue()) == time.sub("", old.getvalue())
    assert new.getvalue().startswith(old.getvalue()[:4])  # the year: a real time prefix


class Sink:
    def __init__(self):
        self.writes: list[str] = []

    def frame(self, text, now):
        return f"{now:g} {text}\n"

    def write(self, framed):
        self.writes.append(framed)


def test_lines_are_written_together_within_the_delay_and_bounded():
    clock, sink = task.Clock(), Sink()
    access = AccessLog(clock, sink, delay=0.05, max_chars=40)
    access.add("a")
    access.add("b")
    assert sink.writes == []
    clock.advance(0.05)
    assert sink.writes == ["0 a\n0 b\n"]  # one write for the batch
    assert clock.getDelayedCalls() == []
    access.add("x" * 50)  # past max_chars: written at once, no timer left behind
    assert sink.writes[-1] == "0.05 " + "x" * 50 + "\n"
    assert clock.getDelayedCalls() == []


def test_stopping_the_listener_writes_what_is_held_and_later_lines_at_once():
    clock, sink = task.Clock(), Sink()
    site = BoundedSite(None, reactor=clock)
    site.write_access_lines_to(sink)
    site.startFactory()
    site.log(Request())
    assert sink.writes == []
    site.stopFactory()
    assert len(sink.writes) == 1 and '"POST /v1/completions HTTP/1.1" 200 123' in sink.writes[0]
    assert clock.getDelayedCalls() == []
    site.log(Request(code=502))  # a request still finishing on an open connection
    assert len(sink.writes) == 2 and " 502 " in sink.writes[1]


def test_access_log_off_writes_nothing():
    clock, sink = task.Clock(), Sink()
    site = BoundedSite(None, reactor=clock, access_log="off")
    site.write_access_lines_to(sink)
    site.startFactory()
    for request in HOSTILE:
        site.log(request)
    clock.advance(1)
    site.stopFactory()
    assert sink.writes == []


def test_a_failing_log_file_drops_its_batch_and_says_so_once_a_minute():
    from twisted.logger import globalLogPublisher

    class Full(Sink):
        def write(self, framed):
            raise OSError(28, "No space left on device")

    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        clock = task.Clock()
        access = AccessLog(clock, Full(), delay=0.05)
        for second in range(3):
            access.add("a")
            access.add("b")
            clock.advance(0.05)
        clock.advance(60)
        access.add("c")
        clock.advance(0.05)
    finally:
        globalLogPublisher.removeObserver(events.append)
    told = [e for e in events if "access lines" in e.get("log_format", "")]
    assert [e["dropped"] for e in told] == [2, 5]  # the first batch, then the four since + c
    assert access._held == [] and clock.getDelayedCalls() == []
