"""Service-tree pieces every subsystem uses.

:class:`InOrderMultiService`: Twisted's ``MultiService`` stops its children all at once; a tree
whose order is its start order and, reversed, its stop order needs each child stopped after the
one started after it has finished (the listener before the replica's parts, these before the
database; a local worker before its frontend).
"""

from __future__ import annotations

from twisted.application.service import MultiService, Service
from twisted.internet import defer
from twisted.logger import Logger

log = Logger()


class InOrderMultiService(MultiService):
    """A ``MultiService`` that stops its children one at a time, last added first, each after
    the previous one has finished stopping (the listener before the replica's parts, these
    before the database; the local worker before its frontend)."""

    def stopService(self):
        Service.stopService(self)
        return defer.ensureDeferred(self._stop_in_order())

    async def _stop_in_order(self) -> None:
        for service in reversed(list(self)):
            if not service.running:
                continue
            try:
                await defer.maybeDeferred(service.stopService)
            except Exception:
                log.failure("stopping {name} failed", name=getattr(service, "name", service))
