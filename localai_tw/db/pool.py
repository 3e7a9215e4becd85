"""Non-blocking PostgreSQL access through txpostgres.

``Database`` is a small fixed-size pool of asynchronous psycopg2 connections driven by the
reactor.  It offers the three operations the rest of the code needs (a query, a statement, a
transaction), a pinned connection for LISTEN, and a session-level advisory lock held on a pinned
connection.

It must never block the reactor and never read the replica's clock: every time comparison
belongs in SQL with ``now()``.  A connection that dies (server restart, ``pg_terminate_backend``)
fails the call that found it dead with ``DatabaseUnavailable`` and is replaced in the background;
the pool does not retry statements itself, because only the caller knows whether a statement is
safe to repeat.

While the database is away nobody waits for it without bound: a caller that finds no free
connection waits at most ``CHECKOUT_TIMEOUT_SECONDS`` and then gets ``DatabaseUnavailable``
(the HTTP APIs answer 503 with ``Retry-After``).  An outage is logged once when the pool first
finds a connection dead and once when a connection is restored, never per call or per reconnect
attempt.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Callable

import psycopg2
import psycopg2.extensions
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from txpostgres import txpostgres

from localai_tw.deferreds import shielded

log = Logger()

_pool_ids = itertools.count(1)

#: Longest a call waits for a pooled connection before it fails with ``DatabaseUnavailable``.
#: While the database is away every connection is dead and reconnecting, so without this bound a
#: request would wait as long as the outage lasts.
CHECKOUT_TIMEOUT_SECONDS = 5.0


class DatabaseError(Exception):
    """Base of errors raised by this module."""


class DatabaseUnavailable(DatabaseError):
    """The connection to PostgreSQL failed or died.  Says nothing about any row."""


class PoolClosed(DatabaseError):
    """The pool was closed; this process is shutting down."""


def redact_dsn(dsn: str) -> str:
    """The DSN with any password removed, for logs.  Secrets are never logged."""
    try:
        params = psycopg2.extensions.parse_dsn(dsn)
    except psycopg2.ProgrammingError:
        return "<unparsable dsn>"
    params.pop("password", None)
    return " ".join(f"{k}={v}" for k, v in sorted(params.items()))


def dsn_with(dsn: str, **overrides: Any) -> str:
    """``dsn`` (URL or key=value form) with some parameters replaced, as key=value text."""
    return psycopg2.extensions.make_dsn(dsn, **overrides)


def _is_dead(conn: txpostgres.Connection) -> bool:
    raw = getattr(conn, "_connection", None)
    return raw is None or bool(raw.closed)


class _Connection(txpostgres.Connection):
    """A txpostgres connection whose death while idle is reported instead of raised.

    txpostgres keeps every connection registered as a reader (for NOTIFY).  When the server
    closes an idle one (a restart, ``pg_terminate_backend``), its ``doRead`` raises the
    ``OperationalError`` with nobody to give it to, and the reactor logs an "Unhandled Error"
    traceback per connection.  Here the loss ends in ``connectionLost`` (which a txpostgres
    detector sees, as before) and in ``on_lost`` (the pool replaces an idle connection at once).
    """

    on_lost: Callable[["_Connection", str], None] | None = None

    def doRead(self):
        try:
            super().doRead()
        except psycopg2.Error as e:
            reason = Failure()
            self.reactor.removeReader(self)
            self.connectionLost(reason)
            if self.on_lost is not None:
                self.on_lost(self, str(e).strip())


class Database:
    """A fixed-size txpostgres pool.

    :param dsn: libpq connection string or URL.
    :param size: number of pooled connections; callers beyond it wait in FIFO order.
    :param application_name: shown in ``pg_stat_activity``; the pool appends a suffix.
    """

    def __init__(self, dsn: str, size: int = 4, reactor=None,
                 application_name: str = "localai_tw"):
        if size < 1:
            raise ValueError("pool size must be at least 1")
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        self.dsn = dsn
        self.size = size
        self._reactor = reactor
        self._app = f"{application_name}_{next(_pool_ids)}"
        self._free: deque[txpostgres.Connection] = deque()
        self._waiters: deque[defer.Deferred] = deque()
        self._all: set[txpostgres.Connection] = set()
        self._closed = False
        self._started = False
        #: Why the database is away, from the first dead connection until one is restored.
        self._outage: str | None = None
        #: Reactor time of the last statement the database answered (None: none yet).
        self.last_answer: float | None = None
        #: Called (no argument) when a connection is restored after an outage.
        self._on_restored: list[Callable[[], Any]] = []

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Open every pooled connection; fails if PostgreSQL cannot be reached."""
        if self._started:
            return
        conns = await defer.gatherResults(
            [defer.ensureDeferred(self._connect(f"{self._app}_{i}", pooled=True))
             for i in range(self.size)],
            consumeErrors=True,
        ).addErrback(lambda f: f.value.subFailure)
        for c in conns:
            self._all.add(c)
            self._release(c)
        self._started = True
        log.info("database pool of {size} connections to {dsn}", size=self.size,
                 dsn=redact_dsn(self.dsn))

    async def _connect(self, name: str, pooled: bool = False) -> txpostgres.Connection:
        conn = _Connection(reactor=self._reactor)
        if pooled:
            conn.on_lost = self._lost_while_idle
        try:
            await conn.connect(dsn_with(self.dsn, application_name=name))
        except psycopg2.Error as e:
            raise DatabaseUnavailable(
                f"cannot connect to PostgreSQL at {redact_dsn(self.dsn)}: {str(e).strip()}"
            ) from e
        return conn

    def close(self) -> None:
        """Close every connection and fail every waiter with ``PoolClosed``."""
        if self._closed:
            return
        self._closed = True
        while self._waiters:
            self._waiters.popleft().errback(PoolClosed("database pool closed"))
        for c in list(self._all):
            try:
                c.close()
            except Exception:  # already broken: nothing left to release
                pass
        self._all.clear()
        self._free.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- connection checkout ------------------------------------------------------------

    def _acquire(self) -> defer.Deferred:
        """A free connection, or a wait of at most ``CHECKOUT_TIMEOUT_SECONDS`` for one."""
        if self._closed:
            return defer.fail(PoolClosed("database pool closed"))
        if self._free:
            return defer.succeed(self._free.popleft())
        d = defer.Deferred(lambda d: self._waiters.remove(d) if d in self._waiters else None)
        self._waiters.append(d)
        d.addTimeout(CHECKOUT_TIMEOUT_SECONDS, self._reactor)
        d.addErrback(self._checkout_timed_out)
        return d

    def _checkout_timed_out(self, failure: Failure):
        failure.trap(defer.TimeoutError)
        if self._outage is not None:
            raise DatabaseUnavailable(f"the database is unavailable: {self._outage}")
        raise DatabaseUnavailable(f"no database connection became free within "
                                  f"{CHECKOUT_TIMEOUT_SECONDS:g}s (all {self.size} busy)")

    def _lost(self, cause: str) -> None:
        """Note that the database is away; the first loss of an outage is logged."""
        if self._outage is None and not self._closed:
            self._outage = cause
            log.warn("database unavailable: {cause}; calls that need it fail (HTTP 503) until a "
                     "connection is restored", cause=cause)

    def on_restored(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` each time a connection is restored after an outage (a replica
        re-joins the cluster at once instead of at its next heartbeat)."""
        self._on_restored.append(callback)

    def _restored(self) -> None:
        if self._outage is not None:
            self._outage = None
            log.info("database available again")
            for callback in list(self._on_restored):
                try:
                    defer.maybeDeferred(callback).addErrback(
                        lambda f: log.failure("a database-restored callback failed", f))
                except Exception:
                    log.failure("a database-restored callback failed")

    def _lost_while_idle(self, conn: txpostgres.Connection, cause: str) -> None:
        if conn in self._free:
            self._free.remove(conn)
            self._replace(conn, f"database connection lost: {cause}")

    def _release(self, conn: txpostgres.Connection) -> None:
        if self._closed:
            conn.close()
            return
        if self._waiters:
            self._waiters.popleft().callback(conn)
        else:
            self._free.append(conn)

    def _replace(self, conn: txpostgres.Connection, cause: str) -> None:
        """Drop a dead connection and put a fresh one in its place, retrying with backoff."""
        self._all.discard(conn)
        self._lost(cause)
        try:
            conn.close()
        except Exception:
            pass

        async def reconnect() -> None:
            delay = 0.1
            while not self._closed:
                try:
                    fresh = await self._connect(f"{self._app}_r", pooled=True)
                except DatabaseUnavailable as e:
                    # The outage was logged once when it began; attempts are not logged.
                    log.debug("database reconnect failed, retrying in {delay}s: {err}",
                              delay=delay, err=e)
                    await _sleep(self._reactor, delay)
                    delay = min(delay * 2, 5.0)
                    continue
                if self._closed:
                    fresh.close()
                    return
                self._all.add(fresh)
                self._restored()
                self._release(fresh)
                return

        defer.ensureDeferred(reconnect())

    async def _with_connection(self, fn: Callable[[txpostgres.Connection], defer.Deferred]):
        conn = await self._acquire()
        try:
            result = await _given_up_cleanly(fn(conn))
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            if _is_dead(conn):
                cause = f"database connection lost: {str(e).strip()}"
                self._replace(conn, cause)
                raise DatabaseUnavailable(cause) from e
            self._release(conn)
            raise
        except txpostgres.RollbackFailed as e:
            cause = "database connection lost during a transaction"
            self._replace(conn, cause)
            raise DatabaseUnavailable(cause) from e
        except BaseException:
            self._release(conn)
            raise
        self.last_answer = self._reactor.seconds()
        self._release(conn)
        return result

    @property
    def outage(self) -> str | None:
        """Why the database is away (from the first dead connection until one is restored),
        else None."""
        return self._outage

    def answered_within(self, seconds: float) -> bool:
        """Whether the database answered one of this pool's statements in the last
        ``seconds``: proof it is reachable that costs no statement and does not wait behind a
        busy pool's queue (``/readyz`` during a reconnect storm)."""
        return (self.last_answer is not None and self._outage is None and not self._closed
                and self._reactor.seconds() - self.last_answer <= seconds)

    # -- operations ---------------------------------------------------------------------

    def runQuery(self, sql: str, params: Any = None) -> defer.Deferred:
        """Run one statement and fire with its rows (a list of tuples)."""
        return defer.ensureDeferred(self._with_connection(lambda c: c.runQuery(sql, params)))

    def runOperation(self, sql: str, params: Any = None) -> defer.Deferred:
        """Run one statement whose rows are not wanted."""
        return defer.ensureDeferred(self._with_connection(lambda c: c.runOperation(sql, params)))

    def runInteraction(self, interaction: Callable[..., Any], *args, **kwargs) -> defer.Deferred:
        """Run ``interaction(cursor, *args, **kwargs)`` inside one transaction.

        The interaction uses ``cursor.execute(sql, params)`` (a Deferred) and
        ``cursor.fetchall()``; it may be an ``async def``.  An exception rolls back.
        """
        def run(conn):
            def wrapped(cursor):
                return defer.maybeDeferred(_call_maybe_coroutine, interaction, cursor,
                                           *args, **kwargs)
            return conn.runInteraction(wrapped)
        return defer.ensureDeferred(self._with_connection(run))

    async def connectPinned(self, purpose: str) -> txpostgres.Connection:
        """A dedicated connection outside the pool (for LISTEN).  The caller closes it."""
        return await self._connect(f"{self._app}_{purpose}")

    async def tryWithAdvisoryLock(self, key: int, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run ``fn()`` while holding session advisory lock ``key``, if it is free.

        Non-blocking and non-sticky: returns ``(False, None)`` at once when another session
        holds the lock; otherwise ``(True, result)``, unlocking afterwards.  The lock lives on a
        pinned pool connection, so if that connection dies the lock is released by PostgreSQL.
        ``fn`` uses the pool as usual (other connections).
        """
        conn = await self._acquire()
        try:
            rows = await conn.runQuery("SELECT pg_try_advisory_lock(%s)", (key,))
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            cause = f"database connection lost: {str(e).strip()}"
            self._replace(conn, cause)
            raise DatabaseUnavailable(cause) from e
        except BaseException:
            self._release(conn)
            raise
        if not rows[0][0]:
            self._release(conn)
            return False, None
        try:
            result = await defer.maybeDeferred(_call_maybe_coroutine, fn)
        finally:
            try:
                await conn.runQuery("SELECT pg_advisory_unlock(%s)", (key,))
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                self._replace(conn, f"database connection lost: {str(e).strip()}")
            else:
                self._release(conn)
        return True, result


def _call_maybe_coroutine(fn, *args, **kwargs):
    result = fn(*args, **kwargs)
    if hasattr(result, "__await__") and not isinstance(result, defer.Deferred):
        return defer.ensureDeferred(result)
    return result


def _sleep(reactor, seconds: float) -> defer.Deferred:
    from twisted.internet import task
    return task.deferLater(reactor, seconds, lambda: None)


# Advisory lock keys, one place.  The numbers follow the Go original where it has them.
LOCK_HEALTH_CHECK = 104
LOCK_SCHEMA_MIGRATE = 105
LOCK_MODEL_LOAD = 108


async def _given_up_cleanly(statement: defer.Deferred):
    """``statement``'s outcome; when the caller gives up (its Deferred is cancelled), the
    server is asked to cancel the statement and the caller waits for it to end before the
    connection can go back to the pool.

    txpostgres cancels by asking the server and raises its private ``_CancelInProgress`` out
    of ``Deferred.cancel()`` (the connection must finish the exchange before it is reused): a
    caller cancelling a router call during a cold load got that exception instead of its
    Deferred failing.  The statement's own Deferred is therefore never the one cancelled."""
    try:
        return await shielded(statement)
    except defer.CancelledError:
        if not statement.called:
            ended: defer.Deferred = defer.Deferred()
            statement.addBoth(lambda _: ended.callback(None))
            try:
                statement.cancel()
            except Exception:  # txpostgres's _CancelInProgress: the server was asked
                pass
            while not ended.called:
                try:
                    await shielded(ended)
                except defer.CancelledError:
                    continue  # cancelled again: the connection still needs the end
        raise
