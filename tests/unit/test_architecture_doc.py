"""docs/architecture.md held against the code, so the map cannot go stale again: every module
of the package is named in the module map (by its path, or in the row of its folder by its file
name), and every file the map names exists.  The service tree is checked against a real
replica's ``Replica.services()`` in tests/integration/test_frontend_service.py."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "localai_tw"
DOC = ROOT / "docs" / "architecture.md"


def _map_rows() -> list[str]:
    text = DOC.read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" and not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def _named(module: str, rows: list[str]) -> bool:
    folder, _, name = module.rpartition("/")
    for row in rows:
        first_cell = row.split("|")[1]
        if f"`{module}`" in first_cell:
            return True
        if folder and f"`{folder}/`" in first_cell and f"`{name}`" in row:
            return True
    return False


def test_every_module_is_in_the_map():
    rows = _map_rows()
    missing = [module for module in _modules() if not _named(module, rows)]
    assert not missing, f"docs/architecture.md's module map does not name: {missing}"


def test_every_file_the_map_names_exists():
    rows = _map_rows()
    named = {path for row in rows for path in re.findall(r"`([\w/]+\.py)`", row.split("|")[1])}
    gone = sorted(path for path in named if not (PACKAGE / path).exists())
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"

