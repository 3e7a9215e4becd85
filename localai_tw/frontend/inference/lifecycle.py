"""Model lifecycle: unload a model where it runs, make room for a cold load (eviction), and
the idle and busy watchdogs (LocalAI's ``--max-active-backends`` and watchdog ideas, across a
cluster).  Preload is :mod:`.preload`; the HTTP routes are api/lifecycle.py` and
``api/nodes.py``.

**Unload** (:meth:`ModelLifecycle.unload`): ``backend.stop`` on the node, through its tunnel
(relayed when another replica holds it).  The ``node_models`` row follows the worker's answer
and nothing else:

====================================================  ==========================================
what happened                                         the row, and the outcome
====================================================  ==========================================
the worker stopped it (or says it was not running)    deleted; ``stopped``
this replica has calls in flight on it (not forced)   untouched, worker not asked; ``busy``
the worker answered busy (the backend's ``Status``    back to ``loaded``; ``busy``
is BUSY: a request from any replica)
the row is ``staging``/``loading`` (a load runs)      untouched; ``loading``
the worker answered a failure to stop                 back to ``loaded``; ``worker-failed``
no route, absent within the grace, an unreachable     back to ``loaded``; ``not-delivered``,
peer, a transport failure, the deadline               with the condition (never "failed")
====================================================  ==========================================

While the stop is asked the row is ``unloading``, so no replica places a new request on it.
``force`` skips both busy checks (the requests in flight then fail); without it a model with
requests in flight is never unloaded.  In flight across replicas is known from the backend
itself: ``backend.stop`` with ``if_idle`` asks the backend's ``Status`` on the worker and
stops nothing when it says BUSY.  A backend that does not implement ``Status`` cannot tell,
and then only this replica's own count protects its requests (docs/models.md).

**Eviction** (:meth:`ModelLifecycle.make_room`, run by the load lock before each cold load, and
:meth:`ModelLifecycle.prefer`, used by the chooser): a node has room for a model when

- ``--max-active-backends`` is 0, or the node holds fewer other models than it, and
- the model's memory need (:func:`memory_need`: ``memory_bytes`` from its config, else the
  size of what would be staged for it, folders included; 0 = unknown, always fits) is at most the node's room: its reported
  total (GPU memory when it reports some, else RAM; the worker's ``--memory-budget`` caps
  both) minus the needs of the models it holds, and at most what it reports available.  A node
  that reports no memory always has room.

Placement prefers nodes with room.  A cold load onto a node without room first unloads the
least recently used idle models there (``last_used``, oldest first; never the model being
loaded, never a ``pinned`` one, never one with requests in flight: the unload above, not
forced), one at a time, until there is room.  When nothing can be evicted the load goes ahead
anyway, as it did before eviction existed, with a warning.

**Watchdogs** (:class:`LifecycleWatchdog`, off by default): every ``interval`` each replica
looks only at the nodes whose tunnels it holds (so two replicas never race for one model):
``--watchdog-idle-timeout`` unloads models whose ``last_used`` is older than the timeout (on
the database clock; not forced, not pinned); ``--watchdog-busy-timeout`` force-unloads a model
on which a call of *this* replica has run longer than the timeout (a stuck backend).

What this module must never do: delete a row on anything but the worker's answer; act on an
absent worker (``not-delivered`` changes nothing); evict a model with requests in flight
unless forced; compare times in Python for what the cluster shares.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable

from twisted.internet import defer
from twisted.logger import Logger

from localai_tw import errors
from localai_tw import metrics as replica_metrics

from localai_tw.localai.model_config import ModelConfig
from localai_tw.periodic import PeriodicPass
from localai_tw.frontend.inference.usage import ModelUse

log = Logger()

#: Seconds an unload waits for the worker's answer (the stop itself has its own grace there).
DEFAULT_STOP_TIMEOUT = 60.0
#: Seconds between two watchdog passes.
DEFAULT_WATCHDOG_INTERVAL = 5.0
#: Models one cold load may evict at most.
MAX_EVICTIONS = 8

STOPPED, NOT_LOADED, BUSY, LOADING = "stopped", "not-loaded", "busy", "loading"
NOT_DELIVERED, WORKER_FAILED = "not-delivered", "worker-failed"


@dataclasses.dataclass
class UnloadResult:
    """What one unload of ``model`` on ``node_id`` came to (module docstring, the table)."""

    model: str
    node_id: str
    outcome: str
    detail: str = ""
    #: the condition of a ``not-delivered`` or ``worker-failed`` outcome
    error: errors.ClusterError | None = None

    @property
    def stopped(self) -> bool:
        return self.outcome == STOPPED

    def view(self) -> dict[str, Any]:
        view = {"model": self.model, "node_id": self.node_id, "outcome": self.outcome}
        if self.detail:
            view["detail"] = self.detail
        if self.error is not None:
            view["condition"] = self.error.condition
        return view


#: Directory entries one need estimate walks at most (a model folder's files).
MAX_WALK = 10000


def memory_need(model: ModelConfig, models_dir: str) -> int:
    """Bytes ``model`` needs loaded: ``memory_bytes`` from its config, else the size of what
    would be staged for it from ``models_dir`` -- its ``files`` (a folder counts the files in
    it), the file or folder ``parameters.model`` names there, its ``download_files`` -- (what
    cannot be read counts 0), else 0 (unknown).  The sizes are a floor for what a backend holds
    (weights are read into memory or mapped); set ``memory_bytes`` where a model needs more
    (context, activations)."""
    if model.memory_bytes:
        return model.memory_bytes
    from localai_tw.frontend.inference.modelfiles import companion_downloads, implicit_model_entry

    entries = list(model.files)
    implicit = implicit_model_entry(model, models_dir)
    if implicit is not None:
        entries.append(implicit)
    entries += companion_downloads(model, entries)
    total = 0
    for f in entries:
        try:
            path = f.contained_path(models_dir)
            if os.path.isdir(path):
                total += _folder_size(path)
            else:
                total += os.stat(path).st_size
        except (OSError, ValueError):
            pass
    return total


def _folder_size(folder: str) -> int:
    total = seen = 0
    for root, dirs, files in os.walk(folder):
        for name in files:
            seen += 1
            if seen > MAX_WALK:
                return total
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                pass
    return total


@dataclasses.dataclass(frozen=True)
class NodeMemory:
    node_id: str
    total: int       # bytes the node offers to models (0 = not reported)
    available: int   # bytes it reports free (0 = not reported)


@dataclasses.dataclass(frozen=True)
class HeldModel:
    name: str
    state: str


_NODES_SQL = ("SELECT id, total_ram, available_ram, total_vram, available_vram"
              " FROM backend_nodes WHERE id = ANY(%s)")
_HELD_SQL = ("SELECT node_id, model_name, state FROM node_models WHERE node_id = ANY(%s)"
             " ORDER BY last_used ASC NULLS FIRST, model_name")


class ModelLifecycle:
    """Unload, room and eviction (module docstring).

    :param control: the ``ControlClient`` (relayed when another replica holds the tunnel);
    :param use: this replica's :class:`ModelUse` (in-flight counts, pending touches);
    :param catalog: the ``ModelCatalog`` (``pinned``, memory needs of held models).
    """

    def __init__(self, db, control, use: ModelUse, catalog, reactor, *,
                 max_active_backends: int = 0,
                 stop_timeout: float = DEFAULT_STOP_TIMEOUT,
                 metrics: replica_metrics.ReplicaMetrics = replica_metrics.DISCARD,
                 on_unloaded: Callable[[str], object] | None = None):
        self._db = db
        self._metrics = metrics
        self._control = control
        self.use = use
        self._catalog = catalog
        self._reactor = reactor
        self.max_active_backends = max_active_backends
        self.stop_timeout = stop_timeout
        #: ``on_unloaded(model_name)`` after a row was deleted (the placement caches drop the
        #: model, here and at every replica); never raises into the unload.
        self.on_unloaded = on_unloaded

    # -- unload -----------------------------------------------------------------------------

    async def unload(self, model_name: str, node_id: str, *, force: bool = False,
                     why: str = "administrator", reason: str = "admin") -> UnloadResult:
        """Stop ``model_name`` on ``node_id``; the row follows the worker's answer.
        ``reason`` (``admin``, ``eviction``, ``idle-watchdog``, ``busy-watchdog``) labels the
        ``localai_model_unloads_total`` metric; ``why`` is for the log."""
        result = await self._unload(model_name, node_id, force, why)
        self._metrics.unload(model_name, reason, result.outcome)
        return result

    async def _unload(self, model_name: str, node_id: str, force: bool,
                      why: str) -> UnloadResult:
        rows = await self._db.runQuery(
            "SELECT state, address FROM node_models WHERE node_id = %s AND model_name = %s",
            (node_id, model_name))
        if not rows:
            return UnloadResult(model_name, node_id, NOT_LOADED,
                                "the model has no row on this node")
        state, address = rows[0]
        if state in ("staging", "loading"):
            return UnloadResult(model_name, node_id, LOADING,
                                f"a load of it is in progress there ({state}); unload it once "
                                "it is loaded")
        own = self.use.in_flight(node_id, model_name)
        if own and not force:
            return UnloadResult(model_name, node_id, BUSY,
                                f"{own} requests in flight on this replica; wait, or force")
        await self._db.runOperation(
            "UPDATE node_models SET state = 'unloading', updated_at = now()"
            " WHERE node_id = %s AND model_name = %s AND address = %s",
            (node_id, model_name, address))
        try:
            reply = await self._control.call(
                node_id, "backend.stop",
                {"model": model_name, "force": bool(force), "if_idle": not force,
                 "absent_ok": True},
                timeout=self.stop_timeout)
        except errors.WorkerAnswer as e:
            await self._restore(node_id, model_name, address)
            log.info("unload of model {model} on node {node} ({why}): the worker could not "
                     "stop it: {err}", model=model_name, node=node_id, why=why, err=e)
            return UnloadResult(model_name, node_id, WORKER_FAILED, str(e), e)
        except errors.ClusterError as e:
            # Nothing learned about the worker: the row stays as it was.
            await self._restore(node_id, model_name, address)
            log.info("unload of model {model} on node {node} ({why}) not delivered "
                     "({condition}): {err}", model=model_name, node=node_id, why=why,
                     condition=e.condition, err=e)
            return UnloadResult(model_name, node_id, NOT_DELIVERED, str(e), e)
        except BaseException:
            await self._restore(node_id, model_name, address)
            raise
        reply = reply or {}
        if reply.get("busy"):
            await self._restore(node_id, model_name, address)
            return UnloadResult(model_name, node_id, BUSY,
                                "the backend answered BUSY (a request in flight); wait, or "
                                "force")
        if not reply.get("success"):
            await self._restore(node_id, model_name, address)
            failure = errors.ControlVerbFailed(node_id, "backend.stop",
                                               str(reply.get("error") or "stop refused"))
            return UnloadResult(model_name, node_id, WORKER_FAILED, str(failure), failure)
        await self._db.runOperation(
            "DELETE FROM node_models WHERE node_id = %s AND model_name = %s AND address = %s"
            " AND state = 'unloading'", (node_id, model_name, address))
        if self.on_unloaded is not None:
            try:
                self.on_unloaded(model_name)
            except Exception as e:
                log.warn("telling the placement caches of the unload of {model} failed: {err}",
                         model=model_name, err=e)
        was = reply.get("state") or ""
        log.info("model {model} unloaded from node {node} ({why}; the worker answered "
                 "{state})", model=model_name, node=node_id, why=why, state=was or "stopped")
        return UnloadResult(model_name, node_id, STOPPED,
                            "it was not running there" if was == "absent" else "")

    async def _restore(self, node_id: str, model_name: str, address: str) -> None:
        try:
            await self._db.runOperation(
                "UPDATE node_models SET state = 'loaded', updated_at = now()"
                " WHERE node_id = %s AND model_name = %s AND address = %s"
                " AND state = 'unloading'", (node_id, model_name, address))
        except Exception as e:
            log.warn("restoring the row of {model} on {node} failed: {err}", model=model_name,
                     node=node_id, err=e)

    async def nodes_holding(self, model_name: str) -> list[str]:
        rows = await self._db.runQuery(
            "SELECT node_id FROM node_models WHERE model_name = %s ORDER BY node_id",
            (model_name,))
        return [r[0] for r in rows]

    async def unload_everywhere(self, model_name: str, *,
                                force: bool = False) -> list[UnloadResult]:
        """Unload ``model_name`` on every node that has a row of it (in parallel)."""
        node_ids = await self.nodes_holding(model_name)
        return list(await defer.gatherResults(
            [defer.ensureDeferred(self.unload(model_name, n, force=force)) for n in node_ids],
            consumeErrors=True).addErrback(lambda f: f.value.subFailure))

    # -- room -------------------------------------------------------------------------------

    def need(self, model: ModelConfig) -> int:
        return memory_need(model, self._catalog.models_dir)

    def _need_of(self, name: str) -> int:
        config = self._catalog.get(name)
        return self.need(config) if config is not None else 0

    async def _read(self, node_ids: list[str]):
        memory = {r[0]: NodeMemory(r[0], *self._pick_memory(r[1:]))
                  for r in await self._db.runQuery(_NODES_SQL, (node_ids,))}
        held: dict[str, list[HeldModel]] = {n: [] for n in node_ids}
        for node_id, name, state in await self._db.runQuery(_HELD_SQL, (node_ids,)):
            held[node_id].append(HeldModel(name, state))
        return memory, held

    @staticmethod
    def _pick_memory(row) -> tuple[int, int]:
        total_ram, available_ram, total_vram, available_vram = row
        if total_vram > 0:  # a node with GPU memory: models are fitted there
            return total_vram, available_vram
        return total_ram, available_ram

    def _has_room(self, model: ModelConfig, memory: NodeMemory | None,
                  held: list[HeldModel], freed: int = 0) -> tuple[bool, str]:
        others = [h for h in held if h.name != model.name]
        if self.max_active_backends and len(others) >= self.max_active_backends:
            return False, (f"holds {len(others)} other models (--max-active-backends "
                           f"{self.max_active_backends})")
        need = self.need(model)
        if not need or memory is None or memory.total <= 0:
            return True, ""
        room = memory.total - sum(self._need_of(h.name) for h in others)
        if memory.available > 0:
            room = min(room, memory.available + freed)
        if need > room:
            return False, f"needs {need} bytes, has room for {max(room, 0)}"
        return True, ""

    async def prefer(self, model: ModelConfig, candidates: list) -> list:
        """The candidates (anything with ``node_id``) with room for ``model``; all of them
        when none has room (the load then evicts)."""
        if len(candidates) < 2:
            return candidates
        try:
            memory, held = await self._read([c.node_id for c in candidates])
        except Exception as e:
            log.warn("reading node memory for placing {model} failed: {err}", model=model.name,
                     err=e)
            return candidates
        roomy = [c for c in candidates
                 if self._has_room(model, memory.get(c.node_id), held[c.node_id])[0]]
        return roomy or candidates

    async def make_room(self, model: ModelConfig, node_id: str) -> list[str]:
        """Before a cold load of ``model`` on ``node_id``: unload least recently used idle
        models there until it has room (module docstring).  Never raises; returns the names
        of the models evicted."""
        try:
            return await self._make_room(model, node_id)
        except Exception:
            log.failure("making room for {model} on node {node} failed; loading anyway",
                        model=model.name, node=node_id)
            return []

    async def _make_room(self, model: ModelConfig, node_id: str) -> list[str]:
        await self.use.flush()  # this replica's recent use counts in the LRU order
        evicted: list[str] = []
        freed = 0
        refused: set[str] = set()
        for _ in range(MAX_EVICTIONS + 1):
            memory, held = await self._read([node_id])
            fits, why = self._has_room(model, memory.get(node_id), held[node_id], freed)
            if fits:
                return evicted
            victims = [h for h in held[node_id]
                       if h.name != model.name and h.state == "loaded" and h.name not in refused
                       and not self._pinned(h.name)
                       and not self.use.in_flight(node_id, h.name)]
            if not victims or len(evicted) >= MAX_EVICTIONS:
                log.warn("node {node} has no room for model {model} ({why}) and no idle model "
                         "to evict; loading anyway", node=node_id, model=model.name, why=why)
                return evicted
            victim = victims[0]  # least recently used first (the query's order)
            result = await self.unload(victim.name, node_id, reason="eviction",
                                       why=f"evicted for {model.name}: {why}")
            if result.stopped:
                evicted.append(victim.name)
                freed += self._need_of(victim.name)
                log.info("evicted model {victim} from node {node} to load {model} ({why})",
                         victim=victim.name, node=node_id, model=model.name, why=why)
            elif result.outcome == NOT_DELIVERED:
                log.info("eviction on node {node} not delivered ({err}); loading anyway",
                         node=node_id, err=result.detail)
                return evicted
            else:
                refused.add(victim.name)  # busy, loading, or the worker could not stop it
        return evicted

    def _pinned(self, name: str) -> bool:
        config = self._catalog.get(name)
        return bool(config is not None and config.pinned)


class LifecycleWatchdog(PeriodicPass):
    """The idle and busy watchdogs of one replica (module docstring); a no-op unless one of
    the timeouts is set.

    :param held_nodes: ``() -> iterable of node ids`` whose tunnels this replica holds.
    """

    name = "lifecycle-watchdog"
    pass_name = "lifecycle watchdog pass"

    def __init__(self, db, lifecycle: ModelLifecycle, held_nodes: Callable[[], Iterable[str]],
                 reactor, *, idle_timeout: float = 0.0, busy_timeout: float = 0.0,
                 interval: float = DEFAULT_WATCHDOG_INTERVAL):
        self._db = db
        self._lifecycle = lifecycle
        self._held_nodes = held_nodes
        self._reactor = reactor
        self.idle_timeout = idle_timeout
        self.busy_timeout = busy_timeout
        self.interval = interval

    @property
    def enabled(self) -> bool:
        return self.idle_timeout > 0 or self.busy_timeout > 0

    def pass_enabled(self) -> bool:
        return self.enabled

    async def run_once(self) -> list[UnloadResult]:
        results: list[UnloadResult] = []
        lifecycle = self._lifecycle
        if self.busy_timeout > 0:
            for node_id, model_name in lifecycle.use.running_longer_than(self.busy_timeout):
                log.warn("model {model} on node {node}: a request has run longer than the "
                         "busy timeout ({timeout:g} s); stopping its backend", model=model_name,
                         node=node_id, timeout=self.busy_timeout)
                results.append(await lifecycle.unload(model_name, node_id, force=True,
                                                      why="busy watchdog",
                                                      reason="busy-watchdog"))
        held = list(self._held_nodes())
        if self.idle_timeout > 0 and held:
            await lifecycle.use.flush()
            rows = await self._db.runQuery(
                "SELECT node_id, model_name FROM node_models WHERE node_id = ANY(%s)"
                " AND state = 'loaded'"
                " AND COALESCE(last_used, updated_at) < now() - make_interval(secs => %s)"
                " ORDER BY node_id, model_name", (held, float(self.idle_timeout)))
            for node_id, model_name in rows:
                if lifecycle._pinned(model_name):
                    continue
                results.append(await lifecycle.unload(model_name, node_id,
                                                      why="idle watchdog",
                                                      reason="idle-watchdog"))
        return results
