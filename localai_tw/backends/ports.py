"""Loopback ports for backend gRPC servers: which port the next backend process binds.

:class:`PortAllocator` hands out ports from an inclusive range on one host address.  Before a
port is handed out the exact address is proved bindable (a socket is bound and closed, with
``SO_REUSEADDR`` off); a port that cannot be bound is quarantined for a while (60 s) so a port
held by some other program is not probed again on every start; a released port is quarantined
briefly (15 s, as LocalAI's worker does) so a new backend never lands on the port a dying one
may still hold, and a client with a stale address cannot reach the wrong model.  A key (the
process key, ``model#replica``) gets its previous port back when that port is free again.

Why the probe is not optional: gRPC servers (C-core) bind with ``SO_REUSEPORT`` by default, so
a second backend can bind the port of a live one and the kernel then splits connections
between the two.  A probe socket without ``SO_REUSEADDR``/``SO_REUSEPORT`` fails on any live
listener, whatever options that listener used.

The default range sits outside the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``): an outgoing connection anywhere on the machine
can take an ephemeral port at any moment, racing a backend for it.

What this module must never do:

- hand out a port it did not just prove bindable, or one it already handed out and was not
  given back;
- hand a released or unbindable port out again before its quarantine is over;
- block: the probe is one ``bind``/``close`` pair on a local address (microseconds), never a
  connection attempt;
- grow without bound: quarantine and affinity entries expire and are pruned on every call.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from typing import Callable, Hashable

import attr
from twisted.logger import Logger

log = Logger()

#: The kernel's ephemeral (outgoing) port range on Linux.
EPHEMERAL_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: The default backend range: below Linux's default ephemeral range (32768-60999).
DEFAULT_FIRST_PORT = 30000
DEFAULT_LAST_PORT = 30999
#: Seconds a released port waits before it may be handed out again (LocalAI worker: 15 s).
RELEASE_QUARANTINE_SECONDS = 15.0
#: Seconds a port that failed its bind probe is skipped before it is probed again.
UNBINDABLE_QUARANTINE_SECONDS = 60.0
#: Seconds a released port stays affine to its last key (LocalAI worker: 5 min).
AFFINITY_SECONDS = 300.0

#: ``bind_probe(host, port)`` returns None when ``host:port`` can be bound now, else raises
#: ``OSError``.
BindProbe = Callable[[str, int], None]


def probe_bind(host: str, port: int) -> None:
    """Bind ``host:port`` with ``SO_REUSEADDR`` off, then close.  Raises ``OSError`` when the
    address is taken (by a listener, a connection in TIME_WAIT, or any socket at all)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        probe.bind((host, port))
    finally:
        probe.close()


def read_ephemeral_range(path: str = EPHEMERAL_PORT_RANGE_FILE) -> tuple[int, int] | None:
    """The kernel's ephemeral port range, or None when it cannot be read (not Linux)."""
    try:
        with open(path) as f:
            first, last = (int(part) for part in f.read().split())
    except (OSError, ValueError):
        return None
    return first, last


def default_port_range(path: str = EPHEMERAL_PORT_RANGE_FILE,
                       size: int = DEFAULT_LAST_PORT - DEFAULT_FIRST_PORT + 1
                       ) -> tuple[int, int]:
    """30000-30999 unless the kernel's ephemeral range covers it; then the ``size`` ports just
    below the ephemeral range (or just above it when there is no room below 1024)."""
    first, last = DEFAULT_FIRST_PORT, DEFAULT_FIRST_PORT + size - 1
    ephemeral = read_ephemeral_range(path)
    if ephemeral is None or not _overlaps((first, last), ephemeral):
        return first, last
    low, high = ephemeral
    if low - size >= 1024:
        return low - size, low - 1
    if high + size <= 65535:
        return high + 1, high + size
    raise ValueError(f"the ephemeral port range {low}-{high} leaves no room for "
                     f"{size} backend ports")


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


class NoFreePort(Exception):
    """Every candidate in the range was skipped.  The message and the attributes say why:
    ``held`` (handed out by this allocator and not given back), ``in_use`` (the bind probe
    failed now: another program holds it), ``quarantined_released``,
    ``quarantined_unbindable``."""

    def __init__(self, first: int, last: int, host: str, *, held: int, in_use: int,
                 quarantined_released: int, quarantined_unbindable: int,
                 last_bind_error: str | None):
        self.first, self.last, self.host = first, last, host
        self.held = held
        self.in_use = in_use
        self.quarantined_released = quarantined_released
        self.quarantined_unbindable = quarantined_unbindable
        self.skipped = held + in_use + quarantined_released + quarantined_unbindable
        quarantined = quarantined_released + quarantined_unbindable
        detail = (f"{held} held by backends of this worker, {in_use} in use by another "
                  f"program (bind failed"
                  + (f": {last_bind_error}" if last_bind_error else "") + "), "
                  f"{quarantined} quarantined ({quarantined_released} recently released, "
                  f"{quarantined_unbindable} recently unbindable)")
        super().__init__(f"no free gRPC port in {first}-{last} on {host}: skipped "
                         f"{self.skipped} candidates: {detail}")


@attr.s(frozen=True, auto_attribs=True)
class _Quarantine:
    until: float
    reason: str  # "released" or "unbindable"


class _MonotonicClock:
    def seconds(self) -> float:
        return time.monotonic()


class PortAllocator:
    """Ports ``first..last`` (inclusive) on ``host``, handed out one per process key.

    ``clock`` needs only ``seconds()`` (a reactor or ``task.Clock``; default: monotonic time).
    ``bind_probe`` is :func:`probe_bind` unless a test injects another.  Allocation order:
    the key's previous port when it is out of quarantine and bindable, then the next port
    upward from the last one handed out (wrapping), so ports rotate instead of being reused
    at once.
    """

    def __init__(
        self,
        first: int,
        last: int,
        host: str = "127.0.0.1",
        *,
        clock=None,
        bind_probe: BindProbe = probe_bind,
        release_quarantine: float = RELEASE_QUARANTINE_SECONDS,
        unbindable_quarantine: float = UNBINDABLE_QUARANTINE_SECONDS,
        affinity: float = AFFINITY_SECONDS,
        ephemeral_range_file: str = EPHEMERAL_PORT_RANGE_FILE,
    ):
        if not (1 <= first <= last <= 65535):
            raise ValueError(f"not a port range: {first}-{last}")
        self.first, self.last, self.host = first, last, host
        self._clock = clock if clock is not None else _MonotonicClock()
        self._probe = bind_probe
        self.release_quarantine = release_quarantine
        self.unbindable_quarantine = unbindable_quarantine
        self.affinity = affinity
        self._held: dict[int, Hashable] = {}
        self._quarantine: dict[int, _Quarantine] = {}
        self._affine: dict[Hashable, tuple[int, float]] = {}  # key -> (port, released at)
        self._cursor = first
        ephemeral = read_ephemeral_range(ephemeral_range_file)
        self.ephemeral_overlap = (
            ephemeral if ephemeral is not None and _overlaps((first, last), ephemeral)
            else None)
        if self.ephemeral_overlap is not None:
            # The one warning of a worker about it (issue 26: it was logged twice).
            log.warn("--backend-port-range {first}-{last} overlaps the kernel's ephemeral port "
                     "range {e0}-{e1} ({path}): outgoing connections may take a backend's "
                     "port; choose a range outside it", first=first, last=last,
                     e0=ephemeral[0], e1=ephemeral[1], path=ephemeral_range_file)

    @classmethod
    def with_default_range(cls, host: str = "127.0.0.1", **kwargs) -> "PortAllocator":
        first, last = default_port_range(
            kwargs.get("ephemeral_range_file", EPHEMERAL_PORT_RANGE_FILE))
        return cls(first, last, host, **kwargs)

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def holder(self, port: int) -> Hashable | None:
        """The key a port is handed out to, or None."""
        return self._held.get(port)

    def held(self) -> dict[int, Hashable]:
        return dict(self._held)

    def quarantined(self) -> dict[int, tuple[float, str]]:
        """``{port: (seconds left, reason)}`` for ports in quarantine now."""
        now = self._clock.seconds()
        self._prune(now)
        return {port: (q.until - now, q.reason) for port, q in self._quarantine.items()}

    def allocate(self, key: Hashable) -> int:
        """A port proved bindable now, recorded as held by ``key``.  Raises
        :class:`NoFreePort` saying how many candidates were skipped and why."""
        now = self._clock.seconds()
        self._prune(now)
        affine = self._affine.get(key)
        if affine is not None:
            port = affine[0]
            if (port in self and port not in self._held and port not in self._quarantine
                    and self._bindable(port, now) is None):
                return self._hand_out(port, key)
        held = in_use = q_released = q_unbindable = 0
        last_error: str | None = None
        for offset in range(self.size):
            port = self.first + (self._cursor - self.first + offset) % self.size
            if port in self._held:
                held += 1
                continue
            quarantine = self._quarantine.get(port)
            if quarantine is not None:
                if quarantine.reason == "released":
                    q_released += 1
                else:
                    q_unbindable += 1
                continue
            error = self._bindable(port, now)
            if error is not None:
                in_use += 1
                last_error = error
                continue
            self._cursor = self.first + (port - self.first + 1) % self.size
            return self._hand_out(port, key)
        raise NoFreePort(self.first, self.last, self.host, held=held, in_use=in_use,
                         quarantined_released=q_released, quarantined_unbindable=q_unbindable,
                         last_bind_error=last_error)

    def release(self, port: int) -> None:
        """Give ``port`` back; it is quarantined for ``release_quarantine`` seconds.  Releasing
        a port that is not held is a no-op (a stop and a crash may both release)."""
        key = self._held.pop(port, None)
        if key is None:
            return
        now = self._clock.seconds()
        self._quarantine[port] = _Quarantine(now + self.release_quarantine, "released")
        self._affine[key] = (port, now)

    def _hand_out(self, port: int, key: Hashable) -> int:
        self._held[port] = key
        self._affine.pop(key, None)
        return port

    def _bindable(self, port: int, now: float) -> str | None:
        """None when the probe binds; else the error text, and the port is quarantined."""
        try:
            self._probe(self.host, port)
        except OSError as e:
            name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "error"
            text = f"{name} {os.strerror(e.errno)}" if e.errno else str(e)
            self._quarantine[port] = _Quarantine(now + self.unbindable_quarantine,
                                                 "unbindable")
            log.info("backend port {host}:{port} is not bindable ({error}); skipping it for "
                     "{seconds:g}s", host=self.host, port=port, error=text,
                     seconds=self.unbindable_quarantine)
            return text
        return None

    def _prune(self, now: float) -> None:
        for port in [p for p, q in self._quarantine.items() if q.until <= now]:
            del self._quarantine[port]
        for key in [k for k, (_, at) in self._affine.items() if now - at >= self.affinity]:
            del self._affine[key]
