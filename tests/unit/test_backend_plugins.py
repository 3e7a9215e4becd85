"""Backend factory discovery through twisted.plugin: built-ins, an operator's drop-in module in a
``localai_tw/plugins`` directory on sys.path, one in a ``twisted/plugins`` directory, overrides
and ambiguity."""

from __future__ import annotations

import sys
import textwrap

import pytest
import twisted.plugins

import localai_tw.plugins
from localai_tw.backends import builtin
from localai_tw.backends.interfaces import (
    BUILTIN_PLUGIN_MODULE,
    BackendFactories,
    IBackendFactory,
    UnknownBackend,
)

PLUGIN_SOURCE = '''
from zope.interface import implementer
from localai_tw.backends.interfaces import IBackendFactory


@implementer(IBackendFactory)
class OperatorFactory:
    description = "an operator's backend"

    def __init__(self, name):
        self.name = name

    def unavailable_reason(self):
        return None

    def command(self, address, options):
        return ["/opt/my-backend/run.sh", "--addr", address]

    def environment(self, options):
        return {{}}

    def servicer(self, options):
        raise NotImplementedError


{assignments}
'''


@pytest.fixture
def drop_in(tmp_path):
    """``drop_in(package_dir, module, names)`` writes a plugin module under ``tmp_path`` and
    puts ``tmp_path`` on sys.path; everything is undone afterwards."""
    added_paths: list[str] = []
    modules: list[str] = []
    saved_paths = {pkg: list(pkg.__path__) for pkg in (localai_tw.plugins, twisted.plugins)}

    def write(package_dir: str, module: str, names: dict[str, str]):
        directory = tmp_path.joinpath(*package_dir.split("/"))
        directory.mkdir(parents=True, exist_ok=True)
        assignments = "\n".join(f"{var} = OperatorFactory({name!r})"
                                for var, name in names.items())
        (directory / f"{module}.py").write_text(
            textwrap.dedent(PLUGIN_SOURCE.format(assignments=assignments)))
        if str(tmp_path) not in sys.path:
            sys.path.insert(0, str(tmp_path))
            added_paths.append(str(tmp_path))
        modules.append(package_dir.replace("/", ".") + "." + module)

    yield write
    for path in added_paths:
        sys.path.remove(path)
    for pkg, paths in saved_paths.items():
        pkg.__path__[:] = paths
    for name in modules:
        sys.modules.pop(name, None)


def test_builtins_are_found_by_name():
    factories = BackendFactories.discover()
    for name in ("external", "echo", "bert-numpy", "sentence-transformers", "transformers",
                 "llama-cpp"):
        assert name in factories
        assert factories.origin(name) == BUILTIN_PLUGIN_MODULE
        assert IBackendFactory.providedBy(factories.lookup(name))
    assert factories.lookup("echo") is builtin.echo_backend


def test_a_dropped_in_localai_plugin_is_found_without_core_changes(drop_in):
    drop_in("localai_tw/plugins", "ops_vllm_backend", {"vllm_factory": "my-vllm"})
    factories = BackendFactories.discover()
    factory = factories.lookup("my-vllm")
    assert factories.origin("my-vllm") == "localai_tw.plugins.ops_vllm_backend"
    assert factory.command("127.0.0.1:30001", {}) == [
        "/opt/my-backend/run.sh", "--addr", "127.0.0.1:30001"]
    assert "echo" in factories  # the built-ins are still there


def test_a_plugin_in_twisted_plugins_on_sys_path_is_found(drop_in):
    drop_in("twisted/plugins", "ops_llama_backend", {"llama": "my-llama"})
    factories = BackendFactories.discover()
    assert factories.origin("my-llama") == "twisted.plugins.ops_llama_backend"


def test_an_operator_plugin_overrides_a_builtin(drop_in):
    drop_in("localai_tw/plugins", "ops_override", {"mine": "transformers"})
    factories = BackendFactories.discover()
    assert factories.origin("transformers") == "localai_tw.plugins.ops_override"


def test_two_operator_plugins_with_one_name_are_ambiguous(drop_in):
    drop_in("localai_tw/plugins", "ops_a", {"a": "twin"})
    drop_in("localai_tw/plugins", "ops_b", {"b": "twin"})
    factories = BackendFactories.discover()
    assert "twin" not in factories
    with pytest.raises(UnknownBackend, match="ops_a.*ops_b|ops_b.*ops_a"):
        factories.lookup("twin")


def test_unknown_name_lists_the_known_ones():
    factories = BackendFactories([builtin.echo_backend])
    with pytest.raises(UnknownBackend, match=r"unknown backend 'nope' \(known: echo\)"):
        factories.lookup("nope")


def test_external_command_appends_addr_last(tmp_path):
    program = tmp_path / "run.sh"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    argv = builtin.external_backend.command(
        "127.0.0.1:30002", {"command": f"{program} --threads 2"})
    assert argv == [str(program), "--threads", "2", "--addr", "127.0.0.1:30002"]
    with pytest.raises(ValueError, match="needs options.command"):
        builtin.external_backend.command("127.0.0.1:1", {})
    with pytest.raises(ValueError, match="not an executable"):
        builtin.external_backend.command("127.0.0.1:1", {"command": [str(tmp_path / "x")]})


def test_heavy_backends_say_which_extra_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "transformers",
                                                          "sentence_transformers")
                        else real(name, *a))
    reason = builtin.transformers_backend.unavailable_reason()
    assert "pip install 'localai-tw[transformers]'" in reason and "torch" in reason
    reason = builtin.sentence_transformers_backend.unavailable_reason()
    assert "localai-tw[sentence-transformers]" in reason and "sentence_transformers" in reason
    with pytest.raises(ValueError, match=r"localai-tw\[sentence-transformers\]"):
        builtin.sentence_transformers_backend.command("127.0.0.1:1", {})
    # The default embeddings backend never needs torch.
    assert "torch" not in (builtin.bert_numpy_backend.unavailable_reason() or "")
    # Another interpreter may have them: no local check then.
    argv = builtin.sentence_transformers_backend.command("127.0.0.1:1",
                                                         {"python": sys.executable})
    assert argv[:3] == [sys.executable, "-m", "localai_tw.backends.builtin.huggingface"]
    assert argv[-2:] == ["--addr", "127.0.0.1:1"]


def test_llama_cpp_names_the_llama_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    reason = builtin.llama_cpp_backend.unavailable_reason()
    assert "pip install 'localai-tw[llama]'" in reason and "llama_cpp" in reason
    with pytest.raises(ValueError, match=r"localai-tw\[llama\]"):
        builtin.llama_cpp_backend.command("127.0.0.1:1", {})


def test_bert_numpy_names_the_light_embeddings_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("numpy", "safetensors")
                        else real(name, *a))
    reason = builtin.bert_numpy_backend.unavailable_reason()
    assert "pip install 'localai-tw[embeddings]'" in reason
    assert "numpy, safetensors" in reason and "torch" not in reason


def test_python_programs_can_import_the_package():
    env = builtin.echo_backend.environment({})
    assert env["PYTHONPATH"].split(":")[0] == builtin.PACKAGE_ROOT
    import os

    assert os.path.exists(os.path.join(builtin.PACKAGE_ROOT, "localai_tw", "__init__.py"))
