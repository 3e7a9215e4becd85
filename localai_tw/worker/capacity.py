"""What a worker reports as its capacity at registration and on every heartbeat.

:class:`HostCapacity` is the default ``capacity_provider`` of a worker: the machine's total and
available RAM and the total and free space of the filesystem holding the worker's models, read
with psutil at each call (a heartbeat is every few seconds; both are single cheap system
calls).  The names are the wire's existing ``capacity`` fields, so a worker sending them works
with every frontend that knows registration.

VRAM is not reported: nothing here can read a GPU's memory without a vendor library, and a
guess would mislead the scheduler.  A field that cannot be read is left out, never sent as 0.

:func:`host_facts` (CPU count and load average) goes into the worker's own ``node.status``
answer instead (``GET /api/nodes/{id}/status``): the registration wire has no field for them,
and frontends refuse unknown capacity fields, so sending them there would break a new worker
against an older frontend.

This module must never raise into the registrar (a failed reading drops that field) and never
block on anything slower than a local ``statvfs``.
"""

from __future__ import annotations

import os

import psutil
from twisted.logger import Logger

log = Logger()


def existing_ancestor(path: str) -> str:
    """``path``, or its nearest ancestor that exists (the models directory may be created
    only when the first file is staged)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


class HostCapacity:
    """A ``capacity_provider``: RAM of the machine, disk of the filesystem holding ``path``.

    :param path: the directory the worker stores models in (its ``--data-dir``'s ``models``);
        the current directory when the worker has none.
    """

    def __init__(self, path: str | None = None):
        self.path = path or os.getcwd()

    def __call__(self) -> dict[str, int]:
        capacity: dict[str, int] = {}
        try:
            memory = psutil.virtual_memory()
            capacity["total_ram"] = int(memory.total)
            capacity["available_ram"] = int(memory.available)
        except (OSError, RuntimeError) as e:
            log.warn("reading the RAM capacity failed: {err}", err=e)
        try:
            disk = psutil.disk_usage(existing_ancestor(self.path))
            capacity["total_disk"] = int(disk.total)
            capacity["available_disk"] = int(disk.free)
        except (OSError, RuntimeError) as e:
            log.warn("reading the disk capacity of {path} failed: {err}", path=self.path, err=e)
        return capacity


def host_facts() -> dict:
    """CPU facts of this machine for ``node.status``: logical CPU count and the 1, 5 and 15
    minute load averages (what is unreadable is left out)."""
    facts: dict = {}
    count = psutil.cpu_count(logical=True)
    if count:
        facts["cpu_count"] = int(count)
    try:
        facts["load_average"] = [round(float(x), 2) for x in psutil.getloadavg()]
    except (OSError, AttributeError) as e:
        log.warn("reading the load average failed: {err}", err=e)
    return facts
