"""Receive-window auto-tuning: grow a stream's window toward the bandwidth-delay product.

A yamux stream moves at most one receive window per round trip: 256 KiB every 50 ms is 5 MB/s
whatever the link.  This module holds the rule a stream uses to decide, each time it grants
window back, how large its window should be (as QUIC and HTTP/2 stacks do):

* an *epoch* runs from one grant to the next; if the reader consumed more than half the window
  in less than ``2 * fraction * rtt`` (fraction = consumed / window), the window is what limits
  the stream, so it doubles, up to the per-stream ceiling and to what the session's and the
  process's budgets (``WindowPool``) still hold;
* if the consumer paused the stream during the epoch, the reader is the bottleneck: the window
  halves (never below the base ``max_window``) and its share goes back to the budgets; it
  never grows in such an epoch, so a paused consumer cannot make the window grow.

It is pure bookkeeping (no I/O, no clock of its own: the caller passes ``now`` and the round
trip), and it must never grant more than the budgets hold, never shrink below the base window,
and never touch the wire: a bigger window is only a bigger delta in a standard window update.
"""

from __future__ import annotations


class WindowPool:
    """Bytes of receive window above the base, shared by every session given this pool (a
    process's memory budget for receive buffers).  ``take`` grants at most what is left."""

    def __init__(self, total: int):
        if total < 0:
            raise ValueError("a window pool must not be negative")
        self.total = total
        self.used = 0

    def take(self, wanted: int) -> int:
        granted = max(0, min(wanted, self.total - self.used))
        self.used += granted
        return granted

    def give(self, amount: int) -> None:
        self.used = max(0, self.used - amount)


class SessionFlow:
    """A session's flow bookkeeping that is not per stream, in one slotted object.  The window
    tuning's share: bytes of window above ``max_window`` the streams hold (``extra``), the
    smallest recent ping round trip and when it was taken, the probe ping out (``(opaque,
    sent)``), when the last keepalive ping went.  The bulk budget's (``SessionConfig.
    bulk_in_flight``): Data bytes written, acknowledged by a ping reply, the mark of the last
    budget ping, and the budget pings out (opaque -> mark)."""

    __slots__ = ("extra", "rtt", "rtt_at", "probe", "keepalive_sent",
                 "data_out", "data_acked", "budget_mark", "budget_pings")

    def __init__(self):
        self.extra = 0
        self.rtt: float | None = None
        self.rtt_at = 0.0
        self.probe: tuple[int, float] | None = None
        self.keepalive_sent = 0.0
        self.data_out = 0
        self.data_acked = 0
        self.budget_mark = 0
        self.budget_pings: dict[int, int] = {}


class WindowTuner:
    """The tuning state of one stream: its receive window (``window``), the payload bytes it
    received in all, and the current epoch.  ``decide`` is called just before a window grant;
    the first grant only ``start``s the first epoch."""

    __slots__ = ("window", "received", "epoch_start", "epoch_consumed", "paused")

    #: grow when a window's worth is consumed within this many round trips: the window then
    #: settles at up to twice the bandwidth-delay product (QUIC stacks use 4; 2 keeps the
    #: queue a control frame may wait behind at about one round trip)
    GROW_RTTS = 2

    def __init__(self, window: int):
        self.window = window
        self.received = 0
        self.epoch_start: float | None = None  # None: no epoch yet (no grant so far)
        self.epoch_consumed = 0
        self.paused = False  # the consumer paused the stream during this epoch

    def start(self, now: float, consumed: int) -> None:
        """Begin the first epoch (at the stream's first grant)."""
        self._restart(now, consumed)

    def decide(self, now: float, consumed: int, window: int, base: int, ceiling: int,
               rtt: float | None) -> int:
        """The window to use from now on (``window`` unchanged, doubled or halved).
        ``consumed``: bytes handed to the protocol so far, in all."""
        if self.paused:
            self._restart(now, consumed)
            return max(base, window // 2)
        read = consumed - self.epoch_consumed
        if read <= window // 2:
            return window  # too little of the window used to say anything
        elapsed = now - self.epoch_start
        self._restart(now, consumed)
        if rtt is None or window >= ceiling:
            return window
        if elapsed < self.GROW_RTTS * (read / window) * rtt:
            return min(2 * window, ceiling)
        return window

    def _restart(self, now: float, consumed: int) -> None:
        self.epoch_start = now
        self.epoch_consumed = consumed
        self.paused = False
