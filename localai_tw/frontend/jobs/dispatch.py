"""Dispatch: a replica's claim-queue consumer hands each claimed job to an agent worker.

Every replica runs one :class:`~localai_tw.bus.claims.ClaimConsumer` of kind ``job`` (built by
:func:`job_consumer`, a service of the replica).  For each claim, :meth:`JobDispatcher.handle`:

1. ``JobStore.begin``: marks the job running, or learns it must not run (finished, or its
   cancel was requested: recorded cancelled) -> the claim completes;
2. picks agent workers (:data:`AGENTS_FOR_DISPATCH_SQL`: ``node_type = 'agent'``, healthy,
   tunnel held by a live replica; those held here first, then random) and calls the streaming
   verb ``job.run`` on them through the ``ControlClient`` (the tunnel here, or relayed by the
   owner), at most :data:`MAX_WORKERS_TRIED`, moving on only when the failure proves the job
   did not start on that worker (busy, verb not served, no route, absent, peer unreachable);
3. stores each progress line as an event; on ``started`` counts the run and, when a cancel was
   requested meanwhile, stops it (closing the stream makes the worker cancel);
4. settles by the four conditions:

   ============================================  ===========================================
   what happened                                 the claim / the job
   ============================================  ===========================================
   the worker's answer (succeeded, failed,       completed / finished with that answer
   cancelled; a verb failure)
   every worker tried was busy                   released with backoff, failures not counted
                                                 (``AllAgentsBusy``) / queued again
   no agent worker reachable, or every one       released with backoff (``NoReachableAgent``)
   tried could not be reached                    / queued again: nothing was learned
   the stream broke after the start, a deadline  released with backoff / queued again; the
   (``TransportFailure``...)                     next dispatch is a re-run
   this replica stops                            released at once (the consumer abandons it)
   this replica dies                             reaped by another replica once this one is
                                                 not live; run again there (a re-run)
   ============================================  ===========================================

Releases use the claim queue's database-clock backoff (2 s doubling to 60 s), so a job that
can never be delivered does not hold the head of the queue.

What this module must never do: settle a job on anything but the worker's answer, act on a
worker's absence (it only skips it), or run a job whose cancel was requested.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger

from localai_tw import errors
from localai_tw.bus.claims import DEFAULT_TRANSPORT_ERRORS, Claim, ClaimConsumer, ClaimQueue
from localai_tw.deferreds import shielded
from localai_tw.cluster.clock import (
    CONNECTION_IS_HELD_SQL,
    INSTANCE_IS_LIVE_SQL,
    INSTANCE_LIVENESS,
)
from localai_tw.jobs.kinds import MAX_RESULT_BYTES, encoded_size

from localai_tw.frontend.jobs.store import CLAIM_KIND, JobStore

log = Logger()

#: Agent workers one dispatch tries before releasing the claim.
MAX_WORKERS_TRIED = 3
#: Jobs one replica drives at once.
DEFAULT_JOB_SLOTS = 4

#: Agent workers a job may be sent to now.  Bind: liveness.
AGENTS_FOR_DISPATCH_SQL = (
    "SELECT n.id, n.name, node_connections.owner_instance_id FROM backend_nodes n"
    " JOIN node_connections ON node_connections.node_id = n.id"
    " JOIN instances ON instances.id = node_connections.owner_instance_id"
    f"  AND {INSTANCE_IS_LIVE_SQL}"
    f" WHERE n.node_type = 'agent' AND n.status = 'healthy' AND {CONNECTION_IS_HELD_SQL}"
)


class NoReachableAgent(Exception):
    """No agent worker could be asked (none connected, or none reachable): nothing learned."""


class AllAgentsBusy(Exception):
    """Every agent worker tried answered busy: the job did not start; offer it later."""


#: Released with backoff, never counted as a failure of the job.
JOB_TRANSPORT_ERRORS = DEFAULT_TRANSPORT_ERRORS + (
    NoReachableAgent, AllAgentsBusy, errors.TunnelProtocolError)

#: Failures of one worker that prove the job did not start there: try the next one.
_DID_NOT_START = (errors.WorkerBusy, errors.VerbNotServed, errors.RoutingFact,
                  errors.AbsentWithinGrace, errors.PeerUnreachable, errors.StreamRefused)


@dataclass(frozen=True)
class AgentWorker:
    node_id: str
    name: str
    owner: str


class JobDispatcher:
    """Runs claimed jobs on agent workers (module docstring).

    :param control: the replica's ``ControlClient`` (tunnel or relay).
    """

    def __init__(self, store: JobStore, db, control, instance_id: str, *,
                 liveness: float = INSTANCE_LIVENESS, rng: random.Random | None = None):
        self.store = store
        self.db = db
        self.control = control
        self.instance_id = instance_id
        self.liveness = liveness
        self._rng = rng or random.Random()
        #: Counters for logs and tests.
        self.stats = {"dispatched": 0, "answered": 0, "busy": 0, "unreachable": 0,
                      "broken": 0, "refused_cancelled": 0, "stopped_on_cancel": 0}

    async def agents(self) -> list[AgentWorker]:
        rows = await shielded(self.db.runQuery(AGENTS_FOR_DISPATCH_SQL, (self.liveness,)))
        found = [AgentWorker(*r) for r in rows]
        self._rng.shuffle(found)
        found.sort(key=lambda a: a.owner != self.instance_id)  # held here first (stable)
        return found

    async def handle(self, claim: Claim) -> None:
        job_id = claim.payload.decode("ascii", "replace")
        job = await self.store.begin(job_id)
        if job is None:
            self.stats["refused_cancelled"] += 1
            return  # finished, unknown, or cancelled before it started: nothing to run
        try:
            await self._dispatch(job, claim)
        except BaseException:
            # Not finished here: visible as queued until a replica dispatches it again.  The
            # write is best effort (the next dispatch marks it running anyway).
            try:
                await self.store.requeue(job_id)
            except Exception as e:
                log.info("jobs: could not mark {job} queued again: {err}", job=job_id, err=e)
            raise

    async def _dispatch(self, job, claim: Claim) -> None:
        agents = await self.agents()
        if not agents:
            self.stats["unreachable"] += 1
            await self.store.add_event(job.id, {"event": "released",
                                                "reason": "no agent worker is connected"})
            raise NoReachableAgent("no agent worker is connected to a live replica")
        busy, unreachable = [], []
        for agent in agents[:MAX_WORKERS_TRIED]:
            self.stats["dispatched"] += 1
            try:
                reply = await self._run_on(agent, job, claim)
            except _DID_NOT_START as e:
                if isinstance(e, (errors.WorkerBusy, errors.VerbNotServed)):
                    busy.append(agent.name)
                else:
                    unreachable.append(f"{agent.name} ({errors.condition_of(e)})")
                continue
            except errors.ControlVerbFailed as e:  # the worker's answer: the job failed
                self.stats["answered"] += 1
                await self.store.finish(job.id, "failed", error=e.error)
                return
            except errors.WorkerAnswer as e:  # 500: the worker could not serve the run
                self.stats["answered"] += 1
                await self.store.finish(job.id, "failed", error=str(e))
                return
            except (errors.TransportFailure, errors.CallerDeadlineExceeded,
                    errors.TunnelProtocolError) as e:
                self.stats["broken"] += 1
                await self.store.add_event(job.id, {"event": "released", "worker": agent.name,
                                                    "reason": errors.condition_of(e)})
                raise
            self.stats["answered"] += 1
            await self._settle_answer(job.id, agent, reply)
            return
        if busy and not unreachable:
            self.stats["busy"] += 1
            await self.store.add_event(job.id, {"event": "released", "reason": "busy",
                                                "workers": busy})
            raise AllAgentsBusy(f"every agent worker tried is busy: {', '.join(busy)}")
        self.stats["unreachable"] += 1
        await self.store.add_event(job.id, {"event": "released", "reason": "unreachable",
                                            "workers": busy + unreachable})
        raise NoReachableAgent("no agent worker tried could be asked: "
                               + ", ".join(busy + unreachable))

    async def _run_on(self, agent: AgentWorker, job, claim: Claim) -> Any:
        writes: list[defer.Deferred] = [defer.succeed(None)]
        calling: list[defer.Deferred] = []
        stopped = []

        started = []

        def record(event: Any) -> None:
            if isinstance(event, dict) and event.get("event") == "started":
                started.append(True)
            # Progress arrives in order; the writes are chained to keep that order.
            previous = writes[-1]
            writes.append(previous.addBoth(lambda _: defer.ensureDeferred(
                self._record(job.id, event, calling, stopped))))

        body = {"job_id": job.id, "kind": job.kind, "input": job.input, "rerun": job.rerun,
                "attempt": claim.attempts}
        d = self.control.call(agent.node_id, "job.run", body, on_progress=record)
        calling.append(d)
        if stopped and not d.called:  # the cancel was seen before the call returned
            d.cancel()
        try:
            reply = await d
        except defer.CancelledError:
            if stopped:
                reply = {"status": "cancelled"}
            else:
                raise
        except _DID_NOT_START as e:
            if started:  # it did start there: it may still run; never offer it elsewhere now
                raise errors.TransportFailure(
                    f"job.run on {agent.name} broke after the job started: {e}") from e
            raise
        finally:
            await writes[-1].addErrback(
                lambda f: log.info("jobs: storing progress of {job} failed: {err}",
                                   job=job.id, err=f.getErrorMessage()))
        return reply

    async def _record(self, job_id: str, event: Any, calling, stopped) -> None:
        await self.store.add_event(job_id, event)
        if isinstance(event, dict) and event.get("event") == "started":
            if await self.store.started(job_id):
                # A cancel was requested while the job was on its way to the worker.
                self.stats["stopped_on_cancel"] += 1
                stopped.append(True)
                if calling and not calling[0].called:
                    calling[0].cancel()

    async def _settle_answer(self, job_id: str, agent: AgentWorker, reply: Any) -> None:
        if not isinstance(reply, dict) or reply.get("status") not in (
                "succeeded", "failed", "cancelled"):
            await self.store.finish(job_id, "failed",
                                    error=f"agent worker {agent.name} answered without a "
                                          "job status")
            return
        status = reply["status"]
        if status == "succeeded":
            result = reply.get("result")
            try:
                size = encoded_size(result)
            except (TypeError, ValueError):
                size = MAX_RESULT_BYTES + 1
            if size > MAX_RESULT_BYTES:
                await self.store.finish(job_id, "failed", error=(
                    f"the result is larger than {MAX_RESULT_BYTES} bytes as JSON"))
                return
            await self.store.finish(job_id, "succeeded", result=result)
        elif status == "failed":
            await self.store.finish(job_id, "failed",
                                    error=str(reply.get("message") or "failed")[:4096])
        else:
            await self.store.finish(job_id, "cancelled")

    async def exhausted(self, claim: Claim) -> None:
        """The dispatch itself kept failing (not a worker's answer): record the job failed."""
        job_id = claim.payload.decode("ascii", "replace")
        await self.store.finish(job_id, "failed", error=(
            "this replica could not dispatch the job (an internal error, repeated); see the "
            "frontend log"))


def job_consumer(store: JobStore, dispatcher: JobDispatcher, queue: ClaimQueue,
                 instance_id: str, *, bus=None, slots: int = DEFAULT_JOB_SLOTS,
                 reactor=None) -> ClaimConsumer:
    """The replica's claim-queue consumer of jobs (a service of the replica)."""
    consumer = ClaimConsumer(queue, instance_id, [CLAIM_KIND], dispatcher.handle, bus=bus,
                             max_in_flight=slots, on_exhausted=dispatcher.exhausted,
                             transport_errors=JOB_TRANSPORT_ERRORS, reactor=reactor)
    consumer.name = "jobs"
    return consumer
