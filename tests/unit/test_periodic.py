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


class Away(Exception):
    """Stands for the pool's DatabaseUnavailable (this base module imports nothing of ours)."""


def test_an_outage_is_one_warning_not_a_traceback_per_pass():
    """Issue 26 §5: the replica floor pass logged a critical traceback every 15 s per replica
    during a database outage.  With ``outage_errors`` set, the first failing pass warns once,
    the next ones are quiet, the first pass that runs again says so; any other failure is
    still a traceback."""
    from twisted.logger import LogLevel, globalLogPublisher

    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        clock = task.Clock()
        passes = Passes(clock)
        passes.outage_errors = (Away,)
        failing: list[BaseException] = []

        async def run_once():
            passes.started += 1
            if failing:
                raise failing[0]
        passes.run_once = run_once
        passes.startService()
        failing.append(Away("the database is unavailable: connection refused"))
        for _ in range(4):
            clock.advance(5)
        failing.clear()
        clock.advance(5)
        failing.append(RuntimeError("a bug"))
        clock.advance(5)
        passes.stopService()
    finally:
        globalLogPublisher.removeObserver(events.append)
    ours = [e for e in events if e.get("what") == "test pass"]
    assert [(e["log_level"], e["log_format"].split(":")[0].split(";")[0]) for e in ours] == [
        (LogLevel.warn, "{what} skipped"),
        (LogLevel.info, "{what} runs again"),
        (LogLevel.critical, "{what} failed"),
    ]
    assert ours[0]["why"] == "the database is unavailable: connection refused"
    assert passes.started == 6
