"""The frontend side of a stream's preamble: ask for a stream, read the answer, hand it over.

A :class:`PreambleClient` is connected to a freshly opened yamux stream (on a worker's tunnel, or
on a peer link for a relayed stream).  It writes the request frame (``"<tag> <target>"``; for a
relayed stream the relay frame ``"<node> <lane> <budget-ms>"`` first, pipelined in the same
write), reads the reply frame(s) without ever reading a byte past them, and then hands the stream
to the caller's protocol together with whatever bytes followed the reply (``HandoffProtocol``).
From then on the caller's protocol owns the stream.

How each outcome is classified (``localai_tw.errors``):

- ``ok`` -> the caller's protocol, connected; the handshake timer is cleared, because an inference
  may then stay quiet for minutes;
- an evidence refusal (``unknown-tag``, ``unavailable``, ``bad-request``) -> ``StreamRefused``
  (the worker's answer); ``not-served`` -> ``WorkerUnroutable`` (nothing learned);
- a relay refusal -> ``WorkerUnroutable`` (the owner replica answered, not the worker);
- a reply outside the vocabulary -> ``TunnelProtocolError`` (not evidence);
- the stream ends before the reply -> ``TransportFailure`` (not a refusal); on a relayed stream,
  before the *relay* reply -> ``PeerUnreachable`` (the peer link failed, not the worker);
- the handshake deadline: the earlier of the caller's deadline and a 15 s backstop.  When the
  caller's deadline is the one that ran out (checked against the reactor clock, not only by
  which timer fired) -> ``CallerDeadlineExceeded``; the backstop alone -> ``TransportFailure``.

What this module must never do: read past the reply (the bytes after it belong to HTTP or gRPC);
leave the handshake timer running after ``ok``; report a broken stream as a refusal, or a refusal
with evidence as anything but the worker's answer; blame the worker or a peer for the caller's
own deadline.
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw import errors
from localai_tw.splice import HandoffProtocol
from localai_tw.tunnel import preamble

log = Logger()

#: Upper bound on waiting for a reply, whatever the caller's deadline (ref §1.4).
HANDSHAKE_BACKSTOP = 15.0


class PreambleClient(HandoffProtocol):
    """Connect to a new stream; fires :meth:`whenReady` with ``protocol`` once it owns the stream.

    :param node_id: the worker the stream is for (named in errors).
    :param tag, target: the request (``http``/``grpc`` and its target).
    :param protocol: the caller's protocol, handed the stream after ``ok``.
    :param reactor: ``seconds`` and ``callLater`` (a ``task.Clock`` in tests).
    :param deadline: the caller's absolute deadline in ``reactor.seconds()`` time, or None.
    :param relay: ``(peer_id, lane, budget_ms)`` for a stream on a peer link: the relay frame is
        written first and ``relay-ok`` is read before the tunnel reply.
    :param early: bytes of the carried protocol written right behind the request frame, without
        waiting for ``ok`` (a ``call`` stream's request: one round trip less, through the relay
        too); a refused stream drops them unread.
    """

    def __init__(self, node_id: str, tag: str, target: str, protocol, reactor,
                 deadline: float | None = None, relay: tuple[str, str, int] | None = None,
                 backstop: float = HANDSHAKE_BACKSTOP, early: bytes = b""):
        self.node_id = node_id
        self._request = preamble.encode_request(tag, target) + early
        self._what = f"opening a {tag} stream to worker {node_id}"
        self._protocol = protocol
        self._reactor = reactor
        self._deadline = deadline
        self._backstop = backstop
        self._relay_frame = b""
        self._peer_id = None
        if relay is not None:
            self._peer_id, lane, budget = relay
            self._relay_frame = preamble.encode_relay_request(node_id, lane, budget)
        self._awaiting_relay_reply = relay is not None
        self._reader = preamble.FrameReader()
        self._ready: defer.Deferred = defer.Deferred(self._cancelled)
        self._timer = None
        self._settled = False

    # -- public ---------------------------------------------------------------------------------

    def whenReady(self) -> defer.Deferred:
        """Fires with the caller's protocol after ``ok``, or fails with the classified error.
        Cancelling it aborts the stream (``CallerDeadlineExceeded`` if the deadline passed)."""
        return self._ready

    def deadline_passed(self) -> bool:
        return self._deadline is not None and self._reactor.seconds() >= self._deadline

    # -- the stream -----------------------------------------------------------------------------

    def connectionMade(self) -> None:
        limit = self._backstop
        if self._deadline is not None:
            limit = min(limit, self._deadline - self._reactor.seconds())
        if limit <= 0:
            self._fail(errors.CallerDeadlineExceeded(self._what), abort=True)
            return
        self._timer = self._reactor.callLater(limit, self._expired)
        # One write: one yamux data frame; the owner's reader stops exactly after the relay frame
        # and passes the tunnel frame on untouched.
        self.transport.write(self._relay_frame + self._request)

    def preludeReceived(self, data: bytes) -> None:
        while data and not self._settled:
            try:
                payload, data = self._reader.feed(data)
            except errors.TunnelProtocolError as e:
                self._fail(e, abort=True)
                return
            if payload is None:
                return
            self._reader = preamble.FrameReader()
            try:
                if self._awaiting_relay_reply:
                    self._relayReply(preamble.parse_relay_reply(payload))
                else:
                    self._streamReply(preamble.parse_reply(payload), data)
                    return
            except errors.TunnelProtocolError as e:
                self._fail(e, abort=True)
                return

    def _relayReply(self, reply: preamble.RelayReply) -> None:
        if not reply.accepted:
            self._fail(reply.as_error(self.node_id), abort=False)
            return
        self._awaiting_relay_reply = False

    def _streamReply(self, reply: preamble.StreamReply, leftover: bytes) -> None:
        if not reply.accepted:
            self._fail(reply.as_error(self.node_id), abort=False)
            return
        self._settled = True
        self._cancelTimer()
        self.handOff(self._protocol, leftover)
        self._ready.callback(self._protocol)

    def connectionLost(self, reason: Failure = None) -> None:
        if self.delegate is None:
            self.preludeLost(reason)
            return
        # Delivered on a later reactor turn, as a TCP transport does.  A yamux stream may end
        # the protocol from inside its own ``loseConnection()`` call, and some protocols are
        # not re-entrant there: ``HTTP11ClientProtocol.abort()`` calls ``loseConnection()`` and
        # only then registers the Deferred that ``connectionLost`` fires, which would never fire.
        self._reactor.callLater(0, self.delegate.connectionLost, reason)

    def preludeLost(self, reason: Failure) -> None:
        if self._settled:
            return
        if self.deadline_passed():
            self._fail(errors.CallerDeadlineExceeded(self._what), abort=False)
            return
        detail = reason.getErrorMessage()
        if self._awaiting_relay_reply:
            self._fail(errors.PeerUnreachable(
                self._peer_id, f"the relayed stream for worker {self.node_id} ended before the "
                f"relay reply ({detail})"), abort=False)
            return
        if not reason.check(ConnectionDone):
            detail = f"{reason.type.__name__}: {detail}"
        self._fail(errors.TransportFailure(
            f"the stream to worker {self.node_id} ended before its reply ({detail})"), abort=False)

    # -- endings --------------------------------------------------------------------------------

    def _expired(self) -> None:
        self._timer = None
        if self.deadline_passed():
            self._fail(errors.CallerDeadlineExceeded(self._what), abort=True)
        else:
            self._fail(errors.TransportFailure(
                f"no reply from worker {self.node_id} within the {self._backstop:g}s handshake "
                "backstop"), abort=True)

    def _cancelled(self, _d) -> None:
        # The Deferred machinery errbacks with CancelledError after this returns, unless we fire.
        if self._settled:
            return
        self._settled = True
        self._cancelTimer()
        self._abort()
        if self.deadline_passed():
            self._ready.errback(errors.CallerDeadlineExceeded(self._what))

    def _fail(self, error: Exception, abort: bool) -> None:
        if self._settled:
            return
        self._settled = True
        self._cancelTimer()
        if abort:
            self._abort()
        elif self.transport is not None:
            self.transport.loseConnection()
        self._ready.errback(Failure(error))

    def _abort(self) -> None:
        transport = self.transport
        if transport is None:
            return
        abort = getattr(transport, "abortConnection", None)
        (abort or transport.loseConnection)()

    def _cancelTimer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
