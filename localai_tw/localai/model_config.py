"""Model configs: one YAML file per model in the models directory, LocalAI style.

A file ``<models-dir>/<anything>.yaml`` (or ``.yml``) describes one model::

    name: tiny-echo                 # required; what clients put in "model"
    backend: echo                   # a backend the workers know; without it a .gguf
                                    # parameters.model means llama-cpp (LocalAI's guess)
    parameters:
      model: tiny.bin               # file or folder (relative to the models dir), a URL
                                    # (downloaded, then its file name), or an identifier
      temperature: 0.2              # defaults for requests (the API layer merges them)
      top_p: 0.9
      max_tokens: 64
      stop: ["</s>"]
    files:                          # staged on the worker before LoadModel
      - path: tiny.bin              # relative to the models dir, inside it
        sha256: 9f86d0...           # optional; checked before staging when given
        key: models/tiny-echo/tiny.bin   # optional worker key (default models/<name>/<basename>)
    download_files:                 # LocalAI's key: fetched into the models dir first
      - {filename: tiny.bin, uri: "https://example.org/tiny.bin", sha256: "9f86d0..."}
    template:
      chat: "{{.Input}}"
      chat_message: "{{.RoleName}}: {{.Content}}"
      completion: "{{.Input}}"
      use_tokenizer_template: false
    context_size: 2048
    embeddings: false               # true: an embeddings model (see "What a model is for")
    known_usecases: [chat]          # optional, LocalAI's key: what the model may be asked for
    options: ["echo.dim:16"]        # ModelOptions.Options, passed through
    node_selector: {gpu: "yes"}     # labels a node must carry (AND of all pairs)
    route_policy: prefix_cache      # round_robin | prefix_cache (default: the cluster's,
                                    # --distributed-prefix-cache; docs/routing.md)

LocalAI's own keys are read as LocalAI reads them (``docs/models.md``): those that map to a
``ModelOptions`` or ``PredictOptions`` field are carried in :attr:`ModelConfig.model_options` /
:attr:`ModelConfig.predict_options` (tables :data:`MODEL_OPTIONS`, :data:`PREDICT_OPTIONS`, ...);
LocalAI keys this project does not act on, and keys nobody knows, are warnings
(:attr:`ModelConfig.warnings`, logged once per change) and the model is kept.  ``name`` may be
left out: the file name without ``.yaml`` is used (LocalAI's gallery configs carry none).

Validation errors name the file and the field (``models/tiny.yaml: files[0].path: ...``); a
known key of the wrong type refuses the file.  An invalid file is skipped (and logged once per
change), never fatal to the others, and :meth:`.catalog.ModelCatalog.error` keeps why, under the name it
meant to define, so a request for it is answered with the reason.  Two files
with the same ``name``: the first by file name wins and the other is reported.

What a model is for (:func:`usecases`), LocalAI's ``HasUsecases``: a list, never a gate.  It
picks defaults (the model of a speech, transcription or image request without ``model``) and
fills lists (``/v1/models/capabilities``); no endpoint refuses a request because of it: the
backend serving the model answers what it cannot do (``UNIMPLEMENTED`` is a 501 naming the
backend's words).  The list is ``known_usecases`` (LocalAI's key; a ``FLAG_`` prefix is dropped)
PLUS what is guessed from the rest of the config, as LocalAI adds its ``GuessUsecases``:

1. ``embeddings: true``: ``embeddings``;
2. else what the backend is known to do (:data:`BACKEND_USECASES`): ``transformers`` and
   ``llama-cpp`` chat and completion, ``sentence-transformers`` embeddings, ``echo`` all three,
   LocalAI's ``whisper`` transcript (not with the ``vad_only`` option), ``piper``, ``kokoro``
   and ``transformers-musicgen`` tts, ``stablediffusion``, ``stablediffusion-ggml`` and
   ``diffusers`` (with a ``diffusers.pipeline_type``) image, ``rerankers`` rerank, ``silero-vad``
   vad; a backend not in the table
   (``external``, plugins) chat, completion and embeddings;
3. ``rerank`` too when ``reranking: true``, or when 1. or 2. gave ``embeddings`` on a backend
   whose ``Rerank`` this package ships (:data:`RERANK_BACKENDS`).

As in LocalAI, a ``known_usecases`` naming ``score`` or ``token_classify`` is taken as it is
(the operator reserved the model for that), with nothing guessed on top.

Reading a directory of such files, and re-reading it when files change, is :mod:`.catalog`'s
(``ModelCatalog``).

What this module must never do: read a file bigger than ``MAX_FILE_BYTES``; accept a file path
that leaves the models directory (``..``, absolute paths, symlinks out); execute anything from
YAML (``yaml.safe_load`` only); raise from :meth:`.catalog.ModelCatalog.models` because of a bad file.

LocalAI's GGUF guesses (``core/config/hooks_llamacpp.go``, ``gguf.go``) are made from the config
alone, never by opening the model file: no ``backend`` and a ``.gguf`` model means
``llama-cpp``; a ``llama-cpp`` config with no template uses the model's own chat template
(``use_tokenizer_template``, :attr:`ModelTemplate.tokenizer_template_guessed`).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Mapping


from localai_tw.localai.capabilities import read_overrides
from localai_tw.localai.toolcalls import FunctionConfig, FunctionConfigError


MAX_FILE_BYTES = 256 * 1024
MAX_FILES = 2000
MAX_NAME = 255
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_BACKEND_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_USECASE_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,63}$")
MAX_USECASES = 32

#: Sampling defaults a model file may set, and their types.
PARAMETER_TYPES: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "max_tokens": (int,),
    "seed": (int,),
    "stop": (list, str),
    "repeat_penalty": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "batch": (int,),
}

# LocalAI's model config keys (core/config ModelConfig, LLMConfig, schema.PredictionOptions),
# by what happens to them here.  A value of a key below is checked against its kind ("bool",
# "int" (int32), "float", "str", "strs" (list of strings), "floats", "map"); a wrong kind
# refuses the file naming the key, as LocalAI's YAML decoder does.

#: Top-level keys sent to the backend in ``ModelOptions`` at LoadModel: key -> (kind, field).
MODEL_OPTIONS: dict[str, tuple[str, str]] = {
    "f16": ("bool", "F16Memory"), "threads": ("int", "Threads"),
    "gpu_layers": ("int", "NGPULayers"), "mmap": ("bool", "MMap"), "mmlock": ("bool", "MLock"),
    "low_vram": ("bool", "LowVRAM"), "numa": ("bool", "NUMA"), "type": ("str", "Type"),
    "main_gpu": ("str", "MainGPU"), "tensor_split": ("str", "TensorSplit"),
    "rms_norm_eps": ("float", "RMSNormEps"), "ngqa": ("int", "NGQA"),
    "mmproj": ("str", "MMProj"), "draft_model": ("str", "DraftModel"),
    "quantization": ("str", "Quantization"), "load_format": ("str", "LoadFormat"),
    "gpu_memory_utilization": ("float", "GPUMemoryUtilization"),
    "trust_remote_code": ("bool", "TrustRemoteCode"), "enforce_eager": ("bool", "EnforceEager"),
    "swap_space": ("int", "SwapSpace"), "max_model_len": ("int", "MaxModelLen"),
    "tensor_parallel_size": ("int", "TensorParallelSize"),
    "disable_log_stats": ("bool", "DisableLogStatus"), "dtype": ("str", "DType"),
    "flash_attention": ("str", "FlashAttention"), "no_kv_offloading": ("bool", "NoKVOffload"),
    "cache_type_k": ("str", "CacheTypeKey"), "cache_type_v": ("str", "CacheTypeValue"),
    "rope_scaling": ("str", "RopeScaling"), "yarn_ext_factor": ("float", "YarnExtFactor"),
    "yarn_attn_factor": ("float", "YarnAttnFactor"), "yarn_beta_fast": ("float", "YarnBetaFast"),
    "yarn_beta_slow": ("float", "YarnBetaSlow"), "cfg_scale": ("float", "CFGScale"),
    "cuda": ("bool", "CUDA"), "lora_adapter": ("str", "LoraAdapter"),
    "lora_base": ("str", "LoraBase"), "lora_scale": ("float", "LoraScale"),
    "lora_adapters": ("strs", "LoraAdapters"), "lora_scales": ("floats", "LoraScales"),
    "no_mulmatq": ("bool", "NoMulMatQ"), "audio_path": ("str", "AudioPath"),
    "overrides": ("strs", "Overrides"), "reranking": ("bool", "Reranking"),
}
#: Top-level keys sent in every request's ``PredictOptions``: key -> (kind, field).  ``f16``,
#: ``threads``, ``mmap``, ``mmlock``, ``main_gpu`` and ``tensor_split`` go to both messages, as
#: LocalAI sends them.
PREDICT_OPTIONS: dict[str, tuple[str, str]] = {
    "stopwords": ("strs", "StopPrompts"), "f16": ("bool", "F16KV"),
    "threads": ("int", "Threads"), "mmap": ("bool", "MMap"), "mmlock": ("bool", "MLock"),
    "main_gpu": ("str", "MainGPU"), "tensor_split": ("str", "TensorSplit"),
    "grammar": ("str", "Grammar"), "n_draft": ("int", "NDraft"),
    "prompt_cache_path": ("str", "PromptCachePath"),
    "prompt_cache_all": ("bool", "PromptCacheAll"), "prompt_cache_ro": ("bool", "PromptCacheRO"),
    "mirostat": ("int", "Mirostat"), "mirostat_eta": ("float", "MirostatETA"),
    "mirostat_tau": ("float", "MirostatTAU"), "debug": ("bool", "Debug"),
}
#: ``parameters`` keys (beyond :data:`PARAMETER_TYPES`) sent in ``PredictOptions``.
PARAMETER_PREDICT: dict[str, tuple[str, str]] = {
    "repeat_last_n": ("int", "Repeat"), "n_keep": ("int", "NKeep"),
    "tfz": ("float", "TailFreeSamplingZ"), "typical_p": ("float", "TypicalP"),
    "ignore_eos": ("bool", "IgnoreEOS"), "rope_freq_base": ("float", "RopeFreqBase"),
    "rope_freq_scale": ("float", "RopeFreqScale"), "negative_prompt": ("str", "NegativePrompt"),
    "negative_prompt_scale": ("float", "NegativePromptScale"),
}
#: ``parameters`` keys also sent in ``ModelOptions``.
PARAMETER_MODEL: dict[str, tuple[str, str]] = {
    "rope_freq_base": ("float", "RopeFreqBase"), "rope_freq_scale": ("float", "RopeFreqScale"),
    "tokenizer": ("str", "Tokenizer"),
}
#: ``diffusers`` keys sent in ``ModelOptions``.
DIFFUSERS_OPTIONS: dict[str, tuple[str, str]] = {
    "cuda": ("bool", "CUDA"), "pipeline_type": ("str", "PipelineType"),
    "scheduler_type": ("str", "SchedulerType"), "img2img": ("bool", "IMG2IMG"),
    "clip_skip": ("int", "CLIPSkip"), "clip_model": ("str", "CLIPModel"),
    "clip_subfolder": ("str", "CLIPSubfolder"), "control_net": ("str", "ControlNet"),
}
#: ``limit_mm_per_prompt`` keys sent in ``ModelOptions``.
LIMIT_OPTIONS: dict[str, tuple[str, str]] = {
    "image": ("int", "LimitImagePerPrompt"), "video": ("int", "LimitVideoPerPrompt"),
    "audio": ("int", "LimitAudioPerPrompt"),
}
#: LocalAI keys accepted and not acted on here (a warning says so): features of LocalAI's own
#: API server (function calling, agents, pipelines, routing, ...) this project does not have.
LOCALAI_IGNORED = frozenset({
    "alias", "artifacts", "known_input_modalities", "known_output_modalities", "pipeline",
    "reasoning", "compression", "reasoning_effort", "chat_template_kwargs",
    "feature_flags", "step", "grpc", "tts", "disabled",
    "concurrency_groups", "mcp", "agent", "pii", "pii_detection", "router", "proxy", "mitm",
    "limits", "cutstrings", "extract_regex", "trimspace", "trimsuffix",
})
PARAMETER_IGNORED = frozenset({
    "echo", "n", "logprobs", "top_logprobs", "language", "translate", "pooling",
    "pooling_half_life_tokens", "clip_skip", "encoding_format", "logit_bias",
})
TEMPLATE_FIELDS = ("chat", "chat_message", "completion", "use_tokenizer_template",
                   "join_chat_messages_by_character", "function")
TEMPLATE_IGNORED = frozenset({"edit", "multimodal", "reply_prefix", "image",
                              "audio", "video"})
TOP_LEVEL_FIELDS = frozenset({
    "name", "backend", "model", "parameters", "files", "template", "context_size",
    "embeddings", "options", "node_selector", "description", "known_usecases", "usage",
    "roles", "system_prompt", "engine_args", "diffusers", "limit_mm_per_prompt",
    "function", "capabilities", "download_files",
    "pinned", "preload", "memory_bytes", "route_policy",
}) | set(MODEL_OPTIONS) | set(PREDICT_OPTIONS)
INT32 = (-(2 ** 31), 2 ** 31 - 1)
MAX_LIST = 256
MAX_STOPWORDS = 32
MAX_WARNINGS = 32


class ModelConfigError(ValueError):
    """A model file is invalid.  ``str()`` names the file and the field."""

    def __init__(self, source: str, field_name: str | None, problem: str):
        self.source = source
        self.field = field_name
        self.problem = problem
        self.model_name: str | None = None  # the name it would have had (set by the loader)
        where = f"{source}: {field_name}: " if field_name else f"{source}: "
        super().__init__(where + problem)


@dataclass(frozen=True)
class ModelFile:
    """A file staged on a worker before the model loads."""

    path: str           # relative to the models dir (normalised, '/' separated)
    key: str            # the worker's staging key (models/...)
    sha256: str | None  # expected digest, lowercase hex, or None

    def local_path(self, models_dir: str) -> str:
        return os.path.join(models_dir, *self.path.split("/"))

    def contained_path(self, models_dir: str) -> str:
        """The file's real path, symlinks resolved, checked to lie inside ``models_dir``.

        ``path`` is validated as relative and free of ``..`` when the config loads, but a
        symlink inside the models directory can still point anywhere; the worker's staging
        resolves and checks the same way.  :raises ValueError: it resolves outside.
        """
        root = os.path.realpath(models_dir)
        real = os.path.realpath(self.local_path(models_dir))
        if os.path.commonpath([root, real]) != root:
            raise ValueError(f"file {self.path} resolves outside the models directory "
                             "(a symbolic link?); model files must lie inside it")
        return real


#: URL schemes ``download_files`` and a URL ``parameters.model`` may use (``docs/models.md``);
#: ``huggingface://``, ``hf://`` and ``github:`` are rewritten to https as LocalAI does.
DOWNLOAD_SCHEMES = ("file://", "http://", "https://", "huggingface://", "hf://", "github://",
                    "github:")
#: Schemes LocalAI knows that this project refuses, named in the refusal.
REFUSED_SCHEMES = ("ollama://", "oci://", "ocifile://", "hf.co/")
MAX_DOWNLOADS = 256


@dataclass(frozen=True)
class ModelDownload:
    """A file the frontend downloads into the models directory before the model loads
    (LocalAI's ``download_files``, or ``parameters.model`` given as a URL)."""

    filename: str       # relative to the models dir (normalised, '/' separated)
    uri: str            # as written in the config (file://, http(s)://, huggingface://, ...)
    sha256: str | None  # expected digest, lowercase hex, or None (then a present file is kept)
    where: str          # the config key that asked for it, for errors


@dataclass(frozen=True)
class ModelTemplate:
    chat: str = ""
    chat_message: str = ""
    completion: str = ""
    use_tokenizer_template: bool = False
    join_chat_messages_by_character: str | None = None
    function: str = ""  # LocalAI's template.function: the chat template when tools are used
    #: ``use_tokenizer_template`` was not written but guessed (a ``llama-cpp`` config with no
    #: template): the frontend also sends the plain prompt, which a GGUF without a chat
    #: template is answered from.
    tokenizer_template_guessed: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """One configured model (see the module docstring for the YAML)."""

    name: str
    backend: str
    model: str
    files: tuple[ModelFile, ...] = ()
    parameters: Mapping[str, Any] = field(default_factory=dict)
    template: ModelTemplate = ModelTemplate()
    context_size: int = 0
    embeddings: bool = False
    options: tuple[str, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    description: str = ""
    source: str = ""
    known_usecases: tuple[str, ...] | None = None
    roles: Mapping[str, str] = field(default_factory=dict)
    system_prompt: str = ""
    #: ``ModelOptions`` fields from the config (LoadModel); see :data:`MODEL_OPTIONS`.
    model_options: Mapping[str, Any] = field(default_factory=dict)
    #: ``PredictOptions`` fields from the config (every request); see :data:`PREDICT_OPTIONS`.
    predict_options: Mapping[str, Any] = field(default_factory=dict)
    #: Keys accepted but not acted on, or not known at all (logged once per file change).
    warnings: tuple[str, ...] = ()
    #: The ``function`` section as acted on (tool call parsing, grammar settings).
    functions: FunctionConfig = FunctionConfig()
    #: ``capabilities`` overrides of what the backend honours (see ``capabilities.py``).
    capabilities: Mapping[str, bool] = field(default_factory=dict)
    #: Files downloaded into the models directory before a load (``download_files``, a URL
    #: ``parameters.model``): ``frontend/inference/downloads.py``.
    downloads: tuple[ModelDownload, ...] = ()
    #: LocalAI's ``pinned``: never evicted (idle watchdog, memory or count eviction); an
    #: explicit unload still stops it (docs/models.md, "Lifecycle").
    pinned: bool = False
    #: ``preload: true``: loaded when a replica starts, on a node the scheduler picks.
    preload: bool = False
    #: ``memory_bytes``: what the model needs loaded (bytes, or 512M / 2G); 0 = estimated
    #: from the sizes of its ``files`` (``lifecycle.memory_need``).
    memory_bytes: int = 0
    #: ``route_policy``: ``round_robin`` or ``prefix_cache`` ("" = the cluster's default,
    #: ``--distributed-prefix-cache``); ``frontend/inference/prefix_index.py``.
    route_policy: str = ""
    #: What was guessed because the config does not say it (LocalAI's GGUF defaults): the
    #: backend from a ``.gguf`` file, the model's own chat template (logged once per change).
    guesses: tuple[str, ...] = ()

    def file_for_model(self) -> ModelFile | None:
        """The staged file ``model`` names, if it names one."""
        for f in self.files:
            if f.path == self.model or posixpath.basename(f.path) == self.model:
                return f
        return None


# -- validation ----------------------------------------------------------------------------


def _relative_path(source: str, fieldname: str, raw) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ModelConfigError(source, fieldname, "must be a non-empty string")
    if len(raw) > 1024 or "\x00" in raw or "\\" in raw:
        raise ModelConfigError(source, fieldname, "is not a usable relative path")
    if raw.startswith("/"):
        raise ModelConfigError(source, fieldname, "must be relative to the models directory")
    normal = posixpath.normpath(raw)
    if normal == "." or normal == ".." or normal.startswith("../"):
        raise ModelConfigError(source, fieldname, "leaves the models directory")
    return normal


def _worker_key(source: str, fieldname: str, raw) -> str:
    if not isinstance(raw, str):
        raise ModelConfigError(source, fieldname, "must be a string")
    normal = posixpath.normpath(raw)
    if raw.startswith("/") or normal.startswith("..") or "\x00" in raw or len(raw) > 1024:
        raise ModelConfigError(source, fieldname, "must be a relative worker key")
    if not normal.startswith("models/"):
        raise ModelConfigError(source, fieldname, "must start with models/ (worker model root)")
    return normal


_KIND_TEXT = {"bool": "true or false", "int": "an integer", "float": "a number",
              "str": "a string", "strs": "a list of strings", "floats": "a list of numbers",
              "map": "a mapping"}


def _typed(source: str, fieldname: str, value, kind: str):
    """``value`` checked as ``kind`` (see :data:`MODEL_OPTIONS`), in its proto type.
    :raises ModelConfigError: naming ``fieldname``."""
    def bad(extra: str = "") -> ModelConfigError:
        return ModelConfigError(source, fieldname, f"must be {_KIND_TEXT[kind]}{extra}")

    if kind == "bool":
        if not isinstance(value, bool):
            raise bad()
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        if not INT32[0] <= value <= INT32[1]:
            raise bad(" that fits 32 bits")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        return float(value)
    if kind == "str":  # a YAML scalar read into a Go string: numbers and booleans as text
        if isinstance(value, bool):
            return "true" if value else "false"
        if not isinstance(value, (str, int, float)):
            raise bad()
        return str(value)
    if kind in ("strs", "floats"):
        item = str if kind == "strs" else (int, float)
        if not isinstance(value, list) or len(value) > MAX_LIST or \
                not all(isinstance(v, item) and not isinstance(v, bool) for v in value):
            raise bad(f" (at most {MAX_LIST})")
        return [v if kind == "strs" else float(v) for v in value]
    if not isinstance(value, dict):
        raise bad()
    return value


def _sub_options(source: str, data: dict, key: str, table: dict, model_options: dict,
                 warnings: list) -> None:
    raw = data.get(key)
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise ModelConfigError(source, key, "must be a mapping")
    for sub, value in raw.items():
        entry = table.get(sub)
        if entry is None:
            warnings.append(f"{key}.{str(sub)[:64]}: not used by localai-tw; ignored")
            continue
        if value is not None:
            model_options[entry[1]] = _typed(source, f"{key}.{sub}", value, entry[0])


def parse_model_config(data: Any, source: str = "<config>") -> ModelConfig:
    """Validate one decoded YAML document.  :raises ModelConfigError:"""
    if not isinstance(data, dict):
        raise ModelConfigError(source, None, "the file must hold a YAML mapping")
    warnings: list[str] = []
    for key in data:
        if key in TOP_LEVEL_FIELDS:
            continue
        shown = str(key)[:64]
        if key in LOCALAI_IGNORED:
            warnings.append(f"{shown}: a LocalAI key localai-tw does not act on; ignored")
        else:
            warnings.append(f"{shown}: unknown key; ignored")
    name = data.get("name")
    if name is None and source.endswith((".yaml", ".yml")):
        name = posixpath.basename(source).rsplit(".", 1)[0]  # LocalAI's gallery omits it
    if not isinstance(name, str) or not name:
        raise ModelConfigError(source, "name", "is required (a non-empty string)")
    if not is_model_name(name):
        raise ModelConfigError(source, "name", "must be a file name: letters, digits and "
                               "punctuation of any script, no '/', '\\', control characters "
                               f"or leading '.' (at most {MAX_NAME} bytes in UTF-8)")
    backend = data.get("backend")
    guesses: list[str] = []
    if backend is None or backend == "":
        backend = _guess_backend(data.get("parameters"), data.get("model"))
        if backend is None:
            raise ModelConfigError(source, "backend", "is required (a backend name such as "
                                   "llama-cpp); it is guessed only when parameters.model is "
                                   "a .gguf file")
        guesses.append(f"backend: {backend} (parameters.model is a .gguf file)")
    if not isinstance(backend, str) or not _BACKEND_RE.match(backend):
        raise ModelConfigError(source, "backend", "is required (a backend name such as echo)")

    parameters = data.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ModelConfigError(source, "parameters", "must be a mapping")
    model = parameters.get("model", data.get("model"))
    if model is None or model == "":
        model = name  # LocalAI's gallery writes model: "" for backends that fetch their own
    if not isinstance(model, str) or not model or len(model) > 1024:
        raise ModelConfigError(source, "parameters.model", "must be a non-empty string")
    downloads = _downloads(source, data.get("download_files"))
    if _looks_like_url(model):
        _check_scheme(source, "parameters.model", model)
        filename = _filename_from_url(model)
        downloads.append(ModelDownload(filename, model, None, "parameters.model"))
        model = filename  # LocalAI: the model is the downloaded file from then on
    if len({d.filename for d in downloads}) != len(downloads):
        raise ModelConfigError(source, "download_files", "two entries write the same filename")
    defaults: dict[str, Any] = {}
    model_options: dict[str, Any] = {}
    predict_options: dict[str, Any] = {}
    for key, value in parameters.items():
        if key == "model" or value is None:
            continue
        where = f"parameters.{str(key)[:64]}"
        types = PARAMETER_TYPES.get(key)
        if types is not None:
            if isinstance(value, bool) or not isinstance(value, types):
                raise ModelConfigError(source, where,
                                       f"must be {' or '.join(t.__name__ for t in types)}")
            if key == "stop" and isinstance(value, list) and \
                    not all(isinstance(s, str) for s in value):
                raise ModelConfigError(source, "parameters.stop", "must be strings")
            defaults[key] = value
        elif key in PARAMETER_PREDICT or key in PARAMETER_MODEL:
            for table, out in ((PARAMETER_PREDICT, predict_options),
                               (PARAMETER_MODEL, model_options)):
                if key in table:
                    out[table[key][1]] = _typed(source, where, value, table[key][0])
        elif key in PARAMETER_IGNORED:
            warnings.append(f"{where}: a LocalAI key localai-tw does not act on; ignored")
        else:
            warnings.append(f"{where}: unknown parameter; ignored")
    for key, (kind, proto) in MODEL_OPTIONS.items():
        if data.get(key) is not None:
            model_options[proto] = _typed(source, key, data[key], kind)
    for key, (kind, proto) in PREDICT_OPTIONS.items():
        if data.get(key) is not None:
            predict_options[proto] = _typed(source, key, data[key], kind)
    # LocalAI's default (core/config/generic_defaults.go): memory-mapped unless the config says
    # mmap: false; without it a GGUF would be read whole into memory.
    model_options.setdefault("MMap", True)
    predict_options.setdefault("MMap", True)
    if len(predict_options.get("StopPrompts", ())) > MAX_STOPWORDS:
        raise ModelConfigError(source, "stopwords", f"at most {MAX_STOPWORDS} are accepted")
    _sub_options(source, data, "diffusers", DIFFUSERS_OPTIONS, model_options, warnings)
    _sub_options(source, data, "limit_mm_per_prompt", LIMIT_OPTIONS, model_options, warnings)
    if model_options.get("CUDA") is False and data.get("cuda") is True:
        model_options["CUDA"] = True  # LocalAI: cuda || diffusers.cuda
    engine_args = data.get("engine_args")
    if engine_args is not None:
        _typed(source, "engine_args", engine_args, "map")
        try:
            model_options["EngineArgs"] = json.dumps(engine_args, separators=(",", ":"),
                                                     sort_keys=True, default=str)
        except (TypeError, ValueError):
            raise ModelConfigError(source, "engine_args", "cannot be written as JSON") from None
    roles = data.get("roles") or {}
    if not isinstance(roles, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in roles.items()):
        raise ModelConfigError(source, "roles", "must map role names to strings")
    system_prompt = data.get("system_prompt") or ""
    if not isinstance(system_prompt, str):
        raise ModelConfigError(source, "system_prompt", "must be a string")

    files_raw = data.get("files") or []
    if not isinstance(files_raw, list):
        raise ModelConfigError(source, "files", "must be a list")
    files: list[ModelFile] = []
    for i, entry in enumerate(files_raw):
        where = f"files[{i}]"
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict):
            raise ModelConfigError(source, where, "must be a mapping with path (and sha256, key)")
        for key in entry:
            if key not in ("path", "sha256", "key"):
                raise ModelConfigError(source, f"{where}.{key}", "unknown field (path, sha256, key)")
        path = _relative_path(source, f"{where}.path", entry.get("path"))
        digest = entry.get("sha256")
        if digest is not None:
            if isinstance(digest, int) and not isinstance(digest, bool):
                raise ModelConfigError(source, f"{where}.sha256", "was read as a number; quote "
                                       "it (an all-digit hash loses its leading zeros)")
            if not isinstance(digest, str) or not _SHA256_RE.match(digest.lower()):
                raise ModelConfigError(source, f"{where}.sha256", "must be 64 hex digits")
            digest = digest.lower()
        key = entry.get("key")
        key = (_worker_key(source, f"{where}.key", key) if key is not None
               else f"models/{name.replace('/', '_')}/{posixpath.basename(path)}")
        files.append(ModelFile(path, key, digest))
    if len({f.key for f in files}) != len(files):
        raise ModelConfigError(source, "files", "two files map to the same worker key")

    template_raw = data.get("template") or {}
    if not isinstance(template_raw, dict):
        raise ModelConfigError(source, "template", "must be a mapping")
    template_kept = {}
    for key, value in template_raw.items():
        if key not in TEMPLATE_FIELDS:
            what = "a LocalAI key localai-tw does not act on" if key in TEMPLATE_IGNORED \
                else "unknown key"
            warnings.append(f"template.{str(key)[:64]}: {what}; ignored")
            continue
        if value is None:
            continue
        expected = bool if key == "use_tokenizer_template" else str
        if not isinstance(value, expected):
            raise ModelConfigError(source, f"template.{key}", f"must be a {expected.__name__}")
        template_kept[key] = value
    known = _known_usecases(source, data.get("known_usecases"))
    if _guesses_tokenizer_template(backend, template_raw, known):
        template_kept.update(use_tokenizer_template=True, tokenizer_template_guessed=True)
        guesses.append("template: the model's own chat template (no template in the config)")
    template = ModelTemplate(**template_kept)

    context_size = data.get("context_size", 0) or 0
    if isinstance(context_size, bool) or not isinstance(context_size, int) or \
            not 0 <= context_size <= 10_000_000:
        raise ModelConfigError(source, "context_size", "must be an integer >= 0")
    embeddings = data.get("embeddings", False)
    if not isinstance(embeddings, bool):
        raise ModelConfigError(source, "embeddings", "must be true or false")
    options = data.get("options") or []
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options) or \
            len(options) > 256:
        raise ModelConfigError(source, "options", "must be a list of strings (at most 256)")
    selector = data.get("node_selector") or {}
    if not isinstance(selector, dict):
        raise ModelConfigError(source, "node_selector", "must be a mapping of label: value")
    clean_selector: dict[str, str] = {}
    for key, value in selector.items():
        if not isinstance(key, str) or not _LABEL_KEY_RE.match(key):
            raise ModelConfigError(source, f"node_selector.{str(key)[:64]}",
                                   "is not a label key")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ModelConfigError(source, f"node_selector.{key}", "must be a string")
        clean_selector[key] = str(value)
    description = data.get("description") or ""
    if not isinstance(description, str):
        raise ModelConfigError(source, "description", "must be a string")
    try:
        functions = FunctionConfig.from_yaml(data.get("function"), warnings)
    except FunctionConfigError as e:
        raise ModelConfigError(source, e.field, e.problem) from None
    try:
        overrides = read_overrides(data.get("capabilities"))
    except ValueError as e:
        raise ModelConfigError(source, "capabilities", str(e)) from None
    lifecycle = {}
    for key in ("pinned", "preload"):
        value = data.get(key)
        if value is not None and not isinstance(value, bool):
            raise ModelConfigError(source, key, "must be true or false")
        lifecycle[key] = bool(value)
    lifecycle["memory_bytes"] = _memory_bytes(source, data.get("memory_bytes"))
    route_policy = data.get("route_policy") or ""
    if route_policy not in ("", "round_robin", "prefix_cache"):
        raise ModelConfigError(source, "route_policy", "must be round_robin or prefix_cache")
    lifecycle["route_policy"] = route_policy
    return ModelConfig(name=name, backend=backend, model=model, files=tuple(files),
                       parameters=defaults, template=template, context_size=context_size,
                       embeddings=embeddings, options=tuple(options),
                       node_selector=clean_selector, description=description[:1024],
                       source=source, known_usecases=known, roles=dict(roles),
                       system_prompt=system_prompt, model_options=model_options,
                       predict_options=predict_options, warnings=_bounded(warnings),
                       functions=functions, capabilities=overrides,
                       downloads=tuple(downloads), guesses=tuple(guesses), **lifecycle)


#: Backends whose configs get LocalAI's GGUF guesses (``core/config/hooks_llamacpp.go``
#: registers them for ``llama-cpp`` and for a config naming no backend).
GGUF_BACKEND = "llama-cpp"
#: LocalAI's ``HasTemplate``: any of these set means the config chose its own template.
_TEMPLATE_CHOICES = ("chat", "chat_message", "completion", "edit", "use_tokenizer_template")
#: Use cases LocalAI reserves for non-chat primitives (``reservedNonChatModel``).
_RESERVED_NON_CHAT = ("score", "token_classify")


def _guess_backend(parameters: Any, top_model: Any) -> str | None:
    """LocalAI's default for a config with no ``backend``: a ``.gguf`` model file is served
    by llama.cpp.  Anything else is not guessed (LocalAI would try every backend in turn;
    here the config must say)."""
    model = parameters.get("model") if isinstance(parameters, dict) else None
    if model is None:
        model = top_model
    if isinstance(model, str) and model.split("?", 1)[0].lower().endswith(".gguf"):
        return GGUF_BACKEND
    return None


def _guesses_tokenizer_template(backend: str, template_raw: Mapping[str, Any],
                                known: tuple[str, ...] | None) -> bool:
    """Whether the model's own chat template is used because the config has none: LocalAI
    (``core/config/gguf.go``) sets ``use_tokenizer_template`` for a ``llama-cpp`` config
    without a template, unless ``known_usecases`` reserves it for scoring or token
    classification."""
    if backend != GGUF_BACKEND:
        return False
    if any(template_raw.get(key) for key in _TEMPLATE_CHOICES):
        return False
    return not (known and any(u in _RESERVED_NON_CHAT for u in known))


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def _memory_bytes(source: str, raw) -> int:
    """``memory_bytes``: a whole number of bytes, or a size such as ``512M``, ``1.5GiB``."""
    if raw is None:
        return 0
    if isinstance(raw, bool):
        raise ModelConfigError(source, "memory_bytes", "must be a size (bytes, or 512M, 2G)")
    if isinstance(raw, int):
        size = raw
    else:
        match = _SIZE_RE.match(raw) if isinstance(raw, str) else None
        if match is None:
            raise ModelConfigError(source, "memory_bytes", "must be a size (bytes, or 512M, 2G)")
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if not 0 <= size <= 1 << 50:
        raise ModelConfigError(source, "memory_bytes", "must be between 0 and 1 PiB")
    return size


def _looks_like_url(value: str) -> bool:
    """LocalAI's ``LooksLikeURL`` plus ``file://`` and the schemes refused here (so a refused
    one is named instead of being taken for a file name)."""
    return value.startswith(DOWNLOAD_SCHEMES + REFUSED_SCHEMES)


def _check_scheme(source: str, fieldname: str, uri: str) -> None:
    if not uri.startswith(DOWNLOAD_SCHEMES):
        scheme = "hf.co/" if uri.startswith("hf.co/") else uri.split("://", 1)[0][:32] + "://"
        raise ModelConfigError(source, fieldname, f"{scheme} URLs are not downloaded by "
                               "localai-tw (file://, http://, https://, huggingface://, hf://, "
                               "github: are); put the file in the models directory instead")
    if len(uri) > 4096 or any(ord(c) < 0x21 or ord(c) == 0x7F for c in uri):
        raise ModelConfigError(source, fieldname, "is not a usable URL (spaces, control "
                               "characters, or longer than 4096)")


def _filename_from_url(uri: str) -> str:
    """The file name LocalAI gives a URL ``parameters.model``: the last path segment (what
    follows ``@`` dropped), else the MD5 of the URL."""
    import hashlib
    from urllib.parse import unquote, urlsplit

    base = posixpath.basename(unquote(urlsplit(uri.split("@", 1)[0]).path))
    if not base or base in (".", "..") or "\\" in base or "\x00" in base or len(base) > 200:
        return hashlib.md5(uri.encode("utf-8")).hexdigest()  # a name, not security
    return base


def _downloads(source: str, raw) -> list[ModelDownload]:
    """LocalAI's ``download_files``: a list of ``{filename, uri, sha256}``."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_DOWNLOADS:
        raise ModelConfigError(source, "download_files", "must be a list of {filename, uri, "
                               f"sha256}} (at most {MAX_DOWNLOADS})")
    out = []
    for i, entry in enumerate(raw):
        where = f"download_files[{i}]"
        if not isinstance(entry, dict):
            raise ModelConfigError(source, where, "must be a mapping with filename, uri, sha256")
        for key in entry:
            if key not in ("filename", "uri", "sha256"):
                raise ModelConfigError(source, f"{where}.{str(key)[:64]}",
                                       "unknown field (filename, uri, sha256)")
        filename = _relative_path(source, f"{where}.filename", entry.get("filename"))
        uri = entry.get("uri")
        if not isinstance(uri, str) or not uri:
            raise ModelConfigError(source, f"{where}.uri", "must be a URL (file://, http://, "
                                   "https://, huggingface://)")
        _check_scheme(source, f"{where}.uri", uri)
        out.append(ModelDownload(filename, uri, _digest(source, f"{where}.sha256",
                                                        entry.get("sha256")), where))
    return out


def _digest(source: str, fieldname: str, digest) -> str | None:
    if digest is None or digest == "":
        return None
    if isinstance(digest, int) and not isinstance(digest, bool):
        raise ModelConfigError(source, fieldname, "was read as a number; quote it (an "
                               "all-digit hash loses its leading zeros)")
    if not isinstance(digest, str) or not _SHA256_RE.match(digest.lower()):
        raise ModelConfigError(source, fieldname, "must be 64 hex digits")
    return digest.lower()


def _bounded(warnings: list[str]) -> tuple[str, ...]:
    """At most ``MAX_WARNINGS`` lines a file can make the log carry, then a count."""
    if len(warnings) <= MAX_WARNINGS:
        return tuple(warnings)
    return (*warnings[:MAX_WARNINGS], f"... and {len(warnings) - MAX_WARNINGS} more ignored keys")


def is_model_name(name: str) -> bool:
    """LocalAI's names, non-ASCII included (piper's voices), kept safe as file names: printable,
    no path separator or NUL, no leading dot, at most ``MAX_NAME`` bytes in UTF-8."""
    return (0 < len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME and name.isprintable()
            and not name.startswith(".") and name.strip() == name
            and not any(c in name for c in "/\\\x00"))


def _known_usecases(source: str, raw) -> tuple[str, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(u, str) for u in raw) or \
            len(raw) > MAX_USECASES:
        raise ModelConfigError(source, "known_usecases", "must be a list of names such as "
                               f"chat, completion, embeddings (at most {MAX_USECASES})")
    names = []
    for item in raw:
        name = item.strip().lower()
        name = name[len("flag_"):] if name.startswith("flag_") else name
        if not _USECASE_RE.match(name):
            raise ModelConfigError(source, "known_usecases",
                                   f"{item[:64]!r} is not a use-case name")
        names.append(name)
    return tuple(dict.fromkeys(names))
