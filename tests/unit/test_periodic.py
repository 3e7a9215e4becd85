"""PeriodicPass: one pass every interval while running; stopping waits for a pass in flight
(TimerService's semantics) and runs nothing after; a failed pass does not end the loop."""

from twisted.internet import defer, task

from localai_tw.periodic import PeriodicPass


class Passes(PeriodicPass):
    pass_name = "test pass"

    def __init__(self, clock, interval=5.0):
        self._reactor = clock
        self.interval = interval
        self.started = 0
        self.gate: defer.Deferred | None = None
        self.fail_next = False

    async def run_once(self):
        self.started += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        if self.gate is not None:
            await self.gate


def test_passes_run_every_interval_and_a_failure_does_not_end_the_loop():
    clock = task.Clock()
    passes = Passes(clock)
    passes.startService()
    assert passes.started == 0  # run_first is off: one interval later
    clock.advance(5)
    passes.fail_next = True
    clock.advance(5)
    clock.advance(5)
    assert passes.started == 3
    passes.stopService()


def test_stopping_waits_for_the_pass_in_flight_and_runs_nothing_after():
    clock = task.Clock()
    passes = Passes(clock)
    passes.gate = defer.Deferred()
    passes.startService()
    clock.advance(5)
    assert passes.started == 1
    stopped = passes.stopService()
    assert not stopped.called  # the pass in flight has not finished
    passes.gate.callback(None)
    assert stopped.called
    clock.advance(50)
    assert passes.started == 1


def test_a_disabled_pass_starts_no_loop_and_stops_at_once():
    clock = task.Clock()
    passes = Passes(clock)
    passes.pass_enabled = lambda: False
    passes.startService()
    clock.advance(50)
    assert passes.started == 0
    assert passes.stopService().called
