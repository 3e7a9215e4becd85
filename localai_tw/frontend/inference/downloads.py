"""Downloads of model files into the models directory: LocalAI's ``download_files`` and a URL
``parameters.model`` (``models.ModelDownload``), fetched by the frontend before a cold load.

:meth:`ModelDownloads.ensure` makes every download of a model present and verified:

- a file already present is kept when the config gives no ``sha256`` (LocalAI does the same),
  or when its digest matches (hashed in a thread, cached by size and mtime); a present file
  whose digest differs is downloaded again, and replaced only by a verified copy;
- ``http://`` and ``https://`` with Twisted's ``Agent`` (``RedirectAgent``: at most
  :data:`~.fetchpolicy.REDIRECT_LIMIT` redirects; only public destinations, checked at every connection,
  unless the operator allows private ones (``fetchpolicy.py``); a connect timeout; an idle
  timeout between body bytes; a size cap on ``Content-Length`` and on the bytes received), the body written chunk by chunk to
  a temporary file beside the target (``.<name>.<random>.partial``) and hashed as it arrives;
  ``file://`` (an absolute path on this machine, a regular file only: never a device or FIFO)
  is copied in a thread the same way, its bytes counted against the cap as it is read;
  ``huggingface://``/``hf://`` and ``github:`` are rewritten to their https URLs as LocalAI
  does (``HF_ENDPOINT`` honoured);
- the temporary file is checked against ``sha256`` and only then fsynced and renamed onto the
  final name, so the final name never shows a partial or unverified file; any failure (HTTP
  status, timeout, a connection that breaks, a mismatch, a full disk) removes it;
- one copy per digest: a download whose config gives a ``sha256`` the models directory already
  holds under another name (another model's download of the same file) is linked from the
  content store (``localai_tw/contentstore.py``) instead of fetched, and every verified
  download is kept there;
- one download per target at a time in this process: a request that needs a file being
  downloaded waits for that download (its own Deferred: cancelling it stops only its waiting);
- progress (bytes, total, rate) is logged at most every :data:`LOG_INTERVAL` seconds per
  download, is listed by :meth:`in_progress` (``/api/cluster/loads`` ``downloads``) and
  described by :meth:`describe` (the ``: loading model`` comments of a waiting stream).

A failure raises :class:`~.interfaces.ModelFileMismatch` (a digest that does not match: the
file and both digests named) or :class:`~.interfaces.ModelDownloadFailed` (the transfer
failed: the URL, shown without credentials or query, and the reason, except before a 200:
then one text whatever happened, the reason in the log, so an error cannot tell a refused
destination from a closed port or a timeout); nothing is remembered, so the next request tries
again.

What this module must never do: hold a file in memory (one chunk at a time); write outside the
models directory (the target is resolved with symlinks and checked); leave anything under the
final name that was not verified; block the reactor on a whole file (hashing a present file and
copying a ``file://`` run in threads; body chunks are written and hashed in a thread, the
connection paused while the disk is behind); log a URL's credentials or query string.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import tempfile
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from twisted.internet import defer, protocol, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import PotentialDataLoss, ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH

from localai_tw.contentstore import ContentStore
from localai_tw.deferreds import OneShotObserver
from localai_tw.staging_client import PARTIAL_SUFFIX
from localai_tw.threadwriter import ThreadedFileWriter, write_all

from localai_tw.frontend.inference.fetchpolicy import fetch_agent
from localai_tw.frontend.inference.interfaces import ModelDownloadFailed, ModelFileMismatch
from localai_tw.frontend.inference.modelfiles import DigestCache
from localai_tw.localai.model_config import ModelConfig, ModelDownload

log = Logger()

#: Largest file one download may bring (Content-Length or bytes received).
DEFAULT_MAX_DOWNLOAD_BYTES = 512 * 1024**3
DEFAULT_CONNECT_TIMEOUT = 30.0
#: Seconds without a byte (response headers, then body) before a download is abandoned.
DEFAULT_IDLE_TIMEOUT = 120.0
#: Seconds between two progress lines of one download in the log.
LOG_INTERVAL = 5.0
COPY_CHUNK = 1024 * 1024
USER_AGENT = b"localai-tw model download"


def shown_url(uri: str) -> str:
    """``uri`` for logs and errors: no user, password, query or fragment."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable URL>"
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def resolve_url(uri: str) -> str:
    """LocalAI's ``ResolveURL`` for the schemes downloaded here: ``huggingface://owner/repo/
    path[@branch]`` and ``hf://`` -> ``$HF_ENDPOINT/owner/repo/resolve/branch/path``,
    ``github:org/repo/path[@branch]`` -> raw.githubusercontent.com; others unchanged."""
    for prefix in ("huggingface://", "hf://"):
        if uri.startswith(prefix):
            rest = uri[len(prefix):]
            rest, _, branch = rest.partition("@")
            pieces = rest.split("/")
            if len(pieces) < 3:
                return uri
            endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
            return (f"{endpoint}/{pieces[0]}/{pieces[1]}/resolve/{branch or 'main'}/"
                    f"{'/'.join(pieces[2:])}")
    for prefix in ("github://", "github:"):
        if uri.startswith(prefix):
            rest, _, branch = uri[len(prefix):].partition("@")
            pieces = rest.split("/")
            if len(pieces) < 3:
                return uri
            return (f"https://raw.githubusercontent.com/{pieces[0]}/{pieces[1]}/"
                    f"{branch or 'main'}/{'/'.join(pieces[2:])}")
    return uri


class Download:
    """One download in progress: what, how far, and the waiters' one outcome."""

    def __init__(self, model: str, item: ModelDownload, target: str, url: str, started: float):
        self.model = model
        self.item = item
        self.target = target
        self.url = url
        self.started = started
        self.received = 0
        self.total: int | None = None
        self.done = OneShotObserver()
        self.waiters = 1
        self.logged_at = started
        #: stops the transfer now (set while one runs); ``stopping`` tells a file copy
        self.stop = None
        self.stopping = False

    def rate(self, now: float) -> float:
        elapsed = now - self.started
        return self.received / elapsed if elapsed > 0 else 0.0

    def as_json(self, now: float) -> dict[str, Any]:
        return {"model": self.model, "file": self.item.filename, "url": shown_url(self.url),
                "received": self.received, "total": self.total,
                "bytes_per_second": round(self.rate(now)),
                "seconds": round(now - self.started, 1), "waiting_requests": self.waiters}

    def describe(self, now: float) -> str:
        total = f"/{_mib(self.total)}" if self.total is not None else ""
        return (f"downloading {self.item.filename} {_mib(self.received)}{total} at "
                f"{_mib(self.rate(now))}/s")


def _mib(n: float) -> str:
    return f"{n / 1024**2:.1f} MiB"


class ModelDownloads:
    """The downloads of one replica into its models directory (module docstring).

    :param digests: the :class:`~.modelfiles.DigestCache` staging uses (a verified download is
        recorded there, so staging does not hash it again).
    :param agent: an ``IAgent`` (tests); default :func:`~.fetchpolicy.fetch_agent`: redirects
        followed, public destinations only unless ``allow_private`` (the operator's
        ``--allow-private-downloads``), ``connect_timeout``, a non-persistent pool.
    """

    def __init__(self, models_dir: str, reactor, digests: DigestCache | None = None, *,
                 agent=None, max_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                 log_interval: float = LOG_INTERVAL, allow_private: bool = False,
                 by_content: bool = True):
        self.models_dir = models_dir
        self._reactor = reactor
        self.digests = digests or DigestCache()
        #: one copy of each verified download, whatever names it (None: a directory of
        #: short-lived files, such as backend archives, keeps no second names)
        self.store = ContentStore(models_dir) if by_content else None
        self.max_bytes = max_bytes
        self.idle_timeout = idle_timeout
        self.log_interval = log_interval
        #: the operator's --allow-private-downloads (the gallery reads it too)
        self.allow_private = allow_private
        if agent is None:
            agent = fetch_agent(reactor, allow_private=allow_private,
                                connect_timeout=connect_timeout)
        self._agent = agent
        #: downloads running, by real target path
        self._active: dict[str, Download] = {}
        self._closed = False

    @property
    def agent(self):
        """The ``IAgent`` downloads use (the gallery fetches with it too: one policy)."""
        return self._agent

    # -- reading ---------------------------------------------------------------------------

    def in_progress(self) -> list[dict[str, Any]]:
        now = self._reactor.seconds()
        return [d.as_json(now) for d in sorted(self._active.values(), key=lambda d: d.started)]

    def describe(self, model_name: str) -> str | None:
        """What ``model_name`` is waiting for, when it waits for a download."""
        now = self._reactor.seconds()
        texts = [d.describe(now) for d in self._active.values() if d.model == model_name]
        return "; ".join(texts) or None

    # -- making files present --------------------------------------------------------------

    async def ensure(self, model: ModelConfig) -> None:
        """Every download of ``model`` present and verified (module docstring).
        :raises ModelFileMismatch: or its subclass ``ModelDownloadFailed``."""
        for item in model.downloads:
            await self._ensure_one(model, item)

    async def _ensure_one(self, model: ModelConfig, item: ModelDownload) -> None:
        target = self._target(model, item)
        for _ in range(3):
            running = self._active.get(target)
            if running is not None:
                running.waiters += 1
                try:
                    await running.done.when()
                finally:
                    running.waiters -= 1
                continue  # then checked against this config's own sha256 (cached: cheap)
            if await self._present(model, item, target):
                return
            if self._active.get(target) is not None:
                continue  # another request started it while this one looked
            if item.sha256 is not None and self.store is not None:
                if await self._linked(model, item, target):
                    return
                if self._active.get(target) is not None:
                    continue  # another request started it while this one asked the store
            await self._start(model, item, target)
            return
        raise ModelDownloadFailed(f"model {model.name}: {item.filename} was downloaded for "
                                  f"another config with another sha256 meanwhile; try again")

    async def _start(self, model: ModelConfig, item: ModelDownload, target: str) -> None:
        if self._closed:
            raise ModelDownloadFailed(f"model {model.name}: this replica is stopping; "
                                      f"{item.filename} is not downloaded")
        download = Download(model.name, item, target, resolve_url(item.uri),
                            self._reactor.seconds())
        self._active[target] = download
        log.info("downloading {file} for model {model} from {url} ({where})",
                 file=item.filename, model=model.name, url=shown_url(download.url),
                 where=item.where)

        def finished(result):
            if self._active.get(target) is download:
                del self._active[target]
            download.done.fire(result)

        defer.ensureDeferred(self._fetch(model, download)).addBoth(finished)
        try:
            await download.done.when()
        finally:
            download.waiters -= 1

    def close(self) -> None:
        """Stop every download in progress (the replica is stopping): each removes its
        temporary file and fails its waiters; no new one starts."""
        self._closed = True
        for download in list(self._active.values()):
            download.stopping = True
            if download.stop is not None:
                download.stop()

    def _target(self, model: ModelConfig, item: ModelDownload) -> str:
        root = os.path.realpath(self.models_dir)
        target = os.path.realpath(os.path.join(root, *item.filename.split("/")))
        if os.path.commonpath([root, target]) != root or target == root:
            raise ModelFileMismatch(f"model {model.name}: {item.where}.filename "
                                    f"{item.filename} resolves outside the models directory "
                                    f"(a symbolic link?)")
        return target

    async def _present(self, model: ModelConfig, item: ModelDownload, target: str) -> bool:
        def check() -> str | None:
            if not os.path.isfile(target):
                return None
            if item.sha256 is None:
                return ""
            return self.digests.digest(target)[1]

        try:
            digest = await threads.deferToThreadPool(self._reactor,
                                                     self._reactor.getThreadPool(), check)
        except OSError as e:
            raise ModelFileMismatch(f"model {model.name}: {item.filename} cannot be read: "
                                    f"{e.strerror}") from None
        if digest is None:
            return False
        if digest == "" or digest == item.sha256:
            return True
        log.warn("model {model}: {file} is present with sha256 {digest}, {where} says "
                 "{expected}; downloading it again (the present file stays until a verified "
                 "copy replaces it)", model=model.name, file=item.filename, digest=digest,
                 where=item.where, expected=item.sha256)
        return False

    async def _linked(self, model: ModelConfig, item: ModelDownload, target: str) -> bool:
        """The file, when the content store holds its digest: linked under ``target``."""
        def link() -> bool:
            if not self.store.link_into(item.sha256, None, target):
                return False
            st = os.stat(target)
            self.digests.record(target, st.st_size, st.st_mtime_ns, item.sha256)
            return True

        try:
            linked = await threads.deferToThreadPool(self._reactor,
                                                     self._reactor.getThreadPool(), link)
        except OSError as e:
            log.warn("model {model}: linking {file} from the content store failed ({e}); "
                     "downloading it", model=model.name, file=item.filename, e=e.strerror)
            return False
        if linked:
            log.info("model {model}: {file} is the same file as one already downloaded "
                     "(sha256 {digest}): linked, not downloaded", model=model.name,
                     file=item.filename, digest=item.sha256)
        return linked

    # -- one download ----------------------------------------------------------------------

    async def _fetch(self, model: ModelConfig, download: Download) -> None:
        pool = self._reactor.getThreadPool()
        try:
            fd, temp = await threads.deferToThreadPool(self._reactor, pool, _open_temp,
                                                       download.target)
        except OSError as e:
            name = download.item.filename
            raise ModelDownloadFailed(f"model {model.name}: cannot create {name} in the "
                                      f"models directory: {e.strerror}") from None
        state = {"fd": fd}
        try:
            if download.url.startswith("file://"):
                digest = await threads.deferToThreadPool(
                    self._reactor, pool, self._copy_blocking, model, download, fd)
            else:
                digest = await self._http_get(model, download, fd)
            expected = download.item.sha256
            if expected is not None and digest != expected:
                raise ModelFileMismatch(
                    f"model {model.name}: {download.item.filename} downloaded from "
                    f"{shown_url(download.url)} has sha256 {digest}, {download.item.where} "
                    f"says {expected}; the download was discarded")
            state["fd"] = -1
            try:
                await threads.deferToThreadPool(self._reactor, pool, self._commit, fd, temp,
                                                download.target, digest)
            except OSError as e:  # a directory in the way, a full disk at fsync
                raise ModelDownloadFailed(
                    f"model {model.name}: {download.item.filename} cannot be written in the "
                    f"models directory: {e.strerror or e}") from None
        except BaseException:
            if state["fd"] >= 0:
                os.close(state["fd"])
            _unlink_quietly(temp)
            raise
        log.info("downloaded {file} for model {model}: {size} bytes in {took:.1f} s, sha256 "
                 "{digest}", file=download.item.filename, model=model.name,
                 size=download.received, took=self._reactor.seconds() - download.started,
                 digest=digest)

    def _commit(self, fd: int, temp: str, target: str, digest: str) -> None:
        """fsync, rename onto the final name, fsync the directory.  Blocking."""
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
        directory_fd = os.open(os.path.dirname(target), os.O_RDONLY)
        try:
            os.fsync(directory_fd)
        finally:
            os.close(directory_fd)
        try:
            if self.store is not None:
                self.store.remember(target, digest)
                self.store.sweep()
        except OSError as e:  # the download is good where it is; only the sharing failed
            log.warn("the content store failed for {target}: {e}", target=target, e=e.strerror)
        st = os.stat(target)
        self.digests.record(target, st.st_size, st.st_mtime_ns, digest)

    def _note(self, download: Download) -> None:
        now = self._reactor.seconds()
        if now - download.logged_at >= self.log_interval:
            download.logged_at = now
            total = download.total if download.total is not None else "?"
            log.info("downloading {file} for model {model}: {received}/{total} bytes, "
                     "{rate} bytes/s", file=download.item.filename, model=download.model,
                     received=download.received, total=total,
                     rate=round(download.rate(now)))

    def _copy_blocking(self, model: ModelConfig, download: Download, fd: int) -> str:
        parts = urlsplit(download.url)
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise ModelDownloadFailed(f"model {model.name}: {download.item.where}: a file:// "
                                      f"URL must name an absolute path on the frontend "
                                      f"(file:///path)")
        digest = hashlib.sha256()
        try:
            with open_regular_file(path) as source:
                download.total = os.fstat(source.fileno()).st_size
                if download.total > self.max_bytes:
                    raise ModelDownloadFailed(
                        f"model {model.name}: {path} is larger than the download cap of "
                        f"{self.max_bytes} bytes")
                while True:
                    if download.stopping:
                        raise ModelDownloadFailed(f"model {model.name}: the replica stopped "
                                                  f"while copying {path}")
                    chunk = source.read(COPY_CHUNK)
                    if not chunk:
                        break
                    if download.received + len(chunk) > self.max_bytes:  # it grew
                        raise ModelDownloadFailed(
                            f"model {model.name}: {path} is larger than the download cap of "
                            f"{self.max_bytes} bytes")
                    write_all(fd, chunk)
                    digest.update(chunk)
                    download.received += len(chunk)
                    self._reactor.callFromThread(self._note, download)
        except OSError as e:
            raise ModelDownloadFailed(f"model {model.name}: copying {path} for "
                                      f"{download.item.filename} failed: {e.strerror}") from None
        return digest.hexdigest()

    async def _http_get(self, model: ModelConfig, download: Download, fd: int) -> str:
        shown = shown_url(download.url)
        what = f"model {model.name}: downloading {download.item.filename} from {shown}"
        try:
            url = download.url.encode("ascii")
        except UnicodeEncodeError:
            raise ModelDownloadFailed(f"{what}: the URL must be ASCII (percent-encode it)") \
                from None
        asked = self._agent.request(b"GET", url, Headers({b"user-agent": [USER_AGENT]}))
        download.stop = asked.cancel
        timer = self._reactor.callLater(self.idle_timeout, asked.cancel)
        try:
            response = await asked
        except defer.CancelledError:
            if download.stopping:
                raise ModelDownloadFailed(f"{what}: the replica is stopping") from None
            raise self._failed(what, f"no answer within {self.idle_timeout:g} s") from None
        except Exception as e:
            raise self._failed(what, failure_reason(e)) from None
        finally:
            if timer.active():
                timer.cancel()
        download.stop = None
        if download.stopping:
            response.deliverBody(_Discard())
            raise ModelDownloadFailed(f"{what}: the replica is stopping")
        if response.code != 200:
            response.deliverBody(_Discard())
            raise self._failed(what, f"the server answered HTTP {response.code} "
                                     f"{_phrase(response)}")
        if response.length is not UNKNOWN_LENGTH:
            if response.length > self.max_bytes:
                response.deliverBody(_Discard())
                raise ModelDownloadFailed(f"{what}: {response.length} bytes is more than the "
                                          f"download cap of {self.max_bytes} bytes")
            download.total = response.length
        body = _BodyToFile(self, download, fd, what)
        download.stop = lambda: body._abort(ModelDownloadFailed(f"{what}: the replica is "
                                                                f"stopping"))
        response.deliverBody(body)
        try:
            return await body.finished
        finally:
            download.stop = None

    @staticmethod
    def _failed(what: str, reason: str) -> ModelDownloadFailed:
        """One text for every way a request can fail before a 200 (refused destination,
        connection refused, timeout, DNS, TLS, an HTTP status), so whoever reads the error
        cannot map the replica's network with it; the reason goes to the operator's log."""
        log.warn("{what} failed: {reason}", what=what, reason=reason)
        return ModelDownloadFailed(f"{what} failed; the frontend's log says why")


class NotARegularFile(OSError):
    """A ``file://`` source that is a device, FIFO, socket or directory."""


def open_regular_file(path: str):
    """``path`` opened for reading in binary, only if it is a regular file.

    Opened non-blocking first, so a FIFO with no writer cannot hold a thread, then checked
    with ``fstat`` on the opened descriptor (no race with a rename): ``/dev/zero``, a FIFO or
    ``/proc`` entry never ends or never answers, so none is read.
    :raises NotARegularFile: (an ``OSError`` whose ``strerror`` says so)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotARegularFile(errno.EINVAL, "not a regular file (a device, FIFO, socket "
                                  "or directory is never read)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def failure_reason(error: BaseException) -> str:
    reasons = getattr(error, "reasons", None)  # ResponseFailed and friends wrap Failures
    if reasons:
        return "; ".join(r.getErrorMessage() for r in reasons)[:500]
    return (str(error) or type(error).__name__)[:500]


def _phrase(response) -> str:
    phrase = response.phrase or b""
    return phrase[:80].decode("ascii", "replace")


def _open_temp(target: str) -> tuple[int, str]:
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    return tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(target) + ".",
                            suffix=PARTIAL_SUFFIX)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Discard(protocol.Protocol):
    """A body nobody reads: the connection is dropped at once."""

    def connectionMade(self) -> None:
        self.transport.stopProducing()

    def connectionLost(self, reason) -> None:
        pass


class _BodyToFile(protocol.Protocol):
    """A response body written to ``fd`` and hashed off the reactor
    (:class:`~localai_tw.threadwriter.ThreadedFileWriter`: the connection is paused while the
    disk is behind); ``finished`` fires with the hex digest once every byte is on its way to the
    disk, or fails with ``ModelDownloadFailed`` (cap, idle timeout, broken connection, disk
    full)."""

    def __init__(self, owner: ModelDownloads, download: Download, fd: int, what: str):
        self.owner = owner
        self.download = download
        self.what = what
        self.hash = hashlib.sha256()
        self.writer = ThreadedFileWriter(owner._reactor, fd, self.hash,
                                         on_error=self._write_failed)
        self.finished: defer.Deferred = defer.Deferred()
        self.error: BaseException | None = None
        self.timer = None
        self.transport = None

    def connectionMade(self) -> None:
        self.writer.producer = self.transport
        self.timer = self.owner._reactor.callLater(self.owner.idle_timeout, self._idle)

    def _idle(self) -> None:
        self._abort(ModelDownloadFailed(
            f"{self.what}: no data for {self.owner.idle_timeout:g} s after "
            f"{self.download.received} bytes"))

    def _abort(self, error: BaseException) -> None:
        if self.error is None and self.transport is not None:
            self.error = error
            self.transport.stopProducing()

    def _write_failed(self, e: BaseException) -> None:
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        reason = "the disk is full" if full else (getattr(e, "strerror", None) or str(e))
        self._abort(ModelDownloadFailed(f"{self.what}: writing failed: {reason}"))

    def dataReceived(self, data: bytes) -> None:
        if self.error is not None:
            return
        if self.download.received + len(data) > self.owner.max_bytes:
            self._abort(ModelDownloadFailed(f"{self.what}: more than the download cap of "
                                            f"{self.owner.max_bytes} bytes"))
            return
        self.writer.write(data)
        self.download.received += len(data)
        if self.timer is not None and self.timer.active():
            self.timer.reset(self.owner.idle_timeout)
        self.owner._note(self.download)

    def connectionLost(self, reason) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        # The file descriptor is closed by the caller once ``finished`` fired: no batch may
        # still be in a thread then, whatever the outcome.
        self.writer.drained().addBoth(self._decide, reason)

    def _decide(self, drained, reason) -> None:
        if self.error is not None:
            self.finished.errback(self.error)
        elif isinstance(drained, Failure):
            self._write_failed(drained.value)  # sets self.error when a transport is attached
            self.finished.errback(self.error or drained.value)
        elif reason.check(ResponseDone) or (
                reason.check(PotentialDataLoss) and self.download.total is None):
            if self.download.total is not None and self.download.received != self.download.total:
                self.finished.errback(ModelDownloadFailed(
                    f"{self.what}: the body ended after {self.download.received} of "
                    f"{self.download.total} bytes"))
            else:
                self.finished.callback(self.hash.hexdigest())
        else:
            total = self.download.total if self.download.total is not None else "?"
            self.finished.errback(ModelDownloadFailed(
                f"{self.what}: the connection broke after {self.download.received} of {total} "
                f"bytes ({failure_reason(reason.value)}); nothing was kept, the next request "
                "tries again"))
