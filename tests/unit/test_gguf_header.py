"""The default context of a GGUF model whose config gives none, from the file's header, as
LocalAI picks it without a GPU: the trained length capped at 8192, else 4096."""

from __future__ import annotations

import struct

import pytest

from localai_tw.backends.builtin.gguf_header import default_context, trained_context


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _kv_string(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", 8) + _string(value)


def _kv_u32(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<I", 4) + struct.pack("<I", value)


def _kv_strings(key: str, values: list[str]) -> bytes:
    return (_string(key) + struct.pack("<I", 9) + struct.pack("<IQ", 8, len(values)) +
            b"".join(_string(v) for v in values))


def _kv_floats(key: str, values: list[float]) -> bytes:
    return (_string(key) + struct.pack("<I", 9) + struct.pack("<IQ", 6, len(values)) +
            struct.pack(f"<{len(values)}f", *values))


def _gguf(*kvs: bytes, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs)) + b"".join(kvs)


def _write(tmp_path, data: bytes) -> str:
    path = tmp_path / "m.gguf"
    path.write_bytes(data + b"\0" * 64)  # tensor data would follow
    return str(path)


@pytest.mark.parametrize("trained,expected", [(2048, 2048), (8192, 8192), (131072, 8192)])
def test_the_trained_context_capped_at_8192(tmp_path, trained, expected):
    path = _write(tmp_path, _gguf(_kv_string("general.architecture", "llama"),
                                  _kv_u32("llama.context_length", trained)))
    assert trained_context(path) == trained and default_context(path) == expected


def test_arrays_before_the_key_are_skipped_and_other_architectures_ignored(tmp_path):
    path = _write(tmp_path, _gguf(
        _kv_u32("qwen2.context_length", 32768),  # not this file's architecture
        _kv_strings("tokenizer.ggml.tokens", ["<s>", "a", "bb", "ccc"] * 100),
        _kv_floats("tokenizer.ggml.scores", [0.5] * 400),
        _kv_string("general.architecture", "gemma"),
        _kv_u32("gemma.context_length", 2048), version=2))
    assert trained_context(path) == 2048


@pytest.mark.parametrize("data", [
    _gguf(_kv_string("general.architecture", "llama")),  # no context length
    _gguf(_kv_string("general.architecture", "llama"), _kv_u32("llama.context_length", 0)),
    b"GGML" + b"\0" * 40,  # not GGUF
    _gguf(_kv_string("general.architecture", "llama"), version=1),
    # a string length past the end of the file
    b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 40),
    # an unknown value type
    _gguf(_string("general.architecture") + struct.pack("<I", 99)),
])
def test_a_header_that_does_not_say_is_the_4096_default(tmp_path, data):
    path = _write(tmp_path, data)
    assert trained_context(path) is None and default_context(path) == 4096


def test_a_header_cut_short_or_a_missing_file_is_the_default(tmp_path):
    whole = _gguf(_kv_string("general.architecture", "llama"),
                  _kv_u32("llama.context_length", 2048))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:-3])
    assert trained_context(str(cut)) is None
    assert default_context(str(tmp_path / "absent.gguf")) == 4096
