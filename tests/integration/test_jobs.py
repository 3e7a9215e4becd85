"""Jobs on a real cluster in one process: FrontendService replicas on one PostgreSQL database,
real agent workers (``--node-type agent``: tunnel over WebSocket + yamux, the ``job.run`` and
``job.cancel`` verbs), a real backend worker with the ``echo`` backend as a subprocess for the
built-in kinds.  Each scenario's docstring names the deliberate break that turns it red; each
was checked once (see the commit message)."""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from twisted.internet import defer

from localai_tw import errors
from localai_tw.jobs.kinds import JobKinds

from .harness_echo import WEIGHTS
from .harness_jobs import EchoJob, WaitJob, kinds, pause_consumer, resume_consumer
from .inference_harness import ADMIN, sha256_hex
from .support import eventually

AUTH = {"Authorization": f"Bearer {ADMIN}"}


# -- HTTP helpers ----------------------------------------------------------------------------------


async def call(cluster, frontend, method, path, body=None, raw=None, headers=None):
    url = cluster.base_url(frontend) + path
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    response = await treq.request(method, url, data=data,
                                  headers={**AUTH, "Content-Type": "application/json",
                                           **(headers or {})})
    text = await response.text()
    return response.code, (json.loads(text) if text else None)


async def submit(cluster, frontend, kind, input):
    code, job = await call(cluster, frontend, "POST", "/api/jobs", {"kind": kind, "input": input})
    assert code == 202, job
    assert job["state"] == "queued"
    return job["id"]


async def finished(cluster, frontend, job_id, timeout=30.0):
    async def state():
        code, job = await call(cluster, frontend, "GET", f"/api/jobs/{job_id}")
        assert code == 200
        return job if job["state"] in ("succeeded", "failed", "cancelled") else None

    return await eventually(state, timeout=timeout, interval=0.1, what=f"job {job_id} finished")


async def job_state(cluster, frontend, job_id):
    code, job = await call(cluster, frontend, "GET", f"/api/jobs/{job_id}")
    assert code == 200
    return job


def write_echo_model(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", (
        "name: echo-chat\nbackend: echo\nparameters:\n  model: echo.bin\n  max_tokens: 64\n"
        f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"
        "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"
        "options: ['echo.dim:6']\n"))


# -- scenarios -----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_job_submitted_at_a_runs_on_an_agent_whose_tunnel_b_owns(cluster):
    """Replica A claims and drives the job; the agent's tunnel is held by replica B, so
    ``job.run`` is relayed, and the ``chat`` and ``embed-batch`` kinds call the cluster's own
    ``/v1`` (placement, cold load, the echo backend on a backend worker).

    Deliberate break: ``WorkerDialer._relayed`` raising ``WorkerUnroutable`` at once (delete
    the relay) -> the jobs stay queued, released with backoff, and this test times out red."""
    write_echo_model(cluster)
    a = await cluster.frontend("replica-a", job_kinds=kinds())
    b = await cluster.frontend("replica-b", job_kinds=kinds())
    await pause_consumer(b)  # only A claims: the run must cross the relay to B
    await cluster.worker("w-echo", a)
    agent = await cluster.agent("ag-1", b, kinds=kinds())
    assert await cluster.owner_of(agent.node_id) == "replica-b"

    chat_id = await submit(cluster, a, "chat", {
        "model": "echo-chat", "messages": [{"role": "user", "content": "hello jobs"}]})
    embed_id = await submit(cluster, a, "embed-batch", {
        "model": "echo-chat", "texts": ["one", "two words", "three more words"]})
    chat = await finished(cluster, b, chat_id, timeout=60)  # any replica answers
    assert chat["state"] == "succeeded", chat
    assert chat["result"]["choices"][0]["message"]["content"] == "hello jobs"
    assert chat["runs"] == 1
    events = [e["event"] for e in chat["progress"]]
    assert events[0] == "started" and "answered" in events
    assert chat["progress"][0]["worker"] == "ag-1" and chat["progress"][0]["rerun"] is False

    embed = await finished(cluster, a, embed_id, timeout=60)
    assert embed["state"] == "succeeded", embed
    code, result = await call(cluster, b, "GET", f"/api/jobs/{embed_id}/result")
    assert code == 200
    vectors = result["result"]["vectors"]
    assert result["result"]["count"] == 3 and [len(v) for v in vectors] == [6, 6, 6]
    assert vectors[0] != vectors[1]
    assert any(e["event"] == "embedded" and e["done"] == 3 for e in embed["progress"])
    # A drove both (B's consumer is paused), over the relay to B's tunnel.
    assert a.replica.jobs.dispatcher.stats["answered"] == 2
    assert agent.agent.stats["succeeded"] == 2
    assert await cluster.owner_of(agent.node_id) == "replica-b"


async def claim_row(frontend, job_id):
    rows = await frontend.database.runQuery(
        "SELECT claimed_by, attempts, failures,"
        " extract(epoch from (not_before - now()))::float8 FROM work_claims WHERE id = %s",
        (job_id,))
    return rows[0] if rows else None


def crash(frontend):
    """Make ``frontend`` behave like a killed process from now on: its consumer writes no
    settle (a dead process releases nothing); stopping it then closes its tunnels and peer
    links and deletes its ``instances`` row, as a dead replica's row stops being live."""
    consumer = frontend.replica.jobs.consumer
    consumer._settle = lambda write: defer.succeed(None)


@pytest_twisted.ensureDeferred
async def test_a_killed_replica_s_claim_is_reaped_and_the_job_runs_again_elsewhere(cluster):
    """A claims a job and drives it on the agent (relayed to B); A dies holding the claim.
    B reaps the claim because A is not live (no age term), runs the job again (the kind is
    told it is a re-run) and it finishes.

    Deliberate break: ``ClaimConsumer._checks`` without ``reap_abandoned()`` -> the claim
    stays held by the dead replica and the job never runs again (red at the second run)."""
    wait = WaitJob()
    a = await cluster.frontend("replica-ka", job_kinds=kinds(wait))
    b = await cluster.frontend("replica-kb", job_kinds=kinds(wait))
    paused = await pause_consumer(b)
    agent = await cluster.agent("ag-k", b, kinds=kinds(wait))
    job_id = await submit(cluster, a, "test.wait", {})
    await eventually(lambda: len(wait.runs) == 1, timeout=20, what="the first run")
    assert (await claim_row(a, job_id))[0] == "replica-ka"

    crash(a)
    await a.stopService()  # the stream breaks: the worker cancels the run (nobody listens)
    assert (await claim_row(b, job_id))[0] == "replica-ka"  # nothing released it
    resume_consumer(b, paused)
    await eventually(lambda: len(wait.runs) == 2, timeout=30, what="the second run")
    assert wait.runs[1] == (job_id, True)  # told it is a re-run
    wait.open(job_id)
    job = await finished(cluster, b, job_id)
    assert job["state"] == "succeeded" and job["result"] == {"waited": True, "rerun": True}
    assert job["runs"] == 2

    # The job is settled on the worker's answer first; the consumer completes the claim after,
    # in its next batched DELETE, so the job can read "succeeded" a moment before its claim is
    # gone. Wait for the claim (a claim never completed still fails here), never assume both
    # in one instant: that assumption failed once in a loaded CI run.
    async def claim_completed():
        return await claim_row(b, job_id) is None

    await eventually(claim_completed, timeout=10, what="the claim completed")
    assert agent.agent.stats["succeeded"] == 1


async def node_snapshot(frontend):
    db = frontend.database
    nodes = await db.runQuery("SELECT id, status, approved FROM backend_nodes ORDER BY id")
    models = await db.runQuery("SELECT node_id, model_name, state FROM node_models ORDER BY 1, 2")
    conns = await db.runQuery("SELECT node_id, owner_instance_id, epoch FROM node_connections"
                              " ORDER BY node_id")
    return [tuple(r) for r in nodes], [tuple(r) for r in models], [tuple(r) for r in conns]


async def cancel(cluster, frontend, job_id):
    code, answer = await call(cluster, frontend, "POST", f"/api/jobs/{job_id}/cancel")
    assert code == 200, answer
    return answer


@pytest_twisted.ensureDeferred
async def test_cancel_outcomes_no_agent_cancelled_and_queued(cluster):
    """``no-agent-worker`` when nobody can be asked; ``cancelled`` when the worker holding the
    run cancels it (relayed: the agent's tunnel is held by the other replica); a cancelled
    queued job never starts.  No cancel changes a node.

    Deliberate break: ``AgentRunner.cancel_verb`` answering ``{"cancelled": false}`` always ->
    the running job's cancel reads ``not-on-any-worker`` and the job never ends (red)."""
    wait = WaitJob()
    a = await cluster.frontend("replica-ca", job_kinds=kinds(wait))
    b = await cluster.frontend("replica-cb", job_kinds=kinds(wait))
    paused_a = await pause_consumer(a)
    paused_b = await pause_consumer(b)

    # A job marked running (as a replica does right before sending it) with no agent at all.
    lonely = await submit(cluster, a, "test.wait", {})
    assert await a.replica.jobs.store.begin(lonely) is not None
    answer = await cancel(cluster, a, lonely)
    assert answer == {"outcome": "no-agent-worker", "state": "running", "workers": []}

    # A queued job cancelled never starts.
    agent = await cluster.agent("ag-c", b, kinds=kinds(wait))
    queued = await submit(cluster, a, "test.wait", {})
    answer = await cancel(cluster, b, queued)
    assert answer == {"outcome": "cancelled", "state": "cancelled", "workers": []}
    assert await claim_row(a, queued) is None

    # A running job: cancelled by the worker holding it, asked through the relay from A.
    running = await submit(cluster, a, "test.wait", {})
    resume_consumer(b, paused_b)
    await eventually(lambda: [r for r in wait.runs if r[0] == running], timeout=20,
                     what="the run started")
    before = await node_snapshot(a)
    answer = await cancel(cluster, a, running)
    assert answer["outcome"] == "cancelled"
    assert answer["workers"] == [{"node_id": agent.node_id, "name": "ag-c",
                                  "answer": "cancelled"}]
    job = await finished(cluster, a, running)
    assert job["state"] == "cancelled"
    assert await node_snapshot(a) == before  # a cancel changed no node
    resume_consumer(a, paused_a)
    job = await job_state(cluster, a, queued)
    assert job["state"] == "cancelled" and job["runs"] == 0
    assert [r for r in wait.runs if r[0] == queued] == []  # never started
    assert agent.agent.stats["cancelled"] == 1


@pytest_twisted.ensureDeferred
async def test_cancel_outcomes_undelivered_not_on_any_worker_and_gone_excluded(cluster):
    """``undelivered`` while one agent worker is inside its reconnect grace (its tunnel lost,
    the departure younger than the grace); ``not-on-any-worker`` once every agent asked
    answered "not mine"; a worker gone past the grace is excluded, not undelivered.

    Deliberate break: a nanosecond grace (``--reconnect-grace`` 1e-9) -> the absent worker
    reads ``gone`` at once, the first cancel says ``not-on-any-worker`` (red)."""
    a = await cluster.frontend("replica-ua", job_kinds=kinds(WaitJob()))
    await pause_consumer(a)
    steady = await cluster.agent("ag-steady", a)
    away = await cluster.agent("ag-away", a)
    job_id = await submit(cluster, a, "test.wait", {})
    assert await a.replica.jobs.store.begin(job_id) is not None  # running, on no worker

    await away.dialer.stopService()  # its tunnel is lost; within the 90 s grace
    await eventually(lambda: not a.replica.tunnels.holds(away.node_id), timeout=10,
                     what="the tunnel released")

    async def departed():
        row = await a.replica.fence.owner_row(away.node_id)
        return row.owner_id == "" and row.disconnected_at is not None

    await eventually(departed, timeout=10, what="the departure recorded")
    before = await node_snapshot(a)
    answer = await cancel(cluster, a, job_id)
    assert answer["outcome"] == "undelivered"
    by_name = {w["name"]: w for w in answer["workers"]}
    assert by_name["ag-steady"]["answer"] == "not-mine"
    assert by_name["ag-away"] == {"node_id": away.node_id, "name": "ag-away",
                                  "answer": "undelivered", "condition": "absent-within-grace"}
    assert await node_snapshot(a) == before  # nothing demoted, reaped or evicted

    # The departure ages past the grace (on the database clock): excluded.
    await a.database.runOperation(
        "UPDATE node_connections SET disconnected_at = now() - interval '1 hour'"
        " WHERE node_id = %s", (away.node_id,))
    answer = await cancel(cluster, a, job_id)
    assert answer["outcome"] == "not-on-any-worker"
    by_name = {w["name"]: w for w in answer["workers"]}
    assert by_name["ag-steady"]["answer"] == "not-mine"
    assert by_name["ag-away"]["answer"] == "excluded"
    assert (await job_state(cluster, a, job_id))["state"] == "running"
    assert steady.agent.stats["cancel_asked"] == 2


async def metrics_text(cluster, frontend):
    response = await treq.get(cluster.base_url(frontend) + "/metrics", headers=AUTH)
    assert response.code == 200
    return await response.text()


class PoisonControl:
    """The replica's ControlClient, except that ``job.run`` of one job always breaks in
    transit (a TransportFailure: nothing learned)."""

    def __init__(self, control, poison_id):
        self._control = control
        self.poison_id = poison_id
        self.broken = 0

    def call(self, node_id, verb, body=None, timeout=None, on_progress=None):
        if verb == "job.run" and (body or {}).get("job_id") == self.poison_id:
            self.broken += 1
            return defer.fail(errors.TransportFailure("poison: the stream broke"))
        return self._control.call(node_id, verb, body, timeout=timeout,
                                  on_progress=on_progress)


@pytest_twisted.ensureDeferred
async def test_a_poison_job_backs_off_and_does_not_hold_the_head_of_the_queue(cluster):
    """A job whose dispatch always breaks in transit is released with the database-clock
    backoff 2, 4, 8, 16, 32, 60, 60 s (never counted as a failure), while jobs submitted
    after it run, with ONE slot on the only replica.  The test moves ``not_before`` to now()
    instead of sleeping.

    Deliberate break: ``_RELEASE_SQL`` with ``not_before = NULL`` (no backoff) -> the poison,
    oldest and always ready, takes the only slot on every tick and the backoff asserts fail."""
    a = await cluster.frontend("replica-pa", job_kinds=kinds())
    consumer = await pause_consumer(a)
    await cluster.agent("ag-p", a, kinds=kinds())
    consumer._max = 1  # one slot: the poison would block everything behind it
    poison = await submit(cluster, a, "test.echo", {"poison": True})
    control = PoisonControl(a.replica.jobs.dispatcher.control, poison)
    a.replica.jobs.dispatcher.control = control
    behind = [await submit(cluster, a, "test.echo", {"n": n}) for n in range(3)]
    resume_consumer(a, consumer)

    for n, job_id in enumerate(behind):
        job = await finished(cluster, a, job_id)
        assert job["state"] == "succeeded" and job["result"]["echo"]["n"] == n
    seen = []
    for attempts, backoff in enumerate((2, 4, 8, 16, 32, 60, 60), start=1):
        async def released(attempts=attempts):
            row = await claim_row(a, poison)
            return row if row and row[0] == "" and row[1] == attempts else None

        claimed_by, got, failures, remaining = await eventually(
            released, timeout=20, what=f"release {attempts}")
        assert failures == 0  # a transport failure is never counted against the job
        assert backoff - 1.5 < remaining <= backoff, (attempts, remaining)
        if attempts == 1:  # the queue's depth on /metrics: the poison is backing off
            await a.replica.jobs.stats.read_once()
            metrics = await metrics_text(cluster, a)
            assert 'localai_job_claims{status="backing_off"} 1.0' in metrics
            assert 'localai_job_claims{status="ready"} 0.0' in metrics
            assert 'localai_jobs{state="queued"} 1.0' in metrics
            assert 'localai_claims_total{outcome="released"}' in metrics
        seen.append(backoff)
        assert (await job_state(cluster, a, poison))["state"] == "queued"
        await a.database.runOperation(  # the database clock "passes" the backoff
            "UPDATE work_claims SET not_before = now() WHERE id = %s", (poison,))
        consumer.wake()
    assert seen == [2, 4, 8, 16, 32, 60, 60]
    assert control.broken >= 7


@pytest_twisted.ensureDeferred
async def test_bad_input_is_a_clear_4xx(cluster):
    """Unknown kind, oversized input, malformed JSON, a bad input for a built-in kind, an
    unknown id, a bad filter, no credentials: each a 4xx naming the cause; nothing queued.

    Deliberate break: ``JobsResource.submit`` without the ``UnknownJobKind`` clause -> the
    unknown kind answers 500 (red)."""
    a = await cluster.frontend("replica-ba", job_kinds=kinds())
    code, body = await call(cluster, a, "POST", "/api/jobs", {"kind": "nope", "input": {}})
    assert code == 400 and body["error"]["field"] == "kind"
    assert "unknown job kind 'nope'" in body["error"]["message"]
    assert "chat" in body["error"]["message"]
    code, body = await call(cluster, a, "POST", "/api/jobs", raw=b'{"kind": "chat", "input": ')
    assert code == 400 and "not valid JSON" in body["error"]["message"]
    code, body = await call(cluster, a, "POST", "/api/jobs",
                            {"kind": "test.echo", "input": "x" * (1024 * 1024 + 10)})
    assert code == 400 and body["error"]["field"] == "input"
    code, body = await call(cluster, a, "POST", "/api/jobs",
                            raw=b'{"kind":"test.echo","input":"' + b"x" * (2 * 1024 * 1024)
                            + b'"}')
    assert code == 413
    code, body = await call(cluster, a, "POST", "/api/jobs",
                            {"kind": "chat", "input": {"model": "m", "messages": []}})
    assert code == 400 and body["error"]["field"] == "input.messages"
    code, body = await call(cluster, a, "POST", "/api/jobs",
                            {"kind": "embed-batch", "input": {"model": "m", "texts": [""]}})
    assert code == 400 and body["error"]["field"] == "input.texts[0]"
    code, body = await call(cluster, a, "POST", "/api/jobs", {"kind": "chat"})
    assert code == 400 and body["error"]["field"] == "input"
    unknown = "00000000-0000-0000-0000-000000000000"
    code, body = await call(cluster, a, "POST", f"/api/jobs/{unknown}/cancel")
    assert code == 404
    code, body = await call(cluster, a, "POST", "/api/jobs/not-a-job/cancel")
    assert code == 404
    code, body = await call(cluster, a, "GET", f"/api/jobs/{unknown}")
    assert code == 404
    code, body = await call(cluster, a, "GET", "/api/jobs?state=nope")
    assert code == 400 and body["error"]["field"] == "state"
    code, body = await call(cluster, a, "GET", "/api/jobs", headers={"Authorization": "Bearer x"})
    assert code == 401
    rows = await a.database.runQuery("SELECT count(*) FROM jobs")
    assert rows[0][0] == 0


@pytest_twisted.ensureDeferred
async def test_list_filters_and_pages_and_a_finished_job_cannot_be_cancelled(cluster):
    a = await cluster.frontend("replica-la", job_kinds=kinds())
    await cluster.agent("ag-l", a, kinds=kinds())
    ids = [await submit(cluster, a, "test.echo", {"n": n}) for n in range(5)]
    for job_id in ids:
        await finished(cluster, a, job_id)
    code, page = await call(cluster, a, "GET", "/api/jobs?state=succeeded&limit=2")
    assert code == 200 and [j["id"] for j in page["jobs"]] == ids[::-1][:2]
    code, page2 = await call(cluster, a, "GET",
                             f"/api/jobs?state=succeeded&limit=2&before={page['next']}")
    assert [j["id"] for j in page2["jobs"]] == ids[::-1][2:4]
    code, none = await call(cluster, a, "GET", "/api/jobs?state=queued")
    assert none == {"jobs": [], "next": None}
    code, body = await call(cluster, a, "POST", f"/api/jobs/{ids[0]}/cancel")
    assert code == 409 and body["error"]["code"] == "job_finished"
    code, body = await call(cluster, a, "GET", "/api/jobs/kinds")
    assert {k["kind"] for k in body["kinds"]} == {"chat", "embed-batch", "test.echo"}


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_the_dashboard_lists_jobs_with_their_state(cluster):
    """The dashboard's Jobs panel shows a finished job and a failed one with its error, read
    from /api/jobs.

    Deliberate break: ``renderJobs`` not called in ``poll`` -> the rows never appear (red)."""
    from .browser import Browser, require_browser
    from .harness_dashboard import open_with_key, text_of

    require_browser()
    a = await cluster.frontend("replica-da", job_kinds=kinds())
    await cluster.agent("ag-d", a, kinds=JobKinds([EchoJob()]))
    done = await submit(cluster, a, "test.echo", {"n": 1})
    failed = await submit(cluster, a, "chat", {"model": "m", "messages": [{"role": "user"}]})
    assert (await finished(cluster, a, done))["state"] == "succeeded"
    assert (await finished(cluster, a, failed))["state"] == "failed"
    browser = await Browser.start()
    try:
        await open_with_key(browser, cluster.base_url(a) + "/")
        state = await browser.wait_for(text_of(f'tr[data-job="{done}"] .state'),
                                       what="the finished job")
        assert state == "succeeded"
        row = await browser.wait_for(text_of(f'tr[data-job="{failed}"]'),
                                     what="the failed job")
        assert "failed" in row and "does not run jobs of kind 'chat'" in row
    finally:
        await browser.stop()


@pytest_twisted.ensureDeferred
async def test_a_busy_agent_s_answer_releases_the_job_without_counting_a_failure(cluster):
    """An agent worker with one slot answers the second job 503 busy: the job did not start,
    its claim is released with backoff and ``failures`` stays 0; it runs once the slot frees.

    Deliberate break: ``AllAgentsBusy`` left out of ``JOB_TRANSPORT_ERRORS`` -> the release
    counts a work failure (``failures`` 1) and the test is red."""
    wait = WaitJob()
    a = await cluster.frontend("replica-sa", job_kinds=kinds(wait))
    agent = await cluster.agent("ag-s", a, kinds=kinds(wait), max_jobs=1)
    first = await submit(cluster, a, "test.wait", {})
    await eventually(lambda: [r for r in wait.runs if r[0] == first], timeout=20,
                     what="the first job running")
    second = await submit(cluster, a, "test.wait", {})

    async def released_busy():
        row = await claim_row(a, second)
        return row if row and row[0] == "" and row[1] >= 1 else None

    _, attempts, failures, remaining = await eventually(released_busy, timeout=20,
                                                        what="the busy release")
    assert failures == 0 and remaining > 0  # released with backoff, never a failure
    job = await job_state(cluster, a, second)
    assert job["state"] == "queued" and job["runs"] == 0
    assert any(e.get("event") == "released" and e.get("reason") == "busy"
               for e in job["progress"])
    assert agent.agent.stats["busy"] >= 1
    wait.open(first)
    assert (await finished(cluster, a, first))["state"] == "succeeded"
    await a.database.runOperation("UPDATE work_claims SET not_before = now() WHERE id = %s",
                                  (second,))
    a.replica.jobs.consumer.wake()
    await eventually(lambda: [r for r in wait.runs if r[0] == second], timeout=20,
                     what="the second job running once the slot is free")
    wait.open(second)
    job = await finished(cluster, a, second)
    assert job["state"] == "succeeded" and job["runs"] == 1
