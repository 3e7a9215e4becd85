"""The trained context length of a GGUF file, read from its header without loading the model.

LocalAI sizes the context of a model whose config gives no ``context_size`` from the file's
metadata (``core/config/gguf.go``, ``context_fit.go`` ``autoContextSize``): the trained length
(``<architecture>.context_length``), capped at 8192, or 4096 when the file does not say.  The
``llama-cpp`` backend does the same with :func:`default_context`; this module only reads.

The header is read sequentially (GGUF v2 and v3, little-endian: magic, version, tensor count,
key/value count, then each key, its type and value).  Scalars are decoded; strings and arrays
are skipped by their lengths (a string array is walked element by element, as its elements'
lengths are only known one by one).  The scan stops as soon as the architecture and its
context length are known, which in files written by llama.cpp's tools is before the
tokenizer's arrays.

What this module must never do: read past the file (every length is checked against the file
size), allocate what a length claims (strings are skipped with ``seek``, never read whole,
except keys and the architecture name, bounded by ``MAX_KEY``), or raise for a file it cannot
read: an unreadable, foreign or malformed header is ``None`` and the caller's default applies.
"""

from __future__ import annotations

import os
import struct

#: LocalAI's ``DefaultContextSize``: the context when the file does not say.
DEFAULT_CONTEXT = 4096
#: LocalAI's ``DefaultAutoContextSize``: the cap on a trained length taken as the default.
AUTO_CONTEXT_CAP = 8192
#: Longest key (or architecture name) read; GGUF keys are short dotted names.
MAX_KEY = 1024
#: Key/value pairs looked at before giving up (llama.cpp's files hold a few dozen).
MAX_KEYS = 10_000

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Malformed(Exception):
    pass


class _Reader:
    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise _Malformed("the header ends early")
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def skip(self, n: int) -> None:
        if n < 0 or self.f.tell() + n > self.size:
            raise _Malformed("a length points past the end of the file")
        self.f.seek(n, os.SEEK_CUR)

    def string(self, keep: bool) -> str | None:
        n = self.unpack("<Q")
        if keep and n <= MAX_KEY:
            return self.take(n).decode("utf-8", "replace")
        self.skip(n)
        return None

    def value(self, kind: int, keep: bool):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string(keep)
        if kind != _ARRAY:
            raise _Malformed(f"unknown value type {kind}")
        inner, count = self.unpack("<I"), self.unpack("<Q")
        if inner in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[inner]))
        elif inner == _STRING:
            for _ in range(count):
                self.skip(self.unpack("<Q"))
        else:  # arrays of arrays: walk them
            for _ in range(count):
                self.value(inner, False)
        return None


def trained_context(path: str) -> int | None:
    """``<architecture>.context_length`` of the GGUF at ``path``, or ``None`` when the file
    does not say or cannot be read as a GGUF header."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            reader = _Reader(f, size)
            if reader.take(4) != b"GGUF" or reader.unpack("<I") not in (2, 3):
                return None
            reader.unpack("<Q")  # tensor count
            count = reader.unpack("<Q")
            architecture, lengths = None, {}
            for _ in range(min(count, MAX_KEYS)):
                key = reader.string(keep=True) or ""
                kind = reader.unpack("<I")
                wanted = key == "general.architecture" or key.endswith(".context_length")
                value = reader.value(kind, keep=wanted)
                if key == "general.architecture" and isinstance(value, str):
                    architecture = value
                elif wanted and isinstance(value, int) and not isinstance(value, bool):
                    lengths[key] = value
                if architecture is not None and f"{architecture}.context_length" in lengths:
                    break
    except (OSError, _Malformed, struct.error, OverflowError):
        return None
    found = lengths.get(f"{architecture}.context_length") if architecture else None
    return found if found and found > 0 else None


def default_context(path: str) -> int:
    """The context for a model whose config gives none, as LocalAI picks it on a machine
    without a GPU: the trained length capped at :data:`AUTO_CONTEXT_CAP`, else
    :data:`DEFAULT_CONTEXT`."""
    trained = trained_context(path)
    return min(trained, AUTO_CONTEXT_CAP) if trained else DEFAULT_CONTEXT
