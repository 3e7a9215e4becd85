"""``CrashProbe`` (frontend/inference/crashes.py) without a worker: only the worker's answer
``crashed: true`` for this call's model makes a crash, and whatever the worker sends is bounded
again here.  With real processes: tests/integration/test_backend_crash.py."""

from __future__ import annotations

import pytest_twisted
from twisted.internet import defer

from localai_tw import errors
from localai_tw.frontend.inference.crashes import MAX_LINE_CHARS, MAX_LINES, CrashProbe, crash_shaped
from localai_tw.frontend.inference.placement import Placement

PLACEMENT = Placement("m", "node-1", "127.0.0.1:30001", "m")


class FakeControl:
    def __init__(self, answer):
        self.answer = answer
        self.calls = []

    def call(self, node_id, verb, body, timeout=None):
        self.calls.append((node_id, verb, body, timeout))
        if isinstance(self.answer, BaseException):
            return defer.fail(self.answer)
        return defer.succeed(self.answer)


def crashed(**fields):
    return {"crashed": True, "model": "m", "description": "killed by signal SIGSEGV",
            "signal": "SIGSEGV", "exit_code": None, "output": ["a", "b"], "fallback": "",
            "node_name": "w1", **fields}


@pytest_twisted.ensureDeferred
async def test_the_workers_crash_answer_becomes_a_worker_answer():
    control = FakeControl(crashed())
    crash = await CrashProbe(control).explain(PLACEMENT)
    assert control.calls == [("node-1", "backend.exit", {"port": 30001}, 5.0)]
    assert isinstance(crash, errors.BackendCrashed) and isinstance(crash, errors.WorkerAnswer)
    assert (crash.model, crash.description, crash.output, crash.node_name, crash.signal) == \
        ("m", "killed by signal SIGSEGV", ["a", "b"], "w1", "SIGSEGV")


@pytest_twisted.ensureDeferred
async def test_anything_but_a_crash_of_this_model_leaves_the_failure_as_it_was():
    for answer in ({"crashed": False, "state": "ready"}, {"crashed": False, "state": "absent"},
                   crashed(model="another"), crashed(crashed="yes"), None, [],
                   errors.VerbNotServed("node-1", "backend.exit"),
                   errors.WorkerUnroutable("node-1", "no route"), RuntimeError("x")):
        assert await CrashProbe(FakeControl(answer)).explain(PLACEMENT) is None, answer


@pytest_twisted.ensureDeferred
async def test_the_workers_words_are_bounded_whatever_it_sends():
    lines = [f"{i} " + "x" * 5000 for i in range(50)]
    crash = await CrashProbe(FakeControl(crashed(
        output=lines, description="d" * 5000, node_name=7, exit_code=True))).explain(PLACEMENT)
    assert len(crash.output) == MAX_LINES and crash.output[-1].startswith("49 ")
    assert all(len(line) <= MAX_LINE_CHARS for line in crash.output)
    assert len(crash.description) <= 200 and crash.node_name == "" and crash.exit_code is None
    odd = await CrashProbe(FakeControl(crashed(output="not a list"))).explain(PLACEMENT)
    assert odd.output == []


def test_which_failures_are_shaped_like_a_dying_process():
    assert crash_shaped(errors.BackendAnswer("n", "UNAVAILABLE", "Socket closed"))
    assert crash_shaped(errors.BackendAnswer("n", "UNKNOWN", "Stream removed"))
    assert crash_shaped(errors.TransportFailure("stream reset"))
    assert not crash_shaped(errors.BackendAnswer("n", "INVALID_ARGUMENT", "bad"))
    assert not crash_shaped(errors.BackendAnswer("n", "DEADLINE_EXCEEDED", "slow"))
    assert not crash_shaped(errors.StreamRefused("n", "unavailable", "port closed"))
    assert not crash_shaped(errors.WorkerUnroutable("n", "no route"))
    assert not crash_shaped(errors.CallerDeadlineExceeded("x"))
