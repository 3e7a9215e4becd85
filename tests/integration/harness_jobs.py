"""Job kinds a test runs on a real cluster and the consumer's pause (``test_jobs.py``,
``test_key_scopes.py``)."""

from __future__ import annotations

from twisted.internet import defer
from zope.interface import implementer

from localai_tw.jobs.builtin import chat_job, embed_batch_job
from localai_tw.jobs.kinds import IJobKind, JobKinds


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


async def pause_consumer(frontend):
    consumer = frontend.replica.jobs.consumer
    await consumer.stopService()
    consumer.disownServiceParent()
    return consumer


def resume_consumer(frontend, consumer):
    consumer.setServiceParent(frontend.replica_service)
