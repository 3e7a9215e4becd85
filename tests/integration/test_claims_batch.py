"""The batch paths of the claim queue against a real PostgreSQL: one statement claims the free
slots, one fenced statement completes a batch, and the consumer coalesces both without giving
up a guarantee (no row to two holders, fencing per row, the in-flight bound, nothing left held
after a stop)."""

from __future__ import annotations

import collections

import pytest
import pytest_twisted
from twisted.internet import defer

from localai_tw.bus.claims import (
    MAX_BATCH,
    Claim,
    ClaimConsumer,
    ClaimQueue,
    EmptyOwner,
    OwnerNotLive,
)
from localai_tw.db.pool import Database, DatabaseUnavailable

from .support import eventually, sleep
from .harness_claims import make_live, make_stale, row


async def insert_jobs(db, total: int, kind: str = "task", prefix: str = "job-") -> list[str]:
    await db.runOperation(
        "INSERT INTO work_claims (id, kind, payload, created_at)"
        " SELECT %s || lpad(g::text, 5, '0'), %s, convert_to(g::text, 'UTF8'),"
        "        now() + make_interval(secs => g / 1000.0)"
        " FROM generate_series(1, %s) g", (prefix, kind, total))
    return [f"{prefix}{g:05d}" for g in range(1, total + 1)]


# -- claim_many -----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_claim_many_takes_up_to_the_limit_oldest_first_and_only_ready_rows(db):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    ids = await insert_jobs(db, 10)
    await insert_jobs(db, 3, kind="agent-run", prefix="other-")
    # not ready yet: backoff on the database clock
    await db.runOperation("UPDATE work_claims SET not_before = now() + interval '1 hour'"
                          " WHERE id = %s", (ids[1],))
    first = await q.claim_many("r1", ["task"], 4)
    assert [c.id for c in first] == [ids[0], ids[2], ids[3], ids[4]]
    assert all(c.owner == "r1" and c.attempts == 0 for c in first)
    assert [c.payload for c in first] == [b"1", b"3", b"4", b"5"]
    for c in first:
        assert (await row(db, c.id))[:3] == ("r1", True, 0)
    rest = await q.claim_many("r1", ["task"], 100)
    assert [c.id for c in rest] == ids[5:]          # fewer than asked: that is all there is
    assert await q.claim_many("r1", ["task"], 4) == []
    assert (await row(db, ids[1]))[:2] == ("", False)


@pytest_twisted.ensureDeferred
async def test_claim_many_by_a_non_live_owner_claims_nothing(db):
    q = ClaimQueue(db)
    ids = await insert_jobs(db, 5)
    with pytest.raises(OwnerNotLive):
        await q.claim_many("never-registered", ["task"], 5)
    await make_live(db, "r-stale")
    await make_stale(db, "r-stale")
    with pytest.raises(OwnerNotLive):
        await q.claim_many("r-stale", ["task"], 5)
    assert (await db.runQuery(
        "SELECT count(*) FROM work_claims WHERE claimed_at IS NOT NULL"))[0][0] == 0
    with pytest.raises(EmptyOwner):
        await q.claim_many("", ["task"], 5)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError):
            await q.claim_many("r-stale", ["task"], bad)
    await make_live(db, "r-stale")
    assert [c.id for c in await q.claim_many("r-stale", ["task"], 5)] == ids


@pytest_twisted.ensureDeferred
async def test_claim_many_is_capped_at_max_batch(db):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    await insert_jobs(db, MAX_BATCH + 10)
    assert len(await q.claim_many("r1", ["task"], MAX_BATCH + 10)) == MAX_BATCH


@pytest_twisted.ensureDeferred
async def test_batch_claims_of_8_claimers_on_separate_pools_never_share_a_row(db, pg_dsn):
    """8 claimers, each on its own pool (own connections), race through 2000 rows with batch
    claims of different sizes and nothing completed: every row is claimed once, by one."""
    total = 2000
    ids = await insert_jobs(db, total)
    owners = [f"claimer-{i}" for i in range(8)]
    await make_live(db, *owners)
    got: dict[str, list[Claim]] = {o: [] for o in owners}
    oversized = []

    async def claimer(pool, owner, limit):
        q = ClaimQueue(pool)
        while True:
            claims = await q.claim_many(owner, ["task"], limit)
            if len(claims) > limit:
                oversized.append((owner, len(claims)))
            if not claims:
                return
            got[owner].extend(claims)

    pools = []
    try:
        for _ in owners:
            pool = Database(pg_dsn, size=2)
            await pool.start()
            pools.append(pool)
        # two racers per pool connection, so each claimer also races itself
        await defer.gatherResults([
            defer.ensureDeferred(claimer(pool, owner, limit))
            for pool, owner, limit in zip(pools, owners, (1, 2, 3, 4, 5, 8, 13, 16))
            for _ in range(2)], consumeErrors=True)
    finally:
        for pool in pools:
            pool.close()

    assert oversized == []
    handed = collections.Counter(c.id for claims in got.values() for c in claims)
    assert [i for i, n in handed.items() if n > 1] == [], "a row was handed to two claimers"
    assert sorted(handed) == ids, "a row was never claimed"
    held = dict(await db.runQuery("SELECT id, claimed_by FROM work_claims"
                                  " WHERE claimed_at IS NOT NULL"))
    assert held == {c.id: owner for owner, claims in got.items() for c in claims}
    assert sum(1 for claims in got.values() if claims) >= 2


# -- complete_many ----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_stale_holders_batch_complete_deletes_nothing_of_a_reclaimed_row(db):
    q = ClaimQueue(db)
    await make_live(db, "dead", "alive")
    ids = await insert_jobs(db, 4)
    old = await q.claim_many("dead", ["task"], 3)
    await make_stale(db, "dead")
    assert sorted(await q.reap_abandoned()) == ids[:3]
    new = await q.claim_many("alive", ["task"], 4)
    assert [(c.id, c.attempts) for c in new] == [(i, 1) for i in ids[:3]] + [(ids[3], 0)]

    # the stale holder's whole batch is fenced out, row by row
    assert await q.complete_many(old) == [False, False, False]
    for i in ids[:3]:
        assert (await row(db, i))[:3] == ("alive", True, 1)
    # a mixed batch: only the tenure that still holds its row is completed
    assert await q.complete_many([old[0], new[0], old[1]]) == [False, True, False]
    assert await row(db, ids[0]) is None
    assert (await row(db, ids[1]))[:3] == ("alive", True, 1)
    assert await q.complete_many(new[1:]) == [True, True, True]
    assert (await db.runQuery("SELECT count(*) FROM work_claims"))[0][0] == 0
    assert await q.complete_many([]) == []


@pytest_twisted.ensureDeferred
async def test_a_batch_complete_from_an_earlier_tenure_of_the_same_replica_is_fenced_out(db):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    ids = await insert_jobs(db, 2)
    earlier = await q.claim_many("r1", ["task"], 2)
    await make_stale(db, "r1")
    assert sorted(await q.reap_abandoned()) == ids
    await make_live(db, "r1")
    later = await q.claim_many("r1", ["task"], 2)
    assert [(c.id, c.owner, c.attempts) for c in later] == [(i, "r1", 1) for i in ids]
    # same holder, same ids, older attempts: nothing is deleted
    assert await q.complete_many(earlier) == [False, False]
    assert [(await row(db, i))[:3] for i in ids] == [("r1", True, 1)] * 2
    assert await q.complete_many(later) == [True, True]


@pytest_twisted.ensureDeferred
async def test_a_batch_complete_checks_id_holder_and_attempts_each(db):
    """Every column of the fence counts on its own: the row of another holder with the same
    attempts, or of the same holder with other attempts, is not deleted."""
    q = ClaimQueue(db)
    await make_live(db, "a", "b")
    ids = await insert_jobs(db, 3)
    claims = await q.claim_many("a", ["task"], 3)
    # moved behind the queue's back: another holder, attempts unchanged
    await db.runOperation("UPDATE work_claims SET claimed_by = 'b' WHERE id = %s", (ids[0],))
    # same holder, attempts changed
    await db.runOperation("UPDATE work_claims SET attempts = 7 WHERE id = %s", (ids[1],))
    assert await q.complete_many(claims) == [False, False, True]
    assert (await row(db, ids[0]))[:3] == ("b", True, 0)
    assert (await row(db, ids[1]))[:3] == ("a", True, 7)
    assert await row(db, ids[2]) is None


@pytest_twisted.ensureDeferred
async def test_complete_many_splits_batches_larger_than_max_batch(db):
    q = ClaimQueue(db)
    await make_live(db, "r1")
    await insert_jobs(db, MAX_BATCH + 5)
    claims = (await q.claim_many("r1", ["task"], MAX_BATCH)
              + await q.claim_many("r1", ["task"], MAX_BATCH))
    assert len(claims) == MAX_BATCH + 5
    assert await q.complete_many(claims) == [True] * (MAX_BATCH + 5)
    assert (await db.runQuery("SELECT count(*) FROM work_claims"))[0][0] == 0


# -- the consumer's batch paths ---------------------------------------------------------------------


class RecordingQueue(ClaimQueue):
    """Notes every claim statement's limit against the handlers running when it was sent, and
    can fail complete statements on demand."""

    def __init__(self, db, consumer_ref):
        super().__init__(db)
        self.consumer_ref = consumer_ref
        self.asked: list[tuple[int, int, int]] = []   # (in flight, limit, rows returned)
        self.complete_sizes: list[int] = []
        self.fail_completes = 0
        self.hang_completes = 0

    async def claim_many(self, owner, kinds, limit):
        running = self.consumer_ref[0].inFlight
        claims = await super().claim_many(owner, kinds, limit)
        self.asked.append((running, limit, len(claims)))
        return claims

    async def complete_many(self, claims):
        if self.fail_completes:
            self.fail_completes -= 1
            raise DatabaseUnavailable("database connection lost (injected)")
        if self.hang_completes:
            self.hang_completes -= 1
            await defer.Deferred()   # a statement that never answers (half-open connection)
        self.complete_sizes.append(len(claims))
        return await super().complete_many(claims)


@pytest_twisted.ensureDeferred
async def test_consumer_claims_its_free_slots_in_one_statement_and_completes_in_batches(
        db, consumers):
    total, bound = 300, 8
    await insert_jobs(db, total)
    await make_live(db, "r1")
    ref = [None]
    q = RecordingQueue(db, ref)
    running = set()
    peak = [0]
    done = collections.Counter()

    async def handler(claim):
        running.add(claim.id)
        peak[0] = max(peak[0], len(running))
        # uneven durations, so slots free a few at a time and claims ask for a few
        await sleep((int(claim.payload) % 4) * 0.003)
        running.discard(claim.id)
        done[claim.id] += 1

    c = ref[0] = consumers(q, "r1", ["task"], handler, max_in_flight=bound, poll_interval=0.5)
    await eventually(lambda: c.stats["completed"] == total, timeout=30, what="the drain")
    assert set(done.values()) == {1} and len(done) == total
    assert peak[0] <= bound
    # every claim asked for exactly the slots free when it was sent, never more
    assert all(running + limit == bound for running, limit, _ in q.asked), q.asked
    assert all(got <= limit for _, limit, got in q.asked)
    assert any(limit < bound for _, limit, _ in q.asked), "slots never freed unevenly"
    # batching happened both ways, even with slots freeing unevenly
    assert c.stats["claim_statements"] < total, c.stats
    assert c.stats["complete_statements"] < total, c.stats
    assert max(got for _, _, got in q.asked) > 1
    assert max(q.complete_sizes) > 1 and sum(q.complete_sizes) == total


@pytest_twisted.ensureDeferred
async def test_handlers_that_finish_together_cost_one_claim_and_one_complete_per_batch(
        db, consumers):
    total, bound = 400, 8
    await insert_jobs(db, total)
    await make_live(db, "r1")
    ref = [None]
    q = RecordingQueue(db, ref)
    c = ref[0] = consumers(q, "r1", ["task"], lambda claim: None, max_in_flight=bound,
                           poll_interval=0.5)
    await eventually(lambda: c.stats["completed"] == total, timeout=30, what="the drain")
    # the freed slots of one batch are refilled by one statement: about total / bound each
    # (a little slack for the first, partial and empty claims)
    assert c.stats["claim_statements"] <= total / bound + 5, c.stats
    assert c.stats["complete_statements"] <= total / bound + 5, c.stats


@pytest_twisted.ensureDeferred
async def test_a_failed_batch_complete_is_retried_and_nothing_runs_twice(db, consumers):
    total = 12
    await insert_jobs(db, total)
    await make_live(db, "r1")
    ref = [None]
    q = RecordingQueue(db, ref)
    q.fail_completes = 1   # the first batch statement fails as if the connection died
    done = collections.Counter()

    def handler(claim):
        done[claim.id] += 1

    c = ref[0] = consumers(q, "r1", ["task"], handler, max_in_flight=4, poll_interval=0.2)
    async def drained():
        return (await db.runQuery("SELECT count(*) FROM work_claims"))[0][0] == 0

    await eventually(drained, timeout=10, what="the retried completes")
    assert sum(q.complete_sizes) == total, (q.complete_sizes, c.stats)
    # held (not released) while the complete waited for its retry, so no row ran twice
    assert set(done.values()) == {1} and len(done) == total


@pytest_twisted.ensureDeferred
async def test_a_batch_complete_that_never_answers_does_not_hold_up_later_batches(
        db, consumers):
    total = 10
    await insert_jobs(db, total)
    await make_live(db, "r1")
    ref = [None]
    q = RecordingQueue(db, ref)
    q.hang_completes = 1
    ref[0] = consumers(q, "r1", ["task"], lambda claim: None, max_in_flight=2,
                           poll_interval=0.2, settle_timeout=0.3)

    async def drained():
        return (await db.runQuery("SELECT count(*) FROM work_claims"))[0][0] == 0

    await eventually(drained, timeout=10, what="completes after the hung one")
    assert q.hang_completes == 0


class GatedQueue(ClaimQueue):
    """Holds every claim statement until ``gate`` fires, then runs it."""

    def __init__(self, db):
        super().__init__(db)
        self.gate = defer.Deferred()
        self.waiting = defer.Deferred()

    async def claim_many(self, owner, kinds, limit):
        if not self.waiting.called:
            self.waiting.callback(None)
        await self.gate
        return await super().claim_many(owner, kinds, limit)


@pytest_twisted.ensureDeferred
async def test_rows_claimed_by_a_statement_that_answers_after_stop_are_released(db):
    ids = await insert_jobs(db, 3)
    await make_live(db, "r1")
    q = GatedQueue(db)
    ran = []
    c = ClaimConsumer(q, "r1", ["task"], ran.append, max_in_flight=4, poll_interval=0.2)
    c.startService()
    await q.waiting                    # a claim statement is on its way
    stopped = c.stopService()
    q.gate.callback(None)              # ...and claims the rows after the stop
    await stopped
    assert ran == []
    # handed straight back, without delay: not left held until r1 stops being live
    assert [(await row(db, i))[:4] for i in ids] == [("", False, 1, 0)] * 3
    assert (await row(db, ids[0]))[4] is None
