"""One timer for the keepalives of every yamux session of a reactor.

A session pings every ``keepalive_interval`` and gives each ping ``keepalive_timeout`` to be
answered.  With a ``LoopingCall`` and a ``callLater`` per session, a replica holding thousands of
worker tunnels (a ping every 3 s, 7 s to answer) woke up once per session and timer, several
thousand times a second, each wake-up a poll and a pass over the timers for one ping
(docs/benchmarks.md, "A fleet on one replica").  A :class:`TickWheel` runs one ``LoopingCall``
per tick for every session whose interval and timeout share that tick (their greatest common
divisor: 1 s for 3 + 7, 10 s for Go's 30 + 10), and keeps the calls due on each tick in a list.

Timing (what ``tunnel/keepalive.py`` documents is kept): calls made on a tick for whole ticks
later run exactly that long after it, so a session's pings leave ``interval`` apart and each is
declared unanswered ``timeout`` after the tick it left on; silence is still seen within
interval + timeout.  A call made between ticks runs on the tick that ends its delay or on the one
before (a session's first ping may leave up to one tick early, never late).  A delay asked with
``at_least=True`` (a ping's timeout) is never shortened by more than a twentieth of a tick: when
the reactor runs the tick late, the call gets one tick more.  A tick the reactor missed
entirely (a stall) runs its calls at the next one, in order.

The loop runs only while calls are waiting, so a reactor without sessions (and a test's
``Clock``) keeps no timer of ours.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

from twisted.internet import task

#: A tick is never shorter than this share of the shorter of interval and timeout (a config
#: such as 3.001 + 7 would otherwise tick every millisecond); the delays are then rounded as
#: :meth:`TickWheel.ticks` says.
_MIN_TICK_SHARE = 10


def common_tick(*seconds: float) -> float:
    """The longest tick that divides every delay in ``seconds`` (to the millisecond), but no
    shorter than a tenth of the shortest."""
    fractions = [Fraction(s).limit_denominator(1000) for s in seconds]
    numerator = 0
    denominator = 1
    for f in fractions:
        denominator = denominator * f.denominator // math.gcd(denominator, f.denominator)
    for f in fractions:
        numerator = math.gcd(numerator, f.numerator * (denominator // f.denominator))
    tick = numerator / denominator
    return max(tick, min(seconds) / _MIN_TICK_SHARE)


class TickWheel:
    """Calls due on ticks of ``tick`` seconds of ``clock``, run by one ``LoopingCall``."""

    def __init__(self, clock, tick: float):
        if tick <= 0:
            raise ValueError("tick must be positive")
        self._clock = clock
        self.tick = tick
        self._slots: dict[int, list[tuple[Callable, tuple]]] = {}
        self._index = 0          # the last tick run (0: the loop's start)
        self._started = 0.0      # clock time of tick 0
        self._loop: task.LoopingCall | None = None

    def ticks(self, seconds: float, *, up: bool) -> int:
        """``seconds`` in whole ticks: rounded up (a timeout, never shorter) or down (an
        interval, never longer), at least one."""
        exact = seconds / self.tick
        return max(1, math.ceil(exact - 1e-9) if up else math.floor(exact + 1e-9))

    def later(self, ticks: int, fn: Callable, *args, at_least: bool = False) -> None:
        """Run ``fn(*args)`` ``ticks`` ticks from the current one (see the module docstring for
        ``at_least``).  There is no cancel: ``fn`` checks whether it is still wanted."""
        if self._loop is None:
            self._started = self._clock.seconds()
            self._index = 0
            self._loop = task.LoopingCall.withCount(self._run)
            self._loop.clock = self._clock
            self._loop.start(self.tick, now=False)
        slot = self._index + ticks
        if at_least:
            late = self._clock.seconds() - (self._started + self._index * self.tick)
            if late > self.tick / 20:
                slot += 1
        self._slots.setdefault(slot, []).append((fn, args))

    @property
    def waiting(self) -> int:
        """Calls not yet run."""
        return sum(len(calls) for calls in self._slots.values())

    def _run(self, count: int) -> None:
        first, self._index = self._index + 1, self._index + count
        for index in range(first, self._index + 1):
            calls = self._slots.pop(index, None)
            if calls:
                for fn, args in calls:
                    fn(*args)
        if not self._slots and self._loop is not None:
            self._loop.stop()
            self._loop = None


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
