"""``/api/embed`` (``input``: a text or a list of texts; vectors L2-normalised, as Ollama
answers them) and the older ``/api/embeddings`` (``prompt``: one text; the vector as the model
gives it), run by the same code as ``/v1/embeddings``
(:func:`~localai_tw.frontend.api.openai.embeddings.embed_items`).

What this module must never do: truncate an input (``truncate: true`` is refused: an input
longer than the model's context fails with the backend's error), or accept more inputs than
``/v1/embeddings`` does.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from localai_tw.localai.usecases import EMBEDDINGS
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.embeddings import embed_items
from localai_tw.frontend.api.openai.requests import MAX_EMBEDDING_INPUTS, Fields, resolve_model
from localai_tw.frontend.api.openai.responses import Exchange
from localai_tw.frontend.api.ollama.chat import Timing
from localai_tw.frontend.api.ollama.translate import Refused, check_keep_alive, model_name

EMBED_FIELDS = frozenset({"model", "input", "truncate", "options", "keep_alive", "dimensions"})
EMBEDDINGS_FIELDS = frozenset({"model", "prompt", "options", "keep_alive"})


def _check(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for key in body:
        if key not in known:
            raise Refused(f"'{str(key)[:80]}' is not a field of this endpoint")
    check_keep_alive(body.get("keep_alive"))
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise Refused("'options' must be an object")
    if options:  # nothing samples in an embedding; load-time settings are the config's
        raise Refused(f"'options.{str(next(iter(options)))[:80]}' is not supported on an "
                      "embedding request; send it without options")


def _resolve(context: Context, exchange: Exchange, body: Mapping[str, Any]):
    name = model_name(body.get("model"), lambda n: context.router.model(n) is not None)
    name, model = resolve_model(context.router, Fields({"model": name}), EMBEDDINGS)
    exchange.record.model = name
    return name, model


def _normalised(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else list(vector)


async def answer_embed(context: Context, exchange: Exchange, body: Mapping[str, Any]) -> None:
    """``POST /api/embed``."""
    timing = Timing(context)
    _check(body, EMBED_FIELDS)
    if body.get("truncate") not in (None, False):
        raise Refused("'truncate' is not supported: this server never truncates an input "
                      "(one longer than the model's context is an error); send truncate: "
                      "false or leave it out")
    if body.get("dimensions") is not None:
        raise Refused("'dimensions' is not supported: the model decides the vector size")
    raw = body.get("input")
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and all(isinstance(item, str) for item in raw):
        inputs = list(raw)
    else:
        raise Refused("'input' must be a string or a list of strings")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise Refused(f"at most {MAX_EMBEDDING_INPUTS} inputs are accepted")
    if any(not item for item in inputs):
        raise Refused("an embedding input must not be empty")
    name, model = _resolve(context, exchange, body)
    vectors, prompt_tokens = await embed_items(context, exchange, name, model, inputs) \
        if inputs else ([], 0)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0}
    exchange.record.usage(usage)
    durations = timing.durations(usage)
    exchange.send_json(200, {"model": body.get("model"),
                             "embeddings": [_normalised(v) for v in vectors],
                             "total_duration": durations["total_duration"],
                             "load_duration": 0, "prompt_eval_count": prompt_tokens})


async def answer_embeddings(context: Context, exchange: Exchange,
                            body: Mapping[str, Any]) -> None:
    """``POST /api/embeddings`` (Ollama's older route)."""
    _check(body, EMBEDDINGS_FIELDS)
    prompt = body.get("prompt")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise Refused("'prompt' must be a string")
    name, model = _resolve(context, exchange, body)
    if not prompt:  # Ollama answers an empty vector to an empty prompt
        exchange.send_json(200, {"embedding": []})
        return
    vectors, prompt_tokens = await embed_items(context, exchange, name, model, [prompt])
    exchange.record.usage({"prompt_tokens": prompt_tokens, "completion_tokens": 0})
    exchange.send_json(200, {"embedding": vectors[0]})
