"""LocalAI backend directories and ``--external-grpc-backends``: backends the worker finds on
disk, run the way LocalAI runs them.

A LocalAI installation keeps each installed backend in a directory of its backends path
(LocalAI's ``--backends-path``, ``LOCALAI_BACKENDS_PATH``)::

    <backends-path>/transformers/run.sh          # the program LocalAI starts
    <backends-path>/transformers/backend.py      # what run.sh execs, in ...
    <backends-path>/transformers/venv/           # ... the backend's own venv
    <backends-path>/transformers/metadata.json   # optional: {"alias": ..., ...}

and a *meta* backend as a directory holding only ``metadata.json`` with
``{"meta_backend_for": "cpu-transformers"}``: the name runs that directory's ``run.sh``.  A
directory whose ``metadata.json`` has ``"alias": "transformers"`` also answers to that name
(LocalAI's gallery installs ``cpu-transformers`` with that alias).  A model config's
``backend: <name>`` then finds ``<backends-path>/<name>`` (LocalAI's ``ListSystemBackends``).

:class:`RunFileBackend` starts a run file as LocalAI's ``pkg/model`` ``startProcess`` does:
``<run.sh> --addr 127.0.0.1:<port>`` and nothing else on the command line, the working
directory is the run file's directory, the worker's environment plus ``HF_HOME``,
``TRANSFORMERS_CACHE`` and ``HUGGINGFACE_HUB_CACHE`` set to the models directory when unset
(``spawnGRPCModel``) and ``VK_DRIVER_FILES``/``VK_ICD_FILENAMES`` when the directory bundles
Vulkan ICD manifests (``vulkanICDEnv``).  The supervisor adds ``LOCALAI_GRPC_AUTH_TOKEN`` and
waits for ``Health`` (``localai_tw.backends.process``).

:class:`LocalAIBackends` puts names together for the supervisor, in this order:

1. ``external`` is always the built-in (an operator's ``options.command``);
2. ``--external-grpc-backends NAME:PATH`` (LocalAI's option and format);
3. the backends directory (a directory named like a built-in, ``transformers`` say, replaces
   it: only an operator puts it there, and a LocalAI user naming ``transformers`` means the
   LocalAI backend they installed);
4. the factories (built-ins and operator plugins).

Differences from LocalAI, on purpose: a ``run.sh`` that is not executable is refused with a
message saying so (LocalAI chmods it; the worker does not change an operator's files); a
directory of the requested name that cannot run (no ``run.sh``, a meta backend naming a missing
directory, a ``metadata.json`` that is not JSON) is an error naming the file, never a silent
fall-back to a built-in of that name; ``NAME:HOST:PORT`` (a backend already running elsewhere)
is refused: a worker serves only processes it started.

What this module must never do: build a path from a name that could leave the backends
directory (names are checked against :data:`NAME_RE`: no ``/``, no leading dot); read more
than :data:`MAX_METADATA_BYTES` of a ``metadata.json`` or list more than :data:`MAX_ENTRIES`
entries; change anything on disk; import a backend's dependencies.  The directory is read
again at every start (a few ``stat`` calls on the reactor thread, bounded as above), so a
backend installed while the worker runs is found without a restart.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Mapping, Sequence

from twisted.logger import Logger
from twisted.python import usage
from zope.interface import implementer

from localai_tw.backends.interfaces import IBackendFactory, UnknownBackend

log = Logger()

RUN_FILE = "run.sh"
METADATA_FILE = "metadata.json"
#: A backend name, as a directory name: what LocalAI's gallery names look like.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_METADATA_BYTES = 64 * 1024
#: Entries of the backends directory looked at when searching for an alias.
MAX_ENTRIES = 1000
#: The environment LocalAI gives every backend it spawns when the variables are unset.
HF_CACHE_VARIABLES = ("HF_HOME", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE")


@implementer(IBackendFactory)
class RunFileBackend:
    """One LocalAI backend program (a ``run.sh`` or any executable), started as LocalAI does.

    ``problem``, when given, is why this backend cannot run (answered by
    :meth:`unavailable_reason` before anything is started)."""

    def __init__(self, name: str, run_file: str, *, source: str,
                 models_dir: str | None = None, problem: str | None = None):
        self.name = name
        self.run_file = os.path.abspath(run_file)
        self.source = source
        self.models_dir = models_dir
        self.problem = problem
        self.description = f"LocalAI backend program {self.run_file} ({source})"

    def __repr__(self) -> str:
        return f"<RunFileBackend {self.name}: {self.run_file}>"

    def unavailable_reason(self) -> str | None:
        """Checked before a port is taken or a process spawned, so a bad directory leaves
        nothing behind.  Each message names the file and what to do."""
        if self.problem is not None:
            return self.problem
        path = self.run_file
        if not os.path.lexists(path):
            return (f"backend {self.name!r}: {path} does not exist ({self.source}); install the "
                    f"backend there (a LocalAI backend directory holds run.sh)")
        if not os.path.exists(path):
            return f"backend {self.name!r}: {path} is a broken symbolic link ({self.source})"
        if not os.path.isfile(path):
            return f"backend {self.name!r}: {path} is not a regular file ({self.source})"
        if not os.access(path, os.X_OK):
            return (f"backend {self.name!r}: {path} is not executable ({self.source}); "
                    f"make it so with chmod +x {path}")
        return None

    def command(self, address: str, options: Mapping) -> Sequence[str]:
        # LocalAI: process.WithArgs(append(args, "--addr", serverAddress)), args empty.
        return [self.run_file, "--addr", address]

    def working_directory(self, options: Mapping) -> str:
        # LocalAI: process.WithWorkDir(filepath.Abs(filepath.Dir(grpcProcess))).
        return os.path.dirname(self.run_file)

    def environment(self, options: Mapping) -> Mapping[str, str]:
        env: dict[str, str] = {}
        if self.models_dir:
            for name in HF_CACHE_VARIABLES:
                if not os.environ.get(name):
                    env[name] = self.models_dir
        env.update(vulkan_icd_environment(self.working_directory(options)))
        return env

    def servicer(self, options: Mapping):
        raise NotImplementedError(f"backend {self.name} always runs a process")


def vulkan_icd_environment(backend_dir: str) -> dict[str, str]:
    """``VK_DRIVER_FILES`` and ``VK_ICD_FILENAMES`` for the ICD manifests a backend bundles in
    ``<dir>/vulkan/icd.d/*.json`` (LocalAI's ``vulkanICDEnv``); empty when it bundles none."""
    icd_dir = os.path.join(backend_dir, "vulkan", "icd.d")
    try:
        with os.scandir(icd_dir) as entries:
            manifests = sorted(e.path for e, _ in zip(entries, range(MAX_ENTRIES))
                               if e.name.endswith(".json") and not e.is_dir())
    except OSError:
        return {}
    if not manifests:
        return {}
    joined = os.pathsep.join(manifests)
    return {"VK_DRIVER_FILES": joined, "VK_ICD_FILENAMES": joined}


def read_metadata(backend_dir: str) -> tuple[dict, str | None]:
    """``(metadata, problem)`` of ``<backend_dir>/metadata.json``: ``({}, None)`` when there is
    none, ``({}, reason)`` when it cannot be used (the reason names the file)."""
    path = os.path.join(backend_dir, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_METADATA_BYTES + 1)
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"{path} cannot be read: {e.strerror}"
    if len(raw) > MAX_METADATA_BYTES:
        return {}, f"{path} is larger than {MAX_METADATA_BYTES} bytes"
    try:
        data = json.loads(raw)
    except ValueError as e:
        return {}, f"{path} is not valid JSON: {e}"
    if not isinstance(data, dict):
        return {}, f"{path} is not a JSON object"
    return data, None


class BackendsDirectory:
    """A LocalAI backends path: ``resolve(name)`` gives the :class:`RunFileBackend` for a
    name, or None when the directory has nothing of that name (see the module docstring)."""

    def __init__(self, path: str, *, models_dir: str | None = None):
        self.path = os.path.abspath(path)
        self.models_dir = models_dir
        #: (the directory's mtime_ns, {alias: directory name}): the aliases are read again
        #: only when an entry was added, removed or renamed (how LocalAI installs a backend).
        self._alias_cache: tuple[int, dict[str, str]] | None = None

    def __repr__(self) -> str:
        return f"<BackendsDirectory {self.path}>"

    def _backend(self, name: str, run_file: str, source: str, problem: str | None = None):
        return RunFileBackend(name, run_file, source=source, models_dir=self.models_dir,
                              problem=problem)

    def resolve(self, name: str) -> RunFileBackend | None:
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            return None
        backend_dir = os.path.join(self.path, name)
        if os.path.isdir(backend_dir):
            return self._resolve_directory(name, backend_dir)
        return self._resolve_alias(name)

    def _resolve_directory(self, name: str, backend_dir: str) -> RunFileBackend:
        run_file = os.path.join(backend_dir, RUN_FILE)
        source = f"backend directory {backend_dir}"
        if os.path.lexists(run_file):
            return self._backend(name, run_file, source)
        metadata, problem = read_metadata(backend_dir)
        if problem is not None:
            return self._backend(name, run_file, source,
                                 f"backend {name!r}: {run_file} does not exist and {problem}")
        target = metadata.get("meta_backend_for")
        if target:
            meta = os.path.join(backend_dir, METADATA_FILE)
            if not isinstance(target, str) or not NAME_RE.fullmatch(target):
                quoted = repr(target)[:80]
                return self._backend(name, run_file, source,
                                     f"backend {name!r}: {meta}: meta_backend_for {quoted} "
                                     f"is not a backend directory name")
            return self._backend(name, os.path.join(self.path, target, RUN_FILE),
                                 f"meta backend {meta} names {target}")
        return self._backend(
            name, run_file, source,
            f"backend {name!r}: {run_file} does not exist: {backend_dir} is not an installed "
            f"LocalAI backend (a backend directory holds run.sh, or a metadata.json naming "
            f"the directory it stands for in meta_backend_for)")

    def _resolve_alias(self, name: str) -> RunFileBackend | None:
        """The first directory (by name) with a ``run.sh`` whose ``metadata.json`` says
        ``"alias": name``.  (LocalAI prefers the candidate that matches the machine's GPU;
        a worker without a GPU choice takes the first.)"""
        target = self._aliases().get(name)
        if target is None:
            return None
        backend_dir = os.path.join(self.path, target)
        return self._backend(name, os.path.join(backend_dir, RUN_FILE),
                             f"alias {name} of backend directory {backend_dir}")

    def _aliases(self) -> dict[str, str]:
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except OSError:
            return {}
        if self._alias_cache is not None and self._alias_cache[0] == stamp:
            return self._alias_cache[1]
        aliases: dict[str, str] = {}
        for candidate in self.names():
            backend_dir = os.path.join(self.path, candidate)
            if not os.path.isfile(os.path.join(backend_dir, METADATA_FILE)) or \
                    not os.path.lexists(os.path.join(backend_dir, RUN_FILE)):
                continue
            metadata, problem = read_metadata(backend_dir)
            alias = metadata.get("alias") if problem is None else None
            if isinstance(alias, str) and NAME_RE.fullmatch(alias):
                aliases.setdefault(alias, candidate)
        self._alias_cache = (stamp, aliases)
        return aliases

    def names(self) -> list[str]:
        """The directory names that look like backends (for listings; not validated)."""
        try:
            with os.scandir(self.path) as entries:
                return sorted(e.name for e, _ in zip(entries, range(MAX_ENTRIES))
                              if NAME_RE.fullmatch(e.name) and e.is_dir())
        except OSError:
            return []


def parse_external_backend(raw: str, option: str) -> tuple[str, str]:
    """``NAME:PATH`` (LocalAI's ``--external-grpc-backends`` item) -> ``(name, absolute path)``.

    ``NAME:HOST:PORT``, a backend already running, is refused: the worker only serves
    processes it started and supervises."""
    name, sep, uri = raw.strip().partition(":")
    if not sep or not name or not uri.strip():
        raise usage.UsageError(f"{option}: {raw!r} is not NAME:PATH (the backend name a model "
                               f"config uses, a colon, the program to run)")
    if not NAME_RE.fullmatch(name):
        raise usage.UsageError(f"{option}: backend name {name!r} must be letters, digits, "
                               f"'.', '_' or '-' (at most 128)")
    if name == "external":
        raise usage.UsageError(f"{option}: 'external' is the built-in backend that runs "
                               f"options.command; give your backend another name")
    uri = os.path.expanduser(uri.strip())
    if "/" not in uri:
        raise usage.UsageError(
            f"{option}: {raw!r}: {uri!r} is not a path; NAME:HOST:PORT (a backend that is "
            f"already running) is not supported by the worker, which runs and supervises its "
            f"backends itself: give the path of the program (e.g. /opt/backends/x/run.sh)")
    return name, os.path.abspath(uri)


def check_external_backends(pairs, option: str = "--external-grpc-backends") -> None:
    """Refuse a name given twice (options' ``validate``)."""
    seen: set[str] = set()
    for name, _ in pairs or ():
        if name in seen:
            raise usage.UsageError(f"{option}: backend {name!r} is given twice")
        seen.add(name)


class LocalAIBackends:
    """The supervisor's ``lookup(name)``: ``--external-grpc-backends``, then the backends
    directory, then the factories (order and reasons in the module docstring)."""

    def __init__(self, factories, backends_path: str | None = None,
                 external: Iterable[tuple[str, str]] = (), *, models_dir: str | None = None):
        self.factories = factories
        self.directory = BackendsDirectory(backends_path, models_dir=models_dir) \
            if backends_path else None
        self.external: dict[str, RunFileBackend] = {
            name: RunFileBackend(name, path, source=f"--external-grpc-backends {name}:{path}",
                                 models_dir=models_dir)
            for name, path in external}
        self._shadow_logged: set[str] = set()

    def lookup(self, name: str) -> IBackendFactory:
        if name == "external":
            return self.factories.lookup(name)
        if name in self.external:
            return self.external[name]
        found = self.directory.resolve(name) if self.directory is not None else None
        if found is not None:
            if name in self.factories and name not in self._shadow_logged:
                self._shadow_logged.add(name)
                log.info("backend {name}: {source} is used instead of the built-in of that "
                         "name ({run_file})", name=name, source=found.source,
                         run_file=found.run_file)
            return found
        try:
            return self.factories.lookup(name)
        except UnknownBackend as e:
            if self.directory is None:
                raise
            raise UnknownBackend(f"{e}; no backend directory "
                                 f"{os.path.join(self.directory.path, name)} either "
                                 f"(install LocalAI backends into {self.directory.path})") from None

    def names(self) -> list[str]:
        names = set(self.factories.names()) | set(self.external)
        if self.directory is not None:
            names |= set(self.directory.names())
        return sorted(names)

    def __contains__(self, name: object) -> bool:
        return name in self.external or name in self.factories or (
            self.directory is not None and isinstance(name, str)
            and self.directory.resolve(name) is not None)
