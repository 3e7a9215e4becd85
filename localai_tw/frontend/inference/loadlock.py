"""One cold load per model across every replica: the ``model_load_jobs`` lock, waiting for it,
the tries over nodes (:mod:`.placement` picks, :mod:`.coldload` loads), and the memory of
failed loads.

:meth:`LoadLock.load`: take the ``model_load_jobs`` row for the model (insert, or take over a
row whose owner is not a live replica or whose ``last_progress_at`` is older than
``takeover_after``, on the database clock); others poll (every ``poll_interval``) until the
model is loaded or the lock is theirs, for at most ``load_wait`` seconds (then
``NoNodeAvailable``: try again later); the owner refreshes ``last_progress_at`` every
``heartbeat_interval`` while it works, and records each phase of the load.  Under the lock: the
loaded placement if another replica finished meanwhile, else a cold load on the picked node; a
load that meets a routing fact or an absence within the grace moves on to the next node (at
most ``MAX_PICKS``), touching nothing (no row, no status) on the node it leaves.  With a
``room`` policy (:mod:`.lifecycle`), each cold load first makes room on its node (eviction of
least recently used idle models).

:meth:`LoadLock.scale_up` (a busy model's next replica, or one short of its minimum,
:mod:`.replicas`): under the same lock, count the nodes holding the model and load it on one
more node (none of those) only when fewer than asked hold it.

Failed loads are remembered (per replica, in memory) for ``failed_load_memory`` seconds
(:data:`DEFAULT_FAILED_LOAD_MEMORY`, 30 s), keyed by the model's name and its whole config: a
request meanwhile -- a new one, or one already waiting for the lock -- fails at once with the
same ``ModelLoadFailed``, whose ``retry_in`` and text say when the load is tried again.  A
changed config file, or a changed file or folder it names (size or mtime at the top level), is
a new key and is tried at once.  Without this, every retry of a model
that cannot load (a hub id on a machine with no hub) paid the whole failing load again.

A model with downloads (``download_files``, a URL ``parameters.model``) has them made present
first, before the lock (``ColdLoader.download``: one download per file in this replica, shared
by every request that waits for it, bounded by the request's deadline), so a long download
holds no lock another replica's waiters give up on.

What this module must never do: run two loads of one model at once across replicas (the lock
row); compare times in Python (the database clock decides staleness and liveness).
"""

from __future__ import annotations

import functools
import uuid
from typing import Callable

from twisted.internet import defer, task
from twisted.logger import Logger

from localai_tw import errors
from localai_tw.cluster.clock import INSTANCE_IS_LIVE_SQL, INSTANCE_LIVENESS
from localai_tw.deferreds import wait_at_most
from localai_tw.metrics import current_hops
from localai_tw.staging_client import STAGING_WATCH

from localai_tw.frontend.inference.coldload import ColdLoader
from localai_tw.frontend.inference.interfaces import ModelLoadFailed, NoNodeAvailable
from localai_tw.localai.model_config import ModelConfig
from localai_tw.frontend.inference.placement import MAX_PICKS, NodeChooser, Placement

log = Logger()

DEFAULT_LOAD_WAIT = 60.0
DEFAULT_TAKEOVER_AFTER = 30.0
DEFAULT_HEARTBEAT = 5.0
DEFAULT_POLL = 0.25
#: Seconds a failed load is remembered (requests meanwhile fail at once with its error).
DEFAULT_FAILED_LOAD_MEMORY = 30.0

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


class LoadLock:
    """Cold loads of a model, one at a time across replicas (see the module docstring).

    :param chooser: the :class:`NodeChooser`; :param loader: the :class:`ColdLoader`."""

    def __init__(self, db, chooser: NodeChooser, loader: ColdLoader, instance_id: str,
                 reactor, *, load_wait: float = DEFAULT_LOAD_WAIT,
                 takeover_after: float = DEFAULT_TAKEOVER_AFTER,
                 heartbeat_interval: float = DEFAULT_HEARTBEAT,
                 poll_interval: float = DEFAULT_POLL,
                 failed_load_memory: float = DEFAULT_FAILED_LOAD_MEMORY,
                 liveness: float = INSTANCE_LIVENESS, room=None,
                 on_loaded: Callable[[str], object] | None = None):
        self._db = db
        #: ``room.make_room(model, node_id)`` runs before each cold load (never raises).
        self.room = room
        self._chooser = chooser
        self._loader = loader
        self.instance_id = instance_id
        self._reactor = reactor
        self.load_wait = load_wait
        self.takeover_after = takeover_after
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = poll_interval
        self.failed_load_memory = failed_load_memory
        # model name -> (config fingerprint, the failure, reactor time it expires)
        self._failed: dict[str, tuple[str, ModelLoadFailed, float]] = {}
        self._liveness = liveness
        #: model name -> bytes staged by the cold load this replica drives now (at most one
        #: per model: the lock), for ``/api/cluster/loads``.
        self.staging: dict[str, StagingProgress] = {}
        #: ``on_loaded(model_name)`` after a load under the lock placed the model (the placement
        #: caches drop it, here and at every replica, so a new replica is used at once).
        self.on_loaded = on_loaded

    # -- cold load --------------------------------------------------------------------------

    async def load(self, model: ModelConfig, exclude: frozenset[str] = frozenset(),
                   deadline: float | None = None) -> Placement:
        """A loaded placement of ``model``: an existing one if another replica finished
        meanwhile, else a cold load under the lock."""
        attempt = str(uuid.uuid4())
        if model.downloads:  # before the lock: a download may take long, and is shared
            existing = await self._chooser.loaded_placement(model, exclude)
            if existing is not None:
                return existing
            downloading = defer.ensureDeferred(self._loader.download(model))
            if deadline is None:
                await downloading
            else:
                try:
                    await wait_at_most(self._reactor, downloading,
                                       max(0.0, deadline - self._reactor.seconds()))
                except defer.TimeoutError:
                    raise errors.CallerDeadlineExceeded(
                        f"waiting for the files of model {model.name} to download") from None
        waited_until = self._reactor.seconds() + self.load_wait
        if deadline is not None:
            waited_until = min(waited_until, deadline)
        while True:
            existing = await self._chooser.loaded_placement(model, exclude)
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

        current_hops().locked()  # the trace's queue ends, its cold load begins
        return await self._holding(model, attempt,
                                   lambda: self._load_somewhere(model, exclude, attempt))

    async def scale_up(self, model: ModelConfig, want: int) -> Placement | None:
        """One more loaded replica of ``model`` on a node that does not hold it, when fewer
        than ``want`` nodes hold it: counted and loaded under the lock, so replicas asking at
        once never load more than ``want``.  None when ``want`` are already loaded or the lock
        stayed taken for ``load_wait`` (a load of it is running: ask again later)."""
        attempt = str(uuid.uuid4())
        waited_until = self._reactor.seconds() + self.load_wait
        while not await self._try_acquire(model.name, attempt):
            if self._reactor.seconds() >= waited_until:
                return None
            await task.deferLater(self._reactor, self.poll_interval, lambda: None)

        async def more() -> Placement | None:
            holders = frozenset(c.node_id for c in await self._chooser.candidates(model)
                                if c.loaded_address)
            if len(holders) >= want:
                return None
            return await self._load_somewhere(model, holders, attempt)
        return await self._holding(model, attempt, more)

    async def _holding(self, model: ModelConfig, attempt: str, work):
        """Run ``work()`` while the lock is ours: heartbeat, then release."""
        heartbeat = task.LoopingCall(self._beat, model.name, attempt)
        heartbeat.clock = self._reactor
        heartbeat.start(self.heartbeat_interval, now=False)
        try:
            placed = await work()
            if placed is not None and self.on_loaded is not None:
                try:
                    self.on_loaded(model.name)
                except Exception as e:
                    log.warn("telling the placement caches of the load of {model} failed: "
                             "{err}", model=model.name, err=e)
            return placed
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
        """Under the lock: the loaded placement if another replica finished meanwhile, else a
        cold load on the best node; when the load meets a routing fact or an absence within
        the grace, try the next candidate (at most ``MAX_PICKS`` nodes).  Nothing is acted on:
        the skipped node keeps its status and its rows (``WorkerGone`` alone demotes, status
        only); the condition itself is raised when no candidate is left."""
        existing = await self._chooser.loaded_placement(model, exclude)
        if existing is not None:
            return existing
        excluded = set(exclude)
        last: BaseException | None = None
        for _ in range(MAX_PICKS):
            try:
                node_id = await self._chooser.pick_for_load(model, frozenset(excluded))
            except NoNodeAvailable:
                if last is not None:
                    raise last from None
                raise
            if self.room is not None:
                await self.room.make_room(model, node_id)
            try:
                return await self._loader.load_on(
                    model, node_id, functools.partial(self._progress, model.name, attempt))
            except ModelLoadFailed as e:
                raise self._remember_failure(model, e) from e
            except (errors.RoutingFact, errors.AbsentWithinGrace) as e:
                if isinstance(e, errors.WorkerGone):
                    await self._chooser.mark_gone(node_id)
                log.info("cold load of model {model}: node {node} cannot be reached ({err}); "
                         "trying another node", model=model.name, node=node_id, err=e)
                excluded.add(node_id)
                last = e
        raise last  # MAX_PICKS nodes met a routing fact or an absence

    # -- the lock row -----------------------------------------------------------------------

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
        if phase is not None:  # the load's own progress (not the heartbeat): time and bytes
            self._phase_began(model_name, phase)
        await self._db.runOperation(
            "UPDATE model_load_jobs SET last_progress_at = now(),"
            " phase = COALESCE(%s, phase), node_id = COALESCE(%s, node_id)"
            " WHERE model_name = %s AND attempt = %s", (phase, node_id, model_name, attempt))

    async def _release(self, model_name: str, attempt: str) -> None:
        self.staging.pop(model_name, None)
        await self._db.runOperation(
            "DELETE FROM model_load_jobs WHERE model_name = %s AND attempt = %s",
            (model_name, attempt))

    def _beat(self, model_name: str, attempt: str) -> defer.Deferred:
        return defer.ensureDeferred(self._progress(model_name, attempt)).addErrback(
            lambda f: log.warn("load heartbeat of {model} failed: {err}", model=model_name,
                               err=f.getErrorMessage()))

    # -- progress of the load this replica drives ---------------------------------------------

    def _phase_began(self, model_name: str, phase: str) -> None:
        """A phase of the load began: the request's trace times it, and while it is
        ``staging`` the uploads it makes (``staging_client``, same request context) count
        their bytes into :attr:`staging`."""
        current_hops().phase(phase)
        if phase == "staging":
            watch = StagingProgress(self._reactor.seconds)
            self.staging[model_name] = watch
            STAGING_WATCH.set(watch)
        else:
            self.staging.pop(model_name, None)
            STAGING_WATCH.set(None)

    # -- failed-load memory -----------------------------------------------------------------

    def _remember_failure(self, model: ModelConfig, error: ModelLoadFailed) -> ModelLoadFailed:
        if self.failed_load_memory <= 0:
            return error
        until = self._reactor.seconds() + self.failed_load_memory
        self._failed[model.name] = (self._fingerprint(model), error, until)
        return self._recalled(model.name, error, self.failed_load_memory)

    def remembered_failure(self, model: ModelConfig) -> ModelLoadFailed | None:
        """The remembered failed load of ``model`` (this config), if still within its window."""
        entry = self._failed.get(model.name)
        if entry is None:
            return None
        fingerprint, error, until = entry
        left = until - self._reactor.seconds()
        if fingerprint != self._fingerprint(model) or left <= 0:
            del self._failed[model.name]
            return None
        return self._recalled(model.name, error, left)

    def _fingerprint(self, model: ModelConfig) -> str:
        """The whole config and the stamps of the files it names: a change of either is a
        new key, tried at once."""
        stamp = getattr(self._loader, "files_stamp", None)
        return repr((model, stamp(model) if stamp is not None else ()))

    @staticmethod
    def _recalled(name: str, error: ModelLoadFailed, left: float) -> ModelLoadFailed:
        seconds = max(1, int(left + 0.999))
        return ModelLoadFailed(
            name, error.node_id,
            f"{error.detail} [localai-tw remembers this failure: the load of {name!r} is "
            f"tried again in {seconds} s, or at once when its config or its files change]",
            retry_in=float(seconds))


class StagingProgress:
    """The bytes one cold load staged so far (``staging_client`` reports each file it begins,
    each chunk it reads for the body, and each file the worker already held, counted as
    staged with nothing moved).  ``total`` is what the cold loader announced
    (:func:`~localai_tw.staging_client.expect_staging`: every file of its plan), else the
    size of the files begun so far."""

    __slots__ = ("_clock", "started", "staged", "moved_bytes", "begun", "expected", "files")

    def __init__(self, clock):
        self._clock = clock
        self.started = clock()
        self.staged = self.moved_bytes = self.begun = self.files = 0
        self.expected: int | None = None

    def expect(self, total: int) -> None:
        self.expected = max(0, total)

    def begin(self, size: int) -> None:
        self.files += 1
        self.begun += max(0, size)

    def moved(self, count: int) -> None:
        self.staged += count
        self.moved_bytes += count

    def skipped(self, size: int) -> None:
        self.begin(size)
        self.staged += max(0, size)

    def view(self) -> dict:
        """``{"staged_bytes", "total_bytes", "files", "bytes_per_second"}`` (the rate of the
        bytes that moved)."""
        took = self._clock() - self.started
        rate = self.moved_bytes / took if took > 0 else 0.0
        total = self.expected if self.expected is not None else self.begun
        return {"staged_bytes": self.staged, "total_bytes": max(total, self.staged),
                "files": self.files, "bytes_per_second": round(rate, 1)}
