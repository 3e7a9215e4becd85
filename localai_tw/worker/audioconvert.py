"""Audio conversion with ffmpeg on the worker, beside the backend (as LocalAI converts in the
process that runs its backends): the control verb ``scratch.convert`` turns one file of a
scratch directory (``localai_tw/worker/scratch.py``) into another.

Why here and not on the frontend: the audio is already on this machine (the backend wrote it,
or the frontend staged it for the backend), so converting here moves no extra bytes through the
tunnel and keeps encoding CPU off the frontend replicas (issue 25).

``scratch.convert`` ``{"id", "src", "dst", "format", "input_format"?, "max_bytes", "timeout"}``
-> ``{"ok": true, "bytes": n}``, or ``{"ok": false, "reason", "message"}`` with ``reason``
``ffmpeg-missing`` (ffmpeg is not on this worker's PATH), ``failed`` (ffmpeg could not decode
or encode; ``message`` quotes its stderr, bounded), ``too-large`` (the output passed
``max_bytes``) or ``timeout``.  ``format`` is one of :data:`OUTPUT_FORMATS`; ``input_format``
names the container the frontend recognised (``mp3``, ``ogg`` ...), so ffmpeg never guesses a
demuxer (a playlist or concat script can never be read from an upload).

Bounds: the input at most :data:`MAX_INPUT_BYTES`, the output at most ``max_bytes`` (at most
:data:`MAX_OUTPUT_BYTES`; ffmpeg's ``-fs`` stops it there), the run at most ``timeout`` seconds
(at most :data:`MAX_SECONDS`; then it is killed), stderr kept up to :data:`MAX_STDERR` bytes,
:data:`MAX_CONVERSIONS` at once (503 busy past that), one encoding thread, only the ``file``
protocol.  The process runs through Twisted's process API (the reactor never waits on it) and is
killed when the caller leaves (the control plane cancels the verb).

What this module must never do: read or write outside the scratch directory named by ``id``,
let a client's bytes choose ffmpeg's options, or leave an ffmpeg running after its request.
"""

from __future__ import annotations

import os
import re
import shutil
import stat

from twisted.internet import defer, error, protocol
from twisted.logger import Logger

from localai_tw.worker.control import BadVerbRequest, NoFreeSlot, VerbRequestSchema

log = Logger()

PROGRAM = "ffmpeg"
#: Output formats: ffmpeg's output options for each (OpenAI's speech formats, and the 16 kHz
#: mono 16-bit WAV that transcription backends read, as LocalAI's AudioToWav makes).
OUTPUT_FORMATS: dict[str, list[str]] = {
    "mp3": ["-c:a", "libmp3lame", "-b:a", "128k", "-f", "mp3"],
    "opus": ["-c:a", "libopus", "-b:a", "64k", "-ar", "48000", "-f", "ogg"],
    "aac": ["-c:a", "aac", "-b:a", "128k", "-f", "adts"],
    "flac": ["-c:a", "flac", "-f", "flac"],
    # OpenAI's pcm: raw signed 16-bit little-endian samples, 24 kHz mono, no header.
    "pcm": ["-c:a", "pcm_s16le", "-ar", "24000", "-ac", "1", "-f", "s16le"],
    "wav16k": ["-c:a", "pcm_s16le", "-ar", "16000", "-ac", "1", "-f", "wav"],
}
#: Containers the frontend recognises by their first bytes -> ffmpeg's demuxer for each.
INPUT_FORMATS = {"wav": "wav", "flac": "flac", "ogg": "ogg", "mp3": "mp3", "aac": "aac",
                 "m4a": "mov", "webm": "matroska"}
MAX_INPUT_BYTES = 64 * 1024 * 1024
MAX_OUTPUT_BYTES = 64 * 1024 * 1024
MAX_SECONDS = 300.0
MAX_STDERR = 2048
MAX_CONVERSIONS = 2
_ID = re.compile(r"^[0-9a-f]{32}$")
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")


def ffmpeg_arguments(src: str, dst: str, output_format: str, input_format: str | None,
                     max_bytes: int) -> list[str]:
    """ffmpeg's argument list (argv[0] included): every option is this module's own."""
    args = [PROGRAM, "-nostdin", "-hide_banner", "-loglevel", "error", "-y",
            "-protocol_whitelist", "file"]
    if input_format:
        args += ["-f", INPUT_FORMATS[input_format]]
    args += ["-i", "file:" + src, "-map", "0:a:0", "-vn", "-sn", "-dn", "-map_metadata", "-1",
             "-threads", "1", *OUTPUT_FORMATS[output_format], "-fs", str(max_bytes + 1),
             "file:" + dst]
    return args


class _FFmpeg(protocol.ProcessProtocol):
    """One ffmpeg run: ``ended`` fires with the exit reason; stderr kept up to a bound."""

    def __init__(self):
        self.ended: defer.Deferred = defer.Deferred()
        self.stderr = bytearray()

    def connectionMade(self):
        self.transport.closeStdin()

    def errReceived(self, data: bytes):
        room = MAX_STDERR - len(self.stderr)
        if room > 0:
            self.stderr += data[:room]

    def outReceived(self, data: bytes):
        pass

    def processEnded(self, reason):
        self.ended.callback(reason.value)

    def kill(self) -> None:
        try:
            self.transport.signalProcess("KILL")
        except (error.ProcessExitedAlready, OSError):
            pass


class AudioConverter:
    """``scratch.convert`` over the scratch directories under ``root``.

    :param search_path: where ffmpeg is looked up (a ``PATH`` string); None = this process's
        ``PATH``, read at each call (an ffmpeg installed later is found without a restart).
    """

    def __init__(self, root: str, reactor, node_name: str, *, search_path: str | None = None):
        self.root = root
        self.reactor = reactor
        self.node_name = node_name
        self.search_path = search_path
        self.running = 0

    def _program(self) -> str | None:
        return shutil.which(PROGRAM, path=self.search_path)

    def _file(self, directory: str, name, what: str) -> str:
        if not isinstance(name, str) or not _NAME.match(name):
            raise BadVerbRequest(f"{what} must be a scratch file name")
        return os.path.join(directory, name)

    async def convert(self, body: dict) -> dict:
        scratch_id = body.get("id")
        if not isinstance(scratch_id, str) or not _ID.match(scratch_id):
            raise BadVerbRequest("a scratch id is 32 lowercase hex digits")
        directory = os.path.join(self.root, scratch_id)
        if not os.path.isdir(directory):
            raise BadVerbRequest("no such scratch directory (create it with scratch.create)")
        src = self._file(directory, body.get("src"), "src")
        dst = self._file(directory, body.get("dst"), "dst")
        if src == dst or os.path.islink(dst):
            raise BadVerbRequest("dst must be a new file, not src or a link")
        output_format = body.get("format")
        if output_format not in OUTPUT_FORMATS:
            raise BadVerbRequest(f"format must be one of {', '.join(OUTPUT_FORMATS)}")
        input_format = body.get("input_format")
        if input_format is not None and input_format not in INPUT_FORMATS:
            raise BadVerbRequest(f"input_format must be one of {', '.join(INPUT_FORMATS)}")
        max_bytes, timeout = body.get("max_bytes"), body.get("timeout")
        if not isinstance(max_bytes, int) or not 0 < max_bytes <= MAX_OUTPUT_BYTES:
            raise BadVerbRequest(f"max_bytes must be 1 to {MAX_OUTPUT_BYTES}")
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_SECONDS:
            raise BadVerbRequest(f"timeout must be more than 0 and at most {MAX_SECONDS:g} s")
        try:
            info = os.lstat(src)
        except FileNotFoundError:
            raise BadVerbRequest("src is not in the scratch directory") from None
        if not stat.S_ISREG(info.st_mode):
            raise BadVerbRequest("src is not a regular file")
        if info.st_size > MAX_INPUT_BYTES:
            return _refused("too-large", f"the input has {info.st_size} bytes; at most "
                            f"{MAX_INPUT_BYTES} are converted")
        program = self._program()
        if program is None:
            return _refused("ffmpeg-missing", f"{PROGRAM} is not installed on worker "
                            f"{self.node_name}; install Debian's ffmpeg there (apt-get install "
                            "ffmpeg) or put it on the worker's PATH")
        if self.running >= MAX_CONVERSIONS:
            raise NoFreeSlot(f"{MAX_CONVERSIONS} audio conversions are running")
        self.running += 1
        try:
            return await self._run(program, ffmpeg_arguments(src, dst, output_format,
                                                             input_format, max_bytes),
                                   dst, max_bytes, float(timeout))
        finally:
            self.running -= 1

    async def _run(self, program: str, args: list[str], dst: str, max_bytes: int,
                   timeout: float) -> dict:
        run = _FFmpeg()
        # No ``path`` (paths are absolute): Twisted then uses posix_spawn, not fork, so no
        # fork handler of a library in this process (gRPC's) runs in the child.
        self.reactor.spawnProcess(run, program, args, env={"LC_ALL": "C"},
                                  childFDs={0: "w", 1: "r", 2: "r"})
        expired: list[bool] = []

        def expire():
            expired.append(True)
            run.kill()

        timer = self.reactor.callLater(timeout, expire)
        waiting = defer.Deferred(lambda _: run.kill())
        run.ended.addBoth(lambda reason: waiting.called or waiting.callback(reason))
        try:
            reason = await waiting
        finally:
            if timer.active():
                timer.cancel()
        stderr = run.stderr.decode("utf-8", "replace").strip()
        if expired:
            return _refused("timeout", f"{PROGRAM} took longer than {timeout:g} s")
        size = os.path.getsize(dst) if os.path.isfile(dst) else -1
        if size > max_bytes:
            return _refused("too-large", f"the converted audio passed {max_bytes} bytes")
        if not isinstance(reason, error.ProcessDone) or size < 0:
            log.info("ffmpeg failed on worker {name}: {err}", name=self.node_name,
                     err=stderr[:500])
            return _refused("failed", f"{PROGRAM} could not convert the audio: "
                            f"{stderr[:500] or 'no message'}")
        return {"ok": True, "bytes": size}

    def register(self, verbs) -> None:
        """Serve ``scratch.convert`` (cancelled, and ffmpeg killed, when the caller leaves)."""
        verbs.register("scratch.convert", self.convert,
                       schema=VerbRequestSchema({"id": str, "src": str, "dst": str,
                                                 "format": str},
                                                frozenset({"id", "src", "dst", "format"})))


def _refused(reason: str, message: str) -> dict:
    return {"ok": False, "reason": reason, "message": message}
