"""The ``pocketsphinx`` backend: speech to text with CMU PocketSphinx (the PyPI ``pocketsphinx``
wheel, which ships its US English acoustic model, dictionary and language model: nothing is
fetched).  Run as ``python -m localai_tw.backends.builtin.pocketsphinx_asr --addr HOST:PORT``.

Why not call it ``whisper``: LocalAI's ``whisper`` backend is whisper.cpp, a neural model that
transcribes many languages well; PocketSphinx is a small HMM recognizer for US English whose
accuracy on real speech is far lower.  A config naming it says what it gets.

RPCs: ``Health``; ``LoadModel`` builds the decoder (the wheel's model, or a model directory in
``ModelFile``/``Model`` when that is a directory holding ``en-us``-style files: ``hmm`` dir,
``*.dict``, ``*.lm.bin``); ``AudioTranscription`` reads the WAV at ``dst``; ``Status``,
``Free``.  A client's upload in another format (mp3, Ogg, FLAC, M4A, WebM) reaches this
program as a 16 kHz mono WAV: ffmpeg on the worker converts it first (``scratch.convert``).

``AudioTranscription`` answers ``text``, ``language`` (``en``), ``duration`` (seconds) and
segments (speech split at the recognizer's silences) with their words; times are nanoseconds,
as LocalAI's backends report them.  Refused with ``INVALID_ARGUMENT``, so nothing a client asks
is silently dropped: a file that is not PCM WAV (8/16-bit, any rate and channel count: mixed
to mono and resampled to 16 kHz here), audio over :data:`MAX_SECONDS`, a ``language`` other
than English, ``translate``, ``diarize``, a ``prompt``, a non-zero ``temperature``,
``stream``, and timestamp granularities other than ``word`` and ``segment``.

What this program must never do: read any file but ``dst``, or fetch a model.
"""

from __future__ import annotations

import os
import threading

import grpc

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.builtin import serving
from localai_tw.backends.builtin.wavfile import (
    UnsupportedAudio,
    little_endian_bytes,
    read_mono16,
    resample,
)

#: The rate the shipped acoustic model was trained at.
MODEL_RATE = 16000
#: Longest audio transcribed in one request.
MAX_SECONDS = 600.0
#: A silence this long (in frames of 10 ms) ends a segment.
SEGMENT_GAP_FRAMES = 30
ENGLISH = frozenset({"", "en", "en-us", "en_us", "english"})
_NS_PER_FRAME = 10_000_000  # frate 100: one frame is 10 ms


def segments_of(words, frate: int = 100) -> list[backend_pb2.TranscriptSegment]:
    """``(word, start_frame, end_frame)`` of the recognizer -> segments split at silences of
    at least :data:`SEGMENT_GAP_FRAMES` frames (fillers and sentence marks left out)."""
    per_frame = 1_000_000_000 // frate
    segments: list[list] = []
    current: list = []
    gap = 0
    for word, start, end in words:
        if word in ("<s>", "</s>", "<sil>") or word.startswith("[") or word.startswith("++"):
            if word == "<sil>":
                gap += end - start + 1
            continue
        if current and gap >= SEGMENT_GAP_FRAMES:
            segments.append(current)
            current = []
        gap = 0
        base = word.split("(")[0]  # alternative pronunciations: "read(2)"
        current.append(backend_pb2.TranscriptWord(start=start * per_frame,
                                                  end=(end + 1) * per_frame, text=base))
    if current:
        segments.append(current)
    return [backend_pb2.TranscriptSegment(
        id=i, start=ws[0].start, end=ws[-1].end, text=" ".join(w.text for w in ws), words=ws)
        for i, ws in enumerate(segments)]


class PocketSphinxServicer(backend_pb2_grpc.BackendServicer):
    def __init__(self, identity: serving.ModelIdentity | None = None):
        self.identity = identity or serving.ModelIdentity()
        self._lock = threading.Lock()
        self._busy = False
        self.decoder = None

    def Health(self, request, context):
        return backend_pb2.Reply(message=b"OK")

    def LoadModel(self, request, context):
        try:
            from pocketsphinx import Config, Decoder
        except ImportError:
            return backend_pb2.Result(success=False, message="pocketsphinx is not installed: "
                                      "pip install 'localai-tw[speech]'")
        try:
            config = Config()
            directory = request.ModelFile or request.Model
            if directory and os.path.isdir(directory):
                _use_model_directory(config, directory)
            config["samprate"] = MODEL_RATE
            config["loglevel"] = "FATAL"
            decoder = Decoder(config)
        except Exception as e:  # a bad model directory: the reason, not a traceback
            return backend_pb2.Result(success=False, message=f"pocketsphinx cannot load: {e}")
        with self._lock:
            self.decoder = decoder
        self.identity.loaded = request.Model
        return backend_pb2.Result(success=True, message="pocketsphinx ready (en-us)")

    def Free(self, request, context):
        with self._lock:
            self.decoder = None
        self.identity.loaded = ""
        return backend_pb2.Result(success=True, message="freed")

    def Status(self, request, context):
        return serving.status_response(busy=bool(self._busy), loaded=self.decoder is not None)

    def _refuse_unhonoured(self, request, context) -> None:
        def refuse(text):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, text)

        if request.language.strip().lower() not in ENGLISH:
            refuse(f"language {request.language[:32]!r}: pocketsphinx here recognizes US "
                   "English only")
        if request.translate:
            refuse("translate: pocketsphinx does not translate")
        if request.diarize:
            refuse("diarize: pocketsphinx does not tell speakers apart")
        if request.prompt:
            refuse("prompt: pocketsphinx takes no prompt")
        if request.temperature:
            refuse("temperature: pocketsphinx decodes deterministically (send 0 or nothing)")
        if request.stream:
            refuse("stream: pocketsphinx answers once")
        for granularity in request.timestamp_granularities:
            if granularity not in ("word", "segment"):
                refuse(f"timestamp granularity {granularity[:32]!r}: word and segment are "
                       "given")

    def AudioTranscription(self, request, context):
        decoder = self.decoder
        if decoder is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")
        self._refuse_unhonoured(request, context)
        if not os.path.isabs(request.dst) or not os.path.isfile(request.dst):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "dst must name an existing audio file (an absolute path)")
        try:
            samples, rate = read_mono16(request.dst, MAX_SECONDS)
        except UnsupportedAudio as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        duration = len(samples) / rate if rate else 0.0
        pcm = little_endian_bytes(resample(samples, rate, MODEL_RATE))
        with self._lock:
            self._busy = True
            try:
                decoder.start_utt()
                decoder.process_raw(pcm, full_utt=True)
                decoder.end_utt()
                words = [(s.word, s.start_frame, s.end_frame) for s in decoder.seg()]
            finally:
                self._busy = False
        segments = segments_of(words)
        text = " ".join(s.text for s in segments)
        return backend_pb2.TranscriptResult(segments=segments, text=text, language="en",
                                            duration=duration)


def _use_model_directory(config, directory: str) -> None:
    """An operator's model directory: ``hmm/`` (or the directory itself) as the acoustic
    model, the one ``*.dict`` and the one ``*.lm.bin`` (or ``*.lm``) inside it."""
    names = os.listdir(directory)
    hmm = os.path.join(directory, "hmm")
    config["hmm"] = hmm if os.path.isdir(hmm) else directory
    dicts = [n for n in names if n.endswith(".dict")]
    lms = [n for n in names if n.endswith((".lm.bin", ".lm"))]
    if len(dicts) == 1:
        config["dict"] = os.path.join(directory, dicts[0])
    if len(lms) == 1:
        config["lm"] = os.path.join(directory, lms[0])


def main() -> None:
    # Two threads: Health is answered while a request runs (the work itself is serialised).
    os.environ.setdefault(serving.MAX_WORKERS_ENV, "2")
    args = serving.argument_parser(__doc__.splitlines()[0]).parse_args()
    identity = serving.ModelIdentity()
    serving.serve(PocketSphinxServicer(identity), identity, args.addr)


if __name__ == "__main__":
    main()
