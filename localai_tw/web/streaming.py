"""A response body written at the client's pace: :class:`PacedWriter`, the one writer under
the frontend's SSE stream and the worker control plane's NDJSON replies (each keeps its own
framing).

The writer is the request's push producer.  :meth:`PacedWriter.write` puts one piece on the
wire and tells the producer upstream whether it may go on: ``None`` while the client reads,
else a Deferred that fires when the transport resumes and fails with
:class:`~twisted.internet.error.ConnectionClosed` (``ConnectionDone`` or ``ConnectionLost``)
when the connection is lost.  Failing rather than releasing is the point: whatever feeds the
stream (a backend RPC, a streaming verb) learns that the client is gone and stops, instead of
producing into the void.  Writes that do not wait for that Deferred are bounded: past
``max_unread_bytes`` the connection is aborted.

What this module must never do: release a waiting writer when the connection is lost, hold
unbounded bytes for a client that stopped reading, or write after the connection is gone.
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

log = Logger()

#: Bytes a producer may write past the one write each wait allows, while the client is not
#: reading, before the connection is dropped (a well-paced producer never comes near it).
MAX_UNREAD_BYTES = 4 * 1024 * 1024


@implementer(IPushProducer)
class PacedWriter:
    """The body of one streamed response on a ``twisted.web`` request.

    The caller sets the status and headers, then :meth:`start` registers the writer as the
    request's producer (picking up a transport that is full already: a pause is only
    announced on a change).  The connection's end is learnt from whichever comes first: the
    transport's ``stopProducing`` (a real TCP connection calls it before the protocol's
    ``connectionLost``) or the request's ``notifyFinish`` failing.
    """

    def __init__(self, request, what: str, max_unread_bytes: int = MAX_UNREAD_BYTES):
        self.request = request
        #: What the stream is, for the log line when it is dropped.
        self.what = what
        self.max_unread_bytes = max_unread_bytes
        self.started = False
        self.finished = False
        self.paused = False
        #: Bytes written while paused beyond the first write of the pause.
        self.unread_bytes = 0
        self._lost: Failure | None = None
        self._waiters: list[defer.Deferred] = []
        request.notifyFinish().addErrback(self._connection_lost)

    @property
    def gone(self) -> bool:
        """Whether the connection is lost: the client left, or was dropped for not reading."""
        return self._lost is not None or bool(getattr(self.request, "_disconnected", False))

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        request = self.request
        if self.gone or request.channel is None:
            return
        request.registerProducer(self, True)
        self.paused = bool(getattr(request.channel, "_waitingForTransport", False))

    def write(self, data: bytes) -> defer.Deferred | None:
        """Write ``data`` (starting the stream if needed).  Returns ``None`` when more may be
        written at once, else a Deferred that fires when the client reads again and fails
        when its connection is lost.  After the loss or :meth:`finish`, ``data`` is dropped
        and the Deferred has failed already."""
        if self.gone or self.finished:
            return defer.fail(self._ended())
        self.start()
        if self.paused and self._waiters:
            # The producer did not wait for the last write: these bytes pile up here.
            self.unread_bytes += len(data)
            if self.unread_bytes > self.max_unread_bytes:
                self._drop()
                return defer.fail(self._ended())
        self.request.write(data)
        if not self.paused:
            return None
        waiter = defer.Deferred()
        self._waiters.append(waiter)
        return waiter

    def finish(self) -> None:
        """End the response (nothing more to write).  A writer still waiting is released:
        nothing is left to wait for, unless the connection is lost (its caller may finish
        before this writer hears of the loss, and a waiter must still learn it)."""
        if self.finished:
            return
        if self.gone:
            self._connection_lost(Failure(ConnectionDone("the client disconnected")))
        self.finished = True
        self._settle(None)
        request = self.request
        if self.gone or request.channel is None:
            return
        if self.started and request.producer is self:
            request.unregisterProducer()
        if not request.finished:
            request.finish()

    def _ended(self) -> Failure:
        if self._lost is not None:
            return self._lost
        if self.finished:
            return Failure(ConnectionDone("the response is finished"))
        return Failure(ConnectionDone("the client disconnected"))

    def _drop(self) -> None:
        log.warn("{what}: the client stopped reading; dropping the stream", what=self.what)
        self._connection_lost(Failure(ConnectionLost("the client stopped reading")))
        channel = self.request.channel
        transport = channel.transport if channel is not None else None
        if transport is not None:
            getattr(transport, "abortConnection", transport.loseConnection)()

    def _connection_lost(self, reason: Failure) -> None:
        if self._lost is None:
            self._lost = reason
        self._settle(self._lost)
        return None  # the notifyFinish failure is handled here

    def _settle(self, outcome: Failure | None) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if waiter.called:
                continue
            if outcome is None:
                waiter.callback(None)
            else:
                waiter.errback(outcome)

    # IPushProducer: the request's channel tells us when the client stops and starts reading.
    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        self.unread_bytes = 0
        if not self.gone:
            self._settle(None)

    def stopProducing(self) -> None:
        self._connection_lost(Failure(ConnectionDone("the client disconnected")))
