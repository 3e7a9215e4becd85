"""The worker's service tree: registration, heartbeat, the tunnel dial loop and the control
plane, composed from the ``twistd localai-worker`` options.

At start the worker registers with ``--register-to`` (retrying 2 s, 4 s, ... up to 30 s between
attempts for as long as it takes: a frontend that is down is never a start failure), heartbeats
every 10 s whatever the tunnel is doing (a 404 means the frontend forgot the node: register
again) unless the tunnel's replica stamps the node's liveness, when the heartbeat carries only
capacity changes and a 60 s refresh that the replica's stamp notices put off
(``tunnel/stampnotice.py``), and holds one outbound tunnel (``tunnel/dialer.py``) whose streams
are served by ``worker/streams.py``: ``http`` streams reach the control plane site
(``node.status``, ``/healthz``, ``/readyz`` reporting the tunnel), ``grpc`` streams reach
loopback backends in the backend port range.

What this service must never do:

- listen: the control plane is a ``Site`` fed only by tunnel streams, and nothing here opens a
  listening socket of any kind (the frontend reaches the worker only through its own tunnel);
- advertise an address: the registration body carries no address at all;
- fail to start because the frontend is down, or stop heartbeating while the tunnel is away
  (withholding heartbeats would turn "reconnecting" into "stale" on the one path with no grace);
  only while the tunnel is up *and* its replica said it stamps this node's liveness
  (``X-LocalAI-Liveness: tunnel``) does the heartbeat wait for a capacity change or the
  60 s refresh, and only a stamp notice from that replica puts the refresh off;
- log the registration token, the node key or the tunnel credential: logs name the node and
  its id only.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from twisted.application.service import MultiService, Service
from twisted.internet import defer
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.nodekey import (
    NODE_KEY_FILE,
    control_token,
    load_or_create_node_key,
    mint_node_key,
    node_key_hash,
)
from localai_tw.config import PortRange
from localai_tw.deferreds import OneShotObserver
from localai_tw.metrics import WorkerMetrics
from localai_tw.tunnel.dialer import TunnelDialer
from localai_tw.worker.audioconvert import AudioConverter
from localai_tw.worker.capacity import HostCapacity, capacity_changed
from localai_tw.worker.control import (
    ControlAuth,
    ControlVerbs,
    build_worker_site,
    register_node_status,
)
from localai_tw.worker.registration import (
    CapacityProvider,
    NodeUnknown,
    Registration,
    RegistrationClient,
    RegistrationError,
    token_option,
)
from localai_tw.worker.scratch import ScratchArea
from localai_tw.worker.staging import FileStaging, StagingRoots
from localai_tw.worker.backendcalls import BackendCalls
from localai_tw.worker.streams import StreamRouter

log = Logger()

#: Seconds between heartbeats (ref §6.2).
HEARTBEAT_INTERVAL_SECONDS = 10.0
#: While the tunnel's replica stamps this node's liveness (``cluster/liveness.py``), the HTTP
#: heartbeat carries only capacity: sent when it changed (``capacity_changed``) and when this
#: long passed without a heartbeat answered or a stamp notice (``tunnel/stampnotice.py``: the
#: replica says it stamped).  Inside the 90 s stale threshold, so a replica that stops stamping
#: without ending the tunnel still sees this node beat.
CAPACITY_REFRESH_SECONDS = 60.0
#: Registration retry: first wait, doubled per failure, up to the cap (ref §7).
REGISTER_RETRY_FIRST_SECONDS = 2.0
REGISTER_RETRY_CAP_SECONDS = 30.0


def registration_retry_delay(failures: int, first: float = REGISTER_RETRY_FIRST_SECONDS,
                             cap: float = REGISTER_RETRY_CAP_SECONDS) -> float:
    """The wait after ``failures`` (>= 1) failed registration attempts: 2, 4, 8, 16, 30, 30 ..."""
    exponent = min(max(failures - 1, 0), 32)
    return min(cap, first * 2.0 ** exponent)


class NodeRegistrar(Service):
    """Keeps this worker registered and heartbeating.

    Registration starts with the service and is retried until it succeeds; heartbeats run every
    ``heartbeat_interval`` from the first successful registration on, whatever the tunnel does
    -- except while ``tunnel_liveness()`` is true (the tunnel is up and its replica stamps this
    node's heartbeat): then a tick sends a heartbeat only when the capacity changed, the last
    one failed, or ``capacity_refresh`` seconds passed since the last one answered or the last
    stamp notice (:meth:`note_stamped`).  :meth:`register_once` is the single-flight
    re-registration used by the dial loop on a 401/403 (one attempt; concurrent callers share
    it).  ``on_registered(registration)`` is called after every successful registration.
    """

    name = "node-registrar"

    def __init__(
        self,
        reactor,
        client: RegistrationClient,
        *,
        on_registered: Callable[[Registration], None] | None = None,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_SECONDS,
        tunnel_liveness: Callable[[], bool] = lambda: False,
        capacity_refresh: float = CAPACITY_REFRESH_SECONDS,
        retry_first: float = REGISTER_RETRY_FIRST_SECONDS,
        retry_cap: float = REGISTER_RETRY_CAP_SECONDS,
    ):
        self._reactor = reactor
        self.client = client
        self._on_registered = on_registered
        self.heartbeat_interval = heartbeat_interval
        self._tunnel_liveness = tunnel_liveness
        self.capacity_refresh = capacity_refresh
        #: The capacity the last answered heartbeat carried and when (reactor seconds); None:
        #: the next tick beats whatever the tunnel does.
        self._sent_capacity: dict[str, int] | None = None
        self._sent_at = 0.0
        #: When the tunnel's replica last said it stamped this node (reactor seconds).
        self._stamped_at: float | None = None
        #: Stamp notices received (metrics, tests).
        self.stamp_notices = 0
        #: Ticks that sent nothing because the tunnel carried liveness (metrics, tests).
        self.heartbeats_skipped = 0
        self._retry_first = retry_first
        self._retry_cap = retry_cap
        self.registration: Registration | None = None
        self.last_heartbeat_status: str | None = None
        self.heartbeat_failures = 0
        self._attempt: defer.Deferred | None = None
        self._attempt_running = False
        self._attempt_outcome: OneShotObserver | None = None  # of the attempt running
        self._retry_call = None
        self._retry_failures = 0
        self._retrying = False
        self._heartbeat = LoopingCall(self._beat)
        self._heartbeat.clock = reactor
        self._beating: defer.Deferred | None = None
        self._last_heartbeat_problem: str | None = None

    @property
    def node_name(self) -> str:
        return self.client.node_name

    def credentials(self) -> tuple[str, str] | None:
        """``(node_id, tunnel credential)`` of the current registration, or None."""
        registration = self.registration
        if registration is None or not registration.tunnel_token:
            return None
        return registration.node_id, registration.tunnel_token

    # -- Service ----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._registerUntilDone()

    def stopService(self):
        super().stopService()
        self._retrying = False
        if self._retry_call is not None and self._retry_call.active():
            self._retry_call.cancel()
        self._retry_call = None
        if self._heartbeat.running:
            self._heartbeat.stop()
        pending = [d for d in (self._attempt, self._beating) if d is not None]
        for d in pending:
            d.cancel()
        return self.client.close()

    # -- registration -------------------------------------------------------------------------

    def register_once(self) -> defer.Deferred:
        """One registration attempt (shared with any attempt already running).  Fires with the
        :class:`Registration` or fails with a :class:`RegistrationError`."""
        if not self.running:
            return defer.fail(RegistrationError(None, "the worker is stopping"))
        if self._attempt_running:
            return self._attempt_outcome.when()
        outcome = self._attempt_outcome = OneShotObserver()
        waiter = outcome.when()  # before starting: the attempt may fire at once
        self._attempt_running = True
        attempt = self.client.register()
        self._attempt = attempt
        attempt.addBoth(self._attemptDone, outcome)
        return waiter

    def _attemptDone(self, result, outcome: OneShotObserver) -> None:
        self._attempt_running = False
        self._attempt = None
        if not isinstance(result, Failure):
            self._installRegistration(result)
        outcome.fire(result)

    def _installRegistration(self, registration: Registration) -> None:
        previous = self.registration
        self.registration = registration
        replaced = previous is not None and previous.node_id != registration.node_id
        log.info("registered: node {name} ({node_id}), status {status}{replaced}",
                 name=self.node_name, node_id=registration.node_id, status=registration.status,
                 replaced=f" (was {previous.node_id})" if replaced else "")
        if registration.status == "pending":
            log.warn("node {name} ({node_id}) is pending approval: the frontend refuses its "
                     "tunnel until an administrator approves it", name=self.node_name,
                     node_id=registration.node_id)
        if not registration.tunnel_token:
            log.warn("node {name} ({node_id}): the frontend issued no tunnel credential; "
                     "the tunnel is not dialled", name=self.node_name,
                     node_id=registration.node_id)
        if self.running and not self._heartbeat.running:
            self._heartbeat.start(self.heartbeat_interval, now=False)
        if self._on_registered is not None:
            try:
                self._on_registered(registration)
            except Exception:
                log.failure("reacting to the registration of node {name} failed",
                            name=self.node_name)

    def _registerUntilDone(self) -> None:
        """Register, retrying 2 s doubling to 30 s, until it works or the service stops."""
        if self._retrying or not self.running:
            return
        self._retrying = True
        self._retry_failures = 0
        self._tryRegister()

    def _tryRegister(self) -> None:
        self._retry_call = None
        if not self.running or not self._retrying:
            return
        self.register_once().addCallbacks(self._registeredInLoop, self._registerFailedInLoop)

    def _registeredInLoop(self, registration: Registration) -> None:
        self._retrying = False
        self._retry_failures = 0

    def _registerFailedInLoop(self, failure: Failure) -> None:
        if not self.running or not self._retrying:
            return
        if failure.check(defer.CancelledError):
            return
        self._retry_failures += 1
        delay = registration_retry_delay(self._retry_failures, self._retry_first,
                                         self._retry_cap)
        error = failure.value
        if isinstance(error, RegistrationError) and error.retry_after:
            delay = max(delay, error.retry_after)  # the frontend's own Retry-After (429)
        text = str(error) if isinstance(error, RegistrationError) else failure.getErrorMessage()
        log.warn("registration of node {name} failed: {error}; retrying in {delay:g}s",
                 name=self.node_name, error=text, delay=delay)
        self._retry_call = self._reactor.callLater(delay, self._tryRegister)

    # -- heartbeat ---------------------------------------------------------------------------

    def _beat(self):
        """One heartbeat.  Never fails the LoopingCall: the loop must never stop."""
        registration = self.registration
        if registration is None or self._beating is not None:
            return None
        capacity = self.client.current_capacity()
        heard_at = self._sent_at if self._stamped_at is None else max(self._sent_at,
                                                                       self._stamped_at)
        if (self._sent_capacity is not None and self._tunnel_liveness()
                and self._reactor.seconds() - heard_at < self.capacity_refresh
                and not capacity_changed(self._sent_capacity, capacity)):
            self.heartbeats_skipped += 1
            return None
        beating = self.client.heartbeat(registration.node_id, registration.tunnel_token,
                                        capacity)
        self._beating = beating
        beating.addCallbacks(self._beatAnswered, self._beatFailed,
                             callbackArgs=(capacity,), errbackArgs=(registration,))
        beating.addErrback(lambda f: log.failure("heartbeat handling failed", f))
        return None

    def _beatAnswered(self, status: str, capacity: dict[str, int]) -> None:
        self._beating = None
        self._sent_capacity, self._sent_at = capacity, self._reactor.seconds()
        self.heartbeat_failures = 0
        if self._last_heartbeat_problem is not None:
            log.info("heartbeat of node {name} works again", name=self.node_name)
            self._last_heartbeat_problem = None
        self._noteStatus(status)

    def note_stamped(self, status: str) -> None:
        """The tunnel's replica stamped this node's heartbeat, and says its ``status``
        (``tunnel/stampnotice.py``): counts as an answered heartbeat for the refresh."""
        self._stamped_at = self._reactor.seconds()
        self.stamp_notices += 1
        self._noteStatus(status)

    def _noteStatus(self, status: str) -> None:
        if status and status != self.last_heartbeat_status:
            log.info("node {name} status is now {status}", name=self.node_name, status=status)
        self.last_heartbeat_status = status or self.last_heartbeat_status

    def _beatFailed(self, failure: Failure, registration: Registration) -> None:
        self._beating = None
        self._sent_capacity = None  # not delivered: the next tick beats again
        if failure.check(defer.CancelledError) or not self.running:
            return
        self.heartbeat_failures += 1
        problem = str(failure.value) if isinstance(failure.value, RegistrationError) else \
            failure.getErrorMessage()
        if failure.check(NodeUnknown):
            log.warn("heartbeat: the frontend no longer knows node {name} ({node_id}); "
                     "registering again", name=self.node_name, node_id=registration.node_id)
            self._registerUntilDone()
            return
        # Log when the problem changes, not every 10 s while the frontend is down.
        if problem != self._last_heartbeat_problem:
            log.warn("heartbeat of node {name} ({node_id}) failed: {problem}",
                     name=self.node_name, node_id=registration.node_id, problem=problem)
            self._last_heartbeat_problem = problem


class WorkerService(MultiService):
    """The worker: :class:`NodeRegistrar`, :class:`~localai_tw.tunnel.dialer.TunnelDialer` and
    the listener-less control plane site, built from the worker's options.

    ``options`` is the ``twistd localai-worker`` option dict: ``register-to``,
    ``registration-token``, ``node-name``, ``node-type``, ``backend-port-range``
    (a :class:`~localai_tw.config.PortRange`), ``data-dir``, and ``labels`` (a dict) or
    ``label`` (``(key, value)`` pairs).  ``verbs`` lets later code add control verbs;
    ``running_backends()`` feeds ``node.status``.  The ``*_options`` mappings pass keyword
    arguments to the registrar, the dialer and the stream router (timings, test doubles).
    """

    name = "worker"

    def __init__(
        self,
        options: Mapping[str, Any],
        reactor=None,
        *,
        verbs: ControlVerbs | None = None,
        running_backends: Callable[[], Any] = lambda: [],
        capacity_provider: CapacityProvider | None = None,
        registration_client: RegistrationClient | None = None,
        dialer_options: Mapping[str, Any] | None = None,
        registrar_options: Mapping[str, Any] | None = None,
        stream_options: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        self.node_name: str = options["node-name"]
        self.node_type: str = options.get("node-type") or "backend"
        register_to: str = options["register-to"]
        token: str | None = options.get("registration-token") or None
        self.backend_ports: PortRange = options["backend-port-range"]
        labels = options.get("labels")
        if labels is None:
            labels = dict(options.get("label") or ())
        self.data_dir: str | None = options.get("data-dir")
        if capacity_provider is None:  # real RAM, and disk where models are stored
            capacity_provider = HostCapacity(
                os.path.join(self.data_dir, "models") if self.data_dir else None,
                memory_budget=options.get("memory-budget") or None)
        self.node_key = self._node_key()

        self.client = registration_client or RegistrationClient(
            reactor, register_to, token, self.node_name, self.node_type, labels,
            capacity_provider, node_key=self.node_key,
            token_hint=token_option(getattr(options, "sources", {}),
                                    options.get("registration-token-file")))
        registrar_options = {"tunnel_liveness": lambda: self.dialer.livenessByTunnel,
                             **dict(registrar_options or {})}
        self.registrar = NodeRegistrar(reactor, self.client, on_registered=self._registered,
                                       **registrar_options)
        self.registrar.setServiceParent(self)

        self.verbs = verbs if verbs is not None else ControlVerbs()
        if self.verbs.lookup("node.status") is None:
            register_node_status(self.verbs, self.node_name, self.node_type, running_backends,
                                 reactor)
        # Callers prove the per-node control token, never the shared registration token: a
        # frontend derives it from the node key hash it stored (nodekey.py).
        self.control_auth = ControlAuth(control_token(node_key_hash(self.node_key)))
        self.staging = None
        self.scratch = None
        self.converter = None
        v1_children, body_policies = {}, []
        if self.data_dir:
            self.staging = FileStaging(
                StagingRoots(os.path.join(self.data_dir, "models"),
                             os.path.join(self.data_dir, "data"),
                             os.path.join(self.data_dir, "staging")),
                self.control_auth, reactor)
            v1_children, body_policies = self.staging.v1_children(), \
                self.staging.body_policies()
            # Per-request scratch directories: files a backend reads or writes by path (dst).
            self.scratch = ScratchArea(self.staging.scratch_root, reactor)
            self.scratch.register(self.verbs)
            # ffmpeg beside the backends: speech formats and transcription uploads.
            self.converter = AudioConverter(self.staging.scratch_root, reactor,
                                            self.node_name)
            self.converter.register(self.verbs)
        self.site = build_worker_site(self.verbs, self.control_auth, self.readiness,
                                      v1_children=v1_children, body_policies=body_policies)
        self.router = StreamRouter(self.site, self.backend_ports, reactor,
                                   **dict(stream_options or {}))
        self.router.on_stamped = self.registrar.note_stamped

        self.dialer = TunnelDialer(
            reactor, register_to, self.registrar.credentials, lambda: self.router.acceptor,
            reauthorize=self.registrar.register_once, node_name=self.node_name,
            takes_stamp_notices=True, **dict(dialer_options or {}))
        self.dialer.setServiceParent(self)
        #: This worker's metrics, served as the control verb ``node.metrics`` (docs/metrics.md).
        self.metrics = WorkerMetrics()
        self.metrics.watch_worker(self.dialer, self.registrar)
        self.verbs.register("node.metrics", self.metrics.control_verb())

    def _node_key(self) -> str:
        """This node's key: kept in the data directory (small file I/O, once, before the reactor
        runs), or in memory only when there is none."""
        if not self.data_dir:
            log.warn("worker {name} has no data directory: its node key lives in memory only, "
                     "so after a restart the frontend refuses the name until an administrator "
                     "removes the node", name=self.node_name)
            return mint_node_key()
        key, created = load_or_create_node_key(self.data_dir)
        if created:
            log.info("generated the node key of {name} in {path}: it proves this node's identity "
                     "to the frontend; keep it with the data directory", name=self.node_name,
                     path=os.path.join(self.data_dir, NODE_KEY_FILE))
        return key

    def startService(self) -> None:
        if self.staging is not None:
            # Small, once, at start: the staging roots must exist before an upload resolves.
            for root in (self.staging.roots.models_dir, self.staging.roots.data_dir,
                         self.staging.roots.staging_dir):
                os.makedirs(root, exist_ok=True)
        if self.scratch is not None:
            self.scratch.reset()
        log.info("worker {name} starting: registering with {url}; listening on nothing",
                 name=self.node_name, url=self.client.base_url)
        super().startService()

    def _registered(self, registration: Registration) -> None:
        self.dialer.credentialsChanged()

    def readiness(self) -> str | None:
        """``/readyz``: ready when registered and holding a tunnel session."""
        if self.registrar.registration is None:
            return "not registered with the frontend yet"
        return self.dialer.readiness()


def worker_backends_path(options: Mapping[str, Any]) -> str | None:
    """``--backends-path``, else ``<data-dir>/backends`` (None without either)."""
    if options.get("backends-path"):
        return options["backends-path"]
    return os.path.join(options["data-dir"], "backends") if options.get("data-dir") else None


def makeWorkerService(options: Mapping[str, Any], reactor=None) -> MultiService:
    """The worker's service tree for ``twistd localai-worker`` (``tap.makeService`` adds its
    configuration report and port range check next to it).

    A ``backend`` worker also gets the backend supervisor: backend processes on ports of
    ``--backend-port-range`` (loopback only) and the ``backend.*`` control verbs.  The supervisor
    is a child service, so stopping the worker stops every backend process it started.  With a
    data directory it records the processes it starts in ``<data-dir>/backend-processes.json``
    and, at start, kills what a killed previous run left there (:mod:`localai_tw.backends.ledger`).
    Backend names are resolved by :class:`~localai_tw.backends.directory.LocalAIBackends`:
    ``--external-grpc-backends``, then the LocalAI backends directory (``--backends-path``,
    default ``<data-dir>/backends``), then the built-ins and plugins.
    """
    if reactor is None:
        from twisted.internet import reactor
    if (options.get("node-type") or "backend") == "agent":
        return makeAgentWorkerService(options, reactor)
    if (options.get("node-type") or "backend") != "backend":
        return WorkerService(options, reactor)

    from localai_tw.backends.amx_fallback import ExtraBuftsFallback
    from localai_tw.backends.directory import LocalAIBackends
    from localai_tw.backends.interfaces import BackendFactories
    from localai_tw.backends.ledger import LEDGER_FILE, ProcessLedger
    from localai_tw.backends.ports import PortAllocator
    from localai_tw.backends.process import BackendSupervisor
    from localai_tw.worker.backend_verbs import register_backend_verbs

    port_range: PortRange = options["backend-port-range"]
    data_dir = options.get("data-dir")
    backends = LocalAIBackends(
        BackendFactories.discover(), worker_backends_path(options),
        options.get("external-grpc-backends") or (),
        models_dir=os.path.join(data_dir, "models") if data_dir else None)
    if backends.directory is not None:  # once, at start: a short listing
        log.info("LocalAI backends directory {path}: {found}", path=backends.directory.path,
                 found=", ".join(backends.directory.names()) or "none installed")
    supervisor = BackendSupervisor(
        reactor, PortAllocator(port_range.first, port_range.last), backends,
        allow_remote_code=bool(options.get("allow-remote-code")),
        withheld_env=WORKER_SECRET_ENV,
        ledger=ProcessLedger(os.path.join(options["data-dir"], LEDGER_FILE))
        if options.get("data-dir") else None)
    ExtraBuftsFallback().install(supervisor)  # llama.cpp on AMX CPUs (issue 22 §1)
    verbs = ControlVerbs()
    register_backend_verbs(verbs, supervisor, node_name=str(options.get("node-name") or ""))
    worker = WorkerService(options, reactor, verbs=verbs,
                           running_backends=supervisor.running_backends)
    supervisor.setServiceParent(worker)
    # ``call`` streams: backend calls the worker makes with the supervisor's own clients
    worker.router.backend_calls = BackendCalls(supervisor, reactor or worker.reactor)
    if backends.directory is not None and worker.staging is not None:
        # backends installed from a frontend's backend gallery (worker/backend_install.py)
        from localai_tw.worker.backend_install import register_backend_install_verbs
        register_backend_install_verbs(verbs, backends.directory.path, worker.staging,
                                       reactor, supervisor.running_backends)
    return worker


#: The worker's secrets (and where they are) as environment variables: never passed on to a
#: backend process.
WORKER_SECRET_ENV = ("LOCALAI_REGISTRATION_TOKEN", "LOCALAI_REGISTRATION_TOKEN_FILE",
                     "LOCALAI_API_TOKEN", "LOCALAI_API_TOKEN_FILE")


class _ClosesOnStop(Service):
    """Closes the agent's pooled connections to the cluster API when the worker stops."""

    name = "cluster-api"

    def __init__(self, api):
        self.api = api

    def stopService(self):
        super().stopService()
        return self.api.close()


def makeAgentWorkerService(options: Mapping[str, Any], reactor=None,
                           kinds=None) -> WorkerService:
    """An ``agent`` worker: no backend supervisor; the ``job.run`` and ``job.cancel`` verbs
    (``worker/agent.py``) with the job kinds found as plugins (``kinds`` replaces them), calling
    the cluster's API at ``--api-url`` (default ``--register-to``) with ``--api-token``."""
    if reactor is None:
        from twisted.internet import reactor
    from localai_tw.jobs.api import ClusterAPI
    from localai_tw.jobs.kinds import JobKinds
    from localai_tw.worker.agent import DEFAULT_MAX_RUNS, AgentRunner

    api = ClusterAPI(options.get("api-url") or options["register-to"],
                     options.get("api-token") or "", reactor)
    runner = AgentRunner(options["node-name"], kinds if kinds is not None else JobKinds.discover(),
                         api, max_runs=int(options.get("max-jobs") or DEFAULT_MAX_RUNS))
    verbs = ControlVerbs()
    runner.register(verbs)
    worker = WorkerService(options, reactor, verbs=verbs)
    worker.agent = runner
    _ClosesOnStop(api).setServiceParent(worker)
    log.info("agent worker {name}: runs job kinds {kinds}, up to {n} at once",
             name=options["node-name"], kinds=", ".join(runner.kinds.names()) or "none",
             n=runner.max_runs)
    return worker
