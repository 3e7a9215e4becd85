"""Scratch directories on a worker (``localai_tw/worker/scratch.py``): made by the worker,
filled and read back through file staging, removed by id; every path outside them refused."""

from __future__ import annotations

import json
import os
import time

import pytest

from localai_tw.worker.control import ControlAuth, ControlVerbs, build_worker_site
from localai_tw.worker.scratch import ScratchArea
from localai_tw.worker.staging import FileStaging

from .support_worker_http import (
    SynchronousThreads,
    connect,
    exchange,
    http_request,
    parse_response,
    post,
    put_head,
    sha,
)


def make(roots, **kw):
    auth = ControlAuth(None)
    files = FileStaging(roots, auth, SynchronousThreads())
    area = ScratchArea(files.scratch_root, SynchronousThreads(), **kw)
    area.reset()
    verbs = ControlVerbs()
    area.register(verbs)
    site = build_worker_site(verbs, auth, lambda: None, v1_children=files.v1_children(),
                             body_policies=files.body_policies())
    return site, area


def get(site, key):
    """GET a file (the worker streams it with a push producer; this transport never pauses)."""
    transport, protocol = connect(site)
    transport.producer = None
    protocol.dataReceived(http_request("GET", "/v1/files/" + key, None))
    return parse_response(transport.value())


def create(site):
    code, _, body = post(site, "/v1/control/scratch/create", {})
    assert code == 200, body
    return json.loads(body)


def test_create_put_get_remove(roots):  # noqa: F811
    site, area = make(roots)
    made = create(site)
    assert len(made["id"]) == 32 and os.path.isdir(made["path"])
    assert made["path"] == os.path.realpath(os.path.join(roots.staging_dir, "scratch",
                                                         made["id"]))
    data = b"RIFF audio"
    key = f"scratch/{made['id']}/audio.wav"
    (code, _, body), _, _ = exchange(site, put_head(key, len(data), sha(data)) + data)
    assert code == 200 and json.loads(body)["local_path"] == os.path.join(made["path"],
                                                                          "audio.wav")
    code, headers, body = get(site, key)
    assert code == 200 and body == data and headers[b"content-length"] == [b"%d" % len(data)]
    code, _, body = post(site, "/v1/control/scratch/remove", {"id": made["id"]})
    assert code == 200 and json.loads(body) == {"removed": True}
    assert not os.path.exists(made["path"])
    code, _, body = post(site, "/v1/control/scratch/remove", {"id": made["id"]})
    assert json.loads(body) == {"removed": False}


@pytest.mark.parametrize("key, words", [
    ("scratch/" + "0" * 32 + "/a.wav", "no such scratch directory"),
    ("scratch/abc/a.wav", "32 lowercase hex"),
    ("scratch/ID/.hidden", "not starting with a dot"),
    ("scratch/ID/sub/a.wav", "scratch/<id>/<name>"),
    ("scratch/ID", "scratch/<id>/<name>"),
    ("scratch/ID/%2e%2e", "segment"),
])
def test_scratch_keys_outside_a_made_directory_are_refused(roots, key, words):  # noqa: F811
    site, _ = make(roots)
    key = key.replace("ID", create(site)["id"])
    (code, _, body), _, _ = exchange(site, put_head(key, 1, sha(b"x")) + b"x")
    assert code == 400 and words in json.loads(body)["problem"], body
    code, _, body = get(site, key)
    assert code == 400 and words in json.loads(body)["problem"], body


def test_only_scratch_files_are_readable(roots):  # noqa: F811
    site, _ = make(roots)
    with open(os.path.join(roots.models_dir, "m.bin"), "wb") as f:
        f.write(b"weights")
    code, _, body = get(site, "models/m.bin")
    assert code == 403 and b"weights" not in body
    made = create(site)
    code, _, body = get(site, f"scratch/{made['id']}/speech.wav")
    assert code == 404 and "wrote nothing" in json.loads(body)["problem"]


def test_a_symlink_out_of_a_scratch_directory_is_not_followed(roots, tmp_path):  # noqa: F811
    site, _ = make(roots)
    made = create(site)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"secret")
    os.symlink(secret, os.path.join(made["path"], "speech.wav"))
    code, _, body = get(site, f"scratch/{made['id']}/speech.wav")
    assert code == 400 and b"secret" not in body


def test_remove_refuses_what_is_not_an_id(roots):  # noqa: F811
    site, _ = make(roots)
    outside = os.path.join(roots.staging_dir, "keep")
    os.mkdir(outside)
    for bad in ("../keep", "keep", "", 5):
        code, _, _ = post(site, "/v1/control/scratch/remove", {"id": bad})
        assert code == 400
    assert os.path.isdir(outside)


def test_busy_when_full_and_leftovers_are_swept(roots):  # noqa: F811
    site, area = make(roots, max_dirs=2, max_age=60.0)
    first, second = create(site), create(site)
    code, _, body = post(site, "/v1/control/scratch/create", {})
    assert code == 503 and "scratch directories are in use" in body.decode()
    old = time.time() - 120
    os.utime(first["path"], (old, old))  # its frontend died an age ago
    third = create(site)
    assert not os.path.exists(first["path"])
    assert os.path.isdir(second["path"]) and os.path.isdir(third["path"])


def test_reset_empties_the_scratch_root(roots):  # noqa: F811
    site, area = make(roots)
    made = create(site)
    area.reset()
    assert not os.path.exists(made["path"]) and os.path.isdir(area.root)


class SlowRequest:
    """A request whose consumer pauses the producer after every write (a slow reader)."""

    def __init__(self):
        from twisted.internet import defer as _defer

        self.chunks = []
        self.finished = 0
        self.producer = None
        self._finish = _defer.Deferred()

    def registerProducer(self, producer, streaming):
        assert streaming
        self.producer = producer

    def unregisterProducer(self):
        self.producer = None

    def notifyFinish(self):
        return self._finish

    def write(self, data):
        self.chunks.append(data)
        self.producer.pauseProducing()

    def finish(self):
        self.finished += 1


def test_reading_back_holds_one_chunk_while_the_reader_is_paused(tmp_path):
    from localai_tw.worker.staging import CHUNK_BYTES, _FileStreamer

    data = os.urandom(CHUNK_BYTES * 3 + 5)
    path = tmp_path / "speech.wav"
    path.write_bytes(data)
    request = SlowRequest()
    streamer = _FileStreamer(open(path, "rb"), request, len(data))
    streamer.start()
    assert len(request.chunks) == 1 and request.finished == 0
    while request.producer is not None:
        request.producer.resumeProducing()
        assert len(request.chunks) <= 5
    assert b"".join(request.chunks) == data and request.finished == 1
