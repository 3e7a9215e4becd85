"""Issue 21 §3, keys with scopes, attacked on a real replica (FrontendService on PostgreSQL,
its real listener): an inference key (``--api-key``) serves ``/v1`` and the model endpoints but
is answered 403 on every admin route once an admin key (``--admin-api-key``) is configured; a
job belongs to the key that submitted it; one key's open jobs are bounded.

Before the fix every API key was an admin key: the inference key read /api/nodes (200),
installed models and read and cancelled another key's job (checked once, see the commit)."""

from __future__ import annotations

import json

import pytest_twisted
import treq

from localai_tw.frontend.jobs import store as job_store

from .inference_harness import ADMIN
from .harness_jobs import kinds, pause_consumer

ALICE = "sk-inference-alice"
BOB = "sk-inference-bob"

#: Admin routes an inference key must not open (method, path, body).
ADMIN_ROUTES = [
    ("GET", "/api/nodes", None),
    ("POST", "/models/apply", {"id": "gallery@model"}),
    ("POST", "/models/delete/some-model", None),
    ("GET", "/api/traces", None),
    ("GET", "/metrics", None),
    ("POST", "/backend/shutdown", {"model": "m"}),
    ("GET", "/api/cluster/instances", None),
    ("GET", "/api/cluster/loads", None),
]


async def call(cluster, frontend, key, method, path, body=None):
    response = await treq.request(
        method, cluster.base_url(frontend) + path,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    text = await response.text()
    try:
        return response.code, json.loads(text) if text else None
    except ValueError:
        return response.code, text


async def scoped_frontend(cluster, name, **options):
    return await cluster.frontend(name, job_kinds=kinds(), **{
        "api-key": [ALICE, BOB], "admin-api-key": [ADMIN], **options})


@pytest_twisted.ensureDeferred
async def test_an_inference_key_is_refused_on_admin_routes_with_a_message_naming_the_admin_key(
        cluster):
    frontend = await scoped_frontend(cluster, "replica-scopes")
    for method, path, body in ADMIN_ROUTES:
        code, answer = await call(cluster, frontend, ALICE, method, path, body)
        assert code == 403, (path, code, answer)
        assert "--admin-api-key-file" in answer["error"]["message"], path
        assert ALICE not in json.dumps(answer)
        # The admin key opens the same door (whatever the route then answers, not 401/403).
        code, answer = await call(cluster, frontend, ADMIN, method, path, body)
        assert code not in (401, 403), (path, code, answer)
    # The model endpoints take both scopes; a wrong key is still 401.
    for key in (ALICE, ADMIN):
        code, answer = await call(cluster, frontend, key, "GET", "/v1/models")
        assert code == 200, answer
        code, answer = await call(cluster, frontend, key, "GET", "/models")
        assert code == 200, answer
    code, _ = await call(cluster, frontend, "sk-wrong", "GET", "/v1/models")
    assert code == 401
    code, _ = await call(cluster, frontend, "sk-wrong", "GET", "/api/nodes")
    assert code == 401


@pytest_twisted.ensureDeferred
async def test_without_an_admin_key_one_key_works_for_everything(cluster):
    """The single-machine default: --api-key alone opens the admin routes too."""
    frontend = await cluster.frontend("replica-onekey", job_kinds=kinds(), **{"api-key": [ALICE]})
    code, answer = await call(cluster, frontend, ALICE, "GET", "/api/nodes")
    assert code == 200, answer
    code, answer = await call(cluster, frontend, ALICE, "GET", "/v1/models")
    assert code == 200, answer


@pytest_twisted.ensureDeferred
async def test_a_job_belongs_to_the_key_that_submitted_it(cluster):
    frontend = await scoped_frontend(cluster, "replica-jobs-owner")
    await pause_consumer(frontend)  # the jobs stay queued
    code, job = await call(cluster, frontend, ALICE, "POST", "/api/jobs",
                           {"kind": "test.echo", "input": {"secret": "alice's prompt"}})
    assert code == 202, job
    job_id = job["id"]
    assert "owner" not in job and ALICE not in json.dumps(job)

    # Bob (another inference key) neither sees, reads, nor cancels it: 404 as for no job.
    code, page = await call(cluster, frontend, BOB, "GET", "/api/jobs")
    assert code == 200 and page["jobs"] == [], page
    for method, path in (("GET", f"/api/jobs/{job_id}"), ("GET", f"/api/jobs/{job_id}/result"),
                         ("POST", f"/api/jobs/{job_id}/cancel")):
        code, answer = await call(cluster, frontend, BOB, method, path)
        assert code == 404, (path, answer)
    code, answer = await call(cluster, frontend, BOB, "GET", f"/api/jobs?before={job_id}")
    assert code == 400, answer

    # Alice and the admin see it; it was never cancelled by Bob.
    code, page = await call(cluster, frontend, ALICE, "GET", "/api/jobs")
    assert [j["id"] for j in page["jobs"]] == [job_id]
    code, page = await call(cluster, frontend, ADMIN, "GET", "/api/jobs")
    assert job_id in [j["id"] for j in page["jobs"]]
    code, answer = await call(cluster, frontend, ALICE, "GET", f"/api/jobs/{job_id}")
    assert code == 200 and answer["state"] == "queued" and not answer["cancel_requested"]
    # The database keeps the key's digest, never the key.
    rows = await frontend.replica.db.runQuery("SELECT owner FROM jobs WHERE id = %s", (job_id,))
    assert rows[0][0] not in ("", ALICE) and len(rows[0][0]) == 64
    code, answer = await call(cluster, frontend, ADMIN, "POST", f"/api/jobs/{job_id}/cancel")
    assert code == 200 and answer["state"] == "cancelled", answer


@pytest_twisted.ensureDeferred
async def test_one_key_s_open_jobs_are_bounded_and_others_still_submit(cluster, monkeypatch):
    monkeypatch.setattr(job_store, "MAX_OPEN_JOBS_PER_OWNER", 3)
    frontend = await scoped_frontend(cluster, "replica-jobs-cap")
    await pause_consumer(frontend)
    for _ in range(3):
        code, job = await call(cluster, frontend, ALICE, "POST", "/api/jobs",
                               {"kind": "test.echo", "input": {}})
        assert code == 202, job
    code, answer = await call(cluster, frontend, ALICE, "POST", "/api/jobs",
                              {"kind": "test.echo", "input": {}})
    assert code == 429 and answer["error"]["code"] == "too_many_open_jobs", answer
    code, job = await call(cluster, frontend, BOB, "POST", "/api/jobs",
                           {"kind": "test.echo", "input": {}})
    assert code == 202, job


@pytest_twisted.ensureDeferred
async def test_finished_jobs_are_deleted_after_the_retention(cluster):
    frontend = await scoped_frontend(cluster, "replica-jobs-retention")
    await pause_consumer(frontend)
    old, recent = [], []
    for bucket in (old, recent):
        code, job = await call(cluster, frontend, ALICE, "POST", "/api/jobs",
                               {"kind": "test.echo", "input": {}})
        assert code == 202, job
        code, _ = await call(cluster, frontend, ALICE, "POST", f"/api/jobs/{job['id']}/cancel")
        assert code == 200
        bucket.append(job["id"])
    days = job_store.FINISHED_RETENTION_DAYS
    await frontend.replica.db.runOperation(
        "UPDATE jobs SET finished_at = now() - make_interval(days => %s) WHERE id = %s",
        (days + 1, old[0]))
    code, _ = await call(cluster, frontend, BOB, "POST", "/api/jobs",
                         {"kind": "test.echo", "input": {}})  # any submit sweeps
    assert code == 202
    code, _ = await call(cluster, frontend, ALICE, "GET", f"/api/jobs/{old[0]}")
    assert code == 404
    code, answer = await call(cluster, frontend, ALICE, "GET", f"/api/jobs/{recent[0]}")
    assert code == 200 and answer["state"] == "cancelled"
