"""Files both ways between this replica and a worker, for backend RPCs that name files by
path on the backend's machine (``dst``): :class:`WorkerScratch`.

One request uses one scratch directory on the node that serves it (the worker side, its
limits and its path rules: ``localai_tw/worker/scratch.py``; the protocol:
``docs/protocol.md``, "Scratch files")::

    async with scratch.directory(node_id, deadline) as where:
        request.dst = await where.put(local_audio, "audio.wav")   # a transcription's input
        ...  or  request.dst = where.path_of("speech.wav")        # a file the backend writes
        await client.call(...)
        await where.convert("speech.wav", "speech.mp3", "mp3", max_bytes)  # ffmpeg, there
        data = await where.fetch("speech.mp3", max_bytes)        # bounded read-back

The directory is made by the worker (``scratch.create``: the worker chooses its id and
answers its absolute path), filled with ``PUT /v1/files/scratch/<id>/<name>`` (file staging:
streamed from disk, verified), converted by ffmpeg on the worker with ``scratch.convert`` (speech formats,
transcription uploads), read with ``GET`` on the same key, and removed with
``scratch.remove`` when the block ends, whatever happened (best effort; the worker also removes
leftovers after an hour).  Every exchange goes through the ``WorkerDialer`` like every other
call: locally or relayed through the replica that holds the worker's tunnel, and its failures
are the dialer's conditions unchanged (a route failure before the backend ran lets the router
serve from another node; a worker's refusal is the worker's answer).

What this module must never do: send a path the worker did not hand out (file names are this
module's own constants, checked against the worker's rule), read more than ``max_bytes`` of a
file back, or leave a scratch directory behind when it could remove it.
"""

from __future__ import annotations

import re
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger

from localai_tw import errors
from localai_tw.tunnel.endpoint import upload_file, with_deadline, worker_url
from localai_tw.web.readers import ResponseTooLarge, read_bounded

log = Logger()

#: Seconds a scratch exchange may take when the request has no deadline of its own.
DEFAULT_TIMEOUT = 120.0
#: Seconds an ffmpeg conversion on the worker may take (the worker's own bound is 300).
CONVERT_TIMEOUT = 300.0
#: Seconds the removal of a scratch directory may take.
REMOVE_TIMEOUT = 30.0
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")
_ID = re.compile(r"^[0-9a-f]{32}$")


class BackendOutputTooLarge(errors.WorkerAnswer):
    """The file a backend wrote is larger than this replica reads back (the worker's answer:
    its ``Content-Length``, or the bytes themselves)."""

    condition = "backend-output-too-large"


class BackendWroteNothing(errors.WorkerAnswer):
    """The backend said it succeeded but its output file is not there (the worker's answer)."""

    condition = "backend-wrote-nothing"


class AudioConversionFailed(errors.WorkerAnswer):
    """ffmpeg on the serving worker could not make the audio asked for (the worker's answer to
    ``scratch.convert``).  ``reason``: ``ffmpeg-missing``, ``failed``, ``too-large`` or
    ``timeout``; ``of_input``: it was converting the client's upload (so a ``failed`` is the
    client's file ffmpeg cannot read), not the backend's output."""

    condition = "audio-conversion-failed"

    def __init__(self, node_id: str, reason: str, message: str, of_input: bool):
        self.reason = reason
        self.message = message
        self.of_input = of_input
        super().__init__(node_id, message)


class ScratchDirectory:
    """One scratch directory on one node (made by :meth:`WorkerScratch.directory`)."""

    def __init__(self, owner: "WorkerScratch", node_id: str, scratch_id: str, path: str,
                 deadline: float | None):
        self._owner = owner
        self.node_id = node_id
        self.id = scratch_id
        self.path = path
        self.deadline = deadline

    def key_of(self, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"not a scratch file name: {name!r}")
        return f"scratch/{self.id}/{name}"

    def path_of(self, name: str) -> str:
        """The worker-local path of ``name`` in this directory (for a backend to write)."""
        self.key_of(name)
        return f"{self.path.rstrip('/')}/{name}"

    async def put(self, local_path: str, name: str) -> str:
        """Put the local file ``local_path`` here as ``name``; the worker-local path."""
        staged = await self._owner._put(self, local_path, self.key_of(name))
        if not staged.local_path:
            raise errors.TunnelProtocolError(
                f"worker {self.node_id} staged {name} without saying where")
        return staged.local_path

    async def fetch(self, name: str, max_bytes: int) -> bytes:
        """The file ``name`` a backend wrote here, at most ``max_bytes`` of it."""
        return await self._owner._fetch(self, self.key_of(name), max_bytes)


    async def convert(self, src: str, dst: str, output_format: str, max_bytes: int, *,
                      input_format: str | None = None) -> str:
        """Convert ``src`` here into ``dst`` with ffmpeg on the worker (``scratch.convert``,
        ``localai_tw/worker/audioconvert.py``); the worker-local path of ``dst``.  An
        ``input_format`` says the client's upload is converted (see
        :class:`AudioConversionFailed`)."""
        self.key_of(src)
        path = self.path_of(dst)
        timeout = self._owner._timeout(self.deadline)
        body: dict[str, Any] = {"id": self.id, "src": src, "dst": dst,
                                "format": output_format, "max_bytes": max_bytes,
                                "timeout": min(CONVERT_TIMEOUT, timeout)}
        if input_format is not None:
            body["input_format"] = input_format
        reply = await self._owner._control.call(self.node_id, "scratch.convert", body,
                                                timeout=timeout)
        reply = reply or {}
        if reply.get("ok") is not True:
            raise AudioConversionFailed(self.node_id, str(reply.get("reason") or "failed"),
                                        str(reply.get("message") or "ffmpeg failed")[:1000],
                                        input_format is not None)
        return path


class _Using:
    def __init__(self, owner: "WorkerScratch", node_id: str, deadline: float | None):
        self._owner = owner
        self._node_id = node_id
        self._deadline = deadline
        self._directory: ScratchDirectory | None = None

    async def __aenter__(self) -> ScratchDirectory:
        self._directory = await self._owner._create(self._node_id, self._deadline)
        return self._directory

    async def __aexit__(self, *exc_info) -> bool:
        if self._directory is not None:
            await self._owner._remove(self._directory)
        return False


class WorkerScratch:
    """Scratch directories on workers, through the control client and the worker HTTP client.

    :param control: the replica's ``ControlClient`` (node tokens included);
    :param worker_http: the replica's ``WorkerHTTPClient``;
    :param token_for: ``token_for(node_id)`` -> (Deferred of) the node's control token.
    """

    def __init__(self, control, worker_http, token_for, reactor):
        self._control = control
        self._http = worker_http
        self._token_for = token_for
        self._reactor = reactor

    def directory(self, node_id: str, deadline: float | None = None) -> _Using:
        """``async with`` a fresh scratch directory on ``node_id`` (removed at the end)."""
        return _Using(self, node_id, deadline)

    def _timeout(self, deadline: float | None) -> float:
        if deadline is None:
            return DEFAULT_TIMEOUT
        return max(deadline - self._reactor.seconds(), 0.001)

    async def _create(self, node_id: str, deadline: float | None) -> ScratchDirectory:
        reply = await self._control.call(node_id, "scratch.create", {},
                                         timeout=self._timeout(deadline))
        reply = reply or {}
        scratch_id, path = reply.get("id"), reply.get("path")
        if not isinstance(scratch_id, str) or not _ID.match(scratch_id) or \
                not isinstance(path, str) or not path.startswith("/") or \
                not path.rstrip("/").endswith("/" + scratch_id):
            raise errors.TunnelProtocolError(
                f"scratch.create on worker {node_id} answered an unusable directory")
        return ScratchDirectory(self, node_id, scratch_id, path, deadline)

    async def _put(self, where: ScratchDirectory, local_path: str, key: str):
        token = await defer.maybeDeferred(self._token_for, where.node_id)
        return await upload_file(self._http, where.node_id, key, local_path, token=token,
                                 timeout=self._timeout(where.deadline))

    async def _fetch(self, where: ScratchDirectory, key: str, max_bytes: int) -> bytes:
        node_id = where.node_id
        what = f"reading {key} back from worker {node_id}"
        reading = defer.ensureDeferred(self._get(node_id, key, max_bytes, what))
        return await with_deadline(self._reactor, reading, self._timeout(where.deadline), what)

    async def _get(self, node_id: str, key: str, max_bytes: int, what: str) -> bytes:
        headers: dict[str, Any] = {}
        token = await defer.maybeDeferred(self._token_for, node_id)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        response = await self._http.get(worker_url(node_id, "/v1/files/" + key),
                                        headers=headers)
        if response.code == 404:
            await _drain(response)
            raise BackendWroteNothing(node_id, "the backend reported success but wrote no "
                                      "output file")
        if response.code != 200:
            raw = await _drain(response)
            raise errors.WorkerAnswer(node_id, f"{what} answered {response.code}: "
                                      f"{raw[:512].decode('utf-8', 'replace')}")
        length = response.length if isinstance(response.length, int) else None
        if length is not None and length > max_bytes:
            response.deliverBody(_Discard())
            raise BackendOutputTooLarge(node_id, f"the backend wrote {length} bytes, more "
                                        f"than the {max_bytes} this server reads back")
        try:
            return await read_bounded(response, max_bytes)
        except ResponseTooLarge:
            raise BackendOutputTooLarge(node_id, f"the backend wrote more than the "
                                        f"{max_bytes} bytes this server reads back") from None

    async def _remove(self, where: ScratchDirectory) -> None:
        try:
            await self._control.call(where.node_id, "scratch.remove", {"id": where.id},
                                     timeout=REMOVE_TIMEOUT)
        except Exception as e:  # the worker removes leftovers after an hour anyway
            log.info("removing scratch directory {id} on node {node} failed: {err}",
                     id=where.id, node=where.node_id, err=e)


class _Discard:
    def makeConnection(self, transport):
        transport.stopProducing()

    def dataReceived(self, data):
        pass

    def connectionLost(self, reason):
        pass


async def _drain(response) -> bytes:
    try:
        return await read_bounded(response, 4096)
    except ResponseTooLarge as e:
        return e.received
    except Exception:
        return b""
