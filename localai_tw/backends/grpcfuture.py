"""A grpcio call future as a Deferred, so gRPC never blocks the reactor.

grpcio's synchronous stubs offer ``.future()``: the call runs on grpcio's own threads and the
future completes there.  :func:`deferred_from_future` hands the outcome back to the reactor
thread with ``callFromThread``; cancelling the Deferred cancels the RPC.  Nothing here waits on a
thread, and nothing here classifies errors: callers decide what a status means.
:func:`next_stream_item` is the one blocking read of a server stream's next item, for the
threads that read streams (the frontend's bridged client, the worker's ``call`` streams).
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.python.failure import Failure


def deferred_from_future(reactor, future) -> defer.Deferred:
    """A Deferred firing on the reactor thread with ``future``'s response or its exception."""
    result: defer.Deferred = defer.Deferred(lambda d: future.cancel())

    def deliver(done):
        if result.called:
            return  # cancelled by the caller
        if done.cancelled():
            result.errback(defer.CancelledError())
            return
        exc = done.exception()
        if exc is not None:
            result.errback(Failure(exc))
        else:
            result.callback(done.result())

    future.add_done_callback(lambda done: reactor.callFromThread(deliver, done))
    return result


#: What :func:`next_stream_item` answers after a stream's last item.
STREAM_END = object()


def next_stream_item(iterator):
    """The stream's next item, or :data:`STREAM_END`; blocks, so only on a reading thread."""
    try:
        return next(iterator)
    except StopIteration:
        return STREAM_END
