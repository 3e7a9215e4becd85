"""The inference interface the OpenAI-compatible API programs against, and its three failures.

``IInferenceRouter`` is the whole surface between ``frontend/api/openai/`` (HTTP, SSE, templates,
OpenAI-shaped errors) and the inference core (model configs, node choice, cold loads, gRPC
through the tunnel).  The API layer must never reach past it into the scheduler, the bridges or
the database; the core must never know about HTTP.

Failures (every returned Deferred fails with exactly one of these):

- ``ModelNotFound(name)`` - no model config by that name (HTTP 404 ``model_not_found``).
- ``ModelConfigInvalid(name, problem)`` - the file meant to define it cannot load (HTTP 500
  ``model_config_invalid``, naming the file and the reason).
- ``CapabilityNotHonoured(name, capability, node_id)`` - the backend answered without what
  the request asked (``logprobs``) though its backend name claims it (HTTP 400).
- ``NoNodeAvailable(name, reason)`` - a routing fact: no healthy ``backend`` node matches the
  model's node selector, or every candidate has no route now (HTTP 503).
- ``ModelLoadFailed(name, node_id, detail)`` - the worker answered: ``backend.start`` or
  ``LoadModel`` failed there.  ``detail`` is the backend's message (HTTP 500).  A failed load
  is remembered for ``Scheduler.failed_load_memory`` seconds (30 by default) per model and
  config content: requests meanwhile fail at once with the same error, whose ``retry_in``
  says when the load will be tried again.
- the conditions of ``localai_tw.errors``: ``BackendAnswer`` (the backend answered a call with a
  gRPC failure status; ``.code`` is the status name, e.g. ``INVALID_ARGUMENT``), ``WorkerAnswer``
  and subclasses, ``RoutingFact``, ``AbsentWithinGrace``, ``PeerUnreachable`` (retry later, 503),
  ``CallerDeadlineExceeded`` (the ``deadline`` ran out, 504), ``TransportFailure`` (a stream
  broke mid-call).
- ``defer.CancelledError`` when the caller cancelled the Deferred (e.g. client disconnect); the
  backend RPC is cancelled too.

How the serving node is reported: every successful result is a ``Served`` wrapper:
``result.value`` is the protobuf message and ``result.served_by`` the node id that answered
(for the ``X-LocalAI-Node`` response header).  ``predict_stream`` fires with a ``Served`` whose
``value`` is ``None``; in addition its ``on_reply`` callback receives plain ``backend_pb2.Reply``
messages, and ``on_start(node_id)`` (optional keyword) is called once, before the first reply, so
the API layer can send its headers naming the node before streaming the body.
``on_loading(name)`` (optional keyword) is called once when the request has to wait for a cold
load of the model (no loaded replica), so the API layer can tell a streaming client it waits.

Deadlines: ``deadline`` is an absolute time on the router's reactor clock
(``reactor.seconds() + timeout``) or ``None`` (the router's default per-call timeout applies,
cold loads included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from zope.interface import Attribute, Interface

from localai_tw.errors import ClusterError, RoutingFact, WorkerAnswer

T = TypeVar("T")


@dataclass(frozen=True)
class Served(Generic[T]):
    """A result and the node that produced it."""

    value: T
    served_by: str


class ModelNotFound(ClusterError):
    """No model config named ``name`` exists in the models directory.  Not a cluster condition;
    nothing may act on it."""

    actionable = False
    condition = "model-not-found"

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"model {name!r} is not configured")


class ModelConfigInvalid(ClusterError):
    """A file in the models directory was meant to define ``name`` but cannot load (bad YAML, a
    known key of the wrong type); ``problem`` names the file and the field.  Not a cluster
    condition: the operator fixes the file."""

    actionable = False
    condition = "model-config-invalid"

    def __init__(self, name: str, problem: str):
        self.name = name
        self.problem = problem
        super().__init__(f"model {name!r} has an invalid config: {problem}")


class ModelFileMismatch(ClusterError):
    """A model's files on this replica are not what its config says: a file or folder it
    names is missing or unreadable, a digest does not match, a folder is too large or holds a
    link out of it, a download failed.  Found before any worker is asked (nothing was started
    or staged), the message names the file; a local configuration problem, nothing about any
    worker, and nothing may act on it."""

    actionable = False
    condition = "model-file-mismatch"


class ModelDownloadFailed(ModelFileMismatch):
    """A file the model's config asks this replica to download (``download_files``, a URL
    ``parameters.model``) could not be fetched: an HTTP status, a timeout, a connection that
    broke, the size cap.  Nothing was kept; the next request tries again."""

    condition = "model-download-failed"


class ModelLoadFailed(WorkerAnswer):
    """The worker answered that the model could not be started or loaded (``backend.start``
    error, ``LoadModel`` returned success=false, or a failed file stage answered by the worker).
    The ``node_models`` row is removed before this is raised."""

    condition = "model-load-failed"

    def __init__(self, name: str, node_id: str, detail: str, retry_in: float | None = None):
        self.name = name
        self.detail = detail
        #: seconds until the load is tried again (None: the next request tries it)
        self.retry_in = retry_in
        WorkerAnswer.__init__(self, node_id, f"model {name!r} failed to load: {detail}")


class CapabilityNotHonoured(ClusterError):
    """The backend serving ``name`` answered without what the request asked of it
    (``capability``: ``logprobs``), though its backend's name claims it: another program
    under that name (a LocalAI backends directory's ``transformers``).  Told from the answer;
    nothing may act on it."""

    actionable = False
    condition = "capability-not-honoured"

    def __init__(self, name: str, capability: str, node_id: str):
        self.name = name
        self.capability = capability
        self.node_id = node_id
        super().__init__(f"the backend serving model {name!r} on node {node_id} answered "
                         f"without {capability}: it does not honour {capability}")


class NoNodeAvailable(RoutingFact):
    """A routing fact: no node can serve ``name`` now (``reason`` says why: no backend node
    matches the selector, all candidates unhealthy or gone, or no route to any of them)."""

    condition = "no-node-available"

    def __init__(self, name: str, reason: str, node_id: str = "*"):
        self.name = name
        self.reason = reason
        RoutingFact.__init__(self, node_id, f"no node available for model {name!r}: {reason}")


class IInferenceRouter(Interface):
    """Routes inference requests for configured models to worker backends."""

    models_dir = Attribute("Path of the directory holding the model YAML files.")

    def models():
        """Return ``list[ModelConfig]`` of every valid configured model, sorted by name
        (for ``/v1/models``).  Invalid files are skipped and logged, never raised.  Synchronous
        and cheap (an mtime check of the directory)."""

    def model(name):
        """Return the ``ModelConfig`` called ``name``, or ``None`` (the caller answers
        ``model_not_found``).  Synchronous."""

    def model_error(name):
        """Return why the config file meant to define ``name`` cannot load (a
        ``ModelConfigError``; its text names the file and the field), or ``None``: a request for
        it is then answered with that reason, not "does not exist".  Synchronous.  Optional:
        callers treat a router without it as having no broken configs."""

    def model_errors():
        """Return ``{name: reason}`` for every config file that cannot load (``/v1/models``
        lists them under ``errors``).  Optional, like :meth:`model_error`."""

    def predict(name, options, deadline=None):
        """``Predict`` on a node serving ``name`` (loading it first if needed).

        ``options`` is a ``backend_pb2.PredictOptions``; the caller renders the prompt and fills
        sampling fields (model defaults from ``ModelConfig.parameters`` are the caller's job).
        Returns ``Deferred[Served[backend_pb2.Reply]]``."""

    def predict_stream(name, options, on_reply, deadline=None, on_start=None, on_loading=None):
        """``PredictStream``: ``on_reply(reply)`` is called once per streamed
        ``backend_pb2.Reply``, in order, on the reactor thread.  If it returns a Deferred, the
        next reply is not delivered until that Deferred fires (backpressure); if that Deferred
        fails, the RPC is cancelled and the returned Deferred fails with the same failure.
        ``on_start(node_id)`` (optional) is called once before the first reply;
        ``on_loading(name)`` (optional) once if a cold load must happen first.
        Returns ``Deferred[Served[None]]`` firing after the last reply.  Cancelling it cancels
        the RPC."""

    def embed(name, options, deadline=None):
        """``Embedding``: returns ``Deferred[Served[backend_pb2.EmbeddingResult]]``."""

    def tokenize(name, options, deadline=None):
        """``TokenizeString``: returns ``Deferred[Served[backend_pb2.TokenizationResponse]]``."""

    def detokenize(name, request, deadline=None):
        """``Detokenize`` of a ``backend_pb2.DetokenizeRequest``: returns
        ``Deferred[Served[backend_pb2.DetokenizeResponse]]``; any configured model may be asked
        (whether it can is its backend's answer, as for ``tokenize``)."""

    def rerank(name, request, deadline=None):
        """``Rerank`` of a ``backend_pb2.RerankRequest``: returns
        ``Deferred[Served[backend_pb2.RerankResult]]``; any configured model may be asked
        (a backend without ``Rerank`` answers ``UNIMPLEMENTED``)."""

    def tts(name, request, max_bytes, deadline=None, response_format="wav"):
        """``TTS`` of a ``backend_pb2.TTSRequest`` (``dst`` is set here: a file in a scratch
        directory of the serving node).  Returns ``Deferred[Served[bytes]]``: the WAV the
        backend wrote, or ffmpeg's conversion of it on that node into ``response_format``
        (``mp3``, ``opus``, ``aac``, ``flac``, ``pcm``), at most ``max_bytes``
        (``BackendOutputTooLarge`` beyond; ``AudioConversionFailed`` when ffmpeg cannot).
        Needs the model's ``tts`` use case.  Optional: a router without it answers 501."""

    def transcribe(name, request, audio_path, audio_name, deadline=None, convert_from=None):
        """``AudioTranscription`` of a ``backend_pb2.TranscriptRequest``: the local file
        ``audio_path`` is put in a scratch directory of the serving node as ``audio_name`` and
        its worker-local path sent as ``dst`` (with ``convert_from``, the container it is in,
        ffmpeg on that node first makes it a 16 kHz mono WAV, and that is sent).  Returns
        ``Deferred[Served[backend_pb2.TranscriptResult]]``.  Needs ``transcript``.  Optional."""

    def generate_image(name, request, max_bytes, deadline=None):
        """``GenerateImage`` of a ``backend_pb2.GenerateImageRequest`` (``dst`` set here).
        Returns ``Deferred[Served[bytes]]``: the PNG, at most ``max_bytes``.  Needs ``image``.
        Optional."""


__all__ = [
    "CapabilityNotHonoured",
    "IInferenceRouter",
    "ModelLoadFailed",
    "ModelNotFound",
    "NoNodeAvailable",
    "Served",
]
