"""The one rule for a test whose dependencies are missing (the heavy extras, the llama build):
skipped on a developer's machine, a failure with ``CI=true`` or ``LOCALAI_REQUIRE_HEAVY=1``,
because a suite that silently skips must not report success there
(``.ci/install-heavy-extras`` installs them)."""

from __future__ import annotations

import importlib.util
import os
from typing import NoReturn

import pytest


def missing(*modules: str) -> list[str]:
    """Those of ``modules`` that cannot be imported."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def skip_or_fail(message: str) -> NoReturn:
    """Skip with ``message``, or fail with it in CI."""
    if os.environ.get("CI", "").lower() == "true" or \
            os.environ.get("LOCALAI_REQUIRE_HEAVY", "") == "1":
        pytest.fail(message + " [failing because CI=true or LOCALAI_REQUIRE_HEAVY=1]",
                    pytrace=False)
    pytest.skip(message)
