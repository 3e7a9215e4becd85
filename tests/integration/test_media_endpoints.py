"""Speech, transcription and images end to end on a real cluster in one process: two
``FrontendService`` replicas on one database, a real worker (tunnel, supervisor, staging,
scratch) registered with the first, and every request sent to the second, which relays it.
Real backends: ``espeak-ng`` (Debian's program), ``pocketsphinx`` (its PyPI wheel and model),
``hash-image`` (the deterministic test backend).

Skipped locally when espeak-ng or pocketsphinx is missing, failed with ``CI=true``
(``.ci/install-media-deps`` installs both)."""

from __future__ import annotations

import base64
import json
import struct
import time
import urllib.error
import urllib.request

import pytest
import pytest_twisted
from twisted.internet import threads

from .harness_media import (
    MODELS,
    SENTENCE,
    multipart,
    post as _post,
    post_json as _post_json,
    relaying_cluster as _relaying_cluster,
    require_media,
    scratch_dirs as _scratch_dirs,
)
from .inference_harness import ADMIN

@pytest_twisted.ensureDeferred
async def test_speak_then_transcribe_through_a_relaying_replica(cluster):
    """The key round trip: /v1/audio/speech (espeak-ng) then /v1/audio/transcriptions
    (pocketsphinx), both sent to the replica that does not hold the worker's tunnel."""
    require_media()
    owner, relay, worker = await _relaying_cluster(cluster)
    base = cluster.base_url(relay)

    started = time.monotonic()
    status, headers, wav = await threads.deferToThread(
        _post_json, base + "/v1/audio/speech", {"model": "speaker", "input": SENTENCE})
    spoke = time.monotonic() - started
    assert status == 200, wav[:500]
    assert headers["Content-Type"] == "audio/wav"
    assert headers["X-LocalAI-Node"] == "w-media"
    assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE"
    rate = struct.unpack("<I", wav[24:28])[0]
    assert rate == 22050 and len(wav) > rate  # some speech, not an empty file

    body, content_type = multipart({"model": "listener", "response_format": "verbose_json",
                                    "timestamp_granularities[]": ["word", "segment"]},
                                   ("speech.wav", wav, "audio/wav"))
    started = time.monotonic()
    status, headers, raw = await threads.deferToThread(
        _post, base + "/v1/audio/transcriptions", body, content_type)
    listened = time.monotonic() - started
    assert status == 200, raw[:500]
    answer = json.loads(raw)
    heard = answer["text"]
    print(f"espeak-ng said {SENTENCE!r}; pocketsphinx heard {heard!r} (first requests, cold "
          f"loads included: speech {spoke:.2f} s, transcription {listened:.2f} s)")
    said = SENTENCE.split()
    recognized = [w for w in said if w in heard.split()]
    assert len(recognized) >= 3, f"heard {heard!r}"
    assert answer["language"] == "en" and 1.0 < answer["duration"] < 10.0
    assert answer["segments"] and answer["words"]
    assert all(0 <= w["start"] < w["end"] <= answer["duration"] + 0.5 for w in answer["words"])
    assert headers["X-LocalAI-Node"] == "w-media"
    # LocalAI's /tts answers the same WAV for the same request (deterministic synthesis).
    status, _, again = await threads.deferToThread(
        _post_json, base + "/tts", {"model": "speaker", "input": SENTENCE})
    assert status == 200 and again == wav
    # And through the replica that holds the tunnel (no relay): the same bytes.
    status, _, owned = await threads.deferToThread(
        _post_json, cluster.base_url(owner) + "/v1/audio/speech",
        {"model": "speaker", "input": SENTENCE})
    assert status == 200 and owned == wav
    # Every request removed its scratch directory on the worker.
    assert _scratch_dirs(worker) == []


@pytest_twisted.ensureDeferred
async def test_transcription_formats_and_bad_uploads(cluster):
    require_media()
    owner, relay, worker = await _relaying_cluster(cluster)
    base = cluster.base_url(relay)
    status, _, wav = await threads.deferToThread(
        _post_json, base + "/v1/audio/speech", {"model": "speaker", "input": SENTENCE})
    assert status == 200
    url = base + "/v1/audio/transcriptions"

    async def transcribe(fields, file=("a.wav", wav, "audio/wav"), **kw):
        body, content_type = multipart(fields, file, **kw)
        return await threads.deferToThread(_post, url, body, content_type)

    status, headers, raw = await transcribe({"model": "listener"})
    assert status == 200 and list(json.loads(raw)) == ["text"]
    text = json.loads(raw)["text"]
    status, headers, raw = await transcribe({"model": "listener", "response_format": "text"})
    assert status == 200 and raw.decode() == text + "\n"
    assert headers["Content-Type"].startswith("text/plain")
    status, _, raw = await transcribe({"model": "listener", "response_format": "srt"})
    assert status == 200 and raw.decode().startswith("1\n00:00:0")
    assert " --> " in raw.decode()
    status, headers, raw = await transcribe({"model": "listener", "response_format": "vtt"})
    assert status == 200 and raw.decode().startswith("WEBVTT\n\n00:00:0")
    assert headers["Content-Type"].startswith("text/vtt")
    # No model: the first configured transcription model, as LocalAI picks.
    status, _, raw = await transcribe({})
    assert status == 200 and json.loads(raw)["text"] == text
    # LocalAI's unprefixed path answers the same (and is spooled and capped the same).
    body, content_type = multipart({"model": "listener"}, ("a.wav", wav, "audio/wav"))
    status, _, raw = await threads.deferToThread(
        _post, base + "/audio/transcriptions", body, content_type)
    assert status == 200 and json.loads(raw)["text"] == text

    def error_of(raw):
        return json.loads(raw)["error"]

    # The backend refuses what it cannot honour (it was reached: a 400 in its words).
    status, _, raw = await transcribe({"model": "listener", "language": "de"})
    assert status == 400 and "English only" in error_of(raw)["message"]
    # Refused before any backend: unknown format, missing file, wrong multipart, bad fields.
    before = await cluster.rows("listener")
    status, _, raw = await transcribe({"model": "listener"},
                                      ("a.txt", b"hello, this is not audio", "text/plain"))
    assert status == 400 and error_of(raw)["code"] == "unsupported_audio_format"
    status, _, raw = await transcribe({"model": "listener"}, None)
    assert status == 400 and error_of(raw)["param"] == "file"
    assert "no 'file' part" in error_of(raw)["message"]
    status, _, raw = await transcribe({"model": "listener"}, file_field="audio")
    assert status == 400 and error_of(raw)["param"] == "file"
    status, _, raw = await threads.deferToThread(
        _post, url, b'{"model": "listener"}', "application/json")
    assert status == 400 and error_of(raw)["code"] == "invalid_multipart"
    assert "multipart/form-data" in error_of(raw)["message"]
    body, content_type = multipart({"model": "listener"}, ("a.wav", wav, "audio/wav"))
    status, _, raw = await threads.deferToThread(_post, url, body[:-40], content_type)
    assert status == 400 and "closing boundary" in error_of(raw)["message"]
    status, _, raw = await transcribe({"model": "listener", "response_format": "mp4"})
    assert status == 400 and error_of(raw)["param"] == "response_format"
    status, _, raw = await transcribe({"model": "listener", "stream": "true"})
    assert status == 400 and error_of(raw)["param"] == "stream"
    status, _, raw = await transcribe({"model": "listener", "include[]": "logprobs"})
    assert status == 400 and error_of(raw)["param"] == "include"
    status, _, raw = await transcribe({"model": "listener", "chunking_strategy": "{}"})
    assert status == 400 and error_of(raw)["param"] == "chunking_strategy"
    # A model that does not transcribe is still asked (LocalAI's rule): its backend answers.
    status, _, raw = await transcribe({"model": "speaker"})
    assert status == 501 and error_of(raw)["code"] == "not_implemented_by_backend"
    assert await cluster.rows("listener") == before
    assert _scratch_dirs(worker) == []


@pytest_twisted.ensureDeferred
async def test_oversized_upload_is_refused_before_its_body(cluster):
    """A Content-Length over the limit is answered 413 naming the limit, before one body byte
    is read (the client sends only the headers)."""
    import socket

    from localai_tw.frontend.api.openai.transcription import TRANSCRIPTION_MAX_UPLOAD_BYTES

    for filename, text in MODELS.items():
        cluster.write_model(filename, text)
    relay = await cluster.frontend("replica-alone")
    port = relay.listener.tcp_port()

    def send_headers_only():
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall((f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                       f"Authorization: Bearer {ADMIN}\r\n"
                       "Content-Type: multipart/form-data; boundary=xyz\r\n"
                       f"Content-Length: {TRANSCRIPTION_MAX_UPLOAD_BYTES + 1}\r\n\r\n").encode())
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return data
                data += chunk

    answer = await threads.deferToThread(send_headers_only)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert str(TRANSCRIPTION_MAX_UPLOAD_BYTES).encode() in body
    assert relay.site.body_bytes_in_flight == 0


@pytest_twisted.ensureDeferred
async def test_speech_refusals_reach_no_backend(cluster):
    require_media()
    owner, relay, worker = await _relaying_cluster(cluster)
    url = cluster.base_url(relay) + "/v1/audio/speech"
    cases = [
        ({"model": "speaker", "input": ""}, "input"),
        ({"model": "speaker", "input": "   "}, "input"),
        ({"model": "speaker"}, "input"),
        ({"model": "speaker", "input": "hi", "response_format": "ogg"}, "response_format"),
        ({"model": "speaker", "input": "hi", "response_format": "ogg-ish"}, "response_format"),
        ({"model": "speaker", "input": "hi", "stream": True}, "stream"),
        ({"model": "speaker", "input": "hi", "speed": 9}, "speed"),
        ({"model": "speaker", "input": "hi", "sample_rate": 16000}, "sample_rate"),
        ({"model": "speaker", "input": "hi", "stream_format": "sse"}, "stream_format"),
        ({"model": "speaker", "input": "x" * 4097}, "input"),
    ]
    for body, param in cases:
        status, _, raw = await threads.deferToThread(_post_json, url, body)
        assert status == 400, (body, raw)
        assert json.loads(raw)["error"]["param"] == param, (body, raw)
    for path in ("/tts", "/v1/audio/speech"):  # the API keys guard LocalAI's /tts too
        status, _, raw = await threads.deferToThread(
            _post, cluster.base_url(relay) + path, b'{"model": "speaker", "input": "hi"}',
            "application/json", key=None)
        assert status == 401, (path, raw)
    assert await cluster.rows() == []  # nothing was loaded anywhere
    # An image model asked to speak is asked (LocalAI's rule): its backend answers it cannot.
    status, _, raw = await threads.deferToThread(_post_json, url,
                                                 {"model": "painter", "input": "hi"})
    assert status == 501 and json.loads(raw)["error"]["code"] == "not_implemented_by_backend"
    # The backend's own refusal (reached): an unknown voice, with valid ones named.
    status, _, raw = await threads.deferToThread(
        _post_json, url, {"model": "speaker", "input": "hi", "voice": "klingon-x"})
    assert status == 400 and "en-us" in json.loads(raw)["error"]["message"]
    # OpenAI's voice names are the model's default voice.
    status, headers, wav = await threads.deferToThread(
        _post_json, url, {"model": "speaker", "input": "hi", "voice": "alloy", "speed": 1.5})
    assert status == 200 and wav[:4] == b"RIFF"
    assert _scratch_dirs(worker) == []


@pytest_twisted.ensureDeferred
async def test_images_b64_and_url_served_by_every_replica(cluster):
    owner, relay, worker = await _relaying_cluster(cluster)
    url = cluster.base_url(relay) + "/v1/images/generations"
    status, headers, raw = await threads.deferToThread(_post_json, url, {
        "model": "painter", "prompt": "a red square", "size": "32x16", "n": 2,
        "response_format": "b64_json", "seed": 7})
    assert status == 200, raw
    data = json.loads(raw)["data"]
    pngs = [base64.b64decode(item["b64_json"]) for item in data]
    assert all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    assert struct.unpack(">II", pngs[0][16:24]) == (32, 16)
    assert pngs[0] != pngs[1]  # n images are n pictures (seed, seed + 1)
    assert headers["X-LocalAI-Node"] == "w-media"
    status, _, raw = await threads.deferToThread(_post_json, url, {
        "model": "painter", "prompt": "a red square", "size": "32x16", "n": 1,
        "response_format": "b64_json", "seed": 7})
    assert base64.b64decode(json.loads(raw)["data"][0]["b64_json"]) == pngs[0]  # deterministic

    status, _, raw = await threads.deferToThread(_post_json, url, {
        "model": "painter", "prompt": "a red square", "size": "32x16", "seed": 7})
    assert status == 200, raw
    image_url = json.loads(raw)["data"][0]["url"]
    relay_port, owner_port = relay.listener.tcp_port(), owner.listener.tcp_port()
    assert image_url.startswith(f"http://127.0.0.1:{relay_port}/generated-images/")
    # Served by the other replica too (the store is the shared database), with no API key.
    other = image_url.replace(f":{relay_port}/", f":{owner_port}/")

    def fetch(u):
        try:
            with urllib.request.urlopen(u, timeout=30) as response:
                return response.status, response.headers["Content-Type"], response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers["Content-Type"], e.read()

    assert await threads.deferToThread(fetch, other) == (200, "image/png", pngs[0])
    status, _, _ = await threads.deferToThread(
        fetch, other.rsplit("/", 1)[0] + "/" + "0" * 32 + ".png")
    assert status == 404
    status, _, _ = await threads.deferToThread(fetch, other + "/../../etc/passwd")
    assert status == 404
    assert _scratch_dirs(worker) == []


@pytest_twisted.ensureDeferred
async def test_image_refusals_reach_no_backend(cluster):
    owner, relay, worker = await _relaying_cluster(cluster)
    url = cluster.base_url(relay) + "/v1/images/generations"
    cases = [
        ({"model": "painter"}, "prompt"),
        ({"model": "painter", "prompt": ""}, "prompt"),
        ({"model": "painter", "prompt": " |blurry"}, "prompt"),
        ({"model": "painter", "prompt": "x", "n": 0}, "n"),
        ({"model": "painter", "prompt": "x", "n": 11}, "n"),
        ({"model": "painter", "prompt": "x", "n": "two"}, "n"),
        ({"model": "painter", "prompt": "x", "size": "big"}, "size"),
        ({"model": "painter", "prompt": "x", "size": "0x10"}, "size"),
        ({"model": "painter", "prompt": "x", "size": "4096x4096"}, "size"),
        ({"model": "painter", "prompt": "x", "size": "-5x10"}, "size"),
        ({"model": "painter", "prompt": "x", "response_format": "jpeg"}, "response_format"),
        ({"model": "painter", "prompt": "x", "style": "vivid"}, "style"),
        ({"model": "painter", "prompt": "x", "quality": "hd"}, "quality"),
    ]
    for body, param in cases:
        status, _, raw = await threads.deferToThread(_post_json, url, body)
        assert status == 400, (body, raw)
        assert json.loads(raw)["error"]["param"] == param, (body, raw)
    assert await cluster.rows() == []  # no model was loaded, no backend called
    # A speech model asked for an image is asked (LocalAI's rule): its backend answers.
    status, _, raw = await threads.deferToThread(_post_json, url,
                                                 {"model": "speaker", "prompt": "x"})
    assert status == 501 and json.loads(raw)["error"]["code"] == "not_implemented_by_backend"


@pytest_twisted.ensureDeferred
async def test_the_official_openai_client_through_a_relaying_replica(cluster):
    """openai-python's audio.speech, audio.transcriptions and images calls, as a user makes
    them (its default fields), against the relaying replica."""
    require_media()
    openai = pytest.importorskip("openai")
    owner, relay, worker = await _relaying_cluster(cluster)
    client = openai.OpenAI(base_url=cluster.base_url(relay) + "/v1", api_key=ADMIN,
                           max_retries=0, timeout=120)

    def use_the_api():
        wav = client.audio.speech.create(model="speaker", voice="alloy", input=SENTENCE,
                                         response_format="wav").read()
        heard = client.audio.transcriptions.create(
            model="listener", file=("speech.wav", wav, "audio/wav")).text
        srt = client.audio.transcriptions.create(
            model="listener", file=("speech.wav", wav, "audio/wav"), response_format="srt")
        image = client.images.generate(model="painter", prompt="a boat", size="64x64",
                                       response_format="b64_json", n=1)
        # No response_format: the client sends none, and the answer is WAV (LocalAI's default).
        default = client.audio.speech.create(model="speaker", voice="alloy", input="hi").read()
        try:
            client.audio.speech.create(model="speaker", voice="alloy", input="hi",
                                       response_format="ogg")  # opus is OpenAI's name
            refused = None
        except openai.BadRequestError as e:
            refused = e
        return wav, heard, srt, image, default, refused

    wav, heard, srt, image, default, refused = await threads.deferToThread(use_the_api)
    assert wav[:4] == b"RIFF"
    assert len([w for w in SENTENCE.split() if w in heard.split()]) >= 3, heard
    assert " --> " in srt
    assert base64.b64decode(image.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"
    assert default[:4] == b"RIFF"
    assert refused is not None and refused.body["param"] == "response_format"
