"""Waiting on Deferreds without cancelling them.

Two small tools every layer needs when a Deferred stands for a database statement or another
operation that must not be cut off half-way (cancelling a txpostgres query part-way hands its
connection back while PostgreSQL is still answering on it):

- :func:`wait_at_most` gives up *waiting* after a bound, but lets the operation finish;
- :func:`shielded` lets a caller stop waiting (cancel) without cancelling the operation.

In both, a late outcome has nobody left to tell and is dropped, so it is never logged as an
unhandled error.  Neither ever cancels the Deferred it is given.
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
