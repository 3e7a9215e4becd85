"""Scheduling across replicas and workers: the first request lands on the replica that does NOT
hold the worker's tunnel (everything crosses the relay); two workers with two models pinned by
labels through POST /api/nodes/scheduling; a backend crash reaps only on the worker's answer and
the next request reloads; a route failure never reaps; the load lock serialises replicas."""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from twisted.internet import defer, reactor
from twisted.web.client import HTTPConnectionPool

from localai_tw import errors
from localai_tw.backends import backend_pb2

from .inference_harness import ADMIN, sha256_hex, supervisor_of
from .support import eventually

WEIGHTS = b"relay weights " * 4000


def echo_model(name, extra=""):
    return f"name: {name}\nbackend: echo\n{extra}"


@pytest_twisted.ensureDeferred
async def test_first_request_on_the_non_owner_crosses_the_relay(cluster):
    cluster.write_file("relay.bin", WEIGHTS)
    cluster.write_model("relay.yaml", echo_model(
        "relay", f"parameters:\n  model: relay.bin\nfiles:\n  - path: relay.bin\n"
                 f"    sha256: '{sha256_hex(WEIGHTS)}'\n"))
    owner = await cluster.frontend("replica-owner")
    other = await cluster.frontend("replica-other")
    worker = await cluster.worker("w1", owner)
    assert await cluster.owner_of(worker.node_id) == "replica-owner"
    assert not other.replica.tunnels.holds(worker.node_id)

    served = await other.replica.inference.predict("relay",
                                                   backend_pb2.PredictOptions(Prompt="via relay"))
    assert served.value.message == b"via relay" and served.served_by == worker.node_id
    # the owner did not change: backend start, staging, load and predict all went through it
    assert await cluster.owner_of(worker.node_id) == "replica-owner"
    assert not other.replica.tunnels.holds(worker.node_id)
    # owner made no call: the calls were the other replica's, on ``call`` streams it relayed
    assert owner.replica.backend_clients.open_clients() == {}
    assert [node for node, _ in other.replica.backend_clients.open_clients()] == \
        [worker.node_id]
    assert other.replica.backend_clients.bridges.bridges_of(worker.node_id) == []
    rows = await cluster.rows("relay")
    assert [(r[0], r[2]) for r in rows] == [(worker.node_id, "loaded")]
    with open(rows[0][4], "rb") as f:
        assert f.read() == WEIGHTS  # staged through the relay, intact
    # the owner's warm path uses the same row: no second load
    again = await owner.replica.inference.predict("relay",
                                                  backend_pb2.PredictOptions(Prompt="owner"))
    assert again.value.message == b"owner" and len(await cluster.rows("relay")) == 1


@pytest_twisted.ensureDeferred
async def test_two_models_pinned_by_labels_to_two_workers(cluster):
    cluster.write_model("alpha.yaml", echo_model("alpha-model"))
    cluster.write_model("beta.yaml", echo_model("beta-model"))
    frontend = await cluster.frontend("replica-a")
    alpha = await cluster.worker("wa", frontend, labels={"e2e.slot": "alpha"})
    beta = await cluster.worker("wb", frontend, labels={"e2e.slot": "beta"})
    base = cluster.base_url(frontend)
    pool = HTTPConnectionPool(reactor, persistent=False)
    headers = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
    try:
        for model, slot in (("alpha-model", "alpha"), ("beta-model", "beta")):
            response = await treq.post(f"{base}/api/nodes/scheduling", pool=pool,
                                       headers=headers, data=json.dumps(
                                           {"model_name": model,
                                            "node_selector": {"e2e.slot": slot}}).encode())
            assert response.code == 200, await treq.content(response)
        listed = await treq.get(f"{base}/api/nodes/scheduling", headers=headers, pool=pool)
        configs = json.loads(await treq.content(listed))["configs"]
        assert [(c["model_name"], c["node_selector"]) for c in configs] == [
            ("alpha-model", {"e2e.slot": "alpha"}), ("beta-model", {"e2e.slot": "beta"})]
        # unauthenticated: refused; the nodes admin API still answers beside it
        refused = await treq.get(f"{base}/api/nodes/scheduling", pool=pool)
        assert refused.code == 401
        await treq.content(refused)
        nodes = await treq.get(f"{base}/api/nodes/{alpha.node_id}", headers=headers, pool=pool)
        assert json.loads(await treq.content(nodes))["id"] == alpha.node_id

        for _ in range(3):
            a = await frontend.replica.inference.predict("alpha-model", backend_pb2.PredictOptions(
                Prompt="a"))
            b = await frontend.replica.inference.predict("beta-model", backend_pb2.PredictOptions(
                Prompt="b"))
            assert (a.served_by, b.served_by) == (alpha.node_id, beta.node_id)
        rows = await cluster.rows()
        assert sorted((r[0], r[1], r[2]) for r in rows) == sorted([
            (alpha.node_id, "alpha-model", "loaded"), (beta.node_id, "beta-model", "loaded")])

        deleted = await treq.delete(f"{base}/api/nodes/scheduling/alpha-model",
                                    headers=headers, pool=pool)
        assert json.loads(await treq.content(deleted))["deleted"] is True
        missing = await treq.get(f"{base}/api/nodes/scheduling/alpha-model", headers=headers,
                                 pool=pool)
        assert missing.code == 404
        await treq.content(missing)
    finally:
        await pool.closeCachedConnections()


@pytest_twisted.ensureDeferred
async def test_backend_crash_reaps_only_on_the_workers_answer_and_reloads(cluster):
    cluster.write_model("crash.yaml", echo_model("crash", "options: ['echo.delay_ms:50']\n"))
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    router = frontend.replica.inference
    await router.predict("crash", backend_pb2.PredictOptions(Prompt="warm"))
    [row] = await cluster.rows("crash")
    supervisor = supervisor_of(worker)
    record = supervisor.find("crash#0")

    # crash the backend in the middle of a streamed request
    first = defer.Deferred()
    streaming = router.predict_stream(
        "crash", backend_pb2.PredictOptions(Prompt=" ".join(["w"] * 100)),
        lambda r: None if first.called else first.callback(r))
    await first
    import os
    import signal
    os.kill(record.pid, signal.SIGKILL)
    with pytest.raises(errors.ClusterError) as caught:
        await streaming
    failure = caught.value
    # whatever gRPC made of it, the worker's answer says the process died (issue 22 §1)
    assert isinstance(failure, errors.BackendCrashed), failure
    assert failure.signal == "SIGKILL" and failure.model == "crash"
    # the row is gone: the worker's answer
    assert await cluster.rows("crash") == []
    # the next request reloads (a new backend process) and is served
    await eventually(lambda: supervisor.find("crash#0").ended, timeout=20,
                     what="crash recorded")
    served = await router.predict("crash", backend_pb2.PredictOptions(Prompt="again"))
    assert served.value.message == b"again"
    [reloaded] = await cluster.rows("crash")
    assert reloaded[2] == "loaded"
    assert supervisor.find("crash#0", include_ended=False).pid != record.pid


@pytest_twisted.ensureDeferred
async def test_a_route_failure_never_reaps_a_row(cluster):
    cluster.write_model("keep.yaml", echo_model("keep"))
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    await frontend.replica.inference.predict("keep", backend_pb2.PredictOptions(Prompt="x"))
    [row] = await cluster.rows("keep")
    port = int(row[3].rsplit(":", 1)[1])
    await frontend.replica.backend_clients.drop(worker.node_id, port)
    await worker.stopService()
    await eventually(lambda: not frontend.replica.tunnels.holds(worker.node_id), timeout=20)
    with pytest.raises(errors.AbsentWithinGrace):
        await frontend.replica.inference.predict("keep", backend_pb2.PredictOptions(Prompt="x"),
                                         deadline=reactor.seconds() + 10)
    assert await cluster.rows("keep") == [row]
    # and the node chooser refuses to reap on anything but the worker's answer
    from localai_tw.frontend.inference.placement import Placement

    placement = Placement("keep", worker.node_id, row[3], row[4])
    for condition in (errors.WorkerUnroutable(worker.node_id, "x"),
                      errors.AbsentWithinGrace(worker.node_id, "reconnecting"),
                      errors.PeerUnreachable("p", "x"), errors.TransportFailure("x"),
                      errors.CallerDeadlineExceeded("x")):
        with pytest.raises(ValueError, match="not the worker's answer"):
            await frontend.replica.inference.chooser.reap(placement, condition)
    assert await cluster.rows("keep") == [row]


@pytest_twisted.ensureDeferred
async def test_one_load_at_a_time_across_replicas(cluster):
    cluster.write_model("slow.yaml", echo_model("slow"))
    a = await cluster.frontend("replica-a")
    b = await cluster.frontend("replica-b")
    worker = await cluster.worker("w1", a)
    starts = []
    original = a.replica.control.call

    def counting(node_id, verb, body=None, **kw):
        if verb == "backend.start":
            starts.append("a")
        return original(node_id, verb, body, **kw)

    a.replica.control.call = counting
    original_b = b.replica.control.call

    def counting_b(node_id, verb, body=None, **kw):
        if verb == "backend.start":
            starts.append("b")
        return original_b(node_id, verb, body, **kw)

    b.replica.control.call = counting_b
    results = await defer.gatherResults([
        a.replica.inference.predict("slow", backend_pb2.PredictOptions(Prompt="1")),
        b.replica.inference.predict("slow", backend_pb2.PredictOptions(Prompt="2")),
        a.replica.inference.predict("slow", backend_pb2.PredictOptions(Prompt="3")),
    ], consumeErrors=True)
    assert [r.value.message for r in results] == [b"1", b"2", b"3"]
    assert len(starts) == 1  # one cold load; the others waited for its row
    assert len(await cluster.rows("slow")) == 1 and results[0].served_by == worker.node_id


@pytest_twisted.ensureDeferred
async def test_a_dead_loaders_lock_is_taken_over(cluster):
    cluster.write_model("orphan.yaml", echo_model("orphan"))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    db = frontend.database_service.database
    # a lock left by a replica that is not live (never registered)
    await db.runOperation("INSERT INTO model_load_jobs (model_name, owner_instance_id, attempt)"
                          " VALUES ('orphan', 'dead-replica', 'old-attempt')")
    served = await frontend.replica.inference.predict("orphan",
                                                      backend_pb2.PredictOptions(Prompt="ok"))
    assert served.value.message == b"ok"
    # a live owner with a fresh heartbeat is NOT taken over: the waiter gives up after load_wait
    await db.runOperation("INSERT INTO model_load_jobs (model_name, owner_instance_id, attempt)"
                          " VALUES ('other', 'replica-a', 'held-attempt')")
    cluster.write_model("other.yaml", echo_model("other"))
    frontend.replica.inference.catalog.refresh()
    frontend.replica.inference.loads.load_wait = 0.5
    from localai_tw.frontend.inference.interfaces import NoNodeAvailable

    with pytest.raises(NoNodeAvailable, match="another load of it is in progress"):
        await frontend.replica.inference.predict("other", backend_pb2.PredictOptions(Prompt="x"))
