"""The claim queue against a real PostgreSQL: fencing, backoff on the DB clock, reaping by
liveness, and many consumers on separate pools draining one queue."""

from __future__ import annotations

import collections

import pytest
import pytest_twisted
from twisted.internet import defer

from localai_tw.bus.claims import (
    EXHAUSTED,
    LOST,
    RELEASED,
    ClaimConsumer,
    ClaimQueue,
    EmptyOwner,
    KeepClaim,
    OwnerNotLive,
    WorkPayloadTooLarge,
)
from localai_tw.bus.pgbus import PgBus
from localai_tw.db.pool import Database
from localai_tw.errors import TransportFailure

from .harness_claims import make_live, make_stale, row
from .support import eventually, sleep, within


@pytest_twisted.ensureDeferred
async def test_empty_owner_is_refused(db):
    q = ClaimQueue(db)
    await q.enqueue("task", b"{}")
    with pytest.raises(EmptyOwner):
        await q.claim_next("", ["task"])
    with pytest.raises(EmptyOwner):
        ClaimConsumer(q, "", ["task"], lambda c: None)
    assert (await db.runQuery("SELECT claimed_by FROM work_claims")) == [("",)]


@pytest_twisted.ensureDeferred
async def test_a_replica_that_is_not_live_cannot_claim(db):
    q = ClaimQueue(db)
    work = await q.enqueue("task", b"x")
    with pytest.raises(OwnerNotLive):
        await q.claim_next("never-registered", ["task"])
    await make_live(db, "r-stale")
    await make_stale(db, "r-stale")
    with pytest.raises(OwnerNotLive):
        await q.claim_next("r-stale", ["task"])
    assert (await row(db, work))[:3] == ("", False, 0)
    await make_live(db, "r-stale")
    claim = await q.claim_next("r-stale", ["task"])
    assert claim.id == work and claim.payload == b"x" and claim.attempts == 0


@pytest_twisted.ensureDeferred
async def test_claims_oldest_first_and_only_the_asked_kinds(db):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    a = await q.enqueue("task", b"a")
    other = await q.enqueue("agent-run", b"o")
    b = await q.enqueue("task", b"b")
    assert (await q.claim_next("r1", ["task"])).id == a
    assert (await q.claim_next("r1", ["task"])).id == b
    assert await q.claim_next("r1", ["task"]) is None
    assert (await q.claim_next("r1", ["mcp-ci", "agent-run"])).id == other


@pytest_twisted.ensureDeferred
async def test_work_payload_over_1_mib_is_refused(db):
    q = ClaimQueue(db)
    with pytest.raises(WorkPayloadTooLarge, match="1 MiB"):
        await q.enqueue("task", b"x" * (1024 * 1024 + 1))
    await q.enqueue("task", b"x" * (1024 * 1024))


@pytest_twisted.ensureDeferred
async def test_transport_backoff_doubles_from_2s_to_a_60s_cap_on_the_db_clock(db):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    work = await q.enqueue("task", b"")
    expected = [2, 4, 8, 16, 32, 60, 60, 60]
    seen = []
    for attempts, wait in enumerate(expected):
        claim = await q.claim_next("r1", ["task"])
        assert claim is not None and claim.attempts == attempts
        assert await q.release_transport_failure(claim)
        claimed_by, held, now_attempts, failures, delay = await row(db, work)
        assert (claimed_by, held, now_attempts, failures) == ("", False, attempts + 1, 0)
        seen.append(delay)
        # not_before - now() read from the database, a moment after the release
        assert wait - 1.0 < delay <= wait, (attempts, delay)
        # not claimable before not_before...
        assert await q.claim_next("r1", ["task"]) is None
        # ...so move only not_before (attempts stay as the queue left them)
        await db.runOperation("UPDATE work_claims SET not_before = now() WHERE id = %s",
                              (work,))
    # the exponent is clamped, so a huge attempts count cannot overflow
    await db.runOperation("UPDATE work_claims SET attempts = 100000 WHERE id = %s", (work,))
    claim = await q.claim_next("r1", ["task"])
    assert await q.release_transport_failure(claim)
    assert 59.0 < (await row(db, work))[4] <= 60
    assert len(seen) == len(expected)


@pytest_twisted.ensureDeferred
async def test_a_slow_but_live_holder_keeps_its_claim(db):
    q = ClaimQueue(db)
    await make_live(db, "slow")
    work = await q.enqueue("task", b"")
    claim = await q.claim_next("slow", ["task"])
    # However old the claim, a live holder is never reaped: there is no age term.
    await db.runOperation(
        "UPDATE work_claims SET claimed_at = now() - interval '3 days' WHERE id = %s", (work,))
    assert await q.reap_abandoned() == []
    assert (await row(db, work))[:3] == ("slow", True, 0)
    assert await q.complete(claim)


@pytest.mark.parametrize("how", ["stale", "deleted"])
@pytest_twisted.ensureDeferred
async def test_a_dead_replicas_claim_is_reaped_at_once_and_its_late_settles_change_nothing(
        db, how):
    q = ClaimQueue(db)
    await make_live(db, "dead", "alive")
    work = await q.enqueue("task", b"p")
    old = await q.claim_next("dead", ["task"])
    if how == "stale":
        await make_stale(db, "dead")
    else:
        await db.runOperation("DELETE FROM instances WHERE id = 'dead'")
    # Claimed a moment ago, yet reaped at once: liveness alone decides.
    assert await q.reap_abandoned() == [work]
    claimed_by, held, attempts, _, not_before = await row(db, work)
    assert (claimed_by, held, attempts, not_before) == ("", False, 1, None)
    new = await q.claim_next("alive", ["task"])  # no delay after a reap
    assert new.id == work and new.attempts == 1

    # The reaped holder answers late: every settle is fenced out.
    assert not await q.complete(old)
    assert not await q.release_transport_failure(old)
    assert await q.release_work_failure(old) == LOST
    assert not await q.abandon(old)
    assert (await row(db, work))[:4] == ("alive", True, 1, 0)
    assert await q.complete(new)
    assert await row(db, work) is None


@pytest_twisted.ensureDeferred
async def test_a_settle_from_an_earlier_tenure_of_the_same_replica_is_fenced_out(db):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    work = await q.enqueue("task", b"")
    earlier = await q.claim_next("r1", ["task"])
    await make_stale(db, "r1")  # r1 stalled past the liveness window...
    assert await q.reap_abandoned() == [work]
    await make_live(db, "r1")  # ...came back and claimed the same row again
    later = await q.claim_next("r1", ["task"])
    assert (later.id, later.attempts) == (work, 1)
    # Same holder id, older attempts count: the earlier tenure's answer changes nothing.
    assert not await q.complete(earlier)
    assert not await q.release_transport_failure(earlier)
    assert await q.release_work_failure(earlier) == LOST
    assert (await row(db, work))[:4] == ("r1", True, 1, 0)
    assert await q.complete(later)


@pytest_twisted.ensureDeferred
async def test_work_failures_count_then_exhaust(db):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    work = await q.enqueue("task", b"")
    claim = await q.claim_next("r1", ["task"])
    assert await q.release_work_failure(claim, max_failures=3) == RELEASED
    assert (await row(db, work))[2:4] == (1, 1)
    await db.runOperation("UPDATE work_claims SET not_before = NULL")
    claim = await q.claim_next("r1", ["task"])
    assert claim.failures == 1
    assert await q.release_work_failure(claim, max_failures=3) == RELEASED
    await db.runOperation("UPDATE work_claims SET not_before = NULL")
    claim = await q.claim_next("r1", ["task"])

    recorded = []

    def refuse(c):
        raise RuntimeError("the job store is down")

    # recording the failure fails: released again rather than lost
    assert await q.release_work_failure(claim, max_failures=3, on_exhausted=refuse) == RELEASED
    await db.runOperation("UPDATE work_claims SET not_before = NULL")
    claim = await q.claim_next("r1", ["task"])
    assert await q.release_work_failure(claim, max_failures=3,
                                        on_exhausted=recorded.append) == EXHAUSTED
    assert recorded == [claim]
    assert await row(db, work) is None


# -- the consumer ----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_consumer_settles_by_outcome(db, consumers):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    ok = await q.enqueue("task", b"ok")
    transport = await q.enqueue("task", b"transport")
    work_fail = await q.enqueue("task", b"fail")
    keep = await q.enqueue("task", b"keep")
    exhaust = await q.enqueue("task", b"exhaust")
    await db.runOperation("UPDATE work_claims SET failures = 9 WHERE id = %s", (exhaust,))
    exhausted = []

    async def handler(claim):
        await sleep(0)
        if claim.payload == b"transport":
            raise TransportFailure("the tunnel reset under a live copy")
        if claim.payload in (b"fail", b"exhaust"):
            raise ValueError("the worker said no")
        if claim.payload == b"keep":
            raise KeepClaim()
        return "done"

    c = consumers(q, "r1", ["task"], handler, poll_interval=0.2,
                  on_exhausted=exhausted.append)
    await eventually(lambda: c.stats["claimed"] == 5 and c.inFlight == 0, what="five outcomes")
    assert await row(db, ok) is None
    claimed_by, held, attempts, failures, delay = await row(db, transport)
    assert (claimed_by, held, attempts, failures) == ("", False, 1, 0) and 1 < delay <= 2
    assert (await row(db, work_fail))[:4] == ("", False, 1, 1)
    assert (await row(db, keep))[:3] == ("r1", True, 0)
    assert await row(db, exhaust) is None
    assert [c.payload for c in exhausted] == [b"exhaust"]


@pytest_twisted.ensureDeferred
async def test_consumer_releases_its_own_leftovers_at_start(db, consumers):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    work = await q.enqueue("task", b"")
    await q.claim_next("r1", ["task"])  # a previous process with the same id held it
    done = []
    c = consumers(q, "r1", ["task"], done.append, poll_interval=0.2)
    await c.whenStarted()
    await eventually(lambda: done, what="the leftover to run again")
    assert done[0].id == work and done[0].attempts == 1


@pytest_twisted.ensureDeferred
async def test_consumer_cancels_a_handler_whose_claim_was_lost(db, consumers):
    q = ClaimQueue(db)
    await make_live(db, "r1", "r2")
    work = await q.enqueue("task", b"")
    cancelled = defer.Deferred()
    running = defer.Deferred()

    def handler(claim):
        running.callback(claim)
        return defer.Deferred(lambda d: cancelled.callback(claim))

    c = consumers(q, "r1", ["task"], handler, poll_interval=0.2)
    claim = await running
    # Taken away behind its back (as a reap during a stall would): the row moves on.
    await db.runOperation("UPDATE work_claims SET claimed_by = 'r2', attempts = attempts + 1"
                          " WHERE id = %s", (work,))
    assert (await within(cancelled, 3)).id == claim.id
    await eventually(lambda: c.inFlight == 0, what="the handler to end")
    assert (await row(db, work))[:3] == ("r2", True, 1)  # nothing settled by the loser
    assert c.stats["lost"] == 1


@pytest_twisted.ensureDeferred
async def test_consumer_of_a_replica_that_stops_being_live_cancels_and_releases(db, consumers):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    work = await q.enqueue("task", b"")
    cancelled = defer.Deferred()
    running = defer.Deferred()

    def handler(claim):
        running.callback(claim)
        return defer.Deferred(lambda d: cancelled.callback(claim))

    c = consumers(q, "r1", ["task"], handler, poll_interval=0.2)
    await running
    await make_stale(db, "r1")
    await within(cancelled, 3)
    await eventually(lambda: c.inFlight == 0, what="the handler to end")
    assert (await row(db, work))[:3] == ("", False, 1)


@pytest_twisted.ensureDeferred
async def test_wake_hint_picks_up_work_before_the_poll(db, consumers):
    bus = PgBus(db)
    bus.startService()
    try:
        await bus.whenConnected()
        q = ClaimQueue(db, bus=bus)
        await make_live(db, "r1")
        done = []
        c = consumers(q, "r1", ["agent-run"], done.append, bus=bus, poll_interval=30)
        await c.whenStarted()
        await eventually(lambda: c._wake_sub is not None, what="the wake subscription")
        await sleep(0.1)  # the first (immediate) poll has run and found nothing
        await q.enqueue("agent-run", b"now")
        await eventually(lambda: done, timeout=3, what="the hinted pickup (poll is 30 s)")
        assert done[0].payload == b"now"
    finally:
        await bus.stopService()


@pytest_twisted.ensureDeferred
async def test_eight_consumers_on_separate_pools_drain_2000_jobs_exactly_once(db, pg_dsn):
    total = 2000
    q0 = ClaimQueue(db)
    await db.runOperation(
        "INSERT INTO work_claims (id, kind, payload)"
        " SELECT 'job-' || lpad(g::text, 5, '0'), 'task', convert_to(g::text, 'UTF8')"
        " FROM generate_series(1, %s) g", (total,))
    owners = [f"replica-{i}" for i in range(8)]
    await make_live(db, *owners)

    in_flight: set[str] = set()
    doubles: list[str] = []
    done = collections.Counter()
    by_owner = collections.Counter()
    peak = [0]

    def handler_for(owner):
        async def handler(claim):
            if claim.id in in_flight:
                doubles.append(claim.id)
            in_flight.add(claim.id)
            peak[0] = max(peak[0], len(in_flight))
            try:
                await sleep(0)
            finally:
                in_flight.discard(claim.id)
            done[claim.id] += 1
            by_owner[owner] += 1
        return handler

    pools, consumers_ = [], []
    try:
        for owner in owners:
            pool = Database(pg_dsn, size=2)
            await pool.start()
            pools.append(pool)
            c = ClaimConsumer(ClaimQueue(pool), owner, ["task"], handler_for(owner),
                              max_in_flight=4, poll_interval=0.5)
            consumers_.append(c)
        for c in consumers_:
            c.startService()

        async def drained():
            return (await db.runQuery("SELECT count(*) FROM work_claims"))[0][0] == 0

        await eventually(drained, timeout=45, what="the queue to drain")
    finally:
        for c in consumers_:
            await c.stopService()
        for pool in pools:
            pool.close()

    assert doubles == [], "a job was claimed twice at the same time"
    assert len(done) == total, "a job was lost"
    assert set(done.values()) == {1}, "a job ran twice although nothing failed"
    assert peak[0] > 1
    assert len(by_owner) >= 2, by_owner
    assert await q0.reap_abandoned() == []
