"""The ``espeak-ng`` backend: text to speech with Debian's ``espeak-ng`` program (formant
synthesis: robotic but intelligible, no model files, a few MB installed).  Run as
``python -m localai_tw.backends.builtin.espeak_ng --addr HOST:PORT``.

LocalAI has no espeak backend of its own (its ``piper`` uses espeak-ng only for phonemes); the
name is the program's.

RPCs: ``Health``; ``LoadModel`` checks that ``espeak-ng`` runs and reads its voice list (the
default voice: option ``voice:<language code>``, else ``en-us``); ``TTS`` writes a WAV
(16-bit mono, 22050 Hz) to ``dst``; ``Status``, ``Free``.

What ``TTS`` honours, and refuses with ``INVALID_ARGUMENT`` (so a client is never silently
given something else):

- ``text``: spoken; empty is refused;
- ``voice``: an espeak-ng language code from its voice list (``en-us``, ``de``, ``fr`` ...);
  OpenAI's voice names (``alloy``, ``echo``, ``nova`` ...) mean the model's default voice
  (documented in ``docs/openai-api.md``); anything else is refused with a few valid codes;
- ``language``: used as the voice when ``voice`` is empty;
- ``params``: ``speed`` (0.25 to 4.0, 1.0 = 175 words a minute); any other key is refused;
- ``instructions``: refused (formant synthesis takes no style instructions);
- ``dst``: an absolute path ending in ``.wav`` whose directory exists.

The program reads the text from stdin (never from the argument list, so a text starting with
``-`` is never an option) and runs at most :data:`SYNTH_TIMEOUT` seconds.  What this program
must never do: write anywhere but ``dst``, or answer success without a WAV there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import grpc

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.builtin import serving
from localai_tw.backends.builtin.wavfile import is_wav

PROGRAM = "espeak-ng"
DEFAULT_VOICE = "en-us"
#: espeak-ng's words per minute at speed 1.0.
WORDS_PER_MINUTE = 175
SYNTH_TIMEOUT = 120.0
#: Longest text spoken in one request (OpenAI's limit is 4096 characters).
MAX_TEXT = 4096
#: OpenAI's voice names: a client always sends one; here each means the default voice.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx",
                           "sage", "shimmer", "verse", "marin", "cedar"})


def parse_voices(listing: str) -> set[str]:
    """The language codes of ``espeak-ng --voices`` (mbrola voices left out: they need the
    separately packaged mbrola program)."""
    codes = set()
    for line in listing.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 5 and not fields[4].startswith("mb/"):
            codes.add(fields[1].lower())
    return codes


def words_per_minute(speed: str) -> int:
    try:
        value = float(speed)
    except ValueError:
        raise ValueError("params.speed must be a number from 0.25 to 4.0") from None
    if not 0.25 <= value <= 4.0:
        raise ValueError("params.speed must be from 0.25 to 4.0")
    return max(80, min(int(round(WORDS_PER_MINUTE * value)), 700))


class EspeakServicer(backend_pb2_grpc.BackendServicer):
    def __init__(self, identity: serving.ModelIdentity | None = None):
        self.identity = identity or serving.ModelIdentity()
        self._lock = threading.Lock()
        self._busy = 0
        self.voices: set[str] = set()
        self.default_voice = DEFAULT_VOICE
        self.loaded = False

    def Health(self, request, context):
        return backend_pb2.Reply(message=b"OK")

    def LoadModel(self, request, context):
        program = shutil.which(PROGRAM)
        if program is None:
            return backend_pb2.Result(success=False, message=f"{PROGRAM} is not installed on "
                                      "this worker: apt-get install espeak-ng")
        try:
            listing = subprocess.run([program, "--voices"], capture_output=True, text=True,
                                     timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError) as e:
            return backend_pb2.Result(success=False, message=f"{PROGRAM} --voices failed: {e}")
        self.voices = parse_voices(listing)
        voice = DEFAULT_VOICE
        for option in request.Options:
            key, _, value = option.partition(":")
            if key.strip() == "voice":
                voice = value.strip().lower()
        if voice not in self.voices:
            return backend_pb2.Result(success=False, message=f"option voice:{voice} is not an "
                                      f"{PROGRAM} voice ({self._some_voices()})")
        self.default_voice = voice
        self.program = program
        self.loaded = True
        self.identity.loaded = request.Model
        return backend_pb2.Result(success=True, message=f"{PROGRAM} ready, voice {voice}")

    def Free(self, request, context):
        self.loaded = False
        self.identity.loaded = ""
        return backend_pb2.Result(success=True, message="freed")

    def Status(self, request, context):
        return serving.status_response(busy=bool(self._busy), loaded=self.loaded)

    def _some_voices(self) -> str:
        some = sorted(self.voices & {"en-us", "en-gb", "de", "fr", "es", "it"}) or \
            sorted(self.voices)[:6]
        return "for example " + ", ".join(some)

    def _voice(self, request, context) -> str:
        voice = request.voice.strip().lower()
        if not voice and request.HasField("language"):
            voice = request.language.strip().lower()
        if not voice or voice in OPENAI_VOICES:
            return self.default_voice
        if voice not in self.voices:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"voice {voice[:64]!r} is not an {PROGRAM} voice ({self._some_voices()})")
        return voice

    def TTS(self, request, context):
        if not self.loaded:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")
        text = request.text
        if not text.strip():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the text to speak is empty")
        if len(text) > MAX_TEXT:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the text is longer than {MAX_TEXT} characters")
        if request.HasField("instructions") and request.instructions.strip():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{PROGRAM} cannot follow instructions; send the request without them")
        speed = WORDS_PER_MINUTE
        for key, value in request.params.items():
            if key != "speed":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"parameter {key[:64]!r} is not understood by {PROGRAM} "
                              "(only speed is)")
            try:
                speed = words_per_minute(value)
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        dst = request.dst
        if not os.path.isabs(dst) or not dst.endswith(".wav") or \
                not os.path.isdir(os.path.dirname(dst)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "dst must be an absolute path ending in .wav in an existing directory")
        voice = self._voice(request, context)
        with self._lock:
            self._busy += 1
        try:
            done = subprocess.run([self.program, "-v", voice, "-s", str(speed), "-w", dst,
                                   "--stdin"], input=text.encode("utf-8"),
                                  capture_output=True, timeout=SYNTH_TIMEOUT)
        except subprocess.TimeoutExpired:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"{PROGRAM} took longer than {SYNTH_TIMEOUT:g} s")
        finally:
            with self._lock:
                self._busy -= 1
        if done.returncode != 0:
            return backend_pb2.Result(success=False, message=f"{PROGRAM} failed: " +
                                      done.stderr.decode("utf-8", "replace")[:500])
        try:
            with open(dst, "rb") as f:
                head = f.read(12)
        except OSError:
            head = b""
        if not is_wav(head):
            return backend_pb2.Result(success=False, message=f"{PROGRAM} wrote no WAV")
        return backend_pb2.Result(success=True, message=dst)


def main() -> None:
    # Two threads: Health is answered while a request runs (the work itself is serialised).
    os.environ.setdefault(serving.MAX_WORKERS_ENV, "2")
    args = serving.argument_parser(__doc__.splitlines()[0]).parse_args()
    identity = serving.ModelIdentity()
    serving.serve(EspeakServicer(identity), identity, args.addr)


if __name__ == "__main__":
    main()
