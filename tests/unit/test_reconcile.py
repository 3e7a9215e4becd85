"""``BackendReconciler``: the one rule for a returning worker's backend processes -- adopted when
a row names them, left to a cold load in progress, stopped otherwise; a ``loaded`` row the
worker does not serve deleted; a list it cannot use changes nothing."""

from __future__ import annotations

import pytest_twisted
from twisted.internet import defer

from localai_tw import errors
from localai_tw.frontend.inference.reconcile import MAX_PROCESSES, BackendReconciler

NODE = "node-1"


class FakeControl:
    def __init__(self, backends, stop_answer=None):
        self.backends = backends
        self.stop_answer = stop_answer or {"success": True}
        self.calls = []

    def call(self, node_id, verb, body=None, timeout=None):
        self.calls.append((node_id, verb, body))
        if verb == "backend.list":
            if isinstance(self.backends, Exception):
                return defer.fail(self.backends)
            return defer.succeed({"backends": self.backends})
        return defer.succeed(self.stop_answer)


class FakeDB:
    def __init__(self, rows, loading=()):
        self.rows = list(rows)  # (model, address, state)
        self.loading = list(loading)
        self.deleted = []

    def runQuery(self, sql, args=None):
        if sql.startswith("SELECT model_name, address, state"):
            return defer.succeed(list(self.rows))
        if sql.startswith("SELECT model_name FROM model_load_jobs"):
            return defer.succeed([(m,) for m in self.loading])
        if sql.startswith("DELETE FROM node_models"):
            _, model, address = args
            before = len(self.rows)
            self.rows = [r for r in self.rows if not (r[0] == model and r[1] == address
                                                      and r[2] == "loaded")]
            if len(self.rows) < before:
                self.deleted.append(model)
                return defer.succeed([(1,)])
            return defer.succeed([])
        raise AssertionError(sql)


def process(model, port, key=None):
    return {"model": model, "process_key": key or f"{model}#0",
            "address": f"127.0.0.1:{port}", "state": "ready", "pid": 1234}


def stops(control):
    return [body["process_key"] for _, verb, body in control.calls if verb == "backend.stop"]


@pytest_twisted.ensureDeferred
async def test_the_rule():
    control = FakeControl([process("kept", 40000), process("orphan", 40001),
                           process("moved", 40002), process("loading", 40003)])
    db = FakeDB([("kept", "127.0.0.1:40000", "loaded"),
                 ("moved", "127.0.0.1:49999", "loaded"),     # the row names another port
                 ("vanished", "127.0.0.1:40005", "loaded"),  # nothing serves it any more
                 ("staging", "127.0.0.1:40006", "staging")],  # not a loaded row: left
                loading=["loading"])
    changed = []
    report = await BackendReconciler(db, control, on_changed=changed.append).reconcile(NODE)
    assert report.error is None
    assert report.adopted == ["kept#0"] and report.left_to_loads == ["loading#0"]
    assert report.stopped == ["orphan#0", "moved#0"] == stops(control)
    assert report.rows_deleted == ["moved", "vanished"] == db.deleted == changed
    assert [r[0] for r in db.rows] == ["kept", "staging"]


@pytest_twisted.ensureDeferred
async def test_a_refused_stop_is_reported_and_nothing_else_changes():
    control = FakeControl([process("orphan", 40001)], stop_answer={"success": False,
                                                                    "error": "busy"})
    report = await BackendReconciler(FakeDB([]), control).reconcile(NODE)
    assert report.stopped == [] and report.failed == ["orphan#0"]


@pytest_twisted.ensureDeferred
async def test_a_list_that_cannot_be_used_changes_nothing():
    for answer in (errors.TransportFailure("tunnel left again"),
                   [process(f"m{i}", 40000 + i) for i in range(MAX_PROCESSES + 1)]):
        control = FakeControl(answer)
        db = FakeDB([("vanished", "127.0.0.1:40005", "loaded")])
        report = await BackendReconciler(db, control).reconcile(NODE)
        assert report.error is not None
        assert stops(control) == [] and db.deleted == []


@pytest_twisted.ensureDeferred
async def test_an_agent_worker_is_left_alone_quietly():
    control = FakeControl(errors.VerbNotServed(NODE, "backend.list"))
    report = await BackendReconciler(FakeDB([]), control).reconcile(NODE)
    assert "not served" in report.error and stops(control) == []
