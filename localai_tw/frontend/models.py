"""Model configs: one YAML file per model in the models directory, LocalAI style.

A file ``<models-dir>/<anything>.yaml`` (or ``.yml``) describes one model::

    name: tiny-echo                 # required; what clients put in "model"
    backend: echo                   # required; a backend the workers know
    parameters:
      model: tiny.bin               # file (relative to the models dir) or identifier
      temperature: 0.2              # defaults for requests (the API layer merges them)
      top_p: 0.9
      max_tokens: 64
      stop: ["</s>"]
    files:                          # staged on the worker before LoadModel
      - path: tiny.bin              # relative to the models dir, inside it
        sha256: 9f86d0...           # optional; checked before staging when given
        key: models/tiny-echo/tiny.bin   # optional worker key (default models/<name>/<basename>)
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

Validation errors name the file and the field (``models/tiny.yaml: files[0].path: ...``); an
invalid file is skipped (and logged once per change), never fatal to the others.  Two files
with the same ``name``: the first by file name wins and the other is reported.

What a model is for (:func:`usecases`), decided from the config alone so that a request the
model cannot serve is refused before any backend is called:

1. ``known_usecases`` when given (LocalAI's key; ``chat``, ``completion``, ``embeddings``, other
   LocalAI names are kept and serve no endpoint here; a ``FLAG_`` prefix is dropped);
2. else ``embeddings: true`` makes it an embeddings model: ``embeddings`` only;
3. else what its backend is known to do (:data:`BACKEND_USECASES`): ``transformers`` chat and
   completion, ``sentence-transformers`` embeddings, ``echo`` all three; a backend not in the
   table (``external``, plugins) is asked for anything and answers for itself.

Reloading: :class:`ModelCatalog` re-reads on access at most every ``check_interval`` seconds,
and then only the files whose (mtime, size) changed; the directory is listed with
``os.scandir`` (one stat per file, no reads).  That is small, local, bounded work (at most
``MAX_FILES`` files of at most ``MAX_FILE_BYTES`` each), done on the caller's thread.

What this module must never do: read a file bigger than ``MAX_FILE_BYTES``; accept a file path
that leaves the models directory (``..``, absolute paths, symlinks out); execute anything from
YAML (``yaml.safe_load`` only); raise from :meth:`ModelCatalog.models` because of a bad file.
"""

from __future__ import annotations

import os
import posixpath
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml
from twisted.logger import Logger

log = Logger()

MAX_FILE_BYTES = 256 * 1024
MAX_FILES = 2000
MAX_NAME = 255
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_BACKEND_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_USECASE_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
MAX_USECASES = 32

CHAT, COMPLETION, EMBEDDINGS = "chat", "completion", "embeddings"
ALL_USECASES = frozenset({CHAT, COMPLETION, EMBEDDINGS})
#: What the backends this package knows can be asked for when a config says nothing
#: (``embeddings: true`` or ``known_usecases`` take precedence; see the module docstring).
BACKEND_USECASES: dict[str, frozenset[str]] = {
    "echo": ALL_USECASES,
    "transformers": frozenset({CHAT, COMPLETION}),
    "sentence-transformers": frozenset({EMBEDDINGS}),
}

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
TEMPLATE_FIELDS = ("chat", "chat_message", "completion", "use_tokenizer_template")
TOP_LEVEL_FIELDS = frozenset({
    "name", "backend", "model", "parameters", "files", "template", "context_size",
    "embeddings", "options", "node_selector", "description", "known_usecases", "usage",
})


class ModelConfigError(ValueError):
    """A model file is invalid.  ``str()`` names the file and the field."""

    def __init__(self, source: str, field_name: str | None, problem: str):
        self.source = source
        self.field = field_name
        self.problem = problem
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
                             f"(a symbolic link?); model files must lie inside {models_dir}")
        return real


@dataclass(frozen=True)
class ModelTemplate:
    chat: str = ""
    chat_message: str = ""
    completion: str = ""
    use_tokenizer_template: bool = False


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


def parse_model_config(data: Any, source: str = "<config>") -> ModelConfig:
    """Validate one decoded YAML document.  :raises ModelConfigError:"""
    if not isinstance(data, dict):
        raise ModelConfigError(source, None, "the file must hold a YAML mapping")
    for key in data:
        if key not in TOP_LEVEL_FIELDS:
            raise ModelConfigError(source, str(key)[:64],
                                   f"unknown field; expected one of {', '.join(sorted(TOP_LEVEL_FIELDS))}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ModelConfigError(source, "name", "is required (a non-empty string)")
    if len(name) > MAX_NAME or not _NAME_RE.match(name) or ".." in name:
        raise ModelConfigError(source, "name", "may hold letters, digits and ._:@+/- "
                               f"(at most {MAX_NAME}, no '..')")
    backend = data.get("backend")
    if not isinstance(backend, str) or not _BACKEND_RE.match(backend or ""):
        raise ModelConfigError(source, "backend", "is required (a backend name such as echo)")

    parameters = data.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ModelConfigError(source, "parameters", "must be a mapping")
    model = parameters.get("model", data.get("model"))
    if model is None:
        model = name
    if not isinstance(model, str) or not model or len(model) > 1024:
        raise ModelConfigError(source, "parameters.model", "must be a non-empty string")
    defaults: dict[str, Any] = {}
    for key, value in parameters.items():
        if key == "model":
            continue
        types = PARAMETER_TYPES.get(key)
        if types is None:
            raise ModelConfigError(source, f"parameters.{key}",
                                   f"unknown parameter; expected one of {', '.join(sorted(PARAMETER_TYPES))}")
        if isinstance(value, bool) or not isinstance(value, types):
            raise ModelConfigError(source, f"parameters.{key}",
                                   f"must be {' or '.join(t.__name__ for t in types)}")
        if key == "stop" and isinstance(value, list) and not all(isinstance(s, str) for s in value):
            raise ModelConfigError(source, "parameters.stop", "must be strings")
        defaults[key] = value

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
    for key, value in template_raw.items():
        if key not in TEMPLATE_FIELDS:
            raise ModelConfigError(source, f"template.{key}",
                                   f"unknown field; expected one of {', '.join(TEMPLATE_FIELDS)}")
        expected = bool if key == "use_tokenizer_template" else str
        if not isinstance(value, expected):
            raise ModelConfigError(source, f"template.{key}", f"must be a {expected.__name__}")
    template = ModelTemplate(**template_raw)

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
    known = _known_usecases(source, data.get("known_usecases"))
    return ModelConfig(name=name, backend=backend, model=model, files=tuple(files),
                       parameters=defaults, template=template, context_size=context_size,
                       embeddings=embeddings, options=tuple(options),
                       node_selector=clean_selector, description=description[:1024],
                       source=source, known_usecases=known)


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


def usecases(config: ModelConfig) -> frozenset[str]:
    """What ``config`` may be asked for (the rule of the module docstring)."""
    if config.known_usecases is not None:
        return frozenset(config.known_usecases)
    if config.embeddings:
        return frozenset({EMBEDDINGS})
    return BACKEND_USECASES.get(config.backend, ALL_USECASES)


def load_model_file(path: str, source: str | None = None) -> ModelConfig:
    """Read and validate one YAML file.  :raises ModelConfigError:"""
    source = source or path
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ModelConfigError(source, None, f"cannot be read: {e.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ModelConfigError(source, None, f"is larger than {MAX_FILE_BYTES} bytes")
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ModelConfigError(source, None, f"is not valid YAML{where}") from None
    except RecursionError:
        # PyYAML's composer recurses once per level: a file nested thousands deep exhausts the
        # stack.  A failure like any other, remembered by the catalog until the file changes.
        raise ModelConfigError(source, None, "nests too deeply to be a model config") from None
    try:
        return parse_model_config(data, source)
    except RecursionError:
        raise ModelConfigError(source, None, "nests too deeply to be a model config") from None


# -- the catalog ------------------------------------------------------------------------------


@dataclass
class _Entry:
    stamp: tuple[int, int]
    config: ModelConfig | None
    error: ModelConfigError | None


class ModelCatalog:
    """The model configs of one directory, re-read when files change (see the module
    docstring).  ``clock`` is ``time.monotonic`` unless given (tests)."""

    def __init__(self, models_dir: str, *, check_interval: float = 1.0, clock=time.monotonic):
        self.models_dir = os.path.abspath(models_dir)
        self._interval = check_interval
        self._clock = clock
        self._checked_at: float | None = None
        self._entries: dict[str, _Entry] = {}
        self._by_name: dict[str, ModelConfig] = {}
        self.errors: dict[str, str] = {}

    def models(self) -> list[ModelConfig]:
        self._refresh()
        return [self._by_name[n] for n in sorted(self._by_name)]

    def get(self, name: str) -> ModelConfig | None:
        self._refresh()
        return self._by_name.get(name)

    def refresh(self) -> None:
        """Re-scan now, whatever the interval."""
        self._checked_at = None
        self._refresh()

    def _refresh(self) -> None:
        now = self._clock()
        if self._checked_at is not None and now - self._checked_at < self._interval:
            return
        self._checked_at = now
        seen: dict[str, tuple[int, int]] = {}
        try:
            with os.scandir(self.models_dir) as listing:
                for entry in listing:
                    if not entry.name.endswith((".yaml", ".yml")) or entry.name.startswith("."):
                        continue
                    try:
                        if not entry.is_file():
                            continue
                        st = entry.stat()
                    except OSError:
                        continue
                    seen[entry.name] = (st.st_mtime_ns, st.st_size)
                    if len(seen) >= MAX_FILES:
                        log.warn("models directory {dir} holds more than {n} YAML files; the "
                                 "rest are ignored", dir=self.models_dir, n=MAX_FILES)
                        break
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warn("cannot list models directory {dir}: {err}", dir=self.models_dir, err=e)
            return
        changed = set(seen) ^ set(self._entries)
        for fname, stamp in seen.items():
            old = self._entries.get(fname)
            if old is None or old.stamp != stamp:
                changed.add(fname)
                try:
                    cfg = load_model_file(os.path.join(self.models_dir, fname), fname)
                    self._entries[fname] = _Entry(stamp, cfg, None)
                except ModelConfigError as e:
                    self._entries[fname] = _Entry(stamp, None, e)
                    log.warn("model config skipped: {err}", err=str(e))
        for fname in list(self._entries):
            if fname not in seen:
                del self._entries[fname]
        if not changed:
            return
        by_name: dict[str, ModelConfig] = {}
        errors: dict[str, str] = {}
        for fname in sorted(self._entries):
            entry = self._entries[fname]
            if entry.error is not None:
                errors[fname] = str(entry.error)
                continue
            cfg = entry.config
            if cfg.name in by_name:
                msg = (f"{fname}: name: model {cfg.name!r} is already defined by "
                       f"{by_name[cfg.name].source}; this file is ignored")
                if self.errors.get(fname) != msg:
                    log.warn("{msg}", msg=msg)
                errors[fname] = msg
                continue
            by_name[cfg.name] = cfg
        self._by_name = by_name
        self.errors = errors
