"""The gRPC bridge (``--backend-calls grpc``, and the fallback for older workers) with a real
worker: Health through it; a route failure (tunnel gone) is
recorded and raised as its condition; a stopped backend behind a live tunnel is the worker's
answer (StreamRefused ``unavailable``); a backend status is a BackendAnswer; streams keep order
and backpressure and are cancellable; bridges leave no socket behind."""

from __future__ import annotations

import os
import stat

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task

from localai_tw import errors
from localai_tw.backends import backend_pb2

from .harness_backends import started_echo_backend as started_backend
from .support import eventually


@pytest_twisted.ensureDeferred
async def test_health_through_the_bridge_and_a_backend_status_is_its_answer(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.bridged(worker.node_id, port)
    bridge = client.bridge
    mode = stat.S_IMODE(os.stat(os.path.dirname(bridge.socket_path)).st_mode)
    assert mode == 0o700
    reply = await client.call("Health", backend_pb2.HealthMessage())
    assert reply.message == b"OK"
    assert bridge.last_dial_error is None and bridge.dials_ok >= 1
    # no model loaded: the backend answers FAILED_PRECONDITION through a working route
    with pytest.raises(errors.BackendAnswer) as caught:
        await client.call("Predict", backend_pb2.PredictOptions(Prompt="x"))
    assert caught.value.code == "FAILED_PRECONDITION" and "not loaded" in caught.value.details
    assert errors.may_act_on(caught.value)


@pytest_twisted.ensureDeferred
async def test_a_stopped_backend_behind_a_live_tunnel_is_the_workers_answer(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.bridged(worker.node_id, port)
    assert (await client.call("Health", backend_pb2.HealthMessage())).message == b"OK"
    stopped = await frontend.replica.control.call(worker.node_id, "backend.stop", {"model": "m"},
                                          timeout=30)
    assert stopped["success"]
    with pytest.raises(errors.StreamRefused) as caught:
        await client.call("Health", backend_pb2.HealthMessage(),
                          deadline=reactor.seconds() + 10)
    assert caught.value.code == "unavailable"
    assert isinstance(caught.value, errors.WorkerAnswer)
    assert isinstance(client.bridge.last_dial_error, errors.StreamRefused)


@pytest_twisted.ensureDeferred
async def test_with_the_tunnel_gone_the_call_fails_with_the_route_condition(cluster):
    frontend = await cluster.frontend("replica-a", **{"reconnect-grace": 1.0})
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.bridged(worker.node_id, port)
    assert (await client.call("Health", backend_pb2.HealthMessage())).message == b"OK"
    # Drop the HTTP/2 connection so the next call needs a new stream, then take the worker
    # away: its tunnel goes and nothing redials it.
    await frontend.replica.backend_clients.drop(worker.node_id, port)
    await worker.stopService()
    await eventually(lambda: not frontend.replica.tunnels.holds(worker.node_id), timeout=20)

    client = frontend.replica.backend_clients.bridged(worker.node_id, port)
    with pytest.raises(errors.AbsentWithinGrace):
        await client.call("Health", backend_pb2.HealthMessage(),
                          deadline=reactor.seconds() + 10)
    assert isinstance(client.bridge.last_dial_error, errors.AbsentWithinGrace)
    assert not errors.may_act_on(client.bridge.last_dial_error)

    # Past the 1 s grace the worker is gone.  grpcio redials on its own backoff (at most 1 s)
    # and fails fast in between with the condition of its latest dial, so allow a few calls.
    async def gone():
        try:
            await client.call("Health", backend_pb2.HealthMessage(),
                              deadline=reactor.seconds() + 10)
        except errors.WorkerGone as e:
            return e
        except errors.AbsentWithinGrace:
            return None

    caught = await eventually(gone, timeout=8, what="WorkerGone")
    assert isinstance(caught, errors.RoutingFact)
    assert client.bridge.last_dial_error is caught


@pytest_twisted.ensureDeferred
async def test_streams_keep_order_wait_for_the_consumer_and_cancel(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.bridged(worker.node_id, port)
    loaded = await client.call("LoadModel", backend_pb2.ModelOptions(Model="m"))
    assert loaded.success

    got, times = [], []

    def slow_consumer(reply):
        got.append(reply.message)
        times.append(reactor.seconds())
        return task.deferLater(reactor, 0.1, lambda: None)

    await client.stream("PredictStream", backend_pb2.PredictOptions(Prompt="w1 w2 w3 w4"),
                        slow_consumer)
    assert [m.strip() for m in got] == [b"w1", b"w2", b"w3", b"w4"]
    # each item was read only after the previous consumer Deferred fired
    assert all(b - a >= 0.09 for a, b in zip(times, times[1:]))

    # cancelling the Deferred cancels the RPC (a slow stream of 200 words)
    first = defer.Deferred()
    streaming = client.stream(
        "PredictStream", backend_pb2.PredictOptions(Prompt=" ".join(["w"] * 200)),
        lambda r: None if first.called else first.callback(r))
    await first
    streaming.cancel()
    with pytest.raises(defer.CancelledError):
        await streaming


@pytest_twisted.ensureDeferred
async def test_forget_and_close_remove_the_sockets(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    bridge = frontend.replica.backend_clients.bridged(worker.node_id, port).bridge
    other = frontend.replica.backend_clients.bridged("some-other-node", 40000).bridge
    assert os.path.exists(bridge.socket_path) and os.path.exists(other.socket_path)
    await frontend.replica.backend_clients.forget(worker.node_id)
    assert not os.path.exists(bridge.socket_path) and bridge.closed
    assert os.path.exists(other.socket_path)
    await frontend.stopService()
    assert not os.path.exists(other.socket_path)


@pytest_twisted.ensureDeferred
async def test_a_call_cut_by_closing_the_client_is_a_transport_failure(cluster):
    """Closing the channel (a dropped or forgotten backend) ends the calls in flight: that is
    this replica's doing, never the backend's answer (which may reap the model) nor a
    cancellation the caller did not make."""
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.bridged(worker.node_id, port)
    assert (await client.call("LoadModel", backend_pb2.ModelOptions(Model="m"))).success
    first = defer.Deferred()
    streaming = client.stream(
        "PredictStream", backend_pb2.PredictOptions(Prompt=" ".join(["w"] * 200)),
        lambda r: None if first.called else first.callback(r))
    await first
    client.close()
    with pytest.raises(errors.TransportFailure) as caught:
        await streaming
    assert not errors.may_act_on(caught.value)
    with pytest.raises(errors.TransportFailure):
        await client.call("Health", backend_pb2.HealthMessage())
