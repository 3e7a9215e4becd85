"""Pieces the e2e tests of the user's path share: a free loopback port for a ``twistd`` to
listen on, and the check that an optional extra is installed (skipped locally, failed in CI or
with ``LOCALAI_REQUIRE_HEAVY=1``)."""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest


def require_modules(*modules: str, extra: str) -> None:
    """Skip (locally) or fail (CI) when ``modules`` are not importable."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    message = (f"needs {', '.join(missing)}: bash .ci/install-heavy-extras "
               f"(or pip install 'localai-tw[{extra}]')")
    if os.environ.get("CI", "").lower() == "true" or \
            os.environ.get("LOCALAI_REQUIRE_HEAVY", "") == "1":
        pytest.fail(message + " [failing because CI=true or LOCALAI_REQUIRE_HEAVY=1]",
                    pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
