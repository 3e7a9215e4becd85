"""The database as a Twisted service: resolve the DSN, connect the pool, migrate, then serve.

``DatabaseService`` is the one place a process's ``Database`` comes from.  On start it uses the
configured ``--database-url`` or, when there is none, starts the embedded PostgreSQL in
``<data-dir>/postgres``; it then opens the pool and applies migrations.  Other services ask for
the pool with ``whenReady()``; health endpoints read ``readiness()``.  On stop it closes the
pool first and only then stops the embedded server, so no connection is cut under a query.

Starting is asynchronous: ``startService`` returns at once and a failure (unreachable server,
schema newer than this code) arrives through ``whenReady()`` as ``DatabaseStartupError``, whose
message names ``--database-url`` (or ``--data-dir``).  Deciding to end the process on such a
failure belongs to the program that owns this service, not to the service.

It never blocks the reactor and never logs a password (DSNs pass through ``redact_dsn``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from twisted.application.service import Service
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from .embedded import EmbeddedDatabaseError, EmbeddedPostgres
from .migrate import SchemaTooNew, migrate
from .pool import Database, DatabaseError, redact_dsn

log = Logger()


class DatabaseStartupError(Exception):
    """The database could not be made ready; the message says which option to look at."""


class DatabaseServiceStopped(Exception):
    """The service was stopped before the database became ready."""


STARTING, READY, FAILED, STOPPED = "starting", "ready", "failed", "stopped"


class DatabaseService(Service):
    """A started, migrated ``Database``, on the configured server or an embedded one.

    :param database_url: libpq DSN or URL; ``None`` starts the embedded server.
    :param data_dir: where the embedded server lives (``<data_dir>/postgres``).
    :param pool_size: connections in the pool.
    :param connect_timeout: seconds allowed for opening the pool before startup fails.
    :param embedded_factory: ``factory(data_dir, reactor)`` returning an ``EmbeddedPostgres``
        (tests substitute it).
    """

    name = "database"

    def __init__(self, database_url: str | None, data_dir: str | Path | None = None, *,
                 pool_size: int = 4, connect_timeout: float = 30.0, reactor: Any = None,
                 application_name: str = "localai_tw",
                 embedded_factory: Callable[..., EmbeddedPostgres] = EmbeddedPostgres):
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        if database_url is None and data_dir is None:
            raise ValueError("DatabaseService needs a database_url or a data_dir")
        self._reactor = reactor
        self.database_url = database_url
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.pool_size = pool_size
        self.connect_timeout = connect_timeout
        self.application_name = application_name
        self._embedded_factory = embedded_factory
        self.embedded: EmbeddedPostgres | None = None
        self.database: Database | None = None
        self.state = STOPPED
        self.reason = "not started"
        self._startup: defer.Deferred | None = None
        self._outcome: Database | Failure | None = None
        self._waiters: list[defer.Deferred] = []

    # -- what other parts ask ------------------------------------------------------------

    def whenReady(self) -> defer.Deferred:
        """Fires with the ready ``Database``, or fails with ``DatabaseStartupError`` (or
        ``DatabaseServiceStopped`` when the service stops first)."""
        if self._outcome is not None:
            return defer.succeed(self._outcome) if isinstance(self._outcome, Database) \
                else defer.fail(self._outcome)
        d: defer.Deferred = defer.Deferred(lambda d: self._waiters.remove(d)
                                           if d in self._waiters else None)
        self._waiters.append(d)
        return d

    def readiness(self) -> tuple[bool, str]:
        """``(ready, reason)``: why the database is not ready yet, for ``/readyz``."""
        return self.state == READY, self.reason

    # -- lifecycle ----------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.state, self.reason, self._outcome = STARTING, "database starting", None
        self._startup = defer.ensureDeferred(self._start())
        self._startup.addCallbacks(self._succeeded, self._failed)

    async def _start(self) -> Database:
        if self.database_url is not None:
            dsn, where = self.database_url, "--database-url"
        else:
            self.reason = "starting the embedded PostgreSQL"
            self.embedded = self._embedded_factory(self.data_dir, self._reactor)
            try:
                dsn = await self.embedded.start()
            except EmbeddedDatabaseError as e:
                raise DatabaseStartupError(
                    f"the embedded PostgreSQL (--data-dir {self.data_dir}) could not be used: "
                    f"{e}. Set --database-url (env LOCALAI_DATABASE_URL) to use another "
                    "PostgreSQL server instead") from e
            where = f"the embedded PostgreSQL in {self.embedded.pgdata}"

        self.reason = "connecting to the database"
        log.info("connecting to PostgreSQL at {dsn}", dsn=redact_dsn(dsn))
        self.database = Database(dsn, size=self.pool_size, reactor=self._reactor,
                                 application_name=self.application_name)
        opening = defer.ensureDeferred(self.database.start())
        opening.addTimeout(self.connect_timeout, self._reactor)
        try:
            await opening
        except defer.TimeoutError:
            raise DatabaseStartupError(
                f"could not connect to PostgreSQL at {redact_dsn(dsn)} within "
                f"{self.connect_timeout:g}s; check {where} (env LOCALAI_DATABASE_URL)") from None
        except DatabaseError as e:
            raise DatabaseStartupError(
                f"{e}; check {where} (env LOCALAI_DATABASE_URL)") from e

        self.reason = "applying schema migrations"
        try:
            version = await migrate(self.database)
        except SchemaTooNew as e:
            raise DatabaseStartupError(f"{e} (database named by {where})") from e
        except DatabaseError as e:
            raise DatabaseStartupError(
                f"migrating the database failed: {e}; check {where}") from e
        log.info("database ready at schema version {version}", version=version)
        return self.database

    def _succeeded(self, database: Database) -> None:
        self.state, self.reason, self._outcome = READY, "ready", database
        self._settle(database)

    def _failed(self, failure: Failure) -> None:
        # libpq messages carry newlines and tabs; one line reads better in a log and in JSON.
        if not self.running:
            failure = Failure(DatabaseServiceStopped("the database service was stopped"))
            self.state, self.reason = STOPPED, "stopped"
        else:
            if not failure.check(DatabaseStartupError):
                failure = Failure(DatabaseStartupError(
                    f"database startup failed: {failure.getErrorMessage()}"))
            self.state, self.reason = FAILED, " ".join(failure.getErrorMessage().split())
        self._outcome = failure
        self._settle(failure)

    def _settle(self, outcome: Any) -> None:
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            if isinstance(outcome, Failure):
                d.errback(outcome)
            else:
                d.callback(outcome)

    def stopService(self) -> defer.Deferred:
        super().stopService()
        return defer.ensureDeferred(self._stop())

    async def _stop(self) -> None:
        if self._startup is not None and not self._startup.called:
            self._startup.cancel()  # _failed sees running == False: reports "stopped"
        self._startup = None
        self.state, self.reason = STOPPED, "stopped"
        # Pool first, then the server it talks to.
        if self.database is not None:
            self.database.close()
            self.database = None
        if self.embedded is not None:
            embedded, self.embedded = self.embedded, None
            await embedded.stop()
        self._outcome = Failure(DatabaseServiceStopped("the database service was stopped"))
