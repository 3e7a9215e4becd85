"""The ``responses`` table (migration 0011) and the background runs of this replica: every
statement about a stored Responses API answer, and the cancel of a background run from any
replica (a ``responses.cancel`` message on the bus, heard by the replica running it).

Why PostgreSQL: ``previous_response_id`` must continue a conversation on whichever replica the
load balancer picks, and the database is the only thing every replica shares.  A row belongs to
the key that created it (``owner``, the key's sha256 in hex, never the key): every read, cancel
and delete is ``WHERE id = %s AND owner = %s``, so another key's response is a 404.

A background response is written with its claim (a ``work_claims`` row of kind
:data:`CLAIM_KIND`, in the same transaction), so it is never recorded without the claim that
will run it; any live replica's consumer claims it, and the claim of a replica that stops
being live moves on, so the response runs again elsewhere (``responses_api.run_claimed``).
This room may not import the claim queue: the composition root hands its ``enqueue``
statement and ``wake`` in.

Bounded: rows older than :data:`RETENTION_DAYS` are deleted, :data:`SWEEP_BATCH` at a time,
whenever a response is stored; one key has at most :data:`MAX_OPEN_BACKGROUND_PER_OWNER`
queued or running background responses; a row's size is bounded by the request body cap, the
chat API's message cap and :data:`MAX_CONVERSATION_BYTES` (checked by the caller).  A finished
row never changes again: a run's final write is fenced on ``status IN ('queued',
'in_progress')``, so a cancel (or a delete) wins over a run that ends after it.

What this module must never do: return a row to a key that is not its owner, store a key,
block the reactor, or cancel a statement mid-way (every statement is shielded).
"""

from __future__ import annotations

from typing import Any, Callable

from psycopg2.extras import Json
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.deferreds import shielded

log = Logger()

#: Stored responses are deleted this long after they were created (OpenAI keeps them 30 days).
RETENTION_DAYS = 30
#: Expired rows deleted per store at most (the sweep stays one short statement).
SWEEP_BATCH = 100
#: Queued or running background responses one key may have at once; more are refused (429).
MAX_OPEN_BACKGROUND_PER_OWNER = 16
#: Largest stored conversation (its JSON text) a response may continue: each turn adds its
#: input (at most the body cap) and its answer, so a long chain is refused, not stored twice.
MAX_CONVERSATION_BYTES = 32 * 1024 * 1024
#: Background responses one replica runs at once (its consumer's slots).
BACKGROUND_SLOTS = 4
#: The claim kind that drives background responses (``work_claims.kind``).
CLAIM_KIND = "response"
#: The bus subject of a cancel: ``{"id": ...}``, heard by every replica.
CANCEL_SUBJECT = "responses.cancel"

RUNNING = ("queued", "in_progress")
_COLUMNS = ("id, owner, status, background, instance_id, body, input_items, conversation,"
            " chat_request, octet_length(conversation::text)")


def claim_id(response_id: str) -> str:
    """The claim's id (at most 36 characters): the response id without ``resp_``."""
    return response_id[-32:]


class TooManyBackground(Exception):
    """The key already has :data:`MAX_OPEN_BACKGROUND_PER_OWNER` open background responses."""


class StoredResponse:
    """One row."""

    def __init__(self, row):
        (self.id, self.owner, self.status, self.background, self.instance_id, self.body,
         self.input_items, self.conversation, self.chat_request,
         self.conversation_bytes) = row

    @property
    def running(self) -> bool:
        return self.status in RUNNING


class ResponseStore:
    """Statements on ``responses`` (module docstring).

    :param db: the replica's txpostgres pool.
    :param instance_id: this replica's id (recorded on the rows it runs).
    :param enqueue: ``enqueue(kind, payload, work_id) -> (sql, params)``, the claim queue's
        INSERT (``bus.claims.enqueue_statement``); None: background responses are refused.
    :param wake: ``wake(kind)``, the claim queue's wake hint (a Deferred), or None.
    """

    def __init__(self, db, instance_id: str = "", *, enqueue=None, wake=None):
        self.db = db
        self.instance_id = instance_id
        self._enqueue = enqueue
        self._wake = wake

    @property
    def runs_background(self) -> bool:
        return self._enqueue is not None

    def _query(self, sql: str, params=None):
        return shielded(self.db.runQuery(sql, params))

    def _interaction(self, work):
        return shielded(self.db.runInteraction(work))

    async def _sweep(self, cursor) -> None:
        await cursor.execute(
            "DELETE FROM responses WHERE id IN (SELECT id FROM responses WHERE created_at <"
            " now() - %s * interval '1 day' ORDER BY created_at LIMIT %s)",
            (RETENTION_DAYS, SWEEP_BATCH))

    async def begin(self, response_id: str, owner: str, model: str, previous: str | None,
                    body: dict, input_items: list, conversation: list,
                    chat_request: dict) -> None:
        """Record a background response as ``queued`` with the claim that will run it.

        :raises TooManyBackground: the owner has too many open background responses."""
        claim = self._enqueue(CLAIM_KIND, response_id.encode("ascii"), claim_id(response_id))

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
                " background, body, input_items, conversation, chat_request) VALUES"
                " (%s, %s, %s, 'queued', %s, true, %s, %s, %s, %s)",
                (response_id, owner, model, previous, Json(body), Json(input_items),
                 Json(conversation), Json(chat_request)))
            await cursor.execute(*claim)

        await self._interaction(write)
        if self._wake is not None:
            try:
                await self._wake(CLAIM_KIND)
            except Exception:  # a hint only: the consumers' poll finds the claim
                log.failure("waking the response consumers failed")

    async def insert(self, response_id: str, owner: str, model: str, previous: str | None,
                     body: dict, input_items: list, conversation: list) -> None:
        """Store a finished foreground response."""

        async def write(cursor):
            await self._sweep(cursor)
            await cursor.execute(
                "INSERT INTO responses (id, owner, model, status, previous_response_id,"
                " body, input_items, conversation) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                (response_id, owner, model, body["status"], previous, Json(body),
                 Json(input_items), Json(conversation)))

        await self._interaction(write)

    # -- a background run ----------------------------------------------------------------------

    async def for_run(self, response_id: str) -> StoredResponse | None:
        """The row a claim names (whoever owns it: the run is the owner's request)."""
        rows = await self._query(f"SELECT {_COLUMNS} FROM responses WHERE id = %s",
                                 (response_id,))
        return StoredResponse(rows[0]) if rows else None

    async def started(self, response_id: str, body: dict) -> bool:
        """-> in_progress here (again, after another replica's claim moved on); False when it
        finished meanwhile (cancelled, deleted)."""
        rows = await self._query(
            "UPDATE responses SET status = 'in_progress', instance_id = %s, body = %s,"
            " updated_at = now() WHERE id = %s AND status IN ('queued', 'in_progress')"
            " RETURNING id", (self.instance_id, Json(body), response_id))
        return bool(rows)

    async def finish(self, response_id: str, body: dict, conversation: list | None) -> bool:
        """A run's final state, while the row is still running (a cancelled or deleted
        response stays so).  False when nothing was written."""
        rows = await self._query(
            "UPDATE responses SET status = %s, body = %s,"
            " conversation = COALESCE(%s, conversation), instance_id = '', updated_at = now()"
            " WHERE id = %s AND status IN ('queued', 'in_progress') RETURNING id",
            (body["status"], Json(body), Json(conversation) if conversation is not None
             else None, response_id))
        return bool(rows)

    async def exhausted(self, claim) -> None:
        """The claim queue gave up on a response (its run kept failing): failed."""
        response_id = claim.payload.decode("ascii", "replace")
        await self._query(
            "UPDATE responses SET status = 'failed', instance_id = '', updated_at = now(),"
            " body = body || jsonb_build_object('status', 'failed', 'error', jsonb_build_object("
            "'code', 'server_error', 'message', 'this response could not be run; see the"
            " frontend log')) WHERE id = %s AND status IN ('queued', 'in_progress')"
            " RETURNING id", (response_id,))

    # -- the owner's requests ------------------------------------------------------------------

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The owner's response, or None."""
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

    :param bus: the replica's ``PgBus`` (None: cancels reach this replica's runs only; the
        row is cancelled anyway and the run's final write is fenced).
    """

    def __init__(self, bus=None):
        self._bus = bus
        self._runs: dict[str, defer.Deferred] = {}
        self._cancelled: set[str] = set()
        self._subscribed = False
        self._subscribing = defer.DeferredLock()

    async def ready(self) -> None:
        """Listen for cancels (once) before a run starts."""
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

    def run(self, response_id: str, work: Callable[[], Any]) -> defer.Deferred:
        """Run ``work()`` (a coroutine function) as ``response_id``'s run: a Deferred of its
        result.  Cancelling that Deferred (a cancel of the response, :meth:`was_cancelled`
        then says so; or the consumer, when this replica stops) fails it with
        ``CancelledError`` at once, whatever the work raises while it stops (a statement
        cancelled mid-way raises something else)."""
        self._cancelled.discard(response_id)
        work_done = defer.ensureDeferred(work())
        stopping: list[bool] = []

        def stop(_):
            stopping.append(True)  # before: the work may end inside its own cancel
            try:
                work_done.cancel()
            except Exception:  # a txpostgres query cancelled mid-way raises from cancel()
                log.debug("cancelling the run of {id} raised", id=response_id)

        result = defer.Deferred(stop)  # fails with CancelledError once stop() returns

        def settle(outcome):
            self._runs.pop(response_id, None)
            if stopping:
                if isinstance(outcome, Failure):
                    log.debug("the cancelled run of {id} ended: {f}", id=response_id,
                              f=outcome.getErrorMessage())
                return None
            result.callback(outcome)
            return None

        if not work_done.called:
            self._runs[response_id] = result
        work_done.addBoth(settle)
        return result

    def was_cancelled(self, response_id: str) -> bool:
        """Whether the run of ``response_id`` ended because the response was cancelled (not
        because the replica stops)."""
        return response_id in self._cancelled

    def forget(self, response_id: str) -> None:
        self._cancelled.discard(response_id)

    def _cancel_here(self, response_id: str) -> bool:
        d = self._runs.get(response_id)
        if d is None:
            return False
        self._cancelled.add(response_id)
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
