"""Waiting on Deferreds without cancelling them.

Two small tools every layer needs when a Deferred stands for a database statement or another
operation that must not be cut off half-way (cancelling a txpostgres query part-way hands its
connection back while PostgreSQL is still answering on it):

- :func:`wait_at_most` gives up *waiting* after a bound, but lets the operation finish;
- :func:`shielded` lets a caller stop waiting (cancel) without cancelling the operation.

In both, a late outcome has nobody left to tell and is dropped, so it is never logged as an
unhandled error.  Neither ever cancels the Deferred it is given.

And one for the other side of waiting: :class:`OneShotObserver`, "one outcome, many waiters",
which every "when ... is done" method otherwise writes by hand as a list of Deferreds.
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.python.failure import Failure


def _relay_into(out: defer.Deferred, result) -> None:
    if not out.called:
        if isinstance(result, Failure):
            out.errback(result)
        else:
            out.callback(result)


def wait_at_most(reactor, d: defer.Deferred, seconds: float,
                 what: str = "the operation") -> defer.Deferred:
    """A Deferred with ``d``'s outcome, or ``defer.TimeoutError`` naming ``what`` after
    ``seconds``, whichever comes first.  ``d`` is left to finish; cancelling the returned
    Deferred does not cancel ``d`` either."""
    out: defer.Deferred = defer.Deferred()

    def expire() -> None:
        if not out.called:
            out.errback(defer.TimeoutError(f"{what} took longer than {seconds:g}s"))

    timer = reactor.callLater(seconds, expire)

    def finished(result):
        if timer.active():
            timer.cancel()
        _relay_into(out, result)
        return None

    d.addBoth(finished)
    return out


def shielded(d: defer.Deferred) -> defer.Deferred:
    """A Deferred with ``d``'s outcome that the caller may cancel without cancelling ``d``."""
    out: defer.Deferred = defer.Deferred()

    def finished(result):
        _relay_into(out, result)
        return None

    d.addBoth(finished)
    return out


class OneShotObserver:
    """One outcome, told to any number of waiters: before it, each :meth:`when` is a new
    pending Deferred; :meth:`fire` gives every one of them the outcome; after it, :meth:`when`
    has the outcome at once.

    Each waiter gets its own Deferred, so one waiter's callbacks never change what another
    sees, and cancelling one only stops that waiter.  Firing twice is a bug in the caller and
    raises ``defer.AlreadyCalledError``: an outcome that could change would be no outcome.
    """

    __slots__ = ("_waiters", "_fired", "_result")

    def __init__(self) -> None:
        self._waiters: list[defer.Deferred] = []
        self._fired = False
        self._result = None

    @property
    def fired(self) -> bool:
        return self._fired

    def when(self) -> defer.Deferred:
        """A new Deferred with the outcome; already fired when the outcome is known."""
        if self._fired:
            result = self._result
            return defer.fail(result) if isinstance(result, Failure) else defer.succeed(result)
        d: defer.Deferred = defer.Deferred(self._forget)
        self._waiters.append(d)
        return d

    def fire(self, result) -> None:
        """Set the outcome (a value, or a :class:`Failure` to errback with) and tell every
        waiter, in the order they asked."""
        if self._fired:
            raise defer.AlreadyCalledError(f"{self!r} already fired")
        self._fired = True
        self._result = result
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            _relay_into(d, result)

    def _forget(self, d: defer.Deferred) -> None:
        # cancelled by its waiter: nothing to tell it any more (the Deferred errbacks with
        # CancelledError on its own)
        if d in self._waiters:
            self._waiters.remove(d)
