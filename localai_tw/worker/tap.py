"""``twistd localai-worker``: the worker's options and service tree.

``Options`` declares every flag with its ``LOCALAI_*`` environment variable (see
``localai_tw.config``).  ``makeService(options)`` returns a ``MultiService`` that logs the
configuration (secrets masked) and holds the worker (registration, the tunnel dial loop and
the backend supervisor); the backend port allocator warns, once, when the backend port range
overlaps the kernel's ephemeral port range.  This module only parses options and composes
services.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from twisted.application.service import MultiService
from twisted.logger import Logger
from twisted.python import usage

from localai_tw import config
from localai_tw.backends.directory import check_external_backends, parse_external_backend
from localai_tw.backends.interfaces import add_plugin_directories

log = Logger()

PROGRAM = "localai-worker"

EPHEMERAL_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"

# Linux hands out ephemeral (outgoing) ports from 32768-60999 by default.  Backend gRPC servers
# bind fixed loopback ports; a range inside the ephemeral one races every outgoing connection
# on the machine for the same numbers, so the default sits below it.
DEFAULT_BACKEND_PORT_RANGE = "30000-30999"

SETTINGS = (
    config.value("register-to", "LOCALAI_REGISTER_TO",
                 "URL of the frontend (or its load balancer) to register with and dial "
                 "(http, https, ws or wss). Required.",
                 parse=config.parse_url),
    config.value("registration-token", "LOCALAI_REGISTRATION_TOKEN",
                 "Shared secret presented when registering (prefer "
                 "--registration-token-file: a command line is visible to every user).",
                 parse=config.parse_secret, secret=True),
    config.value("registration-token-file", "LOCALAI_REGISTRATION_TOKEN_FILE",
                 "File holding the registration token (one trailing newline is ignored).",
                 parse=config.parse_secret_file),
    config.repeatable("plugin-dir", "LOCALAI_PLUGIN_DIRS",
                      "A directory of drop-in plugin modules (backend factories, job kinds), "
                      "scanned like localai_tw/plugins (docs/backends.md).",
                      parse=config.parse_directory),
    config.flag("allow-remote-code", "LOCALAI_ALLOW_REMOTE_CODE",
                "Let backends run a model's own Python code (transformers' trust_remote_code). "
                "Off by default: a config asking for it fails to load on this worker."),
    config.value("node-name", "LOCALAI_NODE_NAME",
                 "This worker's name in the cluster; must be unique.",
                 default=socket.gethostname(),
                 parse=lambda raw, option: config.parse_identifier(raw, option, max_length=255)),
    config.value("node-type", "LOCALAI_NODE_TYPE",
                 "backend (runs models) or agent (runs queued jobs).",
                 default="backend", parse=config.choice_parser("backend", "agent")),
    config.value("backend-port-range", "LOCALAI_BACKEND_PORT_RANGE",
                 "Loopback ports for backend gRPC servers, FIRST-LAST; keep it outside the "
                 "kernel's ephemeral range (" + EPHEMERAL_PORT_RANGE_FILE + ").",
                 default=DEFAULT_BACKEND_PORT_RANGE, parse=config.parse_port_range),
    config.value("data-dir", "LOCALAI_DATA_DIR",
                 "Directory for this worker's state (models, backends; twistd's pidfile is "
                 "<data-dir>/localai-worker.pid unless --pidfile is given). One per worker: "
                 "it is locked (<data-dir>/localai-worker.lock) while the worker runs.",
                 default=config.default_data_dir("worker"), parse=config.parse_path),
    config.value("backends-path", "LOCALAI_BACKENDS_PATH",
                 "Directory of installed LocalAI backends (LocalAI's option): a model config's "
                 "'backend: NAME' runs <backends-path>/NAME/run.sh; such a directory replaces a "
                 "built-in backend of the same name (docs/backends.md).",
                 parse=config.parse_path, default_doc="<data-dir>/backends"),
    config.repeatable("external-grpc-backends", "LOCALAI_EXTERNAL_GRPC_BACKENDS",
                      "A backend program as NAME:PATH (LocalAI's option): 'backend: NAME' runs "
                      "PATH --addr 127.0.0.1:<port> in PATH's directory.",
                      parse=parse_external_backend),
    config.value("memory-budget", "LOCALAI_MEMORY_BUDGET",
                 "Most memory (RAM, and GPU memory when reported) this node offers to models, "
                 "e.g. 12G; it reports at most this much, so the frontends fit and evict "
                 "models within it (docs/models.md, \"Lifecycle\").",
                 parse=config.parse_byte_size, default_doc="all the memory of the machine"),
    config.repeatable("label", "LOCALAI_NODE_LABELS",
                      "Scheduling label key=value; the variable is comma-separated "
                      "(k=v,k=v).",
                      parse=config.parse_label),
    config.value("max-jobs", "LOCALAI_MAX_JOBS",
                 "Agent workers: jobs run at once (more are answered busy and offered to "
                 "another agent worker).",
                 default="4", parse=config.parse_count),
    config.value("api-url", "LOCALAI_API_URL",
                 "Agent workers: the cluster's OpenAI-compatible API that jobs call (chat, "
                 "embed-batch). Default: the --register-to URL.",
                 parse=config.url_parser(("http", "https"))),
    config.value("api-token", "LOCALAI_API_TOKEN",
                 "Agent workers: the API key jobs present to --api-url (one of the frontend's "
                 "--api-key values; prefer --api-token-file).",
                 parse=config.parse_secret, secret=True),
    config.value("api-token-file", "LOCALAI_API_TOKEN_FILE",
                 "File holding the --api-token (one trailing newline is ignored).",
                 parse=config.parse_secret_file),
    config.value("nats-url", "LOCALAI_NATS_URL",
                 "Accepted for compatibility with LocalAI and ignored (no broker is used)."),
    *config.log_settings(),
)


class Options(config.EnvOptions):
    """Options of ``twistd localai-worker``; each has a ``LOCALAI_*`` environment variable."""

    synopsis = "[options]"
    longdesc = ("Run a localai-tw worker: it registers with a frontend, holds one outbound "
                "tunnel to it and runs backends on loopback only.  Every option can also be "
                "set by the environment variable shown beside it.")
    settings = SETTINGS
    program = PROGRAM

    def validate(self) -> None:
        config.adopt_secret_file(self, "registration-token")
        config.adopt_secret_file(self, "api-token")
        if self["register-to"] is None:
            raise usage.UsageError(
                "--register-to is required (env LOCALAI_REGISTER_TO): the URL of the frontend "
                "to register with, e.g. https://frontend.example:8080")
        labels: dict[str, str] = {}
        for key, val in self["label"]:
            if key in labels:
                raise usage.UsageError(f"--label: key {key!r} is given twice")
            labels[key] = val
        self["labels"] = labels
        check_external_backends(self["external-grpc-backends"])


def ephemeral_port_overlap(port_range: config.PortRange,
                           path: str = EPHEMERAL_PORT_RANGE_FILE) -> tuple[int, int] | None:
    """The kernel's ephemeral range if ``port_range`` overlaps it, else None (or unreadable)."""
    try:
        with open(path) as f:
            first, last = (int(p) for p in f.read().split())
    except (OSError, ValueError):
        return None
    return (first, last) if port_range.overlaps(first, last) else None


def warn_if_unencrypted(register_to: str) -> bool:
    """Warn (and answer True) when registration and the tunnel would cross a network in clear:
    an ``http``/``ws`` URL whose host is not this machine."""
    parts = urlsplit(register_to)
    if parts.scheme.lower() not in ("http", "ws") or config.is_loopback_host(parts.hostname or ""):
        return False
    log.warn("--register-to {url} is not encrypted: the registration token, the tunnel "
             "credential and every request to this worker cross the network in clear; use "
             "https:// (TLS at the frontend or its load balancer) outside a trusted network",
             url=register_to)
    return True


def makeService(options: Options) -> MultiService:
    """The worker: configuration report, port range check, then registration, heartbeats, the
    tunnel dial loop and the control plane fed by tunnel streams (``worker/service.py``)."""
    from localai_tw import logs

    logs.quiet_grpc_core()  # before the backend supervisor imports grpc
    from localai_tw.worker.service import makeWorkerService

    warn_if_unencrypted(options["register-to"])
    add_plugin_directories(options["plugin-dir"])  # before any plugin discovery
    worker = logs.LevelledMultiService.from_options(options)
    config.ConfigurationReport(PROGRAM, options, ignored=["nats-url"]).setServiceParent(worker)
    makeWorkerService(options).setServiceParent(worker)
    return worker
