"""WAV files as the speech backends read them: 16-bit mono samples at a given rate, with the
standard library only (``wave``, ``array``; ``audioop`` is gone from Python 3.13).

What this module must never do: read a file it was not given, or accept a WAV it cannot
decode without saying why (:class:`UnsupportedAudio`).
"""

from __future__ import annotations

import array
import sys
import wave

#: What a WAV file starts with (``RIFF`` .... ``WAVE``).
RIFF, WAVE = b"RIFF", b"WAVE"


class UnsupportedAudio(ValueError):
    """The file is not audio this backend reads; the message says what is."""


def is_wav(head: bytes) -> bool:
    return len(head) >= 12 and head[:4] == RIFF and head[8:12] == WAVE


def read_mono16(path: str, max_seconds: float) -> tuple[array.array, int]:
    """The file's samples as 16-bit mono (channels averaged) and its rate.

    :raises UnsupportedAudio: not a PCM WAV of 8 or 16 bits, or longer than ``max_seconds``.
    """
    with open(path, "rb") as f:
        if not is_wav(f.read(12)):
            raise UnsupportedAudio("the audio is not a WAV file (RIFF/WAVE); this backend "
                                   "reads PCM WAV only: convert it first (ffmpeg -i in -ar "
                                   "16000 -ac 1 out.wav)")
    try:
        with wave.open(path, "rb") as w:
            channels, width, rate, frames = (w.getnchannels(), w.getsampwidth(),
                                             w.getframerate(), w.getnframes())
            if width not in (1, 2):
                raise UnsupportedAudio(f"the WAV has {8 * width}-bit samples; 8- or 16-bit "
                                       "PCM is read")
            if rate < 4000 or rate > 192000 or channels < 1 or channels > 8:
                raise UnsupportedAudio(f"the WAV's format ({channels} channels at {rate} Hz) "
                                       "is not read")
            if frames / rate > max_seconds:
                raise UnsupportedAudio(f"the audio lasts {frames / rate:.0f} s; at most "
                                       f"{max_seconds:.0f} s are transcribed")
            raw = w.readframes(frames)
    except (wave.Error, EOFError) as e:
        raise UnsupportedAudio(f"the WAV cannot be read: {e}") from None
    if width == 1:
        samples = array.array("h", ((b - 128) << 8 for b in raw))
    else:
        samples = array.array("h")
        samples.frombytes(raw[: len(raw) - len(raw) % 2])
        if sys.byteorder == "big":
            samples.byteswap()
    if channels > 1:
        samples = array.array("h", (sum(samples[i:i + channels]) // channels
                                    for i in range(0, len(samples) - channels + 1, channels)))
    return samples, rate


def resample(samples: array.array, rate: int, target: int) -> array.array:
    """Linear interpolation from ``rate`` to ``target`` Hz (enough for speech recognition)."""
    if rate == target or not samples:
        return samples
    count = max(1, int(len(samples) * target / rate))
    step = rate / target
    last = len(samples) - 1
    out = array.array("h", bytes(2 * count))
    for i in range(count):
        position = i * step
        left = int(position)
        if left >= last:
            out[i] = samples[last]
            continue
        fraction = position - left
        out[i] = int(samples[left] + (samples[left + 1] - samples[left]) * fraction)
    return out


def little_endian_bytes(samples: array.array) -> bytes:
    if sys.byteorder == "big":
        samples = array.array("h", samples)
        samples.byteswap()
    return samples.tobytes()
