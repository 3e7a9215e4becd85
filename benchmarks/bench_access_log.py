"""Benchmark of one access log line: the CPU the replica's reactor spends per logged request.

Usage:  python benchmarks/bench_access_log.py [--lines 20000] [--rounds 5] [--file PATH]

Two ways to the same log file, alternated round by round (best and median of the rounds):

- ``event``: ``twisted.web``'s way, as the replica logged before ``web/accesslog.py``: the
  ``combinedLogFormatter`` line written to the legacy log file (``twisted.python.log.logfile``)
  -> a ``twisted.logger`` event -> the plugin's text observer behind the ``--log-level``
  filter (``logs.level_filter``) -> a write and a flush per line;
- ``batched``: ``BoundedSite.log`` with ``write_access_lines_to(logs.TextLines(file))``, as the
  frontend under twistd: the line formatted directly, framed, held and written in batches (the
  flush timer fired every 16 lines here, as a reactor would at about c=16; ``--batch 1`` for
  a flush per line, the worst case at c=1).

The request is a realistic ``/v1/completions`` one (a user agent, no referer).  CPU is
``time.process_time`` around each round.  A script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.logger import Logger, LogPublisher, textFileLogObserver
from twisted.python.log import LoggingFile
from twisted.web.http import HTTPFactory

from localai_tw.logs import DEFAULT_LEVEL, TextLines, level_filter
from localai_tw.web.listener import BoundedSite


class Request:
    method, uri, path, clientproto = b"POST", b"/v1/completions", b"/v1/completions", b"HTTP/1.1"
    code, sentLength = 200, 412
    _headers = {b"user-agent": b"python-requests/2.31.0"}

    def getClientAddress(self):
        return IPv4Address("TCP", "127.0.0.1", 40000)

    def getHeader(self, name):
        return self._headers.get(name)


def event_round(out, lines: int) -> float:
    publisher = LogPublisher(level_filter(textFileLogObserver(out), DEFAULT_LEVEL))
    factory = HTTPFactory()
    factory._logFile = LoggingFile(Logger(namespace="twisted.python.log", observer=publisher))
    factory._logDateTime = "[04/Dec/2026:15:57:16 +0000]"
    request = Request()
    start = time.process_time()
    for _ in range(lines):
        HTTPFactory.log(factory, request)
    return time.process_time() - start


def batched_round(out, lines: int, batch: int) -> float:
    clock = task.Clock()
    site = BoundedSite(None, reactor=clock)
    site._logDateTime = "[04/Dec/2026:15:57:16 +0000]"
    site.write_access_lines_to(TextLines(out))
    request = Request()
    start = time.process_time()
    for i in range(lines):
        site.log(request)
        if i % batch == batch - 1:
            clock.advance(0.05)
    site.access_lines.stop()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--file", default="/tmp/bench_access_log.log")
    args = parser.parse_args()
    figures: dict[str, list[float]] = {"event": [], "batched": []}
    with open(args.file, "w", encoding="utf-8") as out:
        for _ in range(args.rounds):
            figures["event"].append(1e6 * event_round(out, args.lines) / args.lines)
            figures["batched"].append(
                1e6 * batched_round(out, args.lines, args.batch) / args.lines)
    os.unlink(args.file)
    print(f"load average: {' '.join('%.2f' % x for x in os.getloadavg())}")
    print(f"CPU us per line, {args.rounds} rounds of {args.lines}, batch {args.batch}:")
    for name, values in figures.items():
        print(f"  {name:<8} best {min(values):6.1f}  median {statistics.median(values):6.1f}")
    ratio = statistics.median(figures["batched"]) / statistics.median(figures["event"])
    print(f"  batched / event (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
