"""Backends as real processes: the check that an optional extra is installed (skipped locally,
failed in CI) and one gRPC call to a running backend (the transformers, bert-numpy and
model-folder tests, and the cluster e2e suite's model files), and an echo backend started on a
worker through a replica's control channel (the call-stream and bridge route tests)."""

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


async def started_echo_backend(frontend, node_id, model="m", options=None) -> int:
    """Start an ``echo`` backend on ``node_id`` through ``frontend``'s control channel; its
    port."""
    reply = await frontend.replica.control.call(node_id, "backend.start",
                                                {"backend": "echo", "model": model,
                                                 "options": options or {}}, timeout=60)
    assert reply["success"], reply
    return int(reply["address"].rsplit(":", 1)[1])
