"""What a model is for, as LocalAI decides it (``HasUsecases``, ``GuessUsecases``): a list, never
a gate.  It picks defaults (the model of a speech, transcription or image request without
``model``) and fills lists (``/v1/models/capabilities``); no endpoint refuses a request because of
it: the backend serving the model answers what it cannot do.  The list is ``known_usecases``
PLUS what is guessed from the rest of the config (the rules: :mod:`.model_config`'s docstring).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a config is read here, never built
    from localai_tw.localai.model_config import ModelConfig

CHAT, COMPLETION, EMBEDDINGS, RERANK = "chat", "completion", "embeddings", "rerank"
#: LocalAI's FLAG_TTS, FLAG_TRANSCRIPT and FLAG_IMAGE.
TTS, TRANSCRIPT, IMAGE = "tts", "transcript", "image"
ALL_USECASES = frozenset({CHAT, COMPLETION, EMBEDDINGS})
#: Backends whose ``Rerank`` this package ships: an embeddings model on one of them also reranks
#: (bi-encoder cosine in ``bert-numpy`` and ``sentence-transformers``; word overlap in ``echo``).
RERANK_BACKENDS = frozenset({"bert-numpy", "sentence-transformers", "echo"})
#: What the backends this package knows can be asked for when a config says nothing
#: (``embeddings: true`` or ``known_usecases`` take precedence; see the module docstring).
BACKEND_USECASES: dict[str, frozenset[str]] = {
    "echo": ALL_USECASES,
    "transformers": frozenset({CHAT, COMPLETION}),
    "sentence-transformers": frozenset({EMBEDDINGS}),
    # llama.cpp embeds only a model loaded with embeddings: true (rule 1.)
    "llama-cpp": frozenset({CHAT, COMPLETION}),
    "espeak-ng": frozenset({TTS}),
    "pocketsphinx": frozenset({TRANSCRIPT}),
    "hash-image": frozenset({IMAGE}),
    # LocalAI's own backends, as its GuessUsecases names them
    "whisper": frozenset({TRANSCRIPT}),
    "piper": frozenset({TTS}),
    "kokoro": frozenset({TTS}),
    "transformers-musicgen": frozenset({TTS}),
    "stablediffusion": frozenset({IMAGE}),
    "stablediffusion-ggml": frozenset({IMAGE}),
    "diffusers": frozenset({IMAGE}),
    "rerankers": frozenset({RERANK}),
    "silero-vad": frozenset({"vad"}),
}
#: LocalAI's use cases that reserve a model: declared, nothing is guessed on top.
RESERVING_USECASES = frozenset({"score", "token_classify"})


def usecases(config: ModelConfig) -> frozenset[str]:
    """What ``config`` is listed for (the rule of the module docstring): a list that picks
    defaults, never a reason to refuse a request."""
    known = frozenset(config.known_usecases or ())
    if known & RESERVING_USECASES:
        return known
    return known | guessed_usecases(config)


def guessed_usecases(config: ModelConfig) -> frozenset[str]:
    """LocalAI's ``GuessUsecases``: what the config says without ``known_usecases``."""
    if config.embeddings:
        found = frozenset({EMBEDDINGS})
    else:
        found = BACKEND_USECASES.get(config.backend, ALL_USECASES)
        if config.backend == "whisper" and "vad_only" in config.options:
            found = frozenset({"vad"})
        if config.backend == "diffusers" and not config.model_options.get("PipelineType"):
            found = frozenset()
    if (EMBEDDINGS in found and config.backend in RERANK_BACKENDS) or \
            config.model_options.get("Reranking"):
        found |= {RERANK}
    return found
