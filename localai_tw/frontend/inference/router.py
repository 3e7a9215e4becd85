"""``InferenceRouter``: the ``IInferenceRouter`` of a frontend replica.

For each request: the model's config (``ModelCatalog``; its use cases are never a reason to
refuse, as in LocalAI: the backend answers what it cannot do) -> a loaded placement (warm
path, ``NodeChooser``), or a cold load under the cross-replica lock (``LoadLock``,
``ColdLoader``) -> the gRPC call through the (node, port) bridge -> the answer checked for
what was asked of it (``honoured.py``) -> ``Served(value, served_by=node)``.

Warm-path failures, and what may happen on each (docs/inference.md):

=========================================  ==================================================
the call failed with                       done
=========================================  ==================================================
``StreamRefused`` at the dial (the worker  reap the row (the worker's answer), cold-load and
said the backend port is not there)        retry once: the call never reached a backend
``BackendAnswer`` ``FAILED_PRECONDITION``  reap, reload, retry once: the backend lost its model
"model not loaded", or ``NOT_FOUND``       or another model holds the port; nothing ran
"model identity mismatch"
``BackendCrashed`` (asked after a failure  reap the row and raise (502 ``backend_crashed``);
shaped like a dying process, the worker    retried once only when the worker changed the
said its process died: ``crashes.py``)     model's next start (``fallback``) and nothing was
                                           sent yet
``BackendAnswer`` ``UNAVAILABLE`` (no      reap the row and raise: the backend died under the
dial error: the backend went away mid-call) call; the next request reloads
any other ``BackendAnswer``                raise; the row stays (a bad request, a backend bug)
a routing fact or an absence within the     raise nothing yet: skip that node (``WorkerGone``:
grace at the dial (the worker's tunnel is  mark it unhealthy, status only) and serve from
gone, reconnecting, or never dialled)      another node, cold-loading there if needed (up
                                           to ``MAX_SKIPS`` nodes); never reap, and the
                                           skipped node's rows stay for its return
an unreachable peer, a transport failure,  raise; never reap, never demote
the caller's deadline, a cancellation
=========================================  ==================================================

Each call is counted in flight on this replica while it runs, and its use is touched (both
in ``usage.ModelUse``: memory only, flushed to ``node_models.last_used`` once a second).
Unloads are :mod:`.lifecycle`'s.
``Predict`` and ``PredictStream`` of a ``prefix_cache`` model carry the prompt's prefix chain
(``prefix_index.py``) to the chooser, which prefers the replica warm for it; where each call
goes is remembered there and told to every replica as it starts (``prefix_fanout.py``), as
LocalAI records its observation when it routes; only when it was chosen among several loaded
replicas (a model on one node costs nothing).
The warm path reads no database: the loaded placements come from the chooser's
``PlacementCache`` (``placement_cache.py``).  A call that fails with the worker's answer, a
routing fact or an absence drops that model's entry first (``NodeChooser.forget``), then the
failure is classified by the table above exactly as for a placement read from the database,
and the retry (if any) excludes nothing cached: it reads the database.

Retries happen only when the call is known not to have run: a dial failure (the splice was
abandoned before any byte reached a backend) or a backend refusal before touching the model;
and once after a crash the worker answered with a ``fallback`` (it starts the model differently
next time, the AMX fallback of ``backends/amx_fallback.py``) while nothing was sent to the
client: the crashed call left nothing behind, and the same input would crash it again
otherwise.

``tts``, ``transcribe`` and ``generate_image`` name files by path on the backend's machine: each
runs in a scratch directory of the serving node (``WorkerScratch``, ``frontend/inference/scratch.py``),
made before the call and removed after it.  Failures while making it or putting the input are
classified by the same table (a route failure skips the node); once the backend answered,
nothing is retried (reading its output back failed after the work ran).

What this module must never do: reap a row on anything but the worker's answer; retry a call
that may have run (a Predict that failed mid-way is reported, not repeated; the one exception
above is a crash the worker changes the next start for); block the reactor.
"""

from __future__ import annotations

from typing import Callable

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from localai_tw import errors
from localai_tw.metrics import current_hops

from localai_tw.frontend.inference.interfaces import (
    IInferenceRouter,
    ModelNotFound,
    NoNodeAvailable,
    Served,
)
from localai_tw.localai.catalog import ModelCatalog
from localai_tw.localai.model_config import ModelConfig
from localai_tw.frontend.inference.coldload import ColdLoader
from localai_tw.frontend.inference.crashes import crash_shaped
from localai_tw.frontend.inference.honoured import HeldUntilLogprobs, check_reply
from localai_tw.frontend.inference.loadlock import LoadLock
from localai_tw.frontend.inference.placement import NodeChooser, Placement

log = Logger()

#: Attempts per request on the worker's answer: the first, plus one after a reap.
MAX_ATTEMPTS = 2
#: Nodes one request may skip because it cannot reach them (routing fact, absence).
MAX_SKIPS = 4
#: Scratch file names: what a backend writes, what a transcription reads.
SPEECH_FILE, IMAGE_FILE = "speech.wav", "image.png"
#: What ffmpeg makes of a transcription upload that is not WAV, and its bound (16 kHz mono
#: 16-bit: about 35 minutes of audio).
TRANSCRIPTION_WAV = "audio.wav"
MAX_TRANSCRIPTION_WAV_BYTES = 64 * 1024 * 1024


def _carries_identity(request) -> bool:
    """Whether ``request`` has a ``ModelIdentity`` field (``DetokenizeRequest`` has none in
    LocalAI's contract: its backend cannot check which model answers)."""
    return "ModelIdentity" in request.DESCRIPTOR.fields_by_name


def _reloadable(error: BaseException) -> bool:
    """The backend refused before running anything: its model is gone or another one is there."""
    if not isinstance(error, errors.BackendAnswer):
        return False
    if error.code == "FAILED_PRECONDITION" and "not loaded" in error.details:
        return True
    return error.code == "NOT_FOUND" and "model identity mismatch" in error.details


def _check_result(node_id: str, method: str, result) -> None:
    """A ``Result`` with ``success=false`` is the backend's failure, in its own words (a
    refused input is a gRPC ``INVALID_ARGUMENT`` status instead, answered 400)."""
    if not result.success:
        raise errors.BackendAnswer(node_id, "UNKNOWN",
                                   (result.message or f"{method} failed")[:2048])


@implementer(IInferenceRouter)
class InferenceRouter:
    """Implements ``IInferenceRouter`` over a :class:`ModelCatalog`, a :class:`NodeChooser`
    (where a model is loaded), a :class:`LoadLock` (cold loads, one per model across
    replicas), a :class:`ColdLoader` and ``BackendClients``; ``use`` (a ``ModelUse``) counts
    calls in flight and batches touches, ``lifecycle`` (a ``ModelLifecycle``) unloads."""

    def __init__(self, catalog: ModelCatalog, chooser: NodeChooser, loads: LoadLock,
                 loader: ColdLoader, clients, reactor, scratch=None, *, use=None,
                 lifecycle=None, scaler=None, crashes=None, prefix=None):
        self.use = use
        #: ``prefix_fanout.PrefixRouting``: chat and completion calls go where their prompt's
        #: head is warm, and what was served is remembered (None: no prefix routing).
        self.prefix = prefix
        #: ``crashes.CrashProbe``: asks the worker whether a failed call's backend crashed.
        self.crashes = crashes
        self.lifecycle = lifecycle
        #: ``replicas.ReplicaScaler``: told of each call (a busy model gets another replica).
        self.scaler = scaler
        self.catalog = catalog
        #: ``WorkerScratch``: files both ways for the RPCs that name files (``dst``).
        self.scratch = scratch
        self.chooser = chooser
        self.loads = loads
        self.loader = loader
        self.clients = clients
        self._reactor = reactor

    @property
    def models_dir(self) -> str:
        return self.catalog.models_dir

    # -- IInferenceRouter -----------------------------------------------------------------

    def models(self) -> list[ModelConfig]:
        return self.catalog.models()

    def model(self, name: str) -> ModelConfig | None:
        return self.catalog.get(name)

    def model_error(self, name: str):
        return self.catalog.error(name)

    def model_errors(self) -> dict[str, str]:
        return {name: str(e) for name, e in self.catalog.broken().items()}

    def predict(self, name, options, deadline=None) -> defer.Deferred:
        def checked(served):
            check_reply(name, options, served.value, served.served_by)
            return served

        return self._serve(name, options, deadline,
                           lambda client, req, dl: client.call("Predict", req, dl),
                           by_prefix=True).addCallback(checked)

    def embed(self, name, options, deadline=None) -> defer.Deferred:
        return self._serve(name, options, deadline,
                           lambda client, req, dl: client.call("Embedding", req, dl))

    def tokenize(self, name, options, deadline=None) -> defer.Deferred:
        return self._serve(name, options, deadline,
                           lambda client, req, dl: client.call("TokenizeString", req, dl))

    def detokenize(self, name, request, deadline=None) -> defer.Deferred:
        return self._serve(name, request, deadline,
                           lambda client, req, dl: client.call("Detokenize", req, dl))

    def rerank(self, name, request, deadline=None) -> defer.Deferred:
        return self._serve(name, request, deadline,
                           lambda client, req, dl: client.call("Rerank", req, dl))

    def tts(self, name, request, max_bytes, deadline=None,
            response_format: str = "wav") -> defer.Deferred:
        async def call(client, req, dl, answered):
            async with self._scratch().directory(client.node_id, dl) as where:
                req.dst = where.path_of(SPEECH_FILE)
                result = await client.call("TTS", req, dl)
                answered.append(True)
                _check_result(client.node_id, "TTS", result)
                if response_format == "wav":
                    return await where.fetch(SPEECH_FILE, max_bytes)
                converted = f"speech.{response_format}"
                await where.convert(SPEECH_FILE, converted, response_format, max_bytes)
                return await where.fetch(converted, max_bytes)

        return self._serve_with_files(name, request, deadline, call)

    def transcribe(self, name, request, audio_path, audio_name, deadline=None,
                   convert_from: str | None = None) -> defer.Deferred:
        async def call(client, req, dl, answered):
            async with self._scratch().directory(client.node_id, dl) as where:
                req.dst = await where.put(audio_path, audio_name)
                if convert_from is not None:  # ffmpeg on the worker: 16 kHz mono WAV
                    req.dst = await where.convert(audio_name, TRANSCRIPTION_WAV, "wav16k",
                                                  MAX_TRANSCRIPTION_WAV_BYTES,
                                                  input_format=convert_from)
                result = await client.call("AudioTranscription", req, dl)
                answered.append(True)
                return result

        return self._serve_with_files(name, request, deadline, call)

    def generate_image(self, name, request, max_bytes, deadline=None) -> defer.Deferred:
        async def call(client, req, dl, answered):
            async with self._scratch().directory(client.node_id, dl) as where:
                req.dst = where.path_of(IMAGE_FILE)
                result = await client.call("GenerateImage", req, dl)
                answered.append(True)
                _check_result(client.node_id, "GenerateImage", result)
                return await where.fetch(IMAGE_FILE, max_bytes)

        return self._serve_with_files(name, request, deadline, call)

    def _serve_with_files(self, name, request, deadline, call) -> defer.Deferred:
        """A call that moves files through the node's scratch directory.  Before the backend
        answered, a failure is classified like any call's (a route failure while making the
        directory or putting the input: served from another node); once it answered, nothing
        is retried (reading its output back failed after the work ran)."""
        answered: list[bool] = []
        return self._serve(name, request, deadline,
                           lambda client, req, dl: call(client, req, dl, answered),
                           lambda: not answered)

    def _scratch(self):
        if self.scratch is None:
            raise RuntimeError("this router was built without WorkerScratch")
        return self.scratch

    def predict_stream(self, name, options, on_reply, deadline=None,
                       on_start=None, on_loading=None) -> defer.Deferred:
        started: list[bool] = []

        hops = current_hops()

        def deliver(reply, node_id: str):
            if not started:
                started.append(True)
                if hops.backend_at is not None:  # time to first token, from the call's start
                    hops.first_token = max(0.0, hops.now() - hops.backend_at)
                if on_start is not None:
                    on_start(node_id)
            return on_reply(reply)

        def call(client, req, dl):
            # logprobs asked: nothing goes out before the backend showed it honours them
            gate = HeldUntilLogprobs(name, options, client.node_id,
                                     lambda r: deliver(r, client.node_id))
            d = client.stream("PredictStream", req, gate.reply, dl)
            return d.addCallback(lambda _: defer.ensureDeferred(gate.end()))

        def retry_allowed() -> bool:
            return not started  # once a reply went out, a retry would repeat it

        return self._serve(name, options, deadline, call, retry_allowed,
                           on_loading=on_loading, by_prefix=True)

    # -- extra (not in the interface) -------------------------------------------------------

    def loading_detail(self, name: str) -> str | None:
        """What a cold load of ``name`` waits for now, when it is a download of this replica
        (for the ``: loading model`` comments of a waiting stream)."""
        return self.loader.downloads.describe(name)

    def unload(self, name: str, node_id: str, force: bool = False) -> defer.Deferred:
        """Fires with a ``lifecycle.UnloadResult`` (the row follows the worker's answer)."""
        return defer.ensureDeferred(self.lifecycle.unload(name, node_id, force=force))

    # -- the request path --------------------------------------------------------------------

    async def _crash_told(self, placement: Placement, calling):
        """``calling``'s result; when it failed the way a dying backend makes calls fail, the
        worker is asked, and its answer that the process crashed replaces the failure."""
        try:
            return await calling
        except (errors.BackendAnswer, errors.TransportFailure) as e:
            if self.crashes is None or not crash_shaped(e):
                raise
            crash = await self.crashes.explain(placement)
            if crash is None:
                raise
            raise crash from e

    def _serve(self, name, options, deadline, call: Callable,
               retry_allowed: Callable[[], bool] = lambda: True,
               on_loading: Callable[[str], object] | None = None,
               by_prefix: bool = False) -> defer.Deferred:
        config = self.catalog.get(name)
        if config is None:
            return defer.fail(ModelNotFound(name))
        chain = (self.prefix.chain_for(config, options)
                 if by_prefix and self.prefix is not None else ())
        return defer.ensureDeferred(self._run(config, options, deadline, call, retry_allowed,
                                              on_loading, chain))

    async def _placement(self, config: ModelConfig, exclude: frozenset[str],
                         deadline, on_loading=None, chain: tuple[int, ...] = ()) -> Placement:
        hops = current_hops()
        since = hops.now()
        placement = await (self.chooser.loaded_placement(config, exclude, chain) if chain
                           else self.chooser.loaded_placement(config, exclude))
        since = hops.add("placement", since)
        if placement is not None:
            return placement
        if on_loading is not None:
            try:
                on_loading(config.name)
            except Exception:
                log.failure("on_loading hook of {model} failed", model=config.name)
        try:
            return await self.loads.load(config, exclude, deadline)
        finally:  # the wait for the lock, then the load it drove (``LoadLock`` marks both)
            hops.loaded(since)

    async def _run(self, config, options, deadline, call, retry_allowed, on_loading=None,
                   chain: tuple[int, ...] = ()):
        if on_loading is not None:
            hook, told = on_loading, []

            def on_loading(name: str) -> None:  # once per request, even across a retry
                if not told:
                    told.append(True)
                    hook(name)
        exclude: set[str] = set()
        last_error: BaseException | None = None
        reloads = 0
        while True:  # ends: each reload is counted, each skip excludes one more node
            if deadline is not None and self._reactor.seconds() >= deadline:
                raise errors.CallerDeadlineExceeded(f"serving model {config.name}")
            try:
                placement = await self._placement(config, frozenset(exclude), deadline,
                                                  on_loading, chain)
            except NoNodeAvailable:
                if last_error is not None:
                    raise last_error from None
                raise
            request = options.__class__()
            request.CopyFrom(options)
            if placement.model_id and _carries_identity(request):
                request.ModelIdentity = placement.model_id
            client = self.clients.client(placement.node_id, placement.port)
            if chain and placement.choice_of > 1:
                # this prompt's head goes into that node's KV cache (prefix_fanout.py): told
                # now, so the other replicas know it long before the next turn comes
                self.prefix.observe(config.name, chain, placement.node_id)
            if self.scaler is not None:
                self.scaler.note(config, placement.node_id)
            call_id = (self.use.begin(placement.node_id, config.name)
                       if self.use is not None else None)
            hops = current_hops()
            try:
                with hops.calling(getattr(client, "route", None)):
                    value = await self._crash_told(placement, call(client, request, deadline))
            except errors.BackendCrashed as e:
                # The worker says the process died under the call: its row goes (the model
                # is not loaded there any more) and the next request loads it again.  Not
                # retried, the same input would crash it again, unless the worker changed
                # the next start because of this crash (``fallback``) and nothing was sent.
                self.chooser.forget(placement)
                await self.chooser.reap(placement, e)
                last_error = e
                if e.fallback and retry_allowed() and reloads + 1 < MAX_ATTEMPTS:
                    reloads += 1
                    log.info("model {model} on node {node}: {err}; the worker changed its next "
                             "start ({fallback}): loading again and retrying once",
                             model=config.name, node=placement.node_id, err=e,
                             fallback=e.fallback)
                    continue
                raise
            except errors.WorkerAnswer as e:
                self.chooser.forget(placement)  # the next request reads the database
                if isinstance(e, errors.StreamRefused) or _reloadable(e):
                    await self.chooser.reap(placement, e)
                    last_error = e
                    if retry_allowed() and reloads + 1 < MAX_ATTEMPTS:
                        reloads += 1
                        log.info("model {model} on node {node}: {err}; reloading and retrying "
                                 "once", model=config.name, node=placement.node_id, err=e)
                        continue
                    raise
                if isinstance(e, errors.BackendAnswer) and e.code == "UNAVAILABLE":
                    await self.chooser.reap(placement, e)
                raise
            except (errors.RoutingFact, errors.AbsentWithinGrace) as e:
                # No route to that node now, or it is away within the grace: the call never
                # reached a backend, so serve from another node (loading there if needed).
                # Acts on nothing: the node's rows stay for its return (WorkerGone alone
                # demotes it, status only).  Only the warm-path cache forgets the placement.
                self.chooser.forget(placement)
                if isinstance(e, errors.WorkerGone):
                    await self.chooser.mark_gone(placement.node_id)
                exclude.add(placement.node_id)
                last_error = e
                if retry_allowed() and len(exclude) < MAX_SKIPS:
                    log.info("model {model}: node {node} cannot be reached ({err}); serving "
                             "from another node", model=config.name, node=placement.node_id,
                             err=e)
                    continue
                raise
            finally:
                if call_id is not None:
                    self.use.end(placement.node_id, config.name, call_id)
            if self.use is not None:
                self.use.touch(placement.node_id, placement.model_name)
            else:
                self.chooser.touch(placement)
            return Served(value, placement.node_id)
