"""A job cancelled through the replica that is not driving it, with real processes (issue 26 §3).

Two frontends and one agent worker (``--node-type agent``), real ``twistd`` processes on one
PostgreSQL.  A long job of a drop-in kind (``e2e.block``: blocks until cancelled, and writes one
line to a file the test reads when its run is cancelled on the worker) is submitted; one replica
claims it and drives it on the agent (over its tunnel, or relayed).  The cancel is sent to the
*other* replica: it records ``cancel_requested`` and fans ``job.cancel`` out to the agent
workers (through the replica holding the agent's tunnel), the worker cancels the run, the
driving replica hears the answer and records ``cancelled``.  Asserted: the cancel's outcome is
``cancelled`` with the agent named; the run was stopped on the worker exactly once (its file and
its log line); the job is ``cancelled`` with one run, its claim gone, its outcome recorded once
(``finished_at`` does not move, a second cancel is ``409 job_finished``), and nothing runs it
again.

Deliberate break: ``AgentRunner.cancel_verb`` answering ``{"cancelled": False}`` without
cancelling -> the outcome is ``not-on-any-worker`` and the job stays ``running`` (red at the
outcome assertion).
"""

from __future__ import annotations

import textwrap

from .harness import hold_for, wait_for

PLUGIN = textwrap.dedent('''
    """e2e drop-in job kind: blocks until cancelled; a cancelled run appends a line to
    ``input.marker`` (the test reads it: evidence from the worker itself)."""
    from twisted.internet import defer
    from zope.interface import implementer

    from localai_tw.jobs.kinds import IJobKind, InvalidJobInput


    @implementer(IJobKind)
    class E2EBlock:
        name = "e2e.block"
        description = "blocks until cancelled (e2e test kind)"

        def validate(self, input):
            if not isinstance(input, dict) or not isinstance(input.get("marker"), str):
                raise InvalidJobInput("input.marker must be a path", field="input.marker")
            return input

        async def run(self, job):
            await job.progress({"event": "blocking"})
            try:
                await defer.Deferred()  # only a cancel ends it
            except defer.CancelledError:
                with open(job.input["marker"], "a") as f:
                    f.write(f"cancelled {job.job_id}\\n")
                raise


    e2e_block = E2EBlock()
''')


def _job(cluster, fe, job_id):
    answer = cluster.admin(fe, "GET", f"/api/jobs/{job_id}")
    assert answer.status == 200, (answer.status, answer.body)
    return answer.json()


def test_a_job_running_behind_one_replica_is_cancelled_through_the_other(make_cluster):
    cluster = make_cluster()
    cluster.install_plugin("e2e_block_jobs", PLUGIN)
    f0 = cluster.start_frontend()
    f1 = cluster.start_frontend()
    agent = cluster.start_agent(prefer=0)
    cluster.wait_registered(agent)
    cluster.wait_owned(agent, by=f0)
    marker = cluster.workdir / "cancelled-runs.txt"

    answer = cluster.admin(f0, "POST", "/api/jobs",
                           {"kind": "e2e.block", "input": {"marker": str(marker)}})
    assert answer.status == 202, answer.body
    job_id = answer.json()["id"]

    def blocking():
        job = _job(cluster, f1, job_id)
        return job if any(e.get("event") == "blocking" for e in job["progress"]) else None
    job = wait_for(blocking, 60, "the job runs on the agent")
    assert job["state"] == "running" and job["runs"] == 1
    (claimed_by,) = cluster.sql("SELECT claimed_by FROM work_claims WHERE id = %s", (job_id,))[0]
    driver = cluster.frontend_of(claimed_by)
    other = f1 if driver is f0 else f0
    assert not marker.exists()

    cancel = cluster.admin(other, "POST", f"/api/jobs/{job_id}/cancel")
    assert cancel.status == 200, cancel.body
    outcome = cancel.json()
    assert outcome["outcome"] == "cancelled", outcome
    assert [(w["name"], w["answer"]) for w in outcome["workers"]] == \
        [(agent.name, "cancelled")], outcome

    def finished():
        job = _job(cluster, other, job_id)
        return job if job["state"] == "cancelled" else None
    job = wait_for(finished, 30, "the driving replica records the job cancelled")
    assert job["runs"] == 1 and job["cancel_requested"] is True and job["finished_at"]
    # Stopped on the worker, once: the kind's own evidence and the agent's log line.
    assert marker.read_text() == f"cancelled {job_id}\n"
    assert len(cluster.grep(agent, f"cancelling job {job_id} on request")) == 1
    # The claim completes after the handler recorded the outcome, in its own (batched) commit.
    wait_for(lambda: cluster.sql("SELECT count(*) FROM work_claims WHERE id = %s",
                                 (job_id,))[0][0] == 0, 10, "the job's claim completed")

    # Recorded once: both replicas read the same finished job, which never changes again,
    # and a second cancel (at either replica) is refused as finished.
    first = {k: job[k] for k in ("state", "runs", "finished_at", "error")}
    for fe in (f0, f1):
        again = cluster.admin(fe, "POST", f"/api/jobs/{job_id}/cancel")
        assert again.status == 409 and again.json()["error"]["code"] == "job_finished", \
            again.body

    def unchanged():
        for fe in (f0, f1):
            now = _job(cluster, fe, job_id)
            assert {k: now[k] for k in first} == first, now
        assert marker.read_text() == f"cancelled {job_id}\n"
    hold_for(unchanged, 5)
