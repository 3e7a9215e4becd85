"""The model configs of a models directory (LocalAI's ``--models-path``): read, validated and
re-read when files change.

:class:`ModelCatalog` re-reads on access at most every ``check_interval`` seconds, and then only
the files whose (mtime, size) changed; the directory is listed with ``os.scandir`` (one stat per
file, no reads).  That is small, local, bounded work (at most ``MAX_FILES`` files of at most
``MAX_FILE_BYTES`` each), done on the caller's thread.  An invalid file is skipped (and logged
once per change), never fatal to the others, and :meth:`ModelCatalog.error` keeps why, under the
name it meant to define.  Two files with the same ``name``: the first by file name wins and the
other is reported.

YAML is read with a safe loader that reads ``\\'`` as Go does and bounds what aliases may add
(``yamlbound.py``).  What one file says is :mod:`.model_config`'s.

What this module must never do: read a file bigger than ``MAX_FILE_BYTES``; execute anything
from YAML; raise from :meth:`ModelCatalog.models` because of a bad file.
"""

from __future__ import annotations

import os
import posixpath
import time
from dataclasses import dataclass
from typing import Any

import yaml
from twisted.logger import Logger

from localai_tw.localai.model_config import (
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_NAME,
    ModelConfig,
    ModelConfigError,
    parse_model_config,
)
from localai_tw.localai.yamlbound import MODEL_CONFIG, AliasBombError, bounded_loader

log = Logger()


class _GoLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``\\'`` in a double-quoted string as ``'``, as Go's
    YAML decoder (libyaml's rules) does: LocalAI's gallery has ``key: "\\'"`` in two files."""

    ESCAPE_REPLACEMENTS = {**yaml.SafeLoader.ESCAPE_REPLACEMENTS, "'": "'"}


#: ... and whose aliases may add only a bounded number of values (``localai_tw/yamlbound.py``):
#: a 422-byte file of nested aliases under ``engine_args`` stalled the reactor 2.2 s.
_Loader = bounded_loader(_GoLoader, MODEL_CONFIG)


def _name_guess(data: Any, source: str) -> str:
    """The model name a file was meant to define, for answering requests about it when it
    cannot load: its ``name`` if readable, else the file name without ``.yaml``."""
    if isinstance(data, dict) and isinstance(data.get("name"), str) and data["name"]:
        return data["name"][:MAX_NAME]
    return posixpath.basename(source).rsplit(".", 1)[0]


def load_model_file(path: str, source: str | None = None) -> ModelConfig:
    """Read and validate one YAML file.  :raises ModelConfigError: with ``model_name`` set."""
    source = source or path
    try:
        return _load_model_file(path, source)
    except ModelConfigError as e:
        if e.model_name is None:
            e.model_name = _name_guess(None, source)
        raise


def _load_model_file(path: str, source: str) -> ModelConfig:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ModelConfigError(source, None, f"cannot be read: {e.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ModelConfigError(source, None, f"is larger than {MAX_FILE_BYTES} bytes")
    try:
        data = yaml.load(raw, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except AliasBombError as e:
        raise ModelConfigError(source, None, f"is refused: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ModelConfigError(source, None, f"is not valid YAML{where}") from None
    except RecursionError:
        # PyYAML's composer recurses once per level: a file nested thousands deep exhausts the
        # stack.  A failure like any other, remembered by the catalog until the file changes.
        raise ModelConfigError(source, None, "nests too deeply to be a model config") from None
    try:
        return parse_model_config(data, source)
    except ModelConfigError as e:
        e.model_name = _name_guess(data, source)
        raise
    except RecursionError:
        raise ModelConfigError(source, None, "nests too deeply to be a model config") from None


# -- the catalog ------------------------------------------------------------------------------


@dataclass
class _Entry:
    stamp: tuple[int, int]
    config: ModelConfig | None
    error: ModelConfigError | None


class ModelCatalog:
    """The model configs of one directory, re-read when files change (see the module
    docstring).  ``clock`` is ``time.monotonic`` unless given (tests)."""

    def __init__(self, models_dir: str, *, check_interval: float = 1.0, clock=time.monotonic):
        self.models_dir = os.path.abspath(models_dir)
        self._interval = check_interval
        self._clock = clock
        self._checked_at: float | None = None
        self._entries: dict[str, _Entry] = {}
        self._by_name: dict[str, ModelConfig] = {}
        self.errors: dict[str, str] = {}
        self._broken: dict[str, ModelConfigError] = {}  # meant model name -> why it failed

    def models(self) -> list[ModelConfig]:
        self._refresh()
        return [self._by_name[n] for n in sorted(self._by_name)]

    def get(self, name: str) -> ModelConfig | None:
        self._refresh()
        return self._by_name.get(name)

    def error(self, name: str) -> ModelConfigError | None:
        """Why the file meant to define model ``name`` could not load (its ``name``, or its
        file name without ``.yaml`` when even that cannot be read), or ``None``: lets a request
        for it be answered with the reason instead of "does not exist"."""
        self._refresh()
        return None if name in self._by_name else self._broken.get(name)

    def broken(self) -> dict[str, ModelConfigError]:
        """Every model name whose config failed to load, with the error (sorted by name)."""
        self._refresh()
        return {n: self._broken[n] for n in sorted(self._broken) if n not in self._by_name}

    def refresh(self) -> None:
        """Re-scan now, whatever the interval."""
        self._checked_at = None
        self._refresh()

    def _refresh(self) -> None:
        now = self._clock()
        if self._checked_at is not None and now - self._checked_at < self._interval:
            return
        self._checked_at = now
        seen: dict[str, tuple[int, int]] = {}
        try:
            with os.scandir(self.models_dir) as listing:
                for entry in listing:
                    if not entry.name.endswith((".yaml", ".yml")) or entry.name.startswith("."):
                        continue
                    try:
                        if not entry.is_file():
                            continue
                        st = entry.stat()
                    except OSError:
                        continue
                    seen[entry.name] = (st.st_mtime_ns, st.st_size)
                    if len(seen) >= MAX_FILES:
                        log.warn("models directory {dir} holds more than {n} YAML files; the "
                                 "rest are ignored", dir=self.models_dir, n=MAX_FILES)
                        break
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warn("cannot list models directory {dir}: {err}", dir=self.models_dir, err=e)
            return
        changed = set(seen) ^ set(self._entries)
        for fname, stamp in seen.items():
            old = self._entries.get(fname)
            if old is None or old.stamp != stamp:
                changed.add(fname)
                try:
                    cfg = load_model_file(os.path.join(self.models_dir, fname), fname)
                    self._entries[fname] = _Entry(stamp, cfg, None)
                    for warning in cfg.warnings:
                        log.warn("model config {file}: {warning}", file=fname, warning=warning)
                    for guess in cfg.guesses:
                        log.info("model config {file}: guessed {guess}", file=fname,
                                 guess=guess)
                except ModelConfigError as e:
                    self._entries[fname] = _Entry(stamp, None, e)
                    log.warn("model config skipped: {err}", err=str(e))
        for fname in list(self._entries):
            if fname not in seen:
                del self._entries[fname]
        if not changed:
            return
        by_name: dict[str, ModelConfig] = {}
        errors: dict[str, str] = {}
        broken: dict[str, ModelConfigError] = {}
        for fname in sorted(self._entries):
            entry = self._entries[fname]
            if entry.error is not None:
                errors[fname] = str(entry.error)
                broken.setdefault(entry.error.model_name or fname, entry.error)
                continue
            cfg = entry.config
            if cfg.name in by_name:
                msg = (f"{fname}: name: model {cfg.name!r} is already defined by "
                       f"{by_name[cfg.name].source}; this file is ignored")
                if self.errors.get(fname) != msg:
                    log.warn("{msg}", msg=msg)
                errors[fname] = msg
                continue
            by_name[cfg.name] = cfg
        self._by_name = by_name
        self.errors = errors
        self._broken = broken
