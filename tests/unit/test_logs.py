"""``localai_tw.logs``: refusals one source repeats are summarised, not logged one by one; the
log file twistd writes is rotated and bounded; ``--log-format json`` writes JSON lines."""

from __future__ import annotations

import json

from twisted.internet import task
from twisted.logger import LogPublisher, Logger, formatEvent

from localai_tw import logs

SUMMARY = "refused {count} requests from {source} in the last {seconds:g} s"


def limited(**kwargs):
    clock = task.Clock()
    events = []
    publisher = LogPublisher(events.append)
    limiter = logs.RateLimitedLog(SUMMARY, clock=clock, logger=Logger(observer=publisher),
                                  **kwargs)
    return clock, events, limiter


def test_a_burst_is_logged_then_the_rest_is_one_summary_with_the_true_count():
    clock, events, limiter = limited(window=10, burst=3)
    allowed = [limiter.allow("10.0.0.9") for _ in range(10432)]
    assert allowed[:3] == [True] * 3 and not any(allowed[3:])
    assert events == []  # the summary waits for the window to close
    clock.advance(10)
    assert [formatEvent(e) for e in events] == [
        "refused 10432 requests from 10.0.0.9 in the last 10 s"]
    assert events[0]["suppressed"] == 10429


def test_sources_are_counted_apart_and_a_quiet_source_gets_no_summary():
    clock, events, limiter = limited(window=10, burst=2)
    assert [limiter.allow("a") for _ in range(3)] == [True, True, False]
    assert [limiter.allow("b") for _ in range(2)] == [True, True]
    clock.advance(10)
    assert [formatEvent(e) for e in events] == ["refused 3 requests from a in the last 10 s"]
    assert limiter.allow("a")  # a new window logs again


def test_the_number_of_sources_tracked_is_bounded():
    """Memory does not grow with the number of sources an attacker uses: the least recently
    seen is dropped, its summary logged at once."""
    clock, events, limiter = limited(window=10, burst=1, max_keys=2)
    for source in ("a", "a", "b", "c"):
        limiter.allow(source)
    assert len(limiter._windows) == 2
    assert [formatEvent(e) for e in events] == ["refused 2 requests from a in the last 10 s"]
    assert not clock.getDelayedCalls()  # a's window end was cancelled with it
    limiter.flush()
    assert clock.getDelayedCalls() == []


def options(**values):
    base = {"logfile": None, "nodaemon": False, "syslog": False}
    base.update(values)
    return base


def test_the_log_file_is_rotated_and_only_max_files_are_kept(tmp_path):
    path = tmp_path / "twistd.log"
    observer = logs.twistd_observer(options(logfile=str(path)), "text", max_bytes=1000,
                                    max_files=2)
    log = Logger(observer=observer)
    for i in range(200):
        log.info("line {i} " + "x" * 50, i=i)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["twistd.log", "twistd.log.1", "twistd.log.2"]
    assert all(p.stat().st_size <= 1000 + 200 for p in tmp_path.iterdir())
    assert "line 199 " in path.read_text()


def test_json_format_writes_one_object_per_line(tmp_path):
    path = tmp_path / "twistd.log"
    log = Logger(observer=logs.twistd_observer(options(logfile=str(path)), "json"))
    log.info("refused {count} requests from {source}", count=3, source="10.0.0.9")
    log.warn("a second line\nwith a newline inside")
    lines = path.read_text().split("\n")
    assert len(lines) == 3 and lines[2] == ""
    first, second = json.loads(lines[0]), json.loads(lines[1])
    assert first["text"] == formatEvent(first) == "refused 3 requests from 10.0.0.9"
    assert second["text"] == "a second line\nwith a newline inside"
    assert first["log_level"]["name"] == "info" and first["source"] == "10.0.0.9"


def test_a_librarys_per_connection_warnings_are_summarised_not_repeated():
    """A replica stopping with 1000 tunnels logged 1032 Autobahn lines "dropping connection to
    peer ... closing handshake timeout", one per connection.  The log filter shows the first 5
    of a kind per 10 s and then one summary with the true count; the project's own events and
    a library's info lines pass untouched.  (Remove RepeatedLibraryEvents from level_filter:
    1000 lines reach the log.)"""
    from twisted.internet import task
    from twisted.logger import Logger, LogLevel, formatEvent

    from localai_tw import logs

    clock = task.Clock()
    seen = []
    observer = logs.level_filter(seen.append, "info", clock=clock)
    autobahn = Logger(namespace="autobahn.twisted.websocket.WebSocketServerProtocol",
                      observer=observer)
    ours = Logger(namespace="localai_tw.tunnel.registry", observer=observer)
    for port in range(1000):
        autobahn.warn("dropping connection to peer {peer} with abort=True: WebSocket closing "
                      "handshake timeout", peer=f"tcp4:127.0.0.1:{port}")
        if port < 20:
            ours.warn("release failed for node {node}", node=port)
            autobahn.info("connection {port} opened", port=port)
    from twisted.logger import globalLogPublisher

    summaries = []
    globalLogPublisher.addObserver(summaries.append)
    try:
        clock.advance(10)
    finally:
        globalLogPublisher.removeObserver(summaries.append)
    shown = [e for e in seen if e["log_namespace"].startswith("autobahn") and
             e["log_level"] is LogLevel.warn]
    assert len(shown) == 5
    assert len([e for e in seen if e["log_namespace"] == "localai_tw.tunnel.registry"]) == 20
    assert len([e for e in seen if e["log_level"] is LogLevel.info]) == 20
    [summary] = [formatEvent(e) for e in summaries if "more like this" in formatEvent(e)]
    assert "995 more like this in the last 10 s" in summary
    assert "closing handshake timeout" in summary


def test_twisteds_factory_lines_are_shown_only_at_debug():
    """Issue 26 §5: Twisted's "Starting/Stopping factory" lines were 36 of 78 lines of a
    worker's log at the default level (one pair per outgoing connection of Twisted's own HTTP
    client pools).  Hidden at info and above, shown at debug; our own factories are not noisy.
    (Drop factory_lifecycle_noise from level_filter: the lines come back.)"""
    from twisted.internet.protocol import Factory
    from twisted.logger import LogLevel

    from localai_tw.frontend.inference.grpcbridge import _BridgeFactory
    from localai_tw.web.listener import BoundedSite
    from localai_tw.worker.httpserve import WorkerSite

    for level, expected in (("info", 0), ("warn", 0), ("debug", 2)):
        seen = []
        observer = logs.level_filter(seen.append, level)
        twisted_factory = Logger(namespace="twisted.web.client._HTTP11ClientFactory",
                                 observer=observer)
        twisted_factory.info("Starting factory {factory!r}", factory="<pool>")
        twisted_factory.info("Stopping factory {factory!r}", factory="<pool>")
        Logger(namespace="localai_tw.worker.service", observer=observer).emit(
            LogLevel.warn, "registration failed")
        assert len([e for e in seen if "factory" in e["log_format"]]) == expected, level
        assert len(seen) == expected + 1
    assert Factory.noisy is True  # Twisted's default, which ours override
    assert not BoundedSite.noisy and not WorkerSite.noisy and not _BridgeFactory.noisy


def test_access_lines_go_to_the_text_file_only_where_its_observer_shows_info(tmp_path):
    """The direct writer (``TextLines``) exists for text logs at info or below; JSON logs and
    ``--log-level warn`` keep the one path that formats and filters them."""
    from twisted.application.service import Application

    made = {}
    for name, level, log_format in (("info", "info", "text"), ("debug", "debug", "text"),
                                    ("warn", "warn", "text"), ("json", "info", "json")):
        root = logs.LevelledMultiService(level, options(logfile=str(tmp_path / f"{name}.log")),
                                         log_format=log_format)
        root.setServiceParent(Application(name))
        made[name] = root.text_lines
    assert isinstance(made["info"], logs.TextLines) and isinstance(made["debug"], logs.TextLines)
    assert made["warn"] is None and made["json"] is None
    from twisted.application.service import MultiService

    made_roots = {}
    for name, root in (("info", made["info"]), ("outside twistd", None)):
        parent = logs.LevelledMultiService()  # no server options: outside twistd
        parent.text_lines = root
        child, grandchild = MultiService(), MultiService()
        child.setServiceParent(parent)
        grandchild.setServiceParent(child)
        made_roots[name] = logs.text_lines_of(grandchild)
    assert made_roots == {"info": made["info"], "outside twistd": None}
    lines = made["info"]
    lines.write(lines.frame('"127.0.0.1" - - [x] "GET / HTTP/1.1" 200 2 "-" "-"', 1e9))
    text = (tmp_path / "info.log").read_text()
    assert text.endswith(' [twisted.python.log#info] "127.0.0.1" - - [x] "GET / HTTP/1.1" 200 2 '
                         '"-" "-"\n')
