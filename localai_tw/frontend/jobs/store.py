"""The ``jobs`` and ``job_events`` tables (migration 0006): every statement about a job's record.

A job is submitted in one transaction that writes its row *and* its ``work_claims`` row (kind
``job``, payload the job id, same id), so a job is never recorded without the claim that will
drive it, nor queued without a record.  Every state change is one fenced statement:

=====================  ============================================  ===========================
change                 when                                          fence
=====================  ============================================  ===========================
queued -> running      a replica is about to send it to a worker     state queued/running AND
                                                                     NOT cancel_requested
runs + 1               the worker said "started"                     state running
running -> queued      released (no agent, busy, transport failure)  state running
-> succeeded/failed/   the worker's answer; a cancel of a queued     not finished
   cancelled           job; a dispatch that finds cancel_requested
=====================  ============================================  ===========================

So a finished job never changes again, and a job whose cancel was requested is never started
again (the dispatcher's ``begin`` refuses it).  Progress events are stored up to
:data:`~localai_tw.jobs.kinds.MAX_EVENTS_PER_JOB` per job; later ones are counted.

This module only reads and writes these tables; it never talks to a worker.  Every statement
is shielded: a caller cancelled while waiting (a claim handler when its replica stops) stops
waiting, and the statement still runs to its end (cancelling a txpostgres query mid-statement
hands the connection back while PostgreSQL is still answering on it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg2.extras import Json

from localai_tw.bus.claims import ClaimQueue, enqueue_statement
from localai_tw.deferreds import shielded
from localai_tw.jobs.kinds import MAX_ERROR_CHARS, MAX_EVENTS_PER_JOB, bounded_event

#: Open (queued or running) jobs one API key may have at once; more are refused (429).
MAX_OPEN_JOBS_PER_OWNER = 32
#: Finished jobs are deleted this long after they finished (with their events), on submit.
FINISHED_RETENTION_DAYS = 7
#: Finished jobs deleted per submit at most (the sweep stays one short statement).
_SWEEP_BATCH = 100

#: The claim kind that drives jobs (``work_claims.kind``).
CLAIM_KIND = "job"
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED = ("succeeded", "failed", "cancelled")

_COLUMNS = ("id, kind, state, runs, cancel_requested, error, events_stored, events_dropped,"
            " created_at, started_at, finished_at, updated_at")


def _time(value) -> str | None:
    return value.isoformat() if value is not None else None


def _summary(row) -> dict:
    (job_id, kind, state, runs, cancel_requested, error, stored, dropped, created, started,
     finished, updated) = row
    return {"id": job_id, "kind": kind, "state": state, "runs": runs,
            "cancel_requested": cancel_requested, "error": error,
            "events": {"stored": stored, "dropped": dropped},
            "created_at": _time(created), "started_at": _time(started),
            "finished_at": _time(finished), "updated_at": _time(updated)}


@dataclass(frozen=True)
class Dispatch:
    """A job a replica may send to a worker now."""

    id: str
    kind: str
    input: Any
    runs: int

    @property
    def rerun(self) -> bool:
        return self.runs > 0


class TooManyOpenJobs(Exception):
    """The key already has :data:`MAX_OPEN_JOBS_PER_OWNER` queued or running jobs."""


class JobStore:
    """Statements on ``jobs`` and ``job_events``; the claim rows through ``queue``."""

    def __init__(self, db, queue: ClaimQueue):
        self.db = db
        self.queue = queue

    def _query(self, sql: str, params=None):
        return shielded(self.db.runQuery(sql, params))

    def _interaction(self, work):
        return shielded(self.db.runInteraction(work))

    # -- submit and read -------------------------------------------------------------------------

    async def submit(self, kind: str, input: Any, owner: str = "") -> dict:
        """Record and queue a job of ``owner`` (the submitting key's digest).

        :raises TooManyOpenJobs: the owner has :data:`MAX_OPEN_JOBS_PER_OWNER` open jobs."""
        job_id = str(uuid.uuid4())
        insert_claim = enqueue_statement(CLAIM_KIND, job_id.encode("ascii"), job_id)

        async def write(cursor):
            # One submit of an owner at a time: the count and the insert cannot interleave.
            await cursor.execute("SELECT pg_advisory_xact_lock(hashtext('jobs:' || %s))",
                                 (owner,))
            await cursor.execute(
                "SELECT count(*) FROM jobs WHERE owner = %s AND state IN ('queued', 'running')",
                (owner,))
            if cursor.fetchall()[0][0] >= MAX_OPEN_JOBS_PER_OWNER:
                raise TooManyOpenJobs()
            await cursor.execute(
                "DELETE FROM jobs WHERE id IN (SELECT id FROM jobs WHERE state IN"
                " ('succeeded', 'failed', 'cancelled') AND finished_at < now() - %s * interval"
                " '1 day' ORDER BY finished_at LIMIT %s)", (FINISHED_RETENTION_DAYS, _SWEEP_BATCH))
            await cursor.execute(
                "INSERT INTO jobs (id, kind, input, owner) VALUES (%s, %s, %s, %s)"
                f" RETURNING {_COLUMNS}", (job_id, kind, Json(input), owner))
            row = cursor.fetchall()[0]
            await cursor.execute(*insert_claim)
            return row

        row = await self._interaction(write)
        await self.queue.wake(CLAIM_KIND)
        return _summary(row)

    async def get(self, job_id: str, *, with_events: bool = True) -> dict | None:
        rows = await self._query(
            f"SELECT {_COLUMNS}, input, result FROM jobs WHERE id = %s", (job_id,))
        if not rows:
            return None
        job = _summary(rows[0][:-2])
        job["input"], job["result"] = rows[0][-2], rows[0][-1]
        if with_events:
            events = await self._query(
                "SELECT seq, at, event FROM job_events WHERE job_id = %s ORDER BY seq",
                (job_id,))
            job["progress"] = [{**(event if isinstance(event, dict) else {"event": event}),
                                "seq": seq, "at": _time(at)}
                               for seq, at, event in events]
        return job

    async def result(self, job_id: str) -> tuple[str, Any] | None:
        rows = await self._query("SELECT state, result FROM jobs WHERE id = %s", (job_id,))
        return (rows[0][0], rows[0][1]) if rows else None

    async def owner_of(self, job_id: str) -> str | None:
        """The digest of the key that submitted the job, or None for an unknown job."""
        rows = await self._query("SELECT owner FROM jobs WHERE id = %s", (job_id,))
        return rows[0][0] if rows else None

    async def page(self, state: str | None, limit: int, before: str | None,
                   owner: str | None = None) -> list[dict]:
        """Newest first; ``before`` is the id of the last job of the previous page; ``owner``:
        only that key's jobs (None: everyone's)."""
        where, params = [], []
        if owner is not None:
            where.append("owner = %s")
            params.append(owner)
        if state is not None:
            where.append("state = %s")
            params.append(state)
        if before is not None:
            where.append("(created_at, id) < (SELECT created_at, id FROM jobs WHERE id = %s)")
            params.append(before)
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        rows = await self._query(
            f"SELECT {_COLUMNS} FROM jobs{clause} ORDER BY created_at DESC, id DESC LIMIT %s",
            (*params, limit))
        return [_summary(r) for r in rows]

    async def exists(self, job_id: str) -> bool:
        return bool(await self._query("SELECT 1 FROM jobs WHERE id = %s", (job_id,)))

    # -- the dispatcher's changes ---------------------------------------------------------------

    async def begin(self, job_id: str) -> Dispatch | None:
        """Mark the job running before it is sent to a worker, or None when it must not run
        (finished, unknown, or its cancel was requested: then it is recorded cancelled)."""
        rows = await self._query(
            "UPDATE jobs SET state = 'running', started_at = coalesce(started_at, now()),"
            " updated_at = now()"
            " WHERE id = %s AND state IN ('queued', 'running') AND NOT cancel_requested"
            " RETURNING kind, input, runs", (job_id,))
        if rows:
            kind, input, runs = rows[0]
            return Dispatch(job_id, kind, input, runs)
        await self.finish(job_id, "cancelled", only_if_cancel_requested=True)
        return None

    async def started(self, job_id: str) -> bool:
        """The worker started the job: count the run.  Returns whether a cancel was requested
        meanwhile (the dispatcher then stops the run)."""
        rows = await self._query(
            "UPDATE jobs SET runs = runs + 1, updated_at = now()"
            " WHERE id = %s AND state = 'running' RETURNING cancel_requested", (job_id,))
        return bool(rows and rows[0][0])

    async def requeue(self, job_id: str) -> bool:
        rows = await self._query(
            "UPDATE jobs SET state = 'queued', updated_at = now()"
            " WHERE id = %s AND state = 'running' RETURNING id", (job_id,))
        return bool(rows)

    async def finish(self, job_id: str, state: str, *, result: Any = None,
                     error: str | None = None, only_if_cancel_requested: bool = False) -> bool:
        """Record the end of a job once; False when it had already finished."""
        if state not in FINISHED:
            raise ValueError(f"{state!r} is not a finished state")
        extra = " AND cancel_requested" if only_if_cancel_requested else ""
        rows = await self._query(
            "UPDATE jobs SET state = %s, result = %s, error = %s, finished_at = now(),"
            " updated_at = now()"
            f" WHERE id = %s AND state NOT IN ('succeeded', 'failed', 'cancelled'){extra}"
            " RETURNING id",
            (state, Json(result) if result is not None else None,
             error[:MAX_ERROR_CHARS] if error is not None else None, job_id))
        return bool(rows)

    async def add_event(self, job_id: str, event: Any) -> None:
        """Store one progress event (bounded), or count it past the per-job cap."""
        event = bounded_event(event)

        async def write_if_room(cursor):
            await cursor.execute("SELECT events_stored FROM jobs WHERE id = %s FOR UPDATE",
                                 (job_id,))
            rows = cursor.fetchall()
            if not rows:
                return
            if rows[0][0] >= MAX_EVENTS_PER_JOB:
                await cursor.execute("UPDATE jobs SET events_dropped = events_dropped + 1"
                                     " WHERE id = %s", (job_id,))
                return
            await cursor.execute("UPDATE jobs SET events_stored = events_stored + 1"
                                 " WHERE id = %s", (job_id,))
            await cursor.execute(
                "INSERT INTO job_events (job_id, seq, event) VALUES (%s, %s, %s)",
                (job_id, rows[0][0] + 1, Json(event)))

        await self._interaction(write_if_room)

    # -- cancel ----------------------------------------------------------------------------------

    async def request_cancel(self, job_id: str) -> str | None:
        """Record the cancel request.  Returns the job's state *before* (None: unknown job).

        A queued job is cancelled here, at once, and its unclaimed claim row deleted: it never
        starts (a replica that claimed it meanwhile finds it cancelled in ``begin``).  A running
        job keeps running until a worker cancels it; ``cancel_requested`` keeps it from ever
        starting again.
        """

        async def write(cursor):
            await cursor.execute(
                "SELECT state FROM jobs WHERE id = %s FOR UPDATE", (job_id,))
            rows = cursor.fetchall()
            if not rows:
                return None
            state = rows[0][0]
            if state in FINISHED:
                return state
            await cursor.execute(
                "UPDATE jobs SET cancel_requested = true, updated_at = now() WHERE id = %s",
                (job_id,))
            if state == "queued":
                await cursor.execute(
                    "UPDATE jobs SET state = 'cancelled', finished_at = now() WHERE id = %s",
                    (job_id,))
                await cursor.execute(
                    "DELETE FROM work_claims WHERE id = %s AND claimed_at IS NULL", (job_id,))
            return state

        return await self._interaction(write)

