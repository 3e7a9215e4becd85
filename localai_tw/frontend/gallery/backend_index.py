"""LocalAI's backend gallery index (``--backend-galleries``; LocalAI's ``backend/index.yaml``)
read as LocalAI reads it: a YAML list of entries with ``name``, ``alias``, ``uri``,
``mirrors``, ``sha256``, ``version``, ``capabilities`` (a *meta* backend: no ``uri``, a map
from a hardware capability to the concrete entry that serves it) and the display fields
(``description``, ``license``, ``urls``, ``icon``, ``tags``).  YAML anchors and merges are
bounded as for model galleries (``index.yaml_load``).

:func:`source_kind` says what a URI is (a directory, a tar archive on this disk, a tar archive
to download, an OCI image) and :func:`local_source_allowed` whether a replica may read it
from its own disk.  Fetching and installing are ``backend_installs.py``'s.

What this module must never do: fetch anything; accept an entry whose name could leave the
backends directory (names are plain backend names: no ``/``, no leading dot).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from localai_tw.frontend.gallery.index import MAX_DESCRIPTION, MAX_ENTRIES, Gallery, GalleryError

#: A backend name as the worker's backends directory accepts it (``backends/directory.py``).
BACKEND_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256_RE = re.compile(r"^[0-9a-fA-F]{64}$")
MAX_MIRRORS = 16
MAX_CAPABILITIES = 64
#: The capability a worker without a GPU choice takes, then LocalAI's fall-backs.
CPU_CAPABILITIES = ("default", "cpu")
OCI_PREFIXES = ("oci://", "ocifile://", "ollama://", "quay.io", "ghcr.io", "docker.io")

LOCAL_FILE, DOWNLOAD, OCI = "local", "download", "oci"
#: A job's ``gallery_jobs.model`` key for a backend: never a model name (those cannot start
#: with a dot), so a backend and a model of the same name do not hold each other.
JOB_KEY_PREFIX = ".backend/"


def job_key(name: str) -> str:
    return JOB_KEY_PREFIX + name


def is_backend_name(name: Any) -> bool:
    return isinstance(name, str) and bool(BACKEND_NAME_RE.fullmatch(name))


@dataclasses.dataclass(frozen=True)
class BackendEntry:
    gallery: Gallery
    name: str
    alias: str = ""
    uri: str = ""
    mirrors: tuple[str, ...] = ()
    sha256: str = ""
    version: str = ""
    capabilities: tuple[tuple[str, str], ...] = ()
    description: str = ""
    license: str = ""
    urls: tuple[str, ...] = ()
    icon: str = ""
    tags: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.gallery.name}@{self.name}"

    @property
    def is_meta(self) -> bool:
        """LocalAI's ``IsMeta``: capabilities and no URI."""
        return bool(self.capabilities) and not self.uri

    def metadata(self, installed: bool) -> dict[str, Any]:
        """LocalAI's ``GalleryBackend`` JSON (``/backends/available``)."""
        return {"id": self.id, "name": self.name, "alias": self.alias, "uri": self.uri,
                "mirrors": list(self.mirrors), "sha256": self.sha256, "version": self.version,
                "capabilities": dict(self.capabilities), "description": self.description,
                "license": self.license, "urls": list(self.urls), "icon": self.icon,
                "tags": list(self.tags),
                "gallery": {"name": self.gallery.name, "url": self.gallery.url},
                "installed": installed, "meta": self.is_meta}


def _text(value: Any, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _strings(value: Any, limit: int = 64) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(v[:4096] for v in value[:limit] if isinstance(v, str))


def parse_backend_entry(raw: Any, gallery: Gallery) -> BackendEntry:
    """:raises GalleryError: an entry that cannot be installed (its name is the reason)."""
    if not isinstance(raw, dict) or not is_backend_name(raw.get("name")):
        raise GalleryError("a backend entry needs a name usable as a directory name")
    name = raw["name"]
    uri = raw.get("uri") or ""
    alias = raw.get("alias") or ""
    sha256 = raw.get("sha256") or ""
    capabilities = raw.get("capabilities") or {}
    if not isinstance(uri, str) or len(uri) > 4096:
        raise GalleryError(f"backend {name}: uri must be a string")
    if alias and not is_backend_name(alias):
        raise GalleryError(f"backend {name}: alias {str(alias)[:64]!r} is not a backend name")
    if sha256 and not (isinstance(sha256, str) and _SHA256_RE.fullmatch(sha256)):
        raise GalleryError(f"backend {name}: sha256 must be 64 hex digits")
    if not isinstance(capabilities, dict) or len(capabilities) > MAX_CAPABILITIES or not all(
            isinstance(k, str) and is_backend_name(v) for k, v in capabilities.items()):
        raise GalleryError(f"backend {name}: capabilities must map capabilities to backend "
                           "names")
    if not uri and not capabilities:
        raise GalleryError(f"backend {name}: neither a uri nor capabilities")
    version = raw.get("version")
    return BackendEntry(
        gallery=gallery, name=name, alias=alias, uri=uri,
        mirrors=_strings(raw.get("mirrors"), MAX_MIRRORS), sha256=sha256.lower(),
        version=str(version)[:128] if isinstance(version, (str, int, float)) else "",
        capabilities=tuple(sorted(capabilities.items())),
        description=_text(raw.get("description"), MAX_DESCRIPTION),
        license=_text(raw.get("license"), 256), urls=_strings(raw.get("urls")),
        icon=_text(raw.get("icon"), 4096), tags=_strings(raw.get("tags")))


def parse_backend_index(data: Any, gallery: Gallery) -> tuple[list[BackendEntry], int]:
    """The usable entries of one decoded backend index and how many were left out.
    :raises GalleryError: when it is not a list."""
    if data is None:
        data = []
    if not isinstance(data, list):
        raise GalleryError(f"backend gallery {gallery.name}: the index must be a YAML or JSON "
                           "list of entries")
    entries: list[BackendEntry] = []
    skipped = 0
    for raw in data[:MAX_ENTRIES]:
        try:
            entries.append(parse_backend_entry(raw, gallery))
        except GalleryError:
            skipped += 1
    return entries, skipped + max(0, len(data) - MAX_ENTRIES)


def concrete_for(meta: BackendEntry, entries: list[BackendEntry]) -> BackendEntry:
    """The entry a meta backend installs on a worker: the worker has no GPU choice here, so
    LocalAI's fall-backs for a host that reports none: ``default``, then ``cpu``.  The entry
    is looked up in the meta backend's own gallery first.  :raises GalleryError:"""
    table = dict(meta.capabilities)
    for capability in CPU_CAPABILITIES:
        if capability in table:
            wanted = table[capability]
            break
    else:
        raise GalleryError(f"meta backend {meta.id} names no backend for a CPU worker "
                           f"(capabilities {', '.join(sorted(table)) or 'none'}; a worker "
                           "here takes 'default', then 'cpu'): install a concrete backend "
                           "by its name on the nodes that fit it")
    same = [e for e in entries if e.name == wanted and e.gallery == meta.gallery]
    found = same or [e for e in entries if e.name == wanted]
    if not found or found[0].is_meta:
        raise GalleryError(f"meta backend {meta.id} picks {wanted!r}, which no backend "
                           "gallery lists as an installable backend")
    return found[0]


def source_kind(uri: str) -> str:
    """What ``uri`` is: :data:`LOCAL_FILE` (``file://`` or an absolute path: a directory or a
    tar archive, which of the two the installer sees on disk),
    :data:`DOWNLOAD` (``http(s)://``, ``github:``, ``huggingface://``/``hf://``),
    :data:`OCI`.  :raises GalleryError: for anything else."""
    if uri.startswith(OCI_PREFIXES):
        return OCI
    if uri.startswith(("file://", "/")):
        return LOCAL_FILE
    if uri.startswith(("http://", "https://", "github:", "huggingface://", "hf://")):
        return DOWNLOAD
    raise GalleryError(f"{uri[:200]!r} is not a directory, a file:// or http(s):// archive "
                       "or an OCI image")


def local_source_allowed(gallery: Gallery, allow_private: bool) -> bool:
    """Whether an entry of ``gallery`` may name a directory or file on the replica's disk:
    when the index itself is on that disk (``file://``: the operator wrote both), or with
    ``--allow-private-downloads``.  A remote index naming a local path would make the replica
    copy its own files (keys, the database's) to a worker."""
    return allow_private or gallery.url.startswith("file://")
