"""Cold loading on one node: ``backend.start``, staging, ``LoadModel``, and the ``node_models``
row that records it.  Which node: :mod:`.placement`; one load per model across replicas, and
the tries over nodes: :mod:`.loadlock`.

:meth:`ColdLoader.load_on`:

0. the model's files are checked on this replica, in a thread (:mod:`.modelfiles`): each file
   and folder of ``files``, and ``parameters.model`` when it names a file or folder in the
   models directory, present, inside its root, hashed (``sha256`` checked when the config gives
   one; digests cached by size and mtime).  A problem is ``ModelFileMismatch`` naming the
   file, before any worker is asked;
1. ``backend.start`` on the node (control verb through the tunnel, relayed when another replica
   holds it) -> ``127.0.0.1:<port>``;
2. ``node_models`` row ``staging``; every file of the plan is staged
   (``PUT /v1/files/models/...``, skipped when the worker holds the same digest), a folder file
   by file under one worker folder with its layout; progress is logged;
3. row ``loading``; gRPC ``LoadModel`` through the bridge with ``ModelOptions`` (``Model`` and
   ``ModelFile`` = the worker-side path of the staged model file or folder, else ``Model`` is
   the identifier; ``ModelPath`` its directory, ``ContextSize``, ``Embeddings``, ``Options``;
   the config's LocalAI keys first);
4. row ``loaded``.  Any failure removes the row (our own unfinished load, explicit lifecycle);
   a failure the worker answered (``backend.start`` error, ``success=false``, a gRPC status)
   is raised as ``ModelLoadFailed`` with the backend's message, after a best-effort
   ``backend.stop``; route conditions are raised as themselves.

Each load logs its start and its end with the time it took.  Unloading is :mod:`.lifecycle`'s
(the row follows the worker's answer to ``backend.stop``).

What this module must never do: hash a file on the reactor thread; stage a file that is not
the one checked (the contained path is the one hashed and sent); leave a row of its own
unfinished load behind; delete a ``loaded`` row (an unload is :mod:`.lifecycle`'s, reaping on
the worker's answer :mod:`.placement`'s).
"""

from __future__ import annotations

import os
import posixpath
from typing import Awaitable, Callable

from twisted.internet import threads
from twisted.logger import Logger

from localai_tw import errors
from localai_tw import metrics as replica_metrics
from localai_tw.logsafe import untrusted
from localai_tw.backends import backend_pb2
from localai_tw.staging_client import expect_staging
from localai_tw.tunnel.endpoint import upload_file

from localai_tw.frontend.inference.crashes import CrashProbe, crash_shaped
from localai_tw.frontend.inference.downloads import ModelDownloads
from localai_tw.frontend.inference.interfaces import ModelFileMismatch, ModelLoadFailed
from localai_tw.frontend.inference.modelfiles import (
    DigestCache,
    StageEntry,
    StagePlan,
    plan_blocking,
    worker_folder,
)
from localai_tw.localai.model_config import ModelConfig
from localai_tw.frontend.inference.placement import Placement

log = Logger()

#: Characters of a worker's start note kept in ``node_models.note``.
MAX_NOTE = 1000
DEFAULT_START_TIMEOUT = 120.0
DEFAULT_STAGE_TIMEOUT = 3600.0
DEFAULT_LOAD_TIMEOUT = 300.0

def _printable(text: str) -> str:
    """The worker's words for a row an admin reads: control characters replaced."""
    return "".join(c if c.isprintable() else "?" for c in text)


LOADED, STAGING, LOADING, UNLOADING = "loaded", "staging", "loading", "unloading"


__all__ = ["ColdLoader", "ModelFileMismatch"]  # ModelFileMismatch: .interfaces, re-exported


class ColdLoader:
    """Loads models on the node it is told (see the module docstring).

    :param nodes: the ``NodeRegistry`` (each node's control token); :param control: a
    ``ControlClient``; :param worker_http: the ``WorkerHTTPClient`` (staging); :param clients:
    ``BackendClients`` (LoadModel through the bridges).
    """

    def __init__(self, db, nodes, control, worker_http, clients, instance_id: str,
                 models_dir: str, reactor, *,
                 start_timeout: float = DEFAULT_START_TIMEOUT,
                 stage_timeout: float = DEFAULT_STAGE_TIMEOUT,
                 load_timeout: float = DEFAULT_LOAD_TIMEOUT,
                 allow_private_downloads: bool = False,
                 metrics: replica_metrics.ReplicaMetrics = replica_metrics.DISCARD):
        self._db = db
        #: the operator's --allow-private-downloads (downloads.py, fetchpolicy.py)
        self.allow_private_downloads = allow_private_downloads
        self._metrics = metrics
        self._nodes = nodes
        self._control = control
        #: asks the worker whether a backend that failed LoadModel crashed
        self.crashes = CrashProbe(control)
        self._http = worker_http
        self._clients = clients
        self.instance_id = instance_id
        self.models_dir = models_dir
        self._reactor = reactor
        self.start_timeout = start_timeout
        self.stage_timeout = stage_timeout
        self.load_timeout = load_timeout
        #: digests of the models directory's files, so an unchanged file is hashed once
        self.digests = DigestCache()
        self._downloads: ModelDownloads | None = None

    @property
    def downloads(self) -> ModelDownloads:
        """This replica's downloads into the models directory (made on first use)."""
        if self._downloads is None:
            self._downloads = ModelDownloads(self.models_dir, self._reactor, self.digests,
                                             allow_private=self.allow_private_downloads)
        return self._downloads

    async def download(self, model: ModelConfig) -> None:
        """The files ``model`` downloads (``download_files``, a URL ``parameters.model``)
        present and verified in the models directory; several requests share one download.
        Before the load lock: a long download holds no lock other replicas wait on."""
        if model.downloads:
            await self.downloads.ensure(model)

    def files_stamp(self, model: ModelConfig) -> tuple:
        """(path, size, mtime) of each top-level file or folder the model names: a remembered
        failed load is forgotten when one of them changes.  A few stats (on the caller's
        thread, as the catalog's)."""
        paths = [f.path for f in model.files] + [d.filename for d in model.downloads]
        paths.append(model.model)
        stamp = []
        for path in paths:
            if path.startswith("/") or "://" in path:
                continue
            try:
                st = os.stat(os.path.join(self.models_dir, path))
            except (OSError, ValueError):
                stamp.append((path, None))
                continue
            stamp.append((path, st.st_size, st.st_mtime_ns))
        return tuple(stamp)

    # -- a cold load ------------------------------------------------------------------------

    async def load_on(self, model: ModelConfig, node_id: str,
                      progress: Callable[..., Awaitable[None]]) -> Placement:
        """Start, stage and load ``model`` on ``node_id`` (module docstring, steps 1-4),
        logging its start and its end.  ``progress(phase, node_id=None)`` is told each phase
        (the load lock records it)."""
        started = self._reactor.seconds()
        log.info("cold load of model {model} ({backend}) on node {node} by replica {replica}: "
                 "started", model=model.name, backend=model.backend, node=node_id,
                 replica=self.instance_id)
        try:
            placement = await self._start_and_load(model, node_id, progress)
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
                              progress: Callable[..., Awaitable[None]]) -> Placement:
        # Local checks first (files present, digests, folders walked): a config problem of
        # this replica never starts a backend on a worker.
        plan = await threads.deferToThreadPool(
            self._reactor, self._reactor.getThreadPool(), plan_blocking, model,
            self.models_dir, self.digests)
        await progress("starting", node_id)
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
        note = reply.get("note") if isinstance(reply.get("note"), str) else ""
        if note:
            log.info("model {model} on node {node}: the worker says: {note}", model=model.name,
                     node=node_id, note=untrusted(note, 500))
        try:
            port = int(address.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            raise errors.TunnelProtocolError(
                f"backend.start on {node_id} answered an unusable address {address!r}") from None
        # the backend process's own gRPC token (an older worker answers none: then asked)
        self._clients.remember_token(node_id, port, reply.get("token"))

        row_written = False
        try:
            await self._set_row(node_id, model, address, STAGING)
            row_written = True
            await progress("staging")
            model_file = await self._stage(model, node_id, plan)
            await self._set_row(node_id, model, address, LOADING)
            await progress("loading")
            model_id = model_file or model.model
            await self._load_model(model, node_id, address, model_id, model_file)
            await self._set_row(node_id, model, address, LOADED, model_id, note)
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

    async def _stage(self, model: ModelConfig, node_id: str, plan: StagePlan) -> str:
        """Put every file of ``plan`` on the node (each skipped when the worker holds its
        digest); the worker-side path of the primary entry (file or folder), or ''."""
        primary_path = ""
        # The node's own control token (derived from its node key), never the shared one.
        token = await self._nodes.control_token(node_id) if plan.entries else ""
        expect_staging(sum(e.size for e in plan.entries))  # /api/cluster/loads: the total
        for entry in plan.entries:
            worker_path = await self._stage_entry(model, node_id, entry, token)
            if entry is plan.primary:
                primary_path = worker_path
        return primary_path

    async def _stage_entry(self, model: ModelConfig, node_id: str, entry: StageEntry,
                           token: str) -> str:
        total = entry.size
        done = 0
        last_logged = [self._reactor.seconds()]
        what = f"folder {entry.path} ({len(entry.items)} files)" if entry.folder else entry.key
        log.info("staging {what} of model {model} on node {node}: {total} bytes", what=what,
                 model=model.name, node=node_id, total=total)

        def progress(sent: int, _total: int) -> None:
            now = self._reactor.seconds()
            if now - last_logged[0] >= 5.0:
                last_logged[0] = now
                log.info("staging {what} on node {node}: {sent}/{total} bytes", what=what,
                         node=node_id, sent=done + sent, total=total)

        worker_path = ""
        skipped = 0
        for item in entry.items:
            try:
                staged = await upload_file(self._http, node_id, item.key, item.local,
                                           token=token, progress_cb=progress,
                                           timeout=self.stage_timeout,
                                           known=(item.size, item.sha256))
            except (ValueError, OSError) as e:  # changed or gone since it was checked
                raise ModelFileMismatch(f"model {model.name}: staging {item.key} from "
                                        f"{entry.path}: {e}") from None
            done += item.size
            skipped += staged.skipped
            if staged.local_path and not worker_path:
                worker_path = (worker_folder(staged.local_path, item.rel) if entry.folder
                               else staged.local_path)
        log.info("staged {what} on node {node} ({how})", what=what, node=node_id,
                 how="already present" if skipped == len(entry.items) else
                 f"{done} bytes, {skipped} of {len(entry.items)} files already present")
        return worker_path

    async def _load_model(self, model: ModelConfig, node_id: str, address: str, model_id: str,
                          model_file: str) -> None:
        # The config's LocalAI keys (f16, threads, gpu_layers, mmap, type, ...; models.py
        # MODEL_OPTIONS) first, then what this loader decides (model, paths, context).
        # ModelFile is the staged file or folder, as LocalAI sends it; ModelPath the directory
        # holding it on the worker.
        options = backend_pb2.ModelOptions(**{
            **model.model_options,
            "Model": model_id, "ContextSize": model.context_size,
            "Embeddings": model.embeddings, "Options": list(model.options),
            "ModelFile": model_file,
            "ModelPath": posixpath.dirname(model_file) if model_file else ""})
        port = int(address.rsplit(":", 1)[1])
        client = self._clients.client(node_id, port)
        deadline = self._reactor.seconds() + self.load_timeout
        try:
            result = await client.call("LoadModel", options, deadline)
        except (errors.BackendAnswer, errors.TransportFailure) as e:
            # A backend that died while loading: the worker says how (crashes.py),
            # and the load failed (remembered like any failed load), not the route.
            crash = await self.crashes.explain(Placement(model.name, node_id, address, model_id)) \
                if crash_shaped(e) else None
            if crash is None:
                raise
            said = f"; its last output: {' | '.join(crash.output)}" if crash.output else ""
            raise ModelLoadFailed(model.name, node_id, f"the backend {crash.description} "
                                  f"while loading the model{said}") from e
        if not result.success:
            raise ModelLoadFailed(model.name, node_id, result.message or "LoadModel failed")

    async def _stop_quietly(self, node_id: str, model_name: str) -> None:
        try:
            await self._control.call(node_id, "backend.stop", {"model": model_name},
                                     timeout=30.0)
        except Exception as e:
            log.info("backend.stop of {model} on {node} after a failed load: {err}",
                     model=model_name, node=node_id, err=e)

    # -- node_models rows -------------------------------------------------------------------

    async def _set_row(self, node_id: str, model: ModelConfig, address: str, state: str,
                       loaded_model: str = "", note: str = "") -> None:
        await self._db.runOperation(
            "INSERT INTO node_models (node_id, model_name, replica_index, address, state,"
            " loading_by, backend_type, loaded_model, note, last_used)"
            " VALUES (%s, %s, 0, %s, %s, %s, %s, %s, %s, now())"
            " ON CONFLICT (node_id, model_name, replica_index) DO UPDATE SET"
            " address = EXCLUDED.address, state = EXCLUDED.state,"
            " loading_by = EXCLUDED.loading_by, backend_type = EXCLUDED.backend_type,"
            " loaded_model = EXCLUDED.loaded_model, note = EXCLUDED.note, updated_at = now()",
            (node_id, model.name, address, state,
             "" if state == LOADED else self.instance_id, model.backend, loaded_model,
             _printable(note[:MAX_NOTE])))

    async def _remove_row(self, node_id: str, model_name: str) -> None:
        await self._db.runOperation(
            "DELETE FROM node_models WHERE node_id = %s AND model_name = %s",
            (node_id, model_name))
