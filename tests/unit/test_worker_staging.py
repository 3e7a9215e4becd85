"""File staging over in-memory transports: streaming to disk, verification, atomic rename,
containment, skip-if-present, progress, and the client's mapping of answers."""

from __future__ import annotations

import hashlib
import io
import json
import os

import pytest
from twisted.internet import defer
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers

from localai_tw import errors
from localai_tw.worker import staging
from localai_tw.worker.control import ControlAuth, ControlVerbs, build_worker_site
from localai_tw.worker.staging import (
    BadStagingKey,
    FileStaging,
    FileUploadSink,
    StagingRoots,
    parse_key,
)

from .support_worker_http import (
    REMOTE,
    SynchronousThreads,
    connect,
    exchange,
    http_request,
    parse_response,
    put_head,
    sha,
)

MiB = 1024 * 1024


def make_staging(roots, token=None, max_upload=staging.DEFAULT_MAX_UPLOAD_BYTES):
    auth = ControlAuth(token)
    files = FileStaging(roots, auth, SynchronousThreads(), max_upload)
    site = build_worker_site(
        ControlVerbs(), auth, lambda: None,
        v1_children=files.v1_children(), body_policies=files.body_policies(),
    )
    return site, files



def leftovers(directory) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), directory)
        for d, _, files in os.walk(directory) for f in files
    )


# -- keys ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"../etc/passwd", "outside allowed directory"),
        (b"models/../../x", "outside allowed directory"),
        (b"models/%2e%2e/x", "outside allowed directory"),
        (b"%2Fetc%2Fpasswd", "absolute key"),
        (b"/etc/passwd", "absolute key"),
        (b"a%00b", "NUL"),
        (b"a" * 1025, "longer than 1024"),
        (b"a/" * 600 + b"b", "longer than 1024"),
        (b"x" * 201, "segment longer"),
        (b"a//b", "empty"),
        (b"a/./b", "'.'"),
        (b"a/b/", "empty"),
        (b"a%5cb", "backslash"),
        (b"model.gguf.sha256", "sidecar"),
        (b"model.gguf.partial", "sidecar"),
        (b"%ff", "not UTF-8"),
        (b"", "empty key"),
    ],
)
def test_bad_keys_are_refused_with_a_clear_message(raw, words):
    with pytest.raises(BadStagingKey) as caught:
        parse_key(raw)
    assert words in str(caught.value)


def test_keys_map_to_their_roots(roots):
    assert roots.resolve("models/llama/q4.gguf").real_path == os.path.join(
        os.path.realpath(roots.models_dir), "llama", "q4.gguf")
    assert roots.resolve("data/set.jsonl").real_path == os.path.join(
        os.path.realpath(roots.data_dir), "set.jsonl")
    assert roots.resolve("job-1/input.bin").real_path == os.path.join(
        os.path.realpath(roots.staging_dir), "job-1", "input.bin")
    with pytest.raises(BadStagingKey):
        roots.resolve("models")


def test_symlink_leading_out_of_a_root_is_refused(roots, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, os.path.join(roots.models_dir, "escape"))
    with pytest.raises(BadStagingKey, match="outside allowed directory"):
        roots.resolve("models/escape/x.gguf")
    # a dangling link pointing outside must not let a file be created there either
    os.symlink(outside / "not-yet", os.path.join(roots.data_dir, "dangling"))
    with pytest.raises(BadStagingKey, match="outside allowed directory"):
        roots.resolve("data/dangling")


def test_symlink_inside_a_root_and_a_symlinked_root_are_allowed(tmp_path):
    real_models = tmp_path / "disk2" / "models"
    real_models.mkdir(parents=True)
    os.symlink(real_models, tmp_path / "models")
    (real_models / "v2").mkdir()
    os.symlink(real_models / "v2", real_models / "current")
    roots = StagingRoots(str(tmp_path / "models"), str(tmp_path), str(tmp_path))
    target = roots.resolve("models/current/x.gguf")
    assert target.real_path == str(real_models / "v2" / "x.gguf")


# -- PUT -----------------------------------------------------------------------------------------


def test_20_mib_upload_is_streamed_to_disk_and_renamed_atomically(roots):
    site, files = make_staging(roots)
    payload = os.urandom(20 * MiB)
    key = "models/big/model.gguf"
    final = os.path.join(roots.models_dir, "big", "model.gguf")
    transport, protocol = connect(site)
    protocol.dataReceived(put_head(key, len(payload), sha(payload)))
    request = protocol._channel.requests[0]
    sink = request.content
    assert isinstance(sink, FileUploadSink)
    assert not isinstance(sink, io.BytesIO)
    chunk = 64 * 1024
    for offset in range(0, len(payload), chunk):
        protocol.dataReceived(payload[offset:offset + chunk])
        if offset == 10 * MiB:
            # half way: the bytes are on disk under a temporary name, none under the final one
            assert not os.path.exists(final)
            assert os.path.getsize(sink.temp_path) == offset + chunk
            assert os.path.dirname(sink.temp_path) == os.path.dirname(final)
            (code, _, body), _, _ = exchange(
                site, http_request("GET", f"/v1/files-progress/{key}", None))
            assert (code, json.loads(body)) == (
                200, {"key": key, "received": offset + chunk, "total": len(payload)})
    assert sink.largest_chunk <= chunk  # never more than one chunk held in memory
    code, _, body = parse_response(transport.value())
    assert code == 200
    reply = json.loads(body)
    assert reply == {"key": key, "size": len(payload), "sha256": sha(payload),
                     "local_path": os.path.realpath(final), "skipped": False}
    with open(final, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == sha(payload)
    assert leftovers(roots.models_dir) == [f".blobs/sha256/{sha(payload)}", "big/model.gguf",
                                           "big/model.gguf.sha256"]
    assert os.path.samefile(final, os.path.join(roots.models_dir, ".blobs", "sha256",
                                                sha(payload)))  # one copy, two names
    assert files.uploads == {}


def test_digest_mismatch_is_400_and_leaves_nothing_behind(roots):
    site, files = make_staging(roots)
    payload = b"x" * 100_000
    (code, _, body), _, _ = exchange(
        site, put_head("data/f.bin", len(payload), sha(b"something else")) + payload)
    assert code == 400
    assert "sha256 mismatch" in json.loads(body)["problem"]
    assert leftovers(roots.data_dir) == []
    assert files.uploads == {}


def test_disconnect_mid_upload_removes_the_temporary_file(roots):
    site, files = make_staging(roots)
    transport, protocol = connect(site)
    protocol.dataReceived(put_head("data/f.bin", 1000, sha(b"x" * 1000)) + b"x" * 400)
    assert len(leftovers(roots.data_dir)) == 1  # the .partial
    protocol.connectionLost(Failure(ConnectionLost("stream reset")))
    assert leftovers(roots.data_dir) == []
    assert files.uploads == {}


def test_an_existing_file_is_replaced_only_when_the_new_one_is_complete(roots):
    site, _ = make_staging(roots)
    final = os.path.join(roots.staging_dir, "f.bin")
    with open(final, "wb") as f:
        f.write(b"old contents")
    new = b"n" * 5000
    transport, protocol = connect(site)
    protocol.dataReceived(put_head("f.bin", len(new), sha(new)) + new[:4999])
    with open(final, "rb") as f:
        assert f.read() == b"old contents"
    protocol.dataReceived(new[4999:])
    assert parse_response(transport.value())[0] == 200
    with open(final, "rb") as f:
        assert f.read() == new


@pytest.mark.parametrize(
    "head, code, words",
    [
        (put_head("a.bin", 10, None), 400, "X-Content-SHA256"),
        (put_head("a.bin", 10, "abc"), 400, "X-Content-SHA256"),
        (b"PUT /v1/files/a.bin HTTP/1.1\r\nHost: w\r\nTransfer-Encoding: chunked\r\n"
         b"X-Content-SHA256: " + b"0" * 64 + b"\r\n\r\n", 411, "Content-Length"),
        (put_head("a.bin", 1001, "0" * 64), 413, "limit of 1000"),
        (b"PUT /v1/files/a.bin HTTP/1.1\r\nHost: w\r\nX-Content-SHA256: " + b"0" * 64
         + b"\r\n\r\n", 411, "Content-Length"),
        (put_head("../a.bin", 10, "0" * 64), 400, "outside allowed directory"),
        (put_head("%2Fetc%2Fpasswd", 10, "0" * 64), 400, "absolute"),
    ],
)
def test_uploads_are_refused_when_the_headers_end(roots, head, code, words):
    site, _ = make_staging(roots, max_upload=1000)
    transport, protocol = connect(site)
    protocol.dataReceived(head)
    got, headers, body = parse_response(transport.value())
    assert got == code
    assert words in json.loads(body)["problem"]
    assert headers[b"connection"] == [b"close"]
    assert transport.disconnecting  # the body is not read
    for root in (roots.models_dir, roots.data_dir, roots.staging_dir):
        assert leftovers(root) == []


def test_expect_100_continue_is_not_sent_after_an_early_answer(roots):
    site, _ = make_staging(roots, max_upload=1000)
    transport, protocol = connect(site)
    protocol.dataReceived(put_head("a.bin", 1001, "0" * 64, [("Expect", "100-continue")]))
    assert transport.value().startswith(b"HTTP/1.1 413 ")
    assert b"100 Continue" not in transport.value()
    transport, protocol = connect(site)
    protocol.dataReceived(put_head("a.bin", 3, sha(b"abc"), [("Expect", "100-continue")]))
    assert transport.value() == b"HTTP/1.1 100 Continue\r\n\r\n"
    protocol.dataReceived(b"abc")
    assert b"HTTP/1.1 200 OK" in transport.value()


def test_unauthorized_upload_writes_nothing(roots):
    site, _ = make_staging(roots, token="t")
    transport, protocol = connect(site, peer=REMOTE)
    protocol.dataReceived(put_head("a.bin", 10, sha(b"0123456789")) + b"0123456789")
    assert parse_response(transport.value())[0] == 401
    assert leftovers(roots.staging_dir) == []
    transport, protocol = connect(site, peer=REMOTE)
    protocol.dataReceived(
        put_head("a.bin", 10, sha(b"0123456789"), [("Authorization", "Bearer t")])
        + b"0123456789")
    assert parse_response(transport.value())[0] == 200


def test_without_a_token_remote_callers_may_not_stage(roots):
    site, _ = make_staging(roots, token=None)
    (code, _, _), _, _ = exchange(site, put_head("a.bin", 1, sha(b"1")) + b"1", peer=REMOTE)
    assert code == 403
    (code, _, _), _, _ = exchange(site, http_request("HEAD", "/v1/files/a.bin", None), peer=REMOTE)
    assert code == 403


def test_concurrent_upload_of_the_same_key_is_409(roots):
    site, _ = make_staging(roots)
    first_transport, first = connect(site)
    first.dataReceived(put_head("a.bin", 10, sha(b"0123456789")) + b"01234")
    (code, _, body), _, _ = exchange(site, put_head("a.bin", 10, sha(b"0123456789")))
    assert code == 409
    first.dataReceived(b"56789")
    assert parse_response(first_transport.value())[0] == 200


def test_upload_into_a_path_under_a_file_is_400(roots):
    site, _ = make_staging(roots)
    with open(os.path.join(roots.staging_dir, "plain"), "wb") as f:
        f.write(b"x")
    (code, _, body), _, _ = exchange(site, put_head("plain/a.bin", 1, sha(b"1")) + b"1")
    assert code == 400


def test_symlink_escape_is_refused_over_http(roots, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, os.path.join(roots.data_dir, "escape"))
    site, _ = make_staging(roots)
    (code, _, body), _, _ = exchange(site, put_head("data/escape/x", 1, sha(b"1")) + b"1")
    assert (code, json.loads(body)["problem"]) == (400, "outside allowed directory")
    assert list(outside.iterdir()) == []


# -- HEAD and skip-if-present ----------------------------------------------------------------------


def head(site, key):
    (code, headers, _), _, _ = exchange(site, http_request("HEAD", f"/v1/files/{key}", None))
    return code, headers


def test_head_reports_size_and_digest_and_caches_it_in_a_sidecar(roots):
    site, _ = make_staging(roots)
    assert head(site, "models/m.gguf")[0] == 404
    path = os.path.join(roots.models_dir, "m.gguf")
    with open(path, "wb") as f:
        f.write(b"weights" * 1000)
    code, headers = head(site, "models/m.gguf")
    assert code == 200
    assert headers[b"x-file-size"] == [b"7000"]
    assert headers[b"x-content-sha256"] == [sha(b"weights" * 1000).encode()]
    assert headers[b"x-local-path"] == [os.fsencode(os.path.realpath(path))]
    assert os.path.exists(path + ".sha256")
    # a changed file makes the sidecar stale: the digest is computed again
    with open(path, "ab") as f:
        f.write(b"!")
    os.utime(path, ns=(1, 1))
    code, headers = head(site, "models/m.gguf")
    assert headers[b"x-content-sha256"] == [sha(b"weights" * 1000 + b"!").encode()]


def test_put_of_a_present_file_is_answered_before_the_body(roots):
    site, files = make_staging(roots)
    payload = b"p" * 50_000
    exchange(site, put_head("data/p.bin", len(payload), sha(payload)) + payload)
    transport, protocol = connect(site)
    protocol.dataReceived(put_head("data/p.bin", len(payload), sha(payload)))
    code, headers, body = parse_response(transport.value())
    assert code == 200 and json.loads(body)["skipped"] is True
    assert headers[b"connection"] == [b"close"]
    assert not transport.disconnecting  # the peer may still send the body: it is dropped
    protocol.dataReceived(payload)
    assert transport.disconnecting
    assert files.uploads == {}
    assert leftovers(roots.data_dir) == ["p.bin", "p.bin.sha256"]


# -- one copy per digest (issue 26 §4) ----------------------------------------------------------


def link(site, key: str, digest: str, size: int) -> tuple[int, dict]:
    (code, _, body), _, _ = exchange(site, http_request(
        "POST", f"/v1/files-link/{key}", b"",
        (("X-Content-SHA256", digest), ("X-File-Size", str(size)))))
    return code, json.loads(body)


def stored_copies(roots) -> list[str]:
    store = os.path.join(roots.models_dir, ".blobs", "sha256")
    return sorted(os.listdir(store)) if os.path.isdir(store) else []


def test_a_file_two_models_name_is_one_copy_and_one_transfer(roots):
    site, _ = make_staging(roots)
    payload = os.urandom(100_000)
    exchange(site, put_head("models/a/m.gguf", len(payload), sha(payload)) + payload)
    # the second model's key: linked from the store, no body sent at all
    code, reply = link(site, "models/b/m.gguf", sha(payload), len(payload))
    assert code == 200 and reply["skipped"] is True
    first, second = (os.path.join(roots.models_dir, m, "m.gguf") for m in ("a", "b"))
    assert os.path.samefile(first, second)
    assert os.stat(first).st_nlink == 3  # a, b and the store: one copy on disk
    assert stored_copies(roots) == [sha(payload)]
    assert head(site, "models/b/m.gguf")[1][b"x-content-sha256"] == [sha(payload).encode()]


@pytest.mark.parametrize("digest, size", [(sha(b"other"), 5), (None, 99)])
def test_a_link_to_what_the_store_does_not_hold_is_404(roots, digest, size):
    site, _ = make_staging(roots)
    payload = b"x" * 99
    exchange(site, put_head("models/a/m.gguf", len(payload), sha(payload)) + payload)
    code, reply = link(site, "models/b/m.gguf", digest or sha(payload), size if digest
                       else size + 1)
    assert code == 404 and "no file with that digest" in reply["problem"]
    assert not os.path.exists(os.path.join(roots.models_dir, "b", "m.gguf"))


def test_two_uploads_of_the_same_bytes_keep_one_copy(roots):
    site, _ = make_staging(roots)
    payload = b"y" * 5000
    for model in ("a", "b"):
        exchange(site, put_head(f"models/{model}/m.gguf", len(payload), sha(payload)) + payload)
    assert os.path.samefile(os.path.join(roots.models_dir, "a", "m.gguf"),
                            os.path.join(roots.models_dir, "b", "m.gguf"))


def test_a_replaced_file_frees_its_old_copy(roots):
    site, _ = make_staging(roots)
    old, new = b"1" * 4000, b"2" * 4000
    exchange(site, put_head("models/a/m.gguf", len(old), sha(old)) + old)
    exchange(site, put_head("models/a/m.gguf", len(new), sha(new)) + new)
    assert stored_copies(roots) == [sha(new)]


def test_files_outside_models_are_not_kept_by_content(roots):
    site, _ = make_staging(roots)
    payload = b"d" * 100
    exchange(site, put_head("data/d.bin", len(payload), sha(payload)) + payload)
    assert stored_copies(roots) == []
    assert link(site, "data/e.bin", sha(payload), 100)[0] == 404


def test_the_store_cannot_be_named_by_a_key(roots):
    with pytest.raises(BadStagingKey, match="content store"):
        roots.resolve("models/.blobs/sha256/" + "0" * 64)


def test_progress_of_no_upload_is_404(roots):
    site, _ = make_staging(roots)
    (code, _, body), _, _ = exchange(site, http_request("GET", "/v1/files-progress/a.bin", None))
    assert code == 404


def test_other_methods_are_405(roots):
    site, _ = make_staging(roots)
    (code, headers, _), _, _ = exchange(site, http_request("DELETE", "/v1/files/a.bin", None))
    assert code == 405 and headers[b"allow"] == [b"HEAD, PUT, GET"]


# -- the client ----------------------------------------------------------------------------------


class FakeResponse:
    def __init__(self, code, body=b"", headers=None):
        self.code = code
        self.headers = Headers(headers or {})
        self._body = body
        self.length = len(body)

    def deliverBody(self, protocol):
        protocol.makeConnection(StringTransport())
        if self._body:
            protocol.dataReceived(self._body)
        protocol.connectionLost(Failure(ResponseDone()))


class FakeClient:
    def __init__(self, head_response, put_response, link_response=None):
        self.head_response = head_response
        self.put_response = put_response
        self.link_response = link_response or FakeResponse(404, b'{"problem": "no file"}')
        self.calls = []

    def head(self, url, headers=None):
        self.calls.append(("HEAD", url, headers))
        return self._answer(self.head_response)

    def post(self, url, headers=None):
        self.calls.append(("POST", url, headers))
        return self._answer(self.link_response)

    def put(self, url, data=None, headers=None):
        self.calls.append(("PUT", url, headers))
        return self._answer(self.put_response)

    @staticmethod
    def _answer(response):
        if isinstance(response, Exception):
            return defer.fail(response)
        return defer.succeed(response)


def run_upload(client, path, **kwargs):
    results = []
    d = staging.upload_file(client, "http://node-1.invalid/", "models/m.gguf", str(path),
                            node_id="node-1", reactor=SynchronousThreads(), **kwargs)
    d.addBoth(results.append)
    assert results, "upload_file should have finished synchronously"
    return results[0]


@pytest.fixture
def local_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"w" * 3000)
    return path


def test_client_skips_when_the_worker_has_the_same_digest(local_file):
    digest = sha(b"w" * 3000)
    client = FakeClient(
        FakeResponse(200, headers={b"X-Content-SHA256": [digest.encode()],
                                   b"X-File-Size": [b"3000"]}),
        AssertionError("must not PUT"),
    )
    progress = []
    result = run_upload(client, local_file, progress_cb=lambda s, t: progress.append((s, t)),
                        token="tok")
    assert result == staging.StagedFile("models/m.gguf", 3000, digest, True, None)
    assert [c[0] for c in client.calls] == ["HEAD"]
    assert client.calls[0][1] == "http://node-1.invalid/v1/files/models/m.gguf"
    assert client.calls[0][2]["Authorization"] == "Bearer tok"
    assert progress == [(3000, 3000)]


def test_client_puts_with_the_digest_when_absent(local_file):
    digest = sha(b"w" * 3000)
    reply = json.dumps({"key": "models/m.gguf", "size": 3000, "sha256": digest,
                        "local_path": "/m/m.gguf", "skipped": False}).encode()
    client = FakeClient(FakeResponse(404, b'{"problem": "no such file"}'),
                        FakeResponse(200, reply))
    result = run_upload(client, local_file)
    assert result == staging.StagedFile("models/m.gguf", 3000, digest, False, "/m/m.gguf")
    assert [c[0] for c in client.calls] == ["HEAD", "POST", "PUT"]
    assert client.calls[2][2]["X-Content-SHA256"] == digest


def test_client_links_what_the_worker_holds_under_another_key(local_file):
    digest = sha(b"w" * 3000)
    reply = json.dumps({"key": "models/m.gguf", "size": 3000, "sha256": digest,
                        "local_path": "/m/m.gguf", "skipped": True}).encode()
    client = FakeClient(FakeResponse(404), AssertionError("must not PUT"),
                        FakeResponse(200, reply))
    result = run_upload(client, local_file)
    assert result == staging.StagedFile("models/m.gguf", 3000, digest, True, "/m/m.gguf")
    method, url, headers = client.calls[1]
    assert (method, url) == ("POST", "http://node-1.invalid/v1/files-link/models/m.gguf")
    assert headers["X-Content-SHA256"] == digest and headers["X-File-Size"] == "3000"


@pytest.mark.parametrize("code", [400, 401, 409, 411, 413, 500, 507])
def test_client_maps_refusals_onto_worker_answers(local_file, code):
    client = FakeClient(FakeResponse(404),
                        FakeResponse(code, b'{"problem": "sha256 mismatch: expected a, got b"}'))
    failure = run_upload(client, local_file)
    assert isinstance(failure, Failure)
    assert failure.check(errors.WorkerAnswer)
    assert not failure.check(errors.WorkerBusy)
    assert f"answered {code}" in str(failure.value)
    assert "sha256 mismatch" in str(failure.value)
    assert errors.condition_of(failure.value) == "worker-answer"


def test_client_maps_503_onto_worker_busy(local_file):
    client = FakeClient(FakeResponse(503, b'{"busy": "disk is being scrubbed"}'), None)
    failure = run_upload(client, local_file)
    assert failure.check(errors.WorkerBusy)
    assert "disk is being scrubbed" in str(failure.value)


@pytest.mark.parametrize("stage", ["head", "put"])
def test_client_leaves_transport_failures_alone(local_file, stage):
    broken = ConnectionDone("stream reset")
    routing = errors.WorkerUnroutable("node-1", "no live owner")
    client = FakeClient(broken if stage == "head" else FakeResponse(404), routing)
    failure = run_upload(client, local_file)
    assert not failure.check(errors.WorkerAnswer)
    assert failure.value is (broken if stage == "head" else routing)
