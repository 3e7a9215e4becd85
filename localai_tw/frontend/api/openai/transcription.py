"""``POST /v1/audio/transcriptions``: OpenAI's (and LocalAI's) transcription endpoint ->
``AudioTranscription`` on a node serving the model, routed like every other call.

The upload: ``multipart/form-data`` with a ``file`` part, at most
:data:`TRANSCRIPTION_MAX_UPLOAD_BYTES` (refused with 413 naming the limit when the headers
announce more, before a body byte is read, and while it arrives when they do not); the body is
spooled to a temporary file as it arrives (``SpooledCappedBody``), the file part is copied out
of it in a thread (:mod:`.multipart`), recognised by its first bytes (:func:`audio_format`: an
unknown format is a 400 and no backend is called), then staged on the serving node's scratch
directory (``WorkerScratch``: streamed from disk, verified) and its worker-local path sent as
``TranscriptRequest.dst``.  A file that is not WAV (mp3, ogg/opus, flac, m4a/aac, webm) is
first converted there by ffmpeg to a 16 kHz mono 16-bit WAV, as LocalAI does (a file ffmpeg
cannot read, or a worker without ffmpeg, is a 400 naming the cause).  The local files go when the request ends.

Fields: ``model`` (else the first model whose config does ``transcript``, as LocalAI picks),
``language``, ``prompt``, ``temperature``, ``timestamp_granularities[]``, ``translate`` and
``diarize`` go to the backend (which refuses what it cannot honour); ``response_format``:
``json`` (default), ``text`` (LocalAI's ``txt`` too), ``srt``, ``vtt``, ``verbose_json``,
``lrc`` (LocalAI's); ``stream: true``, ``include[]``, ``known_speaker_*`` and a
``chunking_strategy`` other than ``auto`` are refused (400).

What this module must never do: read a body it refused, hold the upload in memory, let a
client's file name become a path, or call a backend for a form it could not read.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.internet import threads

from localai_tw.backends import backend_pb2

from localai_tw.localai.usecases import TRANSCRIPT
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import invalid
from localai_tw.frontend.api.openai.multipart import MultipartError, boundary_of, parse_form
from localai_tw.frontend.api.openai.requests import Fields, resolve_model_or_default, router_method
from localai_tw.frontend.api.openai.responses import Exchange

#: Largest upload accepted (OpenAI's limit is 25 MB).
TRANSCRIPTION_MAX_UPLOAD_BYTES = 25 * 1024 * 1024
RESPONSE_FORMATS = ("json", "text", "txt", "srt", "vtt", "verbose_json", "lrc")
#: OpenAI's form fields with a meaning this server cannot honour (refused, never ignored).
REFUSED_FIELDS = ("include[]", "include", "known_speaker_names[]", "known_speaker_names",
                  "known_speaker_references[]", "known_speaker_references")
_NS = 1_000_000_000


def audio_format(head: bytes) -> str | None:
    """The container of an audio file from its first bytes (``wav``, ``flac``, ``ogg``,
    ``aac``, ``mp3``, ``m4a``, ``webm``), or None when it is none of those."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:
        return "aac"  # ADTS: MPEG sync word with layer 0
    if head[:3] == b"ID3" or (len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    if head[4:8] == b"ftyp":
        return "m4a"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    return None


def _parse(content, boundary: bytes, directory: str):
    """Parse the spooled body in a thread, through a descriptor of its own: the reactor closes
    the request's file when the client leaves, which must not pull it from under the parse."""
    spooled = getattr(content, "file", None)
    if spooled is None:  # a body kept in memory (a route without spooling)
        content.seek(0, 0)
        return parse_form(content, boundary, directory)
    with os.fdopen(os.dup(spooled.fileno()), "rb") as source:
        source.seek(0, 0)
        return parse_form(source, boundary, directory)


def _form_flag(value: str | None, name: str) -> bool:
    if value is None or value == "":
        return False
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise invalid(f"{name!r} must be true or false", name, code="invalid_value")


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/audio/transcriptions``."""
    directory = tempfile.mkdtemp(prefix="localai-transcription-")
    try:
        await _answer(context, request, exchange, directory)
    finally:
        await threads.deferToThread(shutil.rmtree, directory, True)


async def _answer(context: Context, request, exchange: Exchange, directory: str) -> None:
    router = context.router
    content = request.content
    try:
        boundary = boundary_of((request.getHeader(b"content-type") or b"").decode("latin-1"))
        if content is None:
            raise MultipartError("the request has no body")
        form = await threads.deferToThread(_parse, content, boundary, directory)
    except MultipartError as e:
        raise invalid(f"the form cannot be read: {e}", e.param,
                      code="invalid_multipart") from None
    fields = Fields({k: v[-1] for k, v in form.fields.items()})
    name, _ = resolve_model_or_default(router, fields, TRANSCRIPT)
    exchange.record.model = name
    if _form_flag(form.value("stream"), "stream"):
        raise invalid("'stream' is not supported here: send the request without it and read "
                      "the whole answer", "stream", code="unsupported_parameter")
    for refused in REFUSED_FIELDS:
        if form.value(refused):
            param = refused.rstrip("[]")
            raise invalid(f"{param!r} is not supported here; send the request without it",
                          param, code="unsupported_parameter")
    if (form.value("chunking_strategy") or "auto") != "auto":
        raise invalid("only chunking_strategy 'auto' is accepted here (the backend reads the "
                      "whole file)", "chunking_strategy", code="unsupported_parameter")
    response_format = (form.value("response_format") or "json").strip()
    if response_format not in RESPONSE_FORMATS:
        raise invalid(f"response_format {response_format[:32]!r} is not one of "
                      f"{', '.join(RESPONSE_FORMATS)}", "response_format", code="invalid_value")
    upload = form.file
    if upload is None:
        raise invalid("the form has no 'file' part (the audio, sent as a file: curl -F "
                      "file=@audio.wav)", "file", code="missing_required_parameter")
    if upload.size == 0:
        raise invalid("the 'file' part is empty", "file", code="invalid_value")
    kind = audio_format(upload.head)
    if kind is None:
        raise invalid("the 'file' part is not audio in a known format (wav, mp3, ogg/opus, "
                      "flac, m4a, aac, webm); convert it to one of them first",
                      "file", code="unsupported_audio_format")
    temperature = 0.0
    raw_temperature = form.value("temperature")
    if raw_temperature:
        try:
            temperature = float(raw_temperature)
        except ValueError:
            raise invalid("'temperature' must be a number", "temperature",
                          code="invalid_type") from None
        if not 0.0 <= temperature <= 1.0:
            raise invalid("'temperature' must be between 0 and 1", "temperature",
                          code="invalid_value")
    granularities = [g.strip() for g in form.values("timestamp_granularities[]",
                                                    "timestamp_granularities") if g.strip()]
    for granularity in granularities:
        if granularity not in ("word", "segment"):
            raise invalid(f"timestamp granularity {granularity[:32]!r} is not word or segment",
                          "timestamp_granularities", code="invalid_value")
    ask = backend_pb2.TranscriptRequest(
        language=(form.value("language") or "").strip()[:64],
        prompt=form.value("prompt") or "",
        temperature=temperature,
        translate=_form_flag(form.value("translate"), "translate"),
        diarize=_form_flag(form.value("diarize"), "diarize"),
        timestamp_granularities=granularities)
    transcribe = router_method(router, "transcribe")
    if kind == "wav":  # read by the backend as it is
        calling = transcribe(name, ask, upload.path, "audio.wav", context.deadline())
    else:  # ffmpeg on the serving worker makes it a 16 kHz mono WAV first
        calling = transcribe(name, ask, upload.path, f"upload.{kind}", context.deadline(),
                             convert_from=kind)
    served = await exchange.call(calling)
    result = served.value
    if response_format in ("json", "verbose_json"):
        exchange.send_json(200, _json_answer(result, response_format, granularities))
        return
    exchange.send_text(200, render_text(result, response_format),
                       "text/vtt" if response_format == "vtt" else "text/plain")


def _seconds(ns: int) -> float:
    return round(ns / _NS, 3)


def _json_answer(result, response_format: str, granularities: list[str]) -> dict:
    text = result.text.strip()
    if response_format == "json":
        return {"text": text}
    segments = [{"id": s.id, "start": _seconds(s.start), "end": _seconds(s.end),
                 "text": s.text.strip(), "tokens": list(s.tokens),
                 **({"speaker": s.speaker} if s.speaker else {})} for s in result.segments]
    body = {"task": "transcribe", "language": result.language, "duration": result.duration,
            "text": text, "segments": segments}
    if "word" in granularities:
        body["words"] = [{"word": w.text, "start": _seconds(w.start), "end": _seconds(w.end)}
                         for s in result.segments for w in s.words]
    return body


def _clock(ns: int, separator: str) -> str:
    ms = max(ns, 0) // 1_000_000
    return (f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}"
            f"{separator}{ms % 1000:03d}")


def render_text(result, response_format: str) -> str:
    """``text``/``txt``, ``srt``, ``vtt`` and ``lrc`` bodies of a ``TranscriptResult``."""
    segments = list(result.segments)
    if response_format in ("text", "txt"):
        return result.text.strip() + "\n"
    if response_format == "srt":
        return "".join(f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n"
                       f"{s.text.strip()}\n\n" for i, s in enumerate(segments, 1))
    if response_format == "vtt":
        return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n"
                                      f"{s.text.strip()}\n\n" for s in segments)
    lines = ["[by:LocalAI]", "[re:LocalAI]"]
    for s in segments:
        ms = max(s.start, 0) // 1_000_000
        lines.append(f"[{ms // 60000:02d}:{ms // 1000 % 60:02d}.{ms % 1000 // 10:02d}]"
                     f"{s.text.strip()}")
    return "\n".join(lines) + "\n"
