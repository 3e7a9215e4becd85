"""What a model's backend honours beyond plain generation, in one place, so a request that needs
more is refused with a 400 naming the model before any backend is called (never sent and
silently ignored):

- ``grammar``: it samples under ``PredictOptions.Grammar`` (GBNF): JSON mode, JSON schema,
  ``tool_choice: required`` / a named function, and ``auto`` with LocalAI's no-action function;
- ``tools``: with ``use_tokenizer_template`` it renders ``PredictOptions.Tools`` through the
  model's own chat template (without it the frontend renders tools itself, through the
  config's ``template.function``);
- ``logprobs``: it fills ``Reply.logprobs`` when ``PredictOptions.Logprobs`` is set.

:data:`BACKENDS` holds what this project knows of the built-in backends and of LocalAI's own
backends of the same names.  A model config may say otherwise for its model with
``capabilities: {grammar: true, tools: true, logprobs: true}`` (an ``external`` backend that
runs LocalAI's ``llama-cpp``, for one), and ``function.grammar.disable: true`` turns grammar
off as LocalAI reads it.  The table is ``docs/openai-api.md``'s "What each backend honours".

A name's claim is the built-in's: a worker whose LocalAI backends directory holds a program of
that name runs that one instead, so what the answer can tell is checked against it as well
(``frontend/inference/honoured.py``: log probabilities).

What this module must never do: guess a capability for a backend it does not know (unknown is
"no", so the request is refused, not ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

NAMES = ("grammar", "tools", "logprobs")


@dataclass(frozen=True)
class Capabilities:
    grammar: bool = False
    tools: bool = False
    logprobs: bool = False


#: Backend name -> what it honours (a backend not listed honours none of them).
BACKENDS: dict[str, Capabilities] = {
    # the built-in llama.cpp backend, and LocalAI's: GBNF grammars, the GGUF's chat template
    # with tools, log probabilities
    "llama-cpp": Capabilities(grammar=True, tools=True, logprobs=True),
    # the built-in transformers backend: the tokenizer's chat template takes tools=, and
    # log probabilities come from the generation's logits; no grammar
    "transformers": Capabilities(tools=True, logprobs=True),
}


def read_overrides(raw: Any) -> dict[str, bool]:
    """A config's ``capabilities`` mapping, checked.  :raises ValueError: naming the key."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError("must be a mapping of grammar, tools, logprobs to true or false")
    out = {}
    for key, value in raw.items():
        if key not in NAMES:
            raise ValueError(f"{str(key)[:64]!r} is not a capability ({', '.join(NAMES)})")
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false")
        out[key] = value
    return out


def capabilities_of(backend: str, overrides: Mapping[str, bool] | None = None, *,
                    grammar_disabled: bool = False) -> Capabilities:
    """What a model on ``backend`` honours, after its config's ``capabilities`` overrides and
    ``function.grammar.disable``."""
    found = replace(BACKENDS.get(backend, Capabilities()), **dict(overrides or {}))
    if grammar_disabled:
        found = replace(found, grammar=False)
    return found


__all__ = ["BACKENDS", "Capabilities", "capabilities_of", "read_overrides"]
