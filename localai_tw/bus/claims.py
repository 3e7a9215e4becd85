"""The work claim queue: rows in ``work_claims`` claimed with ``FOR UPDATE SKIP LOCKED``.

A unit of work is enqueued as a row; a live frontend replica claims it with one statement that
also checks the replica is live, drives it, and settles it.  A consumer claims all its free slots
in one statement and completes the rows finished in the same reactor turn (or while the previous
batch was being written) in one fenced statement: one commit per batch instead of per row.  Every settle (complete, release
after a transport failure, release after a work failure) is fenced by the holder *and* the
``attempts`` count read at claim time, so a holder that was reaped and answers late changes
nothing.  Claims held by replicas that are not live (``instances``) are reaped at once, with no
age term: a live replica keeps a slow claim for as long as it needs, a dead one's claims move on
immediately.  Transport failures back off 2 s doubling to 60 s on the database clock.

Delivery is **at-least-once**: a handler may see the same work again (after a reap, or when its
settle could not be written), so handlers must tolerate repeats.  The bus wake hint only
shortens pickup; the 2 s poll is what guarantees it.

This module must never compare times in Python (every delay and liveness test is SQL against
``now()``), never claim for an empty or non-live owner, never settle a row it no longer holds,
never block the reactor, and never run more handlers than its in-flight bound.

One module of about 780 lines: the statements (``ClaimQueue``) and the consumer that drives
them share the fence (holder and ``attempts``) that makes every settle safe; it is the one
place to read to see that no row is settled by a replica that no longer holds it.
"""

from __future__ import annotations

import inspect
import re
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Sequence

import psycopg2
from twisted.application import service
from twisted.internet import defer, task
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw import errors
from localai_tw.cluster.membership import (
    INSTANCE_IS_LIVE_SQL,
    LIVE_INSTANCE_IDS_SQL,
)
from localai_tw.cluster.clock import INSTANCE_LIVENESS
from localai_tw.db.pool import Database, DatabaseUnavailable, PoolClosed

from localai_tw.deferreds import wait_at_most

from .pgbus import PgBus

log = Logger()

#: Largest payload a unit of work may carry.
WORK_PAYLOAD_MAX_BYTES = 1024 * 1024
#: A consumer polls this often even without wake hints.
CLAIM_POLL_INTERVAL = 2.0
#: A settle write that has not answered by then is retried on a later tick.
SETTLE_TIMEOUT = 10.0
#: Work failures after which ``on_exhausted`` records the work as failed and the row is deleted.
MAX_FAILURES = 10
#: Backoff after a transport failure: 2 s * 2^attempts, capped at 60 s, exponent at most 16.
BACKOFF_BASE_SECONDS = 2
BACKOFF_CAP_SECONDS = 60
BACKOFF_MAX_EXPONENT = 16
#: The bus subject of the wake hint (payload ``{"kind": kind}``).
WAKE_SUBJECT = "claims.wake"

_KIND = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,31}$")


# -- errors and markers ---------------------------------------------------------------------------


class ClaimError(Exception):
    """Base of the errors this module raises."""


class EmptyOwner(ClaimError, ValueError):
    """A claim needs a replica id: a row claimed by '' could never be reaped."""


class OwnerNotLive(ClaimError):
    """The claiming replica is not live in ``instances``, so it may not claim (its rows would
    be reaped from under it)."""

    def __init__(self, owner: str):
        self.owner = owner
        super().__init__(f"replica {owner!r} is not live in instances; it claims nothing "
                         "until its heartbeat makes it live again")


class InvalidKind(ClaimError, ValueError):
    """A kind must be 1-32 characters of ``[a-z0-9_.-]``."""


class WorkPayloadTooLarge(ClaimError, ValueError):
    """The payload exceeds ``WORK_PAYLOAD_MAX_BYTES``."""


class ClaimLost(ClaimError):
    """The claim was reaped or settled elsewhere while its handler ran."""


class KeepClaim(Exception):
    """Raised by a handler: the work ran but its answer could not be recorded; leave the row
    held by this replica (it is released when this replica restarts or stops being live)."""


#: Handler errors that say nothing about the work (the route, the peer, the database failed):
#: released with backoff, not counted as work failures.
DEFAULT_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    errors.TransportFailure, errors.PeerUnreachable, errors.AbsentWithinGrace,
    errors.RoutingFact, errors.CallerDeadlineExceeded, DatabaseUnavailable,
)


# -- the claim and the queue ------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """One claimed row as it was when claimed.  ``(owner, attempts)`` is its fence."""

    id: str
    kind: str
    payload: bytes
    owner: str
    attempts: int
    failures: int


def _check_kind(kind: str) -> str:
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise InvalidKind(f"work kind {kind!r} must be 1-32 characters of [a-z0-9_.-]")
    return kind


def _check_owner(owner: str) -> str:
    if not isinstance(owner, str) or not owner:
        raise EmptyOwner("a claim owner (this replica's instance id) is required; "
                         "a row claimed by '' could never be reaped")
    return owner


_FENCE = "id = %s AND claimed_by = %s AND attempts = %s"

#: Most rows one claim or complete statement handles (a consumer asks for at most its free
#: slots; a larger bound is served by several statements).
MAX_BATCH = 256

# One statement, one round trip, one commit: the liveness of the owner and the claim of up to
# ``limit`` rows are decided together.  ``picked`` is MATERIALIZED so the locking sub-select runs
# exactly once (a re-scanned LIMIT sub-select could hand back more rows than asked for); FOR
# UPDATE SKIP LOCKED lets concurrent claimers pass each other's locked rows.  The LEFT JOIN
# always yields one row, so a live owner with nothing to claim is told apart from a non-live one
# (``live`` false, no rows) in the same answer.
_CLAIM_SQL = f"""
WITH owner_live AS (
    SELECT EXISTS (SELECT 1 FROM instances
                   WHERE instances.id = %s AND {INSTANCE_IS_LIVE_SQL}) AS live
), picked AS MATERIALIZED (
    SELECT id FROM work_claims
    WHERE claimed_at IS NULL
      AND kind = ANY(%s)
      AND (not_before IS NULL OR not_before <= now())
      AND (SELECT live FROM owner_live)
    ORDER BY created_at, id
    FOR UPDATE SKIP LOCKED
    LIMIT %s
), claimed AS (
    UPDATE work_claims SET claimed_by = %s, claimed_at = now()
    FROM picked WHERE work_claims.id = picked.id
    RETURNING work_claims.id, work_claims.kind, work_claims.payload, work_claims.attempts,
              work_claims.failures, work_claims.created_at
)
SELECT owner_live.live, claimed.id, claimed.kind, claimed.payload, claimed.attempts,
       claimed.failures
FROM owner_live LEFT JOIN claimed ON true
ORDER BY claimed.created_at, claimed.id
"""

# attempts on the right-hand side is the pre-increment value (UPDATE reads the old row).
_BACKOFF_SQL = (f"now() + make_interval(secs => least({BACKOFF_CAP_SECONDS}, "
                f"{BACKOFF_BASE_SECONDS} * power(2, least(attempts, {BACKOFF_MAX_EXPONENT}))))")

_RELEASE_SQL = (
    "UPDATE work_claims SET claimed_by = '', claimed_at = NULL, attempts = attempts + 1,"
    f" failures = failures + %s, not_before = {_BACKOFF_SQL}"
    f" WHERE {_FENCE} RETURNING id"
)

_ABANDON_SQL = (
    "UPDATE work_claims SET claimed_by = '', claimed_at = NULL, attempts = attempts + 1,"
    f" not_before = NULL WHERE {_FENCE} RETURNING id"
)

# Fenced like every settle: a row is deleted only where id, holder AND attempts all match one of
# the given tenures.  One statement (one commit) for a whole batch.
_COMPLETE_MANY_SQL = (
    "DELETE FROM work_claims USING unnest(%s::text[], %s::text[], %s::int[])"
    " AS fence(id, claimed_by, attempts)"
    " WHERE work_claims.id = fence.id AND work_claims.claimed_by = fence.claimed_by"
    " AND work_claims.attempts = fence.attempts"
    " RETURNING work_claims.id, work_claims.claimed_by, work_claims.attempts"
)

_REAP_SQL = (
    "UPDATE work_claims SET claimed_by = '', claimed_at = NULL, attempts = attempts + 1,"
    " not_before = NULL"
    f" WHERE claimed_at IS NOT NULL AND claimed_by NOT IN ({LIVE_INSTANCE_IDS_SQL})"
    " RETURNING id"
)

_RELEASE_HELD_BY_SQL = (
    "UPDATE work_claims SET claimed_by = '', claimed_at = NULL, attempts = attempts + 1,"
    " not_before = NULL WHERE claimed_by = %s AND claimed_at IS NOT NULL RETURNING id"
)

def enqueue_statement(kind: str, payload: bytes, work_id: str) -> tuple[str, tuple]:
    """The INSERT of one unit of work, checked like ``enqueue``, for a caller that enqueues in
    its own transaction (the row and its record commit together); then call ``wake``."""
    _check_kind(kind)
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"work payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    if len(payload) > WORK_PAYLOAD_MAX_BYTES:
        raise WorkPayloadTooLarge(
            f"work payload of {len(payload)} bytes exceeds the cap of "
            f"{WORK_PAYLOAD_MAX_BYTES} (1 MiB); store large inputs elsewhere and enqueue "
            "a reference")
    if not isinstance(work_id, str) or not work_id or len(work_id) > 36:
        raise ValueError("a work id is 1-36 characters")
    return ("INSERT INTO work_claims (id, kind, payload) VALUES (%s, %s, %s)",
            (work_id, kind, psycopg2.Binary(payload)))


RELEASED = "released"
EXHAUSTED = "exhausted"
LOST = "lost"


class ClaimQueue:
    """Statements on ``work_claims``.  Stateless apart from the pool and the optional bus.

    :param bus: where the wake hint goes on enqueue (optional; polling works without it).
    :param liveness: the replica liveness window in seconds (``instances.last_seen``).
    """

    def __init__(self, db: Database, bus: PgBus | None = None,
                 liveness: float = INSTANCE_LIVENESS):
        self.db = db
        self.bus = bus
        self.liveness = float(liveness)

    async def enqueue(self, kind: str, payload: bytes, *, work_id: str | None = None) -> str:
        """Insert a unit of work and publish the wake hint; returns its id.

        Succeeds with no consumer running (the row waits).  A failed hint is ignored: the
        consumers' poll picks the row up within one interval.
        """
        _check_kind(kind)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"work payload must be bytes, got {type(payload).__name__}")
        payload = bytes(payload)
        if len(payload) > WORK_PAYLOAD_MAX_BYTES:
            raise WorkPayloadTooLarge(
                f"work payload of {len(payload)} bytes exceeds the cap of "
                f"{WORK_PAYLOAD_MAX_BYTES} (1 MiB); store large inputs elsewhere and enqueue "
                "a reference")
        work_id = work_id or str(uuid.uuid4())
        await self.db.runOperation(*enqueue_statement(kind, payload, work_id))
        await self.wake(kind)
        return work_id

    async def wake(self, kind: str) -> None:
        """Publish the wake hint for ``kind`` (after a row was enqueued in a caller's own
        transaction with :func:`enqueue_statement`).  A failed hint is ignored."""
        if self.bus is not None:
            try:
                await self.bus.publish(WAKE_SUBJECT, {"kind": kind})
            except Exception as e:  # a hint only; the poll covers it
                log.debug("claims: wake hint for {kind} not published: {err}", kind=kind, err=e)

    async def claim_next(self, owner: str, kinds: Iterable[str]) -> Claim | None:
        """Claim the oldest ready row of one of ``kinds`` for ``owner``, or ``None``.

        Raises ``EmptyOwner`` for an empty owner and ``OwnerNotLive`` when ``owner`` is not a
        live instance (checked in the same statement as the claim).
        """
        claims = await self.claim_many(owner, kinds, 1)
        return claims[0] if claims else None

    async def claim_many(self, owner: str, kinds: Iterable[str], limit: int) -> list[Claim]:
        """Claim up to ``limit`` (at most ``MAX_BATCH``) of the oldest ready rows of ``kinds``
        for ``owner`` in one statement, oldest first; ``[]`` when none is ready.

        Raises ``EmptyOwner`` for an empty owner and ``OwnerNotLive`` when ``owner`` is not a
        live instance (decided in the same statement as the claim: a non-live owner claims
        nothing).
        """
        _check_owner(owner)
        kinds = [_check_kind(k) for k in kinds]
        if not kinds:
            raise InvalidKind("a claim needs at least one kind")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"claim limit must be a positive integer, got {limit!r}")
        rows = await self.db.runQuery(
            _CLAIM_SQL, (owner, self.liveness, kinds, min(limit, MAX_BATCH), owner))
        if not rows or not rows[0][0]:
            raise OwnerNotLive(owner)
        return [Claim(row_id, kind, bytes(payload), owner, attempts, failures)
                for _live, row_id, kind, payload, attempts, failures in rows
                if row_id is not None]

    async def complete(self, claim: Claim) -> bool:
        """Delete the row (the work is done, successfully or not).  False if no longer held."""
        (done,) = await self.complete_many([claim])
        return done

    async def complete_many(self, claims: Sequence[Claim]) -> list[bool]:
        """Complete several claims in one fenced statement (one commit per ``MAX_BATCH``).

        Each row is deleted only if it is still held by that claim's owner with that claim's
        attempts.  Returns one flag per claim, in order: False where the row was no longer
        held (nothing changed for it).
        """
        claims = list(claims)
        deleted: set[tuple[str, str, int]] = set()
        for start in range(0, len(claims), MAX_BATCH):
            chunk = claims[start:start + MAX_BATCH]
            rows = await self.db.runQuery(_COMPLETE_MANY_SQL, (
                [c.id for c in chunk], [c.owner for c in chunk], [c.attempts for c in chunk]))
            deleted.update((r[0], r[1], r[2]) for r in rows)
        return [self._fenced((c.id, c.owner, c.attempts) in deleted, "complete", c)
                for c in claims]

    async def release_transport_failure(self, claim: Claim) -> bool:
        """Release after a failure that says nothing about the work: attempts + 1 and
        ``not_before = now() + least(60, 2 * 2^least(attempts, 16))`` s (pre-increment
        attempts, DB clock).  False if no longer held."""
        rows = await self.db.runQuery(_RELEASE_SQL, (0, claim.id, claim.owner, claim.attempts))
        return self._fenced(bool(rows), "release", claim)

    async def release_work_failure(
            self, claim: Claim, max_failures: int = MAX_FAILURES,
            on_exhausted: Callable[[Claim], Any] | None = None) -> str:
        """Count a work failure.  Below ``max_failures`` the row is released with the same
        backoff as a transport failure (``RELEASED``).  At the limit, ``on_exhausted(claim)``
        records the work as failed and the row is deleted (``EXHAUSTED``); if recording fails,
        the row is released again.  ``LOST`` when the row is no longer held."""
        if claim.failures + 1 >= max_failures:
            recorded = True
            if on_exhausted is not None:
                try:
                    result = on_exhausted(claim)
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    log.failure("claims: recording exhausted work {id} failed; releasing again",
                                id=claim.id)
                    recorded = False
            if recorded:
                return EXHAUSTED if await self.complete(claim) else LOST
        rows = await self.db.runQuery(_RELEASE_SQL, (1, claim.id, claim.owner, claim.attempts))
        return RELEASED if self._fenced(bool(rows), "release-failed", claim) else LOST

    async def abandon(self, claim: Claim) -> bool:
        """Release without delay (this replica is stopping; nothing was learned)."""
        rows = await self.db.runQuery(_ABANDON_SQL, (claim.id, claim.owner, claim.attempts))
        return self._fenced(bool(rows), "abandon", claim)

    async def reap_abandoned(self) -> list[str]:
        """Release every claim whose holder is not a live instance: no age term, no delay.

        A live holder keeps its claim however long the work takes.  Returns the released ids.
        """
        rows = await self.db.runQuery(_REAP_SQL, (self.liveness,))
        if rows:
            log.info("claims: reaped {n} claims held by replicas that are not live", n=len(rows))
        return [r[0] for r in rows]

    async def owner_is_live(self, owner: str) -> bool:
        rows = await self.db.runQuery(
            f"SELECT count(*) FROM instances WHERE instances.id = %s AND {INSTANCE_IS_LIVE_SQL}",
            (owner, self.liveness))
        return rows[0][0] > 0

    async def release_held_by(self, owner: str) -> list[str]:
        """Release, without delay, every row held by ``owner`` (a previous process with the
        same id left them, or this replica is no longer live)."""
        _check_owner(owner)
        rows = await self.db.runQuery(_RELEASE_HELD_BY_SQL, (owner,))
        return [r[0] for r in rows]

    async def held_attempts(self, owner: str, ids: Sequence[str]) -> dict[str, int]:
        """``{id: attempts}`` for those of ``ids`` still held by ``owner``."""
        if not ids:
            return {}
        rows = await self.db.runQuery(
            "SELECT id, attempts FROM work_claims WHERE claimed_by = %s AND id = ANY(%s)",
            (owner, list(ids)))
        return dict(rows)

    @staticmethod
    def _fenced(applied: bool, what: str, claim: Claim) -> bool:
        if not applied:
            log.info("claims: {what} of {id} by {owner} (attempts {attempts}) found the row "
                     "not held by it; nothing changed", what=what, id=claim.id,
                     owner=claim.owner, attempts=claim.attempts)
        return applied


# -- the consumer service -------------------------------------------------------------------------------


class _Running:
    __slots__ = ("claim", "deferred", "cancel_reason", "finished")

    def __init__(self, claim: Claim):
        self.claim = claim
        self.deferred: defer.Deferred | None = None
        self.cancel_reason: str | None = None
        self.finished: defer.Deferred | None = None


def _call_handler(handler, claim) -> defer.Deferred:
    try:
        result = handler(claim)
    except Exception:
        return defer.fail()
    if isinstance(result, defer.Deferred):
        return result
    if inspect.isawaitable(result):
        return defer.ensureDeferred(result)
    return defer.succeed(result)


class ClaimConsumer(service.Service):
    """Claims work of some kinds for one replica and runs ``handler(claim)`` on each.

    Outcome of the handler (a value, Deferred or coroutine):
    - returns: the row is completed (deleted);
    - raises ``KeepClaim``: the row stays held;
    - raises one of ``transport_errors``: released with backoff, attempts + 1;
    - raises anything else: a work failure (``release_work_failure``);
    - cancelled because the claim was lost or the replica stopped being live: nothing settled.

    :param owner: this replica's instance id (``instances.id``).
    :param max_in_flight: handlers running at once (at least 1).
    """

    name = "claim-consumer"

    def __init__(self, queue: ClaimQueue, owner: str, kinds: Sequence[str],
                 handler: Callable[[Claim], Any | Awaitable[Any]], *,
                 bus: PgBus | None = None,
                 max_in_flight: int = 4,
                 poll_interval: float = CLAIM_POLL_INTERVAL,
                 max_failures: int = MAX_FAILURES,
                 on_exhausted: Callable[[Claim], Any] | None = None,
                 transport_errors: tuple[type[BaseException], ...] = DEFAULT_TRANSPORT_ERRORS,
                 settle_timeout: float = SETTLE_TIMEOUT,
                 reactor=None):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        self.queue = queue
        self.owner = _check_owner(owner)
        self.kinds = [_check_kind(k) for k in kinds]
        if not self.kinds:
            raise InvalidKind("a consumer needs at least one kind")
        self._handler = handler
        self._bus = bus
        self._max = max_in_flight
        self._interval = poll_interval
        self._max_failures = max_failures
        self._on_exhausted = on_exhausted
        self._transport_errors = transport_errors
        self._settle_timeout = settle_timeout
        self._reactor = reactor
        self._inflight: dict[str, _Running] = {}
        self._ticking = False
        self._again = False
        self._wake_call = None
        self._tick_d: defer.Deferred | None = None
        # Completes waiting for the next batch statement, and whether one is being written.
        self._completing: list[tuple[Claim, defer.Deferred]] = []
        self._complete_call = None
        self._completing_now = False
        self._last_checks = None
        #: True from the first statement a database outage failed until one succeeds: the
        #: outage is warned about once, not on every tick.
        self._database_away = False
        self._loop: task.LoopingCall | None = None
        self._wake_sub = None
        self._pending_settles: list[Callable[[], Awaitable[Any]]] = []
        self._started: defer.Deferred | None = None
        #: Counters for logs and tests.
        self.stats = {"claimed": 0, "completed": 0, "released": 0, "failed": 0, "kept": 0,
                      "lost": 0, "exhausted": 0, "claim_statements": 0,
                      "complete_statements": 0}

    @property
    def inFlight(self) -> int:
        return len(self._inflight)

    # -- lifecycle ----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._started = defer.ensureDeferred(self._start())
        self._started.addErrback(lambda f: log.failure("claim consumer failed to start", f))

    def whenStarted(self) -> defer.Deferred:
        """Fires once leftovers are released and the first poll is scheduled."""
        d = defer.Deferred()

        def fire(result):
            d.callback(None)
            return result

        self._started.addBoth(fire)
        return d

    async def _start(self) -> None:
        try:
            left = await self.queue.release_held_by(self.owner)
            if left:
                log.info("claims: released {n} rows left held by a previous {owner}",
                         n=len(left), owner=self.owner)
        except (DatabaseUnavailable, PoolClosed, psycopg2.Error) as e:
            log.warn("claims: could not release leftovers of {owner}: {err}",
                     owner=self.owner, err=e)
        if not self.running:
            return
        if self._bus is not None:
            try:
                subscription = await self._bus.subscribe(WAKE_SUBJECT, self._on_wake)
            except Exception as e:
                if not self.running:
                    return  # stopped while subscribing: a normal stop, nothing to report
                log.warn("claims: no wake hints (polling only): {err}", err=e)
            else:
                if not self.running:
                    subscription.unsubscribe()  # landed after the stop: undo it
                    return
                self._wake_sub = subscription
        if not self.running:
            return
        self._loop = task.LoopingCall(self.wake)
        self._loop.clock = self._reactor
        self._loop.start(self._interval, now=True)

    def stopService(self):
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        if self._wake_sub is not None:
            self._wake_sub.unsubscribe()
            self._wake_sub = None
        if self._wake_call is not None and self._wake_call.active():
            self._wake_call.cancel()
        self._wake_call = None
        waits = []
        for run in list(self._inflight.values()):
            waits.append(self._cancel(run, "stopping"))
        # A claim statement already sent is waited for too: rows it returns after the stop are
        # released at once (see _fill), not left held until this replica stops being live.
        waits.append(self._tick_d)
        d = defer.DeferredList([w for w in waits if w is not None], consumeErrors=True)
        return wait_at_most(self._reactor, d, self._settle_timeout,
                            "a claim settle").addErrback(lambda _: None)

    # -- ticks --------------------------------------------------------------------------------

    def _on_wake(self, subject: str, payload: Any) -> None:
        if isinstance(payload, dict) and payload.get("kind") in self.kinds:
            self.wake()

    def wake(self) -> None:
        """Run a tick soon: at the end of this reactor turn, so every slot freed in the same
        turn (a batch of completes answering together) is refilled by one claim statement.
        Coalesced with a tick already running or scheduled."""
        if not self.running:
            return
        if self._ticking:
            self._again = True
            return
        if self._wake_call is None:
            self._wake_call = self._reactor.callLater(0, self._run_tick)

    def _run_tick(self) -> None:
        self._wake_call = None
        if not self.running:
            return
        if self._ticking:
            self._again = True
            return
        self._ticking = True
        self._tick_d = defer.ensureDeferred(self._tick()).addErrback(
            lambda f: log.failure("claims: tick failed", f))

    async def _tick(self) -> None:
        try:
            while self.running:
                self._again = False
                await self._checks()
                await self._fill()
                if not self._again:
                    return
        finally:
            self._ticking = False

    async def _checks(self) -> None:
        """Shared per-tick checks, at most once per half poll interval."""
        now = self._reactor.seconds()  # rate limiting only; no liveness decision uses it
        if self._last_checks is not None and now - self._last_checks < self._interval / 2:
            return
        self._last_checks = now
        try:
            if not await self.queue.owner_is_live(self.owner):
                await self._not_live()
                return
            if self._inflight:
                held = await self.queue.held_attempts(self.owner, list(self._inflight))
                for run in list(self._inflight.values()):
                    if held.get(run.claim.id) != run.claim.attempts:
                        self._cancel(run, "lost")
            await self.queue.reap_abandoned()
            pending, self._pending_settles = self._pending_settles, []
            if pending:
                # Fenced, independent writes: issued together, so retried completes share a
                # batch statement.
                await defer.DeferredList(
                    [defer.ensureDeferred(self._settle(settle)) for settle in pending],
                    consumeErrors=True)
        except (DatabaseUnavailable, PoolClosed, psycopg2.Error) as e:
            self._database_failed("per-tick checks", e)
        else:
            self._database_answered()

    def _database_failed(self, what: str, e: Exception) -> None:
        """A statement failed: an outage (the pool's ``DatabaseUnavailable``/``PoolClosed``) is
        warned about once until a statement succeeds again; any other error every time."""
        if not isinstance(e, (DatabaseUnavailable, PoolClosed)):
            log.warn("claims ({kinds}): {what} failed: {err}", kinds=self._label, what=what,
                     err=e)
        elif not self._database_away:
            self._database_away = True
            log.warn("claims ({kinds}): {what} failed: {err}; no claims until the database "
                     "answers (not logged again meanwhile)", kinds=self._label, what=what,
                     err=e)

    @property
    def _label(self) -> str:
        """The consumer a line is about (a replica runs one per work kind group)."""
        return ", ".join(self.kinds)

    def _database_answered(self) -> None:
        if self._database_away:
            self._database_away = False
            log.info("claims ({kinds}): the database answers again; claiming",
                     kinds=self._label)

    async def _not_live(self) -> None:
        if self._inflight:
            log.warn("claims: {owner} is not live; cancelling {n} running handlers",
                     owner=self.owner, n=len(self._inflight))
        for run in list(self._inflight.values()):
            self._cancel(run, "not-live")
        # A live id's rows are never reaped; ours are released here (others may reap them too).
        await self.queue.release_held_by(self.owner)

    async def _fill(self) -> None:
        """Fill every free slot, one claim statement for all of them."""
        while self.running:
            # Only this loop adds to _inflight (one tick at a time), so asking for the slots
            # free now can never run more than max_in_flight handlers.
            free = min(self._max - len(self._inflight), MAX_BATCH)
            if free <= 0:
                return
            try:
                self.stats["claim_statements"] += 1
                claims = await self.queue.claim_many(self.owner, self.kinds, free)
            except OwnerNotLive:
                await self._not_live()
                return
            except (DatabaseUnavailable, PoolClosed, psycopg2.Error) as e:
                self._database_failed("claim", e)
                return
            if not self.running:
                # Stopped while the claim was in the air: hand the rows straight back.
                await defer.DeferredList(
                    [defer.ensureDeferred(self._settle(lambda c=c: self.queue.abandon(c)))
                     for c in claims], consumeErrors=True)
                return
            for claim in claims:
                self.stats["claimed"] += 1
                self._start_handler(claim)
            if len(claims) < free:
                return  # nothing more is ready

    # -- running a handler ----------------------------------------------------------------------

    def _start_handler(self, claim: Claim) -> None:
        run = _Running(claim)
        self._inflight[claim.id] = run
        run.deferred = _call_handler(self._handler, claim)
        run.finished = defer.ensureDeferred(self._finish(run)).addErrback(
            lambda f: log.failure("claims: settling {id} failed", f, id=claim.id))

    def _cancel(self, run: _Running, reason: str) -> defer.Deferred | None:
        if run.cancel_reason is None:
            run.cancel_reason = reason
            if run.deferred is not None and not run.deferred.called:
                run.deferred.cancel()
        return run.finished

    async def _finish(self, run: _Running) -> None:
        claim = run.claim
        try:
            try:
                await run.deferred
            except defer.CancelledError:
                if run.cancel_reason in ("lost", "not-live"):
                    self.stats["lost"] += 1
                    return  # the row is not ours any more, or will be reaped
                if run.cancel_reason == "stopping":
                    await self._settle(lambda: self.queue.abandon(claim))
                    return
                self.stats["released"] += 1  # cancelled by someone else: nothing learned
                await self._settle(lambda: self.queue.release_transport_failure(claim))
            except KeepClaim:
                self.stats["kept"] += 1
            except self._transport_errors as e:
                log.info("claims: {id} hit a transport failure, releasing with backoff: {err}",
                         id=claim.id, err=e)
                self.stats["released"] += 1
                await self._settle(lambda: self.queue.release_transport_failure(claim))
            except Exception:
                log.failure("claims: handler for {id} ({kind}) failed", id=claim.id,
                            kind=claim.kind)
                self.stats["failed"] += 1
                outcome = await self._settle(lambda: self.queue.release_work_failure(
                    claim, self._max_failures, self._on_exhausted))
                if outcome == EXHAUSTED:
                    self.stats["exhausted"] += 1
            else:
                if run.cancel_reason in ("lost", "not-live"):
                    return
                if await self._settle(lambda: self._complete(claim)):
                    self.stats["completed"] += 1
        finally:
            self._inflight.pop(claim.id, None)
            if self.running:
                self.wake()

    async def _settle(self, write: Callable[[], Awaitable[Any]]):
        """Run a fenced settle write, bounded in time; on failure keep it for a later tick
        (fenced writes are safe to repeat)."""
        try:
            return await wait_at_most(self._reactor, defer.ensureDeferred(write()),
                                      self._settle_timeout, "a claim settle")
        except (DatabaseUnavailable, PoolClosed, psycopg2.Error, defer.TimeoutError) as e:
            log.warn("claims: settle write failed, will retry: {err}", err=e)
            if len(self._pending_settles) < 10_000 and self.running:
                self._pending_settles.append(write)
            return None

    # -- batched completes ------------------------------------------------------------------------

    def _complete(self, claim: Claim) -> defer.Deferred:
        """Complete ``claim`` in the next batch statement; fires with the fenced outcome.

        Completes that arrive in the same reactor turn, or while a batch is being written, go
        out together in one ``DELETE`` (one commit), each row still fenced by its own holder
        and attempts.
        """
        d = defer.Deferred()
        self._completing.append((claim, d))
        self._schedule_completes()
        return d

    def _schedule_completes(self) -> None:
        if self._completing and not self._completing_now and self._complete_call is None:
            self._complete_call = self._reactor.callLater(0, self._write_completes)

    def _write_completes(self) -> None:
        self._complete_call = None
        batch = self._completing[:MAX_BATCH]
        del self._completing[:MAX_BATCH]
        if not batch:
            return
        self._completing_now = True
        self.stats["complete_statements"] += 1
        # Bounded like any settle: a statement that does not answer stops holding up the
        # batches behind it (its waiters fail with TimeoutError and retry on a later tick).
        written = wait_at_most(
            self._reactor, defer.ensureDeferred(self.queue.complete_many([c for c, _ in batch])),
            self._settle_timeout, "a batch of claim completions")

        def answered(result):
            self._completing_now = False
            self._schedule_completes()
            if isinstance(result, Failure):
                for _, d in batch:
                    d.errback(result)
            else:
                for (_, d), done in zip(batch, result):
                    d.callback(done)

        written.addBoth(answered).addErrback(
            lambda f: log.failure("claims: delivering complete outcomes failed", f))
