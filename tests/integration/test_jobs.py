"""Jobs on a real cluster in one process: FrontendService replicas on one PostgreSQL database,
real agent workers (``--node-type agent``: tunnel over WebSocket + yamux, the ``job.run`` and
``job.cancel`` verbs), a real backend worker with the ``echo`` backend as a subprocess for the
built-in kinds.  Each scenario's docstring names the deliberate break that turns it red; each
was checked once (see the commit message)."""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import defer, reactor
from zope.interface import implementer

from localai_tw import errors
from localai_tw.jobs.builtin import chat_job, embed_batch_job
from localai_tw.jobs.kinds import IJobKind, JobKinds

from .inference_harness import ADMIN, sha256_hex
from .support import eventually

WEIGHTS = b"echo weights " * 100
AUTH = {"Authorization": f"Bearer {ADMIN}"}


# -- test kinds ----------------------------------------------------------------------------------


@implementer(IJobKind)
class EchoJob:
    """Answers its input; one progress event."""

    name = "test.echo"
    description = "answers its input"

    def validate(self, input):
        return input

    async def run(self, job):
        await job.progress({"event": "echoing", "rerun": job.rerun})
        return {"echo": job.input, "rerun": job.rerun}


@implementer(IJobKind)
class WaitJob:
    """Waits until the test opens its gate (or the run is cancelled)."""

    name = "test.wait"
    description = "waits for the test"

    def __init__(self):
        self.gates: dict[str, defer.Deferred] = {}
        self.runs: list[tuple[str, bool]] = []

    def validate(self, input):
        return input

    def open(self, job_id: str) -> None:
        self.gates.setdefault(job_id, defer.Deferred())
        if not self.gates[job_id].called:
            self.gates[job_id].callback(None)

    async def run(self, job):
        self.runs.append((job.job_id, job.rerun))
        gate = self.gates.get(job.job_id)
        if gate is None or gate.called:
            gate = self.gates[job.job_id] = defer.Deferred()
        await job.progress({"event": "waiting"})
        await gate
        return {"waited": True, "rerun": job.rerun}


def kinds(*extra):
    return JobKinds([chat_job, embed_batch_job, EchoJob(), *extra])


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


async def pause_consumer(frontend):
    consumer = frontend.replica.jobs.consumer
    await consumer.stopService()
    consumer.disownServiceParent()
    return consumer


def resume_consumer(frontend, consumer):
    consumer.setServiceParent(frontend.replica_service)


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
