"""The OpenAI-compatible API of every frontend replica: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, ``/v1/models`` and ``/v1/models/{id}``.

:class:`OpenAIResource` turns OpenAI requests into calls on an
:class:`~localai_tw.frontend.interfaces.IInferenceRouter` the way LocalAI's frontend does
(contract sheet §3; the user-facing description is ``docs/openai-api.md``):

- chat: the conversation is rendered by :mod:`localai_tw.frontend.templates` (or sent as
  ``Messages`` with ``UseTokenizerTemplate``); ``stream: false`` is one ``Predict`` per choice,
  ``stream: true`` one ``PredictStream`` written as server-sent events
  (``data: {chat.completion.chunk}``; the first chunk carries ``role: assistant``, the last
  ``finish_reason``, then ``data: [DONE]``).  Only complete UTF-8 characters are sent: a
  character split across backend replies is held back until its last byte arrives.
- completions: each prompt through the ``completion`` template, one ``Predict`` per prompt;
  streaming allows exactly one prompt.
- embeddings: one ``Embedding`` call per input item (text or token ids); ``encoding_format``
  ``float`` or ``base64`` (little-endian float32).
- sampling: the model config's ``parameters`` first, then the request's fields, then LocalAI's
  defaults for what neither sets.
- capability: a model asked for what its config rules out (``models.usecases``: chat on an
  embeddings model, embeddings on a chat model) is a 400 ``unsupported_by_model`` before the
  router is called, so a wrong request never loads, reaps or reloads anything.
- a stream that waits for a cold load longer than ``LOADING_NOTICE_INTERVAL`` starts then and
  carries ``: loading model <name> (<n> s)`` SSE comments until the first reply.

Streaming writes respect backpressure: the stream registers itself as the request's push
producer, and while the HTTP transport is paused each ``on_reply`` returns a Deferred that
fires only when it resumes, so the router stops pulling replies from the backend.  A client
that disconnects (mid-stream or while waiting) cancels the router's Deferred, which cancels the
backend RPC.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``; every failure
the router can report maps to one status (:func:`error_for`, the table in the docs).
Authentication: ``Authorization: Bearer <key>`` checked by the frontend's
:class:`~localai_tw.frontend.web.APIKeyGuard` (constant time) **only when a key is
configured**; without one this API is open, as LocalAI's is (unlike the admin API, which is then
closed).  The check is :meth:`OpenAIResource.guard`, which ``FrontendSite`` runs when the
headers of a request with a body end, so a refused client never has a body byte read.

What this module must never do: block the reactor, buffer a body beyond its cap (the
``FrontendSite`` refuses it with 413 as it arrives), evaluate anything from a template or a
request, put a traceback or a credential in a response, keep a backend call running after its
client left, or reach past ``IInferenceRouter`` into the scheduler, bridges or database.
"""

from __future__ import annotations

import base64
import codecs
import json
import random
import re
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from twisted.internet import defer, task
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource
from zope.interface import implementer

from localai_tw import metrics
from localai_tw.backends import backend_pb2
from localai_tw.errors import (
    AbsentWithinGrace,
    BackendAnswer,
    CallerDeadlineExceeded,
    ClusterError,
    PeerRejected,
    PeerUnreachable,
    PoolClosed,
    RoutingFact,
    TransportFailure,
    TunnelProtocolError,
    WorkerAnswer,
    WorkerBusy,
    WorkerGone,
)

from .interfaces import (
    IInferenceRouter,
    ModelConfigInvalid,
    ModelLoadFailed,
    ModelNotFound,
    ModelUsecaseUnsupported,
    NoNodeAvailable,
    Served,
)
from .models import CHAT, COMPLETION, EMBEDDINGS, usecases
from .templates import (
    ChatMessage,
    PromptTemplates,
    TemplateError,
    render_chat,
    render_completion,
    tool_calls_json,
)
from .web import (
    DATABASE_DOWN,
    JSON_HEADERS,
    APIError,
    APIKeyGuard,
    bearer_token,
    database_unavailable,
    printable,
    read_json_object,
)

log = Logger()

#: Body cap of every ``/v1/`` request (give it to ``FrontendSite(body_limits=...)``).
OPENAI_MAX_BODY_BYTES = 8 * 1024 * 1024
#: Most messages in one chat request.
MAX_MESSAGES = 4096
#: Most prompts in one completions request / inputs in one embeddings request.
MAX_PROMPTS = 64
MAX_EMBEDDING_INPUTS = 2048
#: Most choices (``n``) in one non-streamed request: each is one backend call.
MAX_CHOICES = 16
#: Most stop sequences (model defaults + request).
MAX_STOP = 16
#: Longest error text passed on from a worker or backend.
MAX_ERROR_TEXT = 2000
#: Seconds between ``: loading model ...`` SSE comments while a stream waits for a cold load
#: (the first after this long, so a quick load answers as if nothing had waited).
LOADING_NOTICE_INTERVAL = 3.0
#: The header naming the node(s) that served the request, by node name.
NODE_HEADER = b"X-LocalAI-Node"

INT32_MAX = 2**31 - 1

#: LocalAI's defaults for what neither the model config nor the request sets (§2.5).
SAMPLING_DEFAULTS = {
    "temperature": 0.9, "top_p": 0.95, "top_k": 40, "tail_free_z": 1.0, "typical_p": 1.0,
    "mirostat_eta": 0.1, "mirostat_tau": 5.0,
}

_seed_source = random.SystemRandom()


# -- errors ------------------------------------------------------------------------------------


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


def _detail(error: BaseException) -> str:
    """The full text of ``error`` (node and replica ids included): for the log only."""
    return printable(" ".join(str(error).split()), MAX_ERROR_TEXT)


#: Node ids are UUIDs (``NodeRegistry``); one that reaches a client-facing text is replaced.
_NODE_ID_TEXT = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")


def _public(text: str) -> str:
    """``text`` fit for an API client: bounded, printable, no node id (the condition and the
    backend's or worker's own words stay; operators find the ids in the log)."""
    return printable(" ".join(_NODE_ID_TEXT.sub("<node>", text).split()), MAX_ERROR_TEXT)


def _worker_words(error: WorkerAnswer) -> str:
    """What the worker said, without the ``worker <id> answered:`` its message starts with."""
    text = str(error)
    prefix = f"worker {error.node_id} answered: "
    return _public(text[len(prefix):] if text.startswith(prefix) else text)


#: gRPC status names of a backend answer that mean the request itself was refused.
_BACKEND_REFUSED_INPUT = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE"})


def error_for(error: BaseException) -> OpenAIError:
    """The HTTP answer for a failure of the router (or of this module).  One row each, in the
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
        return OpenAIError(404, f"the model {printable(error.name)!r} does not exist",
                           "invalid_request_error", param="model", code="model_not_found")
    if isinstance(error, ModelConfigInvalid):
        return OpenAIError(500, f"the model {printable(error.name)!r} is configured but its "
                           f"config cannot be loaded: {printable(error.problem, 1024)}",
                           "server_error", param="model", code="model_config_invalid")
    if isinstance(error, ModelUsecaseUnsupported):
        return OpenAIError(400, _detail(error), "invalid_request_error", param="model",
                           code="unsupported_by_model")
    if isinstance(error, TemplateError):
        return OpenAIError(500, f"the model's prompt template cannot be rendered: "
                           f"{_detail(error)}", "server_error", code="template_error")
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
        return OpenAIError(503, "the replica holding the worker's tunnel refused this "
                           "replica's credentials (a replica configuration problem)",
                           "service_unavailable", code="peer_rejected")
    if isinstance(error, PoolClosed):
        return OpenAIError(503, "this replica is shutting down; retry", "service_unavailable",
                           code="peer_unreachable", headers={"Retry-After": "2"})
    if isinstance(error, PeerUnreachable):
        return OpenAIError(503, "the replica holding the worker's tunnel is unreachable; retry",
                           "service_unavailable", code="peer_unreachable",
                           headers={"Retry-After": "2"})
    if isinstance(error, ModelLoadFailed):
        retry = {"Retry-After": str(int(error.retry_in))} if error.retry_in else None
        return OpenAIError(500, f"model {printable(error.name)!r} failed to load: "
                           f"{_public(error.detail)}", "server_error",
                           code="model_load_failed", headers=retry)
    if isinstance(error, BackendAnswer):
        if error.code in _BACKEND_REFUSED_INPUT:
            return OpenAIError(400, f"the backend refused the request: "
                               f"{_public(error.details)}",
                               "invalid_request_error", code="backend_refused_request")
        if error.code == "UNIMPLEMENTED":
            return OpenAIError(501, f"the model's backend does not implement this call: "
                               f"{_public(error.details)}", "server_error",
                               code="not_implemented_by_backend")
        answered = f"the backend answered {printable(error.code, 32)}: {_public(error.details)}"
        if error.code == "DEADLINE_EXCEEDED":
            return OpenAIError(504, answered, "timeout_error", code="timeout")
        return OpenAIError(502, answered, "upstream_error", code="backend_error")
    if isinstance(error, WorkerBusy):
        return OpenAIError(503, f"the worker is busy: {_worker_words(error)}",
                           "service_unavailable", code="worker_busy",
                           headers={"Retry-After": "1"})
    if isinstance(error, WorkerAnswer):
        return OpenAIError(502, f"the worker answered: {_worker_words(error)}",
                           "upstream_error", code="worker_error")
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


# -- reading request fields ---------------------------------------------------------------------


class _Fields:
    """Typed access to a request object's fields; a wrong type is a 400 naming the field.
    JSON ``null`` counts as absent."""

    def __init__(self, data: Mapping[str, Any], prefix: str = ""):
        self.data = data
        self.prefix = prefix

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str):
        return self.data.get(name)

    def param(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def string(self, name: str, *, required: bool = False, nonempty: bool = False) -> str | None:
        value = self.data.get(name)
        if value is None:
            if required:
                raise invalid(f"you must provide {self.param(name)!r}", self.param(name),
                              code="missing_required_parameter")
            return None
        if not isinstance(value, str):
            raise invalid(f"{self.param(name)!r} must be a string", self.param(name),
                          code="invalid_type")
        if nonempty and not value:
            raise invalid(f"{self.param(name)!r} must not be empty", self.param(name),
                          code="invalid_value")
        return value

    def boolean(self, name: str) -> bool | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise invalid(f"{self.param(name)!r} must be true or false", self.param(name),
                          code="invalid_type")
        return value

    def integer(self, name: str, low: int, high: int) -> int | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"{self.param(name)!r} must be an integer", self.param(name),
                          code="invalid_type")
        if not low <= value <= high:
            raise invalid(f"{self.param(name)!r} must be between {low} and {high}",
                          self.param(name), code="invalid_value")
        return value

    def number(self, name: str, low: float, high: float) -> float | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(f"{self.param(name)!r} must be a number", self.param(name),
                          code="invalid_type")
        if not low <= value <= high:
            raise invalid(f"{self.param(name)!r} must be between {low:g} and {high:g}",
                          self.param(name), code="invalid_value")
        return float(value)

    def mapping(self, name: str) -> Mapping[str, Any] | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid(f"{self.param(name)!r} must be an object", self.param(name),
                          code="invalid_type")
        return value


def _stop_list(value, param: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise invalid(f"{param!r} must be a string or a list of strings", param, code="invalid_type")


# -- model views and PredictOptions --------------------------------------------------------------


def _config_value(obj: Any, name: str, default=None):
    if obj is None:
        return default
    value = obj.get(name, default) if isinstance(obj, Mapping) else getattr(obj, name, default)
    return default if value is None else value


@dataclass(frozen=True)
class _Model:
    """What this module reads of a model config."""

    name: str
    parameters: Mapping[str, Any]
    templates: PromptTemplates
    predict: Mapping[str, Any] = field(default_factory=dict)  # config's PredictOptions fields

    @classmethod
    def of(cls, config: Any) -> "_Model":
        template = _config_value(config, "template")
        templates = PromptTemplates.from_config(
            template, roles=_config_value(config, "roles") or _config_value(template, "roles"),
            system_prompt=_config_value(config, "system_prompt", ""))
        return cls(name=str(_config_value(config, "name", "")),
                   parameters=dict(_config_value(config, "parameters", {}) or {}),
                   templates=templates,
                   predict=dict(_config_value(config, "predict_options", {}) or {}))


@dataclass
class Sampling:
    """The sampling fields of one request after merging (model defaults, then the request)."""

    max_tokens: int = 0
    values: dict = field(default_factory=dict)  # PredictOptions keyword arguments

    def options(self, **more) -> backend_pb2.PredictOptions:
        return backend_pb2.PredictOptions(**self.values, **more)


def merge_sampling(parameters: Mapping[str, Any], body: _Fields,
                   model_predict: Mapping[str, Any] | None = None) -> Sampling:
    """``PredictOptions`` sampling fields: request over model ``parameters`` over LocalAI's
    defaults.  A seed nobody set is a fresh random int32 per request.  ``model_predict``: the
    config's own ``PredictOptions`` fields (``ModelConfig.predict_options``: ``stopwords``,
    ``threads``, ``f16``, ...); its stop words come first, then ``parameters.stop``, then the
    request's ``stop``, as LocalAI appends them."""
    model_predict = dict(model_predict or {})
    stopwords = list(model_predict.pop("StopPrompts", ()))

    def pick(request_value, name, default=None):
        if request_value is not None:
            return request_value
        value = parameters.get(name)
        return default if value is None or isinstance(value, bool) else value

    temperature = pick(body.number("temperature", 0.0, 2.0), "temperature",
                       SAMPLING_DEFAULTS["temperature"])
    top_p = pick(body.number("top_p", 0.0, 1.0), "top_p", SAMPLING_DEFAULTS["top_p"])
    top_k = pick(body.integer("top_k", 0, INT32_MAX), "top_k", SAMPLING_DEFAULTS["top_k"])
    min_p = pick(body.number("min_p", 0.0, 1.0), "min_p", 0.0)
    requested_max = body.integer("max_completion_tokens", 0, INT32_MAX)
    if requested_max is None:
        requested_max = body.integer("max_tokens", 0, INT32_MAX)
    max_tokens = pick(requested_max, "max_tokens", 0)
    seed = body.integer("seed", -(2**63), 2**63 - 1)
    if seed is None:
        seed = pick(None, "seed")
    if seed is None:
        seed = _seed_source.randint(0, INT32_MAX)
    seed = ((int(seed) + 2**31) % 2**32) - 2**31  # OpenAI seeds are int64; the backend's int32
    presence = pick(body.number("presence_penalty", -2.0, 2.0), "presence_penalty", 0.0)
    frequency = pick(body.number("frequency_penalty", -2.0, 2.0), "frequency_penalty", 0.0)
    stop = _stop_list(parameters.get("stop"), "parameters.stop") + \
        _stop_list(body.raw("stop"), "stop")
    if len(stop) > MAX_STOP:
        raise invalid(f"at most {MAX_STOP} stop sequences are accepted (model defaults "
                      "included)", "stop", code="invalid_value")
    stop = list(dict.fromkeys(stopwords + stop))  # the config's (bounded when it loads) first
    values = dict(
        Temperature=float(temperature), TopP=float(top_p), TopK=int(top_k), MinP=float(min_p),
        Tokens=int(max_tokens), Seed=seed, PresencePenalty=float(presence),
        FrequencyPenalty=float(frequency), StopPrompts=stop,
        TailFreeSamplingZ=SAMPLING_DEFAULTS["tail_free_z"],
        TypicalP=SAMPLING_DEFAULTS["typical_p"], MirostatETA=SAMPLING_DEFAULTS["mirostat_eta"],
        MirostatTAU=SAMPLING_DEFAULTS["mirostat_tau"],
    )
    values.update(model_predict)  # over LocalAI's defaults (TypicalP, Mirostat*, ...)
    if isinstance(parameters.get("repeat_penalty"), (int, float)):
        values["Penalty"] = float(parameters["repeat_penalty"])
    if isinstance(parameters.get("batch"), int) and not isinstance(parameters["batch"], bool):
        values["Batch"] = int(parameters["batch"])
    metadata = body.mapping("metadata")
    if metadata is not None:
        if len(metadata) > 64 or not all(isinstance(k, str) and isinstance(v, str)
                                          for k, v in metadata.items()):
            raise invalid("'metadata' must map at most 64 strings to strings", "metadata",
                          code="invalid_value")
        values["Metadata"] = dict(metadata)
    logit_bias = body.mapping("logit_bias")
    if logit_bias is not None:
        values["LogitBias"] = json.dumps(logit_bias, separators=(",", ":"))
    return Sampling(max_tokens=int(max_tokens), values=values)


def finish_reason(reply: backend_pb2.Reply, max_tokens: int) -> str:
    """``length`` when the completion used the whole token budget, else ``stop``."""
    return "length" if max_tokens > 0 and reply.tokens >= max_tokens else "stop"


# -- parsing chat messages -----------------------------------------------------------------------


def parse_messages(raw: Any) -> tuple[list[ChatMessage], list[str]]:
    """The chat messages and the base64 images they carry (``data:`` URLs only; this frontend
    never fetches a URL).  :raises OpenAIError: 400 naming the offending field."""
    if not isinstance(raw, list):
        raise invalid("'messages' must be a list of message objects", "messages",
                      code="invalid_type")
    if not raw:
        raise invalid("'messages' must hold at least one message", "messages",
                      code="invalid_value")
    if len(raw) > MAX_MESSAGES:
        raise invalid(f"at most {MAX_MESSAGES} messages are accepted", "messages",
                      code="invalid_value")
    messages, images = [], []
    for index, item in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise invalid(f"{where!r} must be an object", where, code="invalid_type")
        fields = _Fields(item, prefix=f"{where}.")
        role = fields.string("role", required=True, nonempty=True)
        content = _message_content(item.get("content"), f"{where}.content", images)
        tool_calls = item.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise invalid(f"'{where}.tool_calls' must be a list", f"{where}.tool_calls",
                          code="invalid_type")
        messages.append(ChatMessage(
            role=role, content=content, name=fields.string("name") or "",
            tool_call_id=fields.string("tool_call_id") or "",
            tool_calls=tool_calls_json(tool_calls),
            reasoning_content=fields.string("reasoning_content") or ""))
    return messages, images


def _message_content(content: Any, param: str, images: list[str]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param!r} must be a string or a list of content parts", param,
                      code="invalid_type")
    texts = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise invalid(f"{where!r} must be an object", where, code="invalid_type")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"'{where}.text' must be a string", f"{where}.text",
                              code="invalid_type")
            texts.append(text)
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url.startswith("data:") or \
                    ";base64," not in url[:256]:
                raise invalid(f"'{where}.image_url.url' must be a data: URL with base64 "
                              "content (this server fetches no URLs)",
                              f"{where}.image_url.url", code="invalid_value")
            images.append(url.split(";base64,", 1)[1])
        else:
            raise invalid(f"'{where}.type' {printable(str(kind))!r} is not supported "
                          "(text, image_url)", f"{where}.type", code="invalid_value")
    return "".join(texts)


# -- the response side: one exchange, SSE streams ------------------------------------------------


class NodeNames:
    """Node id -> node name for the ``X-LocalAI-Node`` header.

    ``lookup(node_id)`` (a name, None, or a Deferred of either) is asked once per id and its
    answer kept: a node keeps its name for as long as its id exists.  A failed lookup is not
    kept (the next request asks again); meanwhile the header falls back to the id.
    """

    #: Most ids remembered; the memory is dropped whole beyond it (ids are few in practice).
    MAX_NAMES = 4096

    def __init__(self, lookup: Callable[[str], Any]):
        self._lookup = lookup
        self._names: dict[str, str] = {}

    def known(self, node_id: str) -> str | None:
        return self._names.get(node_id)

    async def learn(self, node_id: str) -> None:
        if node_id in self._names:
            return
        try:
            name = await defer.maybeDeferred(self._lookup, node_id)
        except Exception as e:
            log.warn("looking up the name of node {node} failed: {err}", node=node_id, err=e)
            return
        if name:
            if len(self._names) >= self.MAX_NAMES:
                self._names.clear()
            self._names[node_id] = str(name)


class _Exchange:
    """One HTTP request's lifetime: whether the client left, and the router calls to cancel
    when it does."""

    def __init__(self, request, names: NodeNames | None = None,
                 record: metrics.RequestRecord | None = None):
        self.request = request
        self.record = record or metrics.DISCARD.request(())
        self.gone = False
        self.nodes: list[str] = []
        self.names = names
        self._asked: set[str] = set()
        self._calls: set[defer.Deferred] = set()
        self._on_gone: list[Callable[[], None]] = []
        request.notifyFinish().addBoth(self._finished)

    def _finished(self, result) -> None:
        self.record.finished(metrics.CLIENT_GONE if isinstance(result, Failure)
                             else self.request.code, self.nodes)
        if not isinstance(result, Failure):
            return None
        self.gone = True
        for d in list(self._calls):
            d.cancel()
        for hook in self._on_gone:
            hook()
        return None

    def when_gone(self, hook: Callable[[], None]) -> None:
        self._on_gone.append(hook)

    async def call(self, d: defer.Deferred):
        """Await a router Deferred; cancelled if the client leaves meanwhile."""
        self._calls.add(d)
        if self.gone:
            d.cancel()
        try:
            result = await d
        finally:
            self._calls.discard(d)
        if isinstance(result, Served) and result.served_by:
            self.served_by(result.served_by)
            await self.name_nodes()
        return result

    def served_by(self, node: str | None) -> None:
        if node and node not in self.nodes:
            self.nodes.append(node)

    def named(self) -> bool:
        """Whether every serving node's name was looked up (found or not)."""
        return self.names is None or all(node in self._asked for node in self.nodes)

    async def name_nodes(self) -> None:
        """Look up the names of the serving nodes not looked up yet (before the headers)."""
        if self.names is None:
            return
        for node in list(self.nodes):
            if node not in self._asked:
                await self.names.learn(node)
                self._asked.add(node)

    def node_header(self) -> bytes | None:
        """The serving nodes by name (an id only where no name could be looked up)."""
        if not self.nodes:
            return None
        known = self.names.known if self.names is not None else (lambda _: None)
        return ", ".join(known(node) or node for node in self.nodes).encode("ascii", "replace")

    def send_json(self, status: int, body: dict, headers: Mapping[str, str] | None = None):
        request = self.request
        if self.gone or request.finished or request.channel is None:
            return
        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        self.record.usage(body.get("usage"))
        request.setResponseCode(status)
        for name, value in JSON_HEADERS:
            request.setHeader(name, value)
        for name, value in (headers or {}).items():
            request.setHeader(name.encode("ascii"), value.encode("ascii"))
        node = self.node_header()
        if node is not None:
            request.setHeader(NODE_HEADER, node)
        request.setHeader(b"content-length", b"%d" % len(payload))
        request.write(payload)
        request.finish()


@implementer(IPushProducer)
class SSEStream:
    """A ``text/event-stream`` response that follows the transport's pace.

    Registered as the request's push producer once started: while the HTTP transport is
    paused, :meth:`send` returns a Deferred that fires when it resumes (and fails if the client
    leaves), which the router awaits before pulling the next backend reply.
    """

    def __init__(self, exchange: _Exchange):
        self.exchange = exchange
        self.request = exchange.request
        self.started = False
        self.closed = False
        self.paused = False
        self._waiters: list[defer.Deferred] = []
        exchange.when_gone(self._abandon)

    def start(self, node: str | None) -> None:
        if self.started:
            return
        self.started = True
        self.exchange.served_by(node)
        request = self.request
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        request.setHeader(b"x-content-type-options", b"nosniff")
        header = self.exchange.node_header()
        if header is not None:
            request.setHeader(NODE_HEADER, header)
        request.registerProducer(self, True)
        # The transport may be full already (a pause is only announced on a change).
        self.paused = bool(getattr(request.channel, "_waitingForTransport", False))

    def comment(self, text: str) -> None:
        """Write an SSE comment line (``: text``), which clients ignore: a sign of life while
        nothing else can be sent.  Starts the stream (status 200) if it has not started."""
        if self.exchange.gone or self.closed:
            return
        self.start(None)
        self.request.write(b": " + " ".join(text.split()).encode("utf-8") + b"\n\n")

    def send(self, payload: Any) -> defer.Deferred | None:
        """Write one event (``payload`` as JSON, or a literal string such as ``[DONE]``).
        Returns a Deferred while the transport is paused, else None."""
        if self.exchange.gone or self.closed:
            return defer.fail(ConnectionDone("the client disconnected"))
        text = payload if isinstance(payload, str) else \
            json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        self.request.write(b"data: " + text.encode("utf-8") + b"\n\n")
        if not self.paused:
            return None
        waiter = defer.Deferred()
        self._waiters.append(waiter)
        return waiter

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        request = self.request
        if self.started and request.channel is not None and request.producer is not None:
            request.unregisterProducer()
        if not self.exchange.gone and not request.finished:
            request.finish()

    # IPushProducer
    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.called:
                waiter.callback(None)

    def stopProducing(self) -> None:
        self._abandon()

    def _abandon(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.called:
                waiter.errback(Failure(ConnectionDone("the client disconnected")))


class _Usage:
    """Token counts of a call: the last non-zero values a backend reported."""

    def __init__(self):
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def update(self, reply: backend_pb2.Reply) -> None:
        if reply.tokens:
            self.completion_tokens = reply.tokens
        if reply.prompt_tokens:
            self.prompt_tokens = reply.prompt_tokens

    def add(self, other: "_Usage") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _reply_usage(reply: backend_pb2.Reply) -> _Usage:
    usage = _Usage()
    usage.update(reply)
    return usage


# -- the resource ----------------------------------------------------------------------------------


def check_api_key(api_keys: APIKeyGuard | None, request) -> None:
    """The OpenAI API's key check (also the listener's header guard of ``/v1`` while the
    replica starts).  :raises OpenAIError: 401 when keys are configured and this is none."""
    if api_keys is None or not api_keys.configured:
        return  # no key configured: the OpenAI API is open (docs/openai-api.md)
    if bearer_token(request) is None:
        raise OpenAIError(401, "this API requires Authorization: Bearer <API key>",
                          "authentication_error", code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})
    try:
        api_keys.check(request)
    except APIError:
        raise OpenAIError(401, "the API key is not valid", "authentication_error",
                          code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"}) from None


class OpenAIResource(Resource):
    """``/v1``: the OpenAI-compatible API over an ``IInferenceRouter`` (module docstring).

    :param router: the replica's ``IInferenceRouter`` (the listener's starting gate answers
        503 until the replica, and so the router, exists).
    :param api_keys: the frontend's :class:`APIKeyGuard`; checked only when it has keys.
    :param deadline_seconds: per-request deadline handed to the router (None: its default).
    :param reactor: the clock for deadlines (``seconds()``); ``now`` gives ``created`` stamps.
    :param node_names: ``node_id -> name`` (or a Deferred of it) for the ``X-LocalAI-Node``
        header; without it the header names nodes by id.
    """

    isLeaf = True

    def __init__(self, router: IInferenceRouter, *, api_keys: APIKeyGuard | None = None,
                 deadline_seconds: float | None = None, reactor=None,
                 now: Callable[[], float] = time.time,
                 node_names: Callable[[str], Any] | None = None,
                 metrics: metrics.ReplicaMetrics = metrics.DISCARD):
        super().__init__()
        self._metrics = metrics
        self._router = router
        self._names = NodeNames(node_names) if node_names is not None else None
        self._api_keys = api_keys
        self._deadline_seconds = deadline_seconds
        self._reactor = reactor
        self._now = now

    # -- plumbing --------------------------------------------------------------------------

    def render(self, request):
        answering = defer.ensureDeferred(self._serve(request))
        answering.addErrback(lambda f: log.failure("answering {path} failed", f,
                                                   path=printable(_path_text(request))))
        return server.NOT_DONE_YET

    async def _serve(self, request) -> None:
        exchange = _Exchange(request, self._names, self._metrics.request(request.postpath))
        try:
            await self._dispatch(request, exchange)
        except _AlreadyAnswered:
            return
        except defer.CancelledError:
            if exchange.gone:
                return
            self._answer_error(exchange, OpenAIError(
                500, "the request was cancelled", "server_error", code="cancelled"), None)
        except Exception as e:
            self._answer_error(exchange, error_for(e), e)

    def _answer_error(self, exchange: _Exchange, answer: OpenAIError,
                      cause: BaseException | None) -> None:
        request = exchange.request
        exchange.record.failed(cause)
        if cause is not None and not isinstance(cause, (OpenAIError, APIError)):
            if answer.code == "internal_error":
                log.failure("{method} {path} failed", Failure(cause),
                            method=request.method.decode("ascii", "replace"),
                            path=printable(_path_text(request)))
            else:
                log.info("{method} {path}: {status} {code} ({condition}): {message}",
                         method=request.method.decode("ascii", "replace"),
                         path=printable(_path_text(request)), status=answer.status,
                         code=answer.code, condition=getattr(cause, "condition", "-"),
                         message=_detail(cause))  # the full text, ids included
        exchange.send_json(answer.status, answer.body(), answer.headers)

    def guard(self, request) -> None:
        """The API-key check, from the headers alone: ``FrontendSite`` runs it when the headers
        of a request with a body end, so a refused client never has a body byte read."""
        self._check_key(request)

    def _check_key(self, request) -> None:
        check_api_key(self._api_keys, request)

    def router(self) -> IInferenceRouter:
        return self._router

    def _deadline(self) -> float | None:
        if self._deadline_seconds is None:
            return None
        reactor = self._reactor
        if reactor is None:
            from twisted.internet import reactor
        return reactor.seconds() + self._deadline_seconds

    async def _dispatch(self, request, exchange: _Exchange) -> None:
        self._check_key(request)
        segments = [s for s in request.postpath]
        if segments and segments[-1] == b"":
            segments.pop()
        method = request.method.upper()
        routes = {
            (b"chat", b"completions"): (b"POST", self._chat),
            (b"completions",): (b"POST", self._completions),
            (b"embeddings",): (b"POST", self._embeddings),
            (b"models",): (b"GET", self._models),
        }
        key = tuple(segments)
        if key in routes:
            allowed, handler = routes[key]
            args = ()
        elif len(segments) >= 2 and segments[0] == b"models":
            allowed, handler = b"GET", self._model
            try:
                args = (b"/".join(segments[1:]).decode("utf-8"),)
            except UnicodeDecodeError:
                raise OpenAIError(404, "no such model", "invalid_request_error",
                                  param="model", code="model_not_found") from None
        else:
            raise OpenAIError(404, f"unknown endpoint {printable(_path_text(request))}",
                              "invalid_request_error", code="unknown_url")
        if method != allowed and not (allowed == b"GET" and method == b"HEAD"):
            raise OpenAIError(405, f"use {allowed.decode()} on this endpoint",
                              "invalid_request_error", code="method_not_allowed",
                              headers={"Allow": allowed.decode()})
        await handler(request, exchange, *args)

    def _body(self, request) -> _Fields:
        try:
            return _Fields(read_json_object(request))
        except APIError as e:
            answer = error_for(e)
            if e.status == 413:
                answer.code = "request_too_large"
            raise answer from None

    def _resolve_model(self, router, body: _Fields, usecase: str) -> tuple[str, _Model]:
        name = body.string("model", required=True, nonempty=True)
        config = router.model(name)
        if config is None:
            raise error_for(_missing(router, name))
        supported = usecases(config)
        if usecase not in supported:  # from the config: no backend is called, nothing reaped
            raise error_for(ModelUsecaseUnsupported(name, usecase, supported))
        return name, _Model.of(config)

    def _ids(self, prefix: str) -> tuple[str, int]:
        return f"{prefix}-{uuid.uuid4().hex}", int(self._now())

    # -- /v1/models ------------------------------------------------------------------------------

    async def _models(self, request, exchange: _Exchange) -> None:
        router = self.router()
        data = [_model_entry(config) for config in router.models()]
        listing: dict[str, Any] = {"object": "list", "data": data}
        errors = getattr(router, "model_errors", dict)()  # optional in IInferenceRouter
        if errors:  # an extra key OpenAI clients ignore; operators see what failed and why
            listing["errors"] = [{"id": name, "error": printable(reason, 1024)}
                                 for name, reason in sorted(errors.items())]
        exchange.send_json(200, listing)

    async def _model(self, request, exchange: _Exchange, name: str) -> None:
        router = self.router()
        config = router.model(name)
        if config is None:
            raise error_for(_missing(router, name))
        exchange.send_json(200, _model_entry(config))

    # -- /v1/chat/completions ----------------------------------------------------------------------

    async def _chat(self, request, exchange: _Exchange) -> None:
        router = self.router()
        body = self._body(request)
        name, model = self._resolve_model(router, body, CHAT)
        exchange.record.model = name  # a configured name: a bounded label
        messages, images = parse_messages(body.raw("messages"))
        stream = bool(body.boolean("stream"))
        n = body.integer("n", 1, MAX_CHOICES) or 1
        if stream and n != 1:
            raise invalid("streaming answers one choice; set 'n' to 1", "n",
                          code="invalid_value")
        include_usage = _include_usage(body, stream)
        sampling = merge_sampling(model.parameters, body, model.predict)
        extra: dict[str, Any] = {}
        if images:
            extra["Images"] = images
        tools = body.raw("tools")
        if tools is not None:
            if not isinstance(tools, list):
                raise invalid("'tools' must be a list", "tools", code="invalid_type")
            extra["Tools"] = json.dumps(tools, separators=(",", ":"))
        tool_choice = body.raw("tool_choice")
        if tool_choice is not None:
            if not isinstance(tool_choice, (str, dict)):
                raise invalid("'tool_choice' must be a string or an object", "tool_choice",
                              code="invalid_type")
            extra["ToolChoice"] = json.dumps(tool_choice, separators=(",", ":"))
        rendered = render_chat(model.templates, messages)
        if rendered.use_tokenizer_template:
            extra["UseTokenizerTemplate"] = True
            extra["Messages"] = [backend_pb2.Message(
                role=m.role, content=m.content, name=m.name, tool_call_id=m.tool_call_id,
                tool_calls=m.tool_calls, reasoning_content=m.reasoning_content)
                for m in rendered.messages]
        options = sampling.options(Prompt=rendered.prompt, **extra)
        completion_id, created = self._ids("chatcmpl")
        if stream:
            await self._stream(router, exchange, name, options, sampling, include_usage,
                               _ChatChunks(completion_id, created, name))
            return
        choices, usage = [], _Usage()
        for index in range(n):
            served = await exchange.call(router.predict(name, options, self._deadline()))
            exchange.served_by(served.served_by)
            reply = served.value
            usage.add(_reply_usage(reply))
            choices.append({
                "index": index,
                "message": {"role": "assistant",
                            "content": reply.message.decode("utf-8", "replace")},
                "logprobs": None,
                "finish_reason": finish_reason(reply, sampling.max_tokens),
            })
        exchange.send_json(200, {"id": completion_id, "object": "chat.completion",
                                 "created": created, "model": name, "choices": choices,
                                 "usage": usage.body()})

    # -- /v1/completions ------------------------------------------------------------------------

    async def _completions(self, request, exchange: _Exchange) -> None:
        router = self.router()
        body = self._body(request)
        name, model = self._resolve_model(router, body, COMPLETION)
        exchange.record.model = name  # a configured name: a bounded label
        prompts = _prompts(body.raw("prompt"))
        stream = bool(body.boolean("stream"))
        echo = bool(body.boolean("echo"))
        if stream and len(prompts) != 1:
            raise invalid("streaming answers exactly one prompt", "prompt",
                          code="invalid_value")
        include_usage = _include_usage(body, stream)
        sampling = merge_sampling(model.parameters, body, model.predict)
        completion_id, created = self._ids("cmpl")
        if stream:
            options = sampling.options(Prompt=render_completion(model.templates, prompts[0]))
            await self._stream(router, exchange, name, options, sampling, include_usage,
                               _CompletionChunks(completion_id, created, name,
                                                 prompts[0] if echo else ""))
            return
        choices, usage = [], _Usage()
        for index, prompt in enumerate(prompts):
            options = sampling.options(Prompt=render_completion(model.templates, prompt))
            served = await exchange.call(router.predict(name, options, self._deadline()))
            exchange.served_by(served.served_by)
            reply = served.value
            usage.add(_reply_usage(reply))
            text = reply.message.decode("utf-8", "replace")
            choices.append({"index": index, "text": (prompt + text) if echo else text,
                            "logprobs": None,
                            "finish_reason": finish_reason(reply, sampling.max_tokens)})
        exchange.send_json(200, {"id": completion_id, "object": "text_completion",
                                 "created": created, "model": name, "choices": choices,
                                 "usage": usage.body()})

    # -- streaming (chat and completions) ------------------------------------------------------------

    async def _stream(self, router, exchange: _Exchange, name: str,
                      options: backend_pb2.PredictOptions, sampling: Sampling,
                      include_usage: bool, chunks: "_Chunks") -> None:
        stream = SSEStream(exchange)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        usage = _Usage()
        last = backend_pb2.Reply()
        begun: list[bool] = []
        clock = self._reactor
        if clock is None:
            from twisted.internet import reactor as clock
        notices = task.LoopingCall(lambda: None)
        notices.clock = clock

        def on_loading(model_name: str) -> None:
            """A cold load: a comment every few seconds until the first reply, so the client
            (and any proxy) is not left in silence for the whole load."""
            started = clock.seconds()
            notices.f = lambda: stream.comment(
                f"loading model {model_name} ({clock.seconds() - started:.0f} s)")
            if not notices.running and not begun and not exchange.gone:
                notices.start(LOADING_NOTICE_INTERVAL, now=False)

        def quiet() -> None:
            if notices.running:
                notices.stop()

        def emit(payload) -> None:
            """Send without waiting (the last few small events); a pause is not awaited and
            a departed client is already handled by the exchange."""
            waiting = stream.send(payload)
            if waiting is not None:
                waiting.addErrback(lambda _: None)

        def on_start(node_id=None) -> None:
            quiet()
            if begun or exchange.gone:
                return
            exchange.served_by(node_id)
            if not exchange.named():
                return  # the first reply starts the stream, once the node's name is known
            begun.append(True)
            stream.start(node_id)
            first = chunks.first()
            if first is not None:
                emit(first)

        def on_reply(reply: backend_pb2.Reply):
            if exchange.gone:
                return defer.fail(ConnectionDone("the client disconnected"))
            if not begun and not exchange.named():
                return defer.ensureDeferred(exchange.name_nodes()).addCallback(
                    lambda _: on_reply(reply))
            on_start(None)
            exchange.record.replied()
            usage.update(reply)
            last.tokens = max(last.tokens, reply.tokens)
            text = decoder.decode(reply.message)
            if not text:
                return None  # nothing complete yet (or an empty piece): nothing to send
            return stream.send(chunks.delta(text))

        try:
            served = await exchange.call(router.predict_stream(
                name, options, on_reply, self._deadline(), on_start=on_start,
                on_loading=on_loading))
        except defer.CancelledError:
            if exchange.gone:
                stream.close()
                return
            raise self._stream_failed(stream, OpenAIError(
                500, "the stream was cancelled", "server_error", code="cancelled"))
        except Exception as e:
            if exchange.gone:
                stream.close()
                return
            raise self._stream_failed(stream, e)
        finally:
            quiet()
        on_start(served.served_by if served is not None else None)
        tail = decoder.decode(b"", final=True)
        if tail:
            emit(chunks.delta(tail))
        emit(chunks.finish(finish_reason(last, sampling.max_tokens)))
        exchange.record.usage(usage.body())
        if include_usage:
            emit(chunks.usage(usage.body()))
        emit("[DONE]")
        stream.close()

    def _stream_failed(self, stream: SSEStream, error: BaseException) -> BaseException:
        """Before the stream started: the error to answer as JSON.  After: it is sent as an
        ``error`` event (what OpenAI clients raise on), without ``[DONE]``, and logged."""
        if not stream.started:
            return error
        stream.exchange.record.failed(error)
        answer = error_for(error)
        log.info("stream of {path} failed after it started: {status} {code}: {message}",
                 path=printable(_path_text(stream.request)), status=answer.status,
                 code=answer.code, message=_detail(error))
        if answer.code == "internal_error":
            log.failure("stream failure", Failure(error))
        waiting = stream.send(answer.body())
        if waiting is not None:
            waiting.addErrback(lambda _: None)
        stream.close()
        return _AlreadyAnswered()

    # -- /v1/embeddings ------------------------------------------------------------------------------

    async def _embeddings(self, request, exchange: _Exchange) -> None:
        router = self.router()
        body = self._body(request)
        name, model = self._resolve_model(router, body, EMBEDDINGS)
        exchange.record.model = name  # a configured name: a bounded label
        inputs = _embedding_inputs(body.raw("input"))
        encoding = body.string("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise invalid("'encoding_format' must be float or base64", "encoding_format",
                          code="invalid_value")
        if body.has("dimensions"):
            raise invalid("'dimensions' is not supported: the model decides the vector size",
                          "dimensions", code="unsupported_parameter")
        sampling = merge_sampling(model.parameters, _Fields({}), model.predict)
        data, prompt_tokens = [], 0
        tokenizer = _Tokenizer(router, exchange, name, self._deadline)
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                options = sampling.options(Embeddings=item)
            else:
                options = sampling.options(EmbeddingTokens=item)
            served = await exchange.call(router.embed(name, options, self._deadline()))
            exchange.served_by(served.served_by)
            result = served.value
            vector = _pooled_vector(result)
            prompt_tokens += result.prompt_tokens if result.prompt_tokens > 0 else \
                await tokenizer.count(item)
            data.append({"object": "embedding", "index": index,
                         "embedding": _encode_vector(vector, encoding)})
        exchange.send_json(200, {"object": "list", "data": data, "model": name,
                                 "usage": {"prompt_tokens": prompt_tokens,
                                           "total_tokens": prompt_tokens}})


class _Tokenizer:
    """Counts the tokens of an embeddings input whose backend reported none in
    ``EmbeddingResult.prompt_tokens`` (docs/openai-api.md, *Usage*): token ids count
    themselves; text is counted by the model's ``TokenizeString``.  A backend that cannot
    tokenize either is asked once per request, and its inputs count 0 (logged)."""

    def __init__(self, router, exchange: _Exchange, name: str,
                 deadline: Callable[[], float | None]):
        self._router = router
        self._exchange = exchange
        self._name = name
        self._deadline = deadline
        self._unable = False

    async def count(self, item: str | list[int]) -> int:
        if not isinstance(item, str):
            return len(item)
        if self._unable:
            return 0
        options = backend_pb2.PredictOptions(Prompt=item)
        try:
            served = await self._exchange.call(
                self._router.tokenize(self._name, options, self._deadline()))
        except ClusterError as e:
            self._unable = True
            log.info("embeddings usage of model {model}: the backend reports no token count "
                     "and TokenizeString failed ({err}); its text inputs count 0 tokens",
                     model=self._name, err=_detail(e))
            return 0
        return max(0, served.value.length or len(served.value.tokens))


class _AlreadyAnswered(Exception):
    """The failure was already written into a started stream."""


def _path_text(request) -> str:
    return (request.path or b"").decode("utf-8", "replace")


def _missing(router, name: str) -> ClusterError:
    """Why ``name`` has no config: its file failed to load (the reason), or there is none."""
    lookup = getattr(router, "model_error", None)  # optional in IInferenceRouter
    problem = lookup(name) if lookup is not None else None
    return ModelConfigInvalid(name, str(problem)) if problem is not None else ModelNotFound(name)


def _model_entry(config: Any) -> dict:
    return {"id": str(_config_value(config, "name", "")), "object": "model", "created": 0,
            "owned_by": "localai-tw"}


def _include_usage(body: _Fields, stream: bool) -> bool:
    options = body.mapping("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed with stream: true", "stream_options",
                      code="invalid_value")
    return bool(_Fields(options, "stream_options.").boolean("include_usage"))


def _prompts(raw: Any) -> list[str]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        if len(raw) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts are accepted", "prompt",
                          code="invalid_value")
        return list(raw)
    if raw is None:
        raise invalid("you must provide 'prompt'", "prompt", code="missing_required_parameter")
    if isinstance(raw, list) and raw and all(isinstance(p, (int, list)) and
                                             not isinstance(p, bool) for p in raw):
        raise invalid("token-id prompts are not supported; send text", "prompt",
                      code="unsupported_parameter")
    raise invalid("'prompt' must be a string or a non-empty list of strings", "prompt",
                  code="invalid_type")


def _token_ids(raw: Any, param: str) -> list[int]:
    if not raw or not all(isinstance(t, int) and not isinstance(t, bool) and
                          0 <= t <= INT32_MAX for t in raw):
        raise invalid(f"{param!r} must be a non-empty list of token ids (integers >= 0)",
                      param, code="invalid_value")
    return list(raw)


def _embedding_inputs(raw: Any) -> list[str | list[int]]:
    """Text items and token-id items of ``input``, one backend call each."""
    if raw is None:
        raise invalid("you must provide 'input'", "input", code="missing_required_parameter")
    if isinstance(raw, str):
        items: list = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in raw):
        items = [_token_ids(raw, "input")]
    elif isinstance(raw, list) and raw:
        if len(raw) > MAX_EMBEDDING_INPUTS:
            raise invalid(f"at most {MAX_EMBEDDING_INPUTS} inputs are accepted", "input",
                          code="invalid_value")
        items = []
        for index, item in enumerate(raw):
            if isinstance(item, str):
                items.append(item)
            elif isinstance(item, list):
                items.append(_token_ids(item, f"input[{index}]"))
            else:
                raise invalid(f"'input[{index}]' must be a string or a list of token ids",
                              f"input[{index}]", code="invalid_type")
    else:
        raise invalid("'input' must be a string, a list of strings, or token ids", "input",
                      code="invalid_type")
    for index, item in enumerate(items):
        if isinstance(item, str) and not item:
            raise invalid("an embedding input must not be empty", f"input[{index}]"
                          if isinstance(raw, list) else "input", code="invalid_value")
    return items


def _pooled_vector(result: backend_pb2.EmbeddingResult) -> list[float]:
    if result.layout == backend_pb2.EMBEDDING_LAYOUT_PER_TOKEN or result.tokens > 1:
        raise OpenAIError(502, "the backend answered per-token embeddings; this frontend "
                          "serves pooled vectors only (configure the model to pool)",
                          "upstream_error", code="unsupported_embedding_layout")
    vector = list(result.embeddings)
    if not vector:
        raise OpenAIError(502, "the backend answered an empty embedding", "upstream_error",
                          code="empty_embedding")
    return vector


def _encode_vector(vector: Sequence[float], encoding: str):
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class _Chunks:
    """The event payloads of one streamed answer."""

    def first(self) -> dict | None:
        raise NotImplementedError

    def delta(self, text: str) -> dict:
        raise NotImplementedError

    def finish(self, reason: str) -> dict:
        raise NotImplementedError

    def usage(self, usage: dict) -> dict:
        raise NotImplementedError


@dataclass
class _ChatChunks(_Chunks):
    id: str
    created: int
    model: str

    def _chunk(self, choices: list, **more) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices, **more}

    def first(self) -> dict:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def delta(self, text: str) -> dict:
        return self._chunk([{"index": 0, "delta": {"content": text}, "logprobs": None,
                             "finish_reason": None}])

    def finish(self, reason: str) -> dict:
        return self._chunk([{"index": 0, "delta": {}, "logprobs": None,
                             "finish_reason": reason}])

    def usage(self, usage: dict) -> dict:
        return self._chunk([], usage=usage)


@dataclass
class _CompletionChunks(_Chunks):
    id: str
    created: int
    model: str
    echo: str = ""

    def _chunk(self, choices: list, **more) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **more}

    def first(self) -> dict | None:
        if not self.echo:
            return None
        return self.delta(self.echo)

    def delta(self, text: str) -> dict:
        return self._chunk([{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": None}])

    def finish(self, reason: str) -> dict:
        return self._chunk([{"index": 0, "text": "", "logprobs": None,
                             "finish_reason": reason}])

    def usage(self, usage: dict) -> dict:
        return self._chunk([], usage=usage)


__all__ = [
    "NODE_HEADER",
    "OPENAI_MAX_BODY_BYTES",
    "OpenAIError",
    "OpenAIResource",
    "SSEStream",
    "error_for",
    "merge_sampling",
    "parse_messages",
]
