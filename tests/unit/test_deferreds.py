"""wait_at_most and shielded never cancel what they wait on."""

import pytest
from twisted.internet import defer, task

from localai_tw.deferreds import shielded, wait_at_most


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
