"""File staging: a frontend puts model and data files on a worker over its ``http`` stream.

Server side (mounted in the worker's site next to the control plane):

- ``PUT /v1/files/{key}`` streams the body straight into a temporary file next to the target,
  hashing as it goes; ``X-Content-SHA256`` and ``Content-Length`` are required.  When the body
  is complete and the digest matches, the file is fsynced and renamed onto the final name (so
  the final name never shows a partial file), then a ``<file>.sha256`` sidecar caches the
  digest.  A mismatch answers 400 and removes the temporary file.  A target already present
  with the same digest is answered ``200 {"skipped": true}`` before the body is read.
- ``HEAD /v1/files/{key}`` reports ``X-File-Size`` and ``X-Content-SHA256`` (from the sidecar
  when it still matches the file's size and mtime, else hashed in a thread) so the frontend can
  skip uploads that are already present.
- ``GET /v1/files-progress/{key}`` reports an upload in progress: bytes received and total.
- ``POST /v1/files-link/{key}`` with ``X-Content-SHA256`` and ``X-File-Size``: when the
  worker's content store (``localai_tw/worker/blobs.py``) holds a file of that digest, it is
  linked under ``key`` (200, nothing transferred), else 404 and the frontend uploads it.
  Uploads under ``models/`` are kept there once verified, so a file is one copy on disk
  however many models name it.

- ``GET /v1/files/scratch/<id>/<name>`` streams back a file a backend wrote in a scratch
  directory (``localai_tw/worker/scratch.py``); nothing else under ``/v1/files/`` is readable.

Keys map to roots: ``models/<rest>`` under the models directory, ``data/<rest>`` under the data
directory, anything else under the staging directory.  ``scratch/...`` keys must be exactly
``scratch/<id>/<name>`` of a directory made by the ``scratch.create`` verb.

The client side (:func:`upload_file`) lives in ``localai_tw/staging_client.py`` so frontends
need not import from ``worker``; it is re-exported here.

What this module must never do:

- hold an upload in memory: body chunks go to disk as they arrive (one chunk at a time);
- write outside the allowed roots: a key is validated (no ``..``, no absolute keys, no NUL,
  bounded length) and its target resolved with symlinks on both sides before anything is
  created; a symlink leading out of a root is refused;
- leave a partial or unverified file under the final name, or a temporary file behind after a
  mismatch, a disconnect or a refusal;
- accept a body from an unauthorized caller, or of unannounced or excessive length: those are
  refused when the headers end, before one body byte is written;
- hash a large file on the reactor thread.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import tempfile

import attr
from twisted.internet import defer, threads
from twisted.internet.interfaces import IPushProducer, IReactorThreads
from twisted.logger import Logger
from twisted.web import resource, server
from zope.interface import implementer

from localai_tw.staging_client import (  # noqa: F401 -- the client half and the key rules
    CHUNK_BYTES,
    MAX_KEY_BYTES,
    MAX_KEY_SEGMENT_BYTES,
    OUTSIDE_ALLOWED,
    PARTIAL_SUFFIX,
    SIDECAR_SUFFIX,
    BadStagingKey,
    StagedFile,
    parse_key,
    sha256_of_file,
    upload_file,
)
from localai_tw.contentstore import STORE_DIR, ContentStore
from localai_tw.worker.control import ControlAuth, write_json, write_problem
from localai_tw.worker.scratch import SCRATCH, check_scratch_key, is_scratch_key
from localai_tw.worker.httpserve import (
    AnswerBeforeBody,
    BoundedMemoryBody,
    IRequestBodyPolicy,
    IRequestBodySink,
    failure_summary,
)

log = Logger()

FILES_PREFIX = b"/v1/files/"
PROGRESS_PREFIX = b"/v1/files-progress/"
LINK_PREFIX = b"/v1/files-link/"
#: Default cap of one upload.  Configurable per worker.
DEFAULT_MAX_UPLOAD_BYTES = 256 * 1024**3
_HEX_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# -- keys and roots ------------------------------------------------------------------------------


@attr.s(frozen=True, auto_attribs=True)
class StagingTarget:
    key: str
    real_root: str
    real_path: str

    @property
    def sidecar_path(self) -> str:
        return self.real_path + SIDECAR_SUFFIX


def _contained(real_path: str, real_root: str) -> bool:
    return real_path == real_root or real_path.startswith(real_root.rstrip(os.sep) + os.sep)


def real_path_of(path: str) -> str:
    """``path`` with every symlink resolved, including a path that does not exist yet: the
    first existing ancestor is resolved and the missing remainder re-appended.  A dangling
    symlink is followed to where it points (``os.path.realpath`` does both), so a link whose
    target does not exist yet cannot smuggle a file outside a root."""
    return os.path.realpath(path)


@attr.s(frozen=True, auto_attribs=True)
class StagingRoots:
    """The three directories keys map onto.  Each may itself be a symlink (allowed)."""

    models_dir: str
    data_dir: str
    staging_dir: str

    def root_and_rest(self, key: str) -> tuple[str, str]:
        first, _, rest = key.partition("/")
        if first == "models":
            return self.models_dir, rest
        if first == "data":
            return self.data_dir, rest
        return self.staging_dir, key

    def resolve(self, key: str) -> StagingTarget:
        """Where ``key`` (already validated by :func:`parse_key`) lives, symlinks resolved on
        both sides; raises :class:`BadStagingKey` if that is outside the key's root."""
        root, rest = self.root_and_rest(key)
        if not rest:
            raise BadStagingKey("key names a root directory, not a file")
        if root == self.models_dir and rest.split("/", 1)[0] == STORE_DIR:
            raise BadStagingKey(f"models/{STORE_DIR} is the worker's content store")
        real_root = real_path_of(root)
        real_path = real_path_of(os.path.join(real_root, rest))
        if real_path == real_root or not _contained(real_path, real_root):
            raise BadStagingKey(OUTSIDE_ALLOWED)
        return StagingTarget(key, real_root, real_path)


# -- digests and sidecars -------------------------------------------------------------------------


def read_sidecar(target: StagingTarget) -> str | None:
    """The cached digest of the target when the sidecar still describes the file (same size and
    mtime), else ``None``.  A few hundred bytes: fine on the reactor."""
    try:
        st = os.stat(target.real_path)
        with open(target.sidecar_path, "rb") as f:
            text = f.read(512).decode("ascii", "replace")
    except OSError:
        return None
    fields = text.split()
    if len(fields) != 3 or not _HEX_SHA256.match(fields[0]):
        return None
    if fields[1] != str(st.st_size) or fields[2] != str(st.st_mtime_ns):
        return None
    return fields[0]


def write_sidecar(target: StagingTarget, digest: str) -> None:
    """Record ``digest`` for the file as it is now (atomically, by rename).  Blocking."""
    st = os.stat(target.real_path)
    directory = os.path.dirname(target.real_path)
    fd, tmp = tempfile.mkstemp(
        dir=directory, prefix="." + os.path.basename(target.sidecar_path) + ".",
        suffix=PARTIAL_SUFFIX,
    )
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{digest} {st.st_size} {st.st_mtime_ns}\n")
        os.replace(tmp, target.sidecar_path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- uploads in progress --------------------------------------------------------------------------


@attr.s(auto_attribs=True)
class UploadProgress:
    key: str
    total: int
    received: int = 0

    def as_json(self) -> dict:
        return {"key": self.key, "received": self.received, "total": self.total}


class DigestMismatch(Exception):
    def __init__(self, expected: str, actual: str):
        self.expected = expected
        self.actual = actual
        super().__init__(f"sha256 mismatch: expected {expected}, got {actual}")


@attr.s(frozen=True, auto_attribs=True)
class StoredFile:
    key: str
    size: int
    sha256: str
    local_path: str

    def as_json(self, skipped: bool) -> dict:
        return {"key": self.key, "size": self.size, "sha256": self.sha256,
                "local_path": self.local_path, "skipped": skipped}


@implementer(IRequestBodySink)
class FileUploadSink:
    """One upload's body: each chunk is written to a temporary file beside the target and fed
    to the running hash, then dropped.  Also the request's ``content``.

    States: ``receiving`` (the reactor owns the file) -> ``finalizing`` (a thread verifies,
    fsyncs and renames) -> ``committed`` or ``discarded``.  :meth:`close` discards only while
    receiving, so a disconnect during finalizing cannot race the rename.
    """

    def __init__(
        self,
        staging: "FileStaging",
        request,
        target: StagingTarget,
        expected_sha256: str,
        expected_size: int,
    ):
        self.staging = staging
        self.request = request
        self.target = target
        self.expected_sha256 = expected_sha256
        self.expected_size = expected_size
        self.progress = UploadProgress(target.key, expected_size)
        self.largest_chunk = 0
        self._hash = hashlib.sha256()
        directory = os.path.dirname(target.real_path)
        os.makedirs(directory, exist_ok=True)
        self.fd, self.temp_path = tempfile.mkstemp(
            dir=directory, prefix="." + os.path.basename(target.real_path) + ".",
            suffix=PARTIAL_SUFFIX,
        )
        self.state = "receiving"
        staging.uploads[target.real_path] = self.progress

    # IRequestBodySink
    def write(self, data: bytes) -> None:
        if self.state != "receiving":
            return
        self.largest_chunk = max(self.largest_chunk, len(data))
        view = memoryview(data)
        try:
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError as e:
            self.close()
            code = 507 if e.errno in (errno.ENOSPC, errno.EDQUOT) else 500
            raise AnswerBeforeBody(code, {"problem": f"writing the upload failed: {e.strerror}"})
        self._hash.update(data)
        self.progress.received += len(data)

    def tell(self) -> int:
        return self.progress.received

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0

    def read(self, size: int = -1) -> bytes:
        return b""

    def close(self) -> None:
        if self.state != "receiving":
            return
        self.state = "discarded"
        self._forget()
        try:
            os.close(self.fd)
        finally:
            _unlink_quietly(self.temp_path)

    def _forget(self):
        if self.staging.uploads.get(self.target.real_path) is self.progress:
            del self.staging.uploads[self.target.real_path]

    def commit(self) -> defer.Deferred:
        """Verify the digest and, if it matches, make the file visible under its final name.
        Fires with a :class:`StoredFile`, or fails with :class:`DigestMismatch` (the temporary
        file removed) or an ``OSError``."""
        if self.state != "receiving":
            return defer.fail(RuntimeError(f"upload is {self.state}"))
        if self.progress.received != self.expected_size:
            self.close()
            return defer.fail(ValueError("the body ended before its announced length"))
        self.state = "finalizing"
        actual = self._hash.hexdigest()
        d = threads.deferToThreadPool(
            self.staging.reactor, self.staging.reactor.getThreadPool(),
            self._finalize_blocking, actual,
        )

        def done(result):
            self._forget()
            return result

        return d.addBoth(done)

    def _finalize_blocking(self, actual: str) -> StoredFile:
        try:
            if actual != self.expected_sha256:
                raise DigestMismatch(self.expected_sha256, actual)
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.temp_path, self.target.real_path)
            _fsync_directory(os.path.dirname(self.target.real_path))
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            _unlink_quietly(self.temp_path)
            self.state = "discarded"
            raise
        self.state = "committed"
        self.staging.keep(self.target, actual)
        return StoredFile(self.target.key, self.expected_size, actual, self.target.real_path)


# -- the server side ------------------------------------------------------------------------------


class FileStaging:
    """The file staging service of one worker: roots, limits, auth and uploads in progress.

    Mount it with ``build_worker_site(..., v1_children=staging.v1_children(),
    body_policies=staging.body_policies())``.
    """

    def __init__(
        self,
        roots: StagingRoots,
        auth: ControlAuth,
        reactor: IReactorThreads,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    ):
        self.roots = roots
        self.auth = auth
        self.reactor = reactor
        self.max_upload_bytes = max_upload_bytes
        #: Uploads in progress, by real target path.
        self.uploads: dict[str, UploadProgress] = {}
        #: One copy of each file staged under ``models/``.
        self.store = ContentStore(roots.models_dir)

    def v1_children(self) -> dict[bytes, resource.Resource]:
        return {b"files": FilesResource(self), b"files-progress": UploadProgressResource(self),
                b"files-link": FileLinkResource(self)}

    def in_store(self, target: StagingTarget) -> bool:
        return target.real_root == real_path_of(self.roots.models_dir)

    def keep(self, target: StagingTarget, digest: str) -> None:
        """A verified file is in place under ``target``: its sidecar, its place in the content
        store (models only), and stored files no model names any more freed.  Blocking."""
        if self.in_store(target):
            try:
                if self.store.remember(target.real_path, digest) == "shared":
                    log.info("staged {key}: the same bytes as a file already here, kept once",
                             key=target.key)
                freed, size = self.store.sweep()
            except OSError as e:  # the file is good where it is; only the sharing failed
                log.warn("staging {key}: the content store failed: {e}", key=target.key, e=e)
                freed = size = 0
            if freed:
                log.info("freed {files} staged file(s) no model names any more ({size} bytes)",
                         files=freed, size=size)
        try:
            write_sidecar(target, digest)
        except OSError as e:  # the file is good; HEAD will hash it again
            log.warn("staging {key}: could not write the sha256 sidecar: {e}",
                     key=target.key, e=e)

    def body_policies(self) -> list[IRequestBodyPolicy]:
        return [UploadBodyPolicy(self)]

    @property
    def scratch_root(self) -> str:
        return os.path.join(self.roots.staging_dir, SCRATCH)

    def target_of(self, path: bytes, prefix: bytes) -> StagingTarget:
        if not path.startswith(prefix):
            raise BadStagingKey("not a staging path")
        key = parse_key(path[len(prefix):])
        if is_scratch_key(key):
            check_scratch_key(key, self.scratch_root)
        return self.roots.resolve(key)


def _expected_sha256(request) -> str | None:
    value = request.requestHeaders.getRawHeaders(b"x-content-sha256")
    if not value or len(value) != 1:
        return None
    text = value[0].decode("ascii", "replace").strip().lower()
    return text if _HEX_SHA256.match(text) else None


@implementer(IRequestBodyPolicy)
class UploadBodyPolicy:
    """Decides, when a request's headers end, where a ``/v1/files/`` body goes."""

    prefix = FILES_PREFIX

    def __init__(self, staging: FileStaging):
        self.staging = staging

    def sink_for(self, request, method, path, length):
        if method != b"PUT":
            if length is not None and length > 0:
                raise AnswerBeforeBody(400, {"problem": "only PUT takes a body here"})
            return BoundedMemoryBody(0)
        refusal = self.staging.auth.refusal_for(request)
        if refusal is not None:
            raise refusal.as_answer()
        try:
            target = self.staging.target_of(path, FILES_PREFIX)
        except BadStagingKey as e:
            raise AnswerBeforeBody(400, {"problem": str(e)})
        # twisted.web reports a missing Content-Length as 0, so ask the headers themselves.
        if length is None or not request.requestHeaders.hasHeader(b"content-length"):
            raise AnswerBeforeBody(411, {"problem": "Content-Length is required"})
        if length > self.staging.max_upload_bytes:
            raise AnswerBeforeBody(
                413, {"problem": f"upload larger than the limit of "
                                 f"{self.staging.max_upload_bytes} bytes"})
        expected = _expected_sha256(request)
        if expected is None:
            raise AnswerBeforeBody(
                400, {"problem": "X-Content-SHA256 (64 hex digits) is required"})
        if os.path.isdir(target.real_path):
            raise AnswerBeforeBody(400, {"problem": "key names a directory"})
        if target.real_path in self.staging.uploads:
            raise AnswerBeforeBody(409, {"problem": "an upload of this key is in progress"})
        if read_sidecar(target) == expected and os.path.getsize(target.real_path) == length:
            stored = StoredFile(target.key, length, expected, target.real_path)
            # Answer now and drop the body as it arrives: the peer may finish sending.
            raise AnswerBeforeBody(200, stored.as_json(skipped=True), stop_reading=False)
        try:
            return FileUploadSink(self.staging, request, target, expected, length)
        except OSError as e:
            code = 400 if e.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR) else (
                507 if e.errno in (errno.ENOSPC, errno.EDQUOT) else 500)
            raise AnswerBeforeBody(code, {"problem": f"cannot create the upload: {e.strerror}"})


def _file_headers(request, size: int, digest: str, target: StagingTarget):
    request.setHeader(b"x-file-size", b"%d" % size)
    request.setHeader(b"x-content-sha256", digest.encode("ascii"))
    request.setHeader(b"x-local-path", os.fsencode(target.real_path))


class _StagingResource(resource.Resource):
    """A leaf of the staging routes: the caller's credential checked before anything else,
    then :meth:`answer`, which writes the whole answer (now or later)."""

    isLeaf = True

    def __init__(self, staging: FileStaging):
        super().__init__()
        self.staging = staging

    def render(self, request):
        refusal = self.staging.auth.refusal_for(request)
        if refusal is not None:
            write_problem(request, refusal.code, refusal.problem, refusal.headers)
        else:
            self.answer(request)
        return server.NOT_DONE_YET

    def answer(self, request) -> None:
        raise NotImplementedError


class FilesResource(_StagingResource):
    """``/v1/files/{key}``: HEAD to learn what is present, PUT to upload, GET to read back a
    scratch file."""

    def answer(self, request) -> None:
        if request.method == b"HEAD":
            self._head(request)
        elif request.method == b"PUT":
            self._put(request)
        elif request.method == b"GET":
            self._get(request)
        else:
            write_problem(request, 405, "use HEAD, PUT or GET", ((b"allow", b"HEAD, PUT, GET"),))

    def _get(self, request):
        """Stream a scratch file back (what a backend wrote there), with its length."""
        target = self._target(request)
        if target is None:
            return
        if not is_scratch_key(target.key):
            write_problem(request, 403, "only scratch files (scratch/<id>/<name>) are readable")
            return
        try:
            f = open(target.real_path, "rb")
        except FileNotFoundError:
            write_problem(request, 404, "no such file (the backend wrote nothing there)")
            return
        except OSError as e:
            write_problem(request, 400 if e.errno == errno.EISDIR else 500,
                          f"cannot read the file: {e.strerror}")
            return
        size = os.fstat(f.fileno()).st_size
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"application/octet-stream")
        request.setHeader(b"content-length", b"%d" % size)
        _FileStreamer(f, request, size).start()

    def _target(self, request) -> StagingTarget | None:
        try:
            return self.staging.target_of(request.path, FILES_PREFIX)
        except BadStagingKey as e:
            write_problem(request, 400, str(e))
            return None

    def _head(self, request):
        target = self._target(request)
        if target is None:
            return
        if not os.path.isfile(target.real_path):
            write_problem(request, 404, "no such file")
            return
        cached = read_sidecar(target)
        if cached is not None:
            self._describe(request, target, os.path.getsize(target.real_path), cached)
            return

        def hash_and_record():
            size, digest = sha256_of_file(target.real_path)
            try:
                write_sidecar(target, digest)
            except OSError:
                pass
            return size, digest

        reactor = self.staging.reactor
        d = threads.deferToThreadPool(reactor, reactor.getThreadPool(), hash_and_record)
        d.addCallbacks(
            lambda result: self._describe(request, target, *result),
            lambda f: write_problem(request, 500, f"hashing failed: {failure_summary(f)}"),
        )

    def _describe(self, request, target, size, digest):
        if request.finished or getattr(request, "_disconnected", False):
            return
        _file_headers(request, size, digest, target)
        write_json(request, 200, {})

    def _put(self, request):
        sink = request.content
        if not isinstance(sink, FileUploadSink) or sink.request is not request:
            write_problem(request, 400, "the upload body was not staged (use /v1/files/ unencoded)")
            return

        def stored(stored_file: StoredFile):
            log.info("staged {key} ({size} bytes)", key=stored_file.key, size=stored_file.size)
            write_json(request, 200, stored_file.as_json(skipped=False))

        def failed(failure):
            if failure.check(DigestMismatch):
                write_problem(request, 400, str(failure.value))
            elif failure.check(ValueError):
                write_problem(request, 400, str(failure.value))
            else:
                log.failure("staging {key} failed", failure, key=sink.target.key)
                write_problem(request, 500, f"storing the upload failed: "
                                            f"{failure_summary(failure)}")

        sink.commit().addCallbacks(stored, failed)


@implementer(IPushProducer)
class _FileStreamer:
    """Writes a file to a request in chunks while the request's transport takes them: a push
    producer that stops when paused and goes on when resumed, so a slow reader holds at most
    a chunk or two here (the tunnel stream's window does the rest)."""

    def __init__(self, f, request, size: int):
        self._file = f
        self._request = request
        self._left = size
        self._paused = False
        self._done = False

    def start(self) -> None:
        self._request.registerProducer(self, True)
        self._request.notifyFinish().addBoth(lambda _: self._close())
        self._pump()

    def _pump(self) -> None:
        while not self._paused and not self._done:
            chunk = self._file.read(min(CHUNK_BYTES, self._left)) if self._left > 0 else b""
            if not chunk:
                self._finish()
                return
            self._left -= len(chunk)
            self._request.write(chunk)

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        self._file.close()
        self._request.unregisterProducer()
        self._request.finish()

    def _close(self) -> None:
        self._done = True
        self._file.close()

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._pump()

    def stopProducing(self) -> None:
        self._close()


class FileLinkResource(_StagingResource):
    """``POST /v1/files-link/{key}`` (``X-Content-SHA256``, ``X-File-Size``): the file of that
    digest, if the content store holds one, linked under ``key``: 200 with what ``PUT`` answers
    (``skipped`` true), else 404 (upload it)."""

    def answer(self, request) -> None:
        if request.method != b"POST":
            write_problem(request, 405, "use POST", ((b"allow", b"POST"),))
            return
        try:
            target = self.staging.target_of(request.path, LINK_PREFIX)
        except BadStagingKey as e:
            write_problem(request, 400, str(e))
            return
        digest = _expected_sha256(request)
        size = request.getHeader(b"x-file-size")
        if digest is None or size is None or not size.isdigit() or len(size) > 20:
            write_problem(request, 400, "X-Content-SHA256 (64 hex digits) and X-File-Size "
                                        "(bytes) are required")
            return
        if not self.staging.in_store(target):
            write_problem(request, 404, "only files under models/ are kept by content")
            return
        if target.real_path in self.staging.uploads:
            write_problem(request, 409, "an upload of this key is in progress")
            return
        stored = StoredFile(target.key, int(size), digest, target.real_path)

        def link() -> bool:
            if not self.staging.store.link_into(digest, stored.size, target.real_path):
                return False
            self.staging.keep(target, digest)
            return True

        def reply(linked: bool) -> None:
            if request.finished or getattr(request, "_disconnected", False):
                return
            if linked:
                log.info("staged {key} from a file already here ({size} bytes, nothing "
                         "transferred)", key=target.key, size=stored.size)
                write_json(request, 200, stored.as_json(skipped=True))
            else:
                write_problem(request, 404, "no file with that digest and size on this worker")

        reactor = self.staging.reactor
        d = threads.deferToThreadPool(reactor, reactor.getThreadPool(), link)
        d.addCallbacks(reply, lambda f: write_problem(
            request, 500, f"linking failed: {failure_summary(f)}"))


class UploadProgressResource(_StagingResource):
    """``GET /v1/files-progress/{key}``: ``{"key", "received", "total"}`` of an upload in
    progress, 404 when none is."""

    def answer(self, request) -> None:
        if request.method not in (b"GET", b"HEAD"):
            write_problem(request, 405, "use GET", ((b"allow", b"GET, HEAD"),))
            return
        try:
            target = self.staging.target_of(request.path, PROGRESS_PREFIX)
        except BadStagingKey as e:
            write_problem(request, 400, str(e))
            return
        progress = self.staging.uploads.get(target.real_path)
        if progress is None:
            write_problem(request, 404, "no upload of this key is in progress")
        else:
            write_json(request, 200, progress.as_json())


