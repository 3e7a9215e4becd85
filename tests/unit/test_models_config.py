"""Model YAML configs: parsing, errors naming file and field, reload on change."""

from __future__ import annotations

import os

import pytest

from localai_tw.localai.model_config import ModelCatalog, ModelConfigError, load_model_file, \
    parse_model_config

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
