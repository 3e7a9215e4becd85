"""The request side shared by the endpoint families: typed field access (:class:`Fields`, a
wrong type is a 400 naming the field), the limits on untrusted input, the model config as this
API reads it (:class:`ModelView`), and the sampling merge (:func:`merge_sampling`: the
request over the model's ``parameters`` over LocalAI's defaults).

What this module must never do: evaluate anything from a request or a config, accept an
unbounded list or map from a request, or answer a malformed field with anything but a 400
that names it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Mapping

from localai_tw.backends import backend_pb2
from localai_tw.errors import ClusterError

from localai_tw.frontend.inference.interfaces import (
    ModelConfigInvalid,
    ModelNotFound,
)
from localai_tw.localai.usecases import usecases
from localai_tw.localai.templates import PromptTemplates
from localai_tw.localai.toolcalls import FunctionConfig
from localai_tw.frontend.api.kit import printable, read_json_object
from localai_tw.web.errors import APIError
from localai_tw.frontend.api.openai.errors import error_for, invalid

#: Body cap of every ``/v1/`` request (give it to ``BoundedSite(body_limits=...)``).
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

INT32_MAX = 2**31 - 1

#: LocalAI's defaults for what neither the model config nor the request sets (§2.5).
SAMPLING_DEFAULTS = {
    "temperature": 0.9, "top_p": 0.95, "top_k": 40, "tail_free_z": 1.0, "typical_p": 1.0,
    "mirostat_eta": 0.1, "mirostat_tau": 5.0,
}

_seed_source = random.SystemRandom()
#: Model views kept (``ModelView.of``), by model name: (config object, view).
MAX_KEPT_VIEWS = 1024
_VIEWS: dict[Any, tuple[Any, "ModelView"]] = {}


# -- reading request fields ---------------------------------------------------------------------


class Fields:
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


def read_body(request) -> Fields:
    """The request's JSON object body (its size already capped by ``BoundedSite``)."""
    try:
        return Fields(read_json_object(request))
    except APIError as e:
        answer = error_for(e)
        if e.status == 413:
            answer.code = "request_too_large"
        raise answer from None


def usage_requested(body: Fields, stream: bool) -> bool:
    options = body.mapping("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed with stream: true", "stream_options",
                      code="invalid_value")
    return bool(Fields(options, "stream_options.").boolean("include_usage"))


# -- what this server cannot honour ---------------------------------------------------------------


def _unsupported(model: str, param: str, why: str) -> Exception:
    return invalid(f"model {printable(model)!r} cannot honour {param!r} here: {why}; send the "
                   f"request without it", param, code="unsupported_parameter")


def refuse_unhonoured(body: Fields, model: str, *, chat: bool) -> None:
    """A 400 ``unsupported_parameter`` for a field whose meaning this server cannot honour
    (a caller would otherwise break without an error).  Tools, ``response_format`` and
    log probabilities are checked against the model's backend by
    :mod:`~localai_tw.frontend.api.openai.constraints`."""
    if chat:
        modalities = body.raw("modalities")
        if isinstance(modalities, list) and any(m != "text" for m in modalities):
            raise _unsupported(model, "modalities", "this server answers text only")
        if body.has("audio"):
            raise _unsupported(model, "audio", "this server answers text only")
        if body.has("web_search_options"):
            raise _unsupported(model, "web_search_options", "this server does not search")
    else:
        if body.string("suffix"):
            raise _unsupported(model, "suffix", "this server does not insert text")
        if (body.integer("best_of", 1, MAX_CHOICES) or 1) > 1:
            raise _unsupported(model, "best_of", "this server does not rank candidates")


# -- the model a request names -------------------------------------------------------------------


def config_value(obj: Any, name: str, default=None):
    if obj is None:
        return default
    value = obj.get(name, default) if isinstance(obj, Mapping) else getattr(obj, name, default)
    return default if value is None else value


@dataclass(frozen=True)
class ModelView:
    """What this API reads of a model config."""

    name: str
    parameters: Mapping[str, Any]
    templates: PromptTemplates
    predict: Mapping[str, Any] = field(default_factory=dict)  # config's PredictOptions fields
    backend: str = ""
    functions: FunctionConfig = FunctionConfig()
    capabilities: Mapping[str, bool] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Any) -> "ModelView":
        """The view of ``config``, built once per config object: the catalog replaces the
        object when its file changes, so a view kept for the same object is still true (a
        plain mapping, as in tests, is built every time).  Callers never mutate a view."""
        if isinstance(config, Mapping):
            return cls._build(config)
        name = getattr(config, "name", None)
        kept = _VIEWS.get(name)
        if kept is not None and kept[0] is config:
            return kept[1]
        view = cls._build(config)
        _VIEWS.pop(name, None)
        _VIEWS[name] = (config, view)
        while len(_VIEWS) > MAX_KEPT_VIEWS:
            del _VIEWS[next(iter(_VIEWS))]
        return view

    @classmethod
    def _build(cls, config: Any) -> "ModelView":
        template = config_value(config, "template")
        templates = PromptTemplates.from_config(
            template, roles=config_value(config, "roles") or config_value(template, "roles"),
            system_prompt=config_value(config, "system_prompt", ""))
        functions = config_value(config, "functions")
        if not isinstance(functions, FunctionConfig):  # a plain mapping config (tests, tools)
            functions = FunctionConfig.from_yaml(config_value(config, "function"))
        return cls(name=str(config_value(config, "name", "")),
                   parameters=dict(config_value(config, "parameters", {}) or {}),
                   templates=templates,
                   predict=dict(config_value(config, "predict_options", {}) or {}),
                   backend=str(config_value(config, "backend", "")),
                   functions=functions,
                   capabilities=dict(config_value(config, "capabilities", {}) or {}))


def missing_model(router, name: str) -> ClusterError:
    """Why ``name`` has no config: its file failed to load (the reason), or there is none."""
    lookup = getattr(router, "model_error", None)  # optional in IInferenceRouter
    problem = lookup(name) if lookup is not None else None
    return ModelConfigInvalid(name, str(problem)) if problem is not None else ModelNotFound(name)


def resolve_model(router, body: Fields, usecase: str) -> tuple[str, ModelView]:
    """The request's ``model``, known.  ``usecase`` refuses nothing (LocalAI's rule: the
    backend serving the model answers what it cannot do; ``localai.usecases``)."""
    name = body.string("model", required=True, nonempty=True)
    config = router.model(name)
    if config is None:
        raise error_for(missing_model(router, name))
    return name, ModelView.of(config)


def router_method(router, method: str):
    """``router.<method>`` for the optional calls of ``IInferenceRouter`` (``tts``,
    ``transcribe``, ``generate_image``), or a 501 saying this server has no such call."""
    found = getattr(router, method, None)
    if found is None:
        from localai_tw.frontend.api.openai.errors import OpenAIError

        raise OpenAIError(501, f"this server's router does not serve {method}",
                          "server_error", code="not_implemented")
    return found


def resolve_model_or_default(router, body: Fields, usecase: str) -> tuple[str, ModelView]:
    """Like :func:`resolve_model`, but a request without ``model`` gets the first configured
    model (by name) able to serve ``usecase``, as LocalAI's speech, transcription and image
    endpoints pick one; none configured is a 400 saying so."""
    if body.has("model"):
        return resolve_model(router, body, usecase)
    for config in router.models():
        if usecase in usecases(config):
            return config.name, ModelView.of(config)
    raise invalid(f"you must provide 'model': no configured model does {usecase}",
                  "model", code="missing_required_parameter")


# -- PredictOptions ------------------------------------------------------------------------------


@dataclass
class Sampling:
    """The sampling fields of one request after merging (model defaults, then the request)."""

    max_tokens: int = 0
    values: dict = field(default_factory=dict)  # PredictOptions keyword arguments
    seed_fixed: bool = False  # the request or the model config set the seed

    def options(self, **more) -> backend_pb2.PredictOptions:
        return backend_pb2.PredictOptions(**{**self.values, **more})

    def seeds(self, n: int) -> list[int]:
        """One seed per choice, so ``n`` choices are ``n`` distinct samples: a set seed ``s``
        gives ``s, s+1, ...`` (reproducible), else each choice draws its own."""
        first = self.values["Seed"]
        if self.seed_fixed:
            return [_int32(first + i) for i in range(n)]
        seeds = [first]
        while len(seeds) < n:
            seed = _seed_source.randint(0, INT32_MAX)
            if seed not in seeds:
                seeds.append(seed)
        return seeds


def _int32(value: int) -> int:
    """OpenAI seeds are int64; the backend's are int32 (wrapped around)."""
    return ((int(value) + 2**31) % 2**32) - 2**31


def merge_sampling(parameters: Mapping[str, Any], body: Fields,
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
    seed_fixed = seed is not None
    if seed is None:
        seed = _seed_source.randint(0, INT32_MAX)
    seed = _int32(seed)
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
    return Sampling(max_tokens=int(max_tokens), values=values, seed_fixed=seed_fixed)
