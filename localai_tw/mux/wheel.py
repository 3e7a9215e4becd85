"""One timer for the keepalives of every yamux session of a reactor.

A session pings every ``keepalive_interval`` and gives each ping ``keepalive_timeout`` to be
answered.  With a ``LoopingCall`` and a ``callLater`` per session, a replica holding thousands of
worker tunnels (a ping every 3 s, 7 s to answer) woke up once per session and timer, thousands of
times a second, each wake-up a poll and a pass over the timers for one ping (docs/benchmarks.md,
"A fleet on one replica").  A :class:`TickWheel` keeps the calls due on each tick (at most
:data:`MAX_TICK`, and one that divides interval and timeout: 0.1 s for 3 + 7 and for 30 + 10) in
a list, and one ``callLater`` at a time for the earliest: a reactor with thousands of sessions
wakes up at most once per tick for all of them, one with a single session only when that session
has something due.  Sessions join on the tick of their opening, so a fleet's pings stay spread
over interval / tick phases rather than leaving in a few bursts.

Timing (what ``tunnel/keepalive.py`` documents is kept): calls made on a tick for whole ticks
later run that long after it, so a session's pings leave ``interval`` apart and each is declared
unanswered ``timeout`` after the tick it left on; silence is still seen within interval +
timeout.  A call made between ticks counts from the tick it falls in (a session's first ping may
leave up to one tick early, never late).  Calls the reactor runs late count from the tick of the
moment they run, and a delay asked with ``at_least=True`` (a ping's timeout) gets one tick more
when even that is more than half a tick behind, so a ping is never given less than its timeout
minus half a tick.  A call that raises is logged; the others of its tick still run.

Nothing is kept when nothing waits, so a reactor without sessions (and a test's ``Clock``) has
no timer of ours.
"""

from __future__ import annotations

import heapq
import math
from fractions import Fraction
from typing import Callable

from twisted.logger import Logger

log = Logger()

#: The longest tick: sessions join on the tick of their opening, so ticks this short spread a
#: fleet's pings over interval / tick phases (30 for the tunnel's 3 s) instead of bursts.
MAX_TICK = 0.1


#: A tick is never shorter than this share of the shorter of interval and timeout (a config
#: such as 3.001 + 7 would otherwise tick every millisecond); the delays are then rounded as
#: :meth:`TickWheel.ticks` says.
_MIN_TICK_SHARE = 10


def common_tick(*seconds: float) -> float:
    """The longest tick of at most :data:`MAX_TICK` that divides every delay in ``seconds``
    (to the millisecond); for delays whose common divisor is below a tenth of the shortest, that
    tenth divided down to at most :data:`MAX_TICK` (the delays are then rounded)."""
    fractions = [Fraction(s).limit_denominator(1000) for s in seconds]
    numerator = 0
    denominator = 1
    for f in fractions:
        denominator = denominator * f.denominator // math.gcd(denominator, f.denominator)
    for f in fractions:
        numerator = math.gcd(numerator, f.numerator * (denominator // f.denominator))
    tick = max(numerator / denominator, min(seconds) / _MIN_TICK_SHARE)
    if tick > MAX_TICK:
        tick /= math.ceil(tick / MAX_TICK - 1e-9)
    return tick


class TickWheel:
    """Calls due on ticks of ``tick`` seconds of ``clock``.  One ``callLater`` at a time, set
    for the earliest tick with calls waiting: a reactor with one session wakes up for that
    session's pings and expiries only, one with thousands at most once per tick."""

    def __init__(self, clock, tick: float):
        if tick <= 0:
            raise ValueError("tick must be positive")
        self._clock = clock
        self.tick = tick
        self._epoch = clock.seconds()   # the clock time of tick 0
        self._slots: dict[int, list[tuple[Callable, tuple]]] = {}
        self._due: list[int] = []       # a heap of the ticks in _slots
        self._call = None               # the callLater for _due[0]
        self._running: int | None = None  # the tick being run

    def ticks(self, seconds: float, *, up: bool) -> int:
        """``seconds`` in whole ticks: rounded up (a timeout, never shorter) or down (an
        interval, never longer), at least one."""
        exact = seconds / self.tick
        return max(1, math.ceil(exact - 1e-9) if up else math.floor(exact + 1e-9))

    def _now(self) -> int:
        return math.floor((self._clock.seconds() - self._epoch) / self.tick + 1e-9)

    def later(self, ticks: int, fn: Callable, *args, at_least: bool = False) -> None:
        """Run ``fn(*args)`` ``ticks`` ticks after the current one (see the module docstring
        for ``at_least``).  There is no cancel: ``fn`` checks whether it is still wanted."""
        base = self._running if self._running is not None else self._now()
        slot = base + ticks
        if at_least:
            late = self._clock.seconds() - (self._epoch + base * self.tick)
            if late > self.tick / 2:
                slot += 1
        calls = self._slots.get(slot)
        if calls is None:
            calls = self._slots[slot] = []
            heapq.heappush(self._due, slot)
            if self._running is None and self._due[0] == slot:
                self._schedule()
        calls.append((fn, args))

    @property
    def waiting(self) -> int:
        """Calls not yet run."""
        return sum(len(calls) for calls in self._slots.values())

    def _schedule(self) -> None:
        delay = max(0.0, self._epoch + self._due[0] * self.tick - self._clock.seconds())
        if self._call is not None and self._call.active():
            self._call.reset(delay)
        else:
            self._call = self._clock.callLater(delay, self._run)

    def _run(self) -> None:
        self._call = None
        now = self._now()
        try:
            while self._due and self._due[0] <= now:
                slot = heapq.heappop(self._due)
                self._running = now  # calls made now count from the current tick
                for fn, args in self._slots.pop(slot):
                    try:
                        fn(*args)
                    except Exception:
                        log.failure("a keepalive wheel call failed: {fn!r}", fn=fn)
        finally:
            self._running = None
        if self._due:
            self._schedule()


def wheel_for(clock, tick: float) -> TickWheel:
    """The wheel of ``clock`` ticking every ``tick`` seconds, shared by every session there.
    Kept in the clock's own ``__dict__`` (not in a registry of ours), so it lives exactly as
    long as the clock: a test's ``Clock`` and its sessions are not pinned by a wheel."""
    try:
        by_tick = vars(clock).setdefault("_localai_tick_wheels", {})
    except TypeError:  # a clock without a __dict__: a wheel of its own
        return TickWheel(clock, tick)
    wheel = by_tick.get(tick)
    if wheel is None:
        wheel = by_tick[tick] = TickWheel(clock, tick)
    return wheel
