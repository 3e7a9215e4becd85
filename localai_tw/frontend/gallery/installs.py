"""LocalAI's model gallery on a cluster: installs and deletes run as jobs whose state every
replica can answer (``docs/models.md``, "Gallery"); the indexes they install from are read by
``index.py`` after this module fetched them (``file://``, ``http://``, ``https://`` or
``github:``, at each use, through the destination policy).

- **Jobs**: ``POST /models/apply`` admits an install and answers its id at once. The job is
  *queued* in this replica's memory (installs run one at a time per replica, as LocalAI's
  gallery service does) and has no row yet; its state is broadcast over the PostgreSQL fan-out
  (``bus/pgbus.py``, subject ``gallery.<id>``), and every replica keeps the latest snapshot of
  each job it heard about, so ``GET /models/jobs/{id}`` answers anywhere. Each broadcast is a
  whole snapshot with a sequence number, so a missed one is repaired by the next.
- **One install per model across the cluster**: a job starts by inserting its
  ``gallery_jobs`` row in state ``running``; a partial unique index admits one running row per
  model. A running row whose replica is no longer live is failed first (the replica died), so
  a dead replica never holds a model. A job that finds another running fails with the other
  job's id.
- **Downloads** go through :class:`~.downloads.ModelDownloads` (digests verified, a temporary
  file renamed only when whole); progress (bytes, total, rate) is broadcast at most every
  ``progress_interval`` seconds. The config YAML is written last, through a temporary file and
  a rename, so the model exists only when every file is there; a failure removes the files this
  job created. A record ``._gallery_<name>.yaml`` lists the files, for delete (LocalAI's name).
- **Finished**: the row holds the final snapshot (``done`` or ``failed`` with the reason).

What this module must never do: fetch a URL an API caller chose (only configured galleries and
the URLs their entries name), read a ``file://`` source for an install unless the operator
allows local sources, write outside the models directory, leave a config naming a file
that is not there, or treat a broadcast as the record (the row is).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import uuid
from collections import OrderedDict, deque
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml
from twisted.application.service import Service
from twisted.internet import defer, protocol, task, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from localai_tw.cluster.clock import (
    INSTANCE_IS_LIVE_SQL,
    INSTANCE_LIVENESS,
    LIVE_INSTANCE_IDS_SQL,
)
from localai_tw.bus.pgbus import BusStopped
from localai_tw.web.readers import ResponseTooLarge, read_bounded
from localai_tw.db.pool import DatabaseUnavailable, PoolClosed

from localai_tw.frontend.inference.downloads import (
    failure_reason,
    open_regular_file,
    resolve_url,
    shown_url,
)
from localai_tw.frontend.gallery.backend_index import job_key
from localai_tw.frontend.gallery.index import (
    MAX_CONFIG_BYTES,
    MAX_INDEX_BYTES,
    Gallery,
    GalleryEntry,
    GalleryError,
    is_file_name,
    yaml_load,
    merge,
    parse_files,
    parse_index,
)
from localai_tw.frontend.inference.fetchpolicy import fetch_agent
from localai_tw.frontend.inference.interfaces import ModelFileMismatch
from localai_tw.localai.catalog import ModelCatalog
from localai_tw.localai.model_config import ModelConfigError, parse_model_config

log = Logger()

FETCH_TIMEOUT = 60.0
#: Jobs one replica holds queued (admitted, not started).
MAX_QUEUED = 256
#: Job snapshots a replica remembers (the oldest finished go first).
MAX_REMEMBERED = 1024
#: Finished rows older than this are purged when a job starts.
ROW_RETENTION_SECONDS = 7 * 86400
SUBJECT_ROOT = "gallery"
DATABASE_DOWN = (DatabaseUnavailable, PoolClosed)
#: Tries of the final row write when the database is unavailable (1 s, 2 s, ... apart).
FINISH_TRIES = 5


class GalleryExists(GalleryError):
    """The install's name is a model config already and the request did not say replace."""


def _exists_message(name: str) -> str:
    return (f"model {name!r} exists already: send \"replace\": true to overwrite its config, "
            "or choose another \"name\"")


class GalleryBusy(GalleryError):
    """This replica has :data:`MAX_QUEUED` jobs waiting already."""


async def read_url(url: str, limit: int, reactor, agent=None) -> bytes:
    """The bytes at ``url`` (``file://``, ``http(s)://``, ``github:``), at most ``limit``.
    :raises GalleryError: naming the URL (without credentials or query) and the cause."""
    real = resolve_url(url)
    shown = shown_url(real)
    if real.startswith("file://"):
        path = unquote(urlsplit(real).path)

        def read() -> bytes:
            with open_regular_file(path) as f:
                data = f.read(limit + 1)
            if len(data) > limit:
                raise GalleryError(f"{shown} is larger than {limit} bytes")
            return data

        try:
            return await threads.deferToThreadPool(reactor, reactor.getThreadPool(), read)
        except OSError as e:
            raise GalleryError(f"{shown} cannot be read: {e.strerror}") from None
    if not real.startswith(("http://", "https://")):
        raise GalleryError(f"{shown}: only file://, http(s):// and github: are read")
    if agent is None:
        agent = fetch_agent(reactor, allow_private=False)

    def failed(reason: str) -> GalleryError:
        # One text for a refused destination, a closed port, a timeout or a status, as for
        # model downloads (downloads.py): the reason is for the operator's log only.
        log.warn("fetching {url} failed: {reason}", url=shown, reason=reason)
        return GalleryError(f"{shown} cannot be fetched; the frontend's log says why")

    try:
        encoded = real.encode("ascii")
    except UnicodeEncodeError:
        raise GalleryError(f"{shown}: the URL must be ASCII (percent-encode it)") from None
    requesting = agent.request(b"GET", encoded,
                               Headers({b"User-Agent": [b"localai-tw gallery"]}))
    timer = reactor.callLater(FETCH_TIMEOUT, requesting.cancel)
    try:
        response = await requesting
        if response.code != 200:
            response.deliverBody(protocol.Protocol())
            raise failed(f"HTTP {response.code}")
        if response.length is not None and isinstance(response.length, int) \
                and response.length > limit:
            response.deliverBody(protocol.Protocol())
            raise GalleryError(f"{shown} is larger than {limit} bytes")
        return await read_bounded(response, limit)
    except ResponseTooLarge:
        raise GalleryError(f"{shown} is larger than {limit} bytes") from None
    except defer.CancelledError:
        raise failed(f"no answer within {FETCH_TIMEOUT:.0f} s") from None
    except GalleryError:
        raise
    except Exception as e:
        raise failed(failure_reason(e)) from None
    finally:
        if timer.active():
            timer.cancel()


_CLAIM_STALE_SQL = (
    "UPDATE gallery_jobs SET state = 'failed', finished_at = now(), "
    "status = status || jsonb_build_object('state', 'failed', 'processed', true, 'error', "
    "'the replica running it stopped') "
    f"WHERE model = %s AND state = 'running' AND replica NOT IN ({LIVE_INSTANCE_IDS_SQL})")
_CLAIM_SQL = (
    "INSERT INTO gallery_jobs (id, model, deletion, state, replica, status) "
    "VALUES (%s, %s, %s, 'running', %s, %s) "
    "ON CONFLICT (model) WHERE state = 'running' DO NOTHING RETURNING id")
_HOLDER_SQL = "SELECT id, replica FROM gallery_jobs WHERE model = %s AND state = 'running'"
_FINISH_SQL = ("UPDATE gallery_jobs SET state = %s, status = %s, finished_at = now() "
               "WHERE id = %s")
_FAILED_ROW_SQL = ("INSERT INTO gallery_jobs (id, model, deletion, state, replica, status, "
                   "finished_at) VALUES (%s, %s, %s, 'failed', %s, %s, now()) "
                   "ON CONFLICT (id) DO NOTHING")
_ROW_SQL = ("SELECT state, status, replica IN (" + LIVE_INSTANCE_IDS_SQL + ") "
            "FROM gallery_jobs WHERE id = %s")
_LIVE_SQL = f"SELECT 1 FROM instances WHERE id = %s AND {INSTANCE_IS_LIVE_SQL}"
_PURGE_SQL = ("DELETE FROM gallery_jobs WHERE state <> 'running' AND finished_at < now() - "
              "make_interval(secs => %s)")


@dataclasses.dataclass
class _Op:
    id: str
    name: str
    deletion: bool
    entry: GalleryEntry | None = None
    overrides: dict = dataclasses.field(default_factory=dict)
    replace: bool = False
    finished: bool = False
    #: a backend's install or delete (``backend_installs.py``): ``{"name", "entry",
    #: "entries", "node_id", "node"}``; ``name`` is then the job's key (``.backend/<name>``)
    backend: dict | None = None

    @property
    def label(self) -> str:
        return f"backend {self.backend['name']}" if self.backend else f"model {self.name}"


class GalleryJobs(Service):
    """The gallery of one replica: indexes, its queue of operations, and the snapshots of
    every job the cluster broadcast (module docstring).

    :param bus: a started-with-this-service ``PgBus``.
    :param downloads: the replica's :class:`~.downloads.ModelDownloads`.
    :param catalog: the replica's :class:`~.models.ModelCatalog` of ``models_dir`` (one of its
        own when not given).
    """

    name = "gallery"

    def __init__(self, db, bus, instance_id: str, models_dir: str, downloads,
                 galleries: tuple[Gallery, ...], reactor, *, agent=None, catalog=None,
                 progress_interval: float = 1.0, backends=None):
        self.db, self.bus, self.instance_id = db, bus, instance_id
        self.models_dir = models_dir
        #: every config's ``name`` (the existing-name check reads it)
        self.catalog = catalog if catalog is not None else ModelCatalog(models_dir)
        self.downloads = downloads
        self.galleries = galleries
        self._reactor = reactor
        # the downloads' agent: one destination policy for every fetch of this replica
        self._agent = agent if agent is not None else getattr(downloads, "agent", None)
        #: an install may read file:// sources (the operator's --allow-private-downloads)
        self.allow_local_sources = bool(getattr(downloads, "allow_private", False))
        self.progress_interval = progress_interval
        #: backend installs and deletes (``backend_installs.BackendInstalls``), or None
        self.backends = backends
        self.snapshots: OrderedDict[str, dict] = OrderedDict()
        self._queue: deque[_Op] = deque()
        self._running = False
        self._subscription = None
        self._seq = 0
        self._publishing: defer.Deferred = defer.succeed(None)

    # -- service ---------------------------------------------------------------------------

    def startService(self):
        super().startService()
        return self.bus.subscribe(f"{SUBJECT_ROOT}.*", self._heard).addCallbacks(
            self._subscribed, self._not_subscribed)

    def _subscribed(self, sub) -> None:
        if not self.running:  # stopped while the subscription was on its way
            defer.maybeDeferred(sub.unsubscribe).addErrback(lambda _: None)
            return
        self._subscription = sub

    def _not_subscribed(self, failure: Failure) -> None:
        if not self.running or failure.check(BusStopped):
            # The replica is stopping (it may stop right after it started): nothing is lost.
            log.info("gallery: the bus stopped before its subscription landed")
            return
        log.failure("gallery: cannot subscribe to the bus; this replica answers gallery jobs "
                    "from their rows only", failure)

    def stopService(self):
        super().stopService()
        self._queue.clear()
        if self.backends is not None:
            self.backends.close()
        if self._subscription is not None:
            sub, self._subscription = self._subscription, None
            return defer.maybeDeferred(sub.unsubscribe).addErrback(lambda _: None)

    # -- indexes ---------------------------------------------------------------------------

    async def available(self) -> list[GalleryEntry]:
        """Every usable entry of every configured gallery. :raises GalleryError:"""
        out: list[GalleryEntry] = []
        for gallery in self.galleries:
            data = await read_url(gallery.url, MAX_INDEX_BYTES, self._reactor, self._agent)
            try:
                decoded = await threads.deferToThreadPool(
                    self._reactor, self._reactor.getThreadPool(), yaml_load, data,
                    index=True)
            except yaml.YAMLError as e:
                raise GalleryError(f"gallery {gallery.name}: the index is not YAML or JSON "
                                   f"({str(e)[:200]})") from None
            entries, skipped = parse_index(decoded, gallery)
            if skipped:
                log.warn("gallery {gallery}: {n} entries left out (no usable name, or bad "
                         "fields)", gallery=gallery.name, n=skipped)
            out.extend(entries)
        return out

    async def find(self, wanted: str) -> GalleryEntry:
        """The entry ``gallery@name`` or ``name``. :raises GalleryError: when none is."""
        for entry in await self.available():
            if wanted in (entry.id, entry.name):
                return entry
        if not self.galleries:
            raise GalleryError(f"no gallery entry {wanted[:256]!r}: no gallery is configured "
                               "(start the frontend with --galleries)")
        raise GalleryError(f"no gallery entry {wanted[:256]!r}; GET /models/available lists "
                           "them")

    def installed(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.models_dir, name + ".yaml"))

    def _config_exists(self, name: str) -> bool:
        """Whether a model ``name`` exists: ``<name>.yaml`` or ``<name>.yml``, or any config
        file of the models directory whose ``name:`` is ``name`` (also one that fails to load
        but was meant for it), so an install cannot shadow or rewrite a model whose file is
        named otherwise."""
        for suffix in (".yaml", ".yml"):
            if os.path.lexists(os.path.join(self.models_dir, name + suffix)):
                return True
        self.catalog.refresh()
        return self.catalog.get(name) is not None or self.catalog.error(name) is not None

    def _defined_elsewhere(self, name: str) -> str | None:
        """The file other than ``<name>.yaml`` that defines model ``name``, if any: an install
        writes ``<name>.yaml``, which would not replace that definition (the catalog keeps
        the first file of a name), so even ``"replace": true`` is refused there."""
        self.catalog.refresh()
        config = self.catalog.get(name)
        source = config.source if config is not None else None
        if source is None:
            error = self.catalog.error(name)
            source = error.source if error is not None else None
        if source and os.path.basename(source) != f"{name}.yaml":
            return os.path.basename(source)
        return None

    def _refuse_local(self, uri: str, where: str) -> None:
        """An install reads no ``file://`` source unless the operator allows local and private
        sources (``--allow-private-downloads``): the entry was picked by a request, and a
        local file (a key, the database's files) would be copied into the models directory
        and on to a worker.  :raises GalleryError: naming the key and the option."""
        if self.allow_local_sources or not resolve_url(uri).startswith("file://"):
            return
        raise GalleryError(f"{where}: a gallery install reads no file:// source; the "
                           "operator allows local sources with --allow-private-downloads")

    def _check_name(self, name: str, replace: bool) -> None:
        """:raises GalleryExists: when an install of ``name`` would shadow or rewrite a model
        it was not told to replace."""
        if not replace:
            if self._config_exists(name):
                raise GalleryExists(_exists_message(name))
            return
        elsewhere = self._defined_elsewhere(name)
        if elsewhere is not None:
            raise GalleryExists(f"model {name!r} is defined in {elsewhere}, which an install "
                                f"(writing {name}.yaml) cannot replace: remove or edit that "
                                "file, or choose another \"name\"")

    # -- admitting -------------------------------------------------------------------------

    async def apply(self, wanted: str, name: str | None, overrides: dict, *,
                    replace: bool = False) -> str:
        """Admit an install.  :raises GalleryExists: the name is installed and ``replace``
        is false (an install must not silently rewrite another model's config)."""
        entry = await self.find(wanted)
        op = _Op(str(uuid.uuid4()), name or entry.name, False, entry, overrides, replace)
        self._check_name(op.name, replace)
        await self._admit(op, description=entry.description, element=entry.id)
        return op.id

    async def delete(self, name: str) -> str:
        op = _Op(str(uuid.uuid4()), name, True)
        await self._admit(op, description="", element=name)
        return op.id

    async def apply_backend(self, wanted: str, node_id: str | None = None,
                            node_name: str = "", *, force: bool = False) -> str:
        """Admit a backend install (every connected backend worker, or ``node_id``).
        :raises GalleryError: no such entry, or the gallery cannot be read."""
        if self.backends is None:
            raise GalleryError("backend installs are not available on this replica")
        entry, entries = await self.backends.find(wanted)
        op = _Op(str(uuid.uuid4()), job_key(entry.name), False,
                 backend={"name": entry.name, "entry": entry, "entries": entries,
                          "node_id": node_id, "node": node_name, "force": force})
        await self._admit(op, description=entry.description, element=entry.id)
        return op.id

    async def delete_backend(self, name: str, node_id: str | None = None,
                             node_name: str = "") -> str:
        if self.backends is None:
            raise GalleryError("backend deletes are not available on this replica")
        op = _Op(str(uuid.uuid4()), job_key(name), True,
                 backend={"name": name, "node_id": node_id, "node": node_name})
        await self._admit(op, description="", element=name)
        return op.id

    async def _admit(self, op: _Op, *, description: str, element: str) -> None:
        if len(self._queue) >= MAX_QUEUED:
            raise GalleryBusy(f"{MAX_QUEUED} gallery jobs are queued on this replica already; "
                              "try again when some have finished")
        snapshot = {"id": op.id, "state": "queued", "processed": False, "deletion": op.deletion,
                    "message": "queued", "progress": 0, "file_name": "", "current_bytes": 0,
                    "total_bytes": 0, "bytes_per_second": 0, "file_size": "",
                    "downloaded_size": "", "gallery_element_name": element, "model": op.name,
                    "description": description, "error": None, "cancelled": False,
                    "cancellable": False, "replica": self.instance_id}
        if op.backend is not None:
            snapshot.update(model="", backend=op.backend["name"],
                            node=op.backend.get("node") or "")
        await self._publish(op.id, snapshot)
        self._queue.append(op)
        if not self._running:
            self._running = True
            defer.ensureDeferred(self._drain())

    async def _drain(self) -> None:
        try:
            while self._queue and self.running:
                op = self._queue.popleft()
                try:
                    await self._run(op)
                except Exception as e:
                    if not self.running:  # stopping: the database may be gone already
                        log.warn("gallery job {id} stopped with the replica ({e})", id=op.id,
                                 e=type(e).__name__)
                        continue
                    if isinstance(e, DATABASE_DOWN):
                        why = "the database was unavailable; apply again"
                    else:
                        why = f"internal error ({type(e).__name__}); see the frontend log"
                        log.failure("gallery job {id} failed unexpectedly", Failure(),
                                    id=op.id)
                    # no row could be written: say so to every replica that can hear it
                    await self._publish(op.id, dict(self.snapshots.get(op.id) or {"id": op.id},
                                                    state="failed", processed=True, error=why,
                                                    message=why, replica=self.instance_id))
        finally:
            self._running = False

    # -- snapshots -------------------------------------------------------------------------

    def _remember(self, job_id: str, snapshot: dict) -> None:
        known = self.snapshots.get(job_id)
        if known is not None and known.get("replica") == snapshot.get("replica") \
                and known.get("seq", 0) >= snapshot.get("seq", 0):
            return  # an older snapshot of the same job arrived late
        if "description" not in snapshot and known is not None and "description" in known:
            snapshot = dict(snapshot, description=known["description"])
        self.snapshots[job_id] = snapshot
        self.snapshots.move_to_end(job_id)
        while len(self.snapshots) > MAX_REMEMBERED:
            self.snapshots.popitem(last=False)

    def _heard(self, subject: str, payload: Any) -> None:
        job_id = subject.split(".", 1)[1]
        if isinstance(payload, dict) and payload.get("id") == job_id:
            self._remember(job_id, payload)

    async def _publish(self, job_id: str, snapshot: dict) -> None:
        self._seq += 1
        snapshot = dict(snapshot, seq=self._seq)
        self._remember(job_id, snapshot)
        try:
            await self.bus.publish(f"{SUBJECT_ROOT}.{job_id}", snapshot)
        except Exception as e:  # a hint: the row is the record
            log.warn("gallery job {id}: the broadcast failed ({e}); other replicas see it "
                     "when its row is written", id=job_id, e=str(e)[:200])

    async def status(self, job_id: str) -> dict | None:
        """The job as this replica knows it: a finished row wins; then the latest broadcast;
        then a running row (a replica that missed the broadcasts)."""
        try:
            uuid.UUID(job_id)
        except ValueError:
            return None
        rows = await self.db.runQuery(_ROW_SQL, (INSTANCE_LIVENESS, job_id))
        heard = self.snapshots.get(job_id)
        if rows:
            state, status, live = rows[0]
            status = status if isinstance(status, dict) else json.loads(status)
            if state != "running":
                return dict(status, source="row")
            if heard is None:
                return dict(status, source="row")
            if not live:
                return dict(status, state="failed", processed=True,
                            error="the replica running it stopped", source="row")
        if heard is None:
            return None
        if not rows and heard.get("state") == "queued" and heard.get("replica") \
                and not await self._live(heard["replica"]):
            return dict(heard, state="failed", processed=True, source="broadcast",
                        error="the replica that admitted it stopped before it started")
        return dict(heard, source="broadcast")

    async def _live(self, replica: str) -> bool:
        rows = await self.db.runQuery(_LIVE_SQL, (replica, INSTANCE_LIVENESS))
        return bool(rows)

    # -- running ---------------------------------------------------------------------------

    async def _run(self, op: _Op) -> None:
        base = dict(self.snapshots.get(op.id) or {})
        base.update(state="running", message="starting")
        await self.db.runOperation(_PURGE_SQL, (ROW_RETENTION_SECONDS,))
        await self.db.runOperation(_CLAIM_STALE_SQL, (op.name, INSTANCE_LIVENESS))
        row = dict(base)
        row.pop("seq", None)
        claimed = await self.db.runQuery(
            _CLAIM_SQL, (op.id, op.name, op.deletion, self.instance_id, json.dumps(row)))
        if not claimed:
            holder = await self.db.runQuery(_HOLDER_SQL, (op.name,))
            other = f"job {holder[0][0]} on replica {holder[0][1]}" if holder else "another job"
            jobs = "backends" if op.backend else "models"
            reason = (f"{op.label} is being installed or deleted by {other}; wait for it "
                      f"(GET /{jobs}/jobs/{holder[0][0] if holder else '<id>'}) and try again")
            await self._finish(op, base, reason, claimed=False)
            return
        await self._publish(op.id, base)
        result: dict = {}
        try:
            if op.backend is not None:
                result = await self._backend_op(op, base)
            elif op.deletion:
                await self._delete(op)
            else:
                await self._install(op, base)
        except (GalleryError, ModelFileMismatch, ModelConfigError) as e:
            await self._finish(op, base, str(e))
        except Exception as e:
            log.failure("gallery job {id}", Failure(), id=op.id)
            await self._finish(op, base, f"internal error ({type(e).__name__}); see the log")
        else:
            base.update(result)
            await self._finish(op, base, None)

    async def _backend_op(self, op: _Op, base: dict) -> dict:
        """A backend's install or delete (``backend_installs.py``), reporting into this
        job's snapshots."""
        assert op.backend is not None and self.backends is not None

        def report(**fields) -> defer.Deferred:
            base.update({k: v for k, v in fields.items() if v is not None})
            snapshot = {k: v for k, v in base.items() if k != "description"}

            def publish(_):
                if not op.finished:
                    return defer.ensureDeferred(self._publish(op.id, snapshot))

            self._publishing = self._publishing.addCallback(publish).addErrback(
                lambda f: log.failure("gallery progress", f))
            return self._publishing

        try:
            if op.deletion:
                return await self.backends.delete(op.backend["name"], op.backend["node_id"])
            return await self.backends.install(op.backend["entry"], op.backend["entries"],
                                               op.backend["node_id"], report,
                                               force=op.backend.get("force", False))
        finally:
            op.finished = True
            await self._publishing  # no progress snapshot after the final one

    async def _finish(self, op: _Op, base: dict, error: str | None, *,
                      claimed: bool = True) -> None:
        final = dict(base, state="failed" if error else "done", processed=True, error=error,
                     message=error or ("deleted" if op.deletion else "installed"),
                     progress=0 if error else 100, bytes_per_second=0)
        final.pop("seq", None)
        if claimed:
            sql, args = _FINISH_SQL, (final["state"], json.dumps(final), op.id)
        else:
            sql, args = _FAILED_ROW_SQL, (op.id, op.name, op.deletion, self.instance_id,
                                          json.dumps(final))
        for attempt in range(FINISH_TRIES):
            try:
                await self.db.runOperation(sql, args)
                break
            except DatabaseUnavailable:
                if attempt + 1 == FINISH_TRIES or not self.running:
                    raise  # the row stays running: failed once this replica is not live
                await task.deferLater(self._reactor, 1.0 * (attempt + 1), lambda: None)
        log.info("gallery job {id} ({what} {model}): {state}{why}", id=op.id,
                 what="delete" if op.deletion else "install", model=op.label,
                 state=final["state"], why=f": {error}" if error else "")
        await self._publish(op.id, final)

    async def _install(self, op: _Op, base: dict) -> None:
        entry = op.entry
        assert entry is not None
        config_text: Any = entry.config_file
        files = list(entry.files)
        if entry.url:
            self._refuse_local(entry.url, f"entry {entry.id}: url")
            data = await read_url(entry.url, MAX_CONFIG_BYTES, self._reactor, self._agent)
            try:
                remote = yaml_load(data)
            except yaml.YAMLError as e:
                raise GalleryError(f"entry {entry.id}: its url is not YAML ({str(e)[:200]})") \
                    from None
            if not isinstance(remote, dict):
                raise GalleryError(f"entry {entry.id}: its url must hold a YAML mapping")
            config_text = remote.get("config_file")
            files = list(parse_files(remote.get("files"), f"entry {entry.id} (url)")) + files
        elif config_text is None and not entry.overrides and not files and not op.overrides:
            raise GalleryError(f"entry {entry.id} installs nothing: no url, config_file, "
                               "overrides or files")
        if isinstance(config_text, str):
            try:
                config = yaml_load(config_text.encode("utf-8")) or {}
            except yaml.YAMLError as e:
                raise GalleryError(f"entry {entry.id}: config_file is not YAML "
                                   f"({str(e)[:200]})") from None
        else:
            config = config_text or {}
        if not isinstance(config, dict):
            raise GalleryError(f"entry {entry.id}: config_file must be a YAML mapping")
        config = merge(merge(config, entry.overrides), op.overrides)
        config["name"] = op.name
        self._check_name(op.name, op.replace)  # (again: written since it was admitted?)
        parsed = parse_model_config(config, f"gallery entry {entry.id}")
        # the entry's files and what its config downloads at a cold load: none may read the
        # replica's own files (an install is a request's doing)
        for download in (*files, *parsed.downloads):
            self._refuse_local(download.uri, download.where)
        model = dataclasses.replace(parsed, downloads=tuple(files))

        targets = [os.path.join(self.models_dir, *f.filename.split("/")) for f in files]
        existed = {t for t in targets if os.path.exists(t)}
        progress = task.LoopingCall(self._progress, op, base, len(files))
        progress.clock = self._reactor
        progress.start(self.progress_interval, now=False)
        try:
            os.makedirs(self.models_dir, exist_ok=True)
            await self.downloads.ensure(model)
        except BaseException:
            for target in targets:
                if target not in existed:
                    _remove(target)
            raise
        finally:
            progress.stop()
            op.finished = True
            await self._publishing  # no progress snapshot after the final one
        record = {"name": op.name, "description": entry.description, "license": entry.license,
                  "urls": list(entry.urls), "icon": entry.icon, "gallery": entry.id,
                  "files": [{"filename": f.filename, "uri": f.uri, "sha256": f.sha256 or ""}
                            for f in files]}
        try:
            await threads.deferToThreadPool(
                self._reactor, self._reactor.getThreadPool(), self._write, op.name, config,
                record)
        except OSError as e:
            for target in targets:
                if target not in existed:
                    _remove(target)
            raise GalleryError(f"model {op.name}: the config cannot be written: "
                               f"{e.strerror}") from None

    def _progress(self, op: _Op, base: dict, nfiles: int) -> None:
        try:
            self._progress_once(op, base, nfiles)
        except Exception:  # a progress line is not worth stopping the loop or the job
            log.failure("gallery job {id}: progress", Failure(), id=op.id)

    def _progress_once(self, op: _Op, base: dict, nfiles: int) -> None:
        current = [d for d in self.downloads.in_progress() if d["model"] == op.name]
        if not current:
            return
        d = current[0]
        total = d.get("total") or 0
        base.update(message="downloading", file_name=d["file"],
                    current_bytes=d["received"], total_bytes=total,
                    bytes_per_second=d["bytes_per_second"],
                    progress=round(100.0 * d["received"] / total, 1) if total else 0,
                    file_size=_human(total), downloaded_size=_human(d["received"]),
                    files=nfiles)
        base["state"] = "downloading"
        # (the description, up to 64 KiB, is in the queued and final snapshots and the row;
        # progress once a second goes without it, and a replica keeps the one it has)
        snapshot = {k: v for k, v in base.items() if k != "description"}

        def publish(_):
            if not op.finished:
                return defer.ensureDeferred(self._publish(op.id, snapshot))

        self._publishing = self._publishing.addCallback(publish).addErrback(
            lambda f: log.failure("gallery progress", f))

    def _write(self, name: str, config: dict, record: dict) -> None:
        """The config YAML and the gallery record, each through a temporary file and a
        rename (the record first: a config is never there without it)."""
        _atomic_write(os.path.join(self.models_dir, f"._gallery_{name}.yaml"),
                      yaml.safe_dump(record, sort_keys=False, allow_unicode=True))
        _atomic_write(os.path.join(self.models_dir, f"{name}.yaml"),
                      yaml.safe_dump(config, sort_keys=False, allow_unicode=True))

    async def _delete(self, op: _Op) -> None:
        if not is_file_name(op.name):
            raise GalleryError(f"{op.name[:64]!r} is not a model name")

        def remove() -> bool:
            config = os.path.join(self.models_dir, f"{op.name}.yaml")
            record_path = os.path.join(self.models_dir, f"._gallery_{op.name}.yaml")
            if not os.path.exists(config) and not os.path.exists(record_path):
                return False
            mine = _record_files(record_path)
            others: set[str] = set()
            for entry in os.scandir(self.models_dir):
                if entry.name.startswith("._gallery_") and entry.path != record_path:
                    others |= _record_files(entry.path)
            _remove(config)
            root = os.path.realpath(self.models_dir)
            for filename in mine - others:
                target = os.path.realpath(os.path.join(root, *filename.split("/")))
                if os.path.commonpath([root, target]) == root and target != root:
                    _remove(target)
            _remove(record_path)
            if self.downloads.store is not None:  # a file no other model names: its copy goes
                self.downloads.store.sweep()
            return True

        found = await threads.deferToThreadPool(self._reactor, self._reactor.getThreadPool(),
                                                remove)
        if not found:
            raise GalleryError(f"model {op.name} is not installed (no {op.name}.yaml)")


def _record_files(path: str) -> set[str]:
    try:
        with open(path, "rb") as f:
            record = yaml_load(f.read(MAX_CONFIG_BYTES))
        return {f["filename"] for f in record.get("files") or ()
                if isinstance(f, dict) and isinstance(f.get("filename"), str)}
    except (OSError, yaml.YAMLError, AttributeError, TypeError):
        return set()


def _atomic_write(path: str, text: str) -> None:
    fd, temp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".",
                                suffix=".partial", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        _remove(temp)
        raise


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warn("cannot remove {path}: {e}", path=path, e=e.strerror)


def _human(n: int) -> str:
    return f"{n / 1024**2:.1f} MiB" if n else ""

