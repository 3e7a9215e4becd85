"""``twistd localai-frontend``: the frontend replica's options and service tree.

``Options`` declares every flag with its ``LOCALAI_*`` environment variable (see
``localai_tw.config``); ``makeService(options)`` builds the replica as a ``MultiService``:

1. ``configuration-report``: logs the effective configuration (secrets masked);
2. ``frontend``: ``localai_tw.frontend.service.FrontendService``, which holds the database
   (``--database-url``, else embedded PostgreSQL in ``--data-dir``), the HTTP listener on
   ``--listen``, membership, tunnels, the health monitor and the APIs.  If it cannot start
   (database unreachable, listen failure, membership refused) the process exits with status 1;
3. with ``--local-worker``: ``local-worker`` (``frontend/localworker.py``), a worker in this
   process that registers with this frontend over loopback once it is ready.  The children then
   stop one at a time in reverse order, so the worker leaves before its frontend.

Under twistd the options also move twistd's default pidfile into ``<data-dir>`` (see
``config.EnvOptions``), and ``makeService`` reads or makes ``<data-dir>/instance-id`` and logs,
once ready, one line saying who can use what (``exposure_line``).

``/healthz`` and ``/readyz`` live in ``frontend/api/probes.py``.  This module only parses options
and composes services; it must not grow protocol logic of its own.
"""

from __future__ import annotations

import errno
import os
import secrets
import sys
import uuid
from typing import Any

from twisted.application.service import MultiService
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python import usage
from twisted.web.resource import Resource

from localai_tw import config
from localai_tw.backends.directory import check_external_backends, parse_external_backend
from localai_tw.backends.interfaces import add_plugin_directories
from localai_tw.db.service import DatabaseService, DatabaseServiceStopped
from localai_tw.tunnel.peertls import parse_ca_file as peer_ca_file

from localai_tw.frontend.api.probes import LivenessResource, ReadinessResource
from localai_tw.web.listener import ACCESS_LOG_CHOICES
from localai_tw.cluster.liveness import MAX_TUNNEL_LIVENESS
from localai_tw.cluster.nodes import MAX_HEARTBEAT_BATCH

log = Logger()

PROGRAM = "localai-frontend"

#: Loopback only: an OpenAI API with no key must not be reachable from the network by default.
DEFAULT_LISTEN = "tcp:8080:interface=127.0.0.1"

def _whole(raw: str, option: str) -> int:
    """A whole number of at least 0."""
    try:
        number = int(raw.strip())
    except ValueError:
        raise usage.UsageError(f"{option}: {raw!r} is not a whole number") from None
    if number < 0:
        raise usage.UsageError(f"{option}: {number} is less than 0")
    return number


def _duration_at_most(maximum: float, why: str):
    """A duration parser refusing more than ``maximum`` seconds, saying ``why``."""
    def parse(raw: str, option: str) -> float:
        seconds = config.parse_duration(raw, option)
        if seconds > maximum:
            raise usage.UsageError(f"{option}: at most {maximum:g}s ({why}), not {raw!r}")
        return seconds
    return parse


#: ``--heartbeat-batch``: a beat is written that much later at most; a longer wait would eat
#: into the stale threshold.
_heartbeat_batch = _duration_at_most(
    MAX_HEARTBEAT_BATCH, "a heartbeat waits that long for its statement at most")
#: ``--tunnel-liveness``: a held tunnel's heartbeat must stay far inside the 90 s threshold.
_tunnel_liveness = _duration_at_most(
    MAX_TUNNEL_LIVENESS, "a held tunnel's heartbeat is that old at most before the next")


def _model_name(raw: str, option: str) -> str:
    """A model name (LocalAI's ``--preload-models`` takes gallery JSON: refused, named)."""
    name = raw.strip()
    if name.startswith(("[", "{")):
        raise usage.UsageError(
            f"{option}: takes model names (comma-separated in the variable), not LocalAI's "
            "gallery JSON; install gallery models first and name them here")
    if not name or len(name) > 255:
        raise usage.UsageError(f"{option}: a model name of 1 to 255 characters is expected")
    return name


SETTINGS = (
    config.value("listen", "LOCALAI_LISTEN",
                 "Twisted server endpoint for HTTP (e.g. tcp:8080:interface=0.0.0.0 for every "
                 "interface, ssl:8443:privateKey=key.pem:certKey=cert.pem). A listener other "
                 "machines can reach needs --api-key (or --allow-open-api).",
                 default=DEFAULT_LISTEN, parse=config.parse_server_endpoint),
    config.value("database-url", "LOCALAI_DATABASE_URL",
                 "PostgreSQL DSN (postgresql://user@host:5432/db or key=value). Without it an "
                 "embedded PostgreSQL runs in <data-dir>/postgres.",
                 parse=config.parse_database_url, secret=True,
                 default_doc="embedded PostgreSQL"),
    config.value("data-dir", "LOCALAI_DATA_DIR",
                 "Directory for this replica's state (the embedded PostgreSQL lives in "
                 "<data-dir>/postgres, inside this process; twistd's pidfile is "
                 "<data-dir>/localai-frontend.pid unless --pidfile is given). One per replica: "
                 "it is locked (<data-dir>/localai-frontend.lock) while the replica runs.",
                 default=config.default_data_dir(), parse=config.parse_path),
    config.value("models-dir", "LOCALAI_MODELS_DIR",
                 "Directory of model YAML files.", parse=config.parse_path,
                 default_doc="<data-dir>/models"),
    config.repeatable("galleries", "LOCALAI_GALLERIES",
                      "Model gallery index (LocalAI's format, a YAML or JSON list of entries) "
                      "that /models/available lists and /models/apply installs from: "
                      "name=URL or a bare URL (the flag also takes LocalAI's JSON [{\"name\":..., "
                      "\"url\":...}]); "
                      "file://, http(s):// or github: (docs/models.md, \"Gallery\")."),
    config.repeatable("backend-galleries", "LOCALAI_BACKEND_GALLERIES",
                      "Backend gallery index (LocalAI's backend/index.yaml format) that "
                      "/backends/available lists and /backends/apply installs on workers "
                      "from: name=URL, a bare URL or LocalAI's JSON; file://, http(s):// or "
                      "github: (docs/backends.md, \"The backend gallery\")."),
    config.value("instance-id", "LOCALAI_INSTANCE_ID",
                 "This replica's id in the cluster (at most 36 characters). Keep it stable "
                 "across restarts.",
                 parse=config.parse_identifier,
                 default_doc="a random UUID made at first start and kept in "
                             "<data-dir>/instance-id"),
    config.value("advertise-address", "LOCALAI_ADVERTISE_ADDRESS",
                 "host:port other replicas dial to reach this one.",
                 parse=config.parse_host_port, default_doc="discovered from the route to the "
                 "database"),
    config.value("peer-ca-file", "LOCALAI_PEER_CA_FILE",
                 "PEM CA certificate that other replicas' TLS certificates must chain to; "
                 "a replica whose --listen is ssl: advertises wss://host:port and is dialled "
                 "over TLS, with the certificate checked against this CA.",
                 parse=peer_ca_file, default_doc="the system trust store"),
    config.flag("single-host", "LOCALAI_SINGLE_HOST",
                "All replicas run on this machine: allow a loopback --advertise-address."),
    config.value("registration-token", "LOCALAI_REGISTRATION_TOKEN",
                 "Shared secret workers present to register (prefer "
                 "--registration-token-file: a command line is visible to every user).",
                 parse=config.parse_secret, secret=True),
    config.value("registration-token-file", "LOCALAI_REGISTRATION_TOKEN_FILE",
                 "File holding the registration token (one trailing newline is ignored).",
                 parse=config.parse_secret_file),
    config.repeatable("api-key", "LOCALAI_API_KEY",
                      "API key accepted on the OpenAI API and required by the admin API "
                      "(/api/nodes, /api/cluster/instances; refused with none set); the "
                      "variable takes a comma-separated list (prefer --api-key-file).",
                      parse=config.parse_secret, secret=True),
    config.value("api-key-file", "LOCALAI_API_KEY_FILE",
                 "File holding the API keys, one per line.",
                 parse=config.parse_secret_file),
    config.repeatable("admin-api-key", "LOCALAI_ADMIN_API_KEY",
                      "Admin API key: when one is set, the admin routes (/api/nodes, the "
                      "gallery's /models installs and deletes, /backend, /api/traces, /metrics, "
                      "/api/cluster/instances and loads, other keys' jobs) accept only admin "
                      "keys and --api-key keys serve inference alone; with none set every "
                      "--api-key is also an admin key. The variable takes a comma-separated "
                      "list (prefer --admin-api-key-file).",
                      parse=config.parse_secret, secret=True),
    config.value("admin-api-key-file", "LOCALAI_ADMIN_API_KEY_FILE",
                 "File holding the admin API keys, one per line.",
                 parse=config.parse_secret_file),
    config.flag("allow-open-api", "LOCALAI_ALLOW_OPEN_API",
                "Allow a --listen other machines can reach with no --api-key: the OpenAI API "
                "then serves anyone who reaches it."),
    config.repeatable("allowed-host", "LOCALAI_ALLOWED_HOSTS",
                      "A host name the API answers to while it is open (no --api-key), "
                      "besides IP addresses, localhost and the --advertise-address host: "
                      "requests naming another Host are refused 403 (DNS rebinding); the "
                      "variable takes a comma-separated list."),
    config.flag("allow-open-registration", "LOCALAI_ALLOW_OPEN_REGISTRATION",
                "Allow a --listen other machines can reach with no --registration-token: "
                "anyone who reaches it can then register a worker and be sent prompts."),
    config.flag("allow-private-downloads", "LOCALAI_ALLOW_PRIVATE_DOWNLOADS",
                "Let model downloads and gallery fetches connect to loopback, private, "
                "link-local and other non-public addresses (a mirror on the local network), "
                "and gallery installs read file:// sources; by default only public "
                "addresses are fetched from, checked at every connection and redirect."),
    config.value("reconnect-grace", "LOCALAI_RECONNECT_GRACE",
                 "How long a disconnected worker counts as reconnecting before it is gone "
                 "(90s, 1m30s, or seconds).",
                 default="90s", parse=config.parse_duration),
    config.value("registration-limit", "LOCALAI_REGISTRATION_LIMIT",
                 "Worker registrations one source address may make per minute (at once, then "
                 "refilled evenly); more are answered 429 with Retry-After and the worker "
                 "retries. Workers behind one NAT or proxy share an address: raise it for a "
                 "larger fleet there. 0: no limit.",
                 default="1200", parse=config.parse_whole_number),
    config.value("heartbeat-batch", "LOCALAI_HEARTBEAT_BATCH",
                 "How long a worker's heartbeat waits for others to share its database "
                 "statement (200ms, 0.2, or a duration): one statement checks and writes a "
                 "whole batch. 0: each heartbeat its own statements; at most 2s.",
                 default="200ms", parse=_heartbeat_batch),
    config.value("tunnel-liveness", "LOCALAI_TUNNEL_LIVENESS",
                 "How often this replica writes the heartbeat of every worker whose tunnel it "
                 "holds (10s, or a duration): fenced by the tunnel's claim, on the database "
                 "clock, and tells them over the tunnel (stamp notices). Those workers then "
                 "heartbeat over HTTP only when their capacity changes or 60s pass without a "
                 "notice. 0: off, workers heartbeat every 10s; at most 30s.",
                 default="10s", parse=_tunnel_liveness),
    config.flag("require-approval", "LOCALAI_REQUIRE_APPROVAL",
                "New workers wait for an administrator's approval before they serve."),
    config.flag("local-worker", "LOCALAI_LOCAL_WORKER",
                "Also run a worker in this process (node <hostname>-local, data in "
                "<data-dir>/local-worker): it registers with this frontend over loopback and "
                "dials its tunnel like any worker; a one-machine cluster. Offers the default "
                "embeddings model all-minilm-l6-v2 when the models directory has no config "
                "for it. Mints a registration token when none is set."),
    config.value("backends-path", "LOCALAI_BACKENDS_PATH",
                 "With --local-worker: its directory of installed LocalAI backends (LocalAI's "
                 "option): 'backend: NAME' runs <backends-path>/NAME/run.sh (docs/backends.md).",
                 parse=config.parse_path, default_doc="<data-dir>/local-worker/backends"),
    config.repeatable("external-grpc-backends", "LOCALAI_EXTERNAL_GRPC_BACKENDS",
                      "With --local-worker: a backend program as NAME:PATH (LocalAI's option); "
                      "'backend: NAME' runs it.",
                      parse=parse_external_backend),
    config.value("max-active-backends", "LOCALAI_MAX_ACTIVE_BACKENDS",
                 "Most models one node holds at once (0 = no limit); a cold load onto a full "
                 "node first unloads its least recently used idle model (docs/models.md, "
                 "\"Lifecycle\").",
                 default="0", parse=lambda raw, option: _whole(raw, option)),
    config.flag("single-active-backend", "LOCALAI_SINGLE_ACTIVE_BACKEND",
                "Same as --max-active-backends 1 (LocalAI's older name)."),
    config.flag("enable-watchdog-idle", "LOCALAI_WATCHDOG_IDLE",
                "Unload models idle for longer than --watchdog-idle-timeout."),
    config.value("watchdog-idle-timeout", "LOCALAI_WATCHDOG_IDLE_TIMEOUT",
                 "Idle time after which --enable-watchdog-idle unloads a model.",
                 default="15m", parse=config.parse_duration),
    config.flag("enable-watchdog-busy", "LOCALAI_WATCHDOG_BUSY",
                "Stop a backend on which a request of this replica has run longer than "
                "--watchdog-busy-timeout (its requests in flight fail)."),
    config.value("watchdog-busy-timeout", "LOCALAI_WATCHDOG_BUSY_TIMEOUT",
                 "Run time of one request after which --enable-watchdog-busy stops its "
                 "backend.", default="5m", parse=config.parse_duration),
    config.value("distributed-prefix-cache", "LOCALAI_DISTRIBUTED_PREFIX_CACHE",
                 "Prefix-cache-aware routing (true or false): a chat or completion request to "
                 "a model loaded on several workers goes to the one that served the longest "
                 "head of its prompt, unless that one is too busy; false: the least loaded "
                 "one (round robin). A model's 'route_policy' overrides it (docs/routing.md).",
                 default="true", parse=config.parse_bool),
    config.value("distributed-prefix-cache-ttl", "LOCALAI_DISTRIBUTED_PREFIX_CACHE_TTL",
                 "How long a prompt prefix is remembered after it was last served.",
                 default="5m", parse=config.parse_duration),
    config.repeatable("plugin-dir", "LOCALAI_PLUGIN_DIRS",
                      "A directory of drop-in plugin modules (backend factories, job kinds), "
                      "scanned like localai_tw/plugins (docs/backends.md).",
                      parse=config.parse_directory),
    config.value("backend-calls", "LOCALAI_BACKEND_CALLS",
                 "How this replica calls backends on workers: 'tunnel', one framed request on "
                 "a kept-alive tunnel stream, the worker making the gRPC call (a worker too old for it is "
                 "called the other way); 'grpc', grpcio through a local bridge onto a tunnel "
                 "stream, as before (docs/operators.md).",
                 default="tunnel", parse=config.choice_parser("tunnel", "grpc")),
    config.repeatable("preload-models", "LOCALAI_PRELOAD_MODELS",
                      "Model name to load at start on a node the scheduler picks, once "
                      "workers are connected (as with preload: true in its YAML); the "
                      "variable takes a comma-separated list.", parse=_model_name),
    config.repeatable("load-to-memory", "LOCALAI_LOAD_TO_MEMORY",
                      "LocalAI's name for --preload-models.", parse=_model_name),
    config.value("nats-url", "LOCALAI_NATS_URL",
                 "Accepted for compatibility with LocalAI and ignored (no broker is used)."),
    config.value("access-log", "LOCALAI_ACCESS_LOG",
                 "Which HTTP requests get an access log line: all (every API request; none "
                 "for health probes and successful heartbeats, 4xx lines limited per client), "
                 "errors (only requests answered with a 4xx or 5xx status), or off.  With "
                 "text logs at info, the lines of up to 50 ms are written together; each "
                 "costs the replica about 5-10 us of CPU on its reactor thread.",
                 default="all", parse=config.choice_parser(*ACCESS_LOG_CHOICES)),
    *config.log_settings(),
)


class Options(config.EnvOptions):
    """Options of ``twistd localai-frontend``; each has a ``LOCALAI_*`` environment variable."""

    synopsis = "[options]"
    longdesc = ("Run a localai-tw frontend replica: the OpenAI-compatible API and the endpoint "
                "workers connect to, with cluster state in PostgreSQL.  Every option can also "
                "be set by the environment variable shown beside it.")
    settings = SETTINGS
    program = PROGRAM

    def validate(self) -> None:
        config.adopt_secret_file(self, "registration-token")
        config.adopt_secret_file(self, "api-key", lines=True)
        config.adopt_secret_file(self, "admin-api-key", lines=True)
        check_external_backends(self["external-grpc-backends"])
        reach = config.listener_reach(self["listen"])
        if reach is not None and not self["api-key"] and not self["allow-open-api"]:
            raise usage.UsageError(
                f"--listen: {self['listen']} accepts connections on {reach} and no --api-key "
                "is set, so the OpenAI API would serve anyone who can reach it; set "
                "--api-key-file (or --api-key), listen on loopback "
                f"({DEFAULT_LISTEN}), or pass --allow-open-api (env "
                "LOCALAI_ALLOW_OPEN_API=true) to run it open on purpose")
        for option in ("galleries", "backend-galleries"):
            if self[option]:
                from localai_tw.frontend.gallery.index import GalleryError, parse_galleries

                try:
                    parse_galleries(self[option], "--" + option)
                except GalleryError as e:
                    raise usage.UsageError(str(e)) from None
        advertised = self["advertise-address"]
        if advertised is not None and config.is_loopback_host(advertised[0]) \
                and not self["single-host"]:
            raise usage.UsageError(
                f"--advertise-address: {advertised[0]} is a loopback or unspecified address, "
                "which other replicas cannot reach; pass --single-host (env "
                "LOCALAI_SINGLE_HOST=true) if every replica runs on this machine")
        if self["local-worker"]:
            from localai_tw.frontend.localworker import is_tcp_endpoint

            if not is_tcp_endpoint(self["listen"]):
                raise usage.UsageError(
                    f"--local-worker: the local worker dials this frontend over plain TCP on "
                    f"loopback, so --listen must be a tcp: endpoint, not {self['listen']!r}")
            if not self["registration-token"]:
                # The local worker needs a token its frontend accepts; minted here, kept in
                # this process only (never logged: the configuration report masks it).
                self["registration-token"] = secrets.token_urlsafe(32)
                self.sources["registration-token"] = "generated"
        # After the local worker minted its token: one only this process knows locks it.
        if reach is not None and not self["registration-token"] \
                and not self["allow-open-registration"]:
            raise usage.UsageError(
                f"--listen: {self['listen']} accepts connections on {reach} and no "
                "--registration-token is set, so anyone who can reach it could register a "
                "worker and be sent users' prompts; set --registration-token-file (or "
                "--registration-token), listen on loopback "
                f"({DEFAULT_LISTEN}), or pass --allow-open-registration (env "
                "LOCALAI_ALLOW_OPEN_REGISTRATION=true) to leave registration open on purpose")


# -- the HTTP tree ------------------------------------------------------------------------


def build_http_root(database_service: DatabaseService) -> Resource:
    """A tree with only ``/healthz`` and ``/readyz`` on ``database_service``.  The replica's
    full tree is built by ``FrontendService``; this stays for tools that need the probes alone."""
    root = Resource()
    root.putChild(b"healthz", LivenessResource())
    root.putChild(b"readyz", ReadinessResource(database_service))
    return root


# -- the service tree ---------------------------------------------------------------------


def build_database_service(options: Options) -> DatabaseService:
    return DatabaseService(options["database-url"], options["data-dir"],
                           application_name="localai_frontend")


def startup_failure_reason(failure, listen: str | None = None) -> str:
    """One line saying why the replica could not start and, where it is known, the fix."""
    from twisted.internet.error import CannotListenError

    if failure.check(CannotListenError):
        error = failure.value
        where = f"{error.interface}:{error.port}" if error.interface else f"port {error.port}"
        code = getattr(error.socketError, "errno", None)
        option = f"--listen {listen}" if listen else "--listen"
        if code == errno.EADDRINUSE:
            return (f"{option}: {where} is already in use by another process; stop it or "
                    f"choose another port with --listen (e.g. tcp:8081:interface=127.0.0.1)")
        if code == errno.EACCES:
            return (f"{option}: no permission to listen on {where} (ports below 1024 need "
                    f"privileges); choose a port above 1023 with --listen")
        if code == errno.EADDRNOTAVAIL:
            return (f"{option}: {error.interface or where} is not an address of this machine; "
                    f"fix interface= in --listen")
        return f"{option}: cannot listen on {where}: {error.socketError}"
    return " ".join(failure.getErrorMessage().split())


def exit_on_startup_failure(service: Any, reactor: Any = None,
                            listen: str | None = None) -> None:
    """End the process with status 1 if ``service`` (anything with ``whenReady()``: the
    ``FrontendService`` or a ``DatabaseService``) never becomes ready.

    twistd has no way for a service to fail startup asynchronously, so this logs the reason,
    stops the reactor (services stop in order, the embedded server with them), and once twistd
    has finished its own shutdown, exits with status 1 so a supervisor sees the failure.
    """
    from localai_tw.frontend.service import FrontendStopped

    if reactor is None:
        from twisted.internet import reactor as _reactor
        reactor = _reactor

    def failed(failure):
        if failure.check(DatabaseServiceStopped, FrontendStopped, defer.CancelledError):
            return None
        log.critical("{program} cannot start: {reason}", program=PROGRAM,
                     reason=startup_failure_reason(failure, listen))
        _exit_status_at_interpreter_exit(1)
        if reactor.running:
            reactor.stop()
        else:  # failed inside startService (a listen error), before twistd runs the reactor
            reactor.callWhenRunning(reactor.stop)
        return None

    service.whenReady().addErrback(failed)


def _exit_status_at_interpreter_exit(status: int) -> None:
    import atexit

    def exit_now():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)

    atexit.register(exit_now)


#: The frontend process's ``gc.set_threshold``: Python's default (700, 10, 10) but full
#: collections considered after 100 middle-generation ones instead of 10.  A replica holding
#: 4000 tunnels ran a full collection of its whole heap about every 8 s at idle, 0.75-1.75 s
#: of stalled reactor each on a shared 2-core machine, and every one collected nothing (the
#: objects promoted that often die by reference count); with 100, about every 50-100 s
#: (``docs/benchmarks.md``, "A fleet on one replica").  Cyclic garbage that reached the
#: oldest generation waits longer to be freed.
GC_THRESHOLDS = (700, 10, 100)


def freeze_startup_objects(_ready=None) -> None:
    """Once the replica is ready: one full collection, then every object alive (modules,
    classes, the service tree) moved out of the collector's sight (``gc.freeze``), so a
    later full collection scans what requests and tunnels made, not the whole program.
    Those objects live as long as the process; cyclic garbage made later is still found."""
    import gc

    gc.collect()
    gc.freeze()


def makeService(options: Options) -> MultiService:
    """The frontend replica: configuration report, then the ``FrontendService``; with
    ``--local-worker``, then the ``LocalWorkerService`` (started once the frontend is ready,
    stopped before the frontend stops).  Sets the process's :data:`GC_THRESHOLDS`, and
    freezes what exists once the replica is ready (:func:`freeze_startup_objects`)."""
    import gc

    from localai_tw import logs

    gc.set_threshold(*GC_THRESHOLDS)
    add_plugin_directories(options["plugin-dir"])  # before any plugin discovery

    logs.quiet_grpc_core()  # before the inference core imports grpc
    from localai_tw.frontend.localworker import LocalWorkerService
    from localai_tw.frontend.service import FrontendService
    from localai_tw.servicetree import InOrderMultiService

    if options.get("instance-id") is None:
        try:
            options["instance-id"] = stored_instance_id(options["data-dir"])
        except usage.UsageError as e:  # as at option parsing: one line, status 1
            sys.stderr.write(f"{PROGRAM}: {e}\n")
            raise SystemExit(1) from None
        options.sources["instance-id"] = "data-dir"
    root = logs.LevelledMultiService.from_options(options)
    replica = InOrderMultiService() if options.get("local-worker") else MultiService()
    replica.setServiceParent(root)
    config.ConfigurationReport(PROGRAM, options, ignored=["nats-url"]).setServiceParent(replica)
    frontend = FrontendService(options)
    frontend.setServiceParent(replica)
    exit_on_startup_failure(frontend, listen=options.get("listen"))
    frontend.whenReady().addCallback(freeze_startup_objects).addErrback(lambda _: None)
    frontend.whenReady().addCallbacks(
        lambda ready: log.info("{line}", line=exposure_line(ready.listener.port.getHost(),
                                                            options)),
        lambda failure: None)  # a failed start is reported by exit_on_startup_failure
    if options.get("local-worker"):
        LocalWorkerService(frontend, options).setServiceParent(replica)
    return root


INSTANCE_ID_FILE = "instance-id"


def stored_instance_id(data_dir: str) -> str:
    """This data directory's replica id: read from ``<data-dir>/instance-id``, or made (a
    UUID) and stored there at first start, so a restarted replica comes back under the same
    id and finds the rows it held.  A file holding something else stops the start with a
    usage error naming it (it is the operator's to fix, never silently replaced)."""
    path = os.path.join(data_dir, INSTANCE_ID_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return config.parse_identifier(f.read().strip(), f"--instance-id (from {path})")
    except FileNotFoundError:
        pass
    except OSError as e:
        raise usage.UsageError(f"--data-dir: cannot read {path}: {e.strerror}") from None
    instance_id = str(uuid.uuid4())
    try:
        os.makedirs(data_dir, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(instance_id + "\n")
        os.replace(partial, path)
    except OSError as e:
        raise usage.UsageError(f"--data-dir: cannot write {path}: {e.strerror}") from None
    log.info("this replica's instance id {id} is kept in {path}", id=instance_id, path=path)
    return instance_id


def exposure_line(address: Any, options: Any) -> str:
    """One line saying who can use what on this replica's listener, logged once it is ready:
    an operator reads from it alone whether the OpenAI API, the admin API and worker
    registration are open."""
    host = getattr(address, "host", None)
    if host is None:
        where = str(getattr(address, "name", address))
    elif host in ("0.0.0.0", "::"):
        where = f"every interface of this machine, port {address.port}"
    else:
        where = f"[{host}]:{address.port}" if ":" in host else f"{host}:{address.port}"
    keys = options.get("api-key") or []
    admin_keys = options.get("admin-api-key") or []
    if admin_keys:
        api = (f"the OpenAI API needs an API key ({len(keys)} inference, {len(admin_keys)} "
               "admin configured); the admin API needs an admin key")
    elif keys:
        api = f"the OpenAI API needs an API key ({len(keys)} configured); the admin API is open " \
              "to holders of those keys"
    else:
        api = (f"the OpenAI API is open to anyone who can reach {where} (no --api-key); the "
               "admin API is closed (it needs --api-key)")
    if getattr(options, "sources", {}).get("registration-token") == "generated":
        registration = "worker registration is limited to the local worker (token minted in " \
                       "this process; set --registration-token for other workers)"
    elif options.get("registration-token"):
        registration = "worker registration needs the registration token"
    else:
        registration = "worker registration is open to anyone who can reach it (no " \
                       "--registration-token)"
    return f"{PROGRAM} listening on {where}: {api}; {registration}"
