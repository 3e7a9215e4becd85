"""What a worker reports as its capacity at registration and on every heartbeat.

:class:`HostCapacity` is the default ``capacity_provider`` of a worker: the machine's total and
available RAM and the total and free space of the filesystem holding the worker's models, read
with psutil at each call (a heartbeat is every few seconds; both are single cheap system
calls).  The names are the wire's existing ``capacity`` fields, so a worker sending them works
with every frontend that knows registration.

GPU memory (``total_vram``, ``available_vram``: the sums over the machine's NVIDIA GPUs) is
reported only when the ``pynvml`` module can be imported and answers; nothing else is tried (a
guess would mislead the scheduler).  A field that cannot be read is left out, never sent as 0.

``memory_budget`` (the worker's ``--memory-budget``) caps every memory field it reports (RAM
and GPU memory, total and available): the node offers models at most that much, and the
frontends fit and evict models within it (``frontend/inference/lifecycle.py``).

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

    def __init__(self, path: str | None = None, memory_budget: int | None = None):
        self.path = path or os.getcwd()
        self.memory_budget = memory_budget

    def __call__(self) -> dict[str, int]:
        capacity: dict[str, int] = {}
        try:
            memory = psutil.virtual_memory()
            capacity["total_ram"] = int(memory.total)
            capacity["available_ram"] = int(memory.available)
        except (OSError, RuntimeError) as e:
            log.warn("reading the RAM capacity failed: {err}", err=e)
        capacity.update(gpu_memory())
        if self.memory_budget:
            for name in ("total_ram", "available_ram", "total_vram", "available_vram"):
                if name in capacity:
                    capacity[name] = min(capacity[name], self.memory_budget)
        try:
            disk = psutil.disk_usage(existing_ancestor(self.path))
            capacity["total_disk"] = int(disk.total)
            capacity["available_disk"] = int(disk.free)
        except (OSError, RuntimeError) as e:
            log.warn("reading the disk capacity of {path} failed: {err}", path=self.path, err=e)
        return capacity


def gpu_memory() -> dict[str, int]:
    """``total_vram`` and ``available_vram`` summed over the NVIDIA GPUs ``pynvml`` sees; empty
    when it is not installed, finds no GPU, or fails."""
    try:
        import pynvml  # optional: only on machines with NVIDIA's management library
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        try:
            total = free = 0
            for index in range(pynvml.nvmlDeviceGetCount()):
                info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
                total += int(info.total)
                free += int(info.free)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # NVMLError and friends: no GPU memory is reported
        log.debug("reading GPU memory failed: {err}", err=e)
        return {}
    return {"total_vram": total, "available_vram": free} if total else {}


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


#: An ``available_*`` figure counts as changed (worth a heartbeat of its own when the tunnel
#: carries liveness, ``worker/service.py``) when it moved by this share of its total ...
CAPACITY_CHANGE_SHARE = 0.02
#: ... and by at least this many bytes: free memory drifts by megabytes every second.
CAPACITY_CHANGE_MIN_BYTES = 64 * 1024 * 1024


def capacity_changed(sent: dict[str, int] | None, now: dict[str, int]) -> bool:
    """Whether ``now`` differs from the capacity last ``sent`` enough to tell the frontend at
    once: a field appeared or went, a total changed, or an available figure moved by
    :data:`CAPACITY_CHANGE_SHARE` of its total (at least :data:`CAPACITY_CHANGE_MIN_BYTES`).
    Smaller drifts ride the next heartbeat sent for another reason (the change is measured from
    what was last sent, so the frontend's figure is never further off than this)."""
    if sent is None or set(sent) != set(now):
        return True
    for name, value in now.items():
        before = sent[name]
        if not name.startswith("available_"):
            if value != before:
                return True
            continue
        total = now.get("total_" + name[len("available_"):], 0)
        if abs(value - before) >= max(CAPACITY_CHANGE_MIN_BYTES, total * CAPACITY_CHANGE_SHARE):
            return True
    return False
