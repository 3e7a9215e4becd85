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

BASE = {"errors", "deferreds", "config", "logsafe", "logs", "periodic", "nodekey", "servicetree"}

#: The frontend's sub-packages, each a group of its own (docs/architecture.md, "Rooms").
FRONTEND_ROOMS = {"api", "inference", "jobs", "gallery"}

#: group -> the groups it may import (besides itself and BASE, which every group may import).
#: BASE modules import nothing of ours.  Every entry is used by some module of the group
#: (``test_every_allowed_import_is_used``): the table says what the code does, no more.
ALLOWED: dict[str, set[str]] = {
    **{name: set() for name in BASE},
    "mux": set(),
    "splice": {"mux"},
    "db": set(),
    "cluster": {"db"},
    "bus": {"db", "cluster"},
    "web": set(),  # the HTTP pieces both servers share (bearer rule, bodies, JSON, readers)
    "staging_client": {"web"},
    "threadwriter": set(),  # file writes and hashing off the reactor (downloads, staging)
    "contentstore": set(),  # one copy of a model file per digest (worker staging, downloads)
    "metrics": set(),  # every Prometheus metric in one place (docs/metrics.md)
    "tinychat": set(),  # a user's tool (python -m localai_tw.tinychat): builds a local model
    "tinygguf": set(),  # a user's tool (python -m localai_tw.tinygguf): builds a local GGUF
    "localai": set(),  # LocalAI's formats: model configs, Go templates, GBNF, tool calls
    "tunnel": {"mux", "splice", "db", "cluster", "staging_client", "web"},
    "backends": {"plugins"},  # plugins: the drop-in package IBackendFactory scans
    "plugins": {"backends", "jobs"},
    # jobs: the IJobKind seam and the built-in kinds, shared by the frontend (validation) and
    # the agent worker (runs); plugins: the drop-in package IJobKind is scanned in
    "jobs": {"web", "plugins"},
    # a worker never talks to PostgreSQL: no db, bus or cluster
    "worker": {"splice", "tunnel", "backends", "staging_client", "web", "metrics", "jobs",
               "contentstore"},
    # the inference core knows no HTTP: never frontend.api
    "frontend.inference": {"backends", "cluster", "contentstore", "localai", "metrics",
                           "splice", "staging_client", "threadwriter", "tunnel", "web"},
    "frontend.jobs": {"bus", "cluster", "jobs"},
    "frontend.gallery": {"bus", "cluster", "db", "frontend.inference", "localai", "web"},
    "frontend.api": {"backends", "cluster", "db", "frontend.gallery", "frontend.inference",
                     "frontend.jobs", "jobs", "localai", "metrics", "tunnel", "web"},
    # the composition root (service.py, tap.py, localworker.py): builds the replica
    "frontend": {"backends", "bus", "cluster", "db", "frontend.api", "frontend.gallery",
                 "frontend.inference", "frontend.jobs", "jobs", "localai", "metrics", "tunnel",
                 "web"},
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
    if len(parts) > 2 and parts[1] == "frontend" and parts[2] in FRONTEND_ROOMS:
        return f"frontend.{parts[2]}"
    return parts[1] if len(parts) > 1 else "localai_tw"


def _nodes(tree: ast.AST, runtime_only: bool):
    """Every node of ``tree``; with ``runtime_only``, none under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if runtime_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_nodes(child, True)])
            continue
        yield node
        yield from _nodes(node, runtime_only)


def imported_modules(path: Path, module: str, runtime_only: bool = False) -> set[str]:
    """Every ``localai_tw`` module ``path`` imports (``from localai_tw import x`` counts as
    ``localai_tw.x``); with ``runtime_only``, not the ones only a type checker reads."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text(), str(path)), runtime_only):
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
        if theirs in (mine, "localai_tw") or theirs in BASE:
            continue
        if theirs == "worker" and module in MAY_IMPORT_WORKER:
            continue
        if theirs not in ALLOWED.get(mine, set()):
            wrong.append(f"{module} imports {name} ({mine} may import: "
                         f"{', '.join(sorted(ALLOWED.get(mine, ()))) or 'nothing of ours'})")
    assert not wrong, "\n".join(wrong)


def _group_imports() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    for path, module in all_modules():
        mine = group_of(module)
        for name in imported_modules(path, module):
            theirs = group_of(name)
            if theirs not in (mine, "localai_tw"):
                used.setdefault(mine, set()).add(theirs)
    return used


def test_every_allowed_import_is_used():
    """An allowance nobody uses is a door left open: the table says what the code does."""
    used = _group_imports()
    stale = {group: sorted(allowed - used.get(group, set()))
             for group, allowed in ALLOWED.items() if allowed - used.get(group, set())}
    assert not stale, f"remove from ALLOWED, nothing uses them: {stale}"


def test_no_import_circles():
    """No two modules of ours import each other, directly or round a loop, function-level
    imports included (a circle hidden in a function is still a circle); an import only a type
    checker reads is not one."""
    graph = {module: {name for name in imported_modules(path, module, runtime_only=True)
                      if name != module and name != "localai_tw"}
             for path, module in all_modules()}
    # a package's face imports its own modules; that is not a circle through the package
    for module, names in graph.items():
        names.difference_update(n for n in list(names) if module.startswith(n + "."))
    seen: dict[str, int] = {}
    circles = []

    def visit(module: str, stack: list[str]) -> None:
        seen[module] = 1
        stack.append(module)
        for name in sorted(graph.get(module, ())):
            if seen.get(name) == 1:
                circles.append(" -> ".join(stack[stack.index(name):] + [name]))
            elif name not in seen:
                visit(name, stack)
        stack.pop()
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)
