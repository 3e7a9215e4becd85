"""Pieces the e2e tests of the user's path share: a free loopback port for a ``twistd`` to
listen on, and the check that an optional extra is installed (skipped locally, failed in CI or
with ``LOCALAI_REQUIRE_HEAVY=1``)."""

from __future__ import annotations

import socket

from tests.heavy import missing, skip_or_fail


def require_modules(*modules: str, extra: str) -> None:
    """Skip (locally) or fail (CI) when ``modules`` are not importable."""
    absent = missing(*modules)
    if absent:
        skip_or_fail(f"needs {', '.join(absent)}: bash .ci/install-heavy-extras "
                     f"(or pip install 'localai-tw[{extra}]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
