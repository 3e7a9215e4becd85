"""The jobs API, ``/api/jobs`` (behind ``--api-key``; docs/jobs.md).

A job belongs to the key that submitted it (the key's sha256 is recorded, never the key): an
inference key lists, reads and cancels only its own jobs, and another key's job is a 404 to it;
an admin key (any key while no ``--admin-api-key`` is set) sees every job.  One key has at most
``MAX_OPEN_JOBS_PER_OWNER`` queued or running jobs (more: 429); finished jobs are deleted
``FINISHED_RETENTION_DAYS`` after they finished (``jobs/store.py``).


=================================  ===========================================================
route                              answer
=================================  ===========================================================
POST /api/jobs                     body ``{"kind", "input"}`` -> 202 the job (``state``
                                   queued); an unknown kind or a bad input is 400, a body over
                                   the cap 413
GET /api/jobs                      ``{"jobs": [...], "next": id|null}``, newest first;
                                   ``?state=queued|running|succeeded|failed|cancelled``,
                                   ``?limit=1-200`` (50), ``?before=<id>`` (the ``next`` of the
                                   previous page)
GET /api/jobs/kinds                ``{"kinds": [{"kind", "description"}]}``
GET /api/jobs/{id}                 the job: state, runs, progress events, result or error
GET /api/jobs/{id}/result          ``{"id", "state", "result"}`` (404 until it succeeded)
POST /api/jobs/{id}/cancel         ``{"outcome", "state", "workers": [...]}``: ``cancelled``,
                                   ``not-on-any-worker``, ``undelivered``, ``no-agent-worker``
                                   (jobs/cancel.py); 409 for a finished job
=================================  ===========================================================

Any replica answers: everything lives in tables.  This module validates and answers; the
statements are ``jobs/store.py``'s, the fan-out ``jobs/cancel.py``'s.
"""

from __future__ import annotations

import re

from localai_tw.jobs.kinds import MAX_INPUT_BYTES, InvalidJobInput, JobKinds, UnknownJobKind

from localai_tw.frontend.jobs.cancel import CANCELLED, CancelFanout
from localai_tw.frontend.jobs.store import (
    FINISHED,
    MAX_OPEN_JOBS_PER_OWNER,
    STATES,
    JobStore,
    TooManyOpenJobs,
)
from localai_tw.frontend.api.jsonbody import prepare_json_body
from localai_tw.frontend.api.kit import (
    AdminResource,
    APIKeyGuard,
    printable,
    read_json_object,
    reject_unknown_fields,
    Caller,
    Route,
)
from localai_tw.web.errors import APIError, bad_request, conflict, not_found

#: Body cap of ``POST /api/jobs``: the input cap plus room for the envelope.
MAX_JOB_BODY_BYTES = MAX_INPUT_BYTES + 64 * 1024
DEFAULT_PAGE = 50
MAX_PAGE = 200
_JOB_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _job_id(raw: str) -> str:
    if not _JOB_ID.match(raw):
        raise not_found(f"no job {printable(raw)!r}: job ids are the UUIDs POST /api/jobs "
                        "answers")
    return raw


def _query(request, name: str) -> str | None:
    values = request.args.get(name.encode("ascii"))
    if not values:
        return None
    if len(values) > 1:
        raise bad_request(f"query parameter {name} is given more than once", field=name)
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(f"query parameter {name} is not UTF-8", field=name) from None


class JobsResource(AdminResource):
    """``/api/jobs``."""

    def __init__(self, store: JobStore, kinds: JobKinds, fanout: CancelFanout,
                 guard: APIKeyGuard):
        super().__init__(guard)
        self.store = store
        self.kinds = kinds
        self.fanout = fanout

    def guard(self, request) -> None:
        """Inference and admin keys alike; what each sees is scoped by :meth:`_own`."""
        request.ltw_caller = self._guard.caller(request)

    async def _own(self, request, job_id: str) -> str:
        """``job_id`` when the caller may see it; a 404 for another key's job (the same answer
        as an unknown id: a key learns nothing about other keys' jobs)."""
        job_id = _job_id(job_id)
        caller: Caller = request.ltw_caller
        owner = await self.store.owner_of(job_id)
        if owner is None or not (caller.admin or owner == caller.owner):
            raise not_found(f"no job {job_id}")
        return job_id

    def routes(self):
        return (
            Route("POST", (), self.submit),
            Route("GET", (), self.list_jobs),
            Route("GET", ("kinds",), self.list_kinds),
            Route("GET", ("{job_id}",), self.get_job),
            Route("GET", ("{job_id}", "result"), self.get_result),
            Route("POST", ("{job_id}", "cancel"), self.cancel),
        )

    async def submit(self, request):
        await prepare_json_body(request)  # an input of 1 MiB: decoded off the reactor
        body = read_json_object(request)
        reject_unknown_fields(body, ("kind", "input"))
        if "kind" not in body:
            raise bad_request("kind is required; GET /api/jobs/kinds lists them", field="kind")
        if "input" not in body:
            raise bad_request("input is required (what the kind works on)", field="input")
        try:
            kind, input = self.kinds.validate(body["kind"], body["input"])
        except UnknownJobKind:
            raise bad_request(f"unknown job kind {printable(str(body['kind']))!r}; this cluster "
                              f"runs: {', '.join(self.kinds.names()) or 'none'}",
                              field="kind") from None
        except InvalidJobInput as e:
            raise bad_request(str(e), field=e.field) from None
        except (TypeError, ValueError) as e:  # a value JSON cannot carry further
            raise bad_request(f"input cannot be stored: {e}", field="input") from None
        try:
            job = await self.store.submit(kind, input, owner=request.ltw_caller.owner)
        except TooManyOpenJobs:
            raise APIError(429, f"this API key already has {MAX_OPEN_JOBS_PER_OWNER} queued or "
                           "running jobs; wait for one to finish or cancel one "
                           "(POST /api/jobs/{id}/cancel)", "rate_limited",
                           code="too_many_open_jobs", headers={"Retry-After": "10"}) from None
        return 202, job

    async def list_jobs(self, request):
        state = _query(request, "state")
        if state is not None and state not in STATES:
            raise bad_request(f"state must be one of {', '.join(STATES)}", field="state")
        raw_limit = _query(request, "limit")
        limit = DEFAULT_PAGE
        if raw_limit is not None:
            if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_PAGE:
                raise bad_request(f"limit must be a whole number from 1 to {MAX_PAGE}",
                                  field="limit")
            limit = int(raw_limit)
        before = _query(request, "before")
        if before is not None:
            if not _JOB_ID.match(before) or not await self.store.exists(before):
                raise bad_request("before must be the id of a job (the next of the previous "
                                  "page)", field="before")
        caller: Caller = request.ltw_caller
        if before is not None and not caller.admin \
                and await self.store.owner_of(before) != caller.owner:
            raise bad_request("before must be the id of a job (the next of the previous page)",
                              field="before")
        jobs = await self.store.page(state, limit, before,
                                     owner=None if caller.admin else caller.owner)
        return 200, {"jobs": jobs, "next": jobs[-1]["id"] if len(jobs) == limit else None}

    async def list_kinds(self, request):
        return 200, {"kinds": self.kinds.describe()}

    async def get_job(self, request, job_id):
        job = await self.store.get(await self._own(request, job_id))
        if job is None:
            raise not_found(f"no job {job_id}")
        return 200, job

    async def get_result(self, request, job_id):
        found = await self.store.result(await self._own(request, job_id))
        if found is None:
            raise not_found(f"no job {job_id}")
        state, result = found
        if state != "succeeded":
            raise APIError(404, f"job {job_id} has no result: it is {state}", "not_found",
                           code="no_result")
        return 200, {"id": job_id, "state": state, "result": result}

    async def cancel(self, request, job_id):
        job_id = await self._own(request, job_id)
        before = await self.store.request_cancel(job_id)
        if before is None:
            raise not_found(f"no job {job_id}")
        if before in FINISHED:
            raise conflict(f"job {job_id} already finished ({before}); there is nothing to "
                           "cancel", code="job_finished")
        if before == "queued":
            # Cancelled in the table: it never starts, no worker needs to be asked.
            return 200, {"outcome": CANCELLED, "state": "cancelled", "workers": []}
        outcome, answers = await self.fanout.cancel(job_id)
        job = await self.store.get(job_id, with_events=False)
        return 200, {"outcome": outcome, "state": job["state"] if job else before,
                     "workers": [a.as_dict() for a in answers]}
