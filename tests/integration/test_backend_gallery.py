"""LocalAI's backend gallery on a cluster (issue 24 §4): two real replicas, real workers over
their tunnels, a backend gallery index in LocalAI's format (``backend/index.yaml``: a meta
backend whose ``capabilities`` pick a concrete entry, an ``alias``, ``sha256``) whose entries
are a LocalAI backend directory (a ``run.sh`` that execs this package's ``echo`` backend)
packed as a tar archive, the same directory unpacked, and broken ones.

An install admitted at one replica is answered by the other; it lands on every worker; a
model naming the backend then answers.  Each failure is a ``failed`` job naming what could
not be fetched or unpacked, and leaves the workers' backends directories as they were.

Deliberate breaks checked once (commit message): the worker unpacking without its member
checks (the ``..`` archive escapes the backends directory: red), and the frontend not
checking ``sha256`` (the bad-digest entry installs: red)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile

import pytest_twisted
import yaml
from twisted.internet import threads

from localai_tw.backends.builtin import PACKAGE_ROOT

from .harness_downloads import files  # noqa: F401 (fixture)
from .harness_gallery import call
from .inference_harness import ADMIN
from .support import eventually

import openai  # noqa: E402  (the official client, as a LocalAI user's program would call)

RUN_SH = f"""#!/bin/sh
PYTHONPATH={PACKAGE_ROOT} exec {sys.executable} -m localai_tw.backends.builtin.echo "$@"
"""


def backend_directory(root) -> str:
    """A LocalAI backend directory, as LocalAI's gallery unpacks one."""
    d = root / "echo-backend"
    d.mkdir(parents=True)
    (d / "run.sh").write_text(RUN_SH)
    (d / "run.sh").chmod(0o755)
    (d / "lib").mkdir()
    (d / "lib" / "backend.py").write_text("# what run.sh would exec in a LocalAI backend\n")
    (d / "lib" / "current.py").symlink_to("backend.py")
    return str(d)


def pack(directory: str, target) -> tuple[str, str]:
    """``directory``'s contents as a gzipped tar (run.sh at the top, as LocalAI's backend
    archives are) and its sha256."""
    with tarfile.open(target, "w:gz") as tar:
        for name in sorted(os.listdir(directory)):
            tar.add(os.path.join(directory, name), arcname=name)
    return str(target), hashlib.sha256(open(target, "rb").read()).hexdigest()


def escaping_archive(target) -> str:
    with tarfile.open(target, "w") as tar:
        for name, data in (("run.sh", RUN_SH.encode()), ("../../escaped.txt", b"gotcha")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return str(target)


async def wait_job(cluster, frontend, job_id: str, timeout: float = 90) -> dict:
    async def finished():
        code, body = await call(cluster, frontend, "GET", f"/backends/jobs/{job_id}")
        return body if code == 200 and body["state"] in ("done", "failed") else None
    return await eventually(finished, timeout=timeout, what=f"backend job {job_id}")


def model(cluster, name: str, backend: str, selector: str = "") -> None:
    cluster.write_model(f"{name}.yaml", (
        f"name: {name}\nbackend: {backend}\nparameters:\n  model: {name}-weights\n"
        + (f"node_selector: {{{selector}}}\n" if selector else "") +
        "known_usecases: [chat, completion]\n"
        "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"))


def chat(base: str, model_name: str) -> str:
    client = openai.OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=60)
    answer = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "one two three"}])
    return answer.choices[0].message.content


def listing(path) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


@pytest_twisted.ensureDeferred
async def test_a_gallery_backend_installs_on_every_worker_and_a_model_using_it_answers(
        cluster, tmp_path):
    source = backend_directory(tmp_path / "source")
    archive, digest = pack(source, tmp_path / "echo-backend.tar.gz")
    index = tmp_path / "backend-index.yaml"
    index.write_text(yaml.safe_dump([
        # LocalAI's layout: a meta backend, and the concrete build it picks on a CPU host
        {"name": "my-echo", "alias": "my-echo", "description": "echo, as a LocalAI backend",
         "capabilities": {"default": "cpu-my-echo", "nvidia": "cuda12-my-echo"}},
        {"name": "cpu-my-echo", "alias": "my-echo", "uri": f"file://{archive}",
         "sha256": digest},
        {"name": "dir-echo", "uri": source},
        {"name": "bad-digest", "uri": f"file://{archive}", "sha256": "0" * 64},
        {"name": "oci-echo", "uri": "quay.io/go-skynet/local-ai-backends:latest-cpu-echo"},
        {"name": "escape", "uri": f"file://{escaping_archive(tmp_path / 'escape.tar')}"},
        {"name": "missing", "uri": f"file://{tmp_path}/nowhere.tar.gz"},
    ]))
    model(cluster, "echo-chat", "my-echo")
    model(cluster, "dir-chat", "dir-echo", selector="worker: one")  # only w-one gets it
    # No --allow-private-downloads: the gallery is the operator's own file, so it may name
    # files on the replica's disk.
    replicas = []
    for name in ("replica-a", "replica-b"):
        frontend = await cluster.frontend(name, **{
            "backend-galleries": [f"test=file://{index}"], "allow-private-downloads": False})
        await eventually(lambda f=frontend: f.replica.gallery._subscription is not None,
                         timeout=20, what=f"{name} listening")
        replicas.append(frontend)
    a, b = replicas
    names = ("w-one", "w-two")
    workers = [await cluster.worker(n, a, labels={"worker": n[2:]},
                                    **{"backends-path": str(tmp_path / f"{n}-backends")})
               for n in names]
    dirs = [tmp_path / f"{n}-backends" for n in names]

    code, galleries = await call(cluster, b, "GET", "/backends/galleries")
    assert (code, galleries) == (200, [{"name": "test", "url": f"file://{index}"}])
    code, available = await call(cluster, b, "GET", "/backends/available")
    assert code == 200 and [e["name"] for e in available][:3] == ["my-echo", "cpu-my-echo",
                                                                  "dir-echo"]
    assert available[0]["meta"] and not available[0]["installed"]

    # A request cannot choose what is fetched.
    code, refused = await call(cluster, a, "POST", "/backends/apply",
                               {"id": "x", "uri": "http://example.com/evil.tar"})
    assert code == 400 and refused["error"]["field"] == "uri"
    code, unknown = await call(cluster, a, "POST", "/backends/apply", {"id": "test@nope"})
    assert code == 404

    # The meta backend, on every worker; the job admitted at A is answered by B.
    code, accepted = await call(cluster, a, "POST", "/backends/apply", {"id": "test@my-echo"})
    assert code == 200 and accepted["status_url"].endswith(f"/backends/jobs/{accepted['id']}")
    done = await wait_job(cluster, b, accepted["id"])
    assert done["state"] == "done", done
    assert done["nodes"] == {"w-one": "installed", "w-two": "installed"}
    assert done["backend"] == "cpu-my-echo" and done["sha256"] == digest
    for d in dirs:
        assert listing(d) == ["cpu-my-echo", "my-echo"]
        meta = json.loads((d / "my-echo" / "metadata.json").read_text())
        assert meta["meta_backend_for"] == "cpu-my-echo"
        concrete = json.loads((d / "cpu-my-echo" / "metadata.json").read_text())
        assert concrete["alias"] == "my-echo" and concrete["uri"] == f"file://{archive}"
        assert os.readlink(d / "cpu-my-echo" / "lib" / "current.py") == "backend.py"
    answer = await threads.deferToThread(chat, cluster.base_url(b) + "/v1", "echo-chat")
    assert answer == "one two three"

    # Idempotent unless forced (LocalAI's apply).
    code, again = await call(cluster, b, "POST", "/backends/apply", {"id": "my-echo"})
    again = await wait_job(cluster, a, again["id"])
    assert again["state"] == "done" and set(again["nodes"].values()) == {"already installed"}
    code, available = await call(cluster, a, "GET", "/backends/available")
    assert [e["installed_on"] for e in available[:2]] == [["w-one", "w-two"]] * 2
    assert available[0]["installed"]

    # One node, from a directory entry (packed by the replica, unpacked by the worker).
    one = workers[0].node_id
    code, started = await call(cluster, b, "POST", f"/api/nodes/{one}/backends/install",
                               {"backend": "test@dir-echo"})
    assert code == 202
    done = await wait_job(cluster, a, started["jobID"])
    assert done["state"] == "done" and done["nodes"] == {"w-one": "installed"}, done
    assert listing(dirs[0]) == ["cpu-my-echo", "dir-echo", "my-echo"]
    assert listing(dirs[1]) == ["cpu-my-echo", "my-echo"]
    code, node = await call(cluster, a, "GET", f"/api/nodes/{one}/backends")
    assert code == 200 and {b["name"] for b in node["installed"]} == {
        "cpu-my-echo", "dir-echo", "my-echo"}
    assert await threads.deferToThread(chat, cluster.base_url(a) + "/v1", "dir-chat") \
        == "one two three"

    # What could not be fetched or unpacked is named; nothing is left behind.
    expected = {"bad-digest": f"the gallery says {'0' * 64}",
                "oci-echo": "is an OCI image",
                "escape": "'..' component",
                "missing": "cannot be read"}
    for name, why in expected.items():
        code, accepted = await call(cluster, a, "POST", "/backends/apply", {"id": name})
        assert code == 200, accepted
        failed = await wait_job(cluster, b, accepted["id"])
        assert failed["state"] == "failed" and why in failed["error"], (name, failed)
    assert listing(dirs[0]) == ["cpu-my-echo", "dir-echo", "my-echo"]
    assert listing(dirs[1]) == ["cpu-my-echo", "my-echo"]
    assert not (tmp_path / "escaped.txt").exists()
    assert not any(os.path.exists(os.path.join(w.data_dir, "data", "backend-archives", f))
                   for w in workers for f in listing(os.path.join(w.data_dir, "data",
                                                                  "backend-archives")))

    # Delete on one node, at once: refused while a model runs on it, then done.
    code, busy = await call(cluster, b, "POST", f"/api/nodes/{one}/backends/delete",
                            {"backend": "dir-echo"})
    assert code == 409 and "running model(s) dir-chat" in busy["error"]["message"]
    code, _ = await call(cluster, b, "POST", f"/api/nodes/{one}/models/dir-chat/unload")
    assert code == 200
    code, deleted = await call(cluster, b, "POST", f"/api/nodes/{one}/backends/delete",
                               {"backend": "dir-echo"})
    assert code == 200 and deleted["nodes"] == {"w-one": "deleted: dir-echo"}, deleted
    code, gone = await call(cluster, b, "POST", f"/api/nodes/{one}/backends/delete",
                            {"backend": "dir-echo"})
    assert code == 404 and "is not installed" in gone["error"]["message"]
    assert listing(dirs[0]) == listing(dirs[1]) == ["cpu-my-echo", "my-echo"]

    # Delete everywhere, as a job: the meta backend and its concrete one go from the node
    # where no model runs on them; the node running echo-chat refuses, and the job says so.
    code, accepted = await call(cluster, a, "POST", "/backends/delete/my-echo")
    refused = await wait_job(cluster, b, accepted["id"])
    assert refused["state"] == "failed" and "running model(s) echo-chat" in refused["error"]
    assert sorted(map(listing, dirs)) == [[], ["cpu-my-echo", "my-echo"]]
    kept = "w-one" if listing(dirs[0]) else "w-two"
    assert f"node {kept}: backend my-echo is running" in refused["error"]
    assert f"deleted on {'w-two' if kept == 'w-one' else 'w-one'}" in refused["error"]

    # The admin key is required (an inference key is not enough, no key is a 401).
    code, _ = await call(cluster, a, "GET", "/backends/available", headers={})
    assert code == 401


@pytest_twisted.ensureDeferred
async def test_an_archive_over_http_is_downloaded_checked_and_installed(cluster, tmp_path,
                                                                        files):
    """The index and the archive over http (the tests' server is on 127.0.0.1: the cluster's
    frontends run with --allow-private-downloads); a mirror is tried when the uri fails; the
    download's progress, admitted at A, is seen at B while the server holds the second half."""
    source = backend_directory(tmp_path / "source")
    archive, digest = pack(source, tmp_path / "echo-backend.tar.gz")
    files.files["echo-backend.tar.gz"] = open(archive, "rb").read()
    files.files["index.yaml"] = yaml.safe_dump([
        {"name": "http-echo", "uri": f"{files.base}/files/gone.tar.gz",
         "mirrors": [f"{files.base}/held/echo-backend.tar.gz"], "sha256": digest},
    ]).encode()
    model(cluster, "http-chat", "http-echo")
    replicas = []
    for name in ("replica-a", "replica-b"):
        frontend = await cluster.frontend(name, **{
            "backend-galleries": [f"web={files.base}/files/index.yaml"]})
        await eventually(lambda f=frontend: f.replica.gallery._subscription is not None,
                         timeout=20, what=f"{name} listening")
        replicas.append(frontend)
    a, b = replicas
    worker = await cluster.worker("w-http", a, **{"backends-path": str(tmp_path / "backends")})
    code, accepted = await call(cluster, a, "POST", "/backends/apply", {"id": "web@http-echo"})
    assert code == 200

    async def downloading():
        code, body = await call(cluster, b, "GET", f"/backends/jobs/{accepted['id']}")
        return body if code == 200 and body.get("message") == "downloading" \
            and body.get("current_bytes") else None

    seen = await eventually(downloading, timeout=30, what="the download's progress at B")
    assert seen["total_bytes"] == len(files.files["echo-backend.tar.gz"])
    assert seen["current_bytes"] == seen["total_bytes"] // 2
    files.release.callback(None)
    done = await wait_job(cluster, b, accepted["id"])
    assert done["state"] == "done" and done["nodes"] == {"w-http": "installed"}, done
    assert b"/files/gone.tar.gz" in files.gets and b"/held/echo-backend.tar.gz" in files.gets
    assert await threads.deferToThread(chat, cluster.base_url(b) + "/v1",
                                       "http-chat") == "one two three"
    assert listing(os.path.join(worker.data_dir, "data", "backend-archives")) == []
    assert listing(a.replica.gallery.backends.archives_dir) == []
