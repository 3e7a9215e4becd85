"""Gallery installs on a cluster (issue 13 §3): two real ``FrontendService`` replicas on one
PostgreSQL database and one shared models directory, a gallery index in LocalAI's format in a
file, the model files served by a twisted.web server this test starts on 127.0.0.1
(``harness_downloads.FileServer``: ``/held/`` sends half and waits for ``release``).

Each scenario's docstring names the deliberate break of the product that turns it red; each
was checked once (commit message)."""

from __future__ import annotations

import os

import pytest_twisted
import treq
import yaml

from localai_tw.localai.catalog import load_model_file

from .inference_harness import sha256_hex
from .support import eventually
from .harness_downloads import files  # noqa: F401 (fixture)
from .harness_gallery import AUTH, SMALL, _done, call, entry, job, model_files, stored_copies

WEIGHTS = bytes(range(256)) * 4096  # 1 MiB
#: About 9000 bytes once JSON-encoded (non-ASCII is escaped on the bus): spilled.
LONG_DESCRIPTION = ("Ein Modell für Grüße, naïve café — 模型 🚀\n" * 200)[:8600]


async def start(cluster, tmp_path, entries: list[dict], *replicas: str):
    index = tmp_path / "index.yaml"
    index.write_text(yaml.safe_dump(entries, allow_unicode=True))
    started = []
    for name in replicas:
        frontend = await cluster.frontend(name, galleries=[f"test=file://{index}"])
        # subscribed to the gallery's broadcasts before anything is admitted
        await eventually(lambda f=frontend: f.replica.gallery._subscription is not None,
                         timeout=20, what=f"{name} listening")
        started.append(frontend)
    return started


async def row(cluster, job_id: str):
    db = cluster.frontends[0].database_service.database
    rows = await db.runQuery("SELECT state FROM gallery_jobs WHERE id = %s", (job_id,))
    return rows[0][0] if rows else None


@pytest_twisted.ensureDeferred
async def test_an_install_admitted_at_a_is_seen_at_b_queued_downloading_done(
        cluster, files, tmp_path):
    """Replica B answers a job admitted at A while it is queued (no row yet), while it
    downloads (bytes, total, rate) and once it is done (its row); a ~9000-byte description
    round-trips byte-identical through the bus's spill path.
    Red when A publishes only to itself (``GalleryJobs._publish`` returning before
    ``bus.publish``): B never sees the download's progress (the first wait, 20 s)."""
    files.files["a.bin"] = WEIGHTS
    files.files["b.bin"] = SMALL
    a, b = await start(cluster, tmp_path, [
        entry("first", [("first/a.bin", f"{files.base}/held/a.bin", sha256_hex(WEIGHTS))]),
        entry("second", [("second/b.bin", f"{files.base}/files/b.bin", sha256_hex(SMALL))],
              description=LONG_DESCRIPTION)], "replica-a", "replica-b")

    status, listed = await call(cluster, b, "GET", "/models/available")
    assert status == 200 and [m["name"] for m in listed] == ["first", "second"]
    assert listed[1]["description"] == LONG_DESCRIPTION and not listed[0]["installed"]

    status, first = await call(cluster, a, "POST", "/models/apply", {"id": "test@first"})
    assert status == 200 and first["status"].endswith(f"/models/jobs/{first['uuid']}")
    first_id = first["uuid"]
    # downloading, seen at B: bytes, total, rate
    await eventually(lambda: files.gets, timeout=20, what="the download started")

    async def downloading():
        code, seen = await job(cluster, b, first_id)
        return code == 200 and seen["state"] == "downloading" \
            and seen["current_bytes"] == len(WEIGHTS) // 2 and seen

    seen = await eventually(downloading, timeout=20, what="B sees the download's progress")
    assert seen["total_bytes"] == len(WEIGHTS) and seen["file_name"] == "first/a.bin"
    assert seen["bytes_per_second"] >= 0 and seen["replica"] == "replica-a"
    assert await row(cluster, first_id) == "running"

    # a second install waits behind the first (one at a time per replica): queued, no row
    status, second = await call(cluster, a, "POST", "/models/apply", {"id": "second"})
    second_id = second["uuid"]
    code, queued = await eventually(
        lambda: _ok(job(cluster, b, second_id)), timeout=20, what="B sees the queued job")
    assert queued["state"] == "queued" and queued["source"] == "broadcast"
    assert await row(cluster, second_id) is None
    assert queued["description"] == LONG_DESCRIPTION  # byte-identical after the spill
    db = cluster.frontends[0].database_service.database
    [[spilled]] = await db.runQuery("SELECT count(*) FROM bus_messages WHERE subject = %s",
                                    (f"gallery.{second_id}",))
    assert spilled >= 1  # it went through the spill table, not inline

    files.release.callback(None)
    for job_id in (first_id, second_id):
        code, done = await eventually(lambda j=job_id: _done(job(cluster, b, j)), timeout=30,
                                      what="B sees the job done")
        assert done["state"] == "done" and done["processed"] and done["error"] is None
        assert done["source"] == "row" and await row(cluster, job_id) == "done"
    config = load_model_file(os.path.join(cluster.models_dir, "first.yaml"))
    assert config.name == "first" and config.backend == "echo"
    assert model_files(cluster.models_dir) == [
        "._gallery_first.yaml", "._gallery_second.yaml", "first.yaml", "first/a.bin",
        "second.yaml", "second/b.bin"]
    with open(os.path.join(cluster.models_dir, "first", "a.bin"), "rb") as f:
        assert f.read() == WEIGHTS
    status, listed = await call(cluster, b, "GET", "/models/available")
    assert [m["installed"] for m in listed] == [True, True]


async def _ok(answer):
    code, body = await answer
    return (code, body) if code == 200 else None


@pytest_twisted.ensureDeferred
async def test_a_digest_that_does_not_match_fails_the_job_and_leaves_nothing(
        cluster, files, tmp_path):
    """The second file's sha256 is wrong: the job fails naming the file and both digests, and
    neither the config, nor the first (verified) file, nor a temporary file is left.
    Red when a failed install keeps the files it downloaded (the cleanup in
    ``GalleryJobs._install`` removed)."""
    files.files["a.bin"] = SMALL
    files.files["b.bin"] = WEIGHTS
    wrong = "0" * 64
    (a,) = await start(cluster, tmp_path, [entry("bad", [
        ("bad/a.bin", f"{files.base}/files/a.bin", sha256_hex(SMALL)),
        ("bad/b.bin", f"{files.base}/files/b.bin", wrong)])], "replica-a")
    status, applied = await call(cluster, a, "POST", "/models/apply", {"id": "bad"})
    code, failed = await eventually(lambda: _done(job(cluster, a, applied["uuid"])),
                                    timeout=30, what="the job finished")
    assert failed["state"] == "failed" and failed["processed"]
    assert "bad/b.bin" in failed["error"] and wrong in failed["error"]
    assert sha256_hex(WEIGHTS) in failed["error"]
    assert await row(cluster, applied["uuid"]) == "failed"
    assert model_files(cluster.models_dir) == []


@pytest_twisted.ensureDeferred
async def test_concurrent_applies_of_one_model_install_it_once(cluster, files, tmp_path):
    """The same model applied at A and at B while A's download is held: one install runs, the
    other job fails naming the running job; the file is fetched once.
    Red without the claim (``_CLAIM_SQL`` inserting with no conflict check on the model):
    both download."""
    files.files["a.bin"] = WEIGHTS
    a, b = await start(cluster, tmp_path, [
        entry("one", [("one/a.bin", f"{files.base}/held/a.bin", sha256_hex(WEIGHTS))])],
        "replica-a", "replica-b")
    _, at_a = await call(cluster, a, "POST", "/models/apply", {"id": "one"})
    await eventually(lambda: files.gets, timeout=20, what="A downloads")
    _, at_b = await call(cluster, b, "POST", "/models/apply", {"id": "one"})
    code, refused = await eventually(lambda: _done(job(cluster, a, at_b["uuid"])), timeout=30,
                                     what="B's job finished")
    assert refused["state"] == "failed"
    assert at_a["uuid"] in refused["error"] and "being installed" in refused["error"]
    files.release.callback(None)
    code, done = await eventually(lambda: _done(job(cluster, b, at_a["uuid"])), timeout=30,
                                  what="A's job finished")
    assert done["state"] == "done"
    assert files.gets == [b"/held/a.bin"]


@pytest_twisted.ensureDeferred
async def test_delete_removes_the_config_and_its_files(cluster, files, tmp_path):
    """An installed model deleted at B (``POST /models/delete/{name}``): its config, its files
    and its record are gone; a file another installed model lists stays; deleting it again
    fails the job with the reason.
    Red when delete removes only the config (the record's files kept)."""
    files.files["a.bin"] = SMALL
    files.files["shared.bin"] = b"shared"
    shared = ("shared.bin", f"{files.base}/files/shared.bin", sha256_hex(b"shared"))
    a, b = await start(cluster, tmp_path, [
        entry("gone", [("gone/a.bin", f"{files.base}/files/a.bin", sha256_hex(SMALL)),
                       shared]),
        entry("kept", [shared])], "replica-a", "replica-b")
    for name in ("gone", "kept"):
        _, applied = await call(cluster, a, "POST", "/models/apply", {"id": name})
        _, done = await eventually(lambda j=applied["uuid"]: _done(job(cluster, a, j)),
                                   timeout=30, what="installed")
        assert done["state"] == "done", done
    status, deleting = await call(cluster, b, "POST", "/models/delete/gone")
    assert status == 200
    _, deleted = await eventually(lambda: _done(job(cluster, a, deleting["uuid"])), timeout=30,
                                  what="deleted")
    assert deleted["state"] == "done" and deleted["deletion"]
    assert model_files(cluster.models_dir) == ["._gallery_kept.yaml", "kept.yaml",
                                               "shared.bin"]
    # the deleted file's one copy is freed too; the shared one stays (issue 26 §4)
    assert stored_copies(cluster.models_dir) == [sha256_hex(b"shared")]
    _, again = await call(cluster, b, "POST", "/models/delete/gone")
    _, refused = await eventually(lambda: _done(job(cluster, b, again["uuid"])), timeout=30,
                                  what="second delete finished")
    assert refused["state"] == "failed" and "not installed" in refused["error"]


@pytest_twisted.ensureDeferred
async def test_gallery_routes_need_the_admin_key_and_refuse_bad_input(cluster, files,
                                                                       tmp_path):
    """The gallery routes are admin routes; ``/models`` stays the OpenAI model list; a caller
    cannot make a replica fetch its own URL; bad input is a clear 4xx."""
    (a,) = await start(cluster, tmp_path, [entry("one", [("one/a.bin",
                                                           f"{files.base}/files/a.bin", None)])],
                       "replica-a")
    status, body = await call(cluster, a, "GET", "/models/available", headers={})
    assert status == 401
    status, body = await call(cluster, a, "GET", "/models")
    assert status == 200 and body["object"] == "list"
    status, body = await call(cluster, a, "POST", "/models/apply",
                              {"id": "one", "url": "http://169.254.169.254/x.yaml"})
    assert status == 400 and "url" in body["error"]["message"]
    status, body = await call(cluster, a, "POST", "/models/apply", {"id": "nope"})
    assert status == 404 and "/models/available" in body["error"]["message"]
    status, body = await call(cluster, a, "POST", "/models/apply", {"id": "one",
                                                                     "name": "../escape"})
    assert status == 400
    status, body = await call(cluster, a, "GET", "/models/jobs/not-a-uuid")
    assert status == 404
    answer = await treq.post(cluster.base_url(a) + "/models/apply", data=b"{nope",
                             headers={**AUTH, "Content-Type": "application/json"})
    assert answer.code == 400


@pytest_twisted.ensureDeferred
async def test_a_queued_job_of_a_replica_that_stopped_reads_failed(cluster, files, tmp_path):
    """A queued snapshot heard from a replica that is no longer live (it stopped before the
    job started, so no row will ever come) reads failed with the reason, not queued forever.
    Red when ``status`` trusts a queued broadcast without asking whether its replica lives."""
    a, b = await start(cluster, tmp_path, [], "replica-a", "replica-b")
    job_id = "00000000-0000-4000-8000-000000000001"
    snapshot = {"id": job_id, "state": "queued", "replica": "replica-a", "seq": 1,
                "processed": False, "error": None}
    b.replica.gallery._heard(f"gallery.{job_id}", snapshot)
    _, seen = await job(cluster, b, job_id)
    assert seen["state"] == "queued"  # replica-a is live
    b.replica.gallery._heard(f"gallery.{job_id}", dict(snapshot, replica="replica-gone"))
    _, seen = await job(cluster, b, job_id)
    assert seen["state"] == "failed" and "stopped before it started" in seen["error"]


@pytest_twisted.ensureDeferred
async def test_an_index_over_http_is_read_and_bounded(cluster, files, tmp_path, monkeypatch):
    """An index served over http:// is listed; one larger than the bound is a 502 naming the
    bound, not memory spent on it.
    Red when the body is read without the bound (the Content-Length check and ``_Bounded``)."""
    from localai_tw.frontend.gallery import installs as gallery

    files.files["index.yaml"] = yaml.safe_dump(
        [entry("web", [("web/a.bin", f"{files.base}/files/a.bin", None)])]).encode()
    frontend = await cluster.frontend("replica-a",
                                      galleries=[f"web={files.base}/files/index.yaml"])
    status, listed = await call(cluster, frontend, "GET", "/models/available")
    assert status == 200 and [m["id"] for m in listed] == ["web@web"]
    monkeypatch.setattr(gallery, "MAX_INDEX_BYTES", 100)
    status, body = await call(cluster, frontend, "GET", "/models/available")
    assert status == 502 and "larger than 100 bytes" in body["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_a_running_row_of_a_dead_replica_does_not_hold_the_model(cluster, files,
                                                                         tmp_path):
    """A ``running`` row left by a replica that died (not live) is failed with the reason, and
    the model installs.
    Red without ``_CLAIM_STALE_SQL`` (the dead replica's row would hold the model forever)."""
    files.files["a.bin"] = SMALL
    (a,) = await start(cluster, tmp_path, [
        entry("one", [("one/a.bin", f"{files.base}/files/a.bin", sha256_hex(SMALL))])],
        "replica-a")
    db = cluster.frontends[0].database_service.database
    ghost = "00000000-0000-4000-8000-0000000000aa"
    await db.runOperation(
        "INSERT INTO gallery_jobs (id, model, state, replica, status) "
        "VALUES (%s, 'one', 'running', 'replica-dead', '{}')", (ghost,))
    _, applied = await call(cluster, a, "POST", "/models/apply", {"id": "one"})
    _, done = await eventually(lambda: _done(job(cluster, a, applied["uuid"])), timeout=30,
                               what="installed")
    assert done["state"] == "done", done
    _, old = await job(cluster, a, ghost)
    assert old["state"] == "failed" and old["error"] == "the replica running it stopped"


@pytest_twisted.ensureDeferred
async def test_request_overrides_cannot_choose_backend_code_files_or_node(cluster, files,
                                                                          tmp_path):
    """Issue 21 §2, the attacks through ``overrides`` on a real replica: a request that writes
    ``backend: transformers`` + ``trust_remote_code``, a ``parameters.model`` URL or
    ``download_files`` (the replica fetches them), a ``node_selector``, or 64 KiB of JSON, is
    a 400 naming the key, and nothing is written; sampling defaults are accepted.
    Red before the allow-list (``check_request_overrides`` not called): every one was
    admitted and the first wrote ``trust_remote_code: true`` into the config."""
    files.files["a.bin"] = SMALL
    (a,) = await start(cluster, tmp_path, [entry("one", [
        ("one/a.bin", f"{files.base}/files/a.bin", sha256_hex(SMALL))])], "replica-a")
    attacks = [
        ({"backend": "transformers", "trust_remote_code": True}, "overrides.backend"),
        ({"trust_remote_code": True}, "overrides.trust_remote_code"),
        ({"parameters": {"model": "file:///etc/passwd"}}, "overrides.parameters.model"),
        ({"download_files": [{"filename": "p", "uri": "file:///etc/passwd"}]},
         "overrides.download_files"),
        ({"node_selector": {"node": "mine"}}, "overrides.node_selector"),
        ({"description": "x" * (64 * 1024)}, "overrides"),
    ]
    for overrides, field in attacks:
        status, body = await call(cluster, a, "POST", "/models/apply",
                                  {"id": "one", "name": "evil", "overrides": overrides})
        assert status == 400, (overrides, body)
        assert body["error"]["field"] == field, body
        assert field in body["error"]["message"] or field == "overrides"
    assert model_files(cluster.models_dir) == []
    status, applied = await call(cluster, a, "POST", "/models/apply", {
        "id": "one", "overrides": {"parameters": {"temperature": 0.2, "top_k": 5},
                                   "context_size": 512, "description": "ok"}})
    assert status == 200, applied
    _, done = await eventually(lambda: _done(job(cluster, a, applied["uuid"])), timeout=30,
                               what="installed")
    assert done["state"] == "done", done
    written = yaml.safe_load(open(os.path.join(cluster.models_dir, "one.yaml")))
    assert written["parameters"]["temperature"] == 0.2 and written["context_size"] == 512


@pytest_twisted.ensureDeferred
async def test_an_install_does_not_overwrite_an_existing_model_unless_replace(cluster, files,
                                                                              tmp_path):
    """Issue 21 §2: an install named after an existing model (the operator's ``victim.yaml``)
    is a 409 saying ``"replace": true``; the config is unchanged.  With ``"replace": true``
    it is replaced.
    Red without the existence check (``GalleryJobs.apply``): the config was overwritten."""
    files.files["a.bin"] = SMALL
    (a,) = await start(cluster, tmp_path, [entry("one", [
        ("one/a.bin", f"{files.base}/files/a.bin", sha256_hex(SMALL))])], "replica-a")
    victim = os.path.join(cluster.models_dir, "victim.yaml")
    os.makedirs(cluster.models_dir, exist_ok=True)
    original = "name: victim\nbackend: echo\nnode_selector: {pool: trusted}\n"
    with open(victim, "w") as f:
        f.write(original)
    status, body = await call(cluster, a, "POST", "/models/apply",
                              {"id": "one", "name": "victim"})
    assert status == 409, body
    assert '"replace": true' in body["error"]["message"]
    assert open(victim).read() == original
    status, body = await call(cluster, a, "POST", "/models/apply",
                              {"id": "one", "name": "victim", "replace": "yes"})
    assert status == 400 and body["error"]["field"] == "replace"
    status, applied = await call(cluster, a, "POST", "/models/apply",
                                 {"id": "one", "name": "victim", "replace": True})
    assert status == 200, applied
    _, done = await eventually(lambda: _done(job(cluster, a, applied["uuid"])), timeout=30,
                               what="replaced")
    assert done["state"] == "done", done
    assert "node_selector" not in yaml.safe_load(open(victim))


@pytest_twisted.ensureDeferred
async def test_file_sources_that_never_end_are_refused_and_bounded(cluster, files, tmp_path):
    """Issue 21 §2: a ``file://`` source (here named by the operator's own index) that is
    ``/dev/zero`` or a FIFO with no writer fails the job at once, naming it "not a regular
    file", and leaves nothing; an index that is a FIFO is a 502, not a hung thread.
    Red before ``open_regular_file``: ``/dev/zero`` (size 0 by ``fstat``) passed the cap check
    and was copied without end (the 8 MiB cap set here never applied: the job never
    finished), and the FIFO held a thread in ``open``."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (a,) = await start(cluster, tmp_path, [
        entry("zero", [("zero.bin", "file:///dev/zero", None)]),
        entry("fifo", [("fifo.bin", f"file://{fifo}", None)])], "replica-a")
    a.replica.gallery.downloads.max_bytes = 8 * 1024 * 1024
    for name in ("zero", "fifo"):
        status, applied = await call(cluster, a, "POST", "/models/apply", {"id": name})
        assert status == 200, applied
        _, failed = await eventually(lambda j=applied["uuid"]: _done(job(cluster, a, j)),
                                     timeout=30, what=f"{name} finished")
        assert failed["state"] == "failed" and "not a regular file" in failed["error"], failed
    assert model_files(cluster.models_dir) == []
    frontend = await cluster.frontend("replica-b", galleries=[f"fifo=file://{fifo}"])
    status, body = await call(cluster, frontend, "GET", "/models/available")
    assert status == 502 and "not a regular file" in body["error"]["message"], body


@pytest_twisted.ensureDeferred
async def test_an_existing_model_is_found_whatever_its_file_is_called(cluster, files,
                                                                      tmp_path):
    """Issue 21 §2: the existing-name check knows every config, not only ``<name>.yaml``: a
    model ``renamed`` defined in ``other-file.yaml`` and a model ``short`` in ``short.yml``
    are each a 409, and neither file changes (nor does a ``renamed.yaml`` appear that would
    shadow it).
    Red when only ``<name>.yaml`` is looked at: both were admitted and installed."""
    files.files["a.bin"] = SMALL
    (a,) = await start(cluster, tmp_path, [entry("one", [
        ("one/a.bin", f"{files.base}/files/a.bin", sha256_hex(SMALL))])], "replica-a")
    os.makedirs(cluster.models_dir, exist_ok=True)
    written = {
        "other-file.yaml": "name: renamed\nbackend: echo\nnode_selector: {pool: trusted}\n",
        "short.yml": "name: short\nbackend: echo\n",
    }
    for fname, text in written.items():
        with open(os.path.join(cluster.models_dir, fname), "w") as f:
            f.write(text)
    for name in ("renamed", "short"):
        status, body = await call(cluster, a, "POST", "/models/apply",
                                  {"id": "one", "name": name})
        assert status == 409, (name, body)
        assert '"replace": true' in body["error"]["message"]
    # "replace": true cannot replace a definition in another file (the install writes
    # renamed.yaml; other-file.yaml would still win): a 409 naming the file
    status, body = await call(cluster, a, "POST", "/models/apply",
                              {"id": "one", "name": "renamed", "replace": True})
    assert status == 409 and "other-file.yaml" in body["error"]["message"], body
    assert sorted(n for n in os.listdir(cluster.models_dir) if n != ".blobs") == sorted(written)
    for fname, text in written.items():
        assert open(os.path.join(cluster.models_dir, fname)).read() == text
