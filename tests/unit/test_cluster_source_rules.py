"""Source rules of the cluster package, checked by reading the code itself.

- Epochs are unique but not ordered: they may be compared with ``=``/``==``/``!=`` only.
- Liveness, presence and ages are decided by the database clock: the package never reads the
  process clock.
"""

import ast
import pathlib
import re

import pytest

import localai_tw.cluster as cluster_pkg

PACKAGE = pathlib.Path(cluster_pkg.__file__).parent
SOURCES = sorted(PACKAGE.rglob("*.py"))

ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
# In SQL text: an identifier containing "epoch" on either side of <, <=, >, >= (not <>, not =>).
SQL_EPOCH_ORDER = re.compile(
    r"[\w.]*epoch\w*\s*(<(?![>=])|<=|>(?!=)|>=)|(?<![<=-])(<|<=|>|>=)\s*[\w.]*epoch\w*",
    re.IGNORECASE)


def _names(node: ast.AST) -> list[str]:
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.append(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.append(sub.attr)
        elif isinstance(sub, ast.arg):
            out.append(sub.arg)
    return out


def epoch_order_violations(source: str, filename: str = "<src>") -> list[str]:
    """Every ordering comparison with an epoch-named operand, in Python or in SQL strings."""
    found = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, ORDERING) for op in node.ops):
            operands = [node.left, *node.comparators]
            if any("epoch" in name.lower() for o in operands for name in _names(o)):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and _names(node.func)[-1:] in (["max"], ["min"], ["sorted"]):
            if any("epoch" in name.lower() for a in node.args for name in _names(a)):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for m in SQL_EPOCH_ORDER.finditer(node.value):
                found.append(f"{filename}:{node.lineno}: SQL {m.group(0)!r}")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_epochs_are_compared_for_equality_only(path):
    assert epoch_order_violations(path.read_text(encoding="utf-8"), path.name) == []


@pytest.mark.parametrize("bad", [
    "if epoch > current: pass",
    "ok = row.epoch <= claim_epoch",
    "newest = max(epochs)",
    "SQL = 'UPDATE t SET x = 1 WHERE epoch < %s'",
    "SQL = 'WHERE %s >= node_connections.epoch'",
])
def test_the_epoch_check_catches_ordering(bad):
    assert epoch_order_violations(bad)


@pytest.mark.parametrize("fine", [
    "ok = epoch == other_epoch",
    "ok = epoch != 3",
    "SQL = 'WHERE epoch = %s AND owner <> %s'",
    "SQL = 'make_interval(secs => %s) AND epoch = 1'",
    "if count > 3: pass",
])
def test_the_epoch_check_allows_equality(fine):
    assert epoch_order_violations(fine) == []


PROCESS_CLOCK = re.compile(
    r"\btime\.(time|monotonic|perf_counter)\s*\(|\bdatetime\.(now|utcnow|today)\s*\("
    r"|\bdate\.today\s*\(|\.seconds\s*\(\s*\)")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_the_cluster_package_never_reads_the_process_clock(path):
    hits = [f"{path.name}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if PROCESS_CLOCK.search(line)]
    assert hits == []
