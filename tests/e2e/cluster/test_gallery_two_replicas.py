"""A gallery install with real processes (issue 13 §5): two ``twistd`` frontends on one
PostgreSQL, one shared models directory, a gallery index in LocalAI's format in a file, and the
model files served by a small HTTP server this test runs in a thread (``/held/`` sends half of
the file and waits for the test to release the rest).

At frontend 0 a first install starts downloading (held) and a second waits behind it; frontend 1
sees the second **queued, before any row exists**, with its ~9000-byte description
byte-identical (it went through the bus's spill table), sees the first **downloading** (bytes,
total), and then both **done** (their rows).

Deliberate break: ``GalleryJobs._publish`` returning before ``bus.publish`` (a replica that
publishes only to itself) -> frontend 1 never sees the download's bytes (red at the first wait, after 60 s;
checked once), nor the queued job (404).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading

import yaml

from .harness import wait_for

WEIGHTS = bytes(range(256)) * 4096  # 1 MiB
SMALL = b"vocabulary " * 100
LONG_DESCRIPTION = ("Ein Modell für Grüße, naïve café — 模型 🚀\n" * 200)[:8600]


class _Files(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    release = threading.Event()

    def do_GET(self):
        kind, _, name = self.path.strip("/").partition("/")
        data = self.files.get(name)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if kind == "held":
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.release.wait(120)
            self.wfile.write(data[len(data) // 2:])
        else:
            self.wfile.write(data)

    def log_message(self, *args):
        pass


def _job(cluster, fe, job_id):
    answer = cluster.admin(fe, "GET", f"/models/jobs/{job_id}")
    return answer.json() if answer.status == 200 else None


def test_an_install_admitted_at_one_replica_is_seen_at_the_other_throughout(make_cluster):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    _Files.files = {"a.bin": WEIGHTS, "b.bin": SMALL}
    _Files.release = threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        cluster = make_cluster()
        models = cluster.workdir / "models"
        models.mkdir(parents=True)
        index = cluster.workdir / "index.yaml"
        index.write_text(yaml.safe_dump([
            {"name": "first", "config_file": "backend: echo\nparameters:\n  model: first/a.bin\n",
             "files": [{"filename": "first/a.bin", "uri": f"{base}/held/a.bin",
                        "sha256": hashlib.sha256(WEIGHTS).hexdigest()}]},
            {"name": "second", "description": LONG_DESCRIPTION,
             "config_file": "backend: echo\nparameters:\n  model: second/b.bin\n",
             "files": [{"filename": "second/b.bin", "uri": f"{base}/files/b.bin",
                        "sha256": hashlib.sha256(SMALL).hexdigest()}]}],
            allow_unicode=True))
        # the files are on 127.0.0.1: the operator's option for a local mirror
        args = ("--models-dir", str(models), "--galleries", f"e2e=file://{index}",
                "--allow-private-downloads")
        f0 = cluster.start_frontend(extra_args=args)
        f1 = cluster.start_frontend(extra_args=args)

        first = cluster.admin(f0, "POST", "/models/apply", {"id": "e2e@first"})
        assert first.status == 200, first.body
        first_id = first.json()["uuid"]
        seen = wait_for(lambda: (_job(cluster, f1, first_id) or {}).get("state") ==
                        "downloading" and _job(cluster, f1, first_id), 60,
                        "frontend 1 sees the first install downloading")
        assert seen["total_bytes"] == len(WEIGHTS) and seen["replica"] == f0.instance_id

        second = cluster.admin(f0, "POST", "/models/apply", {"id": "second"})
        second_id = second.json()["uuid"]
        queued = wait_for(lambda: _job(cluster, f1, second_id), 60,
                          "frontend 1 sees the queued install")
        assert queued["state"] == "queued" and queued["source"] == "broadcast"
        assert cluster.sql("SELECT 1 FROM gallery_jobs WHERE id = %s", (second_id,)) == []
        assert queued["description"] == LONG_DESCRIPTION
        assert cluster.sql("SELECT count(*) FROM bus_messages WHERE subject = %s",
                           (f"gallery.{second_id}",))[0][0] >= 1

        _Files.release.set()
        for job_id in (first_id, second_id):
            done = wait_for(lambda j=job_id: (_job(cluster, f1, j) or {}).get("state") in
                            ("done", "failed") and _job(cluster, f1, j), 60,
                            "frontend 1 sees the install finished")
            assert done["state"] == "done" and done["source"] == "row", json.dumps(done)[:500]
        assert (models / "first" / "a.bin").read_bytes() == WEIGHTS
        assert (models / "second.yaml").exists()
    finally:
        _Files.release.set()
        server.shutdown()
        server.server_close()
