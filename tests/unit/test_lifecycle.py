"""Model lifecycle without I/O (``task.Clock``, a recording fake database and control client):
batched last-used touches, in-flight counts, unload outcomes (the row follows the worker's
answer), eviction choices (LRU, idle, pinned, never the model being loaded), the watchdogs and
preload (docs/models.md, "Lifecycle")."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer, task

from localai_tw import errors
from localai_tw.frontend.inference.lifecycle import (
    BUSY,
    LOADING,
    NOT_DELIVERED,
    NOT_LOADED,
    STOPPED,
    WORKER_FAILED,
    LifecycleWatchdog,
    ModelLifecycle,
    memory_need,
)
from localai_tw.localai.model_config import parse_model_config
from localai_tw.frontend.inference.usage import ModelUse


class FakeDB:
    """Answers the lifecycle's queries from in-memory rows; records every statement."""

    def __init__(self):
        self.statements: list[tuple[str, tuple]] = []
        self.rows: dict[tuple[str, str], dict] = {}  # (node, model) -> {state, address}
        self.order: list[tuple[str, str]] = []       # LRU order, oldest first
        self.nodes: dict[str, tuple[int, int, int, int]] = {}
        self.idle: list[tuple[str, str]] = []

    def add(self, node, model, state="loaded"):
        self.rows[(node, model)] = {"state": state, "address": "127.0.0.1:1"}
        self.order.append((node, model))

    def runOperation(self, sql, args=()):
        self.statements.append((sql, args))
        if sql.startswith("UPDATE node_models SET state = 'unloading'"):
            self.rows[(args[0], args[1])]["state"] = "unloading"
        elif sql.startswith("UPDATE node_models SET state = 'loaded'"):
            row = self.rows.get((args[0], args[1]))
            if row and row["state"] == "unloading":
                row["state"] = "loaded"
        elif sql.startswith("DELETE FROM node_models"):
            self.rows.pop((args[0], args[1]), None)
            self.order.remove((args[0], args[1]))
        return defer.succeed(None)

    def runQuery(self, sql, args=()):
        self.statements.append((sql, args))
        if sql.startswith("SELECT state, address FROM node_models"):
            row = self.rows.get((args[0], args[1]))
            return defer.succeed([(row["state"], row["address"])] if row else [])
        if sql.startswith("SELECT id, total_ram"):
            return defer.succeed([(n, *self.nodes.get(n, (0, 0, 0, 0))) for n in args[0]])
        if sql.startswith("SELECT node_id, model_name, state FROM node_models"):
            return defer.succeed([(n, m, self.rows[(n, m)]["state"]) for n, m in self.order
                                  if n in args[0]])
        if sql.startswith("SELECT node_id FROM node_models"):
            return defer.succeed(sorted((n,) for n, m in self.rows if m == args[0]))
        if sql.startswith("SELECT node_id, model_name FROM node_models"):
            return defer.succeed([key for key in self.idle if key[0] in args[0]])
        raise AssertionError(sql)


class FakeControl:
    def __init__(self):
        self.calls: list[tuple[str, str, dict]] = []
        self.answers: dict[str, object] = {}  # model -> reply dict or exception

    def call(self, node_id, verb, body, timeout=None):
        self.calls.append((node_id, verb, body))
        answer = self.answers.get(body["model"], {"success": True, "error": ""})
        if isinstance(answer, Exception):
            return defer.fail(answer)
        return defer.succeed(answer)


class FakeCatalog:
    models_dir = "/nonexistent"

    def __init__(self, *configs):
        self.configs = {c.name: c for c in configs}

    def get(self, name):
        return self.configs.get(name)


def model(name, **extra):
    return parse_model_config({"name": name, "backend": "echo", **extra})


def make(db=None, *configs, **kwargs):
    clock = task.Clock()
    db = db or FakeDB()
    use = ModelUse(db, clock)
    control = FakeControl()
    lifecycle = ModelLifecycle(db, control, use, FakeCatalog(*configs), clock, **kwargs)
    return lifecycle, db, control, use, clock


# -- batched touches -------------------------------------------------------------------------


def test_touches_write_at_most_once_per_pair_per_second_whatever_the_request_rate():
    """Break: write in ``touch`` instead of batching (or flush every 0.1 s): the counts go red."""
    clock = task.Clock()
    db = FakeDB()
    use = ModelUse(db, clock)
    use.startService()
    for second in range(10):
        for i in range(1000):  # 1000 requests a second on three (node, model) pairs
            use.touch(f"n{i % 2}", "m" if i % 3 else "e")
            clock.advance(0.001)
    clock.advance(0.01)  # past the tenth second (the 0.001 steps add up a little short)
    writes = [s for s in db.statements if s[0].startswith("UPDATE node_models AS m")]
    assert len(writes) == 10  # one statement a second, not 10000
    for _, (nodes, models) in writes:
        pairs = list(zip(nodes, models))
        assert len(pairs) == len(set(pairs)) <= 4  # each pair once per statement
    use.touch("n0", "m")
    d = use.stopService()  # stopping flushes what is pending
    assert d.called and len(db.statements) == 11 and use.pending() == frozenset()


def test_a_failed_flush_keeps_its_touches_for_the_next():
    clock = task.Clock()

    class Failing(FakeDB):
        fail = True

        def runOperation(self, sql, args=()):
            self.statements.append((sql, args))
            return defer.fail(RuntimeError("db down")) if self.fail else defer.succeed(None)

    db = Failing()
    use = ModelUse(db, clock)
    use.touch("n", "m")
    use.flush()
    assert use.pending() == {("n", "m")}
    db.fail = False
    use.flush()
    assert use.pending() == frozenset()


def test_in_flight_counts_and_long_running_calls():
    clock = task.Clock()
    use = ModelUse(None, clock)
    a = use.begin("n", "m")
    clock.advance(10)
    b = use.begin("n", "m")
    assert use.in_flight("n", "m") == 2 and use.in_flight("n", "x") == 0
    assert use.running_longer_than(5) == [("n", "m")]
    use.end("n", "m", a)
    assert use.running_longer_than(5) == []
    use.end("n", "m", b)
    assert use.in_flight_counts() == {}


# -- unload ----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_unload_outcomes_follow_the_workers_answer():
    """Break: delete the row before the call, or keep ``unloading`` on a route condition."""
    lifecycle, db, control, use, _ = make()
    db.add("n", "m")
    assert (await lifecycle.unload("x", "n")).outcome == NOT_LOADED
    assert control.calls == []

    call = use.begin("n", "m")
    result = await lifecycle.unload("m", "n")
    assert result.outcome == BUSY and control.calls == []  # not asked: ours are in flight
    use.end("n", "m", call)

    control.answers["m"] = {"success": False, "busy": True, "error": ""}
    assert (await lifecycle.unload("m", "n")).outcome == BUSY
    assert db.rows[("n", "m")]["state"] == "loaded"
    assert control.calls[-1][2] == {"model": "m", "force": False, "if_idle": True,
                                    "absent_ok": True}

    for condition in (errors.WorkerUnroutable("n", "no route"),
                      errors.AbsentWithinGrace("n", "reconnecting"),
                      errors.PeerUnreachable("r", "down"),
                      errors.CallerDeadlineExceeded("unload")):
        control.answers["m"] = condition
        result = await lifecycle.unload("m", "n")
        assert result.outcome == NOT_DELIVERED and result.error is condition
        assert db.rows[("n", "m")]["state"] == "loaded"  # nothing changed

    control.answers["m"] = errors.ControlVerbFailed("n", "backend.stop", "kill failed")
    assert (await lifecycle.unload("m", "n")).outcome == WORKER_FAILED
    assert db.rows[("n", "m")]["state"] == "loaded"

    control.answers["m"] = {"success": True, "error": "", "state": "absent"}
    result = await lifecycle.unload("m", "n")
    assert result.outcome == STOPPED and ("n", "m") not in db.rows
    assert "not running" in result.detail


@pytest_twisted.ensureDeferred
async def test_forced_unload_skips_both_busy_checks_and_a_loading_row_is_left_alone():
    lifecycle, db, control, use, _ = make()
    db.add("n", "m")
    db.add("n", "l", state="loading")
    use.begin("n", "m")
    assert (await lifecycle.unload("m", "n", force=True)).outcome == STOPPED
    assert control.calls[-1][2]["if_idle"] is False and control.calls[-1][2]["force"] is True
    assert (await lifecycle.unload("l", "n", force=True)).outcome == LOADING
    assert db.rows[("n", "l")]["state"] == "loading"


# -- eviction --------------------------------------------------------------------------------


def test_memory_need_is_the_config_key_else_the_file_sizes(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"x" * 1234)
    sized = model("a", files=[{"path": "w.bin"}], parameters={"model": "w.bin"})
    assert memory_need(sized, str(tmp_path)) == 1234
    assert memory_need(model("b", memory_bytes="2K"), str(tmp_path)) == 2048
    assert memory_need(model("c"), str(tmp_path)) == 0  # unknown: always fits


@pytest_twisted.ensureDeferred
async def test_eviction_takes_the_least_recently_used_idle_unpinned_model():
    """Break: pick the most recent, or evict a model with requests in flight / a pinned one."""
    configs = [model(n, memory_bytes=100) for n in ("old", "busy", "pin", "new")]
    configs[2] = model("pin", memory_bytes=100, pinned=True)
    lifecycle, db, control, use, _ = make(None, *configs)
    db.nodes["n"] = (500, 500, 0, 0)
    for name in ("pin", "busy", "old", "new"):  # LRU order, oldest first
        db.add("n", name)
    use.begin("n", "busy")
    evicted = await lifecycle.make_room(model("big", memory_bytes=200), "n")
    # 500 - 400 = 100 < 200: one eviction is enough; pin is older but pinned, busy is busy
    assert evicted == ["old"]
    assert [c[2]["model"] for c in control.calls] == ["old"]
    assert set(m for _, m in db.rows) == {"pin", "busy", "new"}


@pytest_twisted.ensureDeferred
async def test_a_worker_busy_answer_moves_on_and_nothing_evictable_loads_anyway():
    lifecycle, db, control, use, _ = make(None, model("a", memory_bytes=100),
                                          model("b", memory_bytes=100))
    db.nodes["n"] = (150, 150, 0, 0)
    db.add("n", "a")
    control.answers["a"] = {"success": False, "busy": True, "error": ""}
    assert await lifecycle.make_room(model("b", memory_bytes=100), "n") == []
    assert ("n", "a") in db.rows  # never evicted: the backend said BUSY


@pytest_twisted.ensureDeferred
async def test_max_active_backends_counts_models_and_gpu_memory_is_preferred():
    lifecycle, db, control, use, _ = make(None, max_active_backends=2)
    db.add("n", "a")
    db.add("n", "b")
    assert await lifecycle.make_room(model("c"), "n") == ["a"]
    # the model being loaded is never its own victim and never counted
    db.add("n", "c")
    assert await lifecycle.make_room(model("c"), "n") == []
    lifecycle.max_active_backends = 0
    db.nodes["g"] = (10 ** 12, 10 ** 12, 100, 100)  # lots of RAM, little GPU memory
    db.add("g", "x")
    lifecycle._catalog.configs["x"] = model("x", memory_bytes=80)
    assert await lifecycle.make_room(model("y", memory_bytes=50), "g") == ["x"]


@pytest_twisted.ensureDeferred
async def test_placement_prefers_nodes_with_room():
    class C:
        def __init__(self, node_id):
            self.node_id = node_id

    lifecycle, db, *_ = make(None, model("held", memory_bytes=90))
    db.nodes.update({"full": (100, 100, 0, 0), "roomy": (100, 100, 0, 0),
                     "unknown": (0, 0, 0, 0)})
    db.add("full", "held")
    big = model("new", memory_bytes=50)
    preferred = await lifecycle.prefer(big, [C("full"), C("roomy"), C("unknown")])
    assert [c.node_id for c in preferred] == ["roomy", "unknown"]
    huge = model("huge", memory_bytes=1000)
    preferred = await lifecycle.prefer(huge, [C("full"), C("roomy")])
    assert [c.node_id for c in preferred] == ["full", "roomy"]  # none fits: all, then evict


# -- watchdogs -------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_idle_watchdog_unloads_idle_unpinned_models_on_held_nodes_only():
    lifecycle, db, control, use, clock = make(None, model("pin", pinned=True))
    db.add("mine", "a")
    db.add("mine", "pin")
    db.idle = [("mine", "a"), ("mine", "pin"), ("theirs", "b")]
    dog = LifecycleWatchdog(db, lifecycle, lambda: ["mine"], clock, idle_timeout=60)
    results = await dog.run_once()
    assert [(r.model, r.outcome) for r in results] == [("a", STOPPED)]
    assert [c[0] for c in control.calls] == ["mine"]
    assert control.calls[0][2]["if_idle"] is True  # never forced


@pytest_twisted.ensureDeferred
async def test_busy_watchdog_force_stops_a_call_that_ran_too_long():
    lifecycle, db, control, use, clock = make()
    db.add("n", "stuck")
    use.begin("n", "stuck")
    dog = LifecycleWatchdog(db, lifecycle, lambda: [], clock, busy_timeout=300)
    assert await dog.run_once() == []
    clock.advance(301)
    [result] = await dog.run_once()
    assert result.outcome == STOPPED and control.calls[0][2]["force"] is True


def test_watchdogs_are_off_by_default():
    lifecycle, db, control, use, clock = make()
    dog = LifecycleWatchdog(db, lifecycle, lambda: ["n"], clock)
    dog.startService()
    clock.advance(3600)
    assert not dog.enabled and db.statements == []
    dog.stopService()


# -- preload ---------------------------------------------------------------------------------


class Candidate:
    def __init__(self, node_id, connected, loaded=None):
        self.node_id, self.connected, self.loaded_address = node_id, connected, loaded


class FakeInference:
    def __init__(self, configs):
        self.configs = {c.name: c for c in configs}
        self.where: list[Candidate] = []
        self.loaded: list[str] = []
        self.chooser = self
        self.loads = self

    def models(self):
        return list(self.configs.values())

    def model(self, name):
        return self.configs.get(name)

    async def candidates(self, config):
        return self.where

    async def load(self, config):
        self.loaded.append(config.name)

        class P:
            node_id = "n1"
        return P()


@pytest_twisted.ensureDeferred
async def test_preload_waits_for_a_connected_worker_then_loads_once():
    from localai_tw.frontend.inference.preload import Preloader

    clock = task.Clock()
    inference = FakeInference([model("marked", preload=True), model("named"), model("other")])
    preloader = Preloader(inference, ["named", "missing"], clock)
    preloader.startService()  # first pass at once: nobody connected yet
    assert inference.loaded == [] and preloader.settled == {"missing": "not configured"}
    inference.where = [Candidate("n1", connected=True)]
    clock.advance(preloader.interval)
    await defer.succeed(None)
    assert sorted(inference.loaded) == ["marked", "named"]
    assert set(preloader.settled) == {"named", "marked", "missing"}
    clock.advance(preloader.interval * 10)
    assert sorted(inference.loaded) == ["marked", "named"]  # never again
    preloader.stopService()


@pytest_twisted.ensureDeferred
async def test_preload_of_a_model_already_loaded_on_a_connected_node_loads_nothing():
    from localai_tw.frontend.inference.preload import Preloader

    clock = task.Clock()
    inference = FakeInference([model("marked", preload=True)])
    inference.where = [Candidate("n1", connected=True, loaded="127.0.0.1:1")]
    preloader = Preloader(inference, [], clock)
    preloader.startService()
    assert inference.loaded == [] and preloader.settled["marked"].startswith("already")
    preloader.stopService()


def test_model_config_lifecycle_keys_are_validated():
    from localai_tw.localai.model_config import ModelConfigError

    for bad in ({"pinned": "yes"}, {"preload": 1}, {"memory_bytes": "lots"},
                {"memory_bytes": True}, {"memory_bytes": -1}):
        with pytest.raises(ModelConfigError):
            model("x", **bad)
    assert model("x", pinned=True).warnings == ()  # LocalAI's key is acted on now


# -- replicas --------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_scale_up_is_considered_only_when_every_replica_is_busy_here():
    from localai_tw.frontend.inference.replicas import ReplicaScaler

    clock = task.Clock()
    use = ModelUse(None, clock)
    inference = FakeInference([model("m")])
    asked: list[str] = []
    scaled: list[int] = []

    async def replica_bounds(name):
        asked.append(name)
        return 0, 2

    async def scale_up(config, want):
        scaled.append(want)

    inference.replica_bounds = replica_bounds
    inference.scale_up = scale_up
    inference.where = [Candidate("n1", True, "127.0.0.1:1"), Candidate("n2", True)]
    catalog = type("Catalog", (), {"get": staticmethod(inference.model)})()
    scaler = ReplicaScaler(None, catalog, inference.chooser, inference.loads, use, clock)
    scaler.note(model("m"), "n1")
    assert asked == [] and scaled == []  # nothing in flight here: not even a query
    use.begin("n1", "m")
    scaler.note(model("m"), "n1")
    assert asked == ["m"] and scaled == [2]  # busy on its only replica: one more
    inference.where = [Candidate("n1", True, "127.0.0.1:1"), Candidate("n2", True, "x:2")]
    scaler.note(model("m"), "n1")
    assert scaled == [2]  # n2 is idle here (and max_replicas is reached anyway)


def test_each_unload_outcome_has_its_own_status_and_an_absent_worker_is_never_failed():
    from localai_tw.frontend.inference.lifecycle import UnloadResult
    from localai_tw.frontend.api.lifecycle import UnloadRefused, answer_results, refusal_of

    def status(outcome, error=None):
        refusal = refusal_of(UnloadResult("m", "n", outcome, "why", error))
        return refusal.status, refusal.code, refusal.headers.get("Retry-After")

    assert status(NOT_LOADED) == (404, "model_not_loaded", None)
    assert status(BUSY) == (409, "model_busy", None)
    assert status(LOADING) == (409, "model_loading", "5")
    assert status(NOT_DELIVERED, errors.AbsentWithinGrace("n", "reconnecting")) == (
        503, "absent-within-grace", "5")
    assert status(NOT_DELIVERED, errors.WorkerUnroutable("n", "no route"))[:2] == (
        503, "routing-fact")
    assert status(NOT_DELIVERED, errors.PeerUnreachable("r", "down"))[:2] == (
        503, "peer-unreachable")
    assert status(WORKER_FAILED, errors.ControlVerbFailed("n", "backend.stop", "x"))[:2] == (
        502, "worker-answer")
    refused = refusal_of(UnloadResult("m", "n", NOT_DELIVERED, "", errors.AbsentWithinGrace(
        "n", "reconnecting")))
    assert "not delivered, nothing changed" in refused.message
    assert "fail" not in refused.message.lower()
    stopped = UnloadResult("m", "a", STOPPED)
    assert answer_results([stopped]) == (200, {"message": "model stopped",
                                               "nodes": [stopped.view()]})
    with pytest.raises(UnloadRefused) as caught:
        answer_results([stopped, UnloadResult("m", "b", BUSY, "1 request")])
    body = caught.value.body()
    assert caught.value.status == 409 and [n["outcome"] for n in body["nodes"]] == [
        "stopped", "busy"]


@pytest_twisted.ensureDeferred
async def test_unloads_and_last_used_writes_are_counted_in_the_replicas_metrics():
    from prometheus_client import generate_latest

    from localai_tw.metrics import ReplicaMetrics

    metrics = ReplicaMetrics()
    clock = task.Clock()
    db = FakeDB()
    use = ModelUse(db, clock, metrics=metrics)
    lifecycle = ModelLifecycle(db, FakeControl(), use, FakeCatalog(), clock, metrics=metrics)
    db.add("n", "m")
    await lifecycle.unload("m", "n")
    await lifecycle.unload("m", "n", reason="eviction")
    use.touch("n", "m")
    use.flush()
    text = generate_latest(metrics.registry).decode()
    assert 'localai_model_unloads_total{model="m",outcome="stopped",reason="admin"} 1.0' in text
    assert ('localai_model_unloads_total{model="m",outcome="not-loaded",reason="eviction"} 1.0'
            in text)
    assert "localai_last_used_writes_total 1.0" in text


def test_memory_need_counts_folders_and_the_file_parameters_model_names(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.bin").write_bytes(b"x" * 100)
    (tmp_path / "folder" / "sub").mkdir()
    (tmp_path / "folder" / "sub" / "b.bin").write_bytes(b"x" * 50)
    (tmp_path / "plain.gguf").write_bytes(b"x" * 70)
    assert memory_need(model("f", files=[{"path": "folder"}]), str(tmp_path)) == 150
    # parameters.model naming a file in the models dir, no files: list (staged implicitly)
    assert memory_need(model("g", parameters={"model": "plain.gguf"}), str(tmp_path)) == 70
    assert memory_need(model("h", parameters={"model": "org/hub-id"}), str(tmp_path)) == 0
