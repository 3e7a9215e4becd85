"""OpenAI-shaped errors: :class:`OpenAIError` (``{"error": {"message", "type", "param",
"code"}}`` with a status) and :func:`error_for`, the one table from every failure the router
can report to its HTTP status (the table in ``docs/openai-api.md``, in its order).

What this module must never do: put a traceback, a credential, or a node or replica id in a
client-facing message (ids go to the log only, through :func:`detail`), or pass on a worker's
or backend's words unbounded.
"""

from __future__ import annotations

import re
from typing import Mapping

from localai_tw.errors import (
    AbsentWithinGrace,
    BackendAnswer,
    BackendCrashed,
    CallerDeadlineExceeded,
    ClusterError,
    PeerRejected,
    PeerUnreachable,
    PoolClosed,
    RoutingFact,
    StreamRefused,
    TransportFailure,
    TunnelProtocolError,
    WorkerAnswer,
    WorkerBusy,
    WorkerGone,
)

from localai_tw.frontend.inference.interfaces import (
    CapabilityNotHonoured,
    ModelConfigInvalid,
    ModelDownloadFailed,
    ModelFileMismatch,
    ModelLoadFailed,
    ModelNotFound,
    NoNodeAvailable,
)
from localai_tw.frontend.inference.scratch import AudioConversionFailed
from localai_tw.localai.templates import TemplateError
from localai_tw.frontend.api.kit import DATABASE_DOWN, database_unavailable, printable
from localai_tw.web.errors import APIError, hide_host_paths

#: Longest error text passed on from a worker or backend.
MAX_ERROR_TEXT = 2000
#: Characters of a crashed backend's last output quoted in its error.
MAX_CRASH_OUTPUT = 1200


class OpenAIError(Exception):
    """An answer with ``status`` and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, type_: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param=param, code=code)


def detail(error: BaseException) -> str:
    """The full text of ``error`` (node and replica ids included): for the log only."""
    return printable(" ".join(str(error).split()), MAX_ERROR_TEXT)


#: Node ids are UUIDs (``NodeRegistry``); one that reaches a client-facing text is replaced.
_NODE_ID_TEXT = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")


def _public(text: str) -> str:
    """``text`` fit for an API client: bounded, printable, no node id (the condition and the
    backend's or worker's own words stay; operators find the ids in the log), no absolute
    path of the replica's or the worker's disk (:func:`hide_host_paths`)."""
    text = hide_host_paths(_NODE_ID_TEXT.sub("<node>", text))
    return printable(" ".join(text.split()), MAX_ERROR_TEXT)


#: For modules that word their own errors from a backend's answer (``embeddings``).
public_text = _public


def _conversion_failed(error: AudioConversionFailed) -> OpenAIError:
    """ffmpeg on the serving worker: missing there, or unable to read the client's upload, is
    a 400 naming the cause; failing on the backend's own output is the server's fault."""
    words = _public(error.message)
    if error.reason == "ffmpeg-missing":
        return OpenAIError(400, words, "invalid_request_error", code="ffmpeg_not_installed",
                           param="response_format" if not error.of_input else "file")
    if error.of_input and error.reason in ("failed", "too-large"):
        return OpenAIError(400, f"the 'file' part could not be converted to 16 kHz mono WAV: "
                           f"{words}", "invalid_request_error", param="file",
                           code="unsupported_audio_format")
    if error.reason == "timeout":
        return OpenAIError(504, words, "timeout_error", code="timeout")
    return OpenAIError(500, f"the audio could not be converted: {words}", "server_error",
                       code="audio_conversion_failed", headers=NO_RETRY)


def _worker_words(error: WorkerAnswer) -> str:
    """What the worker said, without the ``worker <id> answered:`` its message starts with."""
    text = str(error)
    prefix = f"worker {error.node_id} answered: "
    return _public(text[len(prefix):] if text.startswith(prefix) else text)


#: gRPC status names of a backend answer that mean the request itself was refused.
_BACKEND_REFUSED_INPUT = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE"})
#: gRPC status names of a backend answer that may not recur (the one retryable backend row).
_BACKEND_TRANSIENT = frozenset({"UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED"})

#: On an answer that the same request would get again: the official OpenAI clients retry
#: every 5xx (twice by default) unless the server says not to with this header.
NO_RETRY = {"X-Should-Retry": "false"}


_EARLY_TYPES = {401: "authentication_error", 408: "timeout_error",
                503: "service_unavailable"}


def early_error(refusal) -> OpenAIError:
    """A refusal the listener answers before the body (413 too large, 503 too many bodies in
    flight, 401 from the key check) in the OpenAI error shape, so clients read its ``code``
    (``BoundedSite.add_early_answer_shape``)."""
    if isinstance(refusal, OpenAIError):
        return refusal
    status = int(refusal.status)
    code = getattr(refusal, "code", None) or ("request_too_large" if status == 413 else None)
    kind = _EARLY_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return OpenAIError(status, str(getattr(refusal, "message", "")) or "refused", kind,
                       param=getattr(refusal, "field", None), code=code,
                       headers=getattr(refusal, "headers", None))


def crashed(error: BackendCrashed) -> OpenAIError:
    """A backend process that died during the call, as its worker told it: model, node (by
    name), signal or exit code, and its last output lines; never retried by an SDK (the same
    request would most likely crash it again)."""
    where = f" on node {printable(error.node_name, 64)!r}" if error.node_name else ""
    text = (f"the backend of model {printable(error.model)!r}{where} crashed during the call: "
            f"{printable(error.description, 64)}")
    lines, room = [], MAX_CRASH_OUTPUT
    for line in reversed(error.output):  # the last lines say most: kept first
        if len(line) + 3 > room:
            break
        lines.insert(0, line)
        room -= len(line) + 3
    if lines:
        text += "; its last output: " + " | ".join(lines)
    if error.fallback:
        text += f"; {error.fallback}"
    return OpenAIError(502, _public(text), "upstream_error", code="backend_crashed",
                       headers=NO_RETRY)


def error_for(error: BaseException) -> OpenAIError:
    """The HTTP answer for a failure of the router (or of this API).  One row each, in the
    order of the table in ``docs/openai-api.md``; subclasses are matched before their bases.
    Messages name the condition, never a node or replica id (those are internal; the log has
    them)."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, APIError):
        return OpenAIError(error.status, error.message,
                           "authentication_error" if error.status == 401
                           else "invalid_request_error",
                           param=error.field,
                           code="invalid_api_key" if error.status == 401 else error.code,
                           headers=error.headers)
    if isinstance(error, ModelNotFound):
        return OpenAIError(404, f"the model {printable(error.name)!r} does not exist; "
                           "GET /v1/models lists the models this cluster serves",
                           "invalid_request_error", param="model", code="model_not_found")
    if isinstance(error, ModelConfigInvalid):
        return OpenAIError(500, f"the model {printable(error.name)!r} is configured but its "
                           f"config cannot be loaded: {printable(error.problem, 1024)}",
                           "server_error", param="model", code="model_config_invalid",
                           headers=NO_RETRY)
    if isinstance(error, ModelDownloadFailed):  # this replica's fetch of a config's URL
        return OpenAIError(502, f"a file of the model could not be downloaded: "
                           f"{_public(str(error))}", "upstream_error", param="model",
                           code="model_download_failed", headers={"Retry-After": "5"})
    if isinstance(error, ModelFileMismatch):  # this replica's models dir, before any worker
        return OpenAIError(500, f"the model's files cannot be used: {_public(str(error))}",
                           "server_error", param="model", code="model_file_mismatch",
                           headers=NO_RETRY)
    if isinstance(error, CapabilityNotHonoured):
        cap = error.capability
        return OpenAIError(400, f"the backend serving model {printable(error.name)!r} "
                           f"answered without {cap}: it does not honour {cap} (LocalAI's own "
                           f"transformers backend, for one); ask without {cap}, or set "
                           f"capabilities.{cap}: false in the model's config",
                           "invalid_request_error", param=error.capability,
                           code="unsupported_parameter", headers=NO_RETRY)
    if isinstance(error, TemplateError):
        return OpenAIError(500, f"the model's prompt template cannot be rendered: "
                           f"{detail(error)}", "server_error", code="template_error",
                           headers=NO_RETRY)
    if isinstance(error, NoNodeAvailable):
        return OpenAIError(503, f"no route: no node can serve model "
                           f"{printable(error.name)!r} now: {_public(error.reason)}",
                           "service_unavailable", code="no_node_available")
    if isinstance(error, WorkerGone):
        return OpenAIError(503, "no route: the worker for this request departed longer ago "
                           "than the reconnect grace", "service_unavailable", code="no_route")
    if isinstance(error, RoutingFact):
        return OpenAIError(503, "no route to a worker for this request right now",
                           "service_unavailable", code="no_route")
    if isinstance(error, AbsentWithinGrace):
        return OpenAIError(503, f"the worker for this request is not connected right now "
                           f"(presence {printable(error.presence, 32)}); it may reconnect "
                           "within the grace; retry", "service_unavailable",
                           code="worker_reconnecting", headers={"Retry-After": "5"})
    if isinstance(error, PeerRejected):
        return OpenAIError(500, "the replica holding the worker's tunnel refused this "
                           "replica's credentials (a replica configuration problem)",
                           "server_error", code="peer_rejected", headers=NO_RETRY)
    if isinstance(error, PoolClosed):
        return OpenAIError(503, "this replica is shutting down; retry", "service_unavailable",
                           code="peer_unreachable", headers={"Retry-After": "2"})
    if isinstance(error, PeerUnreachable):
        return OpenAIError(503, "the replica holding the worker's tunnel is unreachable; retry",
                           "service_unavailable", code="peer_unreachable",
                           headers={"Retry-After": "2"})
    if isinstance(error, ModelLoadFailed):
        retry = {"Retry-After": str(int(error.retry_in))} if error.retry_in else {}
        return OpenAIError(500, f"model {printable(error.name)!r} failed to load: "
                           f"{_public(error.detail)}", "server_error",
                           code="model_load_failed", headers={**retry, **NO_RETRY})
    if isinstance(error, BackendCrashed):
        return crashed(error)
    if isinstance(error, BackendAnswer):
        if error.code in _BACKEND_REFUSED_INPUT:
            return OpenAIError(400, f"the backend refused the request: "
                               f"{_public(error.details)}",
                               "invalid_request_error", code="backend_refused_request")
        if error.code == "UNIMPLEMENTED":
            return OpenAIError(501, f"the model's backend does not implement this call: "
                               f"{_public(error.details)}", "server_error",
                               code="not_implemented_by_backend", headers=NO_RETRY)
        answered = f"the backend answered {printable(error.code, 32)}: {_public(error.details)}"
        if error.code == "DEADLINE_EXCEEDED":
            return OpenAIError(504, answered, "timeout_error", code="timeout")
        if error.code in _BACKEND_TRANSIENT:
            return OpenAIError(503, answered, "service_unavailable",
                               code="backend_unavailable", headers={"Retry-After": "1"})
        return OpenAIError(500, answered, "server_error", code="backend_error",
                           headers=NO_RETRY)
    if isinstance(error, AudioConversionFailed):
        return _conversion_failed(error)
    if isinstance(error, WorkerBusy):
        return OpenAIError(503, f"the worker is busy: {_worker_words(error)}",
                           "service_unavailable", code="worker_busy",
                           headers={"Retry-After": "1"})
    if isinstance(error, StreamRefused) and error.code == "unavailable":
        return OpenAIError(502, f"the worker answered: {_worker_words(error)}",
                           "upstream_error", code="worker_error")
    if isinstance(error, WorkerAnswer):
        return OpenAIError(500, f"the worker answered: {_worker_words(error)}",
                           "server_error", code="worker_error", headers=NO_RETRY)
    if isinstance(error, CallerDeadlineExceeded):
        return OpenAIError(504, "the deadline of this request ran out before the answer",
                           "timeout_error", code="timeout")
    if isinstance(error, TransportFailure):
        return OpenAIError(502, f"the connection to the worker broke during the call "
                           f"({_public(str(error))}); nothing is known about the work",
                           "upstream_error", code="transport_failure")
    if isinstance(error, TunnelProtocolError):
        return OpenAIError(502, f"a replica or worker broke the tunnel protocol: "
                           f"{_public(str(error))}", "upstream_error", code="protocol_error")
    if isinstance(error, ClusterError):
        return OpenAIError(500, f"{error.condition} (see the frontend log)", "server_error",
                           code=error.condition)
    if isinstance(error, DATABASE_DOWN):  # this replica's own dependency, none of the four
        answer = database_unavailable()
        return OpenAIError(answer.status, answer.message, answer.type, code=answer.code,
                           headers=answer.headers)
    return OpenAIError(500, "internal error; see the frontend log", "server_error",
                       code="internal_error")
