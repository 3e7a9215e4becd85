"""YAML alias expansion is bounded where model configs and gallery files are read (issue 21 §1:
a 422-byte model file with nested aliases under ``engine_args`` stalled a replica 2.2 s)."""

from __future__ import annotations

import pytest
import yaml

from localai_tw.frontend.gallery import index as gallery
from localai_tw.localai.catalog import load_model_file
from localai_tw.localai.model_config import ModelConfigError
from localai_tw.localai.yamlbound import AliasBombError, Limits, bounded_loader


def bomb(levels: int, width: int = 4) -> str:
    """A model file whose ``engine_args`` expand to ``width ** levels`` strings."""
    lines = ["name: bomb", "backend: echo", "engine_args:",
             '  l0: &l0 ["lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        refs = ", ".join([f"*l{i - 1}"] * width)
        lines.append(f"  l{i}: &l{i} [{refs}]")
    return "\n".join(lines) + "\n"


def test_a_model_file_whose_aliases_explode_is_refused_naming_the_file(tmp_path):
    # 4 ** 11 (4 million) strings from a file of about 500 bytes: json.dumps of engine_args
    # alone took seconds on the reactor before.
    text = bomb(11)
    assert len(text) < 600
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(ModelConfigError) as caught:
        load_model_file(str(path), "bomb.yaml")
    message = str(caught.value)
    assert message.startswith("bomb.yaml: is refused: its aliases expand to more than 10000 "
                              "values"), message
    assert caught.value.model_name == "bomb"


def test_too_many_aliases_are_refused(tmp_path):
    path = tmp_path / "many.yaml"
    refs = ", ".join(["*x"] * 65)
    path.write_text(f"name: many\nbackend: echo\nengine_args:\n  x: &x 1\n  y: [{refs}]\n")
    with pytest.raises(ModelConfigError, match="more than 64 YAML aliases"):
        load_model_file(str(path), "many.yaml")


def test_a_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("name: loop\nbackend: echo\nengine_args: &a\n  self: *a\n")
    with pytest.raises(ModelConfigError, match="recursive YAML alias"):
        load_model_file(str(path), "loop.yaml")


def test_a_config_with_a_few_aliases_still_loads(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("name: ok\nbackend: echo\nparameters: &p {temperature: 0.5}\n"
                    "engine_args:\n  a: &a [1, 2, 3]\n  b: *a\n  c: {<<: *p, top_k: 3}\n")
    config = load_model_file(str(path), "ok.yaml")
    assert config.model_options["EngineArgs"] == \
        '{"a":[1,2,3],"b":[1,2,3],"c":{"temperature":0.5,"top_k":3}}'


def test_a_big_gallery_index_that_merges_a_base_entry_still_loads():
    # LocalAI's index: ~2000 entries, most of them "<<: *base" of a shared entry.
    base = ("- &base\n  name: base\n  url: github:mudler/LocalAI/gallery/base.yaml@master\n"
            "  license: apache-2.0\n  tags: [llm, gguf, gpu, cpu]\n"
            "  overrides: {parameters: {temperature: 0.2, top_p: 0.9}, context_size: 4096}\n")
    entries = "".join(f"- <<: *base\n  name: model-{i}\n  urls: [https://example.org/{i}]\n"
                      for i in range(2500))
    data = gallery.yaml_load((base + entries).encode(), index=True)
    assert len(data) == 2501
    assert data[-1]["license"] == "apache-2.0" and data[-1]["name"] == "model-2499"
    with pytest.raises(AliasBombError):  # the same text as an entry's config: refused
        gallery.yaml_load((base + entries).encode())


def test_gallery_configs_and_indexes_refuse_bombs():
    with pytest.raises(AliasBombError):
        gallery.yaml_load(bomb(11).encode())
    with pytest.raises(AliasBombError):
        gallery.yaml_load(bomb(14).encode(), index=True)


@pytest.mark.parametrize("base", [yaml.SafeLoader, getattr(yaml, "CSafeLoader",
                                                           yaml.SafeLoader)])
def test_the_limit_counts_values_beyond_those_written(base):
    loader = bounded_loader(base, Limits(aliases=10, extra_nodes=5))
    # [1,2,3] written once, used twice more: 3 + 1 extra nodes each time = 8 > 5
    with pytest.raises(AliasBombError):
        yaml.load("a: &a [1, 2, 3]\nb: *a\nc: *a\n", Loader=loader)  # noqa: S506
    assert yaml.load("a: &a [1, 2, 3]\nb: *a\n", Loader=loader) == \
        {"a": [1, 2, 3], "b": [1, 2, 3]}  # noqa: S506
    assert yaml.load("", Loader=loader) is None  # noqa: S506
