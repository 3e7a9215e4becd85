"""The frontend replica's service tree: database, membership, tunnels, health and the web root.

:class:`FrontendService` is built from the ``localai-frontend`` options.  At construction it
creates what needs no database: the ``DatabaseService``, the HTTP listener and the resource tree
(every API answers 503 until the replica is wired).  On start it listens at once (``/healthz``
answers, ``/readyz`` says why it is not ready), and once the database is ready it wires, in
order:

1. ``NodeRegistry`` and ``OwnershipFence`` on the database;
2. the advertised peer address: ``--advertise-address`` if given (loopback only with
   ``--single-host``), else discovered from the route to the database; when discovery finds
   nothing other replicas could dial, ``--single-host`` falls back to ``127.0.0.1:<port>`` and
   otherwise the replica publishes no address (it works alone; other replicas cannot relay to
   it, which they report as an unreachable peer, never as a statement about a worker);
3. ``TunnelRegistry``, the accepted peer links, the ``PeerPool``, the ``WorkerDialer`` and the
   per-node ``WorkerHTTPClient``; then the inference core (``self.inference``, an
   ``IInferenceRouter``: model YAML from ``--models-dir``, gRPC bridges under
   ``<data-dir>/run``, the scheduler);
4. ``MembershipService`` with the ``InstanceIdentity`` (whose peer secret is minted once per
   process and never leaves it); a failed first registration fails startup;
5. the ``HealthMonitor`` with a ``DepartureNotifier`` whose subscribers drop this process's
   per-node HTTP connection pools and gRPC bridges;
6. the APIs and the tunnel endpoints go live; ``/readyz`` turns 200 (database ready *and*
   membership registered).

Routes: ``/healthz``, ``/readyz``, ``/api/node/register``, ``/api/node/{id}/heartbeat``,
``/api/nodes...`` (with ``/api/nodes/scheduling``, the pinning API) and
``/api/cluster/instances`` (admin, ``--api-key``),
``/api/cluster/connect`` (worker tunnels), ``/api/cluster/peer`` (replica links), and the
OpenAI-compatible ``/v1/...`` (``frontend/openai.py``; open unless ``--api-key`` is set).

Stopping runs in this order: stop accepting connections; close the tunnels (releasing their
claims), the peer links and the worker HTTP pools *before* leaving ``instances``; deregister
membership; stop the health monitor; close the database.  Tunnel events are logged by the tunnel
modules with node, replica and epoch; this module logs the replica's lifecycle.

This module only composes: it must not grow protocol logic, never log a secret (registration
token, API keys, peer secret), and never block the reactor (address discovery runs in a thread).
"""

from __future__ import annotations

import dataclasses
import os

from typing import Any, Mapping

from twisted.application.service import MultiService, Service
from twisted.internet import defer, endpoints
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource

from localai_tw import __version__
from localai_tw.cluster.departure import DepartureNotifier
from localai_tw.cluster.health import HealthMonitor
from localai_tw.cluster.membership import (
    AdvertiseAddressError,
    InstanceIdentity,
    MembershipService,
    check_advertised_address,
    discover_advertised_address_async,
    resolve_instance_id,
)
from localai_tw.cluster.nodes import NodeNotFound, NodeRegistry
from localai_tw.cluster.ownership import OwnershipFence
from localai_tw.db.service import DatabaseService, DatabaseServiceStopped
from localai_tw.tunnel.connect import connect_resource
from localai_tw.tunnel.endpoint import WorkerHTTPClient
from localai_tw.tunnel.peer import AcceptedPeerLinks, PeerPool
from localai_tw.tunnel.peertls import published_address
from localai_tw.tunnel.registry import TunnelRegistry
from localai_tw.tunnel.route import WorkerDialer

from .nodes_api import InstancesResource, NodesAdminResource
from .openai import OPENAI_MAX_BODY_BYTES, OpenAIResource
from .scheduling_api import NodesWithScheduling, SchedulingResource
from .web import APIKeyGuard, ClusterParts, FrontendSite, JSONDirectory, LateResource
from .worker_api import WorkerRegistrationResource

log = Logger()

#: What ``GET /`` answers: where the APIs and their documentation are.
ROOT_INDEX = {
    "name": "localai-tw",
    "version": __version__,
    "openai_api": "/v1",
    "models": "/v1/models",
    "admin_api": "/api/nodes",
    "health": {"liveness": "/healthz", "readiness": "/readyz"},
    "docs": "docs/openai-api.md and docs/operators.md in the localai-tw source",
}


class FrontendStartupError(Exception):
    """The replica could not be wired (bad advertised address, membership refused)."""


class FrontendStopped(Exception):
    """The service was stopped before it was wired."""


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
        self._outcome: Any = None
        self._waiters: list[defer.Deferred] = []

    def startService(self) -> None:
        super().startService()
        self._outcome = None
        endpoint = endpoints.serverFromString(self._reactor, self.description)
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
        self._outcome = result
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.errback(result) if isinstance(result, Failure) else d.callback(result)

    def whenListening(self) -> defer.Deferred:
        """Fires with the ``IListeningPort``, or fails with the reason it could not listen."""
        if self._outcome is not None:
            return defer.fail(self._outcome) if isinstance(self._outcome, Failure) \
                else defer.succeed(self._outcome)
        d = defer.Deferred()
        self._waiters.append(d)
        return d

    def tcp_port(self) -> int | None:
        host = self.port.getHost() if self.port is not None else None
        return getattr(host, "port", None)

    def stopService(self) -> defer.Deferred:
        super().stopService()
        port, self.port = self.port, None
        if port is None:
            return defer.succeed(None)
        return defer.maybeDeferred(port.stopListening)


class _Readiness:
    """What ``ReadinessResource`` asks: ready = database ready AND membership registered."""

    def __init__(self, frontend: "FrontendService"):
        self._frontend = frontend

    @property
    def database(self):
        return self._frontend.database_service.database

    def readiness(self) -> tuple[bool, str]:
        ready, reason = self._frontend.database_service.readiness()
        if not ready:
            return False, reason
        return self._frontend.readiness()


def _option(options: Mapping[str, Any], name: str, default=None):
    value = options.get(name, default)
    return default if value is None else value


class FrontendService(MultiService):
    """One frontend replica.

    :param options: the parsed ``localai-frontend`` options (a mapping: ``listen``,
        ``database-url``, ``data-dir``, ``instance-id``, ``advertise-address``,
        ``single-host``, ``registration-token``, ``api-key``, ``reconnect-grace``,
        ``require-approval``).
    :param reactor: the reactor (tests pass the global one; ticks use it too).
    :param database_service: replaces the ``DatabaseService`` built from the options.
    :param health_interval: seconds between health passes.
    :param stale_after: heartbeat age that marks a node offline.
    """

    name = "frontend"

    def __init__(self, options: Mapping[str, Any], *, reactor=None,
                 database_service: DatabaseService | None = None,
                 version: str = __version__,
                 health_interval: float = 15.0, stale_after: float = 60.0):
        super().__init__()
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        self._reactor = reactor
        self.version = version
        self.instance_id = resolve_instance_id(_option(options, "instance-id"))
        self._advertise_option = options.get("advertise-address")
        self._single_host = bool(options.get("single-host"))
        self._registration_token = _option(options, "registration-token", "")
        self._peer_ca_file = options.get("peer-ca-file")
        self._require_approval = bool(options.get("require-approval"))
        self.reconnect_grace = _option(options, "reconnect-grace")
        data_dir = options.get("data-dir")
        #: Model YAML files (``--models-dir``, default ``<data-dir>/models``).
        self.models_dir = _option(options, "models-dir") or os.path.join(data_dir or ".",
                                                                        "models")
        #: Where the gRPC bridge sockets live (None: a private temporary directory).
        self.run_dir = os.path.join(data_dir, "run") if data_dir else None
        self._health_interval = health_interval
        self._stale_after = stale_after
        # The peer secret is minted here, once per process; only its hash is published, and
        # the identity's repr leaves it out.
        self._identity_seed = InstanceIdentity(self.instance_id, version)

        self.database_service = database_service or DatabaseService(
            options.get("database-url"), options.get("data-dir"),
            application_name="localai_frontend", reactor=reactor)
        self.database_service.setServiceParent(self)

        #: Set once wired: what the APIs work with (None = 503 "starting").
        self.parts: ClusterParts | None = None
        self.nodes: NodeRegistry | None = None
        self.fence: OwnershipFence | None = None
        self.tunnels: TunnelRegistry | None = None
        self.peer_links: AcceptedPeerLinks | None = None
        self.peer_pool: PeerPool | None = None
        self.dialer: WorkerDialer | None = None
        self.worker_http: WorkerHTTPClient | None = None
        self.notifier: DepartureNotifier | None = None
        self.membership: MembershipService | None = None
        self.health: HealthMonitor | None = None
        self.identity: InstanceIdentity | None = None
        #: The inference core (``IInferenceRouter``), set once wired; see frontend/inference.py.
        self.inference = None
        self.backend_clients = None
        self.control = None

        self.api_keys = APIKeyGuard(options.get("api-key") or [])
        self._connect_slot = LateResource("the worker tunnel endpoint")
        self._peer_slot = LateResource("the replica peer endpoint")
        self.root = self._build_root()
        self.site = FrontendSite(self.root, body_limits={b"/v1/": OPENAI_MAX_BODY_BYTES})
        self.listener = ListeningService(reactor, _option(options, "listen",
                                                          "tcp:8080:interface=127.0.0.1"),
                                         self.site)
        self.listener.setServiceParent(self)
        for prefix, guard in self._header_guards.items():
            self.site.add_header_guard(prefix, guard)

        #: Further conditions of ``/readyz`` once wired: callables answering None (ready) or
        #: the reason (the local worker's first tunnel, ``frontend/localworker.py``).
        self.readiness_gates: list = []

        self._state = "not started"
        self._failure: Failure | None = None
        self._wiring: defer.Deferred | None = None
        self._ready_waiters: list[defer.Deferred] = []
        self._outcome: Any = None

    # -- the web root ----------------------------------------------------------------------

    def _build_root(self) -> Resource:
        from .tap import LivenessResource, ReadinessResource  # tap imports this module lazily

        parts = lambda: self.parts  # noqa: E731 -- read at request time
        root = JSONDirectory(index=ROOT_INDEX)
        root.putChild(b"healthz", LivenessResource())
        root.putChild(b"readyz", ReadinessResource(_Readiness(self), self._reactor))
        # The OpenAI API finds the inference router at request time (503 until it is wired).
        openai = OpenAIResource(lambda: getattr(self, "inference", None),
                                api_keys=self.api_keys, reactor=self._reactor,
                                node_names=self._node_name)
        root.putChild(b"v1", openai)
        api = JSONDirectory()
        root.putChild(b"api", api)
        registration = WorkerRegistrationResource(parts)
        api.putChild(b"node", registration)
        api.putChild(b"nodes", NodesWithScheduling(NodesAdminResource(parts, self.api_keys),
                                                   SchedulingResource(parts, self.api_keys)))
        cluster = JSONDirectory()
        api.putChild(b"cluster", cluster)
        cluster.putChild(b"instances", InstancesResource(parts, self.api_keys))
        cluster.putChild(b"connect", self._connect_slot)
        cluster.putChild(b"peer", self._peer_slot)
        # Authentication decided when the headers end, before a body byte is read (FrontendSite).
        self._header_guards = {b"/v1": openai.guard, b"/api/node": registration.guard,
                               b"/api/nodes": self.api_keys.check,
                               b"/api/cluster/instances": self.api_keys.check}
        return root

    async def _node_name(self, node_id: str) -> str | None:
        """The name of a node, for the ``X-LocalAI-Node`` header (None when it is unknown)."""
        if self.parts is None:
            return None
        try:
            return (await self.parts.nodes.get_node(node_id)).name
        except NodeNotFound:
            return None

    # -- readiness and startup outcome -------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) of the replica itself (the database is checked by the caller)."""
        if self._failure is not None:
            return False, f"startup failed: {self._failure.getErrorMessage()}"
        if self.parts is None:
            return False, self._state
        for gate in self.readiness_gates:
            reason = gate()
            if reason:
                return False, reason
        return True, "ready"

    def whenReady(self) -> defer.Deferred:
        """Fires with this service once wired and registered; fails with the startup error
        (``DatabaseStartupError``, ``FrontendStartupError``, a listen error) or
        ``FrontendStopped``."""
        if self._outcome is not None:
            return defer.fail(self._outcome) if isinstance(self._outcome, Failure) \
                else defer.succeed(self._outcome)
        d = defer.Deferred()
        self._ready_waiters.append(d)
        return d

    def _settle(self, outcome) -> None:
        self._outcome = outcome
        if isinstance(outcome, Failure) and not outcome.check(FrontendStopped):
            self._failure = outcome
        waiters, self._ready_waiters = self._ready_waiters, []
        for d in waiters:
            d.errback(outcome) if isinstance(outcome, Failure) else d.callback(outcome)

    # -- start ----------------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()  # database and listener start now
        self._state = "waiting for the database"
        self._wiring = defer.ensureDeferred(self._wire())
        self._wiring.addCallbacks(self._wired, self._wiring_failed)

    def _check_running(self) -> None:
        if not self.running:
            raise FrontendStopped("the frontend was stopped while starting")

    async def _wire(self) -> None:
        await self.listener.whenListening()
        try:
            db = await self.database_service.whenReady()
        except DatabaseServiceStopped:
            raise FrontendStopped("the frontend was stopped while starting") from None
        self._check_running()
        reactor, grace = self._reactor, self.reconnect_grace

        self._state = "wiring the cluster layer"
        self.nodes = NodeRegistry(db, registration_token=self._registration_token,
                                  require_approval=self._require_approval)
        self.fence = OwnershipFence(db)
        advertised = await self._advertised_address(db)
        self._check_running()
        self.identity = dataclasses.replace(  # wss://host:port when --listen is ssl:
            self._identity_seed, advertised_addr=published_address(advertised,
                                                                   self.listener.description))

        self.tunnels = TunnelRegistry(self.fence, self.instance_id, reactor)
        self.peer_links = AcceptedPeerLinks(db, self.tunnels, self._registration_token, reactor)
        self.peer_pool = PeerPool(db, self.identity, self._registration_token, reactor,
                                  ca_file=self._peer_ca_file)
        self.dialer = WorkerDialer(self.tunnels, self.fence, self.peer_pool, self.instance_id,
                                   grace, reactor)
        self.worker_http = WorkerHTTPClient(self.dialer, reactor)
        self._wire_inference(db, reactor, grace)
        # One subscriber drops every per-node connection of this process: the HTTP pools and
        # the gRPC bridges (their sockets and channels).
        self.notifier = DepartureNotifier({
            "worker-http-connections": self._forget_worker_connections,
        })

        self._state = "joining the cluster (registering this replica)"
        self.membership = MembershipService(db, self.identity, reactor=reactor,
                                            reconnect_grace=grace or 0,
                                            on_reregistered=self.tunnels.reclaim)
        self.membership.setServiceParent(self)
        await self.membership.whenRegistered()
        self._check_running()

        self.health = HealthMonitor(db, self.nodes, self.fence, self.notifier, reactor,
                                    interval=self._health_interval,
                                    stale_after=self._stale_after, grace=grace)
        self.health.setServiceParent(self)

        self._connect_slot.target = connect_resource(self.nodes, self.tunnels, reactor)
        self._peer_slot.target = self.peer_links.resource()
        self.parts = ClusterParts(db=db, nodes=self.nodes, fence=self.fence,
                                  instance_id=self.instance_id, reconnect_grace=grace,
                                  on_registered=self._node_registered,
                                  on_deleted=self._node_deleted, control=self.control)

    def _forget_worker_connections(self, node_id: str) -> defer.Deferred:
        forgetting = [self.worker_http.forget(node_id)]
        if self.backend_clients is not None:
            forgetting.append(self.backend_clients.forget(node_id))
        return defer.DeferredList(forgetting, consumeErrors=True)

    def _wire_inference(self, db, reactor, grace) -> None:
        from localai_tw.tunnel.endpoint import ControlClient

        from .backend_client import BackendClients
        from .grpcbridge import GrpcBridges
        from .inference import InferenceRouter
        from .models import ModelCatalog
        from .scheduler import Scheduler

        # Control calls carry each node's own control token, never the registration token.
        self.control = ControlClient(self.worker_http, reactor=reactor,
                                     token_for=self.nodes.control_token)
        self.backend_clients = BackendClients(
            GrpcBridges(self.dialer, self.run_dir, self.instance_id, reactor), reactor,
            self._registration_token or None)
        catalog = ModelCatalog(self.models_dir)
        scheduler = Scheduler(db, self.nodes, self.fence, self.control, self.worker_http,
                              self.backend_clients, self.instance_id, self.models_dir, reactor,
                              grace=grace)
        self.inference = InferenceRouter(catalog, scheduler, self.backend_clients, reactor)

    def _wired(self, _) -> None:
        self._state = "ready"
        log.info("frontend replica {replica} ready (version {version}, advertised "
                 "{addr}, port {port})", replica=self.instance_id, version=self.version,
                 addr=self.identity.advertised_addr or "<none>", port=self.listener.tcp_port())
        self._settle(self)

    def _wiring_failed(self, failure: Failure) -> None:
        if failure.check(FrontendStopped):
            self._settle(failure)
            return
        self._state = "startup failed"
        log.error("frontend replica {replica} could not start: {reason}",
                  replica=self.instance_id, reason=" ".join(failure.getErrorMessage().split()))
        self._settle(failure)

    async def _advertised_address(self, db) -> str:
        """The peer address to publish ('' when there is none other replicas could dial)."""
        port = self.listener.tcp_port()
        if self._advertise_option is not None:
            host, configured_port = self._advertise_option
            text = f"[{host}]:{configured_port}" if ":" in host else f"{host}:{configured_port}"
            try:
                return check_advertised_address(text, single_host=self._single_host)
            except AdvertiseAddressError as e:
                raise FrontendStartupError(str(e)) from None
        if port is None:
            log.warn("frontend replica {replica} listens on no TCP port, so it advertises no "
                     "peer address; other replicas cannot relay through it. Set "
                     "--advertise-address", replica=self.instance_id)
            return ""
        try:
            return await discover_advertised_address_async(db.dsn, port,
                                                           single_host=self._single_host)
        except AdvertiseAddressError as e:
            if self._single_host:
                address = f"127.0.0.1:{port}"
                log.info("single-host mode: advertising {addr} ({why})", addr=address,
                         why=e)
                return address
            log.warn("frontend replica {replica} advertises no peer address: {why}. It works "
                     "alone, but other replicas cannot relay to the workers it holds",
                     replica=self.instance_id, why=e)
            return ""

    # -- lifecycle hooks of the APIs ---------------------------------------------------------------

    def _node_registered(self, node_id: str) -> None:
        """The node's credential was just rotated: a tunnel held here with the old one goes."""
        if self.tunnels is not None and self.tunnels.disconnect(node_id):
            log.info("node {node} registered again: closed the tunnel replica {replica} held "
                     "with its previous credential", node=node_id, replica=self.instance_id)

    def _node_deleted(self, node_id: str) -> defer.Deferred | None:
        if self.tunnels is not None:
            self.tunnels.disconnect(node_id)
        if self.backend_clients is not None:
            self.backend_clients.forget(node_id)
        if self.worker_http is not None:
            return self.worker_http.forget(node_id)
        return None

    # -- stop -----------------------------------------------------------------------------------

    def stopService(self) -> defer.Deferred:
        Service.stopService(self)  # children are stopped below, in our order
        return defer.ensureDeferred(self._stop())

    async def _stop(self) -> None:
        log.info("frontend replica {replica} stopping: closing {count} tunnels",
                 replica=self.instance_id,
                 count=len(self.tunnels.held_nodes()) if self.tunnels is not None else 0)
        self.parts = None
        stopped: set[int] = set()

        async def stop(service) -> None:
            if service is None or id(service) in stopped:
                return
            stopped.add(id(service))
            if not service.running:
                return
            try:
                await defer.maybeDeferred(service.stopService)
            except Exception:
                log.failure("stopping {name} failed", Failure(), name=service.name)

        await stop(self.listener)                   # 1. accept nothing new
        if self.tunnels is not None:                # 2. tunnels before leaving instances
            await self.tunnels.close()
        for closing in (self.peer_links, self.peer_pool):
            if closing is not None:
                closing.close()
        if self.backend_clients is not None:
            try:
                await self.backend_clients.close()
            except Exception:
                log.failure("closing the gRPC bridges failed", Failure())
        if self.worker_http is not None:
            try:
                await self.worker_http.close()
            except Exception:
                log.failure("closing the worker HTTP pools failed", Failure())
        await stop(self.membership)                 # 3. deregister
        await stop(self.health)                     # 4. health
        await stop(self.database_service)           # 5. the database last
        for service in reversed(list(self)):
            await stop(service)
        if self._outcome is None:
            self._settle(Failure(FrontendStopped("the frontend was stopped while starting")))
        log.info("frontend replica {replica} stopped", replica=self.instance_id)
