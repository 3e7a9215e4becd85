"""The commands README.md gives, read from the file so a test and the README cannot drift.

A command is the first non-fence line after an HTML comment marker such as
``<!-- main-command -->``; its parts are separated by ``&&`` as a user pastes them.
"""

from __future__ import annotations

import shlex
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def command(marker: str) -> str:
    """The one-line command after ``<!-- marker -->`` in README.md."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    at = lines.index(f"<!-- {marker} -->")
    return next(line for line in lines[at + 1:] if line.strip() and not line.startswith("```"))


def block(marker: str) -> str:
    """The whole fenced block after ``<!-- marker -->`` in README.md (a script of several
    lines, as a user pastes it into a shell)."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    at = lines.index(f"<!-- {marker} -->")
    opening = next(i for i in range(at + 1, len(lines)) if lines[i].startswith("```"))
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[opening + 1:closing]) + "\n"


def parts(marker: str) -> list[str]:
    """The ``&&``-separated steps of that command, stripped."""
    return [part.strip() for part in command(marker).split("&&")]


def main_install_steps() -> list[str]:
    """The steps of the main command that come before ``twistd`` (the installs)."""
    steps = parts("main-command")
    at = next(i for i, step in enumerate(steps) if step.startswith("twistd "))
    return steps[:at]


def main_twistd_args() -> list[str]:
    """The arguments of the main command's ``twistd`` step (after the word ``twistd``)."""
    step = next(step for step in parts("main-command") if step.startswith("twistd "))
    return shlex.split(step)[1:]


def doc_command(document: str, marker: str) -> str:
    """The one-line command after ``<!-- marker -->`` in ``docs/<document>``."""
    lines = (REPO_ROOT / "docs" / document).read_text().splitlines()
    at = lines.index(f"<!-- {marker} -->")
    return next(line for line in lines[at + 1:] if line.strip() and not line.startswith("```"))
