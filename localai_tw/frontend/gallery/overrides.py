"""Which ``overrides`` a ``POST /models/apply`` request may write into a model config.

A request's overrides are merged into the config the replica writes and every worker loads,
so a key there is as strong as the operator's own YAML: ``backend``, ``download_files``,
``parameters.model`` (a URL fetched by the replica), ``trust_remote_code``,
``node_selector``, ``options``... would let an API-key holder choose what is fetched, where
it runs and what code a worker executes (issue 21 §2).  Only the harmless keys below are
accepted; a gallery entry's own ``overrides`` (the operator's index) are not restricted.
"""

from __future__ import annotations

import json
from typing import Any

#: The largest accepted ``overrides`` object, as compact JSON.
MAX_OVERRIDES_JSON = 16 * 1024

#: ``parameters`` keys a request may set: sampling defaults, nothing that names a file.
PARAMETER_KEYS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop",
    "repeat_penalty", "presence_penalty", "frequency_penalty", "repeat_last_n",
    "typical_p", "tfz",
})
#: Top-level keys a request may set (``parameters`` restricted to :data:`PARAMETER_KEYS`).
TOP_LEVEL_KEYS = frozenset({
    "parameters", "template", "context_size", "description", "known_usecases",
    "stopwords", "mirostat", "mirostat_eta", "mirostat_tau",
})


class RefusedOverride(ValueError):
    """An override a request may not set; ``field`` is its dotted path."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_request_overrides(overrides: Any) -> dict:
    """``overrides`` if every key is in the allow-list and it is small enough.

    :raises RefusedOverride: naming the first refused key and what is accepted instead."""
    if not isinstance(overrides, dict):
        raise RefusedOverride("overrides", "'overrides' must be an object")
    try:
        size = len(json.dumps(overrides, separators=(",", ":")).encode("utf-8"))
    except (TypeError, ValueError):
        raise RefusedOverride("overrides", "'overrides' must be plain JSON") from None
    if size > MAX_OVERRIDES_JSON:
        raise RefusedOverride("overrides", f"'overrides' is {size} bytes as JSON; at most "
                              f"{MAX_OVERRIDES_JSON} are accepted")
    for key, value in overrides.items():
        if key not in TOP_LEVEL_KEYS:
            raise RefusedOverride(f"overrides.{str(key)[:64]}", _refused(str(key)[:64],
                                                                         TOP_LEVEL_KEYS))
        if key == "parameters":
            if not isinstance(value, dict):
                raise RefusedOverride("overrides.parameters",
                                      "'overrides.parameters' must be an object")
            for name in value:
                if name not in PARAMETER_KEYS:
                    shown = f"parameters.{str(name)[:64]}"
                    raise RefusedOverride(f"overrides.{shown}", _refused(shown, PARAMETER_KEYS))
    return overrides


def _refused(key: str, accepted: frozenset) -> str:
    return (f"'overrides.{key}' cannot be set by a request: only {', '.join(sorted(accepted))} "
            "are accepted (other keys belong in the gallery entry, which the operator "
            "configures; see docs/models.md)")
