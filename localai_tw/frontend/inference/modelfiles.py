"""What a model's files are, checked on this replica before any worker is asked: the staging
plan of a cold load.

A model's files are the ``files`` entries of its config, plus ``parameters.model`` when it names
a file or a folder inside the models directory that ``files`` does not list (LocalAI stages
its ``ModelFile`` the same way, so a LocalAI config needs no ``files`` key), plus the files of
``download_files`` that neither covers (beside the model file, in ``ModelPath``).  Each entry is a
file or a folder:

- a **file** is hashed (in a thread, by the caller) and checked against its ``sha256`` when the
  config gives one; it is staged under its key (``models/<name>/<basename>`` by default);
- a **folder** (a transformers or sentence-transformers directory, a GGUF with its companions)
  is walked: every regular file below it is staged under ``<key>/<path relative to the
  folder>``, so the worker holds the same tree, and the backend is given the folder.  ``.git``
  and ``.cache`` directories, temporary ``*.partial`` files and ``<file>.sha256`` sidecars are
  not part of a model and are left out.

:func:`plan_blocking` returns a :class:`StagePlan` (every file with its real path, key, size and
digest) or raises :class:`~.interfaces.ModelFileMismatch` naming the file and what is wrong.
It blocks (stats, walks, hashes): call it in a thread.  :class:`DigestCache` remembers digests
by (real path, size, mtime), so a file is hashed once per change, not once per load.

What this module must never do: let a staged path leave its root (a ``files`` path or
``parameters.model`` must resolve inside the models directory; a file in a folder must resolve
inside that folder, so a symbolic link out of it is refused, and a link to a directory is
never followed); walk or stage more than :data:`MAX_FOLDER_FILES` files or
:data:`MAX_FOLDER_BYTES` bytes for one folder; name a worker key the worker would refuse.
"""

from __future__ import annotations

import os
import posixpath
import stat
import threading
from dataclasses import dataclass
from urllib.parse import quote

from localai_tw.staging_client import (
    PARTIAL_SUFFIX,
    SIDECAR_SUFFIX,
    BadStagingKey,
    parse_key,
    sha256_of_file,
)

from localai_tw.frontend.inference.interfaces import ModelFileMismatch
from localai_tw.localai.model_config import ModelConfig, ModelFile

#: Most files one folder may hold to be staged (a big transformers checkpoint has a few dozen).
MAX_FOLDER_FILES = 10_000
#: Most bytes one folder may hold to be staged.
MAX_FOLDER_BYTES = 2 * 1024**4
#: Directories below a model folder that are never staged.
SKIPPED_DIRECTORIES = frozenset({".git", ".cache"})
#: Digests remembered (the oldest half is dropped beyond this).
MAX_CACHED_DIGESTS = 100_000


class DigestCache:
    """SHA-256 of files by (real path, size, mtime_ns): a file that did not change is not read
    again.  Thread-safe (plans run in the reactor's thread pool)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, int, str]] = {}
        self._lock = threading.Lock()

    def digest(self, path: str) -> tuple[int, str]:
        """``(size, sha256)`` of the real path ``path``.  Blocking."""
        st = os.stat(path)
        with self._lock:
            known = self._known.get(path)
        if known is not None and known[0] == st.st_size and known[1] == st.st_mtime_ns:
            return known[0], known[2]
        size, digest = sha256_of_file(path)
        after = os.stat(path)
        if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns) and \
                size == st.st_size:  # unchanged while it was read
            self.record(path, size, after.st_mtime_ns, digest)
        return size, digest

    def record(self, path: str, size: int, mtime_ns: int, digest: str) -> None:
        with self._lock:
            if len(self._known) >= MAX_CACHED_DIGESTS:
                for old in list(self._known)[: MAX_CACHED_DIGESTS // 2]:
                    del self._known[old]
            self._known[path] = (size, mtime_ns, digest)


@dataclass(frozen=True)
class StageItem:
    """One file to put on the worker."""

    local: str      # real path on this replica (checked to lie inside its root)
    key: str        # the worker's staging key
    size: int
    sha256: str
    rel: str = ""   # path below its folder ('' for a lone file)


@dataclass(frozen=True)
class StageEntry:
    """One ``files`` entry (or the implicit ``parameters.model``) and what it expands to."""

    path: str       # relative to the models dir
    key: str        # the file's key, or the folder's key prefix
    folder: bool
    items: tuple[StageItem, ...]

    @property
    def size(self) -> int:
        return sum(i.size for i in self.items)


@dataclass(frozen=True)
class StagePlan:
    entries: tuple[StageEntry, ...] = ()
    #: the entry ``parameters.model`` names (its worker path becomes ModelFile), or None
    primary: StageEntry | None = None

    @property
    def items(self) -> tuple[StageItem, ...]:
        return tuple(i for e in self.entries for i in e.items)


def default_key(model: ModelConfig, path: str) -> str:
    return f"models/{model.name.replace('/', '_')}/{posixpath.basename(path)}"


def implicit_model_entry(model: ModelConfig, models_dir: str) -> ModelFile | None:
    """``parameters.model`` as a staged entry, when ``files`` does not list it and it names a
    file or folder inside the models directory (LocalAI stages it without being told)."""
    if model.file_for_model() is not None:
        return None
    name = model.model
    if name.startswith("/") or "\\" in name or "\x00" in name or "://" in name:
        return None  # absolute: resolved on the worker; a hub id or URL is not a path here
    normal = posixpath.normpath(name)
    if normal in (".", "..") or normal.startswith("../"):
        return None
    if not os.path.lexists(os.path.join(models_dir, *normal.split("/"))):
        return None  # a hub id, or a path the backend resolves on the worker
    key = default_key(model, normal)
    if any(f.key == key for f in model.files):
        return None
    return ModelFile(normal, key, None)


def companion_downloads(model: ModelConfig, files: list[ModelFile]) -> list[ModelFile]:
    """The ``download_files`` not already staged as (or inside) another entry: staged beside
    the model file (``models/<name>/<basename>``, in ``ModelPath``), as LocalAI's router stages
    the companions (mmproj, tokenizer) it finds in the models directory."""
    out = []
    keys = {f.key for f in files}
    for d in model.downloads:
        if any(d.filename == f.path or d.filename.startswith(f.path + "/") for f in files):
            continue
        key = default_key(model, d.filename)
        if key in keys:
            continue
        keys.add(key)
        out.append(ModelFile(d.filename, key, d.sha256))
    return out


def plan_blocking(model: ModelConfig, models_dir: str, digests: DigestCache) -> StagePlan:
    """The staging plan of ``model`` (module docstring).  Blocking: run it in a thread.

    :raises ModelFileMismatch: a file or folder is missing, unreadable, outside its root, too
        large, or does not match its ``sha256``; the message names it.
    """
    files = list(model.files)
    implicit = implicit_model_entry(model, models_dir)
    if implicit is not None:
        files.append(implicit)
    named_by = {id(implicit): "parameters.model"}
    for companion in companion_downloads(model, files):
        files.append(companion)
        named_by[id(companion)] = "download_files"
    primary_file = model.file_for_model() or implicit
    entries = []
    primary = None
    for f in files:
        entry = _entry(model, models_dir, f, digests, named_by.get(id(f), "files"))
        entries.append(entry)
        if f is primary_file:
            primary = entry
    return StagePlan(tuple(entries), primary)


def _fail(model: ModelConfig, text: str) -> ModelFileMismatch:
    return ModelFileMismatch(f"model {model.name}: {text}")


def _entry(model: ModelConfig, models_dir: str, f: ModelFile, digests: DigestCache,
           named_by: str) -> StageEntry:
    try:  # the checked path is the one hashed and sent, so a swap cannot slip past
        local = f.contained_path(models_dir)
    except ValueError as e:
        raise _fail(model, str(e)) from None
    try:
        st = os.stat(local)
    except FileNotFoundError:
        raise _fail(model, f"{f.path} (named by {named_by}) does not exist in the models "
                           "directory") from None
    except OSError as e:
        raise _fail(model, f"{f.path} cannot be read: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        if f.sha256 is not None:
            raise _fail(model, f"{f.path} is a folder, and sha256 applies to a file (list "
                               f"the folder without sha256; each file is checked on staging)")
        try:
            items = _folder_items(model, f, local, digests)
        except OSError as e:
            raise _fail(model, f"folder {f.path} cannot be read: {e.strerror or e}") from None
        return StageEntry(f.path, f.key, True, items)
    if not stat.S_ISREG(st.st_mode):
        raise _fail(model, f"{f.path} is neither a file nor a folder")
    size, digest = _digest(model, f.path, local, digests)
    if f.sha256 is not None and digest != f.sha256:
        raise _fail(model, f"file {f.path} has sha256 {digest}, the config says {f.sha256}")
    _check_key(model, f.path, f.key)
    return StageEntry(f.path, f.key, False, (StageItem(local, f.key, size, digest),))


def _digest(model: ModelConfig, shown: str, local: str, digests: DigestCache) -> tuple[int, str]:
    try:
        return digests.digest(local)
    except OSError as e:
        raise _fail(model, f"file {shown} cannot be read: {e.strerror}") from None


def _check_key(model: ModelConfig, shown: str, key: str) -> None:
    try:
        parse_key(quote(key, safe="/").encode("ascii"))
    except BadStagingKey as e:
        raise _fail(model, f"{shown} cannot be staged under the worker key {key!r}: {e}") \
            from None


def _is_sidecar(directory: str, name: str) -> bool:
    return name.endswith(SIDECAR_SUFFIX) and os.path.isfile(
        os.path.join(directory, name[: -len(SIDECAR_SUFFIX)]))


def _folder_items(model: ModelConfig, f: ModelFile, folder: str,
                  digests: DigestCache) -> tuple[StageItem, ...]:
    """Every file of the folder ``f`` (real path ``folder``), in a stable order."""
    found: list[tuple[str, str]] = []  # (relative path, real path)
    total = 0
    prefix = folder.rstrip(os.sep) + os.sep
    for directory, subdirs, names in os.walk(folder, followlinks=False,
                                             onerror=_raise_walk_error):
        subdirs.sort()
        for sub in list(subdirs):
            full = os.path.join(directory, sub)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            if sub in SKIPPED_DIRECTORIES:
                subdirs.remove(sub)
            elif os.path.islink(full):
                raise _fail(model, f"{f.path}/{rel} is a symbolic link to a directory; links "
                                   f"to directories are not followed (copy it into the folder)")
        for name in sorted(names):
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            if name.endswith(PARTIAL_SUFFIX) or _is_sidecar(directory, name):
                continue
            real = os.path.realpath(full)
            if not real.startswith(prefix):
                raise _fail(model, f"{f.path}/{rel} is a symbolic link out of the folder "
                                   f"{f.path}; every file of a model folder must lie inside it")
            try:
                st = os.stat(real)
            except OSError as e:
                raise _fail(model, f"{f.path}/{rel} cannot be read: {e.strerror}") from None
            if not stat.S_ISREG(st.st_mode):
                continue  # sockets, fifos: nothing a model holds
            found.append((rel, real))
            total += st.st_size
            if len(found) > MAX_FOLDER_FILES:
                raise _fail(model, f"folder {f.path} holds more than {MAX_FOLDER_FILES} files; "
                                   f"a model folder this large is not staged")
            if total > MAX_FOLDER_BYTES:
                raise _fail(model, f"folder {f.path} holds more than {MAX_FOLDER_BYTES} bytes; "
                                   f"a model folder this large is not staged")
    if not found:
        raise _fail(model, f"folder {f.path} holds no files")
    items = []
    for rel, real in found:
        key = f"{f.key}/{rel}"
        _check_key(model, f"{f.path}/{rel}", key)
        size, digest = _digest(model, f"{f.path}/{rel}", real, digests)
        items.append(StageItem(real, key, size, digest, rel))
    return tuple(items)


def _raise_walk_error(error: OSError) -> None:
    raise error


def worker_folder(local_path: str, rel: str) -> str:
    """The worker-side folder of a staged folder file: its worker path minus ``rel``."""
    tail = "/" + rel
    if local_path.endswith(tail):
        return local_path[: -len(tail)]
    return posixpath.dirname(local_path)
