"""wait_at_most and shielded never cancel what they wait on; OneShotObserver tells one outcome
to every waiter."""

import pytest
from twisted.internet import defer, task
from twisted.python.failure import Failure

from localai_tw.deferreds import OneShotObserver, shielded, wait_at_most


def test_wait_at_most_times_out_without_cancelling_the_operation():
    clock = task.Clock()
    cancelled = []
    operation = defer.Deferred(lambda d: cancelled.append(True))
    waiting = wait_at_most(clock, operation, 5, "the statement")
    clock.advance(5)
    failure = []
    waiting.addErrback(failure.append)
    assert failure and failure[0].check(defer.TimeoutError)
    assert "the statement took longer than 5s" in str(failure[0].value)
    assert not cancelled and not operation.called
    operation.errback(RuntimeError("late"))  # dropped, never an unhandled error
    assert clock.getDelayedCalls() == []


def test_wait_at_most_relays_an_early_result_and_stops_its_timer():
    clock = task.Clock()
    operation = defer.Deferred()
    waiting = wait_at_most(clock, operation, 5)
    operation.callback("rows")
    assert waiting.result == "rows"
    assert clock.getDelayedCalls() == []


def test_shielded_cancel_leaves_the_operation_running():
    cancelled = []
    operation = defer.Deferred(lambda d: cancelled.append(True))
    waiting = shielded(operation)
    waiting.cancel()
    assert not cancelled
    with pytest.raises(defer.CancelledError):
        waiting.result.raiseException()
    waiting.addErrback(lambda _: None)
    operation.callback("done")  # nobody waits any more: dropped quietly


def test_observer_tells_every_waiter_the_one_outcome_each_on_its_own_deferred():
    observer = OneShotObserver()
    first, second = observer.when(), observer.when()
    assert not first.called and not second.called and not observer.fired
    first.addCallback(lambda value: "changed by the first waiter")
    observer.fire("done")
    assert first.result == "changed by the first waiter"
    assert second.result == "done"
    assert observer.when().result == "done"  # a late caller has it at once


def test_observer_hands_a_failure_to_every_waiter_and_to_late_callers():
    observer = OneShotObserver()
    early = observer.when()
    observer.fire(Failure(RuntimeError("dial failed")))
    late = observer.when()
    for d in (early, late):
        with pytest.raises(RuntimeError, match="dial failed"):
            d.result.raiseException()
        d.addErrback(lambda _: None)


def test_observer_cancel_stops_only_that_waiter():
    observer = OneShotObserver()
    quitter, stayer = observer.when(), observer.when()
    quitter.cancel()
    quitter.addErrback(lambda f: f.trap(defer.CancelledError))
    assert observer._waiters == [stayer]  # a waiter that gave up is not kept (memory)
    observer.fire(7)  # no AlreadyCalledError from the cancelled one
    assert stayer.result == 7


def test_observer_firing_twice_is_an_error():
    observer = OneShotObserver()
    observer.fire(1)
    with pytest.raises(defer.AlreadyCalledError):
        observer.fire(2)
    assert observer.when().result == 1
