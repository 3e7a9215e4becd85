"""A replica stopped while its claim consumer subscribes to the wake hints: a normal stop, so
no warning, and a subscription that lands after the stop is undone (a warn line per stop made
operators look for a bus problem that was not there)."""

from __future__ import annotations

from twisted.internet import defer, task
from twisted.logger import LogLevel, globalLogPublisher

from localai_tw.bus.claims import ClaimConsumer
from localai_tw.bus.pgbus import BusStopped

from .pendingbus import PendingBus as Bus
from .pendingbus import Subscription


class Queue:
    def release_held_by(self, owner):
        return defer.succeed([])


def _consumer(bus, clock):
    return ClaimConsumer(Queue(), "replica-a", ["chat"], lambda claim: None, bus=bus,
                         reactor=clock)


def test_a_stop_while_subscribing_logs_no_warning_and_undoes_a_late_subscription():
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        for outcome in ("fails", "lands"):
            bus, clock = Bus(), task.Clock()
            consumer = _consumer(bus, clock)
            consumer.startService()
            consumer.stopService()
            if outcome == "fails":
                bus.pending[0].errback(BusStopped("the bus was stopped"))
            else:
                late = Subscription()
                bus.pending[0].callback(late)
                assert late.unsubscribed
            assert not clock.getDelayedCalls()  # no poll loop left behind
    finally:
        globalLogPublisher.removeObserver(events.append)
    ours = [e for e in events if "claims" in str(e.get("log_namespace", ""))]
    assert not [e for e in ours if e["log_level"] >= LogLevel.warn], ours


def test_a_running_consumer_without_the_bus_still_says_it_polls_only():
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        bus, clock = Bus(), task.Clock()
        consumer = _consumer(bus, clock)
        consumer.startService()
        bus.pending[0].errback(BusStopped("the bus is not running"))
        consumer.stopService()
    finally:
        globalLogPublisher.removeObserver(events.append)
    warned = [e for e in events if e["log_level"] == LogLevel.warn
              and "no wake hints" in e.get("log_format", "")]
    assert len(warned) == 1
