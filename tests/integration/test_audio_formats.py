"""Audio formats users ask for and send (issue 22 §6), end to end on a real cluster: two
replicas on one database, a real worker registered with the first, every request sent to the
second (relayed), real ``espeak-ng`` and ``pocketsphinx`` backends, and Debian's ffmpeg run by
the worker (``scratch.convert``).  ffprobe says what the bytes are.

Skipped locally when espeak-ng, pocketsphinx or ffmpeg is missing, failed with ``CI=true``
(``.ci/install-media-deps`` installs them)."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import tempfile
import time
from urllib.parse import urlsplit

import pytest
import pytest_twisted
from twisted.internet import threads

from .harness_media import (
    SENTENCE,
    multipart,
    post as _post,
    post_json as _post_json,
    relaying_cluster as _relaying_cluster,
    require_media,
    scratch_dirs as _scratch_dirs,
)
from .inference_harness import ADMIN
from .support import eventually

#: Each ``response_format``: its content type and what ffprobe names the container.
FORMATS = {"mp3": ("audio/mpeg", "mp3"), "opus": ("audio/ogg", "ogg"),
           "aac": ("audio/aac", "aac"), "flac": ("audio/flac", "flac"),
           "wav": ("audio/wav", "wav")}


def probe(data: bytes) -> dict:
    """ffprobe's container name and first audio stream of ``data``."""
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(data)
        f.flush()
        out = subprocess.run(["ffprobe", "-v", "error", "-print_format", "json",
                              "-show_format", "-show_streams", f.name],
                             capture_output=True, check=True, timeout=60).stdout
    found = json.loads(out)
    return {"format": found["format"]["format_name"], "codec": found["streams"][0]["codec_name"],
            "rate": int(found["streams"][0]["sample_rate"]),
            "duration": float(found["format"].get("duration") or 0)}


def encode(wav: bytes, *args: str) -> bytes:
    """``wav`` encoded by ffmpeg (the test's own, as a user makes an upload; to a file, so
    that a WAV header has its sizes)."""
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "out")
        subprocess.run(["ffmpeg", "-v", "error", "-i", "pipe:0", *args, out], input=wav,
                       capture_output=True, check=True, timeout=60)
        with open(out, "rb") as f:
            return f.read()


def _wav_seconds(wav: bytes) -> float:
    rate = struct.unpack("<I", wav[24:28])[0]
    return (len(wav) - 44) / 2 / rate


@pytest_twisted.ensureDeferred
async def test_speech_in_every_format(cluster):
    require_media()
    owner, relay, worker = await _relaying_cluster(cluster)
    url = cluster.base_url(relay) + "/v1/audio/speech"
    status, _, wav = await threads.deferToThread(
        _post_json, url, {"model": "speaker", "input": SENTENCE})
    assert status == 200
    seconds = _wav_seconds(wav)
    for response_format, (content_type, container) in FORMATS.items():
        status, headers, data = await threads.deferToThread(
            _post_json, url, {"model": "speaker", "input": SENTENCE,
                              "response_format": response_format})
        assert status == 200, (response_format, data[:300])
        assert headers["Content-Type"] == content_type
        found = await threads.deferToThread(probe, data)
        assert container in found["format"].split(","), (response_format, found)
        if response_format == "opus":
            assert found["codec"] == "opus"
        assert abs(found["duration"] - seconds) < 0.2, (response_format, found, seconds)
    # pcm: OpenAI's raw 16-bit little-endian 24 kHz mono, no header: its length is the time.
    status, headers, pcm = await threads.deferToThread(
        _post_json, url, {"model": "speaker", "input": SENTENCE, "response_format": "pcm"})
    assert status == 200 and headers["Content-Type"] == "audio/pcm"
    assert pcm[:4] != b"RIFF" and abs(len(pcm) / 2 / 24000 - seconds) < 0.05
    assert _scratch_dirs(worker) == []


@pytest_twisted.ensureDeferred
async def test_the_openai_client_speaks_mp3_and_transcribes_it(cluster):
    """What every SDK example does: speech as mp3, then that mp3 uploaded for transcription,
    with openai-python.  The mp3 is heard exactly as the 16 kHz mono WAV decoded from it (the
    samples the backend must be given); against espeak-ng's 22 kHz WAV, pocketsphinx may hear
    a word differently (lossy coding), so there the bar is three words of five."""
    require_media()
    openai = pytest.importorskip("openai")
    owner, relay, worker = await _relaying_cluster(cluster)
    client = openai.OpenAI(base_url=cluster.base_url(relay) + "/v1", api_key=ADMIN,
                           max_retries=0, timeout=120)

    def use_the_api():
        mp3 = client.audio.speech.create(model="speaker", voice="alloy", input=SENTENCE,
                                         response_format="mp3").read()
        wav = client.audio.speech.create(model="speaker", voice="alloy", input=SENTENCE,
                                         response_format="wav").read()
        from_mp3 = client.audio.transcriptions.create(
            model="listener", file=("speech.mp3", mp3, "audio/mpeg")).text
        from_wav = client.audio.transcriptions.create(
            model="listener", file=("speech.wav", wav, "audio/wav")).text
        decoded = encode(mp3, "-ar", "16000", "-ac", "1", "-c:a", "pcm_s16le", "-f", "wav")
        from_decoded = client.audio.transcriptions.create(
            model="listener", file=("decoded.wav", decoded, "audio/wav")).text
        return mp3, from_mp3, from_wav, from_decoded

    mp3, from_mp3, from_wav, from_decoded = await threads.deferToThread(use_the_api)
    assert (await threads.deferToThread(probe, mp3))["format"] == "mp3"
    print(f"pocketsphinx heard {from_wav!r} from the WAV, {from_mp3!r} from the MP3")
    assert from_mp3 == from_decoded
    for text in (from_wav, from_mp3):
        assert len([w for w in SENTENCE.split() if w in text.split()]) >= 3, text


@pytest_twisted.ensureDeferred
async def test_uploads_in_the_formats_ffmpeg_reads(cluster):
    """mp3 (as the test's own ffmpeg makes from espeak-ng's WAV), ogg/opus, flac, m4a, aac,
    webm: each converted on the worker to 16 kHz mono WAV and heard."""
    require_media()
    owner, relay, worker = await _relaying_cluster(cluster)
    base = cluster.base_url(relay)
    status, _, wav = await threads.deferToThread(
        _post_json, base + "/v1/audio/speech", {"model": "speaker", "input": SENTENCE})
    assert status == 200
    uploads = {
        "speech.mp3": ("-f", "mp3"),
        "speech.ogg": ("-c:a", "libopus", "-f", "ogg"),
        "speech.flac": ("-f", "flac"),
        "speech.m4a": ("-c:a", "aac", "-movflags", "frag_keyframe+empty_moov", "-f", "mp4"),
        "speech.aac": ("-c:a", "aac", "-f", "adts"),
        "speech.webm": ("-c:a", "libopus", "-f", "webm"),
    }

    async def heard(name, data):
        body, content_type = multipart({"model": "listener", "response_format": "text"},
                                       (name, data, "application/octet-stream"))
        status, _, raw = await threads.deferToThread(
            _post, base + "/v1/audio/transcriptions", body, content_type)
        assert status == 200, (name, raw[:500])
        return raw.decode().strip()

    from_wav = await heard("speech.wav", wav)
    for name, args in uploads.items():
        data = await threads.deferToThread(encode, wav, *args)
        text = await heard(name, data)
        recognized = [w for w in SENTENCE.split() if w in text.split()]
        assert len(recognized) >= 3, (name, text, from_wav)
    # A file that starts like an mp3 and is not one: ffmpeg cannot read it, a 400 naming it.
    body, content_type = multipart({"model": "listener"},
                                   ("bad.mp3", b"ID3\x04\x00" + os.urandom(4000), "audio/mpeg"))
    status, _, raw = await threads.deferToThread(
        _post, base + "/v1/audio/transcriptions", body, content_type)
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "unsupported_audio_format", raw
    assert error["param"] == "file" and "ffmpeg" in error["message"]
    assert _scratch_dirs(worker) == []


@pytest_twisted.ensureDeferred
async def test_a_worker_without_ffmpeg_answers_a_clear_400(cluster, tmp_path):
    require_media()
    owner, relay, worker = await _relaying_cluster(cluster)
    base = cluster.base_url(relay)
    worker.converter.search_path = str(tmp_path)  # the worker's PATH, without ffmpeg
    status, _, raw = await threads.deferToThread(
        _post_json, base + "/v1/audio/speech",
        {"model": "speaker", "input": SENTENCE, "response_format": "mp3"})
    error = json.loads(raw)["error"]
    assert status == 400, raw
    assert error["code"] == "ffmpeg_not_installed" and error["param"] == "response_format"
    assert "ffmpeg is not installed on worker w-media" in error["message"]
    assert "apt-get install ffmpeg" in error["message"]
    # WAV needs no ffmpeg: still served.
    status, _, wav = await threads.deferToThread(
        _post_json, base + "/v1/audio/speech", {"model": "speaker", "input": SENTENCE})
    assert status == 200 and wav[:4] == b"RIFF"
    mp3 = await threads.deferToThread(encode, wav, "-f", "mp3")
    body, content_type = multipart({"model": "listener"}, ("speech.mp3", mp3, "audio/mpeg"))
    status, _, raw = await threads.deferToThread(
        _post, base + "/v1/audio/transcriptions", body, content_type)
    error = json.loads(raw)["error"]
    assert status == 400, raw
    assert error["code"] == "ffmpeg_not_installed" and error["param"] == "file"
    assert "ffmpeg is not installed on worker w-media" in error["message"]
    assert _scratch_dirs(worker) == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _post_and_leave(url: str, body: dict, pid_file: str) -> None:
    """Send the request, wait until the worker's converter runs, then hang up."""
    where = urlsplit(url)
    raw = json.dumps(body).encode()
    with socket.create_connection((where.hostname, where.port), timeout=30) as s:
        s.sendall(f"POST {where.path} HTTP/1.1\r\nHost: {where.netloc}\r\n"
                  f"Authorization: Bearer {ADMIN}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        until = time.monotonic() + 60
        while not (os.path.exists(pid_file) and open(pid_file).read().strip()):
            assert time.monotonic() < until, "the converter never ran"
            time.sleep(0.05)


@pytest_twisted.ensureDeferred
async def test_a_client_that_leaves_kills_the_conversion_on_the_worker(cluster, tmp_path):
    """The client hangs up while ffmpeg runs (a stand-in that would run a minute): the
    replica cancels, the relay and the tunnel carry it, the worker kills the process."""
    require_media()
    owner, relay, worker = await _relaying_cluster(cluster)
    pid_file = tmp_path / "pid"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ffmpeg").write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    (bin_dir / "ffmpeg").chmod(0o755)
    worker.converter.search_path = str(bin_dir)
    await threads.deferToThread(
        _post_and_leave, cluster.base_url(relay) + "/v1/audio/speech",
        {"model": "speaker", "input": SENTENCE, "response_format": "mp3"}, str(pid_file))
    pid = int(pid_file.read_text())
    await eventually(lambda: not _alive(pid), timeout=20, what="ffmpeg killed")
    await eventually(lambda: worker.converter.running == 0 and not _scratch_dirs(worker),
                     timeout=20, what="the conversion and its scratch directory gone")
