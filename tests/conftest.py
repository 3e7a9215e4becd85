"""Test fixtures shared by every suite.

PostgreSQL is real, never mocked: the server named by ``LOCALAI_TEST_DSN`` when it is set,
otherwise an embedded server (the ``pgserver`` package) that this session starts and stops.
Each test that asks for a database gets its own ``CREATE DATABASE``, dropped afterwards.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid

# Nothing a test starts may write into the real ~/.local/share/localai-tw (or -worker): the
# default data directories (platformdirs reads XDG_DATA_HOME) point into a directory of this
# session, for this process and every twistd it starts.  Set before localai_tw is imported,
# since the options compute their defaults at import.
_SESSION_DATA_HOME = tempfile.mkdtemp(prefix="ltw-test-data-home-")
os.environ["XDG_DATA_HOME"] = _SESSION_DATA_HOME
atexit.register(shutil.rmtree, _SESSION_DATA_HOME, True)

import psycopg2
import pytest
import pytest_twisted

from localai_tw.db.pool import Database, dsn_with


@pytest.fixture(scope="session")
def pg_admin_dsn():
    """DSN of a maintenance database on a server where tests may create databases."""
    dsn = os.environ.get("LOCALAI_TEST_DSN")
    if dsn:
        yield dsn
        return
    import pgserver

    # Not under pytest's tmp_path: as root, pgserver runs PostgreSQL as a separate user, and
    # every pytest start resets /tmp/pytest-of-root to 0700, which would lock that user out.
    datadir = tempfile.mkdtemp(prefix="ltw-test-pg-")
    server = pgserver.get_server(datadir, cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
        shutil.rmtree(datadir, ignore_errors=True)


def _admin_exec(admin_dsn: str, sql: str) -> None:
    conn = psycopg2.connect(admin_dsn)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(sql)
    finally:
        conn.close()


@pytest.fixture
def pg_dsn(pg_admin_dsn):
    """A DSN to a brand-new empty database, dropped when the test ends."""
    name = "ltw_" + uuid.uuid4().hex[:16]
    _admin_exec(pg_admin_dsn, f'CREATE DATABASE "{name}"')
    try:
        yield dsn_with(pg_admin_dsn, dbname=name)
    finally:
        _admin_exec(pg_admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest_twisted.async_yield_fixture
async def db(pg_dsn):
    """A started ``Database`` on a fresh, fully migrated database."""
    from localai_tw.db.migrate import migrate

    database = Database(pg_dsn, size=4)
    await database.start()
    await migrate(database)
    try:
        yield database
    finally:
        database.close()
