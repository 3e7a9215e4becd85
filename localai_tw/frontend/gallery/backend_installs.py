"""Backends installed from LocalAI's backend gallery onto workers (``docs/backends.md``, "The
backend gallery"): what an install and a delete job of ``installs.GalleryJobs`` does when the
job is a backend's (the job machinery, its ``gallery_jobs`` row, broadcasts and
``/backends/jobs/{id}`` are the model gallery's).

An install:

1. finds the entry in the operator's ``--backend-galleries`` (a meta backend picks its CPU
   entry: ``backend_index.concrete_for``);
2. makes the archive present on this replica: a directory is packed into a tar archive (in a
   thread; bounded), a ``file://`` archive is read where it is, an ``http(s)://`` one is
   downloaded with the model downloads' machinery (``downloads.ModelDownloads``: destination
   policy, redirects, size cap, temporary file renamed when whole) from ``uri`` then each of
   ``mirrors``; its sha256 is checked against the entry's; an OCI image is refused, naming why;
3. stages it on each target worker (every connected backend worker, or the one node asked)
   over its tunnel with file staging (digest checked on arrival) and asks the worker to unpack
   it (``backends.install``, ``worker/backend_install.py``);
4. reports progress (bytes fetched, bytes staged per node, the node unpacking) and ends
   ``done`` when every target installed it, else ``failed`` naming each node and why.

What this module must never do: fetch a URI an API caller chose (only the operator's
galleries' entries); read this replica's disk for an entry of a remote gallery unless the
operator allows local sources (``backend_index.local_source_allowed``); hold an archive in
memory; hash or pack on the reactor thread; leave a packed or downloaded archive behind.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
import types
from typing import Any, Awaitable, Callable
from urllib.parse import unquote, urlsplit

import yaml
from twisted.internet import threads
from twisted.logger import Logger

from localai_tw import errors
from localai_tw.cluster.nodes import NodeNotFound
from localai_tw.frontend.gallery.backend_index import (
    DOWNLOAD,
    OCI,
    BackendEntry,
    concrete_for,
    local_source_allowed,
    parse_backend_index,
    source_kind,
)
from localai_tw.frontend.gallery.index import MAX_INDEX_BYTES, Gallery, GalleryError, yaml_load
from localai_tw.frontend.gallery.installs import read_url
from localai_tw.frontend.inference.downloads import ModelDownloads, shown_url
from localai_tw.frontend.inference.interfaces import ModelFileMismatch
from localai_tw.frontend.inference.modelfiles import DigestCache
from localai_tw.localai.model_config import ModelDownload

log = Logger()

#: The most a directory entry may pack to (what the worker unpacks at most, too).
MAX_PACKED_BYTES = 64 * 1024**3
MAX_PACKED_MEMBERS = 200_000
#: Seconds a worker may take to receive an archive, and to unpack it.
STAGE_TIMEOUT = 3600.0
INSTALL_TIMEOUT = 1800.0
CALL_TIMEOUT = 60.0
#: Where workers receive archives (``worker/backend_install.py`` ``ARCHIVE_PREFIX``).
ARCHIVE_KEY_PREFIX = "data/backend-archives/"

#: ``report(**fields)``: the job's snapshot updated and broadcast; returns a Deferred (awaited
#: where the order matters, not from a progress callback).
Report = Callable[..., Any]
#: ``stage(node_id, key, path, progress_cb, known)`` -> a Deferred firing when staged.
Stage = Callable[..., Awaitable[Any]]


def _pack_directory(source: str, target: str) -> None:
    """``source`` packed into the tar ``target`` (blocking).  Symbolic links are kept as
    links (the worker refuses one leading out); special files are refused.
    :raises GalleryError:"""
    count = total = 0

    def check(info: tarfile.TarInfo):
        nonlocal count, total
        count += 1
        if count > MAX_PACKED_MEMBERS:
            raise GalleryError(f"{source} holds more than {MAX_PACKED_MEMBERS} entries")
        if not (info.isfile() or info.isdir() or info.issym() or info.islnk()):
            raise GalleryError(f"{source}: {info.name} is a device, FIFO or socket")
        total += info.size if info.isfile() else 0
        if total > MAX_PACKED_BYTES:
            raise GalleryError(f"{source} holds more than {MAX_PACKED_BYTES} bytes")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(target, "w") as tar:
        for name in sorted(os.listdir(source)):
            tar.add(os.path.join(source, name), arcname=name, recursive=True, filter=check)


def _remove(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


class BackendInstalls:
    """Backend gallery installs and deletes on workers (module docstring).

    :param galleries: the operator's ``--backend-galleries``.
    :param archives_dir: where this replica packs and downloads archives.
    :param nodes: the ``NodeRegistry``; :param control: the ``ControlClient``.
    :param stage: stages a local file on a worker (``tunnel.endpoint.upload_file`` with the
        node's control token; given by the composition root).
    :param agent: the downloads' ``IAgent`` (one destination policy for every fetch).
    :param allow_private: ``--allow-private-downloads``.
    """

    def __init__(self, galleries: tuple[Gallery, ...], archives_dir: str, reactor, *,
                 nodes, control, stage: Stage, agent=None, allow_private: bool = False,
                 progress_interval: float = 1.0):
        self.galleries = galleries
        self.archives_dir = archives_dir
        self._reactor = reactor
        self._nodes = nodes
        self._control = control
        self._stage = stage
        self._agent = agent
        self.allow_private = allow_private
        self.progress_interval = progress_interval
        # archives are removed once installed: no content store keeps a second name for them
        self.downloads = ModelDownloads(archives_dir, reactor, DigestCache(), agent=agent,
                                        allow_private=allow_private,
                                        max_bytes=MAX_PACKED_BYTES, by_content=False)

    def close(self) -> None:
        """The replica is stopping: downloads in progress stop (their temporary files go)."""
        self.downloads.close()

    def _in_thread(self, fn, *args):
        return threads.deferToThreadPool(self._reactor, self._reactor.getThreadPool(), fn,
                                         *args)

    # -- the indexes -----------------------------------------------------------------------

    async def available(self) -> list[BackendEntry]:
        """Every usable entry of every backend gallery. :raises GalleryError:"""
        out: list[BackendEntry] = []
        for gallery in self.galleries:
            data = await read_url(gallery.url, MAX_INDEX_BYTES, self._reactor, self._agent)
            try:
                decoded = await self._in_thread(lambda: yaml_load(data, index=True))
            except yaml.YAMLError as e:
                raise GalleryError(f"backend gallery {gallery.name}: the index is not YAML or "
                                   f"JSON ({str(e)[:200]})") from None
            entries, skipped = parse_backend_index(decoded, gallery)
            if skipped:
                log.warn("backend gallery {gallery}: {n} entries left out (no usable name, "
                         "or bad fields)", gallery=gallery.name, n=skipped)
            out.extend(entries)
        return out

    async def find(self, wanted: str) -> tuple[BackendEntry, list[BackendEntry]]:
        """The entry ``gallery@name`` or ``name`` (LocalAI also finds an entry by its
        alias), and every entry.  :raises GalleryError:"""
        if not self.galleries:
            raise GalleryError(f"no backend gallery entry {wanted[:256]!r}: no backend gallery "
                               "is configured (start the frontend with --backend-galleries)")
        entries = await self.available()
        for match in (lambda e: wanted in (e.id, e.name), lambda e: e.alias == wanted):
            for entry in entries:
                if match(entry):
                    return entry, entries
        raise GalleryError(f"no backend gallery entry {wanted[:256]!r}; GET "
                           "/backends/available lists them")

    # -- targets ---------------------------------------------------------------------------

    async def targets(self, node_id: str | None) -> tuple[list[Any], list[str]]:
        """The nodes an operation goes to, and the backend workers left out (and why)."""
        if node_id is not None:
            try:
                return [await self._nodes.get_node(node_id)], []
            except NodeNotFound:
                raise GalleryError(f"node {node_id} was deleted before the job ran") from None
        chosen, skipped = [], []
        for node in await self._nodes.list_nodes(node_type="backend"):
            status = getattr(node.status, "value", node.status)
            if status in ("healthy", "draining") and node.approved:
                chosen.append(node)
            else:
                skipped.append(f"{node.name} ({status})")
        return chosen, skipped

    # -- install ---------------------------------------------------------------------------

    async def installed_on(self, node) -> list[dict]:
        """The backends a node has installed (``backends.list``). :raises ClusterError:"""
        reply = await self._control.call(node.id, "backends.list", {}, timeout=CALL_TIMEOUT)
        return [b for b in (reply or {}).get("installed") or () if isinstance(b, dict)]

    async def _has(self, node, name: str) -> bool:
        try:
            return any(b.get("name") == name and b.get("runnable")
                       for b in await self.installed_on(node))
        except errors.ClusterError:
            return False  # asked again by the install, which then says why

    async def install(self, entry: BackendEntry, entries: list[BackendEntry],
                      node_id: str | None, report: Report, *, force: bool = False) -> dict:
        """Install ``entry`` (module docstring).  Returns the result's fields for the job's
        final snapshot.  :raises GalleryError: naming what failed."""
        concrete, meta = entry, None
        if entry.is_meta:
            concrete, meta = concrete_for(entry, entries), entry
        nodes, skipped = await self.targets(node_id)
        if not nodes:
            raise GalleryError("no backend worker is connected and approved: nothing to "
                               "install on" + (f" (left out: {', '.join(skipped)})"
                                               if skipped else ""))
        outcome: dict[str, str] = {}
        if not force:  # LocalAI's apply is idempotent unless "force": true
            wanted = meta.name if meta is not None else concrete.name
            for node in list(nodes):
                if await self._has(node, wanted) and (meta is None
                                                      or await self._has(node, concrete.name)):
                    outcome[node.name] = "already installed"
                    nodes.remove(node)
        sha256 = ""
        if nodes:
            await report(message="fetching",
                         file_name=concrete.uri and shown_url(concrete.uri))
            path, sha256, owned = await self._archive(concrete, report)
            try:
                size = await self._in_thread(os.path.getsize, path)
                key = f"{ARCHIVE_KEY_PREFIX}{concrete.name}-{sha256[:16]}.tar"
                for node in nodes:
                    outcome[node.name] = await self._install_on(
                        node, concrete, meta, key, path, size, sha256, report)
            finally:
                if owned:
                    await self._in_thread(_remove, path)
        failed = {n: why for n, why in outcome.items()
                  if why not in ("installed", "already installed")}
        if failed:
            raise GalleryError(
                f"backend {concrete.name} was not installed on "
                + "; ".join(f"node {n}: {why}" for n, why in failed.items())
                + (f" (installed on {', '.join(n for n in outcome if n not in failed)})"
                   if len(failed) < len(outcome) else ""))
        return {"backend": concrete.name, "meta_backend": meta.name if meta else "",
                "sha256": sha256, "nodes": outcome, "skipped_nodes": skipped}

    async def _install_on(self, node, concrete: BackendEntry, meta: BackendEntry | None,
                          key: str, path: str, size: int, sha256: str,
                          report: Report) -> str:
        last = [0.0]

        def progress(sent: int, total: int) -> None:
            now = self._reactor.seconds()
            if now - last[0] >= self.progress_interval:
                last[0] = now
                # (a broadcast; the job's final snapshot is the record)
                report(message=f"staging on node {node.name}", current_bytes=sent,
                       total_bytes=total,
                       progress=round(100.0 * sent / total, 1) if total else 0)

        try:
            await report(message=f"staging on node {node.name}", current_bytes=0,
                         total_bytes=size, progress=0)
            await self._stage(node.id, key, path, progress, (size, sha256))
            await report(message=f"unpacking on node {node.name}", progress=100)
            body = {"name": concrete.name, "archive": key, "sha256": sha256,
                    "metadata": {"alias": concrete.alias, "name": concrete.name,
                                 "gallery_url": concrete.gallery.url,
                                 "version": concrete.version, "uri": concrete.uri}}
            if meta is not None:
                body["meta_name"] = meta.name
            await self._control.call(node.id, "backends.install", body,
                                     timeout=INSTALL_TIMEOUT)
        except errors.ControlVerbFailed as e:
            return e.error
        except errors.VerbNotServed:
            return "this worker's version installs no backends (upgrade it)"
        except errors.ClusterError as e:
            return str(e)
        except (OSError, ValueError) as e:
            return f"the archive could not be sent: {e}"
        log.info("backend {name} installed on node {node}", name=concrete.name, node=node.name)
        return "installed"

    async def _archive(self, entry: BackendEntry,
                       report: Report) -> tuple[str, str, bool]:
        """``(path, sha256, owned)`` of the entry's archive on this replica; ``owned``: a
        file this replica made (removed afterwards).  :raises GalleryError:"""
        errors_seen: list[str] = []
        for uri in (entry.uri, *entry.mirrors):
            try:
                return await self._fetch(entry, uri, report)
            except GalleryError as e:
                errors_seen.append(str(e))
                if len(entry.mirrors) and uri != entry.mirrors[-1]:
                    log.warn("backend {name}: {why}; trying the next mirror", name=entry.name,
                             why=str(e))
        raise GalleryError("; ".join(errors_seen))

    async def _fetch(self, entry: BackendEntry, uri: str,
                     report: Report) -> tuple[str, str, bool]:
        kind = source_kind(uri)
        shown = shown_url(uri)
        if kind == OCI:
            raise GalleryError(
                f"backend {entry.name}: {shown} is an OCI image, and this cluster installs "
                "backends from directories and tar archives only (it has no OCI registry "
                "client): name the backend's directory or a tar archive of it (for example "
                "what `docker export` of the image writes) in the gallery")
        if kind == DOWNLOAD:
            return await self._download(entry, uri, report)
        if not local_source_allowed(entry.gallery, self.allow_private):
            raise GalleryError(
                f"backend {entry.name}: {shown} is on this replica's disk, named by the remote "
                f"gallery {entry.gallery.name}; a local source is read only from a file:// "
                "gallery, or with --allow-private-downloads")
        path = unquote(urlsplit(uri).path) if uri.startswith("file://") else uri
        os.makedirs(self.archives_dir, exist_ok=True)

        def local() -> tuple[str, str, bool]:
            if os.path.isdir(path):
                if entry.sha256:
                    raise GalleryError(f"backend {entry.name}: sha256 is given, but {shown} "
                                       "is a directory (a digest names an archive)")
                fd, packed = tempfile.mkstemp(prefix=f".{entry.name}.", suffix=".tar",
                                              dir=self.archives_dir)
                os.close(fd)
                try:
                    _pack_directory(path, packed)
                    return packed, DigestCache().digest(packed)[1], True
                except BaseException:
                    _remove(packed)
                    raise
            if not os.path.isfile(path):
                raise GalleryError(f"backend {entry.name}: {shown} cannot be read: it is "
                                   "neither a directory nor a regular file")
            digest = DigestCache().digest(path)[1]
            if entry.sha256 and digest != entry.sha256:
                raise GalleryError(f"backend {entry.name}: {shown} has sha256 {digest}, the "
                                   f"gallery says {entry.sha256}")
            return path, digest, False

        try:
            return await self._in_thread(local)
        except OSError as e:
            raise GalleryError(f"backend {entry.name}: {shown} cannot be read: "
                               f"{e.strerror or e}") from None
        except tarfile.TarError as e:
            raise GalleryError(f"backend {entry.name}: {shown} cannot be packed: {e}") from None

    async def _download(self, entry: BackendEntry, uri: str,
                        report: Report) -> tuple[str, str, bool]:
        os.makedirs(self.archives_dir, exist_ok=True)
        filename = f"{entry.name}.download"
        target = os.path.join(self.archives_dir, filename)
        await self._in_thread(_remove, target)  # never a stale copy without a digest
        item = ModelDownload(filename=filename, uri=uri, sha256=entry.sha256 or None,
                             where=f"backend {entry.id}: uri")
        model = types.SimpleNamespace(name=f"backend {entry.name}", downloads=(item,))
        loop = None
        if self.progress_interval:
            from twisted.internet import task

            def tick() -> None:
                for d in self.downloads.in_progress():
                    if d["model"] == model.name:
                        total = d.get("total") or 0
                        report(message="downloading", current_bytes=d["received"],
                               total_bytes=total, bytes_per_second=d["bytes_per_second"],
                               progress=round(100.0 * d["received"] / total, 1) if total
                               else 0)

            loop = task.LoopingCall(tick)
            loop.clock = self._reactor
            loop.start(self.progress_interval, now=False)
        try:
            await self.downloads.ensure(model)
        except ModelFileMismatch as e:
            await self._in_thread(_remove, target)
            raise GalleryError(str(e)) from None
        finally:
            if loop is not None and loop.running:
                loop.stop()
        digest = (await self._in_thread(self.downloads.digests.digest, target))[1]
        return target, digest, True

    # -- delete ----------------------------------------------------------------------------

    async def delete(self, name: str, node_id: str | None) -> dict:
        """``backends.delete`` on the target nodes.  A node that does not have it is not a
        failure when another one had it.  :raises GalleryError:"""
        nodes, skipped = await self.targets(node_id)
        if not nodes:
            raise GalleryError("no backend worker is connected and approved")
        outcome: dict[str, str] = {}
        for node in nodes:
            try:
                reply = await self._control.call(node.id, "backends.delete", {"name": name},
                                                 timeout=CALL_TIMEOUT)
                outcome[node.name] = "deleted: " + ", ".join(reply.get("deleted") or [name])
            except errors.ControlVerbFailed as e:
                outcome[node.name] = e.error
            except errors.ClusterError as e:
                outcome[node.name] = str(e)
        deleted = [n for n, why in outcome.items() if why.startswith("deleted")]
        refused = {n: why for n, why in outcome.items()
                   if not why.startswith("deleted") and "is not installed" not in why}
        if refused or not deleted:
            raise GalleryError(f"backend {name} was not deleted on "
                               + "; ".join(f"node {n}: {why}" for n, why in outcome.items()
                                           if not why.startswith("deleted"))
                               + (f" (deleted on {', '.join(deleted)})" if deleted else ""))
        return {"backend": name, "nodes": outcome, "skipped_nodes": skipped}
