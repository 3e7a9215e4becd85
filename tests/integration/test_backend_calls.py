"""Backend calls on ``call`` tunnel streams with a real replica, a real worker and the echo
backend: answers and statuses pass through, a stream is held by a slow consumer and stopped by a
cancel, the deadline is the caller's, no backend on the port is the worker's ``unavailable``,
the relay carries ``call`` streams, and a worker that refuses the tag is served through the
bridge without anything reaped.  Keep-alive: later calls reuse the stream (locally and through
the relay), and a pooled stream whose backend stopped answers the worker's refusal."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task

from localai_tw import errors
from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.tunnelcalls import TunnelBackendClient
from localai_tw.tunnel import preamble
from localai_tw.worker import streams

from .harness_backends import started_echo_backend as started_backend
from .support import eventually


async def loaded(client, **options):
    result = await client.call("LoadModel", backend_pb2.ModelOptions(Model="m", **options),
                               reactor.seconds() + 30)
    assert result.success, result.message


@pytest_twisted.ensureDeferred
async def test_unary_answers_and_backend_statuses_pass_through(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.client(worker.node_id, port)
    assert isinstance(client, TunnelBackendClient)
    reply = await client.call("Health", backend_pb2.HealthMessage())
    assert reply.message == b"OK"
    assert client.dials_ok == 1 and client.in_flight == 0 and client.idle_streams == 1
    # no model loaded: the backend's own status, as it answered it
    with pytest.raises(errors.BackendAnswer) as caught:
        await client.call("Predict", backend_pb2.PredictOptions(Prompt="x"))
    assert caught.value.code == "FAILED_PRECONDITION" and "not loaded" in caught.value.details
    await loaded(client)
    answer = await client.call("Predict", backend_pb2.PredictOptions(Prompt="hello"))
    assert b"hello" in answer.message
    # keep-alive: one stream carried all four calls
    assert client.dials_ok == 1 and client.streams_reused == 3 and client.idle_streams == 1
    # nothing was bridged
    assert frontend.replica.backend_clients.bridges.get(worker.node_id, port) is None


@pytest_twisted.ensureDeferred
async def test_a_stream_keeps_order_and_a_slow_consumer_holds_it(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.client(worker.node_id, port)
    await loaded(client)
    items, gates = [], []

    def on_item(reply):
        items.append(reply.message)
        gate = defer.Deferred()
        gates.append(gate)
        return gate

    words = " ".join(f"w{i}" for i in range(40))
    done = client.stream("PredictStream", backend_pb2.PredictOptions(Prompt=words), on_item)
    await eventually(lambda: len(items) == 1, timeout=10, what="first item")
    await task.deferLater(reactor, 0.3, lambda: None)
    assert len(items) == 1 and not done.called  # held while the first item is not consumed
    while not done.called:
        gates[-1].callback(None)
        await task.deferLater(reactor, 0.01, lambda: None)
    await done
    assert b"".join(items).split() == words.encode().split()


@pytest_twisted.ensureDeferred
async def test_cancel_mid_stream_stops_the_backend_call(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.client(worker.node_id, port)
    await loaded(client, Options=["echo.delay_ms:200"])
    items = []
    done = client.stream("PredictStream",
                         backend_pb2.PredictOptions(Prompt=" ".join(["x"] * 200)),
                         items.append)
    await eventually(lambda: len(items) >= 2, timeout=10, what="two items")
    done.cancel()
    with pytest.raises(defer.CancelledError):
        await done
    assert client.in_flight == 0
    seen = len(items)
    # the worker cancelled the gRPC call: the backend stops generating (no longer BUSY)
    busy = backend_pb2.StatusResponse.BUSY

    async def backend_state():
        return (await client.call("Status", backend_pb2.HealthMessage())).state

    for _ in range(50):
        if await backend_state() != busy:
            break
        await task.deferLater(reactor, 0.1, lambda: None)
    assert await backend_state() != busy
    assert len(items) == seen
    # the backend is free again: a new call is served at once
    assert (await client.call("Health", backend_pb2.HealthMessage())).message == b"OK"


@pytest_twisted.ensureDeferred
async def test_the_deadline_is_the_callers(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.client(worker.node_id, port)
    await loaded(client, Options=["echo.delay_ms:500"])
    with pytest.raises(errors.CallerDeadlineExceeded):
        await client.stream("PredictStream",
                            backend_pb2.PredictOptions(Prompt="a b c d e f g"),
                            lambda item: None, reactor.seconds() + 0.8)
    assert client.in_flight == 0


@pytest_twisted.ensureDeferred
async def test_no_backend_on_the_port_is_the_workers_unavailable(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.client(worker.node_id, port)
    stopped = await frontend.replica.control.call(worker.node_id, "backend.stop",
                                                  {"model": "m"}, timeout=30)
    assert stopped["success"]
    with pytest.raises(errors.StreamRefused) as caught:
        await client.call("Health", backend_pb2.HealthMessage(), reactor.seconds() + 10)
    assert caught.value.code == preamble.UNAVAILABLE
    assert errors.may_act_on(caught.value)
    # a port outside the worker's range is the worker's bad-request
    outside = frontend.replica.backend_clients.client(worker.node_id, 1)
    with pytest.raises(errors.StreamRefused) as caught:
        await outside.call("Health", backend_pb2.HealthMessage(), reactor.seconds() + 10)
    assert caught.value.code == preamble.BAD_REQUEST


@pytest_twisted.ensureDeferred
async def test_calls_go_through_the_owner_replica(cluster):
    owner = await cluster.frontend("replica-a")
    other = await cluster.frontend("replica-b")
    worker = await cluster.worker("w1", owner)
    port = await started_backend(owner, worker.node_id)
    assert not other.replica.tunnels.holds(worker.node_id)
    client = other.replica.backend_clients.client(worker.node_id, port)
    first_deadline = reactor.seconds() + 2
    assert (await client.call("Health", backend_pb2.HealthMessage(),
                              first_deadline)).message == b"OK"
    # the relayed stream is pooled and carries the next calls, past the first call's deadline
    # (nothing on the relay holds an established stream to it)
    await task.deferLater(reactor, first_deadline - reactor.seconds() + 0.2, lambda: None)
    for _ in range(3):
        assert (await client.call("Health", backend_pb2.HealthMessage(),
                                  reactor.seconds() + 1)).message == b"OK"
    await loaded(client)
    items = []
    await client.stream("PredictStream", backend_pb2.PredictOptions(Prompt="a b c"),
                        items.append, reactor.seconds() + 20)
    assert b"".join(i.message for i in items).split() == [b"a", b"b", b"c"]
    assert client.dials_ok == 1 and client.streams_reused == 5 and client.idle_streams == 1


@pytest_twisted.ensureDeferred
async def test_a_pooled_stream_whose_backend_stopped_is_the_workers_refusal(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.client(worker.node_id, port)
    assert (await client.call("Health", backend_pb2.HealthMessage())).message == b"OK"
    assert client.idle_streams == 1
    stopped = await frontend.replica.control.call(worker.node_id, "backend.stop",
                                                  {"model": "m"}, timeout=30)
    assert stopped["success"]
    with pytest.raises(errors.StreamRefused) as caught:
        await client.call("Health", backend_pb2.HealthMessage(), reactor.seconds() + 10)
    assert caught.value.code == preamble.UNAVAILABLE  # as a fresh stream's refusal: nothing ran
    assert client.streams_reused == 1 and client.idle_streams == 0


@pytest_twisted.ensureDeferred
async def test_an_older_worker_is_served_through_the_bridge(cluster, monkeypatch):
    def refuse(self, target, leftover):  # a worker from before ``call`` streams
        self._refuse(preamble.UNKNOWN_TAG, "this worker does not serve tag 'call'")

    monkeypatch.setattr(streams.WorkerStreamProtocol, "_serveCall", refuse)
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    clients = frontend.replica.backend_clients
    client = clients.client(worker.node_id, port)
    assert (await client.call("Health", backend_pb2.HealthMessage())).message == b"OK"
    assert worker.node_id in clients.old_nodes
    bridge = clients.bridges.get(worker.node_id, port)
    assert bridge is not None and bridge.dials_ok >= 1
    dials = client.dials_ok
    assert (await client.call("Health", backend_pb2.HealthMessage())).message == b"OK"
    assert client.dials_ok == dials  # not asked again: straight to the bridge
    assert client.in_flight == 0


@pytest_twisted.ensureDeferred
async def test_concurrent_calls_each_take_a_stream_and_the_next_round_reuses_them(cluster):
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    port = await started_backend(frontend, worker.node_id)
    client = frontend.replica.backend_clients.client(worker.node_id, port)

    async def round_of(n):
        replies = await defer.gatherResults(
            [client.call("Health", backend_pb2.HealthMessage(), reactor.seconds() + 20)
             for _ in range(n)], consumeErrors=True)
        assert all(r.message == b"OK" for r in replies)

    await round_of(16)
    opened = client.dials_ok
    assert opened == 16 and client.idle_streams == 16  # one stream per call in flight
    await round_of(16)
    assert client.dials_ok == opened and client.streams_reused == 16
    assert client.idle_streams == 16 and client.in_flight == 0
