"""The tests' own layout (issue 23): shared helpers live in support modules, never in a
``test_*`` module that other tests import.

Importing a test module runs its module-level code a second time and, with pytest, collects
its tests into the importer's namespace; a helper hidden in ``test_x.py`` is also invisible to
whoever looks for the harness.  So every fixture, fake and helper that two modules share sits
in ``support*.py`` / ``harness_*.py`` (or a ``conftest.py``), and each ``test_*`` module holds
tests.  Function-level imports count as much as module-level ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every module and imported name in ``source``, relative imports
    resolved against ``package`` (the importing module's package, e.g. ``tests.unit``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # ``from tests.unit import test_x`` imports a module by its name
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def imports_of_test_modules(source: str, package: str) -> list[str]:
    """The ``tests.*.test_*`` modules that ``source`` imports, as "line: name"."""
    return [f"{line}: {name}" for line, name in imported_modules(source, package)
            if name.split(".")[0] == "tests" and name.split(".")[-1].startswith("test_")]


def python_files():
    return sorted(TESTS.rglob("*.py"))


def package_of(path: Path) -> str:
    return ".".join(("tests",) + path.relative_to(TESTS).parent.parts).rstrip(".")


@pytest.mark.parametrize("source, package", [
    ("from .test_claims import make_live", "tests.integration"),
    ("from tests.integration.test_tunnel_harness import TOKEN", "tests.unit"),
    ("from tests.unit import test_worker_control", "tests.unit"),
    ("import tests.e2e.test_one_machine", "tests.e2e"),
    ("def f():\n    from ..unit.test_openai_fakes import call\n", "tests.integration"),
])
def test_the_check_sees_every_form_of_import(source, package):
    assert imports_of_test_modules(source, package), source


@pytest.mark.parametrize("source, package", [
    ("from .support import eventually", "tests.integration"),
    ("from .harness_tunnel import TOKEN", "tests.integration"),
    ("from tests.unit.support_openai import call", "tests.integration"),
    ("from localai_tw.frontend import test_seams_do_not_exist", "tests.unit"),
])
def test_the_check_leaves_support_modules_and_the_product_alone(source, package):
    assert imports_of_test_modules(source, package) == []


def test_no_test_module_imports_another_test_module():
    """Break: ``from .test_claims import make_live`` in test_claims_batch.py -> red, naming it."""
    offenders = []
    for path in python_files():
        for hit in imports_of_test_modules(path.read_text(), package_of(path)):
            offenders.append(f"{path.relative_to(TESTS.parent)}:{hit}")
    assert offenders == [], (
        "a test module imports another test module; move what they share into a support "
        "module (support*.py, harness_*.py) or a conftest.py:\n  " + "\n  ".join(offenders))


def is_test(node) -> bool:
    """A ``test_*`` function, or a ``Test*`` class with one (a ``TestWorker`` harness is not)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name.startswith("test")
    return (isinstance(node, ast.ClassDef) and node.name.startswith("Test")
            and any(is_test(child) for child in node.body))


def test_every_test_module_holds_tests():
    """A ``test_*`` module without a test is a harness under a test's name."""
    empty = []
    for path in python_files():
        if not path.name.startswith("test_"):
            continue
        if not any(is_test(node) for node in ast.parse(path.read_text()).body):
            empty.append(str(path.relative_to(TESTS.parent)))
    assert empty == [], f"test modules without a test (rename them support_*/harness_*): {empty}"
