"""DatabaseService against real PostgreSQL: embedded (pgserver) in a temporary data directory,
and a configured server from the ``pg_dsn`` fixture.

Every service a test starts is stopped in a finalizer, so no embedded server outlives a test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg2
import pytest
import pytest_twisted

from localai_tw.db.embedded import DataDirectoryInUse, EmbeddedDatabaseError, EmbeddedPostgres
from localai_tw.db.migrate import load_migrations
from localai_tw.db.pool import Database
from localai_tw.db.service import (DatabaseService, DatabaseServiceStopped,
                                   DatabaseStartupError)


@pytest.fixture
def data_dir():
    """A fresh directory for an embedded server, deliberately NOT under pytest's tmp_path.

    As root, pgserver runs PostgreSQL as the user ``pgserver`` and opens the parents of the data
    directory to it; but every pytest that starts (another suite on this machine, say) resets
    ``/tmp/pytest-of-root`` to mode 0700, which locks ``pgserver`` out of a server running under
    it ("could not open pg_control: Permission denied").  ``/tmp`` itself is never tightened.
    """
    path = Path(tempfile.mkdtemp(prefix="ltw-embedded-"))
    yield path
    leaked = kill_servers_in(path)
    shutil.rmtree(path, ignore_errors=True)
    assert not leaked, f"embedded PostgreSQL left running in {path}: pids {leaked}"


def kill_servers_in(path: Path) -> list[int]:
    """Kill any postmaster still running on a data directory under ``path``; their pids."""
    import psutil

    leaked = []
    for proc in psutil.process_iter(attrs=["name", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if (proc.info["name"] or "").startswith("postgres") and "-D" in cmdline \
                and any(arg.startswith(str(path)) for arg in cmdline):
            leaked.append(proc.pid)
            proc.kill()
    return leaked


@pytest.fixture
def services(data_dir):
    """Starts DatabaseServices and stops every one still running when the test ends (before
    ``data_dir`` is checked and removed, hence the dependency)."""
    started: list[DatabaseService] = []

    def start(*args, **kwargs) -> DatabaseService:
        service = DatabaseService(*args, **kwargs)
        service.startService()
        started.append(service)
        return service

    yield start
    for service in reversed(started):
        if service.running:
            pytest_twisted.blockon(service.stopService())


def postmaster_running(pgdata) -> bool:
    return (pgdata / "postmaster.pid").exists()


@pytest_twisted.ensureDeferred
async def test_embedded_data_persists_across_restarts(services, data_dir):
    first = services(None, data_dir)
    assert first.readiness() == (False, "starting the embedded PostgreSQL")
    db = await first.whenReady()
    assert first.readiness() == (True, "ready")
    pgdata = first.embedded.pgdata
    assert pgdata == data_dir.resolve() / "postgres"
    assert "password" not in first.embedded.dsn
    await db.runOperation("CREATE TABLE kept (v text)")
    await db.runOperation("INSERT INTO kept VALUES ('across restarts')")
    version = (await db.runQuery("SELECT max(version) FROM schema_migrations"))[0][0]
    assert version == load_migrations()[-1].version

    await first.stopService()
    assert db.closed
    assert not postmaster_running(pgdata)
    assert first.readiness() == (False, "stopped")

    second = services(None, data_dir)
    db = await second.whenReady()
    assert await db.runQuery("SELECT v FROM kept") == [("across restarts",)]
    await second.stopService()
    assert not postmaster_running(pgdata)


@pytest_twisted.ensureDeferred
async def test_second_owner_is_refused_and_shares_through_the_dsn(services, data_dir):
    owner = services(None, data_dir)
    await owner.whenReady()
    dsn = owner.embedded.dsn

    intruder = services(None, data_dir)
    with pytest.raises(DatabaseStartupError) as info:
        await intruder.whenReady()
    message = str(info.value)
    assert "in use by another process" in message
    assert f'--database-url "{dsn}"' in message
    assert intruder.readiness()[0] is False
    await intruder.stopService()
    assert postmaster_running(owner.embedded.pgdata), "the refused process stopped the server"

    sharer = services(dsn)  # the way a second frontend on this machine shares it
    db = await sharer.whenReady()
    assert await db.runQuery("SELECT 1") == [(1,)]
    await sharer.stopService()
    await owner.stopService()


@pytest_twisted.ensureDeferred
async def test_stale_pid_file_of_a_dead_process_is_cleared(services, data_dir):
    first = services(None, data_dir)
    await first.whenReady()
    pgdata = first.embedded.pgdata
    await first.stopService()
    # A crash (or reboot) leaves postmaster.pid naming a process that is gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (pgdata / "postmaster.pid").write_text(f"{dead.pid}\n{pgdata}\n")

    second = services(None, data_dir)
    db = await second.whenReady()
    assert await db.runQuery("SELECT 1") == [(1,)]


@pytest_twisted.ensureDeferred
async def test_pid_file_naming_another_program_is_a_clear_error(services, data_dir):
    first = services(None, data_dir)
    await first.whenReady()
    pgdata = first.embedded.pgdata
    await first.stopService()
    # The pid was reused by some other program after a reboot: this test process.
    (pgdata / "postmaster.pid").write_text(f"{os.getpid()}\n{pgdata}\n")

    second = services(None, data_dir)
    with pytest.raises(DatabaseStartupError) as info:
        await second.whenReady()
    assert "not a PostgreSQL server" in str(info.value)
    assert f"remove {pgdata / 'postmaster.pid'}" in str(info.value)
    assert "--data-dir" in str(info.value)


@pytest_twisted.ensureDeferred
async def test_foreign_directory_is_refused(services, data_dir):
    (data_dir / "postgres").mkdir()
    (data_dir / "postgres" / "notes.txt").write_text("mine")
    service = services(None, data_dir)
    with pytest.raises(DatabaseStartupError, match="not a PostgreSQL data directory"):
        await service.whenReady()
    assert (data_dir / "postgres" / "notes.txt").read_text() == "mine"


@pytest_twisted.ensureDeferred
async def test_stop_during_embedded_startup_leaves_no_server(services, data_dir):
    service = services(None, data_dir)
    ready = service.whenReady()
    await service.stopService()  # while initdb / pg_ctl is still running in a thread
    with pytest.raises(DatabaseServiceStopped):
        await ready
    assert not postmaster_running(data_dir.resolve() / "postgres")


@pytest_twisted.ensureDeferred
async def test_embedded_server_directly(data_dir):
    embedded = EmbeddedPostgres(data_dir)
    try:
        dsn = await embedded.start()
        conn = psycopg2.connect(dsn)
        conn.close()
        with pytest.raises(RuntimeError):
            embedded.start()
    finally:
        await embedded.stop()
    assert not postmaster_running(embedded.pgdata)
    with pytest.raises(psycopg2.OperationalError):
        psycopg2.connect(dsn, connect_timeout=2)


def test_data_directory_in_use_is_an_embedded_error():
    assert issubclass(DataDirectoryInUse, EmbeddedDatabaseError)


# -- a configured server ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_configured_database_is_migrated(services, pg_dsn):
    service = services(pg_dsn)
    db = await service.whenReady()
    assert isinstance(db, Database)
    assert service.embedded is None
    rows = await db.runQuery("SELECT count(*) FROM schema_migrations")
    assert rows == [(len(load_migrations()),)]
    await service.stopService()
    assert db.closed


@pytest_twisted.ensureDeferred
async def test_schema_too_new_fails_startup_naming_database_url(services, pg_dsn):
    service = services(pg_dsn)
    db = await service.whenReady()
    await db.runOperation("INSERT INTO schema_migrations (version, name) VALUES (9999, 'future')")
    await service.stopService()

    again = services(pg_dsn)
    with pytest.raises(DatabaseStartupError) as info:
        await again.whenReady()
    assert "newer" in str(info.value)
    assert "--database-url" in str(info.value)
    ready, reason = again.readiness()
    assert not ready and "newer" in reason


@pytest_twisted.ensureDeferred
async def test_unreachable_database_fails_startup_naming_database_url(services):
    service = services("postgresql://postgres:hunter2@127.0.0.1:1/nothing")
    with pytest.raises(DatabaseStartupError) as info:
        await service.whenReady()
    message = str(info.value)
    assert "--database-url" in message and "LOCALAI_DATABASE_URL" in message
    assert "hunter2" not in message
    assert "hunter2" not in service.readiness()[1]
