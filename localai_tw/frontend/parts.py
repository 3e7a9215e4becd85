"""The replica's listener and its long-lived parts as services (children of the tree in
``service.py``): what each one closes when the replica stops, in the tree's order."""

from __future__ import annotations

from twisted.application.service import Service
from twisted.internet import defer, endpoints
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.config import with_fleet_backlog
from localai_tw.deferreds import OneShotObserver
from localai_tw.frontend.inference.backend_client import BackendClients
from localai_tw.tunnel.endpoint import WorkerHTTPClient
from localai_tw.tunnel.peer import AcceptedPeerLinks, PeerPool
from localai_tw.tunnel.registry import TunnelRegistry

log = Logger()


class ListeningService(Service):
    """Listens on a server endpoint description and keeps the ``IListeningPort``.

    Unlike ``strports.service``, the port is public (``port``), so the replica can advertise the
    port it really got; a failure to listen arrives through ``whenListening()``.
    """

    name = "http"

    def __init__(self, reactor, description: str, factory):
        self._reactor = reactor
        self.description = description
        self.factory = factory
        self.port = None
        #: The outcome of the current start's listen (the port, or why it failed).
        self._listening = OneShotObserver()

    def startService(self) -> None:
        super().startService()
        if self._listening.fired:  # started again: a new listen, a new outcome
            self._listening = OneShotObserver()
        endpoint = endpoints.serverFromString(self._reactor,
                                              with_fleet_backlog(self.description))
        endpoint.listen(self.factory).addBoth(self._listened)

    def _listened(self, result) -> None:
        if isinstance(result, Failure):
            log.error("cannot listen on {description}: {reason}", description=self.description,
                      reason=result.getErrorMessage())
        else:
            self.port = result
            log.info("listening on {address}", address=result.getHost())
            if not self.running:  # stopped while the listen was in flight
                self.port = None
                result.stopListening()
        self._listening.fire(result)

    def whenListening(self) -> defer.Deferred:
        """Fires with the ``IListeningPort``, or fails with the reason it could not listen."""
        return self._listening.when()

    def tcp_port(self) -> int | None:
        host = self.port.getHost() if self.port is not None else None
        return getattr(host, "port", None)

    def stopService(self) -> defer.Deferred:
        super().stopService()
        port, self.port = self.port, None
        if port is None:
            return defer.succeed(None)
        return defer.maybeDeferred(port.stopListening)


class TunnelRegistryService(Service):
    """The worker tunnels held here: stopping closes them, releasing their claims."""

    name = "tunnels"

    def __init__(self, tunnels: TunnelRegistry, instance_id: str):
        self.tunnels = tunnels
        self._instance_id = instance_id

    def stopService(self) -> defer.Deferred:
        super().stopService()
        log.info("frontend replica {replica} stopping: closing {count} tunnels",
                 replica=self._instance_id, count=len(self.tunnels.held_nodes()))
        return self.tunnels.close()


class PeerService(Service):
    """The replica links: those other replicas dialed here, and those dialed from here."""

    name = "peers"

    def __init__(self, accepted: AcceptedPeerLinks, pool: PeerPool):
        self.accepted = accepted
        self.pool = pool

    def stopService(self) -> None:
        super().stopService()
        self.accepted.close()
        self.pool.close()


class WorkerClientsService(Service):
    """This process's per-node connections: the gRPC bridges and the worker HTTP pools; and
    its model downloads (``downloads.py``), stopped with them.  With a ``sweep``
    (``frontend/inference/channels.py``) the gRPC channels whose placement is gone are closed
    while it runs; the sweep stops first."""

    name = "worker-clients"

    def __init__(self, backend_clients: BackendClients, worker_http: WorkerHTTPClient,
                 downloads=None, sweep=None):
        self.backend_clients = backend_clients
        self.worker_http = worker_http
        self.downloads = downloads
        self.sweep = sweep

    def startService(self) -> None:
        super().startService()
        if self.sweep is not None:
            self.sweep.startService()

    def stopService(self) -> defer.Deferred:
        super().stopService()
        return defer.ensureDeferred(self._close())

    async def _close(self) -> None:
        if self.sweep is not None and self.sweep.running:
            await self.sweep.stopService()
        if self.downloads is not None:
            self.downloads.close()
        for what, closing in (("the gRPC bridges", self.backend_clients),
                              ("the worker HTTP pools", self.worker_http)):
            try:
                await defer.maybeDeferred(closing.close)
            except Exception:
                log.failure("closing {what} failed", Failure(), what=what)
