"""The documented layers (docs/architecture.md, "Layers and the direction of imports"),
enforced by reading every module's imports, function-level ones included.

Each group of modules may import only the groups listed for it; a new module or package must
be placed in this table (an unknown group fails the test), so the layering is decided on
purpose, not by accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "localai_tw"

BASE = {"errors", "deferreds", "config", "logsafe", "logs"}

#: group -> the groups it may import (besides itself).  BASE modules import nothing of ours.
ALLOWED: dict[str, set[str]] = {
    **{name: set() for name in BASE},
    "mux": BASE,
    "splice": BASE | {"mux"},
    "db": BASE,
    "cluster": BASE | {"db"},
    "bus": BASE | {"db", "cluster"},
    "web": BASE,  # the HTTP pieces both servers share (bearer rule, bodies, JSON, readers)
    "staging_client": BASE | {"web"},
    "threadwriter": BASE,  # file writes and hashing off the reactor (downloads, staging)
    "metrics": BASE,  # every Prometheus metric in one place (docs/metrics.md)
    "tinychat": BASE,  # a user's tool (python -m localai_tw.tinychat): builds a local model
    "tinygguf": BASE,  # a user's tool (python -m localai_tw.tinygguf): builds a local GGUF
    "tunnel": BASE | {"mux", "splice", "db", "cluster", "staging_client", "web"},
    "backends": BASE | {"plugins"},  # plugins: the drop-in package IBackendFactory scans
    "plugins": BASE | {"backends", "jobs"},
    # jobs: the IJobKind seam and the built-in kinds, shared by the frontend (validation) and
    # the agent worker (runs); plugins: the drop-in package IJobKind is scanned in
    "jobs": BASE | {"web", "plugins"},
    "worker": BASE | {"mux", "splice", "tunnel", "db", "cluster", "bus", "backends",
                      "staging_client", "plugins", "web", "metrics", "jobs", "threadwriter"},
    "frontend": BASE | {"mux", "splice", "tunnel", "db", "cluster", "bus", "backends",
                        "staging_client", "plugins", "web", "metrics", "jobs",
                        "threadwriter"},
}

#: The only modules outside ``worker/`` that may import from it: the frontend's in-process
#: worker (``--local-worker``) and the option modules the twistd plugins name.
MAY_IMPORT_WORKER = {"localai_tw.frontend.localworker", "localai_tw.frontend.tap"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def group_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "localai_tw"


def imported_modules(path: Path, module: str) -> set[str]:
    """Every ``localai_tw`` module ``path`` imports (``from localai_tw import x`` counts as
    ``localai_tw.x``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "localai_tw":  # a submodule, or a name of the package itself
                found.update(f"localai_tw.{alias.name}" if _is_module(alias.name)
                             else "localai_tw" for alias in node.names)
            else:
                found.add(target)
    return {name for name in found if name == "localai_tw" or name.startswith("localai_tw.")}


def _is_module(name: str) -> bool:
    return (PACKAGE / f"{name}.py").exists() or (PACKAGE / name).is_dir()


def all_modules() -> list[tuple[Path, str]]:
    return sorted((path, module_name(path)) for path in PACKAGE.rglob("*.py"))


def test_every_group_is_placed_in_the_table():
    groups = {group_of(module) for _, module in all_modules()} - {"localai_tw"}
    assert groups <= set(ALLOWED), f"place these in ALLOWED: {sorted(groups - set(ALLOWED))}"


@pytest.mark.parametrize("path, module", all_modules(), ids=lambda v: getattr(v, "name", v))
def test_imports_follow_the_layers(path, module):
    mine = group_of(module)
    wrong = []
    for name in sorted(imported_modules(path, module)):
        theirs = group_of(name)
        if theirs in (mine, "localai_tw"):
            continue
        if theirs == "worker" and module in MAY_IMPORT_WORKER:
            continue
        if theirs not in ALLOWED.get(mine, set()):
            wrong.append(f"{module} imports {name} ({mine} may import: "
                         f"{', '.join(sorted(ALLOWED.get(mine, ()))) or 'nothing of ours'})")
    assert not wrong, "\n".join(wrong)
