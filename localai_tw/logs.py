"""What a twistd plugin's log shows: ``--log-level`` and gRPC core's own logging.

twistd builds its log observer (stdout with ``-n``, else ``twistd.log`` or syslog) after the
plugin's ``makeService`` and before starting the service tree, and it uses the application's
``ILogObserver`` component instead when there is one.  :class:`LevelledMultiService`, the root
service a plugin returns, sets that component when twistd attaches it to the application:
twistd's own default observer, wrapped in a ``FilteringLogObserver`` that drops events below
``--log-level``.  A ``--logger`` given to twistd wins and is not filtered (it is the
operator's explicit choice).  ``--log-format json`` writes one JSON object per line
(``twisted.logger.jsonFileLogObserver``); when twistd logs to a file (not ``-n``), the file is
rotated at ``--log-max-bytes`` and only ``--log-max-files`` rotated files are kept (twistd's own
default keeps every file).

:class:`RateLimitedLog` keeps log volume independent of what an attacker sends: events one
source repeats (refused requests, refused dials) are logged one by one only up to a small burst
per window, then counted and told in one summary line when the window closes.

:class:`TextLines` hands the plugin's own text log file to a writer of many similar lines (the
access log, ``web/accesslog.py``), which frames them as the text observer would and writes them
in batches, without a log event each; it exists only where the observer would show them (text
at ``info`` or below).

This module must never change what a library logs, only which of it is shown; and it never
overrides ``GRPC_VERBOSITY``/``GRPC_TRACE`` an operator set.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from twisted.application.service import MultiService
from twisted.logger import (
    FilteringLogObserver,
    ILogFilterPredicate,
    ILogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    Logger,
    PredicateResult,
    formatEvent,
    formatTime,
    jsonFileLogObserver,
    textFileLogObserver,
)
from twisted.python import logfile
from twisted.python.components import Componentized
from zope.interface import implementer

LEVELS = {
    "debug": LogLevel.debug,
    "info": LogLevel.info,
    "warn": LogLevel.warn,
    "error": LogLevel.error,
}
DEFAULT_LEVEL = "info"
FORMATS = ("text", "json")
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_FILES = 5


def quiet_grpc_core(environ: Any = os.environ) -> None:
    """Turn off gRPC core's own stderr logging (C-level lines that bypass twisted.logger)
    unless the operator asked for it with ``GRPC_VERBOSITY`` or ``GRPC_TRACE``.  Must run
    before grpc is first imported; backend processes inherit the setting."""
    if "GRPC_VERBOSITY" not in environ and "GRPC_TRACE" not in environ:
        environ["GRPC_VERBOSITY"] = "NONE"


def level_filter(observer, level: str, clock=None) -> FilteringLogObserver:
    """``observer`` seeing only events at ``level`` (a key of :data:`LEVELS`) or above, and
    libraries' repeated per-connection warnings summarised (:class:`RepeatedLibraryEvents`);
    Twisted's "Starting/Stopping factory" lines only at ``debug``
    (:func:`factory_lifecycle_noise`)."""
    predicates = [LogLevelFilterPredicate(defaultLogLevel=LEVELS[level]),
                  RepeatedLibraryEvents(clock=clock)]
    if LEVELS[level] > LogLevel.debug:
        predicates.append(factory_lifecycle_noise)
    return FilteringLogObserver(observer, predicates)


#: Twisted's ``Factory.doStart``/``doStop`` lines: logged at info for every outgoing connection
#: of a noisy factory (Twisted's own HTTP client pools among them), half a worker's log.
FACTORY_LIFECYCLE_FORMATS = frozenset({"Starting factory {factory!r}",
                                       "Stopping factory {factory!r}"})


@implementer(ILogFilterPredicate)
def factory_lifecycle_noise(event: dict):
    """Hides Twisted's "Starting/Stopping factory" events (shown at ``--log-level debug``).
    Our own factories are not noisy (``noisy = False``); this covers the libraries'."""
    if event.get("log_format") in FACTORY_LIFECYCLE_FORMATS:
        return PredicateResult.no
    return PredicateResult.maybe


@implementer(ILogFilterPredicate)
class RepeatedLibraryEvents:
    """Shows the first few of a library's repeated warnings per 10 s, then one summary line.

    Autobahn logs one warning per connection it drops ("WebSocket closing handshake timeout"),
    so a replica stopping with 1000 tunnels wrote 1032 such lines.  Events from the namespaces
    of :data:`LIBRARY_NAMESPACES` at warn level or above are keyed by their namespace and
    format string (not by peer), at most ``burst`` shown per ``window``; the rest are counted
    into "<format> (N more like this in the last 10 s, not shown)".  The project's own events
    are never touched: they bound their own volume where an attacker could drive it.
    """

    def __init__(self, *, clock=None, window: float = 10.0, burst: int = 5):
        self._limits = RateLimitedLog(
            "{source} ({suppressed} more like this in the last {seconds:g} s, not shown)",
            clock=clock, window=window, burst=burst, max_keys=64,
            logger=Logger(namespace="localai_tw.logs"), level=LogLevel.warn)

    def __call__(self, event: dict):
        namespace = event.get("log_namespace") or ""
        level = event.get("log_level")
        if (not namespace.startswith(LIBRARY_NAMESPACES) or level is None
                or level < LogLevel.warn):
            return PredicateResult.maybe
        key = f"[{namespace}] {event.get('log_format') or ''}"[:300]
        return PredicateResult.maybe if self._limits.allow(key) else PredicateResult.no


#: Library log namespaces whose warnings are per connection (and so scale with connections).
LIBRARY_NAMESPACES = ("autobahn.",)


def twistd_default_observer(server_options) -> Any:
    """The observer twistd would build from its own options (``-n``, ``--logfile``,
    ``--syslog``)."""
    from twisted.scripts.twistd import _SomeApplicationRunner

    return _SomeApplicationRunner.loggerFactory(server_options)._getLogObserver()


def twistd_observer(server_options, log_format: str = "text",
                    max_bytes: int = DEFAULT_MAX_BYTES,
                    max_files: int = DEFAULT_MAX_FILES) -> Any:
    """Where twistd would log (stdout with ``-n``, else ``--logfile``, default ``twistd.log``;
    ``--syslog`` is left to twistd), written as ``log_format``, a file rotated at ``max_bytes``
    keeping ``max_files`` rotated files.  ``SIGUSR1`` rotates the file, as under twistd."""
    return _twistd_observer_and_out(server_options, log_format, max_bytes, max_files)[0]


def _twistd_observer_and_out(server_options, log_format: str, max_bytes: int,
                             max_files: int) -> tuple[Any, Any]:
    """:func:`twistd_observer`, and the text stream it writes (None: syslog, JSON)."""
    name = server_options.get("logfile")
    nodaemon = server_options.get("nodaemon")
    if server_options.get("syslog") or (name == "-" and not nodaemon):
        return twistd_default_observer(server_options), None  # syslog, or twistd's refusal
    if name == "-" or (nodaemon and not name):
        out = sys.stdout
    else:
        out = logfile.LogFile.fromFullPath(name or "twistd.log", rotateLength=max_bytes,
                                           maxRotatedFiles=max_files)
        _rotate_on_sigusr1(out)
    if log_format != "json":
        return textFileLogObserver(out), out
    lines = jsonFileLogObserver(out, recordSeparator="")  # JSON Lines, not RFC 7464 records

    def json_line(event: dict) -> None:
        lines(dict(event, text=formatEvent(event)))  # the line a person would read, too

    return json_line, None


def _rotate_on_sigusr1(out) -> None:
    import signal

    if hasattr(signal, "SIGUSR1") and not signal.getsignal(signal.SIGUSR1):
        def rotate(signum, frame):
            from twisted.internet import reactor

            reactor.callFromThread(out.rotate)

        signal.signal(signal.SIGUSR1, rotate)


class LevelledMultiService(MultiService):
    """A plugin's root service; under twistd, it makes the log honour ``log_level``.

    :param server_options: twistd's ``ServerOptions`` (the plugin options' ``parent``), or
        None outside twistd (tests), where nothing is changed.
    """

    def __init__(self, log_level: str = DEFAULT_LEVEL, server_options=None, *,
                 log_format: str = "text", max_bytes: int = DEFAULT_MAX_BYTES,
                 max_files: int = DEFAULT_MAX_FILES):
        super().__init__()
        self.log_level = log_level
        self.log_format = log_format
        self.max_bytes = max_bytes
        self.max_files = max_files
        self._server_options = server_options
        #: The plugin's own text log file, for lines written without a log event
        #: (:class:`TextLines`: the access log), when twistd logs there in text at a level that
        #: shows ``info``; else None (JSON, syslog, a ``--logger``, outside twistd).
        self.text_lines: TextLines | None = None

    @classmethod
    def from_options(cls, options) -> "LevelledMultiService":
        """The root service for a plugin's parsed options (``config.log_settings``)."""
        return cls(options.get("log-level") or DEFAULT_LEVEL, getattr(options, "parent", None),
                   log_format=options.get("log-format") or "text",
                   max_bytes=options.get("log-max-bytes") or DEFAULT_MAX_BYTES,
                   max_files=options.get("log-max-files") or DEFAULT_MAX_FILES)

    def setServiceParent(self, parent) -> None:
        options = self._server_options
        if (options is not None and isinstance(parent, Componentized)
                and options.get("logger") is None
                and parent.getComponent(ILogObserver, None) is None):
            observer, out = _twistd_observer_and_out(options, self.log_format, self.max_bytes,
                                                     self.max_files)
            parent.setComponent(ILogObserver, level_filter(observer, self.log_level))
            if out is not None and LEVELS[self.log_level] <= LogLevel.info:
                self.text_lines = TextLines(out)
        super().setServiceParent(parent)


def text_lines_of(service) -> "TextLines | None":
    """The :attr:`LevelledMultiService.text_lines` of the root above ``service``, or None."""
    while service is not None:
        lines = getattr(service, "text_lines", None)
        if isinstance(lines, TextLines):
            return lines
        service = getattr(service, "parent", None)
    return None


class TextLines:
    """Info lines written straight to the text log file, framed as the plugin's text observer
    frames an event (``<time> [<namespace>#info] <text>``), without a log event: for a line
    per request (the access log), where a ``twisted.logger`` event, its generic formatting and
    a flush per line cost more than the line.  The caller batches (:meth:`frame` each line,
    :meth:`write` them together); the time prefix is made once per second.

    Only for text the caller made safe for one line; it never filters by level (the caller
    asks for it only when ``info`` is shown: :attr:`LevelledMultiService.text_lines`).
    """

    def __init__(self, out, namespace: str = "twisted.python.log"):
        self._out = out
        self._tag = f" [{namespace}#info] "
        self._second: int | None = None
        self._prefix = ""

    def frame(self, text: str, now: float) -> str:
        """``text`` as the observer would write it at ``now`` (seconds since the epoch)."""
        second = int(now)
        if second != self._second:
            self._second, self._prefix = second, formatTime(second) + self._tag
        return self._prefix + text + "\n"

    def write(self, framed: str) -> None:
        """Write (and flush) framed lines."""
        self._out.write(framed)
        self._out.flush()


class RateLimitedLog:
    """Bounds the log lines one source can cause with a repeated event.

    ``allow(key)`` counts one event of ``key`` (a source: an address, a node) and says whether
    to log it one by one: yes for the first ``burst`` events of a window of ``window`` seconds
    (which opens at the key's first event), no for the rest.  When a window in which events
    were held back closes, one ``summary`` line is logged, with fields ``source`` (the key),
    ``count`` (events in the window, all of them), ``suppressed`` (not logged one by one) and
    ``seconds`` (the window).  At most ``max_keys`` keys are tracked (least recently seen
    dropped first, its summary logged then), so memory is bounded too.
    """

    def __init__(self, summary: str, *, clock=None, window: float = 10.0, burst: int = 5,
                 max_keys: int = 1024, logger: Logger | None = None,
                 level: LogLevel = LogLevel.info):
        if clock is None:
            from twisted.internet import reactor as clock
        self._clock = clock
        self._summary = summary
        self.window = window
        self.burst = burst
        self.max_keys = max_keys
        self._log = logger or Logger()
        self._level = level
        self._windows: OrderedDict[Hashable, list] = OrderedDict()  # key -> [start, count, call]

    def allow(self, key: Hashable) -> bool:
        """Count one event of ``key``; True if the caller should log it one by one."""
        now = self._clock.seconds()
        entry = self._windows.get(key)
        if entry is None or now >= entry[0] + self.window:
            if entry is not None:
                self._close(key)
            entry = self._windows[key] = [now, 0, None]
            while len(self._windows) > self.max_keys:
                self._close(next(iter(self._windows)))
        self._windows.move_to_end(key)
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        if entry[2] is None:
            entry[2] = self._clock.callLater(max(0.0, entry[0] + self.window - now),
                                             self._close, key)
        return False

    def flush(self) -> None:
        """Log every pending summary now (when the listener stops)."""
        for key in list(self._windows):
            self._close(key)

    def _close(self, key: Hashable) -> None:
        start, count, call = self._windows.pop(key)
        if call is None:
            return
        if call.active():
            call.cancel()
        self._log.emit(self._level, self._summary, source=key, count=count,
                       suppressed=count - self.burst, seconds=self.window)
