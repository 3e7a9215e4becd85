"""The parts of the ``llama-cpp`` backend that need no llama.cpp: the GGUF file check, stop
sequences in a stream, UTF-8 split across tokens, the logprobs entry shape.  (The backend
itself runs in tests/integration/test_backend_llama_cpp.py.)"""

from __future__ import annotations

import pytest

from localai_tw.backends.builtin import llama_cpp
from localai_tw.backends.builtin.llama_cpp import (
    LoadError,
    check_gguf_file,
    held_back,
    logprob_entry,
    stop_cut,
    utf8_decoder,
)


def test_the_module_imports_without_llama_cpp():
    # The worker imports the factory; the backend module itself imports llama_cpp lazily.
    assert "llama_cpp" not in llama_cpp.__dict__


@pytest.mark.parametrize("content, reason", [
    (b"", "is empty"),
    (b"GGUF\x03\x00", "truncated: it ends inside the GGUF header"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:...", "a git-lfs pointer"),
    (b"<!DOCTYPE html><html>", "an HTML page"),
    (b"lmgg\x01\x00\x00\x00", "an old GGML/GGJT model"),
    (b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}", "is not a GGUF file"),
])
def test_a_file_that_is_not_a_whole_gguf_header_is_refused_naming_it(tmp_path, content,
                                                                       reason):
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    with pytest.raises(LoadError) as caught:
        check_gguf_file(str(path))
    assert str(path) in str(caught.value) and reason in str(caught.value)


def test_missing_files_and_directories_are_refused_naming_them(tmp_path):
    with pytest.raises(LoadError, match="does not exist on this worker"):
        check_gguf_file(str(tmp_path / "nope.gguf"))
    with pytest.raises(LoadError, match="is a directory"):
        check_gguf_file(str(tmp_path))
    ok = tmp_path / "ok.gguf"
    ok.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 16)
    check_gguf_file(str(ok))  # the rest is llama.cpp's to judge


def test_stop_sequences_are_found_and_their_beginnings_held_back():
    assert stop_cut("hello world", ["wor", "llo"]) == 2
    assert stop_cut("hello world", ["xyz"]) is None
    assert stop_cut("hello world", ["llo"], start=3) is None
    assert held_back("the end of", ["of the", "x"]) == 2  # "of" may begin "of the"
    assert held_back("the end o", ["of the"]) == 1
    assert held_back("the end", ["of the"]) == 0
    assert held_back("abc", []) == 0
    assert held_back("ab", ["abc", "bcd"]) == 2


def test_a_utf8_sequence_split_across_tokens_waits_for_its_end():
    decoder = utf8_decoder()
    assert decoder.decode(b"n\xc3") == "n"
    assert decoder.decode(b"\xa9") == "\u00e9"
    assert decoder.decode(b"\xffab") == "\ufffdab"  # not UTF-8: replaced at once, not held
    assert decoder.decode(b"\xe2\x82") == ""
    assert decoder.decode(b"", final=True) == "\ufffd"  # cut short by the end of the answer


def test_a_logprob_entry_has_openais_chat_fields():
    assert logprob_entry(7, " hé".encode(), -0.5) == {
        "id": 7, "token": " hé", "bytes": [32, 104, 195, 169], "logprob": -0.5}


def test_localais_options_set_what_llama_cpp_python_can_take():
    from localai_tw.backends.builtin.llama_cpp import CACHE_TYPES, load_options

    assert load_options(["no_mmap", "mlock:true", "flash_attention:on", "cache_type_k:q8_0",
                         "cache_type_v:F16", "use_extra_bufts:false", "gpu:1", "n_ctx"]) == {
        "use_mmap": False, "use_mlock": True, "flash_attn": True,
        "type_k": CACHE_TYPES["q8_0"], "type_v": CACHE_TYPES["f16"], "extra_bufts": False}
    # llama-server's flags, as LocalAI passes them through
    assert load_options(["--no-mmap", "--mlock", "-fa:auto", "-ctk:f16", "--cache-type-v:q4_0",
                         "--no-repack"]) == {
        "use_mmap": False, "use_mlock": True, "flash_attn": False,
        "type_k": CACHE_TYPES["f16"], "type_v": CACHE_TYPES["q4_0"], "extra_bufts": False}
    assert load_options(["mmap:yes", "no_extra_bufts:false", "repack"]) == {
        "use_mmap": True, "extra_bufts": True}
    assert load_options([]) == {}


@pytest.mark.parametrize("option, named", [
    ("mmap:maybe", "'mmap'"), ("no_repack:2", "'no_repack'"),
    ("cache_type_k:q3", "'cache_type_k'"), ("flash_attention:sometimes", "'flash_attention'"),
])
def test_an_option_value_that_cannot_be_read_refuses_the_load_naming_it(option, named):
    from localai_tw.backends.builtin.llama_cpp import load_options

    with pytest.raises(LoadError) as caught:
        load_options([option])
    assert named in str(caught.value)


def test_extra_buffer_types_reach_the_model_parameters_only_while_loading():
    llama = pytest.importorskip("llama_cpp")
    from localai_tw.backends.builtin.llama_cpp import model_params_with

    assert llama.llama_cpp.llama_model_default_params().use_extra_bufts is True
    with model_params_with(llama, use_extra_bufts=False):
        assert llama.llama_cpp.llama_model_default_params().use_extra_bufts is False
    assert llama.llama_cpp.llama_model_default_params().use_extra_bufts is True
    with pytest.raises(LoadError):
        with model_params_with(llama, no_such_field=1):
            pass
