"""WorkerDialer: how this replica opens a stream to a worker, and what it says when it cannot.

``WorkerDialer.open(node, tag, target, protocol, deadline)`` tries, in order (ref §3.3):

1. **local**: this replica holds the node's tunnel -> open a stream on it and do the preamble;
2. **relay**: ``fence.owner(node)`` (joined with live replicas) names another live replica ->
   open a stream on the peer link to it, write the relay frame and the tunnel frame, read
   ``relay-ok`` and the worker's reply on the same stream;
3. **classification**: nobody live holds it -> read presence and say which condition it is.

Every failure is exactly one of the conditions of ``localai_tw.errors`` (docs/routing.md has the
table):

=====================================================  ==========================================
what happened                                          raised
=====================================================  ==========================================
owner is this replica but no session is held here      ``WorkerUnroutable`` (never relay to self)
held here, session would not carry a stream            ``WorkerUnroutable``
relay refused (not-owner, unavailable, bad-request)    ``WorkerUnroutable`` (cause in the message)
owner replica vanished before the dial                 ``WorkerUnroutable``
peer link failed / refused / pool closed               ``PeerUnreachable`` / ``PeerRejected`` /
                                                       ``PoolClosed`` (never about the worker)
no live owner, presence ``gone``                       ``WorkerGone``
no live owner, presence ``reconnecting``               ``AbsentWithinGrace``
no live owner, presence unknown because the query      ``AbsentWithinGrace``
failed; the owner lookup itself failed (DB error)
no live owner, no row at all (never connected, purged) ``WorkerUnroutable`` ("no route")
worker refused with evidence                           ``StreamRefused`` (the worker's answer)
worker answered ``not-served``                         ``WorkerUnroutable`` (nothing learned)
reply outside the vocabulary                           ``TunnelProtocolError``
stream broke before the reply, or 15 s backstop        ``TransportFailure``
the caller's deadline passed (reactor clock)           ``CallerDeadlineExceeded``
=====================================================  ==========================================

Deadlines are absolute times on the reactor clock (``reactor.seconds()``); see
:func:`deadline_after`.  A failure that could have been caused by the deadline running out
(cancellation, a broken stream or link, a timeout) is reported as ``CallerDeadlineExceeded``
once the clock says the deadline passed; facts (routing facts, worker answers, protocol errors)
are reported as themselves.

What this module must never do: relay to itself or more than one hop; report a peer or transport
problem as a statement about the worker, or a worker's answer as no route; treat a database
failure as absence; cancel a database statement in flight (a caller's cancellation only stops
waiting for it).
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.deferreds import shielded
from localai_tw import errors
from localai_tw.cluster.clock import effective_grace
from localai_tw.cluster.ownership import NoConnection, Presence
from localai_tw.tunnel import preamble
from localai_tw.tunnel.handshake import HANDSHAKE_BACKSTOP, PreambleClient
from localai_tw.tunnel.peer import PeerLookupFailed, PeerNotLive
from localai_tw.tunnel.registry import NotHeldHere, TunnelUnavailable

log = Logger()

#: Errors that an expired caller deadline can produce by itself (an abort, a dropped link).
_DEADLINE_SHAPED = (defer.CancelledError, defer.TimeoutError, errors.TransportFailure,
                    errors.PeerUnreachable)


def deadline_after(reactor, seconds: float | None) -> float | None:
    """The absolute deadline ``seconds`` from now on ``reactor``'s clock (None: no deadline)."""
    return None if seconds is None else reactor.seconds() + seconds


class WorkerDialer:
    """Opens streams to workers from this replica: local, relay, or a classified failure.

    :param registry: this replica's ``TunnelRegistry``.
    :param fence: the ``OwnershipFence`` (owner and presence reads).
    :param peer_pool: the ``PeerPool``, or None (no relay path: a remote owner is unroutable).
    :param instance_id: this replica's id.
    :param grace: the reconnect grace in seconds for presence (None: the default 90 s).
    """

    def __init__(self, registry, fence, peer_pool, instance_id: str, grace: float | None = None,
                 reactor=None, *, backstop: float = HANDSHAKE_BACKSTOP,
                 lane: str = preamble.LANE_INFERENCE):
        if reactor is None:
            from twisted.internet import reactor
        self._registry = registry
        self._fence = fence
        self._pool = peer_pool
        self.instance_id = instance_id
        self._grace = grace
        self.reactor = reactor
        self._backstop = backstop
        self._lane = lane

    def open(self, node_id: str, tag: str, target: str, protocol,
             deadline: float | None = None, *, early: bytes = b"",
             lasting: bool = False) -> defer.Deferred:
        """Open a ``tag`` stream to ``node_id`` and connect ``protocol`` to it after ``ok``.

        Fires with ``protocol`` (connected, owning the stream), or fails with one condition of
        the table above.  ``deadline`` is absolute on the reactor clock.  Cancelling aborts
        whatever is in flight (``CallerDeadlineExceeded`` if the deadline passed by then).
        ``early``: bytes of the carried protocol sent right behind the request frame
        (``handshake.PreambleClient``).  ``lasting``: the stream outlives this caller's
        deadline (a pooled ``call`` stream): a relayed one states no budget (0) in its relay
        frame; ``deadline`` still bounds the opening.
        """
        preamble.encode_request(tag, target)  # a bad tag or target is the caller's bug: raise now
        opening = defer.ensureDeferred(self._open(node_id, tag, target, protocol, deadline,
                                                  early, lasting))
        timer = None
        if deadline is not None:
            remaining = deadline - self.reactor.seconds()
            timer = self.reactor.callLater(max(remaining, 0), opening.cancel)

        def finished(result):
            if timer is not None and timer.active():
                timer.cancel()
            if isinstance(result, Failure):
                return self._blame(result, node_id, tag, deadline)
            return result

        return opening.addBoth(finished)

    def _deadline_passed(self, deadline: float | None) -> bool:
        return deadline is not None and self.reactor.seconds() >= deadline

    def _blame(self, failure: Failure, node_id: str, tag: str, deadline: float | None):
        if (failure.check(*_DEADLINE_SHAPED) and not failure.check(errors.PeerRejected,
                                                                   errors.PoolClosed)
                and self._deadline_passed(deadline)):
            return Failure(errors.CallerDeadlineExceeded(
                f"opening a {tag} stream to worker {node_id}"))
        return failure

    async def _open(self, node_id, tag, target, protocol, deadline, early=b"", lasting=False):
        if self._deadline_passed(deadline):
            raise errors.CallerDeadlineExceeded(f"opening a {tag} stream to worker {node_id}")
        if self._registry.holds(node_id):
            try:
                return await self._local(node_id, tag, target, protocol, deadline, early)
            except NotHeldHere:
                pass  # detached this very moment: ask the database who holds it now
        try:
            ownership = await shielded(defer.ensureDeferred(self._fence.owner(node_id)))
        except NoConnection:
            raise await self._classify_absence(node_id) from None
        except defer.CancelledError:
            raise
        except Exception as e:
            log.warn("owner of node={node} unknown, lookup failed: {err}", node=node_id, err=e)
            raise errors.AbsentWithinGrace(node_id, Presence.UNKNOWN.value, e) from e
        if ownership.owner_id == self.instance_id:
            # The row names us, but no session is held here (detached a moment ago, or a stale
            # claim of ours): relaying to ourselves would only loop.
            raise errors.WorkerUnroutable(
                node_id, f"this replica ({self.instance_id}) is the recorded owner but holds no "
                "session; never relayed to self")
        if self._pool is None:
            raise errors.WorkerUnroutable(
                node_id, f"held by replica {ownership.owner_id}, and no relay path is configured")
        return await self._relayed(node_id, ownership.owner_id, tag, target, protocol, deadline,
                                   early, lasting)

    async def _local(self, node_id, tag, target, protocol, deadline, early=b""):
        client = PreambleClient(node_id, tag, target, protocol, self.reactor, deadline,
                                backstop=self._backstop, early=early)
        try:
            self._registry.open_stream(node_id, client)
        except TunnelUnavailable as e:
            raise errors.WorkerUnroutable(node_id, str(e), e) from e
        return await client.whenReady()

    async def _relayed(self, node_id, owner_id, tag, target, protocol, deadline, early=b"",
                       lasting=False):
        remaining = None if deadline is None else deadline - self.reactor.seconds()
        budget = preamble.budget_ms(remaining)  # CallerDeadlineExceeded when already spent
        if lasting:
            budget = 0  # "stated none": the stream carries later calls with their own deadlines
        client = PreambleClient(node_id, tag, target, protocol, self.reactor, deadline,
                                relay=(owner_id, self._lane, budget), backstop=self._backstop,
                                early=early)
        try:
            await self._pool.open_stream(owner_id, client)
        except PeerNotLive as e:
            raise errors.WorkerUnroutable(
                node_id, f"its owner replica {owner_id} is no longer live", e) from e
        except PeerLookupFailed as e:
            raise errors.AbsentWithinGrace(node_id, Presence.UNKNOWN.value, e) from e
        return await client.whenReady()

    async def _classify_absence(self, node_id: str) -> errors.ClusterError:
        reading = await shielded(defer.ensureDeferred(
            self._fence.presence(node_id, self._grace)))
        presence = reading.presence
        if presence is Presence.GONE:
            return errors.WorkerGone(node_id, self._effective_grace())
        if presence is Presence.RECONNECTING:
            return errors.AbsentWithinGrace(node_id, presence.value)
        if presence is Presence.UNKNOWN and reading.error is not None:
            return errors.AbsentWithinGrace(node_id, presence.value, reading.error)
        if presence is Presence.UNKNOWN:
            return errors.WorkerUnroutable(
                node_id, "no route: it never connected, or its departure was purged")
        # CONNECTED: it attached between the owner read and this one.  Nothing is wrong and
        # nothing is known yet; the caller retries.
        return errors.AbsentWithinGrace(node_id, presence.value)

    def _effective_grace(self) -> float:
        return effective_grace(self._grace)
