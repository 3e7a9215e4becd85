"""LocalAI's gallery indexes (``--galleries``) and their entries, read as LocalAI reads them.

A YAML or JSON list of entries in LocalAI's format (``name``, ``description``, ``license``,
``urls``, ``icon``, ``tags``, ``url`` (a config file) or ``config_file``, ``overrides``,
``files`` of ``{filename, uri, sha256}``), at most :data:`MAX_INDEX_BYTES` and
:data:`MAX_ENTRIES`; an entry that is not usable (no name, a name that is not a file name) is
left out and counted.  YAML aliases are bounded (``localai/yamlbound.py``).  Fetching is the
installs' (``installs.py``); this module only reads what was fetched.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any
from urllib.parse import urlsplit

import yaml

from localai_tw.frontend.inference.downloads import shown_url
from localai_tw.localai.model_config import ModelConfigError, ModelDownload, parse_model_config
from localai_tw.localai.yamlbound import GALLERY_INDEX, MODEL_CONFIG, bounded_loader


#: Largest index or entry config read (LocalAI's own index is about 2.4 MB).
MAX_INDEX_BYTES = 32 * 1024 * 1024
MAX_CONFIG_BYTES = 1024 * 1024
MAX_ENTRIES = 20000
MAX_FILES = 64
MAX_NAME = 200
#: Longest description kept from an index entry (characters).
MAX_DESCRIPTION = 64 * 1024


class GalleryError(Exception):
    """A gallery or an entry that cannot be used; the message names the cause and the fix."""


@dataclasses.dataclass(frozen=True)
class Gallery:
    name: str
    url: str


@dataclasses.dataclass(frozen=True)
class GalleryEntry:
    gallery: Gallery
    name: str
    description: str = ""
    license: str = ""
    urls: tuple[str, ...] = ()
    icon: str = ""
    tags: tuple[str, ...] = ()
    url: str = ""
    config_file: Any = None
    overrides: dict = dataclasses.field(default_factory=dict)
    files: tuple[ModelDownload, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.gallery.name}@{self.name}"

    def metadata(self, installed: bool) -> dict[str, Any]:
        """LocalAI's ``gallery.Metadata`` JSON (``/models/available``)."""
        return {"id": self.id, "url": self.url, "name": self.name,
                "description": self.description, "license": self.license,
                "urls": list(self.urls), "icon": self.icon, "tags": list(self.tags),
                "files": [{"filename": f.filename, "uri": f.uri, "sha256": f.sha256 or ""}
                          for f in self.files],
                "gallery": {"name": self.gallery.name, "url": self.gallery.url},
                "installed": installed}


def parse_galleries(values, option: str = "--galleries") -> tuple[Gallery, ...]:
    """``--galleries`` (or ``--backend-galleries``) values: LocalAI's JSON ``[{"name": ...,
    "url": ...}]``, ``name=url``, or a bare URL (named after its file).
    :raises GalleryError:"""
    out: list[Gallery] = []
    for value in values or ():
        value = value.strip()
        if not value:
            continue
        if value.startswith("["):
            try:
                items = json.loads(value)
            except ValueError as e:
                raise GalleryError(f"{option}: not JSON ({e})") from None
            if not isinstance(items, list) or not all(
                    isinstance(i, dict) and isinstance(i.get("url"), str) for i in items):
                raise GalleryError(option + ': JSON must be [{"name": ..., "url": ...}]')
            pairs = [(str(i.get("name") or ""), i["url"]) for i in items]
        elif "=" in value.split("://", 1)[0]:
            name, _, url = value.partition("=")
            pairs = [(name, url)]
        else:
            pairs = [("", value)]
        for name, url in pairs:
            if not url.startswith(("file://", "http://", "https://", "github:")):
                raise GalleryError(f"{option}: {shown_url(url)[:200]} is not a file://, "
                                   "http(s):// or github: URL")
            if not name:
                base = os.path.basename(urlsplit(url.split("@", 1)[0]).path) or "gallery"
                name = base.rsplit(".", 1)[0] or "gallery"
            if not is_file_name(name) or "@" in name:
                raise GalleryError(f"{option}: the name {name[:64]!r} must be a plain name")
            out.append(Gallery(name, url))
    if len({g.name for g in out}) != len(out):
        raise GalleryError(f"{option}: two galleries have the same name")
    return tuple(out)


def is_file_name(name: Any) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= MAX_NAME and not name.startswith(".")
            and all(c not in name for c in "/\\\x00") and name.isprintable())


# -- reading -------------------------------------------------------------------------------


_SAFE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
#: Safe loaders whose aliases may add only a bounded number of values (``yamlbound.py``): an
#: index is the operator's and big (its entries merge ``<<: *base``), loaded in a thread; an
#: entry's config and the install records are model-config sized, read on the reactor.
_INDEX_LOADER = bounded_loader(_SAFE, GALLERY_INDEX)
_CONFIG_LOADER = bounded_loader(_SAFE, MODEL_CONFIG)


def yaml_load(data: bytes, *, index: bool = False) -> Any:
    """:raises yaml.YAMLError: (``AliasBombError`` when aliases expand past the bound)."""
    loader = _INDEX_LOADER if index else _CONFIG_LOADER
    return yaml.load(data, Loader=loader)  # noqa: S506 (a safe loader)


def _text(value: Any, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(v[:4096] for v in value[:64] if isinstance(v, str))


def parse_files(raw: Any, where: str) -> tuple[ModelDownload, ...]:
    """An entry's ``files``. :raises GalleryError:"""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_FILES:
        raise GalleryError(f"{where}.files must be a list of {{filename, uri, sha256}} (at most "
                           f"{MAX_FILES})")
    try:
        parsed = parse_model_config({"name": "x", "backend": "echo", "download_files": raw})
    except ModelConfigError as e:
        field = (e.field or "").replace("download_files", "files")
        raise GalleryError(f"{where}: {field}: {e.problem}") from None
    return tuple(dataclasses.replace(d, where=f"{where}: files[{i}]")
                 for i, d in enumerate(parsed.downloads))


def parse_index(data: Any, gallery: Gallery) -> tuple[list[GalleryEntry], int]:
    """The usable entries of one decoded index, and how many were left out.
    :raises GalleryError: when it is not a list."""
    if isinstance(data, dict) and isinstance(data.get("models"), list):
        data = data["models"]
    if not isinstance(data, list):
        raise GalleryError(f"gallery {gallery.name}: the index must be a YAML or JSON list of "
                           "entries")
    entries: list[GalleryEntry] = []
    skipped = 0
    for raw in data[:MAX_ENTRIES]:
        try:
            entries.append(parse_entry(raw, gallery))
        except GalleryError:
            skipped += 1
    return entries, skipped + max(0, len(data) - MAX_ENTRIES)


def parse_entry(raw: Any, gallery: Gallery) -> GalleryEntry:
    if not isinstance(raw, dict) or not is_file_name(raw.get("name")):
        raise GalleryError("an entry needs a name usable as a file name")
    name = raw["name"]
    url = raw.get("url") or ""
    overrides = raw.get("overrides") or {}
    config_file = raw.get("config_file")
    if not isinstance(url, str) or not isinstance(overrides, dict) \
            or not isinstance(config_file, (str, dict, type(None))):
        raise GalleryError(f"entry {name}: url must be a string, overrides a mapping, "
                           "config_file a string or mapping")
    return GalleryEntry(
        gallery=gallery, name=name, description=_text(raw.get("description"), MAX_DESCRIPTION),
        license=_text(raw.get("license"), 256), urls=_strings(raw.get("urls")),
        icon=_text(raw.get("icon"), 4096), tags=_strings(raw.get("tags")), url=url,
        config_file=config_file, overrides=overrides,
        files=parse_files(raw.get("files"), f"entry {name}"))


def merge(base: dict, over: dict) -> dict:
    """``over`` merged into ``base`` (mappings deeply, anything else replaced), as LocalAI's
    ``mergo.WithOverride``."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


# -- jobs ----------------------------------------------------------------------------------
