"""An embedded PostgreSQL server for one machine, run with the ``pgserver`` package.

With no ``--database-url``, a frontend keeps its cluster state in a PostgreSQL server that it
starts itself in ``<data-dir>/postgres`` (``initdb`` on first use) and stops when it stops, so a
single machine needs nothing but ``pip install``.

What pgserver does, and what follows for an operator:

* The server listens on a Unix socket in the data directory (``-h ""``: no TCP port at all), and
  trusts every local connection (no password exists, so none can be logged).  The DSN this
  module logs at start, ``host=<data-dir>/postgres port=5432 user=postgres dbname=postgres``,
  is what a second process on the same machine passes as ``--database-url`` to share it
  (pgserver moves the socket to ``$XDG_RUNTIME_DIR/python_PostgresServer/<hash>`` when the data
  path is too long for a socket name; the logged DSN names wherever it really is).  The first
  process owns the server: when it stops, the server stops, and the second one's pool keeps
  retrying until it comes back.  Replicas on other machines need a real PostgreSQL server.
* One process owns a data directory at a time, enforced by an ``flock`` on
  ``<data-dir>/postgres.lock`` (the kernel drops it when the owner dies, so it never goes
  stale).  A second process pointed at the same ``--data-dir`` fails at once with
  ``DataDirectoryInUse``, whose message gives the DSN to use instead.
* As root, pgserver runs PostgreSQL as the system user ``pgserver`` (created with ``useradd``
  when missing), gives it the data directory, and adds ``o+rx`` to every parent directory of the
  data directory and of its own install (``/root`` included).  Prefer ``--data-dir`` outside
  ``/root`` when running as root.
* A server left running by an owner that crashed is adopted and stopped at our shutdown; a
  ``postmaster.pid`` whose process is gone is removed; one whose pid now belongs to some other
  program (a reboot reused it) is refused with a message saying which file to remove.

Every pgserver call blocks (initdb, pg_ctl, a psycopg2 check), so each runs in the reactor's
thread pool; nothing here blocks the reactor.
"""

from __future__ import annotations

import errno
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions
from twisted.internet import defer, threads
from twisted.logger import Logger

log = Logger()

OWNER_LOCK_NAME = "postgres.lock"
PGDATA_NAME = "postgres"


class EmbeddedDatabaseError(Exception):
    """The embedded PostgreSQL server could not be started or reached."""


class DataDirectoryInUse(EmbeddedDatabaseError):
    """Another process owns the embedded server in this data directory."""


def _import_pgserver():
    # pgserver computes platformdirs.user_runtime_path at import; without XDG_RUNTIME_DIR that
    # warns (and falls back to /tmp/runtime-<uid>), which is harmless noise in our logs.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        from pgserver import postgres_server
        from pgserver._commands import pg_ctl
    return postgres_server, pg_ctl


def _log_tail(pgdata: Path, lines: int = 15) -> str:
    try:
        text = (pgdata / "log").read_text(errors="replace")
    except OSError:
        return "(no server log)"
    return "\n".join(text.splitlines()[-lines:]) or "(server log empty)"


def _read_pid_file(pgdata: Path) -> list[str] | None:
    try:
        return (pgdata / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return None


def _is_postgres_for(pid: int, pgdata: Path) -> bool | None:
    """True if ``pid`` is a postgres server for ``pgdata``; False if it is something else or
    gone; None if it is alive but cannot be inspected."""
    import psutil

    try:
        proc = psutil.Process(pid)
        name = proc.name()
        cmdline = proc.cmdline()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return None
    return name.startswith("postgres") and str(pgdata) in cmdline


def _pid_alive(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)


class EmbeddedPostgres:
    """The embedded server in ``<data_dir>/postgres``: ``start()`` fires with its DSN.

    ``start()`` and ``stop()`` return Deferreds and do their work in the reactor's thread pool.
    ``stop()`` waits for a ``start()`` still in progress, then stops whatever it started, so a
    shutdown that races startup leaves no server behind.
    """

    def __init__(self, data_dir: str | os.PathLike, reactor: Any = None):
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        self._reactor = reactor
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.pgdata = self.data_dir / PGDATA_NAME
        self.dsn: str | None = None
        self._server: Any = None
        self._lock_fd: int | None = None
        self._start_attempt: defer.Deferred | None = None
        self._start_finished = False

    def _in_thread(self, fn, *args) -> defer.Deferred:
        return threads.deferToThreadPool(self._reactor, self._reactor.getThreadPool(), fn, *args)

    def start(self) -> defer.Deferred:
        """Start (or adopt) the server; fires with its DSN or fails with EmbeddedDatabaseError.

        Cancelling the returned Deferred abandons the wait, not the thread: a server that comes
        up afterwards is still stopped by ``stop()``.
        """
        if self._start_attempt is not None:
            raise RuntimeError("EmbeddedPostgres.start() called twice without stop()")
        result: defer.Deferred = defer.Deferred()

        def deliver(outcome):
            # Set first: whoever result's callbacks run may call stop() right here, while
            # this attempt is still running its own callbacks and cannot be awaited.
            self._start_finished = True
            if not result.called:  # else the caller cancelled; stop() cleans up
                result.callback(outcome)
            return None

        self._start_finished = False
        attempt = self._in_thread(self._start_blocking)
        attempt.addCallback(self._started)
        attempt.addBoth(deliver)
        self._start_attempt = attempt
        return result

    def _started(self, dsn: str) -> str:
        self.dsn = dsn
        log.info("embedded PostgreSQL is running in {pgdata}; other processes on this machine "
                 "can share it with --database-url \"{dsn}\"", pgdata=str(self.pgdata), dsn=dsn)
        return dsn

    def stop(self) -> defer.Deferred:
        """Stop the server this object started or adopted, then release the data directory."""
        async def stop() -> None:
            if self._start_attempt is not None and not self._start_finished:
                await self._start_attempt  # never fails: deliver() consumed the outcome
            self._start_attempt = None
            await self._in_thread(self._stop_blocking)
        return defer.ensureDeferred(stop())

    # -- in the thread pool -------------------------------------------------------------

    def _start_blocking(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._take_ownership()
        try:
            return self._start_owned()
        except BaseException:
            self._release_ownership()
            raise

    def _take_ownership(self) -> None:
        import fcntl

        path = self.data_dir / OWNER_LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise EmbeddedDatabaseError(f"cannot lock {path}: {e}") from e
            raise DataDirectoryInUse(self._in_use_message(path)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _in_use_message(self, lock_path: Path) -> str:
        try:
            owner = lock_path.read_text().strip() or "unknown"
        except OSError:
            owner = "unknown"
        lines = _read_pid_file(self.pgdata)
        if lines and len(lines) >= 5 and lines[3].strip():
            share = (f"start this process with --database-url "
                     f"\"{self._dsn_for(lines[4].strip() or str(self.pgdata), lines[3])}\"")
        else:
            share = "start this process with --database-url set to the DSN the owner logged"
        return (f"the data directory {self.data_dir} is in use by another process (pid {owner}) "
                f"that owns its embedded PostgreSQL; to share that database, {share}; "
                f"or give this process its own --data-dir")

    def _release_ownership(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    @staticmethod
    def _dsn_for(socket_dir: str, port: Any) -> str:
        return psycopg2.extensions.make_dsn(host=socket_dir, port=int(port), user="postgres",
                                            dbname="postgres")

    def _check_data_dir(self) -> None:
        """Refuse a directory that is not ours; clear a pid file whose process is gone."""
        if self.pgdata.exists() and not self.pgdata.is_dir():
            raise EmbeddedDatabaseError(f"{self.pgdata} exists and is not a directory; "
                                        "choose another --data-dir")
        if self.pgdata.is_dir() and not (self.pgdata / "PG_VERSION").exists():
            leftovers = [p.name for p in self.pgdata.iterdir() if p.name != "log"]
            if leftovers:
                raise EmbeddedDatabaseError(
                    f"{self.pgdata} is not empty and is not a PostgreSQL data directory (no "
                    "PG_VERSION); move its contents away or choose another --data-dir")
        lines = _read_pid_file(self.pgdata)
        if lines is None:
            return
        pid_file = self.pgdata / "postmaster.pid"
        try:
            pid = int(lines[0].strip())
        except (IndexError, ValueError):
            pid = None
        if pid is None or not _pid_alive(pid):
            # We hold the owner lock and no process has that pid: a crash or a reboot left the
            # file behind.  PostgreSQL itself would ignore it; pgserver would trip on it.
            log.warn("removing stale {pid_file} (pid {pid} is gone)", pid_file=str(pid_file),
                     pid=pid)
            pid_file.unlink(missing_ok=True)
            return
        verdict = _is_postgres_for(pid, self.pgdata)
        if verdict is False:
            raise EmbeddedDatabaseError(
                f"{pid_file} names pid {pid}, which is not a PostgreSQL server for this data "
                "directory (the file outlived a crash or reboot and the pid was reused); no "
                f"server is using {self.pgdata}: remove {pid_file} and start again")
        if len(lines) < 8:
            raise EmbeddedDatabaseError(
                f"PostgreSQL (pid {pid}) is still starting or stopping in {self.pgdata}; "
                "wait for it, or stop it, and start again")
        log.info("adopting the PostgreSQL server (pid {pid}) left running in {pgdata} by an "
                 "earlier process; it will be stopped when this one stops", pid=pid,
                 pgdata=str(self.pgdata))

    def _start_owned(self) -> str:
        postgres_server, _ = _import_pgserver()
        self._check_data_dir()
        self.pgdata.mkdir(mode=0o700, exist_ok=True)
        if os.name != "nt" and os.geteuid() == 0:
            log.warn("running as root: pgserver runs PostgreSQL as the system user 'pgserver' "
                     "(creating it if missing), gives it {pgdata}, and adds o+rx to every "
                     "parent directory of it", pgdata=str(self.pgdata))
        log.info("starting embedded PostgreSQL in {pgdata}", pgdata=str(self.pgdata))
        try:
            # cleanup_mode=None: this object, not pgserver's atexit hook, decides when the
            # server stops (pgserver stops only when its on-disk list of handle pids empties,
            # which a crashed process would keep from ever happening).
            server = postgres_server.PostgresServer(self.pgdata, cleanup_mode=None)
        except subprocess.CalledProcessError as e:
            raise EmbeddedDatabaseError(
                f"embedded PostgreSQL failed to start in {self.pgdata} ({e.cmd[0]} exited with "
                f"status {e.returncode}); end of its log:\n{_log_tail(self.pgdata)}") from e
        except subprocess.TimeoutExpired as e:
            raise EmbeddedDatabaseError(
                f"embedded PostgreSQL did not start within {e.timeout}s in {self.pgdata}; end "
                f"of its log:\n{_log_tail(self.pgdata)}") from e
        except (AssertionError, RuntimeError, OSError) as e:
            raise EmbeddedDatabaseError(
                f"embedded PostgreSQL could not be started in {self.pgdata}: "
                f"{e!r}; end of its log:\n{_log_tail(self.pgdata)}") from e
        self._server = server
        info = server.get_postmaster_info()
        if info.socket_dir is not None:
            dsn = self._dsn_for(str(info.socket_dir), info.port)
        else:  # pgserver uses TCP on Windows only
            dsn = psycopg2.extensions.make_dsn(host=info.hostname, port=info.port,
                                               user="postgres", dbname="postgres")
        self._check_connects(dsn)
        return dsn

    def _check_connects(self, dsn: str) -> None:
        try:
            conn = psycopg2.connect(dsn, connect_timeout=10)
        except psycopg2.Error as e:
            raise EmbeddedDatabaseError(
                f"embedded PostgreSQL in {self.pgdata} reports ready but refuses connections: "
                f"{str(e).strip()}; end of its log:\n{_log_tail(self.pgdata)}") from e
        conn.close()

    def _stop_blocking(self) -> None:
        server, self._server = self._server, None
        try:
            if server is not None:
                _, pg_ctl = _import_pgserver()
                try:
                    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.pgdata,
                           user=server.system_user, timeout=120)
                except subprocess.CalledProcessError:
                    if (self.pgdata / "postmaster.pid").exists():
                        log.error("could not stop embedded PostgreSQL in {pgdata}; end of its "
                                  "log:\n{tail}", pgdata=str(self.pgdata),
                                  tail=_log_tail(self.pgdata))
                    # otherwise it was already stopped, which is what we wanted
                else:
                    log.info("embedded PostgreSQL in {pgdata} stopped", pgdata=str(self.pgdata))
        finally:
            self._release_ownership()
