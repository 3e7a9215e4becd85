"""What Ollama clients ask about models: ``/api/tags`` (the configured models), ``/api/show``
(one model's details, template, parameters and capabilities), ``/api/ps`` (the models loaded
somewhere in the cluster) and ``/api/version``, built from the model configs the router reads
and, for ``/api/ps``, a read of the loaded models the caller hands in.

What this module must never do: call a backend or load a model, read a model's files, or show
a path of the replica's disk (a config's model file is named relative to the models
directory).
"""

from __future__ import annotations

import datetime
from typing import Any, Iterable

from localai_tw.localai.usecases import CHAT, COMPLETION, EMBEDDINGS, usecases
from localai_tw.frontend.api.ollama.translate import display_name

#: The Ollama API level these routes speak (the release whose docs/api.md they follow).
OLLAMA_API_VERSION = "0.9.0"
#: ``modified_at`` of every model: this server does not track when a config changed.
EPOCH = "1970-01-01T00:00:00Z"

#: Ollama's capability names, from the use cases LocalAI decides for a model.
_CAPABILITIES = ((CHAT, "completion"), (COMPLETION, "completion"), (EMBEDDINGS, "embedding"))


def iso(seconds: float) -> str:
    """A wall-clock time as Ollama writes ``created_at`` (UTC, RFC 3339)."""
    stamp = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return stamp.isoformat().replace("+00:00", "Z")


def _get(config: Any, name: str, default=None):
    value = config.get(name, default) if isinstance(config, dict) else \
        getattr(config, name, default)
    return default if value is None else value


def _digest(config: Any) -> str:
    files = _get(config, "files", ()) or ()
    for entry in files:
        sha = getattr(entry, "sha256", None)
        if sha:
            return sha
    return ""


def details(config: Any) -> dict:
    backend = str(_get(config, "backend", "") or "")
    model_file = str(_get(config, "model", "") or "")
    return {"parent_model": "", "format": "gguf" if model_file.lower().endswith(".gguf")
            else backend, "family": backend, "families": [backend] if backend else None,
            "parameter_size": "", "quantization_level": ""}


def capabilities(config: Any) -> list[str]:
    try:
        cases = usecases(config)
    except Exception:  # a plain mapping (tests) or a config usecases cannot read
        cases = frozenset()
    out: list[str] = []
    for case, name in _CAPABILITIES:
        if case in cases and name not in out:
            out.append(name)
    if CHAT in cases:  # the turn plans a grammar or reads calls out of the text
        out.append("tools")
    return out


def tag(config: Any) -> dict:
    """One model of ``/api/tags``."""
    name = display_name(str(_get(config, "name", "")))
    return {"name": name, "model": name, "modified_at": EPOCH, "size": 0,
            "digest": _digest(config), "details": details(config)}


def tags(configs: Iterable[Any]) -> dict:
    return {"models": [tag(config) for config in configs]}


def show(config: Any) -> dict:
    """``/api/show`` of one model: what its config says."""
    template = _get(config, "template")
    chat = str(_get(template, "chat", "") or "") if template is not None else ""
    parameters = _get(config, "parameters", {}) or {}
    lines = []
    for key in sorted(parameters):
        value = parameters[key]
        if key != "model" and isinstance(value, (int, float, str)) and \
                not isinstance(value, bool):
            lines.append(f"{key} {value}")
    context = int(_get(config, "context_size", 0) or 0)
    info: dict[str, Any] = {"general.architecture": str(_get(config, "backend", "") or "")}
    if context:
        info["general.context_length"] = context
    return {"modelfile": "", "parameters": "\n".join(lines), "template": chat,
            "system": str(_get(config, "system_prompt", "") or ""),
            "details": details(config), "model_info": info,
            "capabilities": capabilities(config), "modified_at": EPOCH,
            "license": ""}


def running(configs: dict[str, Any], loaded: Iterable[str]) -> dict:
    """``/api/ps``: the names of the models loaded on some node (no ``expires_at``: the idle
    watchdog and eviction decide when, not a deadline set per request); a model no longer
    configured is listed by its name alone."""
    models = []
    for name in loaded:
        config = configs.get(name)
        shown = display_name(name)
        entry = {"name": shown, "model": shown, "size": 0, "size_vram": 0,
                 "digest": _digest(config) if config is not None else "",
                 "details": details(config) if config is not None else {}}
        context = int(_get(config, "context_size", 0) or 0) if config is not None else 0
        if context:
            entry["context_length"] = context
        models.append(entry)
    return {"models": models}


def version() -> dict:
    return {"version": OLLAMA_API_VERSION}
