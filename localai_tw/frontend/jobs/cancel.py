"""Cancel fan-out: ask every agent worker to cancel a running job, and keep the answers apart.

Nothing records which worker holds a run (the claim names the *replica* driving it, and the
replica may be dead), so a cancel asks every agent worker a live replica can reach, each over
its own tunnel (relayed by the owner when another replica holds it), with the control verb
``job.cancel``.  Each worker answers only for itself.  The workers asked are the agent nodes
that are not ``pending`` (a pending node's tunnel is refused on every dial); a ``draining``
one is asked, since it may still be finishing a run.

Per worker, exactly one of:

==================  =======================================================================
``cancelled``       it answered ``{"cancelled": true}``: it held the run and cancelled it
``not-mine``        it answered ``{"cancelled": false}`` (or 404: its version runs no jobs)
``excluded``        ``WorkerGone``: departed longer ago than the reconnect grace, the one
                    routing fact a cancel may act on; it cannot hold a live run
``undelivered``     it could not be asked: absent within the grace, no route now, an
                    unreachable peer replica, a broken exchange, no answer in time
==================  =======================================================================

The outcome, in this order: ``cancelled`` (some worker cancelled it: conclusive),
``undelivered`` (some worker could not be asked, so the run may be there),
``not-on-any-worker`` (every worker asked answered "not mine": built only from workers'
answers), ``no-agent-worker`` (nobody was asked: there is no agent worker, or every one is
gone).  A cancel never demotes, reaps or evicts anything: this module only reads
``backend_nodes`` and calls ``job.cancel``.
"""

from __future__ import annotations

from dataclasses import dataclass

from twisted.internet import defer
from twisted.logger import Logger

from localai_tw import errors

log = Logger()

#: Seconds each worker has to answer a cancel.
CANCEL_TIMEOUT_SECONDS = 10.0

CANCELLED = "cancelled"
UNDELIVERED = "undelivered"
NOT_ON_ANY_WORKER = "not-on-any-worker"
NO_AGENT_WORKER = "no-agent-worker"

AGENTS_FOR_CANCEL_SQL = (
    "SELECT id, name FROM backend_nodes WHERE node_type = 'agent' AND status <> 'pending'"
    " ORDER BY name")


@dataclass(frozen=True)
class WorkerCancel:
    node_id: str
    name: str
    answer: str           # cancelled | not-mine | excluded | undelivered
    condition: str = ""   # why it was undelivered or excluded

    def as_dict(self) -> dict:
        found = {"node_id": self.node_id, "name": self.name, "answer": self.answer}
        if self.condition:
            found["condition"] = self.condition
        return found


def outcome_of(answers: list[WorkerCancel]) -> str:
    kinds = {a.answer for a in answers}
    if "cancelled" in kinds:
        return CANCELLED
    if "undelivered" in kinds:
        return UNDELIVERED
    if "not-mine" in kinds:
        return NOT_ON_ANY_WORKER
    return NO_AGENT_WORKER


class CancelFanout:
    """:param control: the replica's ``ControlClient``."""

    def __init__(self, db, control, timeout: float = CANCEL_TIMEOUT_SECONDS):
        self.db = db
        self.control = control
        self.timeout = timeout

    async def cancel(self, job_id: str) -> tuple[str, list[WorkerCancel]]:
        rows = await self.db.runQuery(AGENTS_FOR_CANCEL_SQL)
        asked = [defer.ensureDeferred(self._ask(node_id, name, job_id)) for node_id, name in rows]
        answers = list(await defer.gatherResults(asked, consumeErrors=True)) if asked else []
        outcome = outcome_of(answers)
        log.info("jobs: cancel of {job}: {outcome} ({answers})", job=job_id, outcome=outcome,
                 answers=", ".join(f"{a.name}={a.answer}" for a in answers) or "nobody asked")
        return outcome, answers

    async def _ask(self, node_id: str, name: str, job_id: str) -> WorkerCancel:
        try:
            reply = await self.control.call(node_id, "job.cancel", {"job_id": job_id},
                                            timeout=self.timeout)
        except errors.WorkerGone as e:
            return WorkerCancel(node_id, name, "excluded", e.condition)
        except errors.VerbNotServed:
            return WorkerCancel(node_id, name, "not-mine", "verb-not-served")
        except errors.ClusterError as e:
            return WorkerCancel(node_id, name, "undelivered", e.condition)
        except Exception as e:  # a bug or a closed pool: still not a statement about the run
            log.info("jobs: asking {name} to cancel {job} failed: {err}", name=name,
                     job=job_id, err=e)
            return WorkerCancel(node_id, name, "undelivered", "unclassified")
        if isinstance(reply, dict) and reply.get("cancelled") is True:
            return WorkerCancel(node_id, name, "cancelled")
        if isinstance(reply, dict) and reply.get("cancelled") is False:
            return WorkerCancel(node_id, name, "not-mine")
        return WorkerCancel(node_id, name, "undelivered", "protocol-error")
