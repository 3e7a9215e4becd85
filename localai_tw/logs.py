"""What a twistd plugin's log shows: ``--log-level`` and gRPC core's own logging.

twistd builds its log observer (stdout with ``-n``, else ``twistd.log`` or syslog) after the
plugin's ``makeService`` and before starting the service tree, and it uses the application's
``ILogObserver`` component instead when there is one.  :class:`LevelledMultiService`, the root
service a plugin returns, sets that component when twistd attaches it to the application:
twistd's own default observer, wrapped in a ``FilteringLogObserver`` that drops events below
``--log-level``.  A ``--logger`` given to twistd wins and is not filtered (it is the
operator's explicit choice).

This module must never change what a library logs, only which of it is shown; and it never
overrides ``GRPC_VERBOSITY``/``GRPC_TRACE`` an operator set.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.application.service import MultiService
from twisted.logger import (
    FilteringLogObserver,
    ILogObserver,
    LogLevel,
    LogLevelFilterPredicate,
)
from twisted.python.components import Componentized

LEVELS = {
    "debug": LogLevel.debug,
    "info": LogLevel.info,
    "warn": LogLevel.warn,
    "error": LogLevel.error,
}
DEFAULT_LEVEL = "info"


def quiet_grpc_core(environ: Any = os.environ) -> None:
    """Turn off gRPC core's own stderr logging (C-level lines that bypass twisted.logger)
    unless the operator asked for it with ``GRPC_VERBOSITY`` or ``GRPC_TRACE``.  Must run
    before grpc is first imported; backend processes inherit the setting."""
    if "GRPC_VERBOSITY" not in environ and "GRPC_TRACE" not in environ:
        environ["GRPC_VERBOSITY"] = "NONE"


def level_filter(observer, level: str) -> FilteringLogObserver:
    """``observer`` seeing only events at ``level`` (a key of :data:`LEVELS`) or above."""
    return FilteringLogObserver(
        observer, [LogLevelFilterPredicate(defaultLogLevel=LEVELS[level])])


def twistd_default_observer(server_options) -> Any:
    """The observer twistd would build from its own options (``-n``, ``--logfile``,
    ``--syslog``)."""
    from twisted.scripts.twistd import _SomeApplicationRunner

    return _SomeApplicationRunner.loggerFactory(server_options)._getLogObserver()


class LevelledMultiService(MultiService):
    """A plugin's root service; under twistd, it makes the log honour ``log_level``.

    :param server_options: twistd's ``ServerOptions`` (the plugin options' ``parent``), or
        None outside twistd (tests), where nothing is changed.
    """

    def __init__(self, log_level: str = DEFAULT_LEVEL, server_options=None):
        super().__init__()
        self.log_level = log_level
        self._server_options = server_options

    def setServiceParent(self, parent) -> None:
        options = self._server_options
        if (options is not None and isinstance(parent, Componentized)
                and options.get("logger") is None
                and parent.getComponent(ILogObserver, None) is None):
            parent.setComponent(ILogObserver,
                                level_filter(twistd_default_observer(options), self.log_level))
        super().setServiceParent(parent)
