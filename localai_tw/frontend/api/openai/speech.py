"""``POST /v1/audio/speech`` (OpenAI) and ``POST /tts`` (LocalAI; the same request and answer,
as LocalAI serves both with one handler) -> ``TTS`` on a node serving the model, routed like
every other call.  The backend writes a WAV into a scratch directory the serving worker made
(``WorkerScratch``); the bytes come back through the tunnel (at most
:data:`MAX_SPEECH_BYTES`) and are the answer's body, of the content type of its format
(:data:`CONTENT_TYPES`).

Fields: ``model`` (else the first model whose config does ``tts``, as LocalAI picks),
``input`` (required, 1 to :data:`MAX_INPUT_CHARS` characters), ``voice``, ``language``
(LocalAI), ``instructions``, ``speed`` (0.25-4.0, sent as ``params.speed`` as LocalAI does),
``params`` (LocalAI: backend-specific strings), ``backend`` (LocalAI: only the model's own
backend is accepted).  ``response_format``: ``wav`` (the default here, as in LocalAI; OpenAI's
default is mp3), ``mp3``, ``opus`` (Ogg), ``aac`` (ADTS), ``flac`` and ``pcm`` (raw 16-bit
little-endian, 24 kHz mono, as OpenAI's): ffmpeg converts the backend's WAV on the serving
worker (``scratch.convert``; a worker without ffmpeg is a 400 naming it); ``stream: true`` and
``sample_rate`` are refused (400) rather than ignored, and so is ``stream_format: sse``
(``audio``, the whole file, is what is answered).

What this module must never do: call a backend for a request it refused, or answer audio in a
format other than the one it names.
"""

from __future__ import annotations

from localai_tw.backends import backend_pb2

from localai_tw.localai.usecases import TTS
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import invalid
from localai_tw.frontend.api.openai.requests import (
    read_body,
    resolve_model_or_default,
    router_method,
)
from localai_tw.frontend.api.openai.responses import Exchange

#: Longest ``input`` (OpenAI's limit).
MAX_INPUT_CHARS = 4096
#: Largest WAV read back from a worker (about 12 minutes of 22 kHz 16-bit mono).
MAX_SPEECH_BYTES = 32 * 1024 * 1024
#: Most ``params`` entries (LocalAI's backend-specific strings).
MAX_PARAMS = 16
#: Each ``response_format``: its content type (OpenAI's) and the file name offered.
CONTENT_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg", "opus": "audio/ogg",
                 "aac": "audio/aac", "flac": "audio/flac", "pcm": "audio/pcm"}
_FILE_NAMES = {"wav": "speech.wav", "mp3": "speech.mp3", "opus": "speech.ogg",
               "aac": "speech.aac", "flac": "speech.flac", "pcm": "speech.pcm"}


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/audio/speech`` and ``POST /tts``."""
    router = context.router
    body = read_body(request)
    name, _ = resolve_model_or_default(router, body, TTS)
    exchange.record.model = name
    text = body.string("input", required=True, nonempty=True)
    if not text.strip():
        raise invalid("'input' must contain something to say", "input", code="invalid_value")
    if len(text) > MAX_INPUT_CHARS:
        raise invalid(f"'input' is longer than {MAX_INPUT_CHARS} characters", "input",
                      code="invalid_value")
    response_format = body.string("response_format") or "wav"
    if response_format not in CONTENT_TYPES:
        raise invalid(f"response_format {response_format[:32]!r} is not a known audio format; "
                      f"ask for one of {', '.join(CONTENT_TYPES)}", "response_format",
                      code="invalid_value")
    if body.boolean("stream"):
        raise invalid("'stream' is not supported here: send the request without it and read "
                      "the whole file", "stream", code="unsupported_parameter")
    if body.string("stream_format") not in (None, "audio"):
        raise invalid("'stream_format' sse is not supported here: the answer is one body",
                      "stream_format", code="unsupported_parameter")
    if body.has("sample_rate"):
        raise invalid("'sample_rate' is not supported here: the audio comes at the backend's "
                      "rate (pcm: 24 kHz); send the request without it", "sample_rate",
                      code="unsupported_parameter")
    backend = body.string("backend")
    config = router.model(name)
    if backend and config is not None and backend != config.backend:
        raise invalid(f"'backend' {backend[:64]!r} differs from the model's backend; the "
                      "model's config decides its backend", "backend", code="invalid_value")
    params = _params(body)
    speed = body.number("speed", 0.25, 4.0)
    if speed is not None:
        params["speed"] = f"{speed:g}"
    ask = backend_pb2.TTSRequest(text=text, voice=body.string("voice") or "", params=params)
    language = body.string("language")
    if language:
        ask.language = language
    instructions = body.string("instructions")
    if instructions:
        ask.instructions = instructions
    tts = router_method(router, "tts")
    if response_format == "wav":  # a router without conversions is asked as before
        calling = tts(name, ask, MAX_SPEECH_BYTES, context.deadline())
    else:
        calling = tts(name, ask, MAX_SPEECH_BYTES, context.deadline(),
                      response_format=response_format)
    served = await exchange.call(calling)
    exchange.send_bytes(200, served.value, CONTENT_TYPES[response_format],
                        {"Content-Disposition":
                         f'attachment; filename="{_FILE_NAMES[response_format]}"'})


def _params(body) -> dict[str, str]:
    raw = body.mapping("params")
    if raw is None:
        return {}
    if len(raw) > MAX_PARAMS or not all(isinstance(k, str) and isinstance(v, str) and
                                        len(k) <= 64 and len(v) <= 1024
                                        for k, v in raw.items()):
        raise invalid(f"'params' must map at most {MAX_PARAMS} short strings to strings",
                      "params", code="invalid_value")
    return dict(raw)
