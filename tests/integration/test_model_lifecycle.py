"""Model lifecycle on a real cluster in one process (real PostgreSQL, FrontendService replicas,
real workers over WebSocket + yamux, the ``echo`` backend as a subprocess): unload through both
routes via a relaying replica, never while a request is in flight unless forced, an absent
worker reported as such; batched last-used touches; eviction under a memory budget set low on
purpose; preload visible in ``/api/nodes`` after a restart (docs/models.md, "Lifecycle")."""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import defer, reactor
from twisted.web.client import HTTPConnectionPool

from localai_tw.backends import backend_pb2

from .inference_harness import ADMIN, sha256_hex, supervisor_of
from .support import eventually

HEADERS = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}


def echo_model(name: str, weights: bytes | None = None, extra: str = "") -> str:
    files = ""
    model = name
    if weights is not None:
        model = f"{name}.bin"
        files = f"files:\n  - path: {name}.bin\n    sha256: '{sha256_hex(weights)}'\n"
    return (f"name: {name}\nbackend: echo\nparameters:\n  model: {model}\n{files}"
            f"options: ['echo.dim:4']\n{extra}")


async def http(method: str, url: str, body: dict | None = None):
    pool = HTTPConnectionPool(reactor, persistent=False)
    try:
        data = json.dumps(body).encode() if body is not None else None
        response = await treq.request(method, url, headers=HEADERS, data=data, pool=pool)
        return response.code, json.loads(await response.content() or b"null")
    finally:
        await pool.closeCachedConnections()


def running(worker) -> list[str]:
    return sorted(b["model"] for b in supervisor_of(worker).list())


async def predict(frontend, model: str, prompt: str = "hi", **metadata):
    options = backend_pb2.PredictOptions(Prompt=prompt)
    for key, value in metadata.items():
        options.Metadata[key] = value
    return await frontend.replica.inference.predict(model, options)


@pytest_twisted.ensureDeferred
async def test_unload_through_a_relaying_replica_follows_the_workers_answer(cluster):
    """Break: make ``ModelLifecycle.unload`` delete the row before asking the worker (or
    ignore ``busy``): the busy and not-delivered assertions go red."""
    cluster.write_model("m.yaml", echo_model("m"))
    owner = await cluster.frontend("replica-owner")
    relay = await cluster.frontend("replica-relay")
    worker = await cluster.worker("w1", owner)
    assert await cluster.owner_of(worker.node_id) == "replica-owner"
    base = cluster.base_url(relay)

    # per-node route, asked at the replica that does not hold the tunnel
    await predict(relay, "m")
    assert running(worker) == ["m"]
    code, body = await http("POST", f"{base}/api/nodes/w1/models/m/unload")
    assert code == 200, body
    assert body["nodes"] == [{"model": "m", "node_id": worker.node_id, "outcome": "stopped"}]
    assert await cluster.rows("m") == []
    assert running(worker) == []
    # unknown model on that node: 404, nothing asked
    code, body = await http("POST", f"{base}/api/nodes/w1/models/m/unload")
    assert code == 404 and body["error"]["code"] == "model_not_loaded"

    # a request in flight (through the relay replica): refused, row and backend untouched
    await predict(relay, "m")
    slow = defer.ensureDeferred(predict(relay, "m", "a b c d e f", **{"echo.delay_ms": "400"}))
    await eventually(lambda: relay.replica.use.in_flight(worker.node_id, "m"), what="in flight")
    code, body = await http("POST", f"{base}/backend/shutdown", {"model": "m"})
    assert code == 409 and body["error"]["code"] == "model_busy", body
    assert [r[2] for r in await cluster.rows("m")] == ["loaded"]
    assert (await slow).value.message == b"a b c d e f"
    # in flight on ANOTHER replica (the owner's own request): the backend's Status says BUSY
    slow_owner = defer.ensureDeferred(predict(owner, "m", "g h i j", **{"echo.delay_ms": "500"}))
    await eventually(lambda: owner.replica.use.in_flight(worker.node_id, "m"), what="owner")
    assert not relay.replica.use.in_flight(worker.node_id, "m")
    code, body = await http("POST", f"{base}/backend/shutdown", {"model": "m"})
    assert code == 409 and body["nodes"][0]["outcome"] == "busy", body
    assert "BUSY" in body["nodes"][0]["detail"]
    assert [r[2] for r in await cluster.rows("m")] == ["loaded"]
    assert (await slow_owner).value.message == b"g h i j"  # it finished: nothing was stopped

    # idle now: LocalAI's route stops it everywhere
    code, body = await http("POST", f"{base}/backend/shutdown", {"model": "m"})
    assert code == 200 and body["message"] == "model stopped", body
    assert await cluster.rows("m") == [] and running(worker) == []
    code, body = await http("POST", f"{base}/backend/shutdown", {"model": "m"})
    assert code == 404 and "not loaded on any worker" in body["error"]["message"]

    # force stops it with a request in flight (that request fails)
    await predict(relay, "m")
    doomed = defer.ensureDeferred(predict(relay, "m", "x y z w", **{"echo.delay_ms": "500"}))
    doomed.addCallbacks(lambda _: "served", lambda f: f.value)
    await eventually(lambda: relay.replica.use.in_flight(worker.node_id, "m"), what="doomed")
    code, body = await http("POST", f"{base}/backend/shutdown", {"model": "m", "force": True})
    assert code == 200, body
    assert await cluster.rows("m") == []
    assert isinstance(await doomed, Exception)  # forced: the request in flight failed

    # bad input: named, 400
    code, body = await http("POST", f"{base}/backend/shutdown", {"model": ""})
    assert code == 400 and body["error"]["field"] == "model"
    code, body = await http("POST", f"{base}/backend/shutdown", {"model": "m", "forse": 1})
    assert code == 400
    code, body = await http("POST", f"{base}/api/nodes/w1/models/m/unload", {"force": "yes"})
    assert code == 400 and body["error"]["field"] == "force"


@pytest_twisted.ensureDeferred
async def test_unload_of_an_absent_worker_is_not_delivered_and_changes_nothing(cluster):
    """Break: restore nothing on a route condition (leave the row ``unloading``) or delete
    it: the row assertion goes red.  A reconnecting worker is reported as such (503 with its
    condition), never as a failed one."""
    cluster.write_model("m.yaml", echo_model("m"))
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    await predict(frontend, "m")
    before = await cluster.rows("m")
    # the worker's tunnel goes away (the worker itself stays registered): within the grace
    await worker.stopService()
    await eventually(lambda: not frontend.replica.tunnels.holds(worker.node_id), what="gone")
    base = cluster.base_url(frontend)
    code, body = await http("POST", f"{base}/api/nodes/{worker.node_id}/models/m/unload")
    assert code == 503, body
    assert body["error"]["code"] in ("absent-within-grace", "routing-fact"), body
    assert "not delivered" in body["error"]["message"]
    assert await cluster.rows("m") == before  # still loaded, as it was


@pytest_twisted.ensureDeferred
async def test_touches_are_batched_and_the_rows_still_move(cluster):
    cluster.write_model("m.yaml", echo_model("m"))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    await predict(frontend, "m")
    db = frontend.database_service.database
    use = frontend.replica.use
    await use.flush()
    [[first]] = await db.runQuery("SELECT last_used FROM node_models WHERE model_name = 'm'")
    writes = use.writes
    for _ in range(30):
        await predict(frontend, "m")
    assert use.writes - writes <= 2  # 30 requests, at most one write a second

    async def moved():
        [[now]] = await db.runQuery("SELECT last_used FROM node_models WHERE model_name='m'")
        return now > first
    await eventually(moved, timeout=5, what="last_used moved")


WEIGHTS = {name: (name.encode() * 12000)[:12000] for name in ("a", "b", "c")}


@pytest_twisted.ensureDeferred
async def test_eviction_under_a_memory_budget_set_low_on_purpose(cluster):
    """A worker offering 30000 bytes; three models of 12000 bytes each (their file sizes).
    Break: evict the most recently used model, or skip the ``if_idle`` Status check (the
    other replica's request in flight then fails), and this goes red."""
    for name, weights in WEIGHTS.items():
        cluster.write_file(f"{name}.bin", weights)
        cluster.write_model(f"{name}.yaml", echo_model(name, weights))
    a_side = await cluster.frontend("replica-a")
    b_side = await cluster.frontend("replica-b")
    worker = await cluster.worker("small", a_side, **{"memory-budget": 30000})
    code, view = await http("GET", f"{cluster.base_url(b_side)}/api/nodes/small")
    assert view["capacity"]["total_ram"] == 30000, view

    await predict(a_side, "a")
    await predict(a_side, "b")
    assert sorted(r[1] for r in await cluster.rows()) == ["a", "b"]
    await predict(a_side, "c")  # 24000 held + 12000 > 30000: the least recently used goes
    assert sorted(r[1] for r in await cluster.rows()) == ["b", "c"]
    assert running(worker) == ["b", "c"]

    # b is now the least recently used, but replica B has a request in flight on it: the
    # backend answers BUSY to replica A's eviction, so c (idle) goes instead
    slow = defer.ensureDeferred(predict(b_side, "b", "one two three four",
                                        **{"echo.delay_ms": "400"}))
    await eventually(lambda: b_side.replica.use.in_flight(worker.node_id, "b"), what="b busy")
    assert not a_side.replica.use.in_flight(worker.node_id, "b")
    await predict(a_side, "a")
    assert (await slow).value.message == b"one two three four"  # never evicted under it
    assert sorted(r[1] for r in await cluster.rows()) == ["a", "b"]
    assert running(worker) == ["a", "b"]


@pytest_twisted.ensureDeferred
async def test_preload_is_visible_in_api_nodes_after_a_restart(cluster):
    """``preload: true`` in the YAML: loaded once a worker is connected, without a request;
    and again after the frontend and the worker restart (the worker's re-registration drops
    its old rows).  Break: make the Preloader settle a model found in a row on a node that is
    not connected (the stale row before the re-registration): the second half goes red."""
    cluster.write_model("p.yaml", echo_model("p", extra="preload: true\n"))
    cluster.write_model("q.yaml", echo_model("q"))

    async def loaded_models(frontend):
        code, view = await http("GET", f"{cluster.base_url(frontend)}/api/nodes/w1")
        return code == 200 and sorted(m["model_name"] for m in view["models"]
                                      if m["state"] == "loaded")

    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    assert await eventually(lambda: loaded_models(frontend), timeout=30,
                            what="p preloaded") == ["p"]
    assert running(worker) == ["p"]

    await worker.stopService()
    await frontend.stopService()
    frontend = await cluster.frontend("replica-a", **{"preload-models": ["q"]})
    worker = await cluster.worker("w1", frontend)
    async def both():
        return await loaded_models(frontend) == ["p", "q"]
    await eventually(both, timeout=30, what="p and q preloaded after the restart")
    assert running(worker) == ["p", "q"]
    assert frontend.replica.preloader.settled["p"].startswith("loaded on")


async def schedule(cluster, frontend, **row):
    code, body = await http("POST", f"{cluster.base_url(frontend)}/api/nodes/scheduling", row)
    assert code == 200, body


@pytest_twisted.ensureDeferred
async def test_a_busy_model_gets_a_second_replica_and_calls_spread_over_both(cluster):
    """Break: drop ``ReplicaScaler.note`` from the router (no second replica), or make the
    chooser prefer the replica with the MOST calls in flight (calls pile on one node): the
    two-node assertions go red (both checked)."""
    cluster.write_model("m.yaml", echo_model("m"))
    frontend = await cluster.frontend("replica-a")
    w1 = await cluster.worker("w1", frontend)
    w2 = await cluster.worker("w2", frontend)
    await schedule(cluster, frontend, model_name="m", max_replicas=2)
    first = (await predict(frontend, "m")).served_by
    assert [r[0] for r in await cluster.rows("m")] == [first]
    # one call in flight, then another: every replica is busy, so a second one is loaded
    slow = defer.ensureDeferred(predict(frontend, "m", "a b c d", **{"echo.delay_ms": "300"}))
    await eventually(lambda: frontend.replica.use.in_flight(first, "m"), what="busy")
    await predict(frontend, "m")

    async def two():
        return sorted(r[0] for r in await cluster.rows("m") if r[2] == "loaded")
    assert await eventually(lambda: defer.ensureDeferred(two()).addCallback(
        lambda nodes: len(nodes) == 2 and nodes), timeout=30, what="a second replica") == \
        sorted([w1.node_id, w2.node_id])
    await slow
    # calls at once go to the replica with the fewest calls in flight: both serve
    served = await defer.gatherResults([
        defer.ensureDeferred(predict(frontend, "m", "x y", **{"echo.delay_ms": "200"}))
        for _ in range(4)])
    assert {s.served_by for s in served} == {w1.node_id, w2.node_id}
    assert len(await cluster.rows("m")) == 2  # never more than max_replicas


@pytest_twisted.ensureDeferred
async def test_min_replicas_are_loaded_without_a_request(cluster):
    cluster.write_model("m.yaml", echo_model("m"))
    frontend = await cluster.frontend("replica-a")
    w1 = await cluster.worker("w1", frontend)
    w2 = await cluster.worker("w2", frontend)
    await schedule(cluster, frontend, model_name="m", min_replicas=2)
    code, body = await http("POST", f"{cluster.base_url(frontend)}/api/nodes/scheduling",
                            {"model_name": "m", "min_replicas": 3, "max_replicas": 2})
    assert code == 400 and body["error"]["field"] == "min_replicas"
    scaler = frontend.replica.scaler
    await scaler.run_once()
    await scaler.run_once()
    await scaler.run_once()  # the floor is met: nothing more
    assert sorted(r[0] for r in await cluster.rows("m")) == sorted([w1.node_id, w2.node_id])
    assert running(w1) == ["m"] and running(w2) == ["m"]


@pytest_twisted.ensureDeferred
async def test_the_idle_watchdog_unloads_what_was_not_used_for_its_timeout(cluster):
    """``--enable-watchdog-idle --watchdog-idle-timeout 1s`` on the replica holding the worker;
    a pinned model stays.  Break: compare ``last_used`` with the timeout the wrong way round
    (``>``): the unused model stays and this goes red."""
    cluster.write_model("m.yaml", echo_model("m"))
    cluster.write_model("p.yaml", echo_model("p", extra="pinned: true\n"))
    frontend = await cluster.frontend("replica-a", **{"enable-watchdog-idle": True,
                                                      "watchdog-idle-timeout": 1.0})
    other = await cluster.frontend("replica-b", **{"enable-watchdog-idle": True,
                                                   "watchdog-idle-timeout": 1.0})
    worker = await cluster.worker("w1", frontend)
    await predict(frontend, "m")
    await predict(frontend, "p")
    dog = frontend.replica.watchdog
    assert dog.enabled and dog.idle_timeout == 1.0
    # "Just used" must not depend on how fast this machine is: with the configured 1 s, a
    # loaded machine can take longer than that between the call above and this pass.  The
    # pass is asked with a timeout no run of this test reaches, then with the configured one
    # (the other replica keeps 1 s: whatever the timing, the worker is not its to unload).
    dog.idle_timeout = 600.0
    assert await dog.run_once() == []  # just used
    dog.idle_timeout = 1.0
    assert await other.replica.watchdog.run_once() == []  # not its worker: never its call

    async def unloaded():  # this pass, or the service's own tick (every 5 s), unloads it
        results = await dog.run_once()
        assert all(r.outcome == "stopped" and r.model == "m" for r in results), results
        return [r[1] for r in await cluster.rows()] == ["p"]
    await eventually(unloaded, timeout=10, what="m unloaded, p kept")
    assert running(worker) == ["p"]
