"""Backends installed from a gallery onto this worker: the ``backends.install``,
``backends.list`` and ``backends.delete`` control verbs (``docs/backends.md``, "The backend
gallery").

A frontend fetches a gallery entry's archive (or packs its directory) on its own side, checks
its sha256, and stages it here with file staging (``PUT /v1/files/data/backend-archives/...``,
digest checked again on arrival).  ``backends.install {name, archive, sha256, metadata?,
meta_name?}`` then unpacks it into ``<backends-path>/<name>`` the way LocalAI's
``InstallBackend`` does: into a temporary directory beside the target, ``run.sh`` required
(an archive holding one top-level directory with ``run.sh`` is taken as that directory),
``metadata.json`` written with LocalAI's fields, the old install moved aside and replaced by
a rename, so the backends directory never shows a half-unpacked backend.  ``meta_name``
also writes LocalAI's meta backend directory (``{"meta_backend_for": name}``).  The staged
archive is removed afterwards, whatever the outcome.

``backends.list`` answers the installed directories with their ``metadata.json``;
``backends.delete {name}`` removes one (and the concrete backend a meta backend names, as
LocalAI does), refused while a backend process of that name runs.

What this module must never do: write outside the backends directory: an archive member with
an absolute name, a ``..`` component, a link (symbolic or hard) leading out of the backend's
directory, a device or FIFO is refused and nothing of the archive is kept (``tarfile``'s
``data`` filter, plus a walk of the result); unpack more than :data:`MAX_UNPACKED_BYTES` or
:data:`MAX_MEMBERS` entries; read an archive that is not the staged one, or whose sha256 is not
the one the frontend named; unpack or delete on the reactor thread; answer a failure as
anything but ``success: false`` with the reason (paths inside the worker are named relative
to the backends directory).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from typing import Any, Callable

from twisted.internet import threads
from twisted.logger import Logger

from localai_tw.backends.directory import METADATA_FILE, NAME_RE, RUN_FILE, read_metadata
from localai_tw.staging_client import BadStagingKey, parse_key
from localai_tw.worker.control import BadVerbRequest, VerbRequestSchema

log = Logger()

#: Where frontends stage archives (under the staging data root).
ARCHIVE_PREFIX = "data/backend-archives/"
#: The most an archive may unpack to, and the most entries it may hold.
MAX_UNPACKED_BYTES = 64 * 1024**3
MAX_MEMBERS = 200_000
#: The metadata fields a frontend may pass on (LocalAI's ``BackendMetadata``).
METADATA_FIELDS = ("alias", "name", "gallery_url", "version", "uri")
_HASH_CHUNK = 1024 * 1024


class InstallError(Exception):
    """Why an archive was not installed (the text the frontend's job shows)."""


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def _write_metadata(directory: str, metadata: dict) -> None:
    with open(os.path.join(directory, METADATA_FILE), "w", encoding="utf-8") as f:
        json.dump(metadata, f, indent=2)


def _check_member(member: tarfile.TarInfo) -> None:
    name = member.name
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise InstallError(f"archive member {name[:200]!r} has an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise InstallError(f"archive member {name[:200]!r} has a '..' component")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise InstallError(f"archive member {name[:200]!r} is a device, FIFO or other "
                           "special file")
    if member.issym() and os.path.isabs(member.linkname):
        raise InstallError(f"archive member {name[:200]!r} is a symbolic link to an absolute "
                           f"path ({member.linkname[:200]})")


def _links_stay_inside(root: str) -> None:
    """Every symbolic link under ``root`` resolves inside it (after the whole archive is
    unpacked: a later member cannot redirect an earlier link out)."""
    real_root = os.path.realpath(root)
    for directory, dirnames, filenames in os.walk(root):
        for entry in dirnames + filenames:
            path = os.path.join(directory, entry)
            if os.path.islink(path):
                target = os.path.realpath(path)
                if os.path.commonpath([real_root, target]) != real_root:
                    raise InstallError(f"archive member {os.path.relpath(path, root)!r} is a "
                                       "symbolic link leading out of the backend's directory")


def unpack(archive: str, parent: str, name: str, *, max_bytes: int = MAX_UNPACKED_BYTES,
           max_members: int = MAX_MEMBERS) -> tuple[str, int, int]:
    """Unpack ``archive`` into a new temporary directory under ``parent`` (blocking: run in a
    thread).  Returns ``(backend root, files, bytes)``; the root is the temporary directory,
    or its one top-level directory when only that holds ``run.sh``.  On any failure the
    temporary directory is removed.  :raises InstallError:"""
    temp = tempfile.mkdtemp(prefix=f".{name}.install-", dir=parent)
    try:
        files = total = count = 0
        try:
            with tarfile.open(archive, "r:*") as tar:
                for member in tar:
                    count += 1
                    if count > max_members:
                        raise InstallError(f"the archive holds more than {max_members} entries")
                    _check_member(member)
                    if member.isfile():
                        files += 1
                        total += member.size
                        if total > max_bytes:
                            raise InstallError(f"the archive unpacks to more than {max_bytes} "
                                               "bytes")
                    try:
                        tar.extract(member, temp, filter="data")
                    except tarfile.FilterError as e:
                        raise InstallError(f"archive member {member.name[:200]!r} refused: "
                                           f"{e}") from None
        except tarfile.TarError as e:
            raise InstallError(f"not a tar archive, or a damaged one ({e})") from None
        root = temp
        if not os.path.lexists(os.path.join(temp, RUN_FILE)):
            entries = os.listdir(temp)
            only = os.path.join(temp, entries[0]) if len(entries) == 1 else None
            if only and os.path.isdir(only) and not os.path.islink(only) \
                    and os.path.lexists(os.path.join(only, RUN_FILE)):
                root = only
        run_file = os.path.join(root, RUN_FILE)
        if not os.path.isfile(run_file) or os.path.islink(run_file):
            raise InstallError(f"not a LocalAI backend: the archive has no {RUN_FILE} at its "
                               "top (or in its one top-level directory)")
        _links_stay_inside(root)
        # LocalAI makes run.sh executable on install; this install is the worker's own.
        os.chmod(run_file, os.stat(run_file).st_mode | 0o755)
        return root, files, total
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _swap_into_place(new: str, target: str) -> None:
    """``new`` becomes ``target``; an existing ``target`` is moved aside first and removed
    after (restored when the rename fails)."""
    backup = None
    if os.path.lexists(target):
        backup = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.install-backup-",
                                  dir=os.path.dirname(target))
        os.rmdir(backup)
        os.rename(target, backup)
    try:
        os.rename(new, target)
    except OSError:
        if backup is not None:
            os.rename(backup, target)
        raise
    if backup is not None:
        if os.path.isdir(backup) and not os.path.islink(backup):
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.unlink(backup)


class BackendInstaller:
    """The three verbs over one backends directory and the worker's staging roots.

    :param backends_path: ``--backends-path`` (created on the first install).
    :param staging: the worker's ``FileStaging`` (the archive's key is resolved by it).
    :param running: ``running()`` -> the supervisor's ready backends (``{backend, model_id}``).
    """

    def __init__(self, backends_path: str, staging, reactor,
                 running: Callable[[], list] = list, *,
                 max_bytes: int = MAX_UNPACKED_BYTES, max_members: int = MAX_MEMBERS):
        self.path = os.path.abspath(backends_path)
        self.staging = staging
        self._reactor = reactor
        self._running = running
        self.max_bytes = max_bytes
        self.max_members = max_members

    def _in_thread(self, fn, *args):
        return threads.deferToThreadPool(self._reactor, self._reactor.getThreadPool(), fn,
                                         *args)

    def register(self, verbs) -> list:
        return [
            verbs.register("backends.install", self.install, cancel_on_disconnect=False,
                           schema=VerbRequestSchema(
                               {"name": str, "archive": str, "sha256": str, "metadata": dict,
                                "meta_name": str},
                               frozenset({"name", "archive", "sha256"}))),
            verbs.register("backends.list", self.list_, schema=VerbRequestSchema({})),
            verbs.register("backends.delete", self.delete, cancel_on_disconnect=False,
                           schema=VerbRequestSchema({"name": str}, frozenset({"name"}))),
        ]

    # -- install ----------------------------------------------------------------------------

    def _archive_path(self, key: str) -> str:
        try:
            key = parse_key(key.encode("utf-8"))
            if not key.startswith(ARCHIVE_PREFIX):
                raise BadStagingKey(f"an archive is staged under {ARCHIVE_PREFIX}")
            return self.staging.roots.resolve(key).real_path
        except (BadStagingKey, UnicodeEncodeError) as e:
            raise BadVerbRequest(f"archive: {e}") from None

    async def install(self, body: dict) -> dict:
        name = body["name"]
        meta_name = body.get("meta_name")
        for value, field in ((name, "name"), (meta_name, "meta_name")):
            if value is not None and not NAME_RE.fullmatch(value):
                raise BadVerbRequest(f"{field} must be a backend name (letters, digits, '.', "
                                     "'_', '-'; at most 128)")
        sha256 = body["sha256"].lower()
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise BadVerbRequest("sha256 must be 64 hex digits")
        archive = self._archive_path(body["archive"])
        metadata = {k: v for k, v in (body.get("metadata") or {}).items()
                    if k in METADATA_FIELDS and isinstance(v, str) and len(v) <= 4096}
        if "alias" in metadata and metadata["alias"] and not NAME_RE.fullmatch(
                metadata["alias"]):
            raise BadVerbRequest("metadata.alias must be a backend name")
        try:
            files, total = await self._in_thread(self._install_blocking, archive, sha256,
                                                 name, metadata, meta_name)
        except InstallError as e:
            log.warn("backend {name} was not installed: {why}", name=name, why=str(e))
            return {"success": False, "error": str(e), "name": name}
        except OSError as e:
            why = f"{e.strerror or e} ({os.path.basename(e.filename or '') or 'the disk'})"
            log.warn("backend {name} was not installed: {why}", name=name, why=why)
            return {"success": False, "error": f"cannot write the backend: {why}",
                    "name": name}
        log.info("backend {name} installed into {path} ({files} files, {total} bytes)",
                 name=name, path=self.path, files=files, total=total)
        return {"success": True, "error": "", "name": name, "files": files, "bytes": total,
                "meta_name": meta_name or ""}

    def _install_blocking(self, archive: str, sha256: str, name: str, metadata: dict,
                          meta_name: str | None) -> tuple[int, int]:
        try:
            if not os.path.isfile(archive):
                raise InstallError("the archive was not staged on this worker")
            actual = _sha256(archive)
            if actual != sha256:
                raise InstallError(f"the staged archive's sha256 is {actual}, not {sha256}")
            os.makedirs(self.path, exist_ok=True)
            root, files, total = unpack(archive, self.path, name, max_bytes=self.max_bytes,
                                        max_members=self.max_members)
            temp = os.path.join(self.path, os.path.relpath(root, self.path).split(os.sep)[0])
            try:
                _write_metadata(root, {**{k: v for k, v in metadata.items() if v},
                                       "name": metadata.get("name") or name,
                                       "installed_at": _now()})
                _swap_into_place(root, os.path.join(self.path, name))
                if meta_name:
                    meta_dir = tempfile.mkdtemp(prefix=f".{meta_name}.install-", dir=self.path)
                    try:
                        _write_metadata(meta_dir, {
                            "meta_backend_for": name, "name": meta_name,
                            **({"gallery_url": metadata["gallery_url"]}
                               if metadata.get("gallery_url") else {}),
                            "installed_at": _now()})
                        _swap_into_place(meta_dir, os.path.join(self.path, meta_name))
                    except BaseException:
                        shutil.rmtree(meta_dir, ignore_errors=True)
                        raise
            finally:
                if temp != os.path.join(self.path, name):
                    shutil.rmtree(temp, ignore_errors=True)
            return files, total
        finally:
            for path in (archive, archive + ".sha256"):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # -- list and delete --------------------------------------------------------------------

    def _listing(self) -> list[dict]:
        out = []
        try:
            entries = sorted(os.scandir(self.path), key=lambda e: e.name)
        except OSError:
            return out
        for entry in entries[:1000]:
            if not NAME_RE.fullmatch(entry.name) or not entry.is_dir():
                continue
            metadata, problem = read_metadata(entry.path)
            runs = entry.path
            target = metadata.get("meta_backend_for")
            if isinstance(target, str) and NAME_RE.fullmatch(target):
                runs = os.path.join(self.path, target)  # a meta backend runs its concrete one
            out.append({"name": entry.name,
                        "runnable": os.access(os.path.join(runs, RUN_FILE), os.X_OK),
                        **{k: metadata[k] for k in ("alias", "meta_backend_for", "gallery_url",
                                                     "installed_at", "version", "uri")
                           if isinstance(metadata.get(k), str)},
                        **({"problem": os.path.basename(problem)} if problem else {})})
        return out

    async def list_(self, body: dict) -> dict:
        return {"backends_path": self.path, "installed": await self._in_thread(self._listing)}

    async def delete(self, body: dict) -> dict:
        name = body["name"]
        if not NAME_RE.fullmatch(name):
            raise BadVerbRequest("name must be a backend name")
        target = os.path.join(self.path, name)
        if not os.path.isdir(target) or os.path.islink(target):
            return {"success": False, "error": f"backend {name} is not installed in the "
                                               "backends directory", "deleted": []}
        metadata, _ = read_metadata(target)
        doomed = [name]
        concrete = metadata.get("meta_backend_for")
        if isinstance(concrete, str) and NAME_RE.fullmatch(concrete) \
                and os.path.isdir(os.path.join(self.path, concrete)):
            doomed.append(concrete)
        names = set(doomed)
        for d in list(doomed):
            alias = read_metadata(os.path.join(self.path, d))[0].get("alias")
            if isinstance(alias, str):
                names.add(alias)
        busy = sorted({r.get("model_id") for r in self._running() if r.get("backend") in names})
        if busy:
            return {"success": False, "deleted": [],
                    "error": f"backend {name} is running model(s) {', '.join(busy)}: unload "
                             "them first (POST /api/nodes/{id}/models/{model}/unload)"}

        def remove() -> None:
            for d in doomed:
                shutil.rmtree(os.path.join(self.path, d))

        try:
            await self._in_thread(remove)
        except OSError as e:
            return {"success": False, "deleted": [],
                    "error": f"cannot remove backend {name}: {e.strerror or e}"}
        log.info("backend(s) {names} deleted from {path}", names=", ".join(doomed),
                 path=self.path)
        return {"success": True, "error": "", "deleted": doomed}


def register_backend_install_verbs(verbs, backends_path: str, staging, reactor,
                                   running: Callable[[], Any] = list) -> BackendInstaller:
    installer = BackendInstaller(backends_path, staging, reactor, running)
    installer.register(verbs)
    return installer
