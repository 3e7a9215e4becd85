"""Per-source token buckets on the reactor's clock (``--registration-limit``)."""

from __future__ import annotations

import pytest
from twisted.internet import task

from localai_tw.web.ratelimit import SourceRateLimit


def test_a_source_gets_its_burst_then_waits_for_the_refill():
    clock = task.Clock()
    limit = SourceRateLimit(rate=2.0, burst=3, clock=clock)
    assert [limit.take("10.0.0.1") for _ in range(3)] == [0, 0, 0]
    assert limit.take("10.0.0.1") == pytest.approx(0.5)  # one token in 1/rate seconds
    assert limit.take("10.0.0.2") == 0  # another address has its own bucket
    clock.advance(0.5)
    assert limit.take("10.0.0.1") == 0
    assert limit.take("10.0.0.1") > 0
    clock.advance(60)
    assert [limit.take("10.0.0.1") for _ in range(4)][:3] == [0, 0, 0]  # refilled to burst only
    assert limit.refused == 3
    assert SourceRateLimit.retry_after(0.2) == "1" and SourceRateLimit.retry_after(2.1) == "3"


def test_memory_is_bounded_by_max_sources():
    clock = task.Clock()
    limit = SourceRateLimit(rate=1.0, burst=1, clock=clock, max_sources=100)
    for i in range(10000):
        limit.take(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(limit) == 100


@pytest.mark.parametrize("rate, burst", [(0, 1), (1, 0), (-1, 5)])
def test_nonsense_settings_are_refused(rate, burst):
    with pytest.raises(ValueError):
        SourceRateLimit(rate=rate, burst=burst, clock=task.Clock())
