"""``scratch.convert`` (localai_tw/worker/audioconvert.py) with real processes: Debian's ffmpeg
where the conversion is real, small shell scripts named ``ffmpeg`` where the test needs an
ffmpeg that hangs or shouts (the converter finds it on its search path, as on a worker's PATH).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import pytest_twisted
from twisted.internet import defer, reactor

from localai_tw.worker.audioconvert import MAX_STDERR, AudioConverter
from localai_tw.worker.control import BadVerbRequest, NoFreeSlot

from tests.integration.support import eventually

SCRATCH_ID = "ab" * 16


@pytest.fixture
def area(tmp_path):
    root = tmp_path / "scratch"
    (root / SCRATCH_ID).mkdir(parents=True)
    return root


def _wav(path) -> None:
    subprocess.run(["espeak-ng", "-w", str(path), "one two three"], check=True, timeout=30)


def _fake_ffmpeg(directory, script: str) -> str:
    directory.mkdir(exist_ok=True)
    program = directory / "ffmpeg"
    program.write_text("#!/bin/sh\n" + script)
    program.chmod(0o755)
    return str(directory)


def _body(**over) -> dict:
    return {"id": SCRATCH_ID, "src": "speech.wav", "dst": "speech.mp3", "format": "mp3",
            "max_bytes": 1 << 20, "timeout": 30, **over}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(")")[-1].split()[0] != "Z"


def _needs(*programs):
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (.ci/install-media-deps)")


@pytest_twisted.ensureDeferred
async def test_real_ffmpeg_converts_and_bounds_the_output(area):
    _needs("ffmpeg", "espeak-ng")
    _wav(area / SCRATCH_ID / "speech.wav")
    converter = AudioConverter(str(area), reactor, "w-test")
    reply = await converter.convert(_body())
    assert reply["ok"] is True and reply["bytes"] > 1000
    with open(area / SCRATCH_ID / "speech.mp3", "rb") as f:
        assert f.read(3) == b"ID3"
    reply = await converter.convert(_body(dst="small.mp3", max_bytes=2000))
    assert reply == {"ok": False, "reason": "too-large",
                     "message": "the converted audio passed 2000 bytes"}
    # Not audio at all: ffmpeg's own words, bounded.
    (area / SCRATCH_ID / "junk.mp3").write_bytes(b"ID3" + b"\x00" * 10 + os.urandom(3000))
    reply = await converter.convert(_body(src="junk.mp3", dst="out.wav", format="wav16k",
                                          input_format="mp3"))
    assert reply["ok"] is False and reply["reason"] == "failed"
    assert reply["message"].startswith("ffmpeg could not convert the audio")


@pytest_twisted.ensureDeferred
async def test_missing_ffmpeg_is_named_with_the_worker(area, tmp_path):
    (area / SCRATCH_ID / "speech.wav").write_bytes(b"RIFF")
    converter = AudioConverter(str(area), reactor, "w-test", search_path=str(tmp_path))
    reply = await converter.convert(_body())
    assert reply["ok"] is False and reply["reason"] == "ffmpeg-missing"
    assert reply["message"].startswith("ffmpeg is not installed on worker w-test")


@pytest_twisted.ensureDeferred
async def test_requests_that_leave_the_scratch_directory_are_refused(area, tmp_path):
    (area / SCRATCH_ID / "speech.wav").write_bytes(b"RIFF")
    os.symlink("/etc/passwd", area / SCRATCH_ID / "link.wav")
    converter = AudioConverter(str(area), reactor, "w-test",
                               search_path=_fake_ffmpeg(tmp_path / "bin", "exit 0\n"))
    for bad in (_body(src="../speech.wav"), _body(dst="/tmp/x.mp3"), _body(id="../" * 3),
                _body(src="link.wav"), _body(format="exe"), _body(input_format="hls"),
                _body(max_bytes=1 << 40), _body(timeout=10_000), _body(dst="speech.wav"),
                _body(src="absent.wav")):
        with pytest.raises(BadVerbRequest):
            await converter.convert(bad)


@pytest_twisted.ensureDeferred
async def test_a_hung_ffmpeg_is_killed_at_its_timeout(area, tmp_path):
    (area / SCRATCH_ID / "speech.wav").write_bytes(b"RIFF")
    pid_file = tmp_path / "pid"
    converter = AudioConverter(str(area), reactor, "w-test", search_path=_fake_ffmpeg(
        tmp_path / "bin", f"echo $$ > {pid_file}\nexec sleep 60\n"))
    reply = await converter.convert(_body(timeout=0.5))
    assert reply == {"ok": False, "reason": "timeout",
                     "message": "ffmpeg took longer than 0.5 s"}
    assert not _alive(int(pid_file.read_text()))
    assert converter.running == 0


@pytest_twisted.ensureDeferred
async def test_ffmpeg_is_killed_when_the_caller_leaves(area, tmp_path):
    """The control plane cancels the verb when the frontend's request goes away: the process
    must not run on (a client that disconnects must not leave CPU work behind)."""
    (area / SCRATCH_ID / "speech.wav").write_bytes(b"RIFF")
    pid_file = tmp_path / "pid"
    converter = AudioConverter(str(area), reactor, "w-test", search_path=_fake_ffmpeg(
        tmp_path / "bin", f"echo $$ > {pid_file}\nexec sleep 60\n"))
    running = defer.ensureDeferred(converter.convert(_body(timeout=120)))
    await eventually(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=10)
    pid = int(pid_file.read_text())
    assert _alive(pid)
    running.cancel()
    with pytest.raises(defer.CancelledError):
        await running
    await eventually(lambda: not _alive(pid), timeout=10)
    assert converter.running == 0


@pytest_twisted.ensureDeferred
async def test_stderr_is_bounded_and_conversions_are_counted(area, tmp_path):
    (area / SCRATCH_ID / "speech.wav").write_bytes(b"RIFF")
    converter = AudioConverter(str(area), reactor, "w-test", search_path=_fake_ffmpeg(
        tmp_path / "bin", "head -c 1000000 /dev/zero | tr '\\0' x >&2\nexit 1\n"))
    reply = await converter.convert(_body())
    assert reply["reason"] == "failed" and len(reply["message"]) < 600
    converter.running = 2  # MAX_CONVERSIONS in flight: the next is 503 busy, not queued
    with pytest.raises(NoFreeSlot):
        await converter.convert(_body())
    assert MAX_STDERR <= 4096
