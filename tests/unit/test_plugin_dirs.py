"""``--plugin-dir``: an operator's drop-in directory joins the plugin package's path (no
PYTHONPATH), and a path that is not a directory is refused naming the option."""

from __future__ import annotations

import types

import pytest
from twisted.python import usage

from localai_tw.backends.interfaces import add_plugin_directories
from localai_tw.config import parse_directory


def test_a_directory_joins_the_package_path_once(tmp_path):
    package = types.SimpleNamespace(__path__=["/built-in"])
    assert add_plugin_directories([str(tmp_path)], package) == [str(tmp_path)]
    assert add_plugin_directories([str(tmp_path)], package) == []
    assert package.__path__ == ["/built-in", str(tmp_path)]


def test_the_option_takes_an_existing_directory_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "drop").mkdir()
    assert parse_directory("drop", "--plugin-dir") == str(tmp_path / "drop")
    (tmp_path / "file.py").write_text("")
    for bad in ("file.py", "missing", "  "):
        with pytest.raises(usage.UsageError, match="--plugin-dir"):
            parse_directory(bad, "--plugin-dir")
