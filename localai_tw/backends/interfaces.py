"""The seam operator plugins fill: :class:`IBackendFactory`, and how factories are found.

A backend factory says how to run one kind of backend: the argv of a process that serves the
LocalAI ``backend.Backend`` gRPC service on the address it is given (the usual case, and what
every LocalAI backend is), or, when ``command`` returns None, a servicer object the worker
serves in-process.  Factories are found with ``twisted.plugin.getPlugins`` in two plugin
packages:

- ``localai_tw.plugins``: the built-ins ship there, and an operator drops a module into any
  ``localai_tw/plugins/`` directory **without** an ``__init__.py`` on ``sys.path``
  (``twisted.plugin.pluginPackagePaths`` semantics: directories holding an ``__init__.py``
  are real packages and are not scanned as drop-in paths);
- ``twisted.plugins``: any ``twisted/plugins/`` directory on ``sys.path``, the usual place for
  Twisted plugins of installed distributions.

A plugin module exposes instances (not classes) that provide :class:`IBackendFactory` at module
level; discovery collects every module attribute that provides the interface.  Name them so
they cannot collide with a submodule of the package they are imported from.

What this module must never do:

- import a backend's heavy dependencies (torch, transformers ...): a factory only builds an
  argv; the program it names imports what it needs in its own process;
- let a broken plugin hide the others: a module that fails to import is logged by
  ``twisted.plugin`` and skipped; a factory without a usable name is skipped with a warning;
- pick silently between two plugins claiming one name: an operator plugin overriding a built-in
  is logged; two operator plugins with the same name make that name ambiguous (an error naming
  both modules) rather than whichever the file system listed first.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from twisted.logger import Logger
from twisted.plugin import IPlugin
from zope.interface import Attribute

log = Logger()

#: Module of the plugin package that holds the shipped factories.
BUILTIN_PLUGIN_MODULE = "localai_tw.plugins.localai_builtin_backends"


class BackendUnavailable(Exception):
    """The backend cannot run on this worker (an extra is not installed, a program is
    missing).  The message says what to install or configure."""


class UnknownBackend(LookupError):
    """No factory has this name (or two operator plugins claim it)."""


class IBackendFactory(IPlugin):
    """How to run one kind of backend.

    Extends ``twisted.plugin.IPlugin`` (``getCache`` only records module attributes that
    provide ``IPlugin``), so ``@implementer(IBackendFactory)`` alone makes a plugin."""

    name = Attribute("str: the backend name the frontend asks for, e.g. 'echo' or "
                     "'transformers'; lowercase, no whitespace")
    description = Attribute("str: one line for operators")

    def unavailable_reason() -> str | None:
        """None when the backend can run here, else what is missing and how to get it (for
        example ``pip install 'localai-tw[transformers]'``).  Called before every start; must
        be cheap (``importlib.util.find_spec``, ``shutil.which``), never an import of the
        heavy dependency itself."""

    def command(address: str, options: Mapping) -> Sequence[str] | None:
        """The argv of a process that serves ``backend.Backend`` on ``address``
        (``"127.0.0.1:<port>"``), or None for an in-process backend (see ``servicer``).
        ``options`` is the ``options`` object of the ``backend.start`` request.  Raise
        ``ValueError`` for options this factory cannot use (answered as a start failure)."""

    def environment(options: Mapping) -> Mapping[str, str]:
        """Variables added to the worker's environment for the process (may be empty).

        Optional, not declared here so existing plugins stay valid: a factory may also have
        ``working_directory(options) -> str | None``, the process's working directory when the
        start request gives no ``options.cwd`` (LocalAI backend directories run in their own
        directory: ``localai_tw.backends.directory``)."""

    def servicer(options: Mapping) -> object:
        """Only consulted when ``command`` returned None: a ``BackendServicer`` (from
        ``backend_pb2_grpc``) the worker serves on a gRPC server of its own, in its own
        threads.  Factories that always return an argv may raise ``NotImplementedError``."""


def refresh_plugin_paths(package) -> None:
    """Add drop-in directories that appeared on ``sys.path`` since ``package`` was imported
    (``twisted.plugin`` computes a plugin package's ``__path__`` once, at import)."""
    from twisted.plugin import pluginPackagePaths

    for path in pluginPackagePaths(package.__name__):
        if path not in package.__path__:
            package.__path__.append(path)


def add_plugin_directories(paths: Iterable[str], package=None) -> list[str]:
    """``--plugin-dir``: append each directory of drop-in modules to ``package``'s ``__path__``
    (default ``localai_tw.plugins``, where backend factories and job kinds are discovered)
    unless it is there already, so an operator needs no ``PYTHONPATH``; returns those added.
    Called before anything is discovered."""
    if package is None:
        import localai_tw.plugins as package
    added = []
    for path in paths:
        if path not in package.__path__:
            package.__path__.append(path)
            added.append(path)
    return added


def iter_factory_plugins(packages: Iterable | None = None):
    """Yield ``(factory, module name)`` for every factory plugin in ``packages`` (default:
    ``localai_tw.plugins`` then ``twisted.plugins``).

    This is ``twisted.plugin.getPlugins`` unrolled over ``getCache`` so each factory comes
    with the module that exposes it (needed to tell a built-in from an operator plugin)."""
    from twisted.plugin import getCache

    if packages is None:
        import twisted.plugins

        import localai_tw.plugins

        packages = [localai_tw.plugins, twisted.plugins]
    for package in packages:
        refresh_plugin_paths(package)
        for module_name, dropin in sorted(getCache(package).items()):
            for plugin in dropin.plugins:
                try:
                    factory = IBackendFactory(plugin, None)
                except Exception:
                    log.failure("loading plugin {name} from {module} failed",
                                name=plugin.name, module=module_name)
                    continue
                if factory is not None:
                    yield factory, dropin.moduleName


class BackendFactories:
    """Factories by name.  Built from plugins by :meth:`discover`, or from a list (tests,
    embedding)."""

    def __init__(self, factories: Iterable[IBackendFactory] = (), *, origins=None):
        self._by_name: dict[str, IBackendFactory] = {}
        self._origin: dict[str, str] = {}
        self._ambiguous: dict[str, list[str]] = {}
        for factory in factories:
            self.add(factory, (origins or {}).get(id(factory), "<given>"))

    @classmethod
    def discover(cls, packages: Iterable | None = None) -> "BackendFactories":
        registry = cls()
        found = list(iter_factory_plugins(packages))
        # Built-ins first, so an operator plugin with the same name overrides them.
        found.sort(key=lambda pair: pair[1] != BUILTIN_PLUGIN_MODULE)
        for factory, origin in found:
            registry.add(factory, origin)
        return registry

    def add(self, factory: IBackendFactory, origin: str = "<given>") -> None:
        name = getattr(factory, "name", None)
        if not isinstance(name, str) or not name or name != name.strip() or " " in name:
            log.warn("backend factory plugin in {origin} has no usable name ({name!r}); "
                     "skipped", origin=origin, name=name)
            return
        previous = self._origin.get(name)
        if previous is None:
            self._by_name[name], self._origin[name] = factory, origin
        elif previous == BUILTIN_PLUGIN_MODULE:
            log.info("backend {name}: plugin {origin} overrides the built-in", name=name,
                     origin=origin)
            self._by_name[name], self._origin[name] = factory, origin
        elif previous != origin:
            self._ambiguous.setdefault(name, [previous]).append(origin)
            log.warn("backend {name} is claimed by plugins {origins}: the name is ambiguous "
                     "until one is removed", name=name,
                     origins=", ".join(self._ambiguous[name]))

    def names(self) -> list[str]:
        return sorted(name for name in self._by_name if name not in self._ambiguous)

    def origin(self, name: str) -> str:
        return self._origin[name]

    def lookup(self, name: str) -> IBackendFactory:
        if name in self._ambiguous:
            raise UnknownBackend(f"backend {name!r} is claimed by several plugins "
                                 f"({', '.join(self._ambiguous[name])}); remove all but one")
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise UnknownBackend(f"unknown backend {name!r} (known: {known})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name and name not in self._ambiguous
