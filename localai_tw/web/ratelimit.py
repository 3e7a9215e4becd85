"""Per-source token buckets: how many requests of one kind an address may make, bounded in memory.

Written here rather than taken from a library because what is needed is small and must run on
the reactor's clock (``IReactorTime.seconds``, so tests drive it with ``task.Clock``): a bucket
of ``burst`` tokens per source, refilled at ``rate`` per second, and at most ``max_sources``
buckets (the least recently seen source is forgotten first, which can only make the limit more
lenient for it, never stricter for anyone else).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    at: float


class SourceRateLimit:
    """``take(source)`` answers 0 when the request may go ahead, else the seconds until it may.

    :param rate: tokens added per second per source (> 0).
    :param burst: the most tokens a source can hold, i.e. requests it may make at once (>= 1).
    :param clock: an ``IReactorTime``.
    :param max_sources: buckets kept at most.
    """

    def __init__(self, rate: float, burst: int, clock, max_sources: int = 10000):
        if not rate > 0 or burst < 1 or max_sources < 1:
            raise ValueError("rate must be > 0, burst and max_sources >= 1")
        self.rate = float(rate)
        self.burst = int(burst)
        self._clock = clock
        self._max_sources = max_sources
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        #: Requests refused since the counter was last read (for rate-limited log summaries).
        self.refused = 0

    def take(self, source: str) -> float:
        now = self._clock.seconds()
        bucket = self._buckets.pop(source, None)
        if bucket is None:
            bucket = _Bucket(float(self.burst), now)
            while len(self._buckets) >= self._max_sources:
                self._buckets.popitem(last=False)
        else:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
        self._buckets[source] = bucket
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        self.refused += 1
        return (1 - bucket.tokens) / self.rate

    @staticmethod
    def retry_after(seconds: float) -> str:
        """A ``Retry-After`` value: whole seconds, at least 1."""
        return str(max(1, math.ceil(seconds)))

    def __len__(self) -> int:
        return len(self._buckets)
