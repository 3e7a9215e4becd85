"""Per-request scratch directories on a worker: where a backend reads a file the frontend put
there (the audio of a transcription) and writes a file the frontend takes back (the WAV of a
speech request, the PNG of an image request).

Backend RPCs name files by paths on the backend's machine (``dst`` of ``TTSRequest``,
``TranscriptRequest``, ``GenerateImageRequest``).  The frontend never invents such a path: it
asks the worker for a scratch directory, and the worker answers with its id and its absolute
path.  Then, over the same tunnel and the same per-node control credential:

- ``scratch.create`` (control verb) ``{}`` -> ``{"id": <32 hex>, "path": <absolute dir>}``: a
  fresh directory ``<staging dir>/scratch/<id>`` (mode 0700); 503 busy when
  :data:`MAX_SCRATCH_DIRS` are already in use;
- ``PUT /v1/files/scratch/<id>/<name>`` (file staging, unchanged: streamed to disk, size and
  sha256 verified) puts an input file there; its answer's ``local_path`` is what goes in ``dst``;
- ``GET /v1/files/scratch/<id>/<name>`` streams a file a backend wrote there back, with its
  ``Content-Length`` (the frontend bounds what it reads);
- ``scratch.remove`` ``{"id"}`` -> ``{"removed": bool}`` removes the directory and everything in
  it (the frontend calls it when the request ends, whatever happened).

A frontend that dies between ``create`` and ``remove`` leaves a directory behind: every
``create`` first removes directories older than :data:`MAX_SCRATCH_AGE_SECONDS`, and the
worker empties the scratch root when it starts.

Path safety: scratch keys are exactly ``scratch/<32 lowercase hex>/<name>`` with ``name`` of
at most 64 characters from ``[A-Za-z0-9._-]`` not starting with a dot, and the id's directory
must exist (made by ``create``); anything else is refused 400 before a byte is read or
written.  Reading back is allowed under ``scratch/`` only (never a model file).

What this module must never do: remove or serve anything outside the scratch root; follow a
symlink out of it (targets are resolved and contained by ``StagingRoots``); block the reactor on
a tree removal (done in a thread); hand out an id twice.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time

from twisted.internet import threads
from twisted.logger import Logger

from localai_tw.staging_client import BadStagingKey
from localai_tw.worker.control import BadVerbRequest, NoFreeSlot, VerbRequestSchema

log = Logger()

#: The first key segment of scratch files, and the directory under the staging root.
SCRATCH = "scratch"
#: Scratch directories in use at once on one worker.
MAX_SCRATCH_DIRS = 256
#: A directory older than this is a leftover (its frontend died) and is removed.
MAX_SCRATCH_AGE_SECONDS = 3600.0

_ID = re.compile(r"^[0-9a-f]{32}$")
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")


def is_scratch_key(key: str) -> bool:
    return key == SCRATCH or key.startswith(SCRATCH + "/")


def check_scratch_id(value) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise BadStagingKey("a scratch id is 32 lowercase hex digits")
    return value


def check_scratch_key(key: str, root: str) -> None:
    """Refuse (:class:`BadStagingKey`) a ``scratch/...`` key that is not exactly
    ``scratch/<id>/<name>`` of an existing scratch directory under ``root``."""
    parts = key.split("/")
    if len(parts) != 3:
        raise BadStagingKey("a scratch key is scratch/<id>/<name>")
    check_scratch_id(parts[1])
    if not _NAME.match(parts[2]):
        raise BadStagingKey("a scratch file name is 1-64 characters of A-Z a-z 0-9 . _ - "
                            "not starting with a dot")
    if not os.path.isdir(os.path.join(root, parts[1])):
        raise BadStagingKey("no such scratch directory (create it with scratch.create)")


def _remove_old(root: str, max_age: float, now: float) -> int:
    """Remove scratch directories older than ``max_age``.  Blocking: run in a thread."""
    removed = 0
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if not _ID.match(entry.name):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime > max_age:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
        except OSError:
            continue
    return removed


class ScratchArea:
    """The scratch directories of one worker under ``root`` (``<staging dir>/scratch``)."""

    def __init__(self, root: str, reactor, *, max_dirs: int = MAX_SCRATCH_DIRS,
                 max_age: float = MAX_SCRATCH_AGE_SECONDS):
        self.root = root
        self.reactor = reactor
        self.max_dirs = max_dirs
        self.max_age = max_age
        self.live: set[str] = set()

    def _in_thread(self, fn, *args):
        return threads.deferToThreadPool(self.reactor, self.reactor.getThreadPool(), fn, *args)

    def reset(self) -> None:
        """Empty the root, synchronously, at worker start (before any ``create`` can run;
        nothing there belongs to a live request, and leftovers are a few small files)."""
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    async def create(self, body: dict) -> dict:
        removed = await self._in_thread(_remove_old, self.root, self.max_age, time.time())
        if removed:
            log.info("removed {n} scratch directories older than {age:g} s (their frontend "
                     "did not remove them)", n=removed, age=self.max_age)
        self.live = {i for i in self.live if os.path.isdir(os.path.join(self.root, i))}
        if len(self.live) >= self.max_dirs:
            raise NoFreeSlot(f"{self.max_dirs} scratch directories are in use")
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        while True:
            scratch_id = secrets.token_hex(16)
            path = os.path.join(self.root, scratch_id)
            try:
                os.mkdir(path, 0o700)
                break
            except FileExistsError:
                continue
        self.live.add(scratch_id)
        return {"id": scratch_id, "path": os.path.realpath(path)}

    async def remove(self, body: dict) -> dict:
        try:
            scratch_id = check_scratch_id(body.get("id"))
        except BadStagingKey as e:
            raise BadVerbRequest(str(e)) from None
        self.live.discard(scratch_id)
        path = os.path.join(self.root, scratch_id)
        existed = os.path.isdir(path)
        if existed:
            await self._in_thread(shutil.rmtree, path, True)
        return {"removed": existed}

    def register(self, verbs) -> None:
        """Serve ``scratch.create`` and ``scratch.remove`` (both run to the end even when the
        caller leaves: a half-made directory or a half-removed one helps nobody)."""
        verbs.register("scratch.create", self.create, schema=VerbRequestSchema(),
                       cancel_on_disconnect=False)
        verbs.register("scratch.remove", self.remove,
                       schema=VerbRequestSchema({"id": str}, frozenset({"id"})),
                       cancel_on_disconnect=False)
