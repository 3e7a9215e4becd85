"""Plugin package for localai-tw extensions (``twisted.plugin``): backend factories
(:class:`~localai_tw.backends.interfaces.IBackendFactory`) today.

Operators add a plugin by dropping a module into a ``localai_tw/plugins/`` directory that has
**no** ``__init__.py`` anywhere on ``sys.path`` (for example
``/etc/localai-tw/plugins/localai_tw/plugins/my_backend.py`` with
``PYTHONPATH=/etc/localai-tw/plugins``); ``twisted.plugin.pluginPackagePaths`` adds every such
directory to this package's ``__path__``.  A module-level instance providing the interface is
the plugin.  No core code changes.

This package must never hold code other than plugin modules: every module here is imported
during discovery.
"""

from twisted.plugin import pluginPackagePaths

__path__.extend(pluginPackagePaths(__name__))  # noqa: F821 (set by the import system)
__all__: list = []
