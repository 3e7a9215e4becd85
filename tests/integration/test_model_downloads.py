"""Model files the frontend downloads (issue 11 §4): LocalAI's ``download_files`` and a URL
``parameters.model``, served by a twisted.web server this test starts on 127.0.0.1.

A download lands in the models directory only verified and whole, shows its progress (the
admin ``/api/cluster/loads`` ``downloads``, the router's ``loading_detail`` a waiting stream
prints, the log), is shared by concurrent requests, and its failures are named: a digest that
does not match (the file and both digests; nothing kept), a connection that breaks mid-body
(nothing kept; the next request tries again), an HTTP error.  The model then loads on a real
worker through the tunnel (``echo`` backend) from the staged file."""

from __future__ import annotations

import json
import os

import pytest
import pytest_twisted
import treq
from twisted.internet import defer
from twisted.logger import globalLogPublisher

from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.interfaces import ModelDownloadFailed, ModelFileMismatch

from .harness_downloads import WEIGHTS, download_model, files  # noqa: F401 (fixture)
from .inference_harness import ADMIN, sha256_hex
from .support import eventually, within


def leftovers(models_dir: str) -> list[str]:
    """The files a download left (configs and the content store's links aside)."""
    return sorted(os.path.relpath(os.path.join(d, n), models_dir)
                  for d, _, names in os.walk(models_dir) for n in names
                  if not n.endswith(".yaml") and
                  not os.path.relpath(d, models_dir).startswith(".blobs"))


@pytest_twisted.ensureDeferred
async def test_a_download_is_shared_shows_progress_and_loads_on_the_worker(cluster, files):
    files.files["weights.bin"] = WEIGHTS
    cluster.write_model("dl.yaml", download_model(f"{files.base}/held/weights.bin",
                                                  sha256_hex(WEIGHTS)))
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    router = frontend.replica.inference
    router.loader.downloads.log_interval = 0.0  # every chunk may log: the line is seen
    lines: list[str] = []

    def observe(event):
        text = event.get("log_format") or ""
        if "download" in text:
            lines.append(text.format(**{k: v for k, v in event.items() if isinstance(k, str)}))

    globalLogPublisher.addObserver(observe)
    try:
        first = router.predict("dl", backend_pb2.PredictOptions(Prompt="one"))
        second = router.predict("dl", backend_pb2.PredictOptions(Prompt="two"))
        downloads = router.loader.downloads
        # (each request reads the database before it joins the download: wait for both)
        await eventually(lambda: downloads.in_progress() and
                         downloads.in_progress()[0]["received"] == len(WEIGHTS) // 2 and
                         downloads.in_progress()[0]["waiting_requests"] == 2,
                         timeout=30, what="half of the file received, both requests waiting")
        [progress] = downloads.in_progress()
        assert progress["file"] == "dl/weights.bin" and progress["total"] == len(WEIGHTS)
        assert progress["url"] == f"{files.base}/held/weights.bin"
        assert "downloading dl/weights.bin 0.5 MiB/1.0 MiB at" in router.loading_detail("dl")
        # a third request that gives up stops waiting; the download goes on for the others
        third = router.predict("dl", backend_pb2.PredictOptions(Prompt="three"))
        await eventually(lambda: downloads.in_progress()[0]["waiting_requests"] == 3,
                         timeout=30, what="a third request waiting")
        third.cancel()
        with pytest.raises(defer.CancelledError):
            await third
        assert downloads.in_progress()[0]["waiting_requests"] == 2
        # the admin API shows it; nothing under the final name yet
        answer = await treq.get(cluster.base_url(frontend) + "/api/cluster/loads",
                                headers={"Authorization": f"Bearer {ADMIN}"})
        [shown] = json.loads(await answer.content())["downloads"]
        assert shown["received"] == len(WEIGHTS) // 2 and shown["replica"] == "replica-a"
        assert not os.path.exists(os.path.join(cluster.models_dir, "dl", "weights.bin"))

        files.release.callback(None)
        one, two = await first, await second
    finally:
        globalLogPublisher.removeObserver(observe)
    assert (one.value.message, two.value.message) == (b"one", b"two")
    assert files.gets == [b"/held/weights.bin"]  # one download for both requests
    assert leftovers(cluster.models_dir) == ["dl/weights.bin"]
    with open(os.path.join(cluster.models_dir, "dl", "weights.bin"), "rb") as f:
        assert f.read() == WEIGHTS
    [(_, _, _, _, loaded)] = await cluster.rows("dl")
    assert loaded.startswith(worker.data_dir) and loaded.endswith("/dl/weights.bin")
    assert any(f"/{len(WEIGHTS)} bytes" in line for line in lines), lines
    assert any(line.startswith("downloaded dl/weights.bin") for line in lines), lines
    assert downloads.in_progress() == []

    # present and verified: the next load downloads nothing
    await router.unload("dl", worker.node_id)
    await router.predict("dl", backend_pb2.PredictOptions(Prompt="three"))
    assert files.gets == [b"/held/weights.bin"]


@pytest_twisted.ensureDeferred
async def test_a_digest_mismatch_names_the_file_and_both_digests_and_keeps_nothing(
        cluster, files):
    files.files["weights.bin"] = WEIGHTS
    wrong = "ab" * 32
    cluster.write_model("dl.yaml", download_model(f"{files.base}/files/weights.bin", wrong))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    with pytest.raises(ModelFileMismatch) as caught:
        await frontend.replica.inference.predict("dl", backend_pb2.PredictOptions(Prompt="x"))
    text = str(caught.value)
    assert "dl/weights.bin" in text and sha256_hex(WEIGHTS) in text and wrong in text
    assert not isinstance(caught.value, ModelDownloadFailed)
    assert leftovers(cluster.models_dir) == []
    assert await cluster.rows("dl") == []

    # and the API names it too
    answer = await treq.post(cluster.base_url(frontend) + "/v1/completions",
                             json={"model": "dl", "prompt": "x"},
                             headers={"Authorization": f"Bearer {ADMIN}"})
    body = json.loads(await answer.content())
    assert answer.code == 500 and body["error"]["code"] == "model_file_mismatch"
    assert wrong in body["error"]["message"] and "dl/weights.bin" in body["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_an_interrupted_download_keeps_nothing_and_the_next_request_retries(
        cluster, files):
    files.files["weights.bin"] = WEIGHTS
    cluster.write_model("dl.yaml", download_model(f"{files.base}/broken/weights.bin",
                                                  sha256_hex(WEIGHTS)))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    router = frontend.replica.inference
    with pytest.raises(ModelDownloadFailed, match=r"connection broke after \d+ of 1048576"):
        await router.predict("dl", backend_pb2.PredictOptions(Prompt="x"))
    assert leftovers(cluster.models_dir) == []
    answer = await treq.post(cluster.base_url(frontend) + "/v1/completions",
                             json={"model": "dl", "prompt": "x"},
                             headers={"Authorization": f"Bearer {ADMIN}"})
    body = json.loads(await answer.content())
    assert answer.code == 502 and body["error"]["code"] == "model_download_failed"
    assert leftovers(cluster.models_dir) == []

    # the server is fixed (a redirect to the whole file): the next request downloads it
    cluster.write_model("dl.yaml", download_model(f"{files.base}/redirect/weights.bin",
                                                  sha256_hex(WEIGHTS)))
    router.catalog.refresh()
    served = await router.predict("dl", backend_pb2.PredictOptions(Prompt="fixed"))
    assert served.value.message == b"fixed"
    assert leftovers(cluster.models_dir) == ["dl/weights.bin"]
    assert files.gets[-2:] == [b"/redirect/weights.bin", b"/files/weights.bin"]


@pytest_twisted.ensureDeferred
async def test_a_url_model_and_a_file_url_and_an_http_error(cluster, files, tmp_path):
    files.files["tiny.gguf"] = WEIGHTS
    source = tmp_path / "local-copy.bin"
    source.write_bytes(WEIGHTS[:1000])
    cluster.write_model("url.yaml", f"name: url\nbackend: echo\nparameters:\n"
                                    f"  model: {files.base}/files/tiny.gguf\n")
    cluster.write_model("local.yaml", download_model(f"file://{source}",
                                                     sha256_hex(WEIGHTS[:1000]),
                                                     name="local", filename="copied.bin"))
    cluster.write_model("missing.yaml", download_model(f"{files.base}/files/absent.bin", None,
                                                       name="missing", filename="absent.bin"))
    frontend = await cluster.frontend("replica-a")
    worker = await cluster.worker("w1", frontend)
    router = frontend.replica.inference

    served = await router.predict("url", backend_pb2.PredictOptions(Prompt="u"))
    assert served.value.message == b"u"
    [(_, _, _, _, loaded)] = await cluster.rows("url")  # the URL's file name, staged
    assert loaded.startswith(worker.data_dir) and loaded.endswith("/url/tiny.gguf")

    await router.predict("local", backend_pb2.PredictOptions(Prompt="l"))
    with open(os.path.join(cluster.models_dir, "copied.bin"), "rb") as f:
        assert f.read() == WEIGHTS[:1000]

    with pytest.raises(ModelDownloadFailed, match="failed; the frontend.s log says why"):
        await router.predict("missing", backend_pb2.PredictOptions(Prompt="m"))
    assert sorted(leftovers(cluster.models_dir)) == ["copied.bin", "tiny.gguf"]


@pytest_twisted.ensureDeferred
async def test_a_replica_that_stops_abandons_its_download_and_keeps_nothing(cluster, files):
    files.files["weights.bin"] = WEIGHTS
    cluster.write_model("dl.yaml", download_model(f"{files.base}/held/weights.bin",
                                                  sha256_hex(WEIGHTS)))
    frontend = await cluster.frontend("replica-a")
    router = frontend.replica.inference
    asked = router.predict("dl", backend_pb2.PredictOptions(Prompt="x"))
    await eventually(lambda: router.loader.downloads.in_progress() and
                     router.loader.downloads.in_progress()[0]["received"] > 0,
                     timeout=30, what="the download under way")
    await frontend.stopService()
    with pytest.raises(ModelDownloadFailed, match="the replica is stopping"):
        await within(asked, 20)
    assert leftovers(cluster.models_dir) == []


@pytest_twisted.ensureDeferred
async def test_a_streamed_request_is_told_how_the_download_goes(cluster, files):
    files.files["weights.bin"] = WEIGHTS
    cluster.write_model("dl.yaml", download_model(f"{files.base}/held/weights.bin",
                                                  sha256_hex(WEIGHTS)))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    answer = await treq.post(cluster.base_url(frontend) + "/v1/completions",
                             json={"model": "dl", "prompt": "a b", "stream": True},
                             headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.code == 200  # the stream starts while the request waits (after ~3 s)
    received: list[bytes] = []
    collected = treq.collect(answer, received.append)
    await eventually(lambda: b"downloading dl/weights.bin 0.5 MiB/1.0 MiB" in b"".join(received),
                     timeout=20, what="a loading comment naming the download")
    assert b": loading model dl (" in b"".join(received)
    files.release.callback(None)
    await collected
    text = b"".join(received)
    assert b'"finish_reason":"stop"' in text and text.endswith(b"data: [DONE]\n\n")


@pytest_twisted.ensureDeferred
async def test_a_directory_in_the_way_of_a_download_is_named(cluster, files):
    files.files["weights.bin"] = WEIGHTS
    os.makedirs(os.path.join(cluster.models_dir, "dl", "weights.bin", "inside"))
    cluster.write_model("dl.yaml", download_model(f"{files.base}/files/weights.bin", None))
    frontend = await cluster.frontend("replica-a")
    with pytest.raises(ModelDownloadFailed, match="dl/weights.bin cannot be written"):
        await frontend.replica.inference.predict("dl", backend_pb2.PredictOptions(Prompt="x"))
    assert [n for n in os.listdir(os.path.join(cluster.models_dir, "dl"))] == ["weights.bin"]


@pytest_twisted.ensureDeferred
async def test_one_file_two_models_download_under_two_names_is_fetched_once(cluster, files):
    """issue 26 §4: a second model's download of a file the models directory already holds
    (same sha256, another name) is linked from the content store, not fetched again."""
    files.files["weights.bin"] = WEIGHTS
    digest = sha256_hex(WEIGHTS)
    for name in ("first", "second"):
        cluster.write_model(f"{name}.yaml", download_model(
            f"{files.base}/files/weights.bin", digest, name=name,
            filename=f"{name}/weights.bin"))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    router = frontend.replica.inference
    for name in ("first", "second"):
        served = await router.predict(name, backend_pb2.PredictOptions(Prompt="hi"))
        assert served.value.message == b"hi"
    assert files.gets == [b"/files/weights.bin"]
    models = cluster.models_dir
    assert os.path.samefile(os.path.join(models, "first", "weights.bin"),
                            os.path.join(models, "second", "weights.bin"))
