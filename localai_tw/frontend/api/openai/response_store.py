"""The ``responses`` table (migration 0011) and the background runs of this replica: every
statement about a stored Responses API answer, and the cancel of a background run from any
replica (a ``responses.cancel`` message on the bus, heard by the replica running it).

Why PostgreSQL: ``previous_response_id`` must continue a conversation on whichever replica the
load balancer picks, and the database is the only thing every replica shares.  A row belongs to
the key that created it (``owner``, the key's sha256 in hex, never the key): every read, cancel
and delete is ``WHERE id = %s AND owner = %s``, so another key's response is a 404.

Bounded: rows older than :data:`RETENTION_DAYS` are deleted, :data:`SWEEP_BATCH` at a time,
whenever a response is stored; one key has at most :data:`MAX_OPEN_BACKGROUND_PER_OWNER`
queued or running background responses; a row's size is bounded by the request body cap and
the chat API's message cap (checked by the caller).  A finished row never changes again: the
final write is fenced on ``status IN ('queued', 'in_progress')``, so a cancel wins over a run
that ends after it.  A running row whose replica is no longer live is failed when it is read.

What this module must never do: return a row to a key that is not its owner, store a key,
block the reactor, or cancel a statement mid-way (every statement is shielded).
"""

from __future__ import annotations

from typing import Any, Callable

from psycopg2.extras import Json
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.cluster.clock import INSTANCE_LIVENESS, LIVE_INSTANCE_IDS_SQL
from localai_tw.deferreds import shielded

log = Logger()

#: Stored responses are deleted this long after they were created (OpenAI keeps them 30 days).
RETENTION_DAYS = 30
#: Expired rows deleted per store at most (the sweep stays one short statement).
SWEEP_BATCH = 100
#: Queued or running background responses one key may have at once; more are refused (429).
MAX_OPEN_BACKGROUND_PER_OWNER = 16
#: The bus subject of a cancel: ``{"id": ...}``, heard by every replica.
CANCEL_SUBJECT = "responses.cancel"

RUNNING = ("queued", "in_progress")
_COLUMNS = "id, owner, status, background, instance_id, body, input_items, conversation"
#: A running row failed because its run can no longer finish (binds the id, then more).
_FAIL_RUNNING = (
    "UPDATE responses SET status = 'failed', instance_id = '', updated_at = now(),"
    " body = body || jsonb_build_object('status', 'failed', 'error', jsonb_build_object("
    "'code', 'server_error', 'message', 'the replica running this response stopped'))"
    " WHERE id = %s AND status IN ('queued', 'in_progress')")


class TooManyBackground(Exception):
    """The key already has :data:`MAX_OPEN_BACKGROUND_PER_OWNER` open background responses."""


class StoredResponse:
    """One row, as read by its owner."""

    def __init__(self, row):
        (self.id, self.owner, self.status, self.background, self.instance_id, self.body,
         self.input_items, self.conversation) = row

    @property
    def running(self) -> bool:
        return self.status in RUNNING


class ResponseStore:
    """Statements on ``responses`` (module docstring).

    :param db: the replica's txpostgres pool.
    :param instance_id: this replica's id (recorded on the rows it runs).
    """

    def __init__(self, db, instance_id: str = ""):
        self.db = db
        self.instance_id = instance_id

    def _query(self, sql: str, params=None):
        return shielded(self.db.runQuery(sql, params))

    def _interaction(self, work):
        return shielded(self.db.runInteraction(work))

    async def begin(self, response_id: str, owner: str, model: str, previous: str | None,
                    body: dict, input_items: list, conversation: list) -> None:
        """Record a background response as ``queued`` before it runs (run by this replica).

        :raises TooManyBackground: the owner has too many open background responses."""

        async def write(cursor):
            await cursor.execute("SELECT pg_advisory_xact_lock(hashtext('responses:' || %s))",
                                 (owner,))
            await cursor.execute(
                "SELECT count(*) FROM responses WHERE owner = %s AND background AND status IN"
                " ('queued', 'in_progress')", (owner,))
            if cursor.fetchall()[0][0] >= MAX_OPEN_BACKGROUND_PER_OWNER:
                raise TooManyBackground()
            await self._sweep(cursor)
            await cursor.execute(
                "INSERT INTO responses (id, owner, model, status, previous_response_id,"
                " background, instance_id, body, input_items, conversation) VALUES"
                " (%s, %s, %s, 'queued', %s, true, %s, %s, %s, %s)",
                (response_id, owner, model, previous, self.instance_id, Json(body),
                 Json(input_items), Json(conversation)))

        await self._interaction(write)

    async def _sweep(self, cursor) -> None:
        await cursor.execute(
            "DELETE FROM responses WHERE id IN (SELECT id FROM responses WHERE created_at <"
            " now() - %s * interval '1 day' ORDER BY created_at LIMIT %s)",
            (RETENTION_DAYS, SWEEP_BATCH))

    async def started(self, response_id: str, body: dict) -> bool:
        """queued -> in_progress; False when it was cancelled meanwhile."""
        rows = await self._query(
            "UPDATE responses SET status = 'in_progress', body = %s, updated_at = now()"
            " WHERE id = %s AND status = 'queued' RETURNING id", (Json(body), response_id))
        return bool(rows)

    async def finish(self, response_id: str, owner: str, model: str, previous: str | None,
                     body: dict, input_items: list, conversation: list, *,
                     background: bool = False) -> bool:
        """The final state of a response: a foreground one is inserted; a background one is
        updated while it is still running (a cancelled or deleted one stays so).  False when
        nothing was written."""
        if background:
            rows = await self._query(
                "UPDATE responses SET status = %s, body = %s, conversation = %s,"
                " instance_id = '', updated_at = now() WHERE id = %s AND owner = %s"
                " AND status IN ('queued', 'in_progress') RETURNING id",
                (body["status"], Json(body), Json(conversation), response_id, owner))
            return bool(rows)

        async def write(cursor):
            await self._sweep(cursor)
            await cursor.execute(
                "INSERT INTO responses (id, owner, model, status, previous_response_id,"
                " body, input_items, conversation) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                (response_id, owner, model, body["status"], previous, Json(body),
                 Json(input_items), Json(conversation)))
            return True

        return await self._interaction(write)

    async def orphaned(self, response_id: str) -> None:
        """A row this replica says it runs, with no run here (the process that ran it
        stopped, and this one took its instance id): failed."""
        await self._query(_FAIL_RUNNING + " AND instance_id = %s RETURNING id",
                          (response_id, self.instance_id))

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The owner's response, or None.  A running row whose replica is gone is failed
        first (its run can never finish)."""
        await self._query(_FAIL_RUNNING + f" AND owner = %s AND instance_id NOT IN"
                          f" ({LIVE_INSTANCE_IDS_SQL}) RETURNING id",
                          (response_id, owner, INSTANCE_LIVENESS))
        rows = await self._query(f"SELECT {_COLUMNS} FROM responses WHERE id = %s AND owner = %s",
                                 (response_id, owner))
        return StoredResponse(rows[0]) if rows else None

    async def cancel(self, response_id: str, owner: str) -> StoredResponse | None:
        """A running background response -> ``cancelled``; the row as it is now (None: no
        such response of this owner)."""
        await self._query(
            "UPDATE responses SET status = 'cancelled', instance_id = '', updated_at = now(),"
            " body = body || jsonb_build_object('status', 'cancelled')"
            " WHERE id = %s AND owner = %s AND background AND status IN ('queued', 'in_progress')"
            " RETURNING id", (response_id, owner))
        return await self.get(response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        rows = await self._query("DELETE FROM responses WHERE id = %s AND owner = %s RETURNING id",
                                 (response_id, owner))
        return bool(rows)


class BackgroundRuns:
    """The background responses this replica runs, and their cancel from any replica.

    :param bus: the replica's ``PgBus`` (None: cancels reach this replica's runs only).
    """

    def __init__(self, bus=None):
        self._bus = bus
        self._runs: dict[str, defer.Deferred] = {}
        self._reserved: set[str] = set()
        self._subscribed = False
        self._subscribing = defer.DeferredLock()

    async def ready(self) -> None:
        """Listen for cancels before the first run starts (once).  Without the bus a cancel
        still marks the row (and the run's final write is fenced): only the work goes on."""
        if self._bus is None or self._subscribed:
            return
        await self._subscribing.acquire()
        try:
            if not self._subscribed:
                await self._bus.subscribe(CANCEL_SUBJECT, self._heard)
                self._subscribed = True
        except Exception:
            log.failure("listening for response cancels failed")
        finally:
            self._subscribing.release()

    def _heard(self, subject: str, payload: Any) -> None:
        if isinstance(payload, dict) and isinstance(payload.get("id"), str):
            self._cancel_here(payload["id"])

    def reserve(self, response_id: str) -> None:
        """Known as running here from before its row is written (:meth:`knows`)."""
        self._reserved.add(response_id)

    def unreserve(self, response_id: str) -> None:
        self._reserved.discard(response_id)

    def knows(self, response_id: str) -> bool:
        return response_id in self._runs or response_id in self._reserved

    def run(self, response_id: str, work: Callable[[], Any]) -> defer.Deferred:
        """Run ``work()`` (a coroutine function) as ``response_id``'s background run."""
        d = defer.ensureDeferred(work())
        if not d.called:
            self._runs[response_id] = d
        self._reserved.discard(response_id)
        d.addBoth(self._ended, response_id)
        return d

    def _ended(self, result, response_id: str):
        self._runs.pop(response_id, None)
        if isinstance(result, Failure) and not result.check(defer.CancelledError):
            log.failure("background response {id} failed", result, id=response_id)
        return None

    def _cancel_here(self, response_id: str) -> bool:
        d = self._runs.get(response_id)
        if d is None:
            return False
        d.cancel()
        return True

    async def cancel(self, response_id: str) -> None:
        """Stop the run wherever it is: here at once, elsewhere through the bus."""
        if self._cancel_here(response_id) or self._bus is None:
            return
        try:
            await self._bus.publish(CANCEL_SUBJECT, {"id": response_id})
        except Exception:  # the row is cancelled already; its run's final write is fenced
            log.failure("publishing the cancel of {id} failed", id=response_id)

    def running(self) -> list[str]:
        return sorted(self._runs)

