"""The pool and the migration runner against a real PostgreSQL."""

import json

import psycopg2
import pytest
import pytest_twisted
from twisted.internet import defer
from twisted.web.server import NOT_DONE_YET

from localai_tw.db.migrate import Migration, SchemaTooNew, load_migrations, migrate
from localai_tw.db.pool import Database, DatabaseUnavailable, PoolClosed


@pytest_twisted.ensureDeferred
async def test_query_operation_and_transaction(db):
    await db.runOperation("CREATE TABLE t (k int PRIMARY KEY, v text)")
    await db.runOperation("INSERT INTO t VALUES (%s, %s)", (1, "one"))

    async def move(cursor):
        await cursor.execute("UPDATE t SET v = %s WHERE k = 1", ("uno",))
        raise RuntimeError("roll it back")

    with pytest.raises(RuntimeError):
        await db.runInteraction(move)
    assert await db.runQuery("SELECT v FROM t WHERE k = 1") == [("one",)]


@pytest_twisted.ensureDeferred
async def test_more_callers_than_connections_all_complete(db):
    results = await defer.gatherResults(
        [db.runQuery("SELECT %s::int, pg_sleep(0.01)", (i,)) for i in range(20)]
    )
    assert sorted(r[0][0] for r in results) == list(range(20))


@pytest_twisted.ensureDeferred
async def test_a_caller_that_gives_up_cancels_its_statement_cleanly(pg_dsn):
    """Cancelling a statement's Deferred (a client that left during a cold load) must not
    raise out of ``cancel()`` (txpostgres raised its private _CancelInProgress there), fails
    that caller with CancelledError, and leaves the connection usable by the next caller only
    once the server has ended the statement."""
    database = Database(pg_dsn, size=1)
    await database.start()
    try:
        slow = database.runQuery("SELECT pg_sleep(30)")
        await defer.ensureDeferred(_sleep(0.2))  # the statement is on the server
        slow.cancel()  # raised _CancelInProgress before
        with pytest.raises(defer.CancelledError):
            await slow
        assert await database.runQuery("SELECT 1") == [(1,)]  # the one connection, reused
    finally:
        database.close()


async def _sleep(seconds: float) -> None:
    from twisted.internet import reactor, task
    await task.deferLater(reactor, seconds, lambda: None)


@pytest_twisted.ensureDeferred
async def test_killed_backend_fails_one_call_then_pool_recovers(pg_dsn):
    database = Database(pg_dsn, size=1)
    await database.start()
    try:
        (pid,) = (await database.runQuery("SELECT pg_backend_pid()"))[0]
        admin = psycopg2.connect(pg_dsn)
        admin.autocommit = True
        admin.cursor().execute("SELECT pg_terminate_backend(%s)", (pid,))
        admin.close()
        with pytest.raises(DatabaseUnavailable):
            await database.runQuery("SELECT 1")
        # The replacement connection arrives in the background.
        assert await database.runQuery("SELECT 1") == [(1,)]
    finally:
        database.close()


@pytest_twisted.ensureDeferred
async def test_closed_pool_refuses(pg_dsn):
    database = Database(pg_dsn, size=1)
    await database.start()
    database.close()
    with pytest.raises(PoolClosed):
        await database.runQuery("SELECT 1")


@pytest_twisted.ensureDeferred
async def test_unreachable_server_is_named_without_password():
    database = Database("host=127.0.0.1 port=1 user=u password=hunter2 dbname=x", size=1)
    with pytest.raises(DatabaseUnavailable) as info:
        await database.start()
    assert "hunter2" not in str(info.value)
    assert "port=1" in str(info.value)


@pytest_twisted.ensureDeferred
async def test_advisory_lock_is_exclusive_and_released(db):
    entered = defer.Deferred()
    release = defer.Deferred()

    async def hold():
        entered.callback(None)
        await release

    first = defer.ensureDeferred(db.tryWithAdvisoryLock(4242, hold))
    await entered
    assert await db.tryWithAdvisoryLock(4242, lambda: "never") == (False, None)
    release.callback(None)
    assert (await first)[0] is True
    assert await db.tryWithAdvisoryLock(4242, lambda: "again") == (True, "again")


@pytest_twisted.ensureDeferred
async def test_migrations_apply_once_and_record_versions(db):
    known = load_migrations()
    assert await migrate(db) == known[-1].version
    rows = await db.runQuery("SELECT version FROM schema_migrations ORDER BY version")
    assert [r[0] for r in rows] == [m.version for m in known]


@pytest_twisted.ensureDeferred
async def test_concurrent_migrations_both_succeed(pg_dsn):
    extra = load_migrations() + [
        Migration(len(load_migrations()) + 1, "probe",
                  "CREATE TABLE probe_once (x int); INSERT INTO probe_once VALUES (1)")
    ]
    a, b = Database(pg_dsn, size=1), Database(pg_dsn, size=1)
    await a.start()
    await b.start()
    try:
        versions = await defer.gatherResults(
            [defer.ensureDeferred(migrate(a, extra)), defer.ensureDeferred(migrate(b, extra))]
        )
        assert versions == [extra[-1].version] * 2
        assert await a.runQuery("SELECT count(*) FROM probe_once") == [(1,)]
    finally:
        a.close()
        b.close()


@pytest_twisted.ensureDeferred
async def test_schema_newer_than_code_is_refused(db):
    await db.runOperation(
        "INSERT INTO schema_migrations (version, name) VALUES (9999, 'from_the_future')")
    with pytest.raises(SchemaTooNew) as info:
        await migrate(db)
    assert "9999" in str(info.value)


@pytest_twisted.ensureDeferred
async def test_readyz_stays_ready_while_the_pool_is_busy_but_answering(pg_dsn):
    """Issue 15 §4: during a reconnect storm /readyz answered 503 five times in a row while the
    replica served, because its ``SELECT 1`` queued behind thousands of claims and hit its 2 s
    timeout.  The pool's own answers prove the database is there.  Make answered_within always
    False: this fails (the probe waits behind the busy pool and times out)."""
    from twisted.internet import reactor
    from twisted.web.test.requesthelper import DummyRequest

    from localai_tw.frontend.api.probes import ReadinessResource

    class Checked:
        def __init__(self, database):
            self.database = database

        def readiness(self):
            return True, "ready"

    database = Database(pg_dsn, size=1)
    await database.start()
    try:
        await database.runQuery("SELECT 1")
        busy = [database.runQuery("SELECT pg_sleep(1.5)") for _ in range(3)]  # 4.5 s of queue
        request = DummyRequest([b""])
        result = ReadinessResource(Checked(database), reactor, probe_timeout=2.0).render_GET(
            request)
        assert request.responseCode in (None, 200) and json.loads(result) == {"ready": True}
        await defer.gatherResults(busy)
        database.close()
        request = DummyRequest([b""])  # a closed pool is not ready, whatever it answered
        result = ReadinessResource(Checked(database), reactor, probe_timeout=2.0).render_GET(
            request)
        if result is NOT_DONE_YET:
            await eventually_finished(request)
        assert request.responseCode == 503
    finally:
        database.close()


async def eventually_finished(request):
    from twisted.internet import reactor, task

    for _ in range(100):
        if request.finished:
            return
        await task.deferLater(reactor, 0.05, lambda: None)
    raise AssertionError("the readiness probe never answered")
