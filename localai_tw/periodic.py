"""A service that runs one pass of its work every ``interval`` seconds while it runs.

The lifecycle watchdog, the replica floor, the preloader, the health monitor and the jobs
figures each started, stopped and guarded a ``LoopingCall`` by hand, with two different stop
semantics; this is that code once, with ``TimerService``'s: stopping ends the loop and waits
for a pass in flight, so a stopped service runs nothing and owes nothing.  A pass that fails
is logged with ``pass_name`` and the next one runs on time; nothing here blocks the reactor (a
pass is ``async`` and runs on it).  (``TimerService`` itself is not used because its call
cannot be async and its failures end the loop.)

A dependency that is away (the database during an outage: ``outage_errors``, set by a
subclass, since this base module imports nothing of ours) is not a fault of the pass: the first
pass it fails logs one warning, the passes after it nothing, and the first pass that runs again
one line -- never a traceback every ``interval``.
"""

from __future__ import annotations

from twisted.application.service import Service
from twisted.internet import defer, task
from twisted.logger import Logger

log = Logger()


class PeriodicPass(Service):
    """Subclasses set ``self._reactor`` and ``self.interval`` and define ``async run_once()``.

    ``pass_enabled()`` False at start: no loop at all.  ``run_first``: the first pass runs at
    start instead of one interval later.  ``stop_passes()`` ends the loop from inside a pass.
    """

    pass_name = "periodic pass"
    run_first = False
    #: Exceptions meaning a dependency is away (module docstring): one warning per outage.
    outage_errors: tuple[type[BaseException], ...] = ()
    _away: bool = False
    _loop: task.LoopingCall | None = None
    _loop_finished: defer.Deferred | None = None

    def pass_enabled(self) -> bool:
        return True

    def startService(self) -> None:
        super().startService()
        if not self.pass_enabled():
            return
        self._loop = task.LoopingCall(self._tick)
        self._loop.clock = self._reactor
        self._loop_finished = self._loop.start(self.interval, now=self.run_first)
        self._loop_finished.addErrback(
            lambda f: log.failure("the {what} loop stopped", f, what=self.pass_name))

    def stopService(self) -> defer.Deferred:
        """Fires once the loop has ended and a pass in flight has finished."""
        super().stopService()
        self.stop_passes()
        finished, self._loop_finished = self._loop_finished, None
        if finished is None:
            return defer.succeed(None)
        return finished.addCallback(lambda _: None)

    def stop_passes(self) -> None:
        """End the loop (from a pass too); a pass in flight still finishes."""
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def _tick(self) -> defer.Deferred:
        return defer.ensureDeferred(self.run_once()).addCallbacks(self._ran, self._failed)

    def _ran(self, result):
        if self._away:
            self._away = False
            log.info("{what} runs again", what=self.pass_name)
        return result

    def _failed(self, failure) -> None:
        if self.outage_errors and failure.check(*self.outage_errors):
            if not self._away:
                self._away = True
                log.warn("{what} skipped: {why}; it is skipped quietly until that ends",
                         what=self.pass_name, why=failure.getErrorMessage())
            return None
        log.failure("{what} failed", failure, what=self.pass_name)
        return None

    async def run_once(self):
        raise NotImplementedError
