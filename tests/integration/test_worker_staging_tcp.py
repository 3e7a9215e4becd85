"""File staging over real loopback TCP: the client helper against the worker's site."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import pytest_twisted
import treq
from twisted.internet import defer, reactor, task

from localai_tw import errors, staging_client
from localai_tw.worker import staging
from localai_tw.worker.control import ControlAuth, ControlVerbs, build_worker_site
from localai_tw.worker.staging import FileStaging, StagingRoots
from tests.integration.harness_tcp import raw_exchange, with_timeout

MiB = 1024 * 1024
TOKEN = "stage-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def roots(tmp_path):
    for name in ("models", "data", "staging"):
        (tmp_path / name).mkdir()
    return StagingRoots(str(tmp_path / "models"), str(tmp_path / "data"),
                        str(tmp_path / "staging"))


@pytest.fixture
def worker(roots):
    auth = ControlAuth(TOKEN)
    files = FileStaging(roots, auth, reactor, max_upload_bytes=64 * MiB)
    site = build_worker_site(ControlVerbs(), auth, lambda: None,
                             v1_children=files.v1_children(),
                             body_policies=files.body_policies())
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    yield f"http://127.0.0.1:{port.getHost().port}", port.getHost().port, files
    pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


@pytest.fixture
def sink_writes(monkeypatch):
    """Every chunk the server's upload sinks took: (sink, length)."""
    seen = []
    real_write = staging.FileUploadSink.write

    def spy(self, data):
        seen.append((self, len(data)))
        return real_write(self, data)

    monkeypatch.setattr(staging.FileUploadSink, "write", spy)
    return seen


def files_under(directory):
    return sorted(os.path.relpath(os.path.join(d, f), directory)
                  for d, _, names in os.walk(directory) for f in names)


@pytest_twisted.ensureDeferred
async def test_20_mib_upload_streams_then_a_second_one_is_skipped(worker, roots, tmp_path,
                                                                  sink_writes):
    base, _, files = worker
    source = tmp_path / "weights.gguf"
    payload = os.urandom(20 * MiB)
    source.write_bytes(payload)
    progress = []
    result = await with_timeout(staging.upload_file(
        treq, base, "models/llama/weights.gguf", str(source),
        lambda sent, total: progress.append((sent, total)), node_id="node-a", token=TOKEN))
    digest = hashlib.sha256(payload).hexdigest()
    final = os.path.join(roots.models_dir, "llama", "weights.gguf")
    assert result == staging.StagedFile("models/llama/weights.gguf", len(payload), digest,
                                        False, os.path.realpath(final))
    with open(final, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == digest
    assert files_under(roots.models_dir) == [f".blobs/sha256/{digest}", "llama/weights.gguf",
                                             "llama/weights.gguf.sha256"]
    # streamed: many chunks, none large; the request content was the sink, not a buffer
    sinks = {sink for sink, _ in sink_writes}
    assert len(sinks) == 1
    (sink,) = sinks
    assert not hasattr(sink, "getvalue")
    assert max(size for _, size in sink_writes) <= 256 * 1024
    assert len(sink_writes) >= 20 * MiB // (256 * 1024)
    assert progress[-1] == (len(payload), len(payload))
    assert [sent for sent, _ in progress] == sorted(sent for sent, _ in progress)

    writes_before = len(sink_writes)
    again = await with_timeout(staging.upload_file(
        treq, base, "models/llama/weights.gguf", str(source), node_id="node-a", token=TOKEN))
    assert again.skipped is True and again.sha256 == digest
    assert len(sink_writes) == writes_before  # nothing was sent


@pytest_twisted.ensureDeferred
async def test_digest_mismatch_is_a_worker_answer_and_leaves_no_file(worker, roots, tmp_path,
                                                                     monkeypatch):
    base, _, _ = worker
    source = tmp_path / "data.bin"
    source.write_bytes(b"d" * 300_000)
    monkeypatch.setattr(staging_client, "sha256_of_file", lambda path: (300_000, "0" * 64))
    with pytest.raises(errors.WorkerAnswer) as caught:
        await with_timeout(staging.upload_file(
            treq, base, "data/data.bin", str(source), node_id="node-a", token=TOKEN))
    assert "answered 400" in str(caught.value) and "sha256 mismatch" in str(caught.value)
    assert errors.may_act_on(caught.value)
    assert files_under(roots.data_dir) == []


@pytest_twisted.ensureDeferred
async def test_put_with_a_wrong_digest_header_is_400(worker, roots):
    base, _, _ = worker
    response = await with_timeout(treq.put(
        base + "/v1/files/job/x.bin", data=b"x" * 1000,
        headers={**AUTH, "X-Content-SHA256": "f" * 64}, persistent=False))
    assert response.code == 400
    assert "sha256 mismatch" in json.loads(await treq.content(response))["problem"]
    assert files_under(roots.staging_dir) == []  # no file, no .partial
    assert os.listdir(os.path.join(roots.staging_dir, "job")) == []


@pytest_twisted.ensureDeferred
async def test_containment_over_http(worker, roots, tmp_path):
    base, port, _ = worker
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    os.symlink(outside, os.path.join(roots.data_dir, "link"))
    for key in ("data/link/secret", "models/%2e%2e/%2e%2e/outside/secret",
                "%2Fetc%2Fpasswd", "a%00b"):
        response = await with_timeout(treq.head(base + "/v1/files/" + key, headers=AUTH,
                                                persistent=False))
        assert response.code == 400, key
        await treq.content(response)
    # a raw request line with literal dot segments (clients would normalise them away)
    client = await raw_exchange(
        port, b"PUT /v1/files/../../outside/evil HTTP/1.1\r\nHost: w\r\n"
              b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
              b"X-Content-SHA256: " + b"0" * 64 + b"\r\nContent-Length: 4\r\n\r\nevil")
    received = await with_timeout(client.closed)
    assert received.startswith(b"HTTP/1.1 400 ")
    assert b"outside allowed directory" in received
    assert sorted(os.listdir(outside)) == ["secret"]


@pytest_twisted.ensureDeferred
async def test_progress_is_visible_while_an_upload_is_in_flight(worker, roots):
    base, port, _ = worker
    body = b"p" * (2 * MiB)
    digest = hashlib.sha256(body).hexdigest()
    head = (b"PUT /v1/files/data/slow.bin HTTP/1.1\r\nHost: w\r\nConnection: close\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"X-Content-SHA256: " + digest.encode() + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    client = await raw_exchange(port, head + body[:MiB])
    final = os.path.join(roots.data_dir, "slow.bin")
    progress = None
    for _ in range(100):
        response = await with_timeout(treq.get(base + "/v1/files-progress/data/slow.bin",
                                               headers=AUTH, persistent=False))
        progress = json.loads(await treq.content(response))
        if response.code == 200 and progress["received"] == MiB:
            break
        await task.deferLater(reactor, 0.02, lambda: None)
    assert progress == {"key": "data/slow.bin", "received": MiB, "total": 2 * MiB}
    assert not os.path.exists(final)  # nothing under the final name until complete
    client.transport.write(body[MiB:])
    received = await with_timeout(client.closed)
    assert received.startswith(b"HTTP/1.1 200 OK")
    with open(final, "rb") as f:
        assert f.read() == body
    response = await with_timeout(treq.get(base + "/v1/files-progress/data/slow.bin",
                                           headers=AUTH, persistent=False))
    assert response.code == 404
    await treq.content(response)
