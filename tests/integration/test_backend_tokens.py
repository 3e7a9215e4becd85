"""Each backend process holds a gRPC token of its own, never a cluster-wide secret (issue 21
§2): a real frontend replica, a real PostgreSQL and a real worker spawning real backend
processes.  Each process's environment (``/proc/PID/environ``) holds its own random
``LOCALAI_GRPC_AUTH_TOKEN`` and not the registration token, the API key or the node's control
token; a call to a backend that presents the registration token is refused
``UNAUTHENTICATED``; the replicas call it with its own token, learnt over the control channel:
the replica that started it from ``backend.start``, another replica (relaying to the worker)
from ``backend.token``.

Red before the per-process token (the supervisor given the registration token): the
environment held the registration token and a call presenting it was served (commit
message)."""

from __future__ import annotations

import grpc
import pytest
import pytest_twisted
from twisted.internet import threads

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.nodekey import control_token, node_key_hash

from .inference_harness import ADMIN, TOKEN, supervisor_of
from .support import process_environ as _environ

ECHO = "name: {name}\nbackend: echo\nparameters:\n  model: {name}\noptions: ['echo.dim:4']\n"


def _health(address: str, token: str):
    """``Health`` on the backend at ``address`` presenting ``token`` (blocking: a thread)."""
    with grpc.insecure_channel(address) as channel:
        stub = backend_pb2_grpc.BackendStub(channel)
        return stub.Health(backend_pb2.HealthMessage(), timeout=10,
                           metadata=(("authorization", f"Bearer {token}"),))


@pytest_twisted.ensureDeferred
async def test_every_backend_process_has_its_own_token_and_refuses_the_cluster_one(cluster):
    for name in ("one", "two"):
        cluster.write_model(f"{name}.yaml", ECHO.format(name=name))
    # the tokens a replica learns are the bridged gRPC path's (``call`` streams carry none)
    a = await cluster.frontend("replica-a", **{"backend-calls": "grpc"})
    b = await cluster.frontend("replica-b", **{"backend-calls": "grpc"})
    worker = await cluster.worker("w1", a)
    for name in ("one", "two"):
        reply = await a.replica.inference.predict(name, backend_pb2.PredictOptions(Prompt="x"))
        assert reply.value.message == b"x"

    supervisor = supervisor_of(worker)
    records = [r for r in supervisor._live.values() if r.pid]
    assert len(records) == 2
    node_control = control_token(node_key_hash(worker.node_key))
    tokens = set()
    for record in records:
        environ = _environ(record.pid)
        for secret in (TOKEN, ADMIN, node_control):
            assert not any(secret in v for v in environ.values()), \
                "a cluster-wide secret in a backend's environment"
        # the registration token (what every backend accepted before) is refused ...
        with pytest.raises(grpc.RpcError) as refused:
            await threads.deferToThread(_health, record.address, TOKEN)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        token = environ["LOCALAI_GRPC_AUTH_TOKEN"]
        assert token == record.grpc_token and len(token) >= 32
        tokens.add(token)
        # ... and the process's own token is accepted
        assert (await threads.deferToThread(_health, record.address, token)).message == b"OK"
    assert len(tokens) == 2, "two processes share a token"

    # A replica that did not start the backends calls them with their own tokens too,
    # asked of the worker over the control channel (relayed through replica A).
    assert b.replica.backend_clients.tokens._known == {}
    reply = await b.replica.inference.predict("two", backend_pb2.PredictOptions(Prompt="y"))
    assert reply.value.message == b"y"
    assert set(b.replica.backend_clients.tokens._known.values()) <= tokens
    assert b.replica.backend_clients.tokens._known

    # A token that went stale (the backend restarted on the same port with a new one): the
    # backend refuses it, the replica asks again and the call is served.
    known = b.replica.backend_clients.tokens._known
    for key in known:
        known[key] = "a-token-of-a-process-that-ended"
    reply = await b.replica.inference.predict("two", backend_pb2.PredictOptions(Prompt="z"))
    assert reply.value.message == b"z"
    assert set(known.values()) <= tokens
