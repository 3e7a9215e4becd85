"""Jobs with real processes (issue 13, §5): the replica driving a running job is SIGKILLed.

Two frontends and one agent worker (``--node-type agent``), real ``twistd`` processes on one
PostgreSQL.  A job kind dropped in as an operator plugin (``e2e.sleep``: sleeps long on its first
run, briefly when told it is a re-run) is submitted at frontend 0; whichever replica claims it
drives it on the agent (over its tunnel, or relayed).  That replica is killed with SIGKILL while
the job runs: nothing releases the claim, the agent's stream breaks and it cancels the run.
Once the dead replica's ``instances`` row stops being live (30 s), the survivor reaps the claim
(no age term), runs the job again -- the kind is told it is a re-run -- and it succeeds.

Deliberate break: ``ClaimConsumer._checks`` without ``queue.reap_abandoned()`` -> the claim
stays with the dead replica and the job never finishes (red at the wait for ``succeeded``).
"""

from __future__ import annotations

import textwrap

from .harness import wait_for

PLUGIN = textwrap.dedent('''
    """e2e drop-in job kind: sleeps ``seconds`` (``rerun_seconds`` on a re-run)."""
    from twisted.internet import reactor, task
    from zope.interface import implementer

    from localai_tw.jobs.kinds import IJobKind, InvalidJobInput


    @implementer(IJobKind)
    class E2ESleep:
        name = "e2e.sleep"
        description = "sleeps (e2e test kind)"

        def validate(self, input):
            if not isinstance(input, dict) or not isinstance(input.get("seconds"), int):
                raise InvalidJobInput("input.seconds must be an integer", field="input.seconds")
            return input

        async def run(self, job):
            seconds = job.input.get("rerun_seconds", 1) if job.rerun else job.input["seconds"]
            await job.progress({"event": "sleeping", "seconds": seconds, "rerun": job.rerun})
            await task.deferLater(reactor, seconds, lambda: None)
            return {"slept": seconds, "rerun": job.rerun}


    e2e_sleep = E2ESleep()
''')


def _job(cluster, fe, job_id):
    answer = cluster.admin(fe, "GET", f"/api/jobs/{job_id}")
    assert answer.status == 200, (answer.status, answer.body)
    return answer.json()


def test_the_replica_driving_a_job_is_killed_the_job_is_reaped_and_runs_again(make_cluster):
    cluster = make_cluster()
    cluster.install_plugin("e2e_jobs", PLUGIN)
    f0 = cluster.start_frontend()
    f1 = cluster.start_frontend()
    agent = cluster.start_agent(prefer=1)
    cluster.wait_registered(agent)
    cluster.wait_owned(agent, by=f1)

    answer = cluster.admin(f0, "POST", "/api/jobs",
                           {"kind": "e2e.sleep", "input": {"seconds": 600, "rerun_seconds": 1}})
    assert answer.status == 202, answer.body
    job_id = answer.json()["id"]
    wait_for(lambda: _job(cluster, f0, job_id)["runs"] == 1, 60, "the first run started")
    (claimed_by,) = cluster.sql("SELECT claimed_by FROM work_claims WHERE id = %s", (job_id,))[0]
    victim = cluster.frontend_of(claimed_by)
    survivor = f1 if victim is f0 else f0

    victim.kill()
    assert victim.popen.returncode == -9
    # Nothing released the claim: a dead process writes nothing.
    assert cluster.sql("SELECT claimed_by FROM work_claims WHERE id = %s",
                       (job_id,))[0][0] == victim.instance_id

    def succeeded():
        job = _job(cluster, survivor, job_id)
        assert job["state"] in ("queued", "running", "succeeded"), job
        return job if job["state"] == "succeeded" else None

    job = wait_for(succeeded, 150, "the job re-run and finished on the survivor")
    assert job["result"] == {"slept": 1, "rerun": True}
    assert job["runs"] == 2
    started = [e for e in job["progress"] if e.get("event") == "started"]
    assert [e["rerun"] for e in started] == [False, True]
    assert cluster.sql("SELECT count(*) FROM work_claims WHERE id = %s", (job_id,))[0][0] == 0
