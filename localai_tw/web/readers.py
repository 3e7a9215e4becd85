"""Reading a response body (``twisted.web.client`` / ``treq``) up to a cap: one byte more
aborts the connection, and so does cancelling the read, so a timed-out exchange stops reading."""

from __future__ import annotations

from twisted.internet import defer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss


class ResponseTooLarge(Exception):
    """The body passed ``limit``; ``received`` holds what came before (at most ``limit``)."""

    def __init__(self, limit: int, received: bytes = b""):
        self.limit = limit
        self.received = received
        super().__init__(f"response body over {limit} bytes")


class _BoundedBody(Protocol):
    def __init__(self, limit: int):
        self.limit = limit
        self.chunks: list[bytes] = []
        self.size = 0
        self.finished: defer.Deferred = defer.Deferred(lambda _: self._abort())

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.finished.called:
            return
        if self.size + len(data) > self.limit:
            self._abort()
            self.finished.errback(ResponseTooLarge(self.limit, b"".join(self.chunks)))
            return
        self.size += len(data)
        self.chunks.append(data)

    def connectionLost(self, reason: Failure) -> None:
        if self.finished.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self.finished.callback(b"".join(self.chunks))
        else:
            self.finished.errback(reason)


def read_bounded(response, limit: int) -> defer.Deferred:
    """A Deferred of ``response``'s whole body, or a :class:`ResponseTooLarge` failure."""
    collector = _BoundedBody(limit)
    response.deliverBody(collector)
    return collector.finished
