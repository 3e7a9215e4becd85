"""ControlClient and WorkerHTTPClient against the real worker control site, over real tunnels
(locally held and relayed), with real PostgreSQL."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer, protocol, reactor, task

from localai_tw import errors
from localai_tw.tunnel.endpoint import (
    ControlClient,
    WorkerStreamEndpoint,
    control_path,
    node_of_host,
    worker_url,
)
from localai_tw.worker.control import NoFreeSlot, VerbRequestSchema
from tests.integration.harness_tunnel import TOKEN, only_condition
from tests.integration.support import eventually, failure_of, within


@pytest.fixture
def verbs(real_worker):
    v = real_worker.verbs
    v.register("node.echo", lambda body: {"echo": body})
    v.register("node.fails", lambda body: {"error": "disk full"})
    v.register("node.quiet", lambda body: None)

    def busy(body):
        raise NoFreeSlot()

    v.register("node.busy", busy)
    v.register("node.strict", lambda body: {},
               schema=VerbRequestSchema({"n": int}, frozenset({"n"})))

    async def install(body, progress):
        for step in range(3):
            await progress({"step": step})
        return {"success": True, "address": "127.0.0.1:50051"}

    v.register("backend.install", install, streaming=True)
    hang = defer.Deferred()

    async def stalls(body, progress):
        await progress({"step": 0})
        await hang
        return {}

    v.register("backend.stalls", stalls, streaming=True)
    yield v
    if not hang.called:
        hang.callback(None)


@pytest.fixture(params=["local", "relayed"])
def route(request):
    return request.param


async def setup(frontends, workers, real_worker, route):
    a = await frontends("replica-a")
    caller = a
    if route == "relayed":
        caller = await frontends("replica-b")
    worker = await workers(a.nodes, "w-ctl", real_worker.router)
    await worker.attach_to(a)
    return a, caller, worker, ControlClient(caller.http, TOKEN)


def test_urls_and_paths():
    assert worker_url("abc-1", "/v1/x") == "http://abc-1.worker.invalid/v1/x"
    assert node_of_host(b"abc-1.worker.invalid") == "abc-1"
    assert control_path("backend.install") == "/v1/control/backend/install"
    with pytest.raises(ValueError):
        node_of_host("example.com")
    with pytest.raises(ValueError):
        control_path("../x")


@pytest_twisted.ensureDeferred
async def test_status_contract_maps_onto_the_conditions(db, frontends, workers, real_worker,
                                                        verbs, route):
    _, _, worker, control = await setup(frontends, workers, real_worker, route)
    node = worker.node_id
    assert await within(control.call(node, "node.echo", {"a": 1})) == {"echo": {"a": 1}}
    assert await within(control.call(node, "node.quiet")) is None
    only_condition(await failure_of(control.call(node, "node.fails")), errors.ControlVerbFailed)
    only_condition(await failure_of(control.call(node, "node.nope")), errors.VerbNotServed)
    only_condition(await failure_of(control.call(node, "node.busy")), errors.WorkerBusy)
    error = await failure_of(control.call(node, "node.strict", {"n": "x"}))
    assert isinstance(error, errors.TunnelProtocolError)  # 400: a frontend bug, not evidence
    assert not isinstance(error, (errors.WorkerAnswer, errors.RoutingFact))
    bad_token = ControlClient(control._http, "wrong-token")
    error = await failure_of(bad_token.call(node, "node.echo"))
    assert isinstance(error, errors.TunnelProtocolError)


@pytest_twisted.ensureDeferred
async def test_streaming_verb_reports_progress_then_the_reply(db, frontends, workers, real_worker,
                                                              verbs, route):
    _, _, worker, control = await setup(frontends, workers, real_worker, route)
    progress = []
    reply = await within(control.call(worker.node_id, "backend.install", {"backend": "x"},
                                      on_progress=progress.append))
    assert progress == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert reply == {"success": True, "address": "127.0.0.1:50051"}


@pytest_twisted.ensureDeferred
async def test_stream_ending_without_reply_line_is_a_transport_failure(
        db, frontends, workers, real_worker, verbs, route):
    _, _, worker, control = await setup(frontends, workers, real_worker, route)
    progress = []
    calling = control.call(worker.node_id, "backend.stalls", on_progress=progress.append)
    await eventually(lambda: progress, what="the first progress line")
    worker.close()  # the tunnel drops mid-reply
    only_condition(await failure_of(calling), errors.TransportFailure)


@pytest_twisted.ensureDeferred
async def test_control_timeout_is_the_callers(db, frontends, workers, real_worker, verbs, route):
    _, _, worker, control = await setup(frontends, workers, real_worker, route)
    error = await failure_of(control.call(worker.node_id, "backend.stalls", timeout=0.5))
    only_condition(error, errors.CallerDeadlineExceeded)


@pytest_twisted.ensureDeferred
async def test_dial_failures_pass_through_unchanged(db, frontends, workers, real_worker, verbs):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-never", real_worker.router)  # never dials
    control = ControlClient(a.http, TOKEN)
    error = await failure_of(control.call(worker.node_id, "node.echo"))
    only_condition(error, errors.WorkerUnroutable)
    assert "no route" in str(error)


@pytest_twisted.ensureDeferred
async def test_connections_are_pooled_per_node_and_forget_drops_them(
        db, frontends, workers, real_worker, verbs):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-ctl", real_worker.router)
    session = await worker.attach_to(a)
    control = ControlClient(a.http, TOKEN)
    for _ in range(3):
        await within(control.call(worker.node_id, "node.echo"))
    assert a.http.worker_agent.nodes() == [worker.node_id]
    # Sequential calls reuse one persistent connection: one stream on the worker's session.
    assert session.streamCount == 1
    await within(a.http.forget(worker.node_id))
    assert a.http.worker_agent.nodes() == []
    await eventually(lambda: session.streamCount == 0, what="the pooled stream to close")
    assert await within(control.call(worker.node_id, "node.echo", {"b": 2})) == {"echo": {"b": 2}}


@pytest_twisted.ensureDeferred
async def test_stream_endpoint_connects_any_factory(db, frontends, workers, real_worker):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-ep", real_worker.router)
    await worker.attach_to(a)

    class Echoed(protocol.Protocol):
        def __init__(self):
            self.got = defer.Deferred()

        def dataReceived(self, data):
            self.got.callback(data)

    endpoint = WorkerStreamEndpoint(a.dialer, worker.node_id, "grpc",
                                    f"127.0.0.1:{real_worker.backend_port}")
    proto = await within(endpoint.connect(protocol.Factory.forProtocol(Echoed)))
    proto.transport.write(b"ping")
    assert await within(proto.got) == b"ping"
    await task.deferLater(reactor, 0, lambda: None)
