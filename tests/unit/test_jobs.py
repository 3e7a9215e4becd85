"""Jobs without I/O: the kinds and their bounds, the agent worker's verbs, the cancel fan-out's
classification, the dispatcher's settling by the four conditions."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer
from zope.interface import implementer

from localai_tw import errors
from localai_tw.bus.claims import Claim
from localai_tw.frontend.jobs.cancel import CancelFanout, WorkerCancel, outcome_of
from localai_tw.frontend.jobs.dispatch import (
    AllAgentsBusy,
    JobDispatcher,
    NoReachableAgent,
)
from localai_tw.frontend.jobs.store import Dispatch
from localai_tw.jobs.builtin import chat_job, embed_batch_job
from localai_tw.jobs.kinds import (
    MAX_EVENT_BYTES,
    MAX_INPUT_BYTES,
    MAX_RESULT_BYTES,
    IJobKind,
    InvalidJobInput,
    JobKinds,
    UnknownJobKind,
    bounded_event,
)
from localai_tw.worker.agent import AgentRunner
from localai_tw.worker.control import ControlVerbs, NoFreeSlot


@implementer(IJobKind)
class Slow:
    name = "slow"
    description = "waits on a Deferred the test fires"

    def __init__(self):
        self.pending: list[defer.Deferred] = []
        self.jobs = []

    def validate(self, input):
        return input

    def run(self, job):
        self.jobs.append(job)
        d = defer.Deferred()
        self.pending.append(d)
        return d


@implementer(IJobKind)
class Big:
    name = "big"
    description = "answers too much"

    def validate(self, input):
        return input

    def run(self, job):
        return {"blob": "x" * (MAX_RESULT_BYTES + 1)}


def progress_sink(lines):
    def progress(event):
        lines.append(event)
        return defer.succeed(None)
    return progress


# -- kinds -------------------------------------------------------------------------------------


def test_the_built_in_kinds_are_found_as_plugins():
    assert {"chat", "embed-batch"} <= set(JobKinds.discover().names())


def test_validation_names_the_field_and_refuses_unknown_kinds_and_oversized_input():
    kinds = JobKinds([chat_job, embed_batch_job])
    with pytest.raises(UnknownJobKind):
        kinds.validate("nope", {})
    with pytest.raises(InvalidJobInput) as bad:
        kinds.validate("Not A Kind!", {})
    assert bad.value.field == "kind"
    with pytest.raises(InvalidJobInput) as bad:
        kinds.validate("embed-batch", {"model": "m", "texts": ["x" * MAX_INPUT_BYTES]})
    assert bad.value.field == "input"
    with pytest.raises(InvalidJobInput) as bad:
        kinds.validate("chat", {"model": "m", "messages": [{"role": "user"}], "stream": True})
    assert bad.value.field == "input.stream"
    with pytest.raises(InvalidJobInput) as bad:
        kinds.validate("embed-batch", {"model": "m", "texts": ["a"], "extra": 1})
    assert bad.value.field == "input.extra"
    assert kinds.validate("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def test_a_progress_event_is_bounded():
    assert bounded_event({"event": "x"}) == {"event": "x"}
    assert bounded_event(3) == {"value": 3}
    big = bounded_event({"event": "huge", "blob": "y" * MAX_EVENT_BYTES})
    assert big["truncated"] is True and big["event"] == "huge"


# -- the agent worker's verbs ------------------------------------------------------------------


def runner(*kinds, max_runs=1):
    r = AgentRunner("ag", JobKinds(kinds), api=None, max_runs=max_runs)
    r.register(ControlVerbs())
    return r


def test_a_run_writes_started_then_the_kind_s_answer():
    slow = Slow()
    r = runner(slow)
    lines = []
    d = defer.ensureDeferred(r.run_verb({"job_id": "j1", "kind": "slow", "input": {"a": 1},
                                         "rerun": True}, progress_sink(lines)))
    assert lines == [{"event": "started", "worker": "ag", "rerun": True}]
    assert slow.jobs[0].rerun is True and slow.jobs[0].input == {"a": 1}
    assert r.running() == ["j1"]
    slow.pending[0].callback({"ok": 1})
    assert d.result == {"status": "succeeded", "result": {"ok": 1}}
    assert r.running() == []


def test_a_full_worker_and_a_duplicate_run_are_busy_before_anything_starts():
    slow = Slow()
    r = runner(slow, max_runs=1)
    defer.ensureDeferred(r.run_verb({"job_id": "j1", "kind": "slow", "input": {}},
                                    progress_sink([])))
    for job_id in ("j1", "j2"):
        lines = []
        d = defer.ensureDeferred(r.run_verb({"job_id": job_id, "kind": "slow", "input": {}},
                                            progress_sink(lines)))
        failure = []
        d.addErrback(failure.append)
        assert failure and failure[0].check(NoFreeSlot)
        assert lines == []  # 503 busy: nothing was started
    assert len(slow.jobs) == 1


def test_cancel_answers_for_this_worker_only():
    slow = Slow()
    r = runner(slow)
    assert r.cancel_verb({"job_id": "j1"}) == {"cancelled": False}  # not mine
    d = defer.ensureDeferred(r.run_verb({"job_id": "j1", "kind": "slow", "input": {}},
                                        progress_sink([])))
    assert r.cancel_verb({"job_id": "j1"}) == {"cancelled": True}
    assert d.result == {"status": "cancelled"}
    assert r.cancel_verb({"job_id": "j1"}) == {"cancelled": False}  # gone once cancelled


def test_the_caller_leaving_cancels_the_run_without_an_answer():
    slow = Slow()
    r = runner(slow)
    d = defer.ensureDeferred(r.run_verb({"job_id": "j1", "kind": "slow", "input": {}},
                                        progress_sink([])))
    d.cancel()  # what the control plane does when the caller's stream breaks
    failure = []
    d.addErrback(failure.append)
    assert failure[0].check(defer.CancelledError)
    assert r.running() == [] and r.stats["cancelled"] == 0


def test_unknown_kind_failure_and_oversized_result_are_the_worker_s_answers():
    r = runner(Big())
    reply = defer.ensureDeferred(r.run_verb({"job_id": "j", "kind": "nope", "input": {}},
                                            progress_sink([]))).result
    assert reply["status"] == "failed" and "does not run jobs of kind 'nope'" in reply["message"]
    assert "error" not in reply  # "error" would read as the verb failing, not the job
    reply = defer.ensureDeferred(r.run_verb({"job_id": "j", "kind": "big", "input": {}},
                                            progress_sink([]))).result
    assert reply["status"] == "failed" and "bytes as JSON" in reply["message"]


# -- the cancel fan-out ------------------------------------------------------------------------


class FakeDB:
    def __init__(self, rows):
        self.rows = rows

    def runQuery(self, sql, params=None):
        return defer.succeed(self.rows)


class FakeControl:
    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def call(self, node_id, verb, body=None, timeout=None, on_progress=None):
        self.calls.append((node_id, verb, body))
        answer = self.answers[node_id]
        if isinstance(answer, Exception):
            return defer.fail(answer)
        if callable(answer):
            return answer(on_progress)
        return defer.succeed(answer)


@pytest.mark.parametrize("answers, outcome", [
    ({"n1": {"cancelled": False}, "n2": {"cancelled": True}}, "cancelled"),
    ({"n1": {"cancelled": True}, "n2": errors.AbsentWithinGrace("n2", "reconnecting")},
     "cancelled"),
    ({"n1": {"cancelled": False}, "n2": errors.AbsentWithinGrace("n2", "reconnecting")},
     "undelivered"),
    ({"n1": {"cancelled": False}, "n2": errors.PeerUnreachable("r", "down")}, "undelivered"),
    ({"n1": {"cancelled": False}, "n2": errors.WorkerUnroutable("n2", "no route")},
     "undelivered"),
    ({"n1": {"cancelled": False}, "n2": errors.TransportFailure("broke")}, "undelivered"),
    ({"n1": {"cancelled": False}, "n2": errors.WorkerGone("n2", 90)}, "not-on-any-worker"),
    ({"n1": {"cancelled": False}, "n2": errors.VerbNotServed("n2", "job.cancel")},
     "not-on-any-worker"),
    ({"n1": errors.WorkerGone("n1", 90), "n2": errors.WorkerGone("n2", 90)},
     "no-agent-worker"),
])
def test_cancel_outcomes_are_kept_apart(answers, outcome):
    fanout = CancelFanout(FakeDB([("n1", "one"), ("n2", "two")]), FakeControl(answers))
    got, workers = defer.ensureDeferred(fanout.cancel("job")).result
    assert got == outcome
    assert [w.name for w in workers] == ["one", "two"]


def test_no_agent_worker_when_nobody_is_asked():
    control = FakeControl({})
    got, workers = defer.ensureDeferred(CancelFanout(FakeDB([]), control).cancel("j")).result
    assert (got, workers, control.calls) == ("no-agent-worker", [], [])


def test_outcome_order():
    w = [WorkerCancel("a", "a", "undelivered", "x"), WorkerCancel("b", "b", "cancelled")]
    assert outcome_of(w) == "cancelled"
    assert outcome_of(w[:1]) == "undelivered"
    assert outcome_of([]) == "no-agent-worker"


# -- the dispatcher ------------------------------------------------------------------------------


class FakeStore:
    def __init__(self, cancel_requested=False):
        self.events, self.finished, self.requeued, self.runs = [], [], 0, 0
        self.cancel_requested = cancel_requested

    async def begin(self, job_id):
        return Dispatch(job_id, "slow", {}, self.runs)

    async def add_event(self, job_id, event):
        self.events.append(event)

    async def started(self, job_id):
        self.runs += 1
        return self.cancel_requested

    async def requeue(self, job_id):
        self.requeued += 1
        return True

    async def finish(self, job_id, state, *, result=None, error=None, **_):
        self.finished.append((state, result, error))
        return True


CLAIM = Claim("j", "job", b"j", "replica", 0, 0)


def dispatcher(store, answers, agents=None):
    agents = tuple(answers) if agents is None else agents
    return JobDispatcher(store, FakeDB([(n, n, "replica") for n in agents]),
                         FakeControl(answers), "replica")


def handle(d):
    result = []
    defer.ensureDeferred(d.handle(CLAIM)).addBoth(result.append)
    return result[0]


def test_the_worker_s_answer_completes_and_records_it():
    store = FakeStore()
    d = dispatcher(store, {"n1": {"status": "succeeded", "result": {"x": 1}}})
    assert handle(d) is None
    assert store.finished == [("succeeded", {"x": 1}, None)]
    store = FakeStore()
    d = dispatcher(store, {"n1": errors.ControlVerbFailed("n1", "job.run", "kaboom")})
    assert handle(d) is None
    assert store.finished == [("failed", None, "kaboom")]


def test_busy_everywhere_releases_without_a_failure_and_requeues():
    store = FakeStore()
    d = dispatcher(store, {"n1": errors.WorkerBusy("n1"), "n2": errors.WorkerBusy("n2")})
    outcome = handle(d)
    assert outcome.check(AllAgentsBusy)
    assert store.finished == [] and store.requeued == 1
    assert store.events[-1]["reason"] == "busy"


def test_absent_or_unreachable_workers_are_skipped_never_acted_on():
    store = FakeStore()
    d = dispatcher(store, {"n1": errors.AbsentWithinGrace("n1", "reconnecting"),
                           "n2": {"status": "succeeded", "result": 1}})
    assert handle(d) is None and store.finished == [("succeeded", 1, None)]
    store = FakeStore()
    d = dispatcher(store, {"n1": errors.AbsentWithinGrace("n1", "reconnecting"),
                           "n2": errors.PeerUnreachable("r2", "down")})
    assert handle(d).check(NoReachableAgent) and store.finished == []
    store = FakeStore()
    assert handle(dispatcher(store, {}, agents=())).check(NoReachableAgent)


def test_a_broken_stream_is_released_not_finished():
    store = FakeStore()
    d = dispatcher(store, {"n1": errors.TransportFailure("reset")})
    assert handle(d).check(errors.TransportFailure)
    assert store.finished == [] and store.requeued == 1


def test_a_cancel_requested_before_the_start_stops_the_run():
    store = FakeStore(cancel_requested=True)
    pending = defer.Deferred()

    def run(on_progress):
        on_progress({"event": "started", "worker": "n1", "rerun": False})
        return pending

    d = dispatcher(store, {"n1": run})
    assert handle(d) is None
    assert pending.called  # cancelled: closing the stream makes the worker cancel the run
    assert store.finished == [("cancelled", None, None)]


@pytest_twisted.ensureDeferred
async def test_the_agent_verbs_are_registered():
    verbs = ControlVerbs()
    AgentRunner("ag", JobKinds(), api=None).register(verbs)
    assert {"job.run", "job.cancel"} <= set(verbs.names())
    assert verbs.lookup("job.run").streaming is True


def test_a_failure_after_the_start_is_never_read_as_did_not_start():
    store = FakeStore()

    def run(on_progress):
        on_progress({"event": "started", "worker": "n1", "rerun": False})
        return defer.fail(errors.PeerUnreachable("r2", "the link dropped"))

    d = dispatcher(store, {"n1": run, "n2": {"status": "succeeded", "result": 1}},
                   agents=("n1",))
    outcome = handle(d)
    assert outcome.check(errors.TransportFailure)  # released; not moved on to another worker
    assert store.finished == [] and store.requeued == 1


def test_a_cancel_while_the_started_line_is_being_written_is_mine_and_nothing_runs():
    slow = Slow()
    r = runner(slow)
    paced = defer.Deferred()  # the caller is not reading yet

    def progress(event):
        return paced

    d = defer.ensureDeferred(r.run_verb({"job_id": "j1", "kind": "slow", "input": {}},
                                        progress))
    assert r.cancel_verb({"job_id": "j1"}) == {"cancelled": True}
    paced.callback(None)
    assert d.result == {"status": "cancelled"}
    assert slow.jobs == []  # the kind never ran
