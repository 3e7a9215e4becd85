"""Where a model runs: node choice, ``node_models`` rows, the cross-replica load lock, cold
loads, unloads, and the one rule about reaping rows.

Node choice (:meth:`Scheduler.candidates`): healthy ``backend`` nodes whose labels carry every
pair of the model's selector -- the YAML ``node_selector`` with the ``model_scheduling_configs``
row (``POST /api/nodes/scheduling``) on top (the row wins per key).  Nodes where the model is
``loaded`` come first; among equals the choice is random (cold loads prefer nodes holding fewer
models, then random).  Connected nodes (tunnel held by a live replica, read in the same query)
come before the others, both for a loaded replica and for a cold load: a node that heartbeats
but never dials holds no models and would otherwise win every cold load.  Before a cold load
the picked node's presence is read: ``gone`` -> ``mark_unhealthy`` (status only, reversible)
and pick again; ``reconnecting``/``unknown`` stay eligible (nobody acts on absence within the
grace).  A cold load that meets a routing fact or an absence within the grace moves on to the
next candidate, touching nothing (no row, no status) on the node it leaves.

Cold load (:meth:`Scheduler.load`), one at a time per model across every replica:

1. take the ``model_load_jobs`` row for the model (insert, or take over a row whose owner is not
   a live replica or whose ``last_progress_at`` is older than ``takeover_after``, on the
   database clock); others poll (every ``poll_interval``) until the model is loaded or the lock
   is theirs, for at most ``load_wait`` seconds (then ``NoNodeAvailable``: try again later);
   the owner refreshes ``last_progress_at`` every ``heartbeat_interval`` while it works;
2. ``backend.start`` on the node (control verb through the tunnel, relayed when another replica
   holds it) -> ``127.0.0.1:<port>``;
3. ``node_models`` row ``staging``; each file of the model is checked against its ``sha256``
   (locally, in a thread) and staged (``PUT /v1/files/models/...``, skipped when the worker
   holds the same digest); progress is logged;
4. row ``loading``; gRPC ``LoadModel`` through the bridge with ``ModelOptions`` (``Model`` = the
   worker-side path of the staged model file, or the identifier; ``ModelFile``, ``ModelPath``,
   ``ContextSize``, ``Embeddings``, ``Options``);
5. row ``loaded``.  Any failure removes the row (our own unfinished load, explicit lifecycle);
   a failure the worker answered (``backend.start`` error, ``success=false``, a gRPC status)
   is raised as ``ModelLoadFailed`` with the backend's message, after a best-effort
   ``backend.stop``; route conditions are raised as themselves.

Failed loads are remembered (per replica, in memory) for ``failed_load_memory`` seconds
(:data:`DEFAULT_FAILED_LOAD_MEMORY`, 30 s), keyed by the model's name and its whole config: a
request meanwhile -- a new one, or one already waiting for the lock -- fails at once with the
same ``ModelLoadFailed``, whose ``retry_in`` and text say when the load is tried again.  A
changed config file is a new key and is tried at once.  Without this, every retry of a model
that cannot load (a hub id on a machine with no hub) paid the whole failing load again.  Each
load logs its start and its end with the time it took.

Reaping (:meth:`Scheduler.reap`) deletes a ``loaded`` row, and is called by the router ONLY on
the worker's answer (``WorkerAnswer``: ``StreamRefused`` at the dial, ``BackendAnswer`` of a
dead or wrong backend).  It asserts that: handing it a routing fact, absence, a peer failure, a
transport failure or a caller deadline raises ``ValueError`` and deletes nothing.

What this module must never do: delete a ``loaded`` row on anything but the worker's answer or
an explicit unload; compare times in Python (the database clock decides staleness and
liveness); run two loads of one model at once across replicas (the lock row); hash a file on
the reactor thread.
"""

from __future__ import annotations

import posixpath
import random
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from twisted.internet import defer, task, threads
from twisted.logger import Logger

from localai_tw import errors, metrics as replica_metrics
from localai_tw.backends import backend_pb2
from localai_tw.cluster.clock import (
    CONNECTION_IS_HELD_SQL,
    INSTANCE_IS_LIVE_SQL,
    INSTANCE_LIVENESS,
)
from localai_tw.cluster.ownership import Presence
from localai_tw.staging_client import sha256_of_file
from localai_tw.tunnel.endpoint import upload_file

from .interfaces import ModelLoadFailed, NoNodeAvailable
from .models import ModelConfig

log = Logger()

DEFAULT_LOAD_WAIT = 60.0
DEFAULT_TAKEOVER_AFTER = 30.0
DEFAULT_HEARTBEAT = 5.0
DEFAULT_POLL = 0.25
DEFAULT_START_TIMEOUT = 120.0
DEFAULT_STAGE_TIMEOUT = 3600.0
DEFAULT_LOAD_TIMEOUT = 300.0
#: Seconds a failed load is remembered (requests meanwhile fail at once with its error).
DEFAULT_FAILED_LOAD_MEMORY = 30.0
MAX_PICKS = 4

LOADED, STAGING, LOADING, UNLOADING = "loaded", "staging", "loading", "unloading"


class ModelFileMismatch(errors.ClusterError):
    """A model file in this replica's models directory does not match its configured sha256
    (or is missing).  A local configuration problem: nothing about any worker."""

    condition = "model-file-mismatch"


@dataclass(frozen=True)
class Candidate:
    node_id: str
    models_held: int
    loaded_address: str | None  # address of a loaded replica of the model here, if any
    loaded_model: str = ""      # its ModelOptions.Model
    connected: bool = False     # a live replica holds its tunnel now (read with the rows)


@dataclass(frozen=True)
class Placement:
    """A loaded model replica: where calls go."""

    model_name: str
    node_id: str
    address: str
    model_id: str  # ModelOptions.Model as loaded; sent as ModelIdentity

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


_CANDIDATES_SQL = (
    "SELECT n.id,"
    " (SELECT count(*) FROM node_models m WHERE m.node_id = n.id),"
    " (SELECT m.address FROM node_models m WHERE m.node_id = n.id AND m.model_name = %(model)s"
    "   AND m.state = 'loaded' ORDER BY m.replica_index LIMIT 1),"
    " (SELECT m.loaded_model FROM node_models m WHERE m.node_id = n.id"
    "   AND m.model_name = %(model)s AND m.state = 'loaded' ORDER BY m.replica_index LIMIT 1),"
    " EXISTS (SELECT 1 FROM node_connections JOIN instances"
    "   ON instances.id = node_connections.owner_instance_id"
    f"   AND {INSTANCE_IS_LIVE_SQL.replace('%s', '%(live)s')}"
    f"   WHERE node_connections.node_id = n.id AND {CONNECTION_IS_HELD_SQL})"
    " FROM backend_nodes n"
    " WHERE n.status = 'healthy' AND n.node_type = 'backend'"
    " AND NOT EXISTS (SELECT 1 FROM jsonb_each_text(%(selector)s::jsonb) s"
    "   WHERE NOT EXISTS (SELECT 1 FROM node_labels l"
    "     WHERE l.node_id = n.id AND l.key = s.key AND l.value = s.value))"
    " ORDER BY n.id"
)

_ACQUIRE_SQL = (
    "INSERT INTO model_load_jobs (model_name, owner_instance_id, attempt)"
    " VALUES (%(model)s, %(owner)s, %(attempt)s)"
    " ON CONFLICT (model_name) DO UPDATE SET owner_instance_id = EXCLUDED.owner_instance_id,"
    "  attempt = EXCLUDED.attempt, node_id = '', phase = 'choosing', started_at = now(),"
    "  last_progress_at = now()"
    " WHERE model_load_jobs.last_progress_at < now() - make_interval(secs => %(stale)s)"
    "  OR NOT EXISTS (SELECT 1 FROM instances WHERE instances.id ="
    f"   model_load_jobs.owner_instance_id AND {INSTANCE_IS_LIVE_SQL.replace('%s', '%(live)s')})"
    " RETURNING attempt, (xmax <> 0)"
)


def merged_selector(model: ModelConfig, configured: Mapping[str, str] | None) -> dict[str, str]:
    selector = dict(model.node_selector)
    selector.update(configured or {})
    return selector


class Scheduler:
    """Placement and lifecycle of models on workers (see the module docstring).

    :param control: a ``ControlClient``; :param worker_http: the ``WorkerHTTPClient`` (staging);
    :param clients: ``BackendClients`` (LoadModel through the bridges).
    """

    def __init__(self, db, nodes, fence, control, worker_http, clients, instance_id: str,
                 models_dir: str, reactor, *, grace: float | None = None,
                 load_wait: float = DEFAULT_LOAD_WAIT,
                 takeover_after: float = DEFAULT_TAKEOVER_AFTER,
                 heartbeat_interval: float = DEFAULT_HEARTBEAT,
                 poll_interval: float = DEFAULT_POLL,
                 start_timeout: float = DEFAULT_START_TIMEOUT,
                 stage_timeout: float = DEFAULT_STAGE_TIMEOUT,
                 load_timeout: float = DEFAULT_LOAD_TIMEOUT,
                 failed_load_memory: float = DEFAULT_FAILED_LOAD_MEMORY,
                 liveness: float = INSTANCE_LIVENESS,
                 metrics: replica_metrics.ReplicaMetrics = replica_metrics.DISCARD):
        self._db = db
        self._metrics = metrics
        self._nodes = nodes
        self._fence = fence
        self._control = control
        self._http = worker_http
        self._clients = clients
        self.instance_id = instance_id
        self.models_dir = models_dir
        self._reactor = reactor
        self._grace = grace
        self.load_wait = load_wait
        self.takeover_after = takeover_after
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = poll_interval
        self.start_timeout = start_timeout
        self.stage_timeout = stage_timeout
        self.load_timeout = load_timeout
        self.failed_load_memory = failed_load_memory
        # model name -> (config fingerprint, the failure, reactor time it expires)
        self._failed: dict[str, tuple[str, ModelLoadFailed, float]] = {}
        self._liveness = liveness
        self._random = random.Random()

    # -- reads ------------------------------------------------------------------------------

    async def configured_selector(self, model_name: str) -> dict[str, str]:
        rows = await self._db.runQuery(
            "SELECT node_selector FROM model_scheduling_configs WHERE model_name = %s",
            (model_name,))
        return dict(rows[0][0]) if rows else {}

    async def candidates(self, model: ModelConfig) -> list[Candidate]:
        import json

        selector = merged_selector(model, await self.configured_selector(model.name))
        rows = await self._db.runQuery(_CANDIDATES_SQL, {
            "model": model.name, "selector": json.dumps(selector),
            "live": float(self._liveness)})
        return [Candidate(r[0], int(r[1]), r[2], r[3] or "", bool(r[4])) for r in rows]

    def _shuffled(self, items: list) -> list:
        items = list(items)
        self._random.shuffle(items)
        return items

    async def loaded_placement(self, model: ModelConfig,
                               exclude: frozenset[str] = frozenset()) -> Placement | None:
        """A loaded replica of ``model`` on a node that still matches: on a connected node
        when there is one, random among equals."""
        loaded = [c for c in await self.candidates(model)
                  if c.loaded_address and c.node_id not in exclude]
        if not loaded:
            return None
        connected = [c for c in loaded if c.connected]
        chosen = self._shuffled(connected or loaded)[0]
        return Placement(model.name, chosen.node_id, chosen.loaded_address,
                         chosen.loaded_model or self.model_id(model, None))

    def model_id(self, model: ModelConfig, worker_paths: Mapping[str, str] | None) -> str:
        """``ModelOptions.Model``: the worker path of the staged model file, else the
        identifier (also the ``ModelIdentity`` of every call).  Deterministic from the config,
        so every replica computes the same value without asking the worker."""
        staged = model.file_for_model()
        if staged is None:
            return model.model
        if worker_paths and worker_paths.get(staged.key):
            return worker_paths[staged.key]
        return staged.key

    # -- presence ------------------------------------------------------------------------------

    async def _usable(self, node_id: str) -> bool:
        """False (and the node demoted, status only) when its presence is ``gone``."""
        reading = await self._fence.presence(node_id, self._grace)
        if reading.presence is Presence.GONE:
            log.info("node {node} is gone (departed past the grace): marked unhealthy, "
                     "skipped", node=node_id)
            await self.mark_gone(node_id)
            return False
        return True

    async def mark_gone(self, node_id: str) -> None:
        try:
            await self._nodes.mark_unhealthy(node_id)
        except Exception as e:  # a status write failing changes nothing about the choice
            log.warn("marking node {node} unhealthy failed: {err}", node=node_id, err=e)

    async def pick_for_load(self, model: ModelConfig,
                            exclude: frozenset[str] = frozenset()) -> str:
        excluded = set(exclude)
        for _ in range(MAX_PICKS):
            candidates = [c for c in await self.candidates(model) if c.node_id not in excluded]
            if not candidates:
                break
            # Connected nodes first: a node that heartbeats but holds no tunnel (never dialled,
            # or reconnecting) holds no models either, and would otherwise win every cold load.
            candidates = [c for c in candidates if c.connected] or candidates
            fewest = min(c.models_held for c in candidates)
            chosen = self._shuffled([c for c in candidates if c.models_held == fewest])[0]
            if await self._usable(chosen.node_id):
                return chosen.node_id
            excluded.add(chosen.node_id)
        selector = merged_selector(model, await self.configured_selector(model.name))
        reason = "no healthy backend node" + (f" with labels {selector}" if selector else "")
        if excluded - set(exclude):
            reason += f" (skipped gone nodes: {', '.join(sorted(excluded - set(exclude)))})"
        raise NoNodeAvailable(model.name, reason)

    # -- the load lock ---------------------------------------------------------------------------

    async def _try_acquire(self, model_name: str, attempt: str) -> bool:
        rows = await self._db.runQuery(_ACQUIRE_SQL, {
            "model": model_name, "owner": self.instance_id, "attempt": attempt,
            "stale": float(self.takeover_after), "live": float(self._liveness)})
        if rows and rows[0][0] == attempt:
            if rows[0][1]:
                log.info("load of model {model}: took over a dead or stale loader's lock",
                         model=model_name)
            return True
        return False

    async def _progress(self, model_name: str, attempt: str, phase: str | None = None,
                        node_id: str | None = None) -> None:
        await self._db.runOperation(
            "UPDATE model_load_jobs SET last_progress_at = now(),"
            " phase = COALESCE(%s, phase), node_id = COALESCE(%s, node_id)"
            " WHERE model_name = %s AND attempt = %s", (phase, node_id, model_name, attempt))

    async def _release(self, model_name: str, attempt: str) -> None:
        await self._db.runOperation(
            "DELETE FROM model_load_jobs WHERE model_name = %s AND attempt = %s",
            (model_name, attempt))

    # -- node_models rows ------------------------------------------------------------------------

    async def _set_row(self, node_id: str, model: ModelConfig, address: str, state: str,
                       loaded_model: str = "") -> None:
        await self._db.runOperation(
            "INSERT INTO node_models (node_id, model_name, replica_index, address, state,"
            " loading_by, backend_type, loaded_model, last_used)"
            " VALUES (%s, %s, 0, %s, %s, %s, %s, %s, now())"
            " ON CONFLICT (node_id, model_name, replica_index) DO UPDATE SET"
            " address = EXCLUDED.address, state = EXCLUDED.state,"
            " loading_by = EXCLUDED.loading_by, backend_type = EXCLUDED.backend_type,"
            " loaded_model = EXCLUDED.loaded_model, updated_at = now()",
            (node_id, model.name, address, state,
             "" if state == LOADED else self.instance_id, model.backend, loaded_model))

    async def _remove_row(self, node_id: str, model_name: str) -> None:
        await self._db.runOperation(
            "DELETE FROM node_models WHERE node_id = %s AND model_name = %s",
            (node_id, model_name))

    async def reap(self, placement: Placement, evidence: BaseException) -> bool:
        """Delete the loaded row of ``placement`` because the worker answered ``evidence``.

        :raises ValueError: ``evidence`` is not the worker's answer (nothing is deleted)."""
        if not isinstance(evidence, errors.WorkerAnswer):
            raise ValueError(f"refusing to reap {placement.model_name} on {placement.node_id}: "
                             f"{errors.condition_of(evidence)} is not the worker's answer")
        rows = await self._db.runQuery(
            "DELETE FROM node_models WHERE node_id = %s AND model_name = %s AND address = %s"
            " RETURNING id", (placement.node_id, placement.model_name, placement.address))
        if rows:
            log.info("reaped model {model} on node {node} ({address}) on the worker's answer: "
                     "{evidence}", model=placement.model_name, node=placement.node_id,
                     address=placement.address, evidence=evidence)
        return bool(rows)

    def touch(self, placement: Placement) -> None:
        """Record use (LRU information); best effort, never awaited by a request."""
        self._db.runOperation(
            "UPDATE node_models SET last_used = now() WHERE node_id = %s AND model_name = %s",
            (placement.node_id, placement.model_name)).addErrback(lambda _: None)

    # -- failed-load memory ---------------------------------------------------------------------

    def _remember_failure(self, model: ModelConfig, error: ModelLoadFailed) -> ModelLoadFailed:
        if self.failed_load_memory <= 0:
            return error
        until = self._reactor.seconds() + self.failed_load_memory
        self._failed[model.name] = (repr(model), error, until)
        return self._recalled(model.name, error, self.failed_load_memory)

    def remembered_failure(self, model: ModelConfig) -> ModelLoadFailed | None:
        """The remembered failed load of ``model`` (this config), if still within its window."""
        entry = self._failed.get(model.name)
        if entry is None:
            return None
        fingerprint, error, until = entry
        left = until - self._reactor.seconds()
        if fingerprint != repr(model) or left <= 0:
            del self._failed[model.name]
            return None
        return self._recalled(model.name, error, left)

    @staticmethod
    def _recalled(name: str, error: ModelLoadFailed, left: float) -> ModelLoadFailed:
        seconds = max(1, int(left + 0.999))
        return ModelLoadFailed(
            name, error.node_id,
            f"{error.detail} [localai-tw remembers this failure: the load of {name!r} is "
            f"tried again in {seconds} s, or at once when its config file changes]",
            retry_in=float(seconds))

    # -- cold load ----------------------------------------------------------------------------------

    async def load(self, model: ModelConfig, exclude: frozenset[str] = frozenset(),
                   deadline: float | None = None) -> Placement:
        """A loaded placement of ``model``: an existing one if another replica finished
        meanwhile, else a cold load under the lock."""
        attempt = str(uuid.uuid4())
        waited_until = self._reactor.seconds() + self.load_wait
        if deadline is not None:
            waited_until = min(waited_until, deadline)
        while True:
            existing = await self.loaded_placement(model, exclude)
            if existing is not None:
                return existing
            failed = self.remembered_failure(model)  # also for waiters: the load just failed
            if failed is not None:
                raise failed
            if await self._try_acquire(model.name, attempt):
                break
            if self._reactor.seconds() >= waited_until:
                if deadline is not None and self._reactor.seconds() >= deadline:
                    raise errors.CallerDeadlineExceeded(f"waiting for model {model.name} to load")
                raise NoNodeAvailable(model.name, f"another load of it is in progress; waited "
                                      f"{self.load_wait:g}s, try again")
            await task.deferLater(self._reactor, self.poll_interval, lambda: None)

        heartbeat = task.LoopingCall(self._beat, model.name, attempt)
        heartbeat.clock = self._reactor
        heartbeat.start(self.heartbeat_interval, now=False)
        try:
            existing = await self.loaded_placement(model, exclude)
            if existing is not None:
                return existing
            return await self._load_somewhere(model, exclude, attempt)
        finally:
            if heartbeat.running:
                heartbeat.stop()
            try:
                await self._release(model.name, attempt)
            except Exception as e:
                log.warn("releasing the load lock of {model} failed (it goes stale): {err}",
                         model=model.name, err=e)

    async def _load_somewhere(self, model: ModelConfig, exclude: frozenset[str],
                              attempt: str) -> Placement:
        """Cold-load on the best node; when the load meets a routing fact or an absence
        within the grace, try the next candidate (at most ``MAX_PICKS`` nodes).  Nothing is
        acted on: the skipped node keeps its status and its rows (``WorkerGone`` alone demotes,
        status only); the condition itself is raised when no candidate is left."""
        excluded = set(exclude)
        last: BaseException | None = None
        for _ in range(MAX_PICKS):
            try:
                node_id = await self.pick_for_load(model, frozenset(excluded))
            except NoNodeAvailable:
                if last is not None:
                    raise last from None
                raise
            try:
                return await self._load_on(model, node_id, attempt)
            except ModelLoadFailed as e:
                raise self._remember_failure(model, e) from e
            except (errors.RoutingFact, errors.AbsentWithinGrace) as e:
                if isinstance(e, errors.WorkerGone):
                    await self.mark_gone(node_id)
                log.info("cold load of model {model}: node {node} cannot be reached ({err}); "
                         "trying another node", model=model.name, node=node_id, err=e)
                excluded.add(node_id)
                last = e
        raise last  # MAX_PICKS nodes met a routing fact or an absence

    def _beat(self, model_name: str, attempt: str) -> defer.Deferred:
        return defer.ensureDeferred(self._progress(model_name, attempt)).addErrback(
            lambda f: log.warn("load heartbeat of {model} failed: {err}", model=model_name,
                               err=f.getErrorMessage()))

    async def _load_on(self, model: ModelConfig, node_id: str, attempt: str) -> Placement:
        started = self._reactor.seconds()
        log.info("cold load of model {model} ({backend}) on node {node} by replica {replica}: "
                 "started", model=model.name, backend=model.backend, node=node_id,
                 replica=self.instance_id)
        try:
            placement = await self._start_and_load(model, node_id, attempt)
        except BaseException as e:
            self._metrics.cold_load(model.name, self._reactor.seconds() - started, ok=False)
            log.info("cold load of model {model} on node {node} failed after {took:.1f} s: "
                     "{err}", model=model.name, node=node_id,
                     took=self._reactor.seconds() - started, err=e)
            raise
        self._metrics.cold_load(model.name, self._reactor.seconds() - started, ok=True)
        log.info("cold load of model {model} on node {node} finished in {took:.1f} s "
                 "(at {address})", model=model.name, node=node_id,
                 took=self._reactor.seconds() - started, address=placement.address)
        return placement

    async def _start_and_load(self, model: ModelConfig, node_id: str,
                              attempt: str) -> Placement:
        await self._progress(model.name, attempt, "starting", node_id)
        try:
            reply = await self._control.call(node_id, "backend.start",
                                             {"backend": model.backend, "model": model.name},
                                             timeout=self.start_timeout)
        except errors.ControlVerbFailed as e:
            raise ModelLoadFailed(model.name, node_id, e.error) from e
        if not reply or not reply.get("success"):
            raise ModelLoadFailed(model.name, node_id,
                                  (reply or {}).get("error") or "backend.start failed")
        address = str(reply.get("address") or "")
        try:
            int(address.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            raise errors.TunnelProtocolError(
                f"backend.start on {node_id} answered an unusable address {address!r}") from None

        row_written = False
        try:
            await self._set_row(node_id, model, address, STAGING)
            row_written = True
            await self._progress(model.name, attempt, "staging")
            worker_paths = await self._stage(model, node_id)
            await self._set_row(node_id, model, address, LOADING)
            await self._progress(model.name, attempt, "loading")
            model_id = self.model_id(model, worker_paths)
            await self._load_model(model, node_id, address, model_id, worker_paths)
            await self._set_row(node_id, model, address, LOADED, model_id)
        except BaseException as e:
            if row_written:
                try:
                    await self._remove_row(node_id, model.name)
                except Exception as cleanup:
                    log.warn("removing the unfinished row of {model} on {node} failed: {err}",
                             model=model.name, node=node_id, err=cleanup)
            if isinstance(e, errors.WorkerAnswer):
                await self._stop_quietly(node_id, model.name)
                if not isinstance(e, ModelLoadFailed):
                    raise ModelLoadFailed(model.name, node_id, str(e)) from e
            raise
        return Placement(model.name, node_id, address, model_id)

    async def _stage(self, model: ModelConfig, node_id: str) -> dict[str, str]:
        worker_paths: dict[str, str] = {}
        for f in model.files:
            try:  # the checked path is the one hashed and sent, so a swap cannot slip past
                local = f.contained_path(self.models_dir)
            except ValueError as e:
                raise ModelFileMismatch(f"model {model.name}: {e}") from None
            if f.sha256 is not None:
                try:
                    _, digest = await threads.deferToThreadPool(
                        self._reactor, self._reactor.getThreadPool(), sha256_of_file, local)
                except OSError as e:
                    raise ModelFileMismatch(f"model {model.name}: file {f.path} cannot be read:"
                                            f" {e.strerror}") from None
                if digest != f.sha256:
                    raise ModelFileMismatch(f"model {model.name}: file {f.path} has sha256 "
                                            f"{digest}, the config says {f.sha256}")
            last_logged = [0.0]

            def progress(sent: int, total: int, key=f.key) -> None:
                now = self._reactor.seconds()
                if sent == total or now - last_logged[0] >= 5.0:
                    last_logged[0] = now
                    log.info("staging {key} on node {node}: {sent}/{total} bytes", key=key,
                             node=node_id, sent=sent, total=total)

            # The node's own control token (derived from its node key), never the shared one.
            token = await self._nodes.control_token(node_id)
            staged = await upload_file(self._http, node_id, f.key, local, token=token,
                                       progress_cb=progress, timeout=self.stage_timeout)
            log.info("staged {key} on node {node} ({how})", key=f.key, node=node_id,
                     how="already present" if staged.skipped else f"{staged.size} bytes")
            if staged.local_path:
                worker_paths[f.key] = staged.local_path
        return worker_paths

    async def _load_model(self, model: ModelConfig, node_id: str, address: str, model_id: str,
                          worker_paths: Mapping[str, str]) -> None:
        staged = model.file_for_model()
        model_file = worker_paths.get(staged.key, "") if staged is not None else ""
        # The config's LocalAI keys (f16, threads, gpu_layers, mmap, type, ...; models.py
        # MODEL_OPTIONS) first, then what this loader decides (model, paths, context).
        options = backend_pb2.ModelOptions(**{
            **model.model_options,
            "Model": model_id, "ContextSize": model.context_size,
            "Embeddings": model.embeddings, "Options": list(model.options),
            "ModelFile": model_file,
            "ModelPath": posixpath.dirname(model_file) if model_file else ""})
        port = int(address.rsplit(":", 1)[1])
        client = self._clients.client(node_id, port)
        deadline = self._reactor.seconds() + self.load_timeout
        result = await client.call("LoadModel", options, deadline)
        if not result.success:
            raise ModelLoadFailed(model.name, node_id, result.message or "LoadModel failed")

    async def _stop_quietly(self, node_id: str, model_name: str) -> None:
        try:
            await self._control.call(node_id, "backend.stop", {"model": model_name},
                                     timeout=30.0)
        except Exception as e:
            log.info("backend.stop of {model} on {node} after a failed load: {err}",
                     model=model_name, node=node_id, err=e)

    # -- unload ----------------------------------------------------------------------------------

    async def unload(self, model_name: str, node_id: str) -> dict[str, Any]:
        """Explicit lifecycle: ``backend.stop`` on the node, then the row goes (even when the
        stop fails with no route: the operator asked; a still-running process is found and
        reused by the next ``backend.start``)."""
        await self._db.runOperation(
            "UPDATE node_models SET state = 'unloading', updated_at = now()"
            " WHERE node_id = %s AND model_name = %s", (node_id, model_name))
        try:
            reply = await self._control.call(node_id, "backend.stop", {"model": model_name},
                                             timeout=60.0)
        finally:
            await self._remove_row(node_id, model_name)
        return reply or {}
