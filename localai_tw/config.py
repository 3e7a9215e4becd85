"""Command-line options that also read the environment, and the validators they share.

Every option of ``localai-frontend`` and ``localai-worker`` is declared once as a ``Setting``:
its long name, the ``LOCALAI_*`` environment variable that supplies it when the flag is not
given, its default, and a parser.  ``EnvOptions`` (a ``twisted.python.usage.Options``) turns
those declarations into ``--flags`` whose ``--help`` line ends with
``[env: LOCALAI_X, default: ...]``, and resolves each value in one place, in this order:
command-line flag, then environment variable, then default.  An environment variable set to
the empty string counts as unset.

Every value, whichever source it came from, goes through the same parser, and a bad value is a
``usage.UsageError`` that names the option (and the environment variable when the value came
from there), so twistd refuses to start with a message the operator can act on.

This module must never log or echo a secret: parsers for secret options do not quote the value,
and ``EnvOptions.describe()`` masks them.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from twisted.application.service import Service
from twisted.logger import Logger
from twisted.python import usage

log = Logger()

Parser = Callable[[str, str], Any]
"""``parser(raw, option_label) -> value``; raises ``usage.UsageError`` naming the option."""

VALUE, FLAG, LIST = "value", "flag", "list"


@dataclass(frozen=True)
class Setting:
    """One option: a ``--name`` flag, its ``env`` variable, default and parser.

    ``default`` is the raw (string) form, parsed like any other value; ``default_doc`` replaces
    it in ``--help`` when the real default is computed elsewhere (say, "embedded PostgreSQL").
    ``secret`` values are never echoed in errors, help or ``describe()``.
    """

    name: str
    env: str
    doc: str
    kind: str = VALUE
    default: str | None = None
    parse: Parser | None = None
    secret: bool = False
    default_doc: str | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name

    def help_line(self) -> str:
        if self.default_doc is not None:
            shown = self.default_doc
        elif self.kind == FLAG:
            shown = "off"
        elif self.default is None:
            shown = "none"
        else:
            shown = self.default
        return f"{self.doc} [env: {self.env}, default: {shown}]"


def value(name: str, env: str, doc: str, *, default: str | None = None,
          parse: Parser | None = None, secret: bool = False,
          default_doc: str | None = None) -> Setting:
    """An option that takes one value (``--name=VALUE``)."""
    return Setting(name, env, doc, VALUE, default, parse, secret, default_doc)


def flag(name: str, env: str, doc: str) -> Setting:
    """An on/off option; its environment variable takes true/false, yes/no, on/off or 1/0."""
    return Setting(name, env, doc, FLAG, None, parse_bool)


def repeatable(name: str, env: str, doc: str, *, parse: Parser | None = None,
               secret: bool = False) -> Setting:
    """An option given any number of times; its environment variable is comma-separated.

    The value is a list.  Flags, when given, replace the environment variable entirely.
    """
    return Setting(name, env, doc + " Repeatable.", LIST, None, parse, secret)


def _value_handler(setting: Setting):
    def handler(self, raw):
        self._given[setting.name] = raw
    handler.__doc__ = setting.help_line()
    return handler


def _flag_handler(setting: Setting):
    def handler(self):
        self._given[setting.name] = True
    handler.__doc__ = setting.help_line()
    return handler


def _list_handler(setting: Setting):
    def handler(self, raw):
        self._given.setdefault(setting.name, []).append(raw)
    handler.__doc__ = setting.help_line()
    return handler


class EnvOptions(usage.Options):
    """``usage.Options`` built from ``settings``, a sequence of ``Setting``.

    After ``parseOptions``, ``self[name]`` holds each parsed value, ``self.sources[name]`` says
    where it came from (``"flag"``, ``"env"`` or ``"default"``; absent when unset).  Subclasses
    add cross-option checks by overriding ``validate()``.

    :param environ: the environment to read; ``os.environ`` when omitted (tests pass a dict).
    """

    settings: ClassVar[Sequence[Setting]] = ()
    #: The plugin's name, in error lines and ``--version``.
    program: ClassVar[str] = "localai-tw"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for setting in cls.settings:
            make = {VALUE: _value_handler, FLAG: _flag_handler, LIST: _list_handler}[setting.kind]
            setattr(cls, "opt_" + setting.name.replace("-", "_"), make(setting))

    def __init__(self, environ: Mapping[str, str] | None = None):
        self._environ = os.environ if environ is None else environ
        self._given: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.raw: dict[str, Any] = {}
        super().__init__()

    def opt_version(self) -> None:
        """Print localai-tw's version and exit."""
        print(f"{self.program} (localai-tw) {installed_version()}")
        raise SystemExit(0)

    def parseOptions(self, options=None) -> None:
        """As ``usage.Options.parseOptions``; under twistd (``self.parent`` set) a usage error
        is one line on stderr and exit status 1, instead of twistd's full help with the
        reason at its end."""
        try:
            super().parseOptions(options)
        except usage.UsageError as e:
            if self.parent is None:
                raise
            sys.stderr.write(f"{self.program}: {e} (see twistd -n {self.program} --help)\n")
            sys.stderr.flush()
            raise SystemExit(1) from None

    def postOptions(self) -> None:
        for setting in self.settings:
            self[setting.name] = self._resolve(setting)
        self.validate()
        if self.parent is not None:
            self._adopt_pidfile()

    def _adopt_pidfile(self) -> None:
        """Under twistd, move its default pidfile (``twistd.pid`` in the working directory,
        which makes a second process started from the same directory fail) into this
        process's data directory: ``<data-dir>/<program>.pid``.

        twistd reads ``--pidfile`` before the plugin's options and checks it only after they
        are parsed, so the plugin may still replace its default.  A ``--pidfile`` given
        explicitly (``--pidfile=`` for none) is left alone.  A live process already holding
        that pidfile is refused here with a message naming ``--data-dir``, the real fix.

        Whatever the pidfile, the data directory's lock (:func:`hold_data_dir_lock`) is taken
        first: a pidfile can be moved or turned off, the lock cannot.
        """
        parent = self.parent
        if not self.get("data-dir"):
            return
        data_dir = self["data-dir"]
        try:
            os.makedirs(data_dir, exist_ok=True)
        except OSError as e:
            raise _fail("--data-dir", f"cannot create {data_dir}: {e.strerror}") from None
        # Whatever the pidfile (twistd's own --pidfile, or none), the data directory is this
        # process's alone: two workers on one directory would rotate each other's credential.
        hold_data_dir_lock(data_dir, self.program)
        if parent.get("pidfile") != TWISTD_DEFAULT_PIDFILE:
            return
        pidfile = os.path.join(data_dir, f"{self.program}.pid")
        pid = _live_pid(pidfile)
        if pid is not None:
            raise usage.UsageError(
                f"--data-dir: another {self.program} (pid {pid}) is running with data "
                f"directory {data_dir}; give this one its own --data-dir (a second frontend "
                "shares the first one's embedded PostgreSQL with the --database-url the first "
                "one logged)")
        parent["pidfile"] = pidfile

    def validate(self) -> None:
        """Checks that involve more than one option; raise ``usage.UsageError``."""

    def _resolve(self, setting: Setting) -> Any:
        env_raw = self._environ.get(setting.env, "")
        if setting.name in self._given:
            source, raw = "flag", self._given[setting.name]
            label = setting.flag
        elif env_raw != "":
            source, raw = "env", env_raw
            label = f"{setting.flag} (from {setting.env})"
        elif setting.default is not None:
            source, raw = "default", setting.default
            label = f"{setting.flag} (default)"
        else:
            if setting.kind == FLAG:
                return False
            return [] if setting.kind == LIST else None
        self.sources[setting.name] = source
        self.raw[setting.name] = raw

        if setting.kind == FLAG:
            return True if source == "flag" else parse_bool(raw, label)
        if setting.kind == LIST:
            items = raw if source == "flag" else [p.strip() for p in raw.split(",") if p.strip()]
            if setting.parse is None:
                return list(items)
            return [setting.parse(item, label) for item in items]
        return raw if setting.parse is None else setting.parse(raw, label)

    def describe(self) -> list[tuple[str, str, str]]:
        """``(option, shown value, source)`` for every option that has a value, for logs.

        Secret values are shown as ``<set>`` (or a count for lists); nothing secret leaves here.
        """
        out = []
        for setting in self.settings:
            val = self.get(setting.name)
            if val is None or val == [] or val is False:
                continue
            if setting.secret:
                shown = f"<{len(val)} set>" if isinstance(val, list) else "<set>"
            elif isinstance(self.raw.get(setting.name), str):
                shown = self.raw[setting.name].strip()
            elif isinstance(self.raw.get(setting.name), list):
                shown = ", ".join(self.raw[setting.name])
            else:
                shown = str(val)
            out.append((setting.flag, shown, self.sources.get(setting.name, "default")))
        return out


def installed_version() -> str:
    """localai-tw's version as installed (setup.py's), else the package's own ``__version__``
    (a checkout run without installing)."""
    from importlib import metadata

    try:
        return metadata.version("localai-tw")
    except metadata.PackageNotFoundError:
        from localai_tw import __version__

        return __version__


TWISTD_DEFAULT_PIDFILE = "twistd.pid"


#: Data-directory locks this process holds: real path of the lock file -> its descriptor.
_HELD_LOCKS: dict[str, int] = {}


def hold_data_dir_lock(data_dir: str, program: str) -> None:
    """Take ``<data_dir>/<program>.lock`` (``flock``, exclusive) for the rest of this process,
    or refuse with a usage error naming ``--data-dir`` and the holder's pid.

    The kernel releases the lock when the process ends, however it ends (SIGKILL included):
    a stale file never blocks a restart.  The descriptor is inherited by twistd's daemon
    child, which keeps the lock after the parent exits.  Taking it twice in one process is a
    no-op (option parsing may run more than once).
    """
    import fcntl

    path = os.path.realpath(os.path.join(data_dir, f"{program}.lock"))
    if path in _HELD_LOCKS:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise _fail("--data-dir", f"cannot open {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        try:
            holder = os.read(fd, 32).decode("ascii", "replace").strip()
        except OSError:
            holder = ""
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
            raise _fail("--data-dir", f"cannot lock {path}: {e.strerror}") from None
        pid = f" (pid {holder})" if holder.isdigit() else ""
        raise usage.UsageError(
            f"--data-dir: another {program}{pid} is running with data directory {data_dir} "
            f"(it holds {path}); give this one its own --data-dir") from None
    _HELD_LOCKS[path] = fd
    note_lock_holder()


def note_lock_holder() -> None:
    """Write this process's pid into every data-directory lock it holds (again after twistd
    forked into a daemon, whose pid differs from the one that took the lock)."""
    pid = f"{os.getpid()}\n".encode()
    for fd in _HELD_LOCKS.values():
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, pid, 0)
        except OSError:
            pass  # only the message's pid is at stake


def _live_pid(pidfile: str) -> int | None:
    """The pid recorded in ``pidfile`` if that process is alive, else None."""
    try:
        with open(pidfile) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except OSError as e:
        return pid if e.errno == errno.EPERM else None
    return pid


class ConfigurationReport(Service):
    """Logs a process's configuration once, at start: every option, its value and its source.

    Secrets are masked by ``EnvOptions.describe()``; ``ignored`` names options that are
    accepted only for compatibility and logged as ignored.
    """

    name = "configuration-report"

    def __init__(self, program: str, options: EnvOptions, ignored: Iterable[str] = ()):
        self.program = program
        self.options = options
        self.ignored = tuple(ignored)

    def startService(self) -> None:
        super().startService()
        note_lock_holder()  # after twistd's daemon fork, the pid a refusal names is ours
        for option, shown, source in self.options.describe():
            log.info("{program} {option} = {value} ({source})", program=self.program,
                     option=option, value=shown, source=source)
        for name in self.ignored:
            if self.options.get(name) not in (None, [], False):
                log.warn("{program}: --{name} is accepted for compatibility and ignored "
                         "(this build has no message broker)", program=self.program, name=name)


# -- validators ---------------------------------------------------------------------------
#
# Each takes the raw string and the option's label (``--reconnect-grace`` or
# ``--reconnect-grace (from LOCALAI_RECONNECT_GRACE)``) and raises usage.UsageError naming it.


def _fail(option: str, message: str) -> usage.UsageError:
    return usage.UsageError(f"{option}: {message}")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(raw: str, option: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise _fail(option, f"expected true/false, yes/no, on/off or 1/0, not {raw!r}")


def parse_port(raw: str, option: str) -> int:
    try:
        port = int(raw.strip())
    except ValueError:
        raise _fail(option, f"{raw!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise _fail(option, f"port {port} is outside 1-65535")
    return port


@dataclass(frozen=True)
class PortRange:
    """An inclusive range of TCP ports."""

    first: int
    last: int

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    def overlaps(self, first: int, last: int) -> bool:
        return self.first <= last and first <= self.last


def parse_port_range(raw: str, option: str) -> PortRange:
    """``FIRST-LAST``, both ports, FIRST <= LAST."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", raw)
    if m is None:
        raise _fail(option, f"expected a port range like 30000-30999, not {raw!r}")
    first = parse_port(m.group(1), option)
    last = parse_port(m.group(2), option)
    if first > last:
        raise _fail(option, f"range {first}-{last} is empty (first port above last)")
    return PortRange(first, last)


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_duration(raw: str, option: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"1.5m"``, ``"1m30s"``, ``"500ms"`` or ``"2h"``."""
    text = raw.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise _fail(option, f"expected a duration like 90s, 1m, 1m30s, 500ms or plain seconds, "
                            f"not {raw!r}")
    return total


def format_duration(seconds: float) -> str:
    """The inverse of ``parse_duration`` for whole seconds: ``90.0`` -> ``"90s"``."""
    return f"{seconds:g}s"


def parse_host_port(raw: str, option: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; the host is a name or an IP address."""
    text = raw.strip()
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)", text) or re.fullmatch(r"([^:\[\]\s]+):(\d+)",
                                                                          text)
    if m is None:
        raise _fail(option, f"expected host:port (or [ipv6]:port), not {raw!r}")
    host = m.group(1)
    if text.startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _fail(option, f"{host!r} is not an IPv6 address") from None
    return host, parse_port(m.group(2), option)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8, ``::1`` and the unspecified addresses."""
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(
            ".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def url_parser(schemes: Sequence[str] = ("http", "https", "ws", "wss")) -> Parser:
    """A parser accepting absolute URLs with one of ``schemes`` and a host."""
    def parse_url(raw: str, option: str) -> str:
        text = raw.strip()
        try:
            parts = urlsplit(text)
            parts.port  # noqa: B018 -- raises ValueError for a bad port
        except ValueError as e:
            raise _fail(option, f"{text!r} is not a valid URL ({e})") from None
        if parts.scheme.lower() not in schemes:
            raise _fail(option, f"{text!r} must start with one of "
                                + ", ".join(f"{s}://" for s in schemes))
        if not parts.hostname:
            raise _fail(option, f"{text!r} has no host")
        return text
    return parse_url


parse_url = url_parser()
"""``http``, ``https``, ``ws`` or ``wss`` URL with a host."""

_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]*")


def parse_label(raw: str, option: str) -> tuple[str, str]:
    """``key=value``; the key is letters, digits and ``_ . - /``, the value may be empty."""
    key, sep, val = raw.partition("=")
    key, val = key.strip(), val.strip()
    if not sep or not key:
        raise _fail(option, f"expected key=value, not {raw!r}")
    if not _LABEL_KEY.fullmatch(key):
        raise _fail(option, f"label key {key!r} may hold only letters, digits and _ . - /")
    return key, val


def choice_parser(*choices: str) -> Parser:
    def parse_choice(raw: str, option: str) -> str:
        word = raw.strip().lower()
        if word not in choices:
            raise _fail(option, f"expected one of {', '.join(choices)}, not {raw!r}")
        return word
    return parse_choice


def log_level_setting() -> Setting:
    """``--log-level``, shared by both plugins (``localai_tw.logs`` applies it)."""
    return value("log-level", "LOCALAI_LOG_LEVEL",
                 "Least severe log events shown: debug, info, warn or error.",
                 default="info", parse=choice_parser("debug", "info", "warn", "error"))


def log_settings() -> tuple[Setting, ...]:
    """The log options shared by both plugins (``localai_tw.logs`` applies them)."""
    return (
        log_level_setting(),
        value("log-format", "LOCALAI_LOG_FORMAT",
              "Log lines as text, or as json (one JSON object per line, for machine readers).",
              default="text", parse=choice_parser("text", "json")),
        value("log-max-bytes", "LOCALAI_LOG_MAX_BYTES",
              "When twistd logs to a file (not with -n): rotate it at this size (bytes, or "
              "with a K, M or G suffix).",
              default="10M", parse=parse_byte_size),
        value("log-max-files", "LOCALAI_LOG_MAX_FILES",
              "When twistd logs to a file: rotated files kept beside it (older ones are "
              "deleted).",
              default="5", parse=parse_count),
    )


_SIZE_SUFFIXES = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_byte_size(raw: str, option: str) -> int:
    """A positive size in bytes: ``1048576``, ``1024K``, ``10M``, ``1G``."""
    text = raw.strip().upper().removesuffix("B").removesuffix("I")
    number, suffix = (text[:-1], text[-1]) if text and text[-1] in "KMG" else (text, "")
    try:
        size = int(number) * _SIZE_SUFFIXES[suffix]
    except ValueError:
        raise _fail(option, f"{raw!r} is not a size (bytes, or with K, M or G)") from None
    if size < 1:
        raise _fail(option, f"{raw!r} is not a positive size")
    return size


def parse_count(raw: str, option: str) -> int:
    """A whole number of at least 1."""
    try:
        count = int(raw.strip())
    except ValueError:
        raise _fail(option, f"{raw!r} is not a whole number") from None
    if count < 1:
        raise _fail(option, f"{count} is less than 1")
    return count


def parse_whole_number(raw: str, option: str) -> int:
    """A whole number of at least 0."""
    try:
        count = int(raw.strip())
    except ValueError:
        raise _fail(option, f"{raw!r} is not a whole number") from None
    if count < 0:
        raise _fail(option, f"{count} is less than 0")
    return count


def parse_secret(raw: str, option: str) -> str:
    """A non-blank secret.  The value never appears in the error."""
    if not raw.strip():
        raise _fail(option, "must not be blank")
    return raw.strip()


def parse_identifier(raw: str, option: str, max_length: int = 36) -> str:
    """Letters, digits and ``. _ -``, at most ``max_length`` characters (instance ids)."""
    text = raw.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._\-]*", text):
        raise _fail(option, f"{raw!r} may hold only letters, digits and . _ -")
    if len(text) > max_length:
        raise _fail(option, f"{raw!r} is longer than {max_length} characters")
    return text


def parse_server_endpoint(raw: str, option: str) -> str:
    """A Twisted server endpoint description (``tcp:8080``, ``tcp:8080:interface=127.0.0.1``,
    ``ssl:8443:privateKey=...``, ``unix:/path``), checked by building (not listening on) it."""
    from twisted.internet import endpoints, reactor

    text = raw.strip()
    try:
        endpoints.serverFromString(reactor, text)
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise _fail(option, f"{text!r} is not a server endpoint description ({e})") from None
    except Exception as e:  # e.g. ssl: with an unreadable key: still the operator's input
        raise _fail(option, f"{text!r} cannot be used: {e}") from None
    return text


#: The listen backlog a server endpoint gets when its description names none.  Twisted's default
#: (50) overflowed when 1000 workers registered at once (269 timed out and retried; the batch
#: took 13-14 s instead of 1.8 s).  The kernel caps it at net.core.somaxconn.
FLEET_BACKLOG = 1024


def with_fleet_backlog(description: str) -> str:
    """``description`` with ``backlog=FLEET_BACKLOG`` added when it is a tcp, ssl or unix
    endpoint that does not name a backlog itself; anything else is returned unchanged."""
    from twisted.internet.endpoints import _parse

    text = description.strip()
    try:
        args, kwargs = _parse(text)
    except Exception:
        return text
    kind = args[0].lower() if args else ""
    if kind not in ("tcp", "tcp6", "ssl", "unix") or "backlog" in kwargs:
        return text
    return f"{text}:backlog={FLEET_BACKLOG}"


def listener_reach(description: str) -> str | None:
    """Who else can connect to a server endpoint description: None when only this machine can
    (``interface=`` a loopback address, a ``unix:`` socket), else what it listens on
    (``"every interface"`` when no interface is named).  Other endpoint kinds (plugins) count
    as reachable: nothing here can tell."""
    from twisted.internet.endpoints import _parse

    try:
        args, kwargs = _parse(description.strip())
    except Exception:
        return description
    kind = args[0].lower() if args else ""
    if kind in ("unix",):
        return None
    if kind not in ("tcp", "tcp6", "ssl") and not kind.isdigit():
        return f"{description.strip()} (an endpoint this check cannot see into)"
    interface = kwargs.get("interface", "")
    if not interface:
        return "every interface"
    host = interface.split("%", 1)[0]
    if host.lower() == "localhost":
        return None
    try:
        return None if ipaddress.ip_address(host).is_loopback else interface
    except ValueError:
        return interface


def parse_secret_file(raw: str, option: str) -> str:
    """The secret held in the file named ``raw``: its content without the trailing newline.
    A missing, unreadable or empty file is a usage error naming the path, never the content."""
    path = parse_path(raw, option)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(65536 + 1)
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e.__class__.__name__)
        raise _fail(option, f"cannot read {path}: {reason}") from None
    if len(text) > 65536:
        raise _fail(option, f"{path} is larger than 64 KiB; it should hold only the secret")
    secret = text.rstrip("\r\n")
    if not secret.strip():
        raise _fail(option, f"{path} is empty")
    return secret


def adopt_secret_file(options: "EnvOptions", name: str, *, lines: bool = False) -> None:
    """Fill ``options[name]`` from ``options[name + "-file"]`` when that was given; both at
    once is a usage error.  ``lines``: the file holds one secret per non-blank line (a list)."""
    content = options.get(name + "-file")
    if content is None:
        return
    given = options.get(name)
    if given not in (None, [], ""):
        raise usage.UsageError(f"--{name} and --{name}-file are both set; give one of them")
    if lines:
        options[name] = [line.strip() for line in content.splitlines() if line.strip()]
    else:
        options[name] = content
    options.sources[name] = "file"
    # Keep the secret in one place only: the -file option goes back to naming the file.
    options[name + "-file"] = parse_path(options.raw[name + "-file"], f"--{name}-file")


def parse_database_url(raw: str, option: str) -> str:
    """A libpq DSN: ``postgresql://...``/``postgres://...`` URL or ``key=value`` text.

    The error never quotes the value: it may carry a password.
    """
    import psycopg2.extensions

    text = raw.strip()
    if "://" in text and urlsplit(text).scheme not in ("postgres", "postgresql"):
        raise _fail(option, "must be a postgres:// or postgresql:// URL or a key=value DSN")
    try:
        psycopg2.extensions.parse_dsn(text)
    except psycopg2.ProgrammingError as e:
        raise _fail(option, f"is not a PostgreSQL connection string "
                            f"({str(e).strip().splitlines()[0]})") from None
    return text


def default_data_dir(role: str = "") -> str:
    """The per-user data directory for localai-tw: ``~/.local/share/localai-tw`` on Linux for
    a frontend, ``~/.local/share/localai-tw-worker`` for ``role="worker"``, so a worker and a
    frontend on one machine never share state (or a pidfile) by default."""
    import platformdirs

    return platformdirs.user_data_dir("localai-tw" + (f"-{role}" if role else ""))


def parse_path(raw: str, option: str) -> str:
    """A filesystem path, with ``~`` expanded; whether it exists is checked by its user."""
    text = raw.strip()
    if not text:
        raise _fail(option, "must not be blank")
    return os.path.abspath(os.path.expanduser(text))


def parse_directory(raw: str, option: str) -> str:
    """An existing directory, made absolute (``~`` expanded)."""
    if not raw.strip():
        raise _fail(option, "must not be blank")
    path = os.path.abspath(os.path.expanduser(raw.strip()))
    if not os.path.isdir(path):
        raise _fail(option, f"{path} is not a directory")
    return path
