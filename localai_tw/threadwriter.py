"""Chunks of a stream written to a file and hashed on a thread, so a slow disk never stalls
the reactor.

A page-cache write is usually microseconds, but a disk under dirty-page throttling, a network
filesystem or a full journal can hold ``write(2)`` for seconds, and on the reactor thread that
stalls every connection of the process.  :class:`ThreadedFileWriter` takes the chunks on the
reactor, hands them in order to a thread pool in batches (one batch in flight per file, so the
hash sees the bytes in order and the thread pool is never flooded), and pauses the producer
that delivers them while more than ``high_water`` bytes wait, resuming it below ``low_water``:
memory per file stays bounded whatever the disk does.

Twisted has no file consumer that writes off the reactor (``twisted.protocols.basic.FileSender``
reads, and ``FileBodyProducer`` reads on the reactor through a cooperator), hence this module.
"""

from __future__ import annotations

import os

from twisted.internet import defer, threads
from twisted.python.failure import Failure

#: Bytes waiting for the disk above which the producer is paused, and below which it resumes.
HIGH_WATER = 4 * 1024 * 1024
LOW_WATER = 1024 * 1024


def write_all(fd: int, data: bytes) -> None:
    """``data`` written whole to ``fd`` (``os.write`` may write less than it was given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class ThreadedFileWriter:
    """Writes to ``fd`` and feeds ``hasher`` (anything with ``update``) off the reactor.

    :param producer: an ``IPushProducer`` (or None) paused while too much waits.
    :param on_error: called on the reactor with the ``OSError`` of a failed write (at most once),
        so the owner can stop the transfer at once instead of at its end.
    The owner must not close ``fd`` until :meth:`drained` fired: a batch may be in a thread.
    """

    def __init__(self, reactor, fd: int, hasher, producer=None, *, pool=None, on_error=None,
                 high_water: int = HIGH_WATER, low_water: int = LOW_WATER):
        self._reactor = reactor
        self._pool = pool if pool is not None else reactor.getThreadPool()
        self._fd = fd
        self._hasher = hasher
        self.producer = producer
        self._on_error = on_error
        self._high = high_water
        self._low = low_water
        self._chunks: list[bytes] = []
        #: bytes taken by :meth:`write` and not yet written to the file
        self.pending = 0
        self.written = 0
        self.paused = False
        self._busy = False
        #: the OSError of a failed write; later writes are dropped
        self.error: BaseException | None = None
        self._waiters: list[defer.Deferred] = []

    def write(self, data: bytes) -> None:
        if self.error is not None or not data:
            return
        self._chunks.append(data)
        self.pending += len(data)
        if not self.paused and self.pending > self._high and self.producer is not None:
            self.paused = True
            self.producer.pauseProducing()
        self._next_batch()

    def drained(self) -> defer.Deferred:
        """Fires with None once every byte taken was written, or fails with the write's error."""
        if self.error is not None:
            return defer.fail(self.error)
        if not self._busy and not self._chunks:
            return defer.succeed(None)
        waiter: defer.Deferred = defer.Deferred()
        self._waiters.append(waiter)
        return waiter

    def _next_batch(self) -> None:
        if self._busy or not self._chunks or self.error is not None:
            return
        batch, self._chunks = self._chunks, []
        self._busy = True
        size = sum(len(chunk) for chunk in batch)
        threads.deferToThreadPool(self._reactor, self._pool, self._write_batch, batch) \
            .addCallbacks(self._batch_written, self._batch_failed, callbackArgs=(size,))

    def _write_batch(self, batch: list[bytes]) -> None:
        """In a thread: the only place the file and the hasher are touched while a batch runs."""
        for chunk in batch:
            write_all(self._fd, chunk)
            self._hasher.update(chunk)

    def _batch_written(self, _, size: int) -> None:
        self._busy = False
        self.pending -= size
        self.written += size
        if self.paused and self.pending <= self._low:
            self.paused = False
            if self.producer is not None:
                self.producer.resumeProducing()
        if self._chunks:
            self._next_batch()
        else:
            self._fire(None)

    def _batch_failed(self, failure: Failure) -> None:
        self._busy = False
        self.error = failure.value
        self._chunks = []
        self.pending = 0
        if self._on_error is not None:
            self._on_error(failure.value)
        self._fire(failure)

    def _fire(self, outcome) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if isinstance(outcome, Failure):
                waiter.errback(outcome)
            else:
                waiter.callback(outcome)
