"""The frontend replica as a service tree: its order is the start and stop order.

::

    FrontendService            children start in order, stop one at a time, last first
      DatabaseService          stops last
      ReplicaService           waits for the database, builds a Replica (build_replica),
                               starts its services in order, then opens the gate
        HealthMonitor
        MembershipService      a failed first registration fails startup
        WorkerClientsService   the per-node HTTP pools and gRPC bridges
        PeerService            the accepted peer links and the peer pool
        TunnelRegistryService  the worker tunnels held here (their claims)
        ModelUse               batched last-used touches (flushed once more at stop)
        LifecycleWatchdog      idle and busy watchdogs (frontend/inference/lifecycle.py; off by default)
        Preloader              preload: ``preload: true`` models and --preload-models
        ReplicaScaler          min_replicas floor, busy scale-up (frontend/inference/replicas.py)
        PgBus                  the LISTEN/NOTIFY fan-out (the claim queue's wake hint, the
                               gallery's job snapshots, the placement caches' invalidations)
        PlacementFanout        the warm path's placement cache and its invalidations
                               (frontend/inference/placement_cache.py)
        PrefixRouting          the prefix index shared through the bus, its expiry
                               (frontend/inference/prefix_fanout.py)
        GalleryJobs "gallery"  gallery installs and deletes (frontend/gallery/installs.py)
        JobStatsService        reads the jobs queue's depth every 15 s (for /metrics)
        ClaimConsumer "jobs"   claims queued jobs and runs them on agent workers; stops
                               first, releasing its claims (docs/jobs.md)
      ListeningService         listens at once behind the StartingGate (/healthz, /readyz,
                               503 elsewhere); stops first: accept nothing new

So stopping runs: listener; the jobs consumer (its claims released at once), the gallery, the
prefix routing, the placement fan-out and the bus; tunnels (releasing their claims), peer links, worker pools, all
*before* leaving ``instances``; deregister; health; database.  The state of the start is a
:class:`StartupState`, which ``/readyz`` reports.

:func:`build_replica` makes every long-lived part once the database is ready:

1. ``NodeRegistry`` and ``OwnershipFence`` on the database;
2. the advertised peer address: ``--advertise-address`` if given (loopback only with
   ``--single-host``), else discovered from the route to the database; when discovery finds
   nothing other replicas could dial, ``--single-host`` falls back to ``127.0.0.1:<port>`` and
   otherwise the replica publishes no address (it works alone; other replicas cannot relay to
   it, which they report as an unreachable peer, never as a statement about a worker);
3. ``TunnelRegistry``, the accepted peer links, the ``PeerPool``, the ``WorkerDialer`` and the
   per-node ``WorkerHTTPClient``; the inference core (an ``IInferenceRouter``: model YAML from
   ``--models-dir``, gRPC bridges under ``<data-dir>/run``, the node chooser, the load lock and the cold loader);
4. ``MembershipService`` with the ``InstanceIdentity`` (whose peer secret is minted once per
   process and never leaves it);
5. the ``HealthMonitor`` with a ``DepartureNotifier`` whose subscribers drop this process's
   per-node HTTP connection pools and gRPC bridges, and the node's placements from every
   replica's placement cache (through the bus, ``PlacementFanout``), and the node's entries
   from every replica's prefix index (``PrefixRouting``).

The resource tree (:meth:`FrontendService._build_root`) is then built from that ``Replica``:
``/`` (the JSON index, or the dashboard's page for a browser) and ``/dashboard/``,
``/healthz``, ``/readyz``, ``/version``, ``/.well-known/localai.json``, ``/api/features`` and
``/system`` (``frontend/api/discovery.py``), ``/api/node/register``, ``/api/node/{id}/heartbeat``,
``/api/nodes...`` (with ``/api/nodes/scheduling``, the pinning API) and
``/api/cluster/instances``, ``/api/cluster/loads``, ``/api/traces`` (``frontend/api/traces.py``) and ``/metrics`` (admin, ``--api-key``; ``docs/metrics.md``),
``/backend/shutdown`` and ``/backend/load`` (admin, ``frontend/api/lifecycle.py``),
``/api/jobs`` (``frontend/api/jobs.py``; admin, ``docs/jobs.md``),
LocalAI's gallery routes under ``/models`` (``frontend/api/gallery.py``; admin),
``/api/cluster/connect`` (worker tunnels),
``/api/cluster/peer`` (replica links), and the OpenAI-compatible ``/v1/...``
(``frontend/api/openai/``; open unless ``--api-key`` is set).  ``/readyz`` turns 200 once the
gate is open (database ready *and* membership registered, and every readiness gate passed).

Tunnel events are logged by the tunnel modules with node, replica and epoch; this module logs
the replica's lifecycle.  It only composes: it must not grow protocol logic, never log a secret
(registration token, API keys, peer secret), and never block the reactor (address discovery
runs in a thread).
"""

from __future__ import annotations

import dataclasses
import functools
import enum
import os
from typing import Any, Callable, Mapping

from twisted.application.service import Service
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource

from localai_tw import __version__, logs
from localai_tw.deferreds import OneShotObserver
from localai_tw.servicetree import InOrderMultiService
from localai_tw.cluster.departure import DepartureNotifier
from localai_tw.cluster.health import HealthMonitor
from localai_tw.cluster.liveness import DEFAULT_TUNNEL_LIVENESS
from localai_tw.cluster.membership import (
    AdvertiseAddressError,
    InstanceIdentity,
    MembershipService,
    check_advertised_address,
    discover_advertised_address_async,
    resolve_instance_id,
)
from localai_tw.cluster.nodes import (DEFAULT_HEARTBEAT_BATCH, HeartbeatBatch, NodeNotFound,
                                      NodeRegistry)
from localai_tw.cluster.ownership import OwnershipFence
from localai_tw.bus.claims import ClaimConsumer, ClaimQueue, enqueue_statement
from localai_tw.bus.pgbus import PgBus
from localai_tw.jobs.kinds import JobKinds
from localai_tw.db.pool import Database, DatabaseUnavailable, PoolClosed
from localai_tw.db.service import DatabaseService, DatabaseServiceStopped
from localai_tw.metrics import ReplicaMetrics
from localai_tw.web.ratelimit import SourceRateLimit
from localai_tw.tunnel.endpoint import ControlClient, WorkerHTTPClient, upload_file
from localai_tw.tunnel.peer import AcceptedPeerLinks, PeerPool
from localai_tw.tunnel.peertls import published_address
from localai_tw.tunnel.keepalive import DEAD_TUNNEL_DETECTION
from localai_tw.tunnel.liveness import TunnelLiveness
from localai_tw.tunnel.registry import TunnelRegistry
from localai_tw.tunnel.route import WorkerDialer
from localai_tw.tunnel.stampnotice import StampNotices

from localai_tw.frontend.inference.backend_client import BackendClients
from localai_tw.frontend.inference.interfaces import IInferenceRouter
from localai_tw.frontend.jobs.cancel import CancelFanout
from localai_tw.frontend.jobs.dispatch import JobDispatcher, job_consumer
from localai_tw.frontend.jobs.stats import JobStatsService
from localai_tw.frontend.jobs.store import JobStore
from localai_tw.frontend.inference.placement_cache import PlacementCache, PlacementFanout
from localai_tw.frontend.gallery.backend_installs import STAGE_TIMEOUT, BackendInstalls
from localai_tw.frontend.gallery.installs import GalleryJobs
from localai_tw.frontend.gallery.index import parse_galleries
from localai_tw.frontend.api.probes import LivenessResource, ReadinessResource, StartingGate
from localai_tw.frontend.api.kit import APIKeyGuard, ClusterParts
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.response_store import (
    BACKGROUND_SLOTS,
    CLAIM_KIND as RESPONSE_CLAIM_KIND,
    BackgroundRuns,
    ResponseStore,
)
from localai_tw.frontend.api.openai.responses_api import ReplicaResponses, run_claimed
from localai_tw.web.listener import BoundedSite
from localai_tw.web.hosts import HostCheck
from localai_tw.frontend.parts import (
    ListeningService,
    PeerService,
    TunnelRegistryService,
    WorkerClientsService,
)
from localai_tw.frontend.api.routes import Wiring, apply_policies, build_root
from localai_tw.frontend.api.workers import is_heartbeat_path
from localai_tw.frontend.inference.crashes import CrashProbe

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


class StartupState(enum.Enum):
    """Where the replica's start is; ``/readyz`` reports the name, the value is its reason."""

    NOT_STARTED = "not started"
    STARTING_DATABASE = "waiting for the database"
    JOINING = "joining the cluster (registering this replica)"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "startup failed"


def _allowed_hosts(options: Mapping[str, Any]) -> list[str]:
    """The host names an open API answers to besides IP literals and localhost
    (``web/hosts.py``): ``--allowed-host`` and the ``--advertise-address`` host."""
    names = list(options.get("allowed-host") or [])
    advertised = options.get("advertise-address")
    if isinstance(advertised, (tuple, list)) and advertised:
        names.append(str(advertised[0]))
    elif isinstance(advertised, str) and advertised:
        names.append(advertised.rsplit(":", 1)[0].strip("[]"))
    return names


def _option(options: Mapping[str, Any], name: str, default=None):
    value = options.get(name, default)
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    """What :func:`build_replica` needs from the options (read once, at construction)."""

    instance_id: str
    identity_seed: InstanceIdentity
    advertise_address: tuple[str, int] | None
    single_host: bool
    registration_token: str
    peer_ca_file: str | None
    require_approval: bool
    reconnect_grace: float | None
    models_dir: str
    run_dir: str | None
    health_interval: float
    stale_after: float
    #: lifecycle (frontend/inference/lifecycle.py, frontend/inference/preload.py); the defaults change nothing
    max_active_backends: int = 0
    idle_timeout: float = 0.0
    busy_timeout: float = 0.0
    preload_models: tuple[str, ...] = ()
    #: Registrations one source address may make per minute (burst and refill); 0: no limit.
    registration_limit: int = 1200
    #: Seconds a heartbeat waits to share one statement with others (``--heartbeat-batch``);
    #: 0: each heartbeat its own statements.
    heartbeat_batch: float = DEFAULT_HEARTBEAT_BATCH
    #: Seconds between stamps of the held tunnels' heartbeats (``--tunnel-liveness``); 0: off.
    tunnel_liveness: float = DEFAULT_TUNNEL_LIVENESS
    #: Model galleries (``--galleries``, ``frontend/gallery/installs.py``).
    galleries: tuple = ()
    #: Backend galleries (``--backend-galleries``, ``frontend/gallery/backend_installs.py``)
    #: and where this replica packs and downloads their archives.
    backend_galleries: tuple = ()
    backend_archives_dir: str | None = None
    #: Downloads and gallery fetches may reach private and loopback addresses
    #: (``--allow-private-downloads``, ``frontend/inference/fetchpolicy.py``).
    allow_private_downloads: bool = False
    #: The job kinds (a ``JobKinds``); None: found as plugins (``jobs/kinds.py``).
    job_kinds: Any = None
    #: Prefix-cache-aware routing (``--distributed-prefix-cache*``,
    #: ``frontend/inference/prefix_index.py``).
    prefix_cache: bool = True
    prefix_cache_ttl: float = 300.0
    #: How backend calls travel (``--backend-calls``): ``tunnel`` (one framed request on a
    #: kept-alive ``call`` stream) or ``grpc`` (grpcio through a bridge)
    backend_calls: str = "tunnel"

    @classmethod
    def from_options(cls, options: Mapping[str, Any], version: str, health_interval: float,
                     stale_after: float) -> "ReplicaConfig":
        instance_id = resolve_instance_id(_option(options, "instance-id"))
        data_dir = options.get("data-dir")
        return cls(
            instance_id=instance_id,
            # The peer secret is minted here, once per process; only its hash is published,
            # and the identity's repr leaves it out.
            identity_seed=InstanceIdentity(instance_id, version),
            advertise_address=options.get("advertise-address"),
            single_host=bool(options.get("single-host")),
            registration_token=_option(options, "registration-token", ""),
            peer_ca_file=options.get("peer-ca-file"),
            require_approval=bool(options.get("require-approval")),
            reconnect_grace=_option(options, "reconnect-grace"),
            models_dir=_option(options, "models-dir") or os.path.join(data_dir or ".",
                                                                       "models"),
            run_dir=os.path.join(data_dir, "run") if data_dir else None,
            health_interval=health_interval, stale_after=stale_after,
            max_active_backends=int(_option(options, "max-active-backends", 0))
            or (1 if options.get("single-active-backend") else 0),
            idle_timeout=float(_option(options, "watchdog-idle-timeout", 900.0))
            if options.get("enable-watchdog-idle") else 0.0,
            busy_timeout=float(_option(options, "watchdog-busy-timeout", 300.0))
            if options.get("enable-watchdog-busy") else 0.0,
            preload_models=tuple(_option(options, "preload-models", ()))
            + tuple(_option(options, "load-to-memory", ())),
            registration_limit=int(_option(options, "registration-limit", 1200)),
            heartbeat_batch=float(_option(options, "heartbeat-batch", DEFAULT_HEARTBEAT_BATCH)),
            tunnel_liveness=float(_option(options, "tunnel-liveness", DEFAULT_TUNNEL_LIVENESS)),
            galleries=parse_galleries(options.get("galleries") or ()),
            backend_galleries=parse_galleries(options.get("backend-galleries") or (),
                                              "--backend-galleries"),
            backend_archives_dir=os.path.join(data_dir, "backend-archives") if data_dir
            else None,
            allow_private_downloads=bool(options.get("allow-private-downloads")),
            prefix_cache=bool(_option(options, "distributed-prefix-cache", True)),
            prefix_cache_ttl=float(_option(options, "distributed-prefix-cache-ttl", 300.0)),
            backend_calls=str(_option(options, "backend-calls", "tunnel")))


# -- the replica -------------------------------------------------------------------------------


@dataclasses.dataclass
class JobParts:
    """The jobs of this replica (docs/jobs.md): the table, the kinds, the claim-queue consumer
    and its dispatcher, the cancel fan-out."""

    kinds: JobKinds
    store: JobStore
    dispatcher: JobDispatcher
    consumer: ClaimConsumer
    fanout: CancelFanout
    stats: JobStatsService


@dataclasses.dataclass
class Replica:
    """Every long-lived part of a wired replica, real and wired (see :func:`build_replica`)."""

    instance_id: str
    reconnect_grace: float | None
    db: Database
    nodes: NodeRegistry
    fence: OwnershipFence
    identity: InstanceIdentity
    tunnels: TunnelRegistry
    peer_links: AcceptedPeerLinks
    peer_pool: PeerPool
    dialer: WorkerDialer
    worker_http: WorkerHTTPClient
    control: ControlClient
    backend_clients: BackendClients
    inference: IInferenceRouter
    notifier: DepartureNotifier
    membership: MembershipService
    health: HealthMonitor
    bus: PgBus
    jobs: JobParts
    placements: PlacementFanout
    #: Prefix-cache-aware routing shared through the bus (``prefix_fanout.py``).
    prefix: Any = None
    metrics: ReplicaMetrics = dataclasses.field(default_factory=ReplicaMetrics)
    #: lifecycle parts (frontend/inference/usage.py, lifecycle.py, preload.py)
    use: Any = None
    lifecycle: Any = None
    watchdog: Any = None
    preloader: Any = None
    scaler: Any = None
    registration_limit: SourceRateLimit | None = None
    #: The gallery's jobs on the bus (``gallery.py``).
    gallery: GalleryJobs | None = None
    #: Closes the gRPC channels whose placement is gone (``frontend/inference/channels.py``).
    channel_sweep: Any = None
    #: Adopts or stops a returning worker's backends (``frontend/inference/reconcile.py``).
    reconciler: Any = None
    #: The Responses API's store and background runs, with their claim consumer.
    responses: ReplicaResponses | None = None
    #: Stamps the heartbeat of the tunnels held here (``tunnel/liveness.py``).
    liveness: TunnelLiveness | None = None

    def services(self) -> list[Service]:
        """The replica's children in start order (they stop in the reverse order): the jobs
        consumer last, so it stops first, releasing its claims and ending its runs' streams
        while the tunnels, the peer links and this replica's ``instances`` row still exist."""
        return [self.health, self.membership,
                WorkerClientsService(self.backend_clients, self.worker_http,
                                     self._downloads(), self.channel_sweep),
                PeerService(self.peer_links, self.peer_pool),
                TunnelRegistryService(self.tunnels, self.instance_id),
                *([self.liveness] if self.liveness is not None else []),
                *[s for s in (self.use, self.watchdog, self.preloader, self.scaler)
                  if s is not None],
                self.bus, self.placements,
                *([self.prefix] if self.prefix is not None else []),
                *([self.gallery] if self.gallery is not None else []),
                self.jobs.stats,
                *([self.responses.consumer] if self.responses is not None else []),
                self.jobs.consumer]

    def cluster_parts(self) -> ClusterParts:
        """What the admin and worker APIs work with."""
        return ClusterParts(db=self.db, nodes=self.nodes, fence=self.fence,
                            instance_id=self.instance_id, reconnect_grace=self.reconnect_grace,
                            on_registered=self.node_registered, on_deleted=self.node_deleted,
                            control=self.control, lifecycle=self.lifecycle,
                            registration_limit=self.registration_limit,
                            downloads=self.downloads_in_progress,
                            on_scheduling_changed=self.placements.model_changed,
                            staging=self.staging_of)

    def _downloads(self):
        loader = getattr(self.inference, "loader", None)
        return loader.downloads if loader is not None else None

    def downloads_in_progress(self) -> list:
        """This replica's model downloads in progress (``/api/cluster/loads``)."""
        downloads = self._downloads()
        return downloads.in_progress() if downloads is not None else []

    def staging_of(self, model: str) -> dict | None:
        """The bytes staged by this replica's cold load of ``model`` (None: none staging)."""
        watch = getattr(getattr(self.inference, "loads", None), "staging", {}).get(model)
        return watch.view() if watch is not None else None

    def node_registered(self, node_id: str) -> None:
        """The node's credential was just rotated: a tunnel held here with the old one goes."""
        if self.tunnels.disconnect(node_id):
            log.info("node {node} registered again: closed the tunnel replica {replica} held "
                     "with its previous credential", node=node_id, replica=self.instance_id)

    def node_deleted(self, node_id: str) -> defer.Deferred:
        self.tunnels.disconnect(node_id)
        self.backend_clients.forget(node_id)
        return self.worker_http.forget(node_id)

    async def node_name(self, node_id: str) -> str | None:
        """The name of a node, for the ``X-LocalAI-Node`` header (None when it is unknown)."""
        try:
            return (await self.nodes.get_node(node_id)).name
        except NodeNotFound:
            return None


def _responses(db, queue: ClaimQueue, bus: PgBus, inference, instance_id: str,
               reactor) -> ReplicaResponses:
    """The Responses API's store, and the consumer every replica runs of its background
    responses (claims of kind ``response``; docs/responses-api.md)."""
    store = ResponseStore(db, instance_id, enqueue=enqueue_statement, wake=queue.wake)
    runs = BackgroundRuns(bus)
    context = Context(inference, reactor=reactor)
    consumer = ClaimConsumer(queue, instance_id, [RESPONSE_CLAIM_KIND],
                             functools.partial(run_claimed, store, runs, context), bus=bus,
                             max_in_flight=BACKGROUND_SLOTS, on_exhausted=store.exhausted,
                             reactor=reactor)
    consumer.name = "responses"
    return ReplicaResponses(store, runs, consumer)


async def build_replica(config: ReplicaConfig, db: Database, port: int | None,
                        reactor, listen_description: str = "") -> Replica:
    """Every part of the replica, wired on the ready database (module docstring, steps 1-5).
    Nothing is started here: :class:`ReplicaService` starts the services."""
    from localai_tw.frontend.inference.channels import PlacementSweep
    from localai_tw.frontend.inference.coldload import ColdLoader
    from localai_tw.frontend.inference.reconcile import BackendReconciler
    from localai_tw.frontend.inference.grpcbridge import GrpcBridges
    from localai_tw.frontend.inference.router import InferenceRouter
    from localai_tw.frontend.inference.lifecycle import LifecycleWatchdog, ModelLifecycle
    from localai_tw.frontend.inference.loadlock import LoadLock
    from localai_tw.localai.catalog import ModelCatalog
    from localai_tw.frontend.inference.placement import NodeChooser
    from localai_tw.frontend.inference.prefix_fanout import PrefixRouting
    from localai_tw.frontend.inference.prefix_index import PrefixSettings
    from localai_tw.frontend.inference.preload import Preloader
    from localai_tw.frontend.inference.replicas import ReplicaScaler
    from localai_tw.frontend.inference.usage import ModelUse
    from localai_tw.frontend.inference.scratch import WorkerScratch

    grace = config.reconnect_grace
    # The warm path's placement cache, told of changes here and by every replica through the
    # bus (frontend/inference/placement_cache.py): a warm request reads no database.  The bus
    # is also the claim queue's wake hint and the gallery's job snapshots (below).  Built
    # first: the parts below are handed its callbacks when they are made.
    bus = PgBus(db, reactor=reactor)
    placements = PlacementFanout(PlacementCache(reactor), bus, reactor)
    nodes = NodeRegistry(db, registration_token=config.registration_token,
                         require_approval=config.require_approval,
                         on_changed=placements.node_changed,
                         heartbeat_batch=HeartbeatBatch(db, reactor, config.heartbeat_batch)
                         if config.heartbeat_batch > 0 else None)
    fence = OwnershipFence(db)
    advertised = await advertised_address(config, db, port)
    identity = dataclasses.replace(  # wss://host:port when --listen is ssl:
        config.identity_seed, advertised_addr=published_address(advertised, listen_description))

    tunnels = TunnelRegistry(fence, config.instance_id, reactor)
    # An open tunnel was heard from within the keepalive bound: its heartbeat is stamped that
    # much (and a second) before now, by this replica only while it holds the claim.
    # Each pass's written stamps are noticed to the workers that take notices, over their
    # tunnels: they then send no HTTP heartbeat at idle (tunnel/stampnotice.py).
    notices = StampNotices(tunnels, reactor, config.tunnel_liveness)
    liveness = TunnelLiveness(db, config.instance_id, tunnels.live_claims,
                              DEAD_TUNNEL_DETECTION + 1.0, reactor,
                              interval=config.tunnel_liveness, on_stamped=notices.stamped)
    tunnels.stamps_liveness = liveness.enabled
    peer_links = AcceptedPeerLinks(db, tunnels, config.registration_token, reactor)
    peer_pool = PeerPool(db, identity, config.registration_token, reactor,
                         ca_file=config.peer_ca_file)
    metrics = ReplicaMetrics()  # this replica's own registry (never the process-global one)
    metrics.watch_tunnels(tunnels, (peer_links, peer_pool))
    dialer = WorkerDialer(tunnels, fence, peer_pool, config.instance_id, grace, reactor)
    worker_http = WorkerHTTPClient(dialer, reactor)
    # Control calls carry each node's own control token, never the registration token.
    control = ControlClient(worker_http, reactor=reactor, token_for=nodes.control_token)
    # Backend calls go as one framed request on a ``call`` stream (the worker attaches the
    # backend's token); bridged gRPC calls (``--backend-calls grpc``, or a worker too old for
    # ``call`` streams) carry each backend process's own token, asked of its worker over the
    # control channel; the registration token only for a worker too old to tell it.
    backend_clients = BackendClients(
        GrpcBridges(dialer, config.run_dir, config.instance_id, reactor), reactor,
        config.registration_token or None, control=control, dialer=dialer,
        mode=config.backend_calls)
    metrics.watch_backend_calls(backend_clients)
    catalog = ModelCatalog(config.models_dir)
    use = ModelUse(db, reactor, metrics=metrics)
    # Chat and completion calls go where their prompt's head is warm; what each replica
    # served reaches every replica through the bus (frontend/inference/prefix_fanout.py).
    prefix = PrefixRouting(PrefixSettings(enabled=config.prefix_cache,
                                          ttl=config.prefix_cache_ttl),
                           reactor, bus, metrics=metrics)
    lifecycle = ModelLifecycle(db, control, use, catalog, reactor,
                               max_active_backends=config.max_active_backends,
                               metrics=metrics, on_unloaded=placements.model_changed)
    # Calls spread over a model's replicas (in_flight); the cache serves the warm path.
    chooser = NodeChooser(db, nodes, fence, grace=grace, room=lifecycle,
                          in_flight=use.in_flight, cache=placements.cache,
                          on_reaped=placements.model_changed, prefix=prefix)
    loader = ColdLoader(db, nodes, control, worker_http, backend_clients, config.instance_id,
                        config.models_dir, reactor, metrics=metrics,
                        allow_private_downloads=config.allow_private_downloads)
    # A new replica is used at once (on_loaded).
    loads = LoadLock(db, chooser, loader, config.instance_id, reactor, room=lifecycle,
                     on_loaded=placements.model_changed)
    scaler = ReplicaScaler(db, catalog, chooser, loads, use, reactor, pressure=prefix.pressure)
    inference = InferenceRouter(catalog, chooser, loads, loader, backend_clients, reactor,
                                WorkerScratch(control, worker_http, nodes.control_token,
                                              reactor),
                                use=use, lifecycle=lifecycle, scaler=scaler,
                                crashes=CrashProbe(control), prefix=prefix)
    watchdog = LifecycleWatchdog(db, lifecycle, tunnels.held_nodes, reactor,
                                 idle_timeout=config.idle_timeout,
                                 busy_timeout=config.busy_timeout)
    preloader = Preloader(inference, config.preload_models, reactor)
    # One subscriber drops every per-node connection of this process when a node departs:
    # the HTTP pools and the gRPC bridges (their sockets and channels); another drops the
    # node's placements from every replica's cache.
    # A backend's gRPC channel lives while a placement names it; a worker whose tunnel comes
    # back has its backends adopted or stopped (frontend/inference/channels.py, reconcile.py).
    channel_sweep = PlacementSweep(db, backend_clients, reactor)
    reconciler = BackendReconciler(db, control, backend_clients,
                                   on_changed=placements.model_changed)
    tunnels.add_attach_listener(reconciler.node_returned)
    notifier = DepartureNotifier({
        "worker-http-connections": functools.partial(forget_worker_connections, worker_http,
                                                     backend_clients),
        "placement-cache": placements.node_changed,
        "prefix-index": prefix.node_departed})
    membership = MembershipService(db, identity, reactor=reactor,
                                   reconnect_grace=grace or 0, on_reregistered=tunnels.reclaim)
    health = HealthMonitor(db, nodes, fence, notifier, reactor,
                           interval=config.health_interval, stale_after=config.stale_after,
                           grace=grace, on_back=reconciler.node_returned)
    metrics.watch_health(health)
    # Jobs: the claim queue (the bus above is its wake hint), and the consumer every replica
    # runs (frontend/jobs/dispatch.py).
    queue = ClaimQueue(db, bus)
    store = JobStore(db, queue)
    dispatcher = JobDispatcher(store, db, control, config.instance_id)
    consumer = job_consumer(store, dispatcher, queue, config.instance_id, bus=bus,
                            reactor=reactor)
    jobs = JobParts(kinds=config.job_kinds if config.job_kinds is not None
                    else JobKinds.discover(), store=store, dispatcher=dispatcher,
                    consumer=consumer, fanout=CancelFanout(db, control),
                    stats=JobStatsService(db, reactor))
    # A database outage is logged once by the pool and once by each pass (PeriodicPass), not
    # as a traceback every interval: these layers may not import the pool's errors themselves.
    for periodic in (scaler, watchdog, preloader, jobs.stats):
        periodic.outage_errors = (DatabaseUnavailable, PoolClosed)
    metrics.watch_bus(bus, [consumer])
    metrics.watch_jobs(lambda: jobs.stats.snapshot)
    async def stage(node_id, key, path, progress_cb, known):
        # the node's own control token, never the shared one (as a cold load stages)
        token = await nodes.control_token(node_id)
        return await upload_file(worker_http, node_id, key, path, token=token,
                                 progress_cb=progress_cb, timeout=STAGE_TIMEOUT, known=known)

    backends = BackendInstalls(
        config.backend_galleries,
        config.backend_archives_dir or os.path.join(config.models_dir, ".backend-archives"),
        reactor, nodes=nodes, control=control, stage=stage, agent=loader.downloads.agent,
        allow_private=config.allow_private_downloads)
    gallery = GalleryJobs(db, bus, config.instance_id, config.models_dir, loader.downloads,
                          config.galleries, reactor, catalog=catalog, backends=backends)
    responses = _responses(db, queue, bus, inference, config.instance_id, reactor)
    return Replica(
        instance_id=config.instance_id, reconnect_grace=grace, db=db, nodes=nodes, fence=fence,
        identity=identity, tunnels=tunnels, peer_links=peer_links, peer_pool=peer_pool,
        dialer=dialer, worker_http=worker_http, control=control,
        backend_clients=backend_clients, inference=inference, notifier=notifier,
        membership=membership, health=health, bus=bus, placements=placements, prefix=prefix,
        jobs=jobs,
        metrics=metrics, use=use, lifecycle=lifecycle, watchdog=watchdog, preloader=preloader,
        scaler=scaler, gallery=gallery, channel_sweep=channel_sweep, reconciler=reconciler,
        responses=responses, liveness=liveness,
        registration_limit=SourceRateLimit(config.registration_limit / 60.0,
                                           config.registration_limit, reactor)
        if config.registration_limit > 0 else None)


def forget_worker_connections(worker_http: WorkerHTTPClient, backend_clients: BackendClients,
                              node_id: str) -> defer.Deferred:
    """Drop every per-node connection of this process: HTTP pools and gRPC bridges."""
    return defer.DeferredList([worker_http.forget(node_id), backend_clients.forget(node_id)],
                              consumeErrors=True)


async def advertised_address(config: ReplicaConfig, db: Database, port: int | None) -> str:
    """The peer address to publish ('' when there is none other replicas could dial)."""
    if config.advertise_address is not None:
        host, configured_port = config.advertise_address
        text = f"[{host}]:{configured_port}" if ":" in host else f"{host}:{configured_port}"
        try:
            return check_advertised_address(text, single_host=config.single_host)
        except AdvertiseAddressError as e:
            raise FrontendStartupError(str(e)) from None
    if port is None:
        log.warn("frontend replica {replica} listens on no TCP port, so it advertises no "
                 "peer address; other replicas cannot relay through it. Set "
                 "--advertise-address", replica=config.instance_id)
        return ""
    try:
        return await discover_advertised_address_async(db.dsn, port,
                                                       single_host=config.single_host)
    except AdvertiseAddressError as e:
        if config.single_host:
            address = f"127.0.0.1:{port}"
            log.info("single-host mode: advertising {addr} ({why})", addr=address, why=e)
            return address
        log.warn("frontend replica {replica} advertises no peer address: {why}. It works "
                 "alone, but other replicas cannot relay to the workers it holds",
                 replica=config.instance_id, why=e)
        return ""


class ReplicaService(InOrderMultiService):
    """Waits for the database, builds the :class:`Replica`, starts its services in order (the
    first registration must succeed), then opens the gate: the replica's resource tree serves.

    :param open_gate: called with the wired ``Replica`` once it is registered.
    """

    name = "replica"

    def __init__(self, config: ReplicaConfig, database_service: DatabaseService,
                 listener: ListeningService, open_gate: Callable[[Replica], None], reactor):
        super().__init__()
        self.config = config
        self._database_service = database_service
        self._listener = listener
        self._open_gate = open_gate
        self._reactor = reactor
        self.state = StartupState.NOT_STARTED
        self.failure: Failure | None = None
        self._replica: Replica | None = None
        #: The outcome of the current start (the Replica, or why it did not start).
        self._ready = OneShotObserver()

    @property
    def replica(self) -> Replica:
        """The wired replica.  :raises FrontendStartupError: before it is built."""
        if self._replica is None:
            raise FrontendStartupError(f"the replica is not built yet ({self.state.value})")
        return self._replica

    def startService(self) -> None:
        Service.startService(self)  # the children exist only once the replica is built
        if self._ready.fired:  # started again: a new start, a new outcome
            self._ready = OneShotObserver()
        self.state = StartupState.STARTING_DATABASE
        self.failure = None
        starting = defer.ensureDeferred(self._start())
        starting.addCallbacks(self._started, self._start_failed)

    def _check_running(self) -> None:
        if not self.running:
            raise FrontendStopped("the frontend was stopped while starting")

    async def _start(self) -> Replica:
        await self._listener.whenListening()
        try:
            db = await self._database_service.whenReady()
        except DatabaseServiceStopped:
            raise FrontendStopped("the frontend was stopped while starting") from None
        self._check_running()
        self.state = StartupState.JOINING
        replica = await build_replica(self.config, db, self._listener.tcp_port(),
                                      self._reactor, self._listener.description)
        self._check_running()
        self._replica = replica
        for service in replica.services():
            service.setServiceParent(self)  # we are running: this starts it
            if service is replica.membership:
                await replica.membership.whenRegistered()
                self._check_running()
        self._open_gate(replica)
        return replica

    def _started(self, replica: Replica) -> None:
        self.state = StartupState.READY
        log.info("frontend replica {replica} ready (version {version}, advertised "
                 "{addr}, port {port})", replica=self.config.instance_id,
                 version=self.config.identity_seed.version,
                 addr=replica.identity.advertised_addr or "<none>",
                 port=self._listener.tcp_port())
        self._settle(replica)

    def _start_failed(self, failure: Failure) -> None:
        if not failure.check(FrontendStopped):
            self.state = StartupState.FAILED
            self.failure = failure
            log.error("frontend replica {replica} could not start: {reason}",
                      replica=self.config.instance_id,
                      reason=" ".join(failure.getErrorMessage().split()))
        self._settle(failure)

    def _settle(self, outcome) -> None:
        """The start's outcome; the first one stands (a stop while starting settles it
        FrontendStopped before the start itself gives up)."""
        if not self._ready.fired:
            self._ready.fire(outcome)

    def whenReady(self) -> defer.Deferred:
        """Fires with the ``Replica`` once built and registered; fails with the startup error
        or ``FrontendStopped``."""
        return self._ready.when()

    def stopService(self) -> defer.Deferred:
        if self.state is not StartupState.FAILED:
            self.state = StartupState.STOPPING
        stopping = super().stopService()

        def stopped(result):
            if not self._ready.fired:
                self._settle(Failure(FrontendStopped("the frontend was stopped while starting")))
            return result

        return stopping.addBoth(stopped)


class FrontendService(InOrderMultiService):
    """One frontend replica (the tree in the module docstring).

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
                 health_interval: float = 15.0, stale_after: float = 60.0,
                 job_kinds=None):
        super().__init__()
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        self._reactor = reactor
        self.version = version
        self.config = ReplicaConfig.from_options(options, version, health_interval,
                                                 stale_after)
        if job_kinds is not None:  # tests and embedders: kinds instead of the plugins
            self.config = dataclasses.replace(self.config, job_kinds=job_kinds)
        self.instance_id = self.config.instance_id
        #: Model YAML files (``--models-dir``, default ``<data-dir>/models``).
        self.models_dir = self.config.models_dir
        self.api_keys = APIKeyGuard(options.get("api-key") or [],
                                    admin_keys=options.get("admin-api-key") or [])
        #: Further conditions of ``/readyz`` once wired: callables answering None (ready) or
        #: the reason (the local worker's first tunnel, ``frontend/localworker.py``).
        self.readiness_gates: list[Callable[[], str | None]] = []

        self.database_service = database_service or DatabaseService(
            options.get("database-url"), options.get("data-dir"),
            application_name="localai_frontend", reactor=reactor)
        self._probe_resources: dict[bytes, Resource] = {
            b"healthz": LivenessResource(),
            b"readyz": ReadinessResource(self, reactor, state=lambda: self.state.name.lower())}
        self.gate = StartingGate(self._probe_resources, ROOT_INDEX)
        # The listener's policies come from the route table (frontend/api/routes.py):
        # authentication decided when the headers end, before a body byte is read (and, while
        # starting, before the gate's 503), body caps, uploads on disk.
        self.site = BoundedSite(self.gate, access_log=_option(options, "access-log", "all"),
                                quiet_on_success=is_heartbeat_path,
                                host_check=None if self.api_keys.configured else HostCheck(
                                    _allowed_hosts(options)))
        apply_policies(self.site, self.api_keys)
        self.listener = ListeningService(
            reactor, _option(options, "listen", "tcp:8080:interface=127.0.0.1"), self.site)
        self.replica_service = ReplicaService(self.config, self.database_service,
                                              self.listener, self._open, reactor)
        # The order of the tree is the start order, and (reversed) the stop order.
        self.database_service.setServiceParent(self)
        self.replica_service.setServiceParent(self)
        self.listener.setServiceParent(self)

    # -- the web root ----------------------------------------------------------------------

    def _open(self, replica: Replica) -> None:
        """The replica is registered: its tree serves from now on (and its header guards)."""
        self.gate.open(self._build_root(replica))

    def _build_root(self, replica: Replica) -> Resource:
        """The resource tree of a wired replica, from the route table (tests/e2e/cluster/probe.py
        wraps this)."""
        return build_root(Wiring(replica, api_keys=self.api_keys, reactor=self._reactor,
                                 probes=self._probe_resources, site=self.site), ROOT_INDEX)

    # -- what the replica is -----------------------------------------------------------------

    @property
    def replica(self) -> Replica:
        """The wired replica (its parts: ``nodes``, ``tunnels``, ``inference``...).
        :raises FrontendStartupError: before it is built."""
        return self.replica_service.replica

    @property
    def state(self) -> StartupState:
        return self.replica_service.state

    @property
    def database(self) -> Database | None:
        return self.database_service.database

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): the database ready, the replica registered, every gate passed."""
        ready, reason = self.database_service.readiness()
        if not ready:
            return False, reason
        state, failure = self.replica_service.state, self.replica_service.failure
        if failure is not None:
            return False, f"startup failed: {failure.getErrorMessage()}"
        if state is not StartupState.READY:
            return False, state.value
        for gate in self.readiness_gates:
            reason = gate()
            if reason:
                return False, reason
        return True, "ready"

    def whenReady(self) -> defer.Deferred:
        """Fires with this service once wired and registered; fails with the startup error
        (``DatabaseStartupError``, ``FrontendStartupError``, a listen error) or
        ``FrontendStopped``."""
        return self.replica_service.whenReady().addCallback(lambda _: self)

    def startService(self) -> None:
        # Under twistd with text logs at info, the access lines go to the log file in batches
        # (web/accesslog.py); else each as a log event.
        self.site.write_access_lines_to(logs.text_lines_of(self))
        super().startService()

    def stopService(self) -> defer.Deferred:
        self.gate.close()  # a request on a kept-alive connection finds the replica stopping
        stopping = super().stopService()
        return stopping.addCallback(
            lambda _: log.info("frontend replica {replica} stopped", replica=self.instance_id))
