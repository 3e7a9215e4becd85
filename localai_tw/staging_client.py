"""Client side of file staging: put a local file on a worker through ``PUT /v1/files/{key}``.

The frontend uses this to stage model files over a worker's ``http`` stream (see
``localai_tw/worker/staging.py`` for the server side and ``docs/control-plane.md`` for the
protocol).  The file is hashed off the reactor thread, a ``HEAD`` skips files the worker already
holds with the same digest under the key, a ``POST /v1/files-link/`` links a file it holds with
that digest under another key (another model naming the same file), and only then is the body
streamed from disk with ``FileBodyProducer``.

It lives outside ``worker/`` because frontends import it and nothing but the plugins may import
from ``worker``.  What it must never do: read a whole file into memory, hash on the reactor
thread, or turn a transport failure into a worker's answer (only the worker's HTTP replies are
its answers; a broken stream stays whatever the dialer said it was).
"""

from __future__ import annotations

import contextvars
import hashlib
import json
from typing import Any, Callable
from urllib.parse import quote, unquote_to_bytes

import attr
from treq.client import HTTPClient
from twisted.internet import defer, threads
from twisted.internet.interfaces import IReactorThreads
from twisted.logger import Logger
from twisted.web.client import FileBodyProducer
from twisted.web.iweb import IAgent

from localai_tw import errors
from localai_tw.web.readers import ResponseTooLarge, read_bounded

log = Logger()

#: Longest key accepted, in bytes of UTF-8.
MAX_KEY_BYTES = 1024
#: Longest path segment of a key: leaves room for the temporary name under NAME_MAX (255).
MAX_KEY_SEGMENT_BYTES = 200
#: Chunk size of hashing and of the client's reads.
CHUNK_BYTES = 64 * 1024

SIDECAR_SUFFIX = ".sha256"
PARTIAL_SUFFIX = ".partial"
OUTSIDE_ALLOWED = "outside allowed directory"


class BadStagingKey(ValueError):
    """A key that cannot name a staged file; the message says why (answered 400)."""


def parse_key(raw: bytes) -> str:
    """Decode and validate a key taken from a URL path (still percent-encoded)."""
    if len(raw) > 3 * MAX_KEY_BYTES:
        raise BadStagingKey(f"key longer than {MAX_KEY_BYTES} bytes")
    decoded = unquote_to_bytes(raw)
    if len(decoded) > MAX_KEY_BYTES:
        raise BadStagingKey(f"key longer than {MAX_KEY_BYTES} bytes")
    if not decoded:
        raise BadStagingKey("empty key")
    if b"\x00" in decoded:
        raise BadStagingKey("key contains a NUL byte")
    try:
        key = decoded.decode("utf-8")
    except UnicodeDecodeError:
        raise BadStagingKey("key is not UTF-8") from None
    if key.startswith("/"):
        raise BadStagingKey(f"absolute key: {OUTSIDE_ALLOWED}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key) or "\\" in key:
        raise BadStagingKey("key contains a control character or a backslash")
    segments = key.split("/")
    for segment in segments:
        if segment in ("", ".", ".."):
            raise BadStagingKey(
                f"key segment {segment!r} is not allowed: {OUTSIDE_ALLOWED}"
                if segment == ".."
                else "key has an empty or '.' segment"
            )
        if len(segment.encode("utf-8")) > MAX_KEY_SEGMENT_BYTES:
            raise BadStagingKey(f"key segment longer than {MAX_KEY_SEGMENT_BYTES} bytes")
    if segments[-1].endswith((SIDECAR_SUFFIX, PARTIAL_SUFFIX)):
        raise BadStagingKey("key names a staging sidecar or temporary file")
    return key


def sha256_of_file(path: str) -> tuple[int, str]:
    """Size and hex SHA-256 of ``path``, read in chunks.  Blocking: call it in a thread."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1024 * 1024)
            if not chunk:
                break
            size += len(chunk)
            digest.update(chunk)
    return size, digest.hexdigest()



#: Largest error body the client reads from a worker.
MAX_ANSWER_BYTES = 64 * 1024


@attr.s(frozen=True, auto_attribs=True)
class StagedFile:
    """What :func:`upload_file` did: ``skipped`` when the worker already had the file."""

    key: str
    size: int
    sha256: str
    skipped: bool
    local_path: str | None


#: Where the uploads of the current context report their bytes: an object with ``begin(size)``,
#: ``moved(count)``, ``skipped(size)`` (a file the worker held) and ``expect(total)`` (the
#: frontend's load lock sets one while a cold load stages, so ``/api/cluster/loads`` shows
#: bytes; ``frontend/inference/loadlock.py``), or None.
STAGING_WATCH: contextvars.ContextVar[Any] = contextvars.ContextVar("localai_tw_staging_watch",
                                                                    default=None)


def expect_staging(total: int) -> None:
    """Tell the current context's :data:`STAGING_WATCH` (if any) how many bytes the uploads
    to come add up to, so its progress has its total from the start."""
    watch = STAGING_WATCH.get()
    if watch is not None:
        watch.expect(total)


class _CountingFile:
    """A file whose reads report progress; offers what ``FileBodyProducer`` uses."""

    def __init__(self, f, total: int, progress_cb: Callable[[int, int], Any] | None):
        self._f = f
        self.total = total
        self.sent = 0
        self._progress_cb = progress_cb
        self._watch = STAGING_WATCH.get()  # made in the uploading coroutine: its context
        if self._watch is not None:
            self._watch.begin(total)

    def read(self, size: int) -> bytes:
        data = self._f.read(size)
        self.sent += len(data)
        if data and self._progress_cb is not None:
            self._progress_cb(self.sent, self.total)
        if data and self._watch is not None:
            self._watch.moved(len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()


async def _bounded_body(response) -> bytes:
    """At most :data:`MAX_ANSWER_BYTES` of an answer's body (what came before the cap when it
    is longer: an error message is still worth reading)."""
    try:
        return await read_bounded(response, MAX_ANSWER_BYTES)
    except ResponseTooLarge as e:
        return e.received


async def _answer_error(node_id: str, what: str, response) -> errors.WorkerAnswer:
    raw = await _bounded_body(response)
    try:
        decoded = json.loads(raw)
        detail = decoded.get("problem") or decoded.get("busy") or decoded.get("error")
    except (ValueError, AttributeError):
        detail = None
    detail = str(detail) if detail else raw[:512].decode("utf-8", "replace")
    if response.code == 503:
        return errors.WorkerBusy(node_id, detail or "the worker is busy")
    return errors.WorkerAnswer(node_id, f"{what} answered {response.code}: {detail}")


def _header(response, name: bytes) -> str | None:
    values = response.headers.getRawHeaders(name)
    return values[-1].decode("ascii", "replace") if values else None


def upload_file(
    client: HTTPClient | IAgent,
    base_url: str,
    key: str,
    path: str,
    progress_cb: Callable[[int, int], Any] | None = None,
    *,
    node_id: str = "?",
    token: str | None = None,
    reactor: IReactorThreads | None = None,
    known: tuple[int, str] | None = None,
) -> "defer.Deferred[StagedFile]":
    """Stage the local file ``path`` on a worker under ``key``.

    Hashes the file in a thread, HEADs ``{base_url}/v1/files/{key}`` and skips when the worker
    already holds the same size and digest, else PUTs the file streamed from disk with
    ``FileBodyProducer`` (``progress_cb(sent, total)`` per chunk read).  A worker's refusal
    (400, 401, 403, 404, 409, 411, 413, 5xx) raises :class:`~localai_tw.errors.WorkerAnswer`,
    503 :class:`~localai_tw.errors.WorkerBusy`; transport failures (no route, broken stream)
    propagate unchanged.  ``client`` is a treq ``HTTPClient`` or an ``IAgent`` (for a tunnel,
    an agent whose endpoint opens an ``http`` stream).  Cancelling the Deferred cancels the
    request in flight.  ``known`` is ``(size, sha256)`` when the caller already hashed the file
    (no second read); a file changed since is refused by the worker's digest check, or here
    when its size differs.
    """
    return defer.Deferred.fromCoroutine(
        _upload_file(client, base_url, key, path, progress_cb, node_id, token, reactor, known)
    )


async def _upload_file(client, base_url, key, path, progress_cb, node_id, token, reactor,
                       known=None):
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
    if IAgent.providedBy(client):
        client = HTTPClient(client)
    parse_key(quote(key, safe="/").encode("ascii"))  # refuse locally what the worker would
    url = base_url.rstrip("/") + "/v1/files/" + quote(key, safe="/")
    headers = {}
    if token:
        headers["Authorization"] = f"Bearer {token}"

    if known is not None:
        size, digest = known
    else:
        size, digest = await threads.deferToThreadPool(
            reactor, reactor.getThreadPool(), sha256_of_file, path
        )

    head = await client.head(url, headers=headers)
    if head.code == 200:
        await _bounded_body(head)
        if _header(head, b"x-content-sha256") == digest and _header(head, b"x-file-size") == str(
            size
        ):
            if progress_cb is not None:
                progress_cb(size, size)
            watch = STAGING_WATCH.get()
            if watch is not None:  # already there: done, with nothing moved
                watch.skipped(size)
            return StagedFile(key, size, digest, True, _header(head, b"x-local-path"))
    elif head.code == 404:
        await _bounded_body(head)
    else:
        raise await _answer_error(node_id, f"HEAD {key}", head)

    # The worker may hold the same bytes under another key (another model naming the file):
    # then it links them under this key and nothing crosses the tunnel.  A worker without
    # a content store (or an older one) answers 404 and the file is uploaded.
    link_url = base_url.rstrip("/") + "/v1/files-link/" + quote(key, safe="/")
    linked = await client.post(link_url, headers={**headers, "X-Content-SHA256": digest,
                                                  "X-File-Size": str(size)})
    linked_body = await _bounded_body(linked)
    if linked.code == 200:
        if progress_cb is not None:
            progress_cb(size, size)
        watch = STAGING_WATCH.get()
        if watch is not None:
            watch.skipped(size)
        try:
            local_path = json.loads(linked_body).get("local_path")
        except (ValueError, AttributeError):
            local_path = None
        return StagedFile(key, size, digest, True, local_path)

    put_headers = dict(headers)
    put_headers["X-Content-SHA256"] = digest
    with open(path, "rb") as f:
        body = FileBodyProducer(_CountingFile(f, size, progress_cb), readSize=CHUNK_BYTES)
        if body.length != size:
            raise ValueError(f"{path} changed while it was being staged")
        put = await client.put(url, data=body, headers=put_headers)
        if put.code != 200:
            raise await _answer_error(node_id, f"PUT {key}", put)
        raw = await _bounded_body(put)
    try:
        reply = json.loads(raw)
    except ValueError:
        raise errors.WorkerAnswer(node_id, f"PUT {key} answered 200 with a non-JSON body")
    return StagedFile(
        key, size, digest, bool(reply.get("skipped")), reply.get("local_path")
    )
