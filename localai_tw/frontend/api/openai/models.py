"""``GET /v1/models`` and ``GET /v1/models/{id}``: the configured models (the YAML files in
``--models-dir``), and under an extra ``errors`` key the files that failed to load.

What this module must never do: call a backend or load a model, or pass a config's load error
on unbounded.
"""

from __future__ import annotations

from typing import Any

from localai_tw.frontend.api.kit import printable
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import error_for
from localai_tw.frontend.api.openai.requests import config_value, missing_model
from localai_tw.frontend.api.openai.responses import Exchange


async def answer_list(context: Context, request, exchange: Exchange) -> None:
    """``GET /v1/models``: the configured models, and the config files that failed to load."""
    router = context.router
    data = [_model_entry(config) for config in router.models()]
    listing: dict[str, Any] = {"object": "list", "data": data}
    errors = getattr(router, "model_errors", dict)()  # optional in IInferenceRouter
    if errors:  # an extra key OpenAI clients ignore; operators see what failed and why
        listing["errors"] = [{"id": name, "error": printable(reason, 1024)}
                             for name, reason in sorted(errors.items())]
    exchange.send_json(200, listing)


async def answer_one(context: Context, request, exchange: Exchange, name: str) -> None:
    """``GET /v1/models/{id}``."""
    router = context.router
    config = router.model(name)
    if config is None:
        raise error_for(missing_model(router, name))
    exchange.send_json(200, _model_entry(config))


def _model_entry(config: Any) -> dict:
    return {"id": str(config_value(config, "name", "")), "object": "model", "created": 0,
            "owned_by": "localai-tw"}
