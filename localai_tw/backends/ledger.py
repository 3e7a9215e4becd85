"""The worker's record of the backend processes it started, so that a worker restarted after a
crash (``kill -9``, OOM killer, power cut of the process) can kill what its previous run left
behind.

The record is one JSON file in the worker's data directory (``backend-processes.json``): an
entry ``{pid, create_time, key, backend, command, started_at}`` is added when a backend process
is spawned and removed when the supervisor sees it exit (whether stopped or crashed).  A worker
that exits cleanly therefore leaves an empty list; a worker that was killed leaves the entries of
the backends it was running.

At start, :meth:`ProcessLedger.reap` kills (SIGKILL, to the process group the backend leads) every
recorded process that is still alive **and** still the same process: same pid and same kernel
start time (``psutil.Process.create_time``).  A pid the kernel has since given to an unrelated
process has another start time and is left alone.  Normally there is nothing to reap: backends
are started with ``PR_SET_PDEATHSIG`` (see :mod:`localai_tw.backends.process`) and die with the
worker; the record covers what that cannot (platforms without ``prctl``, a backend that resets
its parent-death signal, a worker restarted while a dying backend still holds its port).

The file is small (one entry per live backend) and written with a synchronous
write-then-rename on the reactor thread: a few hundred bytes to a local disk, at the same moments
a process is forked, which costs more.  A file that cannot be read or written is logged and
otherwise ignored: the record is a safety net, never a reason to refuse a backend.

What this module must never do: signal a process whose start time does not match the record, or
the worker's own process or process group.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Sequence

import psutil
from twisted.logger import Logger

log = Logger()

#: File name of the record, in the worker's data directory.
LEDGER_FILE = "backend-processes.json"
#: Start times are read from /proc in clock ticks; equal processes compare equal exactly, this
#: only absorbs float rounding.
CREATE_TIME_TOLERANCE = 0.005


def process_create_time(pid: int) -> float | None:
    """The kernel's start time of a running ``pid``; None when there is no such process or
    it is a zombie (dead already, waiting for a parent to collect it)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except (psutil.Error, OSError):
        return None


class ProcessLedger:
    """The record file at ``path``: :meth:`add`, :meth:`remove`, and :meth:`reap` at start."""

    def __init__(self, path: str):
        self.path = path
        self._entries: dict[int, dict[str, Any]] = {}

    def entries(self) -> list[dict[str, Any]]:
        return list(self._entries.values())

    def add(self, pid: int, key: str, backend: str, command: Sequence[str]) -> None:
        self._entries[pid] = {
            "pid": pid, "create_time": process_create_time(pid), "key": key,
            "backend": backend, "command": list(command), "started_at": time.time(),
        }
        self._write()

    def remove(self, pid: int | None) -> None:
        if self._entries.pop(pid, None) is not None:
            self._write()

    def _write(self) -> None:
        data = {"worker_pid": os.getpid(), "processes": list(self._entries.values())}
        tmp = f"{self.path}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warn("cannot write the backend process record {path}: {error}", path=self.path,
                     error=e)

    def _read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            log.warn("cannot read the backend process record {path} ({error}); no leftover "
                     "backends are reaped", path=self.path, error=e)
            return []
        processes = data.get("processes") if isinstance(data, dict) else None
        return [p for p in processes or () if isinstance(p, dict)]

    def reap(self) -> list[dict[str, Any]]:
        """Kill the recorded processes of a previous run that are still alive and still the
        same process; forget the record.  Returns the entries that were killed."""
        reaped = []
        for entry in self._read():
            pid, recorded = entry.get("pid"), entry.get("create_time")
            if not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
                continue
            what = (f"backend {entry.get('key')} ({entry.get('backend')}, pid {pid}): "
                    f"{' '.join(map(str, entry.get('command') or ()))}")
            now = process_create_time(pid)
            if now is None:
                continue  # gone, as it should be
            if not isinstance(recorded, (int, float)) or \
                    abs(now - recorded) > CREATE_TIME_TOLERANCE:
                log.info("pid {pid} of the recorded {what} now belongs to another process "
                         "(started at another time); left alone", pid=pid, what=what)
                continue
            if _kill_leftover(pid):
                log.warn("killed leftover {what} (still running from a previous run of this "
                         "worker, recorded in {path})", what=what, path=self.path)
                reaped.append(entry)
        self._entries.clear()
        self._write()
        return reaped


def _kill_leftover(pid: int) -> bool:
    """SIGKILL the backend's process group when it leads one (it does: the spawn wrapper makes
    it a session leader), else the pid alone."""
    try:
        if os.getpgid(pid) == pid and pid != os.getpgrp():
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as e:
        log.warn("cannot kill leftover backend pid {pid}: {error}", pid=pid, error=e)
        return False
