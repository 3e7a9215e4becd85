"""Backends as real processes: the check that an optional extra is installed (skipped locally,
failed in CI) and one gRPC call to a running backend (the transformers, bert-numpy and
model-folder tests, and the cluster e2e suite's model files)."""

from __future__ import annotations

from localai_tw.backends import backend_pb2_grpc
from tests.heavy import missing, skip_or_fail


def require_extra(*modules: str, what: str) -> None:
    """Skip when ``modules`` are missing -- except in CI (``CI=true``) or with
    ``LOCALAI_REQUIRE_HEAVY=1``: then fail, because a suite that silently skips must not report
    success there (``.ci/install-heavy-extras`` installs them)."""
    absent = missing(*modules)
    if absent:
        skip_or_fail(f"{what} is not installed (missing {', '.join(absent)})")


def call_backend(record, method, request):
    """One call to a supervised backend (``record``: a ``BackendProcess``), presenting the
    process's own gRPC token as the replicas do."""
    from tests.integration.support import backend_channel

    channel = backend_channel(record)
    try:
        return getattr(backend_pb2_grpc.BackendStub(channel), method)(request, timeout=60)
    finally:
        channel.close()
