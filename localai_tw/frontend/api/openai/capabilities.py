"""``GET /v1/models/capabilities``: LocalAI's extension of ``/v1/models``, the same models each
with what it can do (``capabilities``) and the modalities it takes and gives
(``input_modalities``, ``output_modalities``), so a client can pick a model for a call, or an
attachment, before making it.

Decided from the config alone, by LocalAI's rule (``localai.usecases``: ``known_usecases`` plus
what the config's backend, templates and ``embeddings`` suggest).  The list picks and shows;
no endpoint refuses a model missing from it (the backend answers what it cannot do).  Names are LocalAI's use-case
names in LocalAI's order (``core/config/model_capabilities.go`` at 82c191a): ``chat``,
``completion``, ``embeddings``, ``rerank``, ``transcript``, ``tts``, ``image`` ...; a name this
table does not know (a future use case) follows them, sorted.  ``tokenize`` is guessed when the
backend is one whose ``TokenizeString`` and ``Detokenize`` ship here (:data:`TOKENIZING_BACKENDS`);
any model may still be asked ``/v1/tokenize`` (its backend answers for itself).

What this module must never do: call a backend or load a model.
"""

from __future__ import annotations

from typing import Any

from localai_tw.localai.usecases import usecases
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.requests import config_value
from localai_tw.frontend.api.openai.responses import Exchange

#: LocalAI's capability names, in the order it lists them.
ORDER = ("chat", "completion", "edit", "embeddings", "rerank", "tokenize", "vision", "tools",
         "thinking", "transcript", "tts", "sound_generation", "image", "video", "3d", "vad",
         "detection", "depth", "audio_transform", "diarization", "sound_classification",
         "realtime_audio", "face_recognition", "speaker_recognition")
#: Built-in backends whose ``TokenizeString`` and ``Detokenize`` ship in this package.
TOKENIZING_BACKENDS = frozenset({"transformers", "sentence-transformers", "bert-numpy", "echo",
                                 "llama-cpp"})

#: Modalities, in LocalAI's order, and the use cases that take / give each.
MODALITIES = ("text", "image", "audio", "video", "3d")
_INPUT = {
    "text": {"chat", "completion", "edit", "embeddings", "rerank", "tokenize", "tts",
             "sound_generation", "image", "video"},
    "image": {"vision", "detection", "depth", "face_recognition", "3d"},
    "audio": {"transcript", "audio_transform", "realtime_audio", "vad", "diarization",
              "sound_classification", "speaker_recognition"},
}
_OUTPUT = {
    "text": {"chat", "completion", "edit", "transcript"},
    "image": {"image"},
    "audio": {"tts", "sound_generation", "audio_transform", "realtime_audio"},
    "video": {"video"},
    "3d": {"3d"},
}


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``GET /v1/models/capabilities``."""
    data = [model_capabilities(config) for config in context.router.models()]
    exchange.send_json(200, {"object": "list", "data": data})


def capabilities_of(config: Any) -> list[str]:
    """What ``config``'s model can be asked (module docstring), in LocalAI's order."""
    found = set(usecases(config))
    if config_value(config, "backend", "") in TOKENIZING_BACKENDS:
        found.add("tokenize")
    ordered = [name for name in ORDER if name in found]
    return ordered + sorted(found - set(ORDER))


def model_capabilities(config: Any) -> dict:
    """One entry of the listing: ``/v1/models``'s fields and the three lists."""
    names = capabilities_of(config)
    chosen = set(names)
    return {"id": str(config_value(config, "name", "")), "object": "model",
            "capabilities": names,
            "input_modalities": [m for m in MODALITIES if chosen & _INPUT.get(m, set())],
            "output_modalities": [m for m in MODALITIES if chosen & _OUTPUT.get(m, set())]}
