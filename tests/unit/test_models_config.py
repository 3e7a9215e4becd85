"""Model YAML configs: parsing, errors naming file and field, reload on change."""

from __future__ import annotations

import os

import pytest

from localai_tw.localai.catalog import ModelCatalog, load_model_file
from localai_tw.localai.model_config import ModelConfigError, parse_model_config

GOOD = """
name: tiny
backend: echo
parameters:
  model: tiny.bin
  temperature: 0.2
  max_tokens: 16
  stop: ["</s>"]
files:
  - path: tiny.bin
    sha256: %s
template:
  chat: "{{.Input}}"
  use_tokenizer_template: false
context_size: 512
embeddings: true
options: ["echo.dim:4"]
node_selector: {zone: a}
""" % ("ab" * 32)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_full_config_parses(tmp_path):
    cfg = load_model_file(write(tmp_path, "tiny.yaml", GOOD), "tiny.yaml")
    assert (cfg.name, cfg.backend, cfg.model) == ("tiny", "echo", "tiny.bin")
    assert cfg.files[0].key == "models/tiny/tiny.bin" and cfg.files[0].sha256 == "ab" * 32
    assert cfg.parameters == {"temperature": 0.2, "max_tokens": 16, "stop": ["</s>"]}
    assert cfg.template.chat == "{{.Input}}" and cfg.context_size == 512 and cfg.embeddings
    assert cfg.options == ("echo.dim:4",) and cfg.node_selector == {"zone": "a"}
    assert cfg.file_for_model() is cfg.files[0]


def test_model_defaults_to_the_name_and_files_may_be_plain_strings():
    cfg = parse_model_config({"name": "m", "backend": "echo", "files": ["a/b.gguf"]})
    assert cfg.model == "m" and cfg.files[0].path == "a/b.gguf"
    assert cfg.files[0].key == "models/m/b.gguf" and cfg.file_for_model() is None


@pytest.mark.parametrize("data,field,words", [
    ({"backend": "echo", "name": ""}, "name", "required"),
    ({"name": "../x", "backend": "echo"}, "name", "letters"),
    ({"name": "m"}, "backend", "required"),
    ({"name": "m", "backend": "echo", "parameters": {"temperature": "hot"}},
     "parameters.temperature", "must be"),
    ({"name": "m", "backend": "echo", "files": [{"path": "../etc/passwd"}]}, "files[0].path",
     "leaves"),
    ({"name": "m", "backend": "echo", "files": [{"path": "/abs"}]}, "files[0].path",
     "relative"),
    ({"name": "m", "backend": "echo", "files": [{"path": "a", "sha256": "xyz"}]},
     "files[0].sha256", "64 hex"),
    ({"name": "m", "backend": "echo", "files": [{"path": "a", "key": "data/a"}]},
     "files[0].key", "models/"),
    ({"name": "m", "backend": "echo", "template": {"chat": 3}}, "template.chat", "str"),
    ({"name": "m", "backend": "echo", "context_size": -1}, "context_size", ">= 0"),
    ({"name": "m", "backend": "echo", "embeddings": "yes"}, "embeddings", "true or false"),
    ({"name": "m", "backend": "echo", "options": [1]}, "options", "strings"),
    ({"name": "m", "backend": "echo", "node_selector": ["a"]}, "node_selector", "mapping"),
])
def test_errors_name_the_file_and_the_field(data, field, words):
    with pytest.raises(ModelConfigError) as caught:
        parse_model_config(data, "models/m.yaml")
    assert caught.value.field == field
    assert str(caught.value).startswith(f"models/m.yaml: {field}: ")
    assert words in str(caught.value)


def test_an_unquoted_all_digit_sha256_is_refused(tmp_path):
    text = "name: m\nbackend: echo\nfiles:\n  - path: a\n    sha256: " + "0" * 64 + "\n"
    with pytest.raises(ModelConfigError, match=r"m.yaml: files\[0\].sha256: .*quote it"):
        load_model_file(write(tmp_path, "m.yaml", text), "m.yaml")


def test_bad_yaml_and_oversized_files_are_refused(tmp_path):
    with pytest.raises(ModelConfigError, match=r"bad.yaml: is not valid YAML at line 2"):
        load_model_file(write(tmp_path, "bad.yaml", "name: a\n  - : [\n"), "bad.yaml")
    with pytest.raises(ModelConfigError, match="larger than"):
        load_model_file(write(tmp_path, "big.yaml", "#" * (300 * 1024)), "big.yaml")


def test_a_file_nested_deeper_than_the_stack_is_a_config_error_remembered(tmp_path):
    """100 000 nested lists raise RecursionError inside PyYAML: a config error naming the
    file, read once (not on every /v1/models call), and the other models still listed."""
    write(tmp_path, "deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    write(tmp_path, "ok.yaml", "name: ok\nbackend: echo\n")
    now = [0.0]
    catalog = ModelCatalog(str(tmp_path), check_interval=1.0, clock=lambda: now[0])
    assert [m.name for m in catalog.models()] == ["ok"]
    assert "deep.yaml: nests too deeply" in catalog.errors["deep.yaml"]
    reads = []
    real_load = load_model_file.__globals__["load_model_file"]
    load_model_file.__globals__["load_model_file"] = lambda *a: reads.append(a) or real_load(*a)
    try:
        now[0] = 5.0
        assert [m.name for m in catalog.models()] == ["ok"]
    finally:
        load_model_file.__globals__["load_model_file"] = real_load
    assert reads == []  # unchanged file: its error is remembered, not re-parsed


def test_catalog_reloads_changed_files_and_skips_bad_ones(tmp_path):
    now = [0.0]
    catalog = ModelCatalog(str(tmp_path), check_interval=1.0, clock=lambda: now[0])
    assert catalog.models() == []
    write(tmp_path, "a.yaml", "name: a\nbackend: echo\n")
    write(tmp_path, "b.yaml", "name: b\nbackend: [\n")
    assert catalog.models() == []  # within the check interval: not re-read
    now[0] = 2.0
    assert [m.name for m in catalog.models()] == ["a"]
    assert "b.yaml" in catalog.errors and "not valid YAML" in catalog.errors["b.yaml"]
    path = write(tmp_path, "a.yaml", "name: a\nbackend: other\ncontext_size: 9\n")
    os.utime(path, ns=(10**18, 10**18))
    write(tmp_path, "c.yml", "name: a\nbackend: echo\n")  # duplicate name: later file loses
    now[0] = 4.0
    assert catalog.get("a").backend == "other"
    assert "already defined by a.yaml" in catalog.errors["c.yml"]
    os.unlink(path)
    now[0] = 6.0
    assert catalog.get("a").source == "c.yml"
    assert catalog.get("zzz") is None


# -- LocalAI's GGUF guesses (issue 22 §3) ----------------------------------------------------


def test_a_gguf_model_with_no_backend_is_served_by_llama_cpp():
    """LocalAI's gallery has embedding and reranker entries with no backend and a .gguf file:
    LocalAI serves them with llama.cpp, so this does too (and says it guessed)."""
    cfg = parse_model_config({"name": "e", "embeddings": True,
                              "parameters": {"model": "nomic-embed-text-v1.5.f16.GGUF"}})
    assert cfg.backend == "llama-cpp"
    assert cfg.guesses[0] == "backend: llama-cpp (parameters.model is a .gguf file)"
    cfg = parse_model_config({"name": "e", "model": "x.gguf"})  # LocalAI's top-level model:
    assert cfg.backend == "llama-cpp"


def test_no_backend_and_no_gguf_is_refused_saying_when_it_is_guessed():
    with pytest.raises(ModelConfigError) as caught:
        parse_model_config({"name": "m", "parameters": {"model": "m.bin"}}, "models/m.yaml")
    assert caught.value.field == "backend"
    assert "guessed only when parameters.model is a .gguf file" in str(caught.value)


@pytest.mark.parametrize("data", [
    {"name": "m", "backend": "llama-cpp", "parameters": {"model": "m.gguf"}},
    {"name": "m", "parameters": {"model": "m.gguf"}},
    {"name": "m", "backend": "llama-cpp", "parameters": {"model": "m.gguf"},
     "template": {"use_tokenizer_template": False, "function": "{{.Input}}"}},
])
def test_a_llama_cpp_config_with_no_template_uses_the_models_own(data):
    """LocalAI's minimal form (name, backend, parameters.model) chats through the GGUF's
    chat template: without it SmolLM2 got the raw text and answered nothing."""
    cfg = parse_model_config(data)
    assert cfg.template.use_tokenizer_template and cfg.template.tokenizer_template_guessed
    assert cfg.guesses[-1] == "template: the model's own chat template (no template in the " \
                              "config)"


@pytest.mark.parametrize("data", [
    {"name": "m", "backend": "llama-cpp", "parameters": {"model": "m.gguf"},
     "template": {"chat": "{{.Input}}"}},
    {"name": "m", "backend": "llama-cpp", "parameters": {"model": "m.gguf"},
     "template": {"chat_message": "{{.Content}}"}},
    {"name": "m", "backend": "llama-cpp", "parameters": {"model": "m.gguf"},
     "template": {"completion": "{{.Input}}"}},
    {"name": "m", "backend": "llama-cpp", "parameters": {"model": "m.gguf"},
     "template": {"edit": "{{.Input}}"}},  # LocalAI's HasTemplate counts edit too
    {"name": "m", "backend": "llama-cpp", "parameters": {"model": "m.gguf"},
     "known_usecases": ["FLAG_SCORE"]},  # reserved for a non-chat primitive
    {"name": "m", "backend": "transformers", "parameters": {"model": "some/dir"}},
    {"name": "m", "backend": "echo", "parameters": {"model": "m.gguf"}},
])
def test_a_config_that_chose_a_template_or_another_backend_is_left_alone(data):
    cfg = parse_model_config(data)
    assert not cfg.template.tokenizer_template_guessed
    assert not any(g.startswith("template:") for g in cfg.guesses)


def test_an_explicit_tokenizer_template_is_not_a_guess():
    cfg = parse_model_config({"name": "m", "backend": "llama-cpp", "parameters": {
        "model": "m.gguf"}, "template": {"use_tokenizer_template": True}})
    assert cfg.template.use_tokenizer_template and not cfg.template.tokenizer_template_guessed
    assert cfg.guesses == ()


@pytest.mark.parametrize("name,overrides,serves", [
    # LocalAI's gallery index entries (on gallery/virtual.yaml, which sets nothing) that were
    # refused here for their missing backend
    ("nomic-embed-text-v1.5", {"embeddings": True,
                               "parameters": {"model": "nomic-embed-text-v1.5.f16.gguf"}},
     {"embeddings"}),
    ("granite-embedding-125m-english", {
        "embeddings": True, "known_usecases": ["embeddings"],
        "parameters": {"model": "granite-embedding-125m-english-f16.gguf"}}, {"embeddings"}),
    ("jina-reranker-v1-tiny-en", {
        "f16": True, "known_usecases": ["rerank"], "reranking": True,
        "parameters": {"model": "jina-reranker-v1-tiny-en.f16.gguf"}},
     {"rerank", "chat", "completion"}),  # listed use cases add to llama-cpp's guess
])
def test_localai_gallery_gguf_entries_without_a_backend_load(name, overrides, serves):
    from localai_tw.localai.usecases import usecases

    cfg = parse_model_config({"name": name, **overrides}, f"{name}.yaml")
    assert cfg.backend == "llama-cpp" and usecases(cfg) == serves


@pytest.mark.parametrize("name", ["voice-pt_PT-tugão-medium", "piper-pt_PT-tugão-medium-crispasr",
                                  "模型", "localai@phi-2", "a b", "x:1+2"])
def test_localais_names_non_ascii_included_are_accepted(name):
    assert parse_model_config({"name": name, "backend": "echo"}).name == name


@pytest.mark.parametrize("name", ["org/model", "a\\b", "nul\x00", "tab\there", ".hidden", "..",
                                  "bidi\u202eevil", " padded", "é" * 128])
def test_names_stay_safe_file_names(name):
    from localai_tw.localai.model_config import ModelConfigError

    with pytest.raises(ModelConfigError, match="name: must be a file name"):
        parse_model_config({"name": name, "backend": "echo"})
