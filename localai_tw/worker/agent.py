"""The agent worker's side of jobs: the control verbs ``job.run`` and ``job.cancel``.

A worker started with ``--node-type agent`` registers as an agent (``backend_nodes.node_type``)
and serves these verbs over its tunnel, like every control verb (``docs/jobs.md``):

- ``job.run`` (streaming) ``{"job_id", "kind", "input", "rerun", "attempt"}``: answers 503
  busy when all ``--max-jobs`` slots are taken or this worker already runs the job (the job did
  not start: the frontend offers it elsewhere).  Otherwise it writes ``{"progress": {"event":
  "started", "worker": name, "rerun": bool}}``, the kind's own progress events, and one reply
  line ``{"status": "succeeded", "result": ...}``, ``{"status": "failed", "message": ...}`` or
  ``{"status": "cancelled"}``.  An unknown kind is answered ``failed``: it is this worker's
  answer.  When the caller's stream breaks (its replica died) the run is cancelled: nobody is
  left to hear its answer, and the job will run again elsewhere.
- ``job.cancel`` (unary) ``{"job_id"}`` -> ``{"cancelled": true}`` when this worker was
  running the job and cancelled it, ``{"cancelled": false}`` ("not mine") otherwise.  A worker
  answers only for itself; the frontend asks every agent worker.

What this module must never do: run more than ``max_runs`` jobs at once, answer a result over
:data:`~localai_tw.jobs.kinds.MAX_RESULT_BYTES`, or report a cancel it did not make.
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.logger import Logger

from localai_tw.jobs.kinds import (
    MAX_ERROR_CHARS,
    MAX_RESULT_BYTES,
    JobFailed,
    JobKinds,
    JobRun,
    UnknownJobKind,
    bounded_event,
    encoded_size,
)
from localai_tw.worker.control import (
    BadVerbRequest,
    ControlVerbs,
    NoFreeSlot,
    VerbRequestSchema,
)

log = Logger()

#: Jobs one agent worker runs at once unless ``--max-jobs`` says otherwise.
DEFAULT_MAX_RUNS = 4

RUN_SCHEMA = VerbRequestSchema(
    {"job_id": str, "kind": str, "rerun": bool, "attempt": int},
    frozenset({"job_id", "kind", "input"}))
CANCEL_SCHEMA = VerbRequestSchema({"job_id": str}, frozenset({"job_id"}))


class _Run:
    __slots__ = ("job_id", "deferred", "cancelled")

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.deferred: defer.Deferred | None = None
        self.cancelled = False


class AgentRunner:
    """Runs jobs of ``kinds`` on this worker; :meth:`register` adds its verbs."""

    def __init__(self, node_name: str, kinds: JobKinds, api, *,
                 max_runs: int = DEFAULT_MAX_RUNS):
        if max_runs < 1:
            raise ValueError("an agent worker runs at least one job at a time")
        self.node_name = node_name
        self.kinds = kinds
        self.api = api
        self.max_runs = max_runs
        self._runs: dict[str, _Run] = {}
        #: Counters for logs and tests.
        self.stats = {"started": 0, "succeeded": 0, "failed": 0, "cancelled": 0, "busy": 0,
                      "cancel_asked": 0}

    def running(self) -> list[str]:
        return sorted(self._runs)

    def register(self, verbs: ControlVerbs) -> None:
        verbs.register("job.run", self.run_verb, streaming=True, schema=RUN_SCHEMA)
        verbs.register("job.cancel", self.cancel_verb, schema=CANCEL_SCHEMA)

    # -- job.cancel -------------------------------------------------------------------------

    def cancel_verb(self, body: dict) -> dict:
        self.stats["cancel_asked"] += 1
        run = self._runs.get(body["job_id"])
        if run is None:
            return {"cancelled": False}
        if not run.cancelled:
            run.cancelled = True
            log.info("agent {name}: cancelling job {job} on request", name=self.node_name,
                     job=run.job_id)
            if run.deferred is not None:
                run.deferred.cancel()
            # else: accepted, not started yet (its "started" line is being written): it
            # answers cancelled without starting
        return {"cancelled": True}

    # -- job.run ----------------------------------------------------------------------------

    async def run_verb(self, body: dict, progress) -> dict:
        job_id = body["job_id"]
        if not job_id or len(job_id) > 64:
            raise BadVerbRequest("job_id must be 1-64 characters")
        if job_id in self._runs:
            self.stats["busy"] += 1
            raise NoFreeSlot(f"this worker is already running job {job_id}")
        if len(self._runs) >= self.max_runs:
            self.stats["busy"] += 1
            raise NoFreeSlot(f"the worker has no free slot for this run (all {self.max_runs} "
                             "job slots are taken)")
        try:
            kind = self.kinds.get(body["kind"])
        except UnknownJobKind:
            return {"status": "failed",
                    "message": f"this agent worker does not run jobs of kind {body['kind']!r} "
                             f"(it runs: {', '.join(self.kinds.names()) or 'none'})"}
        run = self._runs[job_id] = _Run(job_id)
        self.stats["started"] += 1
        rerun = bool(body.get("rerun", False))
        try:
            await progress({"event": "started", "worker": self.node_name, "rerun": rerun})
            if run.cancelled:
                self.stats["cancelled"] += 1
                return {"status": "cancelled"}
            job = JobRun(job_id=job_id, kind=kind.name, input=body["input"], rerun=rerun,
                         progress=lambda event: progress(bounded_event(event)), api=self.api,
                         attempt=int(body.get("attempt", 0)))
            run.deferred = defer.maybeDeferred(kind.run, job)
            try:
                result = await run.deferred
            except defer.CancelledError:
                if run.cancelled:
                    self.stats["cancelled"] += 1
                    return {"status": "cancelled"}
                raise  # the caller left: nobody to answer
            except JobFailed as e:
                return self._failed(job_id, str(e))
            except Exception as e:
                log.failure("agent {name}: job {job} ({kind}) raised", name=self.node_name,
                            job=job_id, kind=kind.name)
                return self._failed(job_id, f"{e.__class__.__name__}: {e}")
            try:
                size = encoded_size(result)
            except (TypeError, ValueError):
                return self._failed(job_id, "the job's result is not JSON")
            if size > MAX_RESULT_BYTES:
                return self._failed(job_id, f"the result is {size} bytes as JSON, more than "
                                            f"the {MAX_RESULT_BYTES} a job may keep")
            self.stats["succeeded"] += 1
            return {"status": "succeeded", "result": result}
        finally:
            self._runs.pop(job_id, None)

    def _failed(self, job_id: str, error: str) -> dict:
        self.stats["failed"] += 1
        log.info("agent {name}: job {job} failed: {error}", name=self.node_name, job=job_id,
                 error=error[:200])
        return {"status": "failed", "message": error[:MAX_ERROR_CHARS]}

