"""The backend supervisor: one backend process per loaded model, started, watched and stopped
on the worker's reactor.

Lifecycle of a backend (process key ``model#replica``):

1. **start**: the factory names an argv; a port comes from the :class:`PortAllocator`; the
   process is spawned in a session (and so a process group) of its own with
   ``<argv> --addr 127.0.0.1:<port>`` (external backends get the flag appended by their
   factory); stdout and stderr go into a bounded :class:`OutputRing`.
2. **readiness**: ``Health`` every 200 ms (2 s timeout each) until it answers ``OK``, within a
   deadline (60 s by default: LocalAI's transformers backend needs 5-10 s to import torch).
   A process that exits meanwhile fails the start with its exit status and last lines.
3. **load** (optional, when the start request carries ``load``): ``LoadModel``; an error or
   ``success=false`` fails the start with the backend's message and the process is stopped.
4. **ready**: liveness is the process being alive (``processEnded`` is authoritative); an
   optional ``Health`` probe with a generous timeout counts misses and logs them, and never
   kills: a single-threaded backend answers Health only after the Predict it is running.
5. **stop**: ``Free`` (5 s, failures ignored: UNIMPLEMENTED is normal), then SIGTERM to the
   process group, then SIGKILL to the group after a grace (10 s by default); every exit,
   requested or not, is followed by a SIGKILL sweep of the group so no grandchild survives.
6. **exit**: ``processEnded`` records the exit code or signal, releases the port into
   quarantine, and tells every exit listener (state ``stopped``, ``crashed`` or ``failed``).
   The record stays readable (with its output) among the last ``keep_ended`` exits.

Own process group, how: Twisted's ``spawnProcess`` neither calls ``setsid`` nor ``setpgid``
for a non-PTY child, so every backend is launched through a short exec wrapper,
``python -I -S -c SPAWN_EXEC <worker pid> <working directory or ""> <argv...>``: the wrapper
becomes a session leader, enters the working directory, and then *execs* the backend, so the
backend keeps the pid ``spawnProcess`` returned, its pid is its process group id, and its parent
is the worker (the parent-death backstop of LocalAI backends watches the right process).  The
``setsid`` binary is not used: it forks when the caller is already a group leader, and then the
pid we hold is not the backend's.

Never fork the worker, why: ``spawnProcess`` is always called without ``path``, so Twisted starts
the wrapper with ``posix_spawnp`` (it forks whenever a working directory is given).  A
``fork()`` of a process that has live gRPC channels runs gRPC core's at-fork handlers, which
restart its poller in the child; the child then closes its inherited descriptors before the
exec, the restarted poller finds its epoll descriptor gone and aborts the child (grpcio >= 1.80,
grpc/grpc#43055): a backend "killed by signal SIGABRT before it was ready" with the last line
``Epoll1Poller ... epoll_wait error: Bad file descriptor``, 19 of 300 forks in a measurement.
The wrapper's ``chdir`` keeps the working directory out of Twisted's hands.

Dying with the worker, how: before the exec the wrapper sets ``PR_SET_PDEATHSIG`` to SIGKILL
(Linux ``prctl`` through ctypes; it survives ``execve``), then checks that its parent is still
the worker pid it was given (a worker that died before the ``prctl`` would never send the
signal).  So a backend dies the moment the process that started it dies, ``kill -9``
included, whatever the backend program is (built-in or any LocalAI-compatible executable) and
whether or not it watches its parent itself.  The signal follows the *thread* that forked:
``spawnProcess`` runs on the reactor thread, which lives as long as the process.  It reaches
the backend only, not processes the backend started itself.  Where ``prctl`` does not exist
the wrapper goes on without it; the record below is then the remedy.

Leftovers, how: with a :class:`~localai_tw.backends.ledger.ProcessLedger` (the worker passes
``<data-dir>/backend-processes.json``) every spawned pid is recorded with its start time and
removed when it exits; ``startService`` first kills what a previous, killed run recorded and
is still running.

gRPC from the reactor, how: the supervisor's own calls (Health, LoadModel, Free) use grpcio's
synchronous channel in *future* mode (``stub.Health.future(...)``): the call is started
without blocking, grpc's own threads complete it, and the result is handed to the reactor with
``callFromThread``.  No thread is parked per call (a LoadModel may take minutes), a cancelled
Deferred cancels the RPC, and no asyncio loop is needed (``grpc.aio`` would need the asyncio
reactor or a second event loop thread).  Server-streaming calls are not made here.

What this module must never do:

- block the reactor: no blocking gRPC call, no ``wait``/``sleep``, no synchronous process
  reaping (Twisted reaps on SIGCHLD);
- signal a group it did not create: the group id is the backend's own pid, never the worker's
  own group (checked), and group signals stop once the group is empty;
- kill a ready backend because a health probe was slow or failed;
- keep unbounded output: each backend's output ring is bounded in bytes and lines, and ended
  records are kept in a bounded deque;
- hand a backend's port to another backend before the process that held it has exited;
- start a backend that can outlive the worker's process (the wrapper's parent-death signal).
"""

from __future__ import annotations

import collections
import os
import secrets
import signal
import sys
import time
from typing import Mapping

import grpc
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.builtin.serving import AUTH_TOKEN_ENV, REMOTE_CODE_ENV
from localai_tw.backends.grpcoptions import CLIENT_OPTIONS
from localai_tw.backends.interfaces import BackendFactories, UnknownBackend
from localai_tw.backends.ledger import ProcessLedger
from localai_tw.backends.ports import NoFreePort, PortAllocator
from localai_tw.backends.record import (
    BackendClient,
    BackendLoadFailed,
    BackendProcess,
    BackendProcessProtocol,
    BackendStartError,
    BackendStopError,
    CRASHED,
    describe_rpc_error,
    ExitListener,
    FAILED,
    is_unimplemented,
    load_options_of,
    LOADING,
    NoSuchBackend,
    one_line,
    OutputRing,
    READY,
    shared_outcome,
    signal_group,
    StartEnvironment,
    STARTING,
    STOPPING,
)

log = Logger()


#: The exec wrapper: own session and process group, SIGKILL when the worker dies, the working
#: directory (see above).  ``argv[1]`` is the worker's pid, ``argv[2]`` the working directory
#: ("" for the worker's), the backend's argv follows.
SPAWN_EXEC = (
    "import os,sys\n"
    "os.setsid()\n"
    "try:\n"
    " import ctypes; ctypes.CDLL(None).prctl(1, ctypes.c_ulong(9))  # PR_SET_PDEATHSIG, KILL\n"
    "except Exception:\n"
    " pass\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(70)\n"
    "if sys.argv[2]:\n"
    " try:\n"
    "  os.chdir(sys.argv[2])\n"
    " except OSError as e:\n"
    "  sys.stderr.write('cannot enter the working directory %s: %s\\n'\n"
    "                   % (sys.argv[2], e.strerror))\n"
    "  os._exit(71)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


DEFAULT_READY_TIMEOUT = 60.0
DEFAULT_HEALTH_INTERVAL = 0.2
DEFAULT_HEALTH_TIMEOUT = 2.0
DEFAULT_STOP_GRACE = 10.0
DEFAULT_KILL_WAIT = 5.0
DEFAULT_FREE_TIMEOUT = 5.0
DEFAULT_LIVENESS_INTERVAL = 30.0
DEFAULT_LIVENESS_TIMEOUT = 30.0
#: Lines of output quoted in a start failure.
FAILURE_TAIL_LINES = 20


class BackendSupervisor(Service):
    """Starts, watches and stops backend processes; one per process key ``model#replica``.

    ``ports`` is a :class:`PortAllocator`; ``factories`` a
    :class:`~localai_tw.backends.interfaces.BackendFactories` (or any object with
    ``lookup(name)``).  As a service, stopping it stops every backend (in parallel).
    Timings are injectable for tests; the defaults follow the contract sheet §4.
    """

    name = "backend-supervisor"

    def __init__(
        self,
        reactor,
        ports: PortAllocator,
        factories: BackendFactories,
        *,
        stop_grace: float = DEFAULT_STOP_GRACE,
        kill_wait: float = DEFAULT_KILL_WAIT,
        free_timeout: float = DEFAULT_FREE_TIMEOUT,
        ready_timeout: float = DEFAULT_READY_TIMEOUT,
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
        load_timeout: float | None = None,
        liveness_interval: float | None = DEFAULT_LIVENESS_INTERVAL,
        liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT,
        allow_remote_code: bool = False,
        withheld_env: tuple[str, ...] = (),
        extra_env: Mapping[str, str] | None = None,
        log_max_bytes: int = 1 << 20,
        log_max_lines: int = 5000,
        keep_ended: int = 32,
        on_exit: ExitListener | None = None,
        python: str = sys.executable,
        ledger: ProcessLedger | None = None,
    ):
        self._reactor = reactor
        self.ports = ports
        self.factories = factories
        self.stop_grace, self.kill_wait, self.free_timeout = stop_grace, kill_wait, free_timeout
        self.ready_timeout, self.health_interval = ready_timeout, health_interval
        self.health_timeout, self.load_timeout = health_timeout, load_timeout
        self.liveness_interval, self.liveness_timeout = liveness_interval, liveness_timeout
        #: the worker operator's decision, told to every backend (``REMOTE_CODE_ENV``)
        self.allow_remote_code = allow_remote_code
        #: variables of this process's environment a backend never inherits (the worker's
        #: secrets: a backend runs code the cluster does not vouch for)
        self.withheld_env = tuple(withheld_env)
        self.extra_env = dict(extra_env or {})
        self._log_limits = (log_max_bytes, log_max_lines)
        self._python = python
        #: Records spawned pids (``<data-dir>/backend-processes.json`` on a worker).
        self.ledger = ledger
        self._live: dict[str, BackendProcess] = {}
        self._ended: collections.deque[BackendProcess] = collections.deque(maxlen=keep_ended)
        self._exit_listeners: list[ExitListener] = [on_exit] if on_exit else []
        self._start_environments: list[StartEnvironment] = []

    # -- queries ------------------------------------------------------------------------------

    def add_exit_listener(self, listener: ExitListener) -> None:
        self._exit_listeners.append(listener)

    def add_start_environment(self, provider: StartEnvironment) -> None:
        """Ask ``provider`` for extra environment at every start (after the factory's own, so
        a provider's decision wins)."""
        self._start_environments.append(provider)

    def find_by_port(self, port: int) -> BackendProcess | None:
        """The live process on ``port``, else the latest ended one that had it (a port stays
        quarantined after its process exits, so the ended record is still the right one)."""
        for record in self._live.values():
            if record.port == port:
                return record
        for record in reversed(self._ended):
            if record.port == port:
                return record
        return None

    def find(self, name: str, *, include_ended: bool = True) -> BackendProcess:
        """The record for a process key, or for a model with exactly one live process (the
        most recent ended one when none is live).  Raises :class:`NoSuchBackend`."""
        if name in self._live:
            return self._live[name]
        live = [r for r in self._live.values() if r.model == name]
        if len(live) == 1:
            return live[0]
        if len(live) > 1:
            raise NoSuchBackend(f"model {name!r} runs {len(live)} processes "
                                f"({', '.join(sorted(r.key for r in live))}): name one")
        if include_ended:
            for record in reversed(self._ended):
                if name in (record.key, record.model):
                    return record
        raise NoSuchBackend(f"no backend process for {name!r}")

    def list(self, include_ended: bool = False) -> list[dict]:
        records = list(self._live.values())
        if include_ended:
            records += list(self._ended)
        return [r.describe() for r in records]

    def running_backends(self) -> list[dict]:
        """For ``node.status``: the ready backends as ``{model_id, address}``."""
        return [{"model_id": r.model, "address": r.address, "backend": r.backend}
                for r in self._live.values() if r.state == READY]

    def logs(self, name: str, tail: int | None = None) -> list[str]:
        return self.find(name).output.lines(tail)

    def token_for_port(self, port: int) -> str | None:
        """The gRPC token of the live backend listening on ``port``, or None."""
        for record in self._live.values():
            if record.port == port and record.grpc_token and not record.ended:
                return record.grpc_token
        return None

    def client_for_port(self, port: int) -> BackendClient | None:
        """The gRPC client of the live backend on ``port`` (None when no live process has
        that port, or it has no address yet): a ``call`` stream's backend."""
        for record in self._live.values():
            if record.port == port and not record.ended:
                return record._client
        return None

    def client(self, name: str) -> BackendClient:
        record = self.find(name, include_ended=False)
        if record._client is None:
            raise NoSuchBackend(f"backend {record.key} has no address yet")
        return record._client

    # -- start --------------------------------------------------------------------------------

    def start(self, backend: str, model: str, options: Mapping | None = None, *,
              replica: int = 0, load=None) -> defer.Deferred:
        """Start (or join the start of) the backend for ``model``.  Fires with the ready
        :class:`BackendProcess`, or fails with :class:`BackendStartError`."""
        key = f"{model}#{replica}"
        existing = self._live.get(key)
        if existing is not None:
            if existing.backend != backend:
                return defer.fail(BackendStartError(
                    f"{key} already runs backend {existing.backend}; stop it first",
                    existing))
            if existing.state == STOPPING:
                # An eviction's stop still running (a slow backend, a loaded machine): the
                # new start waits for that process to end, then starts a fresh one, rather
                # than fail a load that would succeed a moment later.
                log.info("backend {key} is stopping; starting it again once it has ended",
                         key=key)
                return existing.when_ended().addCallback(
                    lambda _: self.start(backend, model, options, replica=replica, load=load))
            if existing.state == READY:
                return defer.succeed(existing)
            return existing._start_outcome.when()
        output = OutputRing(*self._log_limits)
        record = BackendProcess(key, model, backend, output)
        record.started_at = time.time()
        self._live[key] = record
        record._start = defer.ensureDeferred(self._start_backend(record, dict(options or {}),
                                                                 load))
        record._start_outcome = shared_outcome(record._start)
        return record._start_outcome.when()

    async def _start_backend(self, record: BackendProcess, options: dict, load):
        try:
            try:
                factory = self.factories.lookup(record.backend)
            except UnknownBackend as e:
                raise BackendStartError(str(e), record) from None
            reason = factory.unavailable_reason()
            if reason is not None:
                raise BackendStartError(reason, record)
            model_options = load_options_of(load) if load is not None else None
            try:
                record.port = self.ports.allocate(record.key)
            except NoFreePort as e:
                raise BackendStartError(str(e), record) from None
            record.address = f"{self.ports.host}:{record.port}"
            argv = factory.command(record.address, options)
            # A token of its own (not the cluster's registration token): a backend runs code the
            # cluster does not vouch for, and its environment is readable by its user.
            record.grpc_token = secrets.token_urlsafe(32)
            record._client = BackendClient(self._reactor, record.address, record.grpc_token)
            if argv is None:
                self._serve_in_process(record, factory.servicer(options))
            else:
                cwd = options.get("cwd")
                if cwd is None and hasattr(factory, "working_directory"):
                    cwd = factory.working_directory(options)
                env = dict(factory.environment(options))
                env.update(self._extra_start_environment(record))
                self._spawn(record, list(argv), env, cwd)
            await self._wait_ready(record)
            if model_options is not None:
                record.state = LOADING
                await self._load(record, model_options)
            record.state = READY
            record.output.note(f"ready on {record.address}")
            log.info("backend {key} ({backend}) ready on {address}, pid {pid}",
                     key=record.key, backend=record.backend, address=record.address,
                     pid=record.pid)
            self._start_liveness(record)
            return record
        except BaseException as e:
            failure = Failure()
            if isinstance(e, defer.CancelledError) or record.state == STOPPING:
                message = f"{record.key} was stopped while starting"
            elif isinstance(e, BackendStartError):
                message = str(e)
            elif isinstance(e, ValueError):
                message = f"cannot start {record.key}: {e}"
            else:
                log.failure("starting backend {key} failed", failure, key=record.key)
                message = f"cannot start {record.key}: {failure.getErrorMessage()}"
            record.error = message
            record.output.note(message)
            # One line in the worker's log (the caller gets the whole message, output included);
            # a start a stop cancelled was asked for, not a failure.
            (log.info if record.state == STOPPING else log.warn)(
                "backend {key} ({backend}) did not start: {reason}", key=record.key,
                backend=record.backend, reason=one_line(message))
            if record.state != STOPPING:
                record._final_state = FAILED
                if record.ended:
                    pass  # it exited on its own: already reported as crashed, output kept
                elif record.pid is None and not record.in_process:
                    self._no_process(record)
                else:
                    record.state = STOPPING
                    self._stop_process(record, free=False).addErrback(
                        lambda f: log.failure("stopping failed backend {key}", f,
                                              key=record.key))
            kind = BackendLoadFailed if isinstance(e, BackendLoadFailed) else BackendStartError
            raise kind(message, record) from None

    def _extra_start_environment(self, record: BackendProcess) -> dict[str, str]:
        extra: dict[str, str] = {}
        notes = []
        for provider in self._start_environments:
            try:
                env, note = provider(record.backend, record.model)
            except Exception:
                log.failure("start environment provider failed for {key}", key=record.key)
                continue
            extra.update(env or {})
            if note:
                notes.append(note)
        if notes:
            record.note = "; ".join(notes)
            record.output.note(record.note)
        return extra

    def _spawn(self, record: BackendProcess, argv: list[str], env: Mapping[str, str],
               cwd) -> None:
        environment = {k: v for k, v in os.environ.items() if k not in self.withheld_env}
        environment.update(self.extra_env)
        environment.update(env)
        environment.setdefault("PYTHONUNBUFFERED", "1")
        # set last: neither the worker's environment nor a start request's options decide it
        environment[REMOTE_CODE_ENV] = "1" if self.allow_remote_code else "0"
        # set last too: the worker's own environment never chooses a backend's token
        environment[AUTH_TOKEN_ENV] = record.grpc_token or ""
        if cwd is not None and not isinstance(cwd, str):
            raise ValueError("options.cwd must be a string")
        wrapper = [self._python, "-I", "-S", "-c", SPAWN_EXEC, str(os.getpid()), cwd or "",
                   *argv]
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            # No path=: the wrapper enters cwd, so Twisted can posix_spawn (module docstring).
            record._transport = self._reactor.spawnProcess(
                BackendProcessProtocol(self, record), self._python, wrapper,
                env=environment, usePTY=False,
                childFDs={0: devnull, 1: "r", 2: "r"})
        finally:
            os.close(devnull)
        record.pid = record._transport.pid
        record.program = argv[0]
        record.output.note(f"started pid {record.pid}: {' '.join(argv)}")
        if self.ledger is not None:
            self.ledger.add(record.pid, record.key, record.backend, argv)

    def _serve_in_process(self, record: BackendProcess, servicer) -> None:
        from concurrent import futures

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                             options=[*CLIENT_OPTIONS[:2], ("grpc.so_reuseport", 0)])
        backend_pb2_grpc.add_BackendServicer_to_server(servicer, server)
        if server.add_insecure_port(record.address) == 0:
            raise BackendStartError(f"cannot bind {record.address} for in-process backend "
                                    f"{record.backend}", record)
        server.start()
        record._server = server
        record.in_process = True
        record.output.note(f"serving in process on {record.address}")

    def _until_ended(self, record: BackendProcess, d: defer.Deferred) -> defer.Deferred:
        """``d``'s outcome, unless the process exits first: then :class:`BackendStartError`
        (and ``d`` is cancelled).  ``defer.race`` does not fit: it ignores a failure while
        another Deferred is pending, and a failed Health must be seen at once."""
        ended = record.when_ended()

        def cancel(_):
            d.cancel()
            ended.cancel()

        outcome: defer.Deferred = defer.Deferred(cancel)

        def from_call(result):
            if not outcome.called:
                ended.cancel()
                outcome.callback(result) if not isinstance(result, Failure) \
                    else outcome.errback(result)
            return None

        def from_end(result):
            if isinstance(result, Failure) or outcome.called:
                return None  # cancelled: the call won
            outcome.errback(BackendStartError(
                self._exit_report(record, "before it was ready"), record))
            d.cancel()
            return None

        d.addBoth(from_call)
        ended.addBoth(from_end)
        return outcome

    def _exit_report(self, record: BackendProcess, when: str) -> str:
        tail = [line for line in record.output.lines(FAILURE_TAIL_LINES + 5)
                if not line.startswith("[localai-tw] ")][-FAILURE_TAIL_LINES:]
        program = f" ({record.program})" if record.program else ""
        text = f"backend {record.key}{program} {record.exit_description()} {when}"
        if tail:
            text += "; last output:\n" + "\n".join(tail)
        return text

    async def _wait_ready(self, record: BackendProcess) -> None:
        deadline = self._reactor.seconds() + self.ready_timeout
        last_error = "no answer yet"
        while True:
            if record.ended:
                raise BackendStartError(self._exit_report(record, "before it was ready"),
                                        record)
            try:
                reply = await self._until_ended(record, record._client.call(
                    "Health", backend_pb2.HealthMessage(), self.health_timeout))
            except BackendStartError:
                raise
            except grpc.RpcError as e:
                last_error = describe_rpc_error(Failure(e))
            else:
                if reply.message == b"OK":
                    return
                last_error = f"Health answered {reply.message[:64]!r}, not 'OK'"
            if self._reactor.seconds() + self.health_interval > deadline:
                raise BackendStartError(
                    f"grpc service not ready: backend {record.key} did not answer Health "
                    f"within {self.ready_timeout:g}s (last: {last_error})", record)
            await self._until_ended(record, deferLater(self._reactor, self.health_interval))

    async def _load(self, record: BackendProcess, request) -> None:
        try:
            result = await self._until_ended(
                record, record._client.call("LoadModel", request, self.load_timeout))
        except grpc.RpcError as e:
            raise BackendLoadFailed(f"LoadModel of {record.key} failed: "
                                    f"{describe_rpc_error(Failure(e))}", record) from None
        except BackendStartError as e:
            raise BackendLoadFailed(str(e).replace("before it was ready",
                                                   "while loading the model"), record) from None
        if not result.success:
            raise BackendLoadFailed(f"LoadModel of {record.key} failed: "
                                    f"{result.message or 'success=false, no message'}",
                                    record)
        record.output.note(f"model loaded: {result.message}")

    # -- liveness -----------------------------------------------------------------------------

    def _start_liveness(self, record: BackendProcess) -> None:
        if not self.liveness_interval:
            return
        loop = LoopingCall(self._probe, record)
        loop.clock = self._reactor
        record._liveness = loop
        loop.start(self.liveness_interval, now=False).addErrback(
            lambda f: log.failure("liveness probe of {key} stopped", f, key=record.key))

    def _probe(self, record: BackendProcess) -> None:
        """One liveness Health.  A miss is counted and logged; never a reason to kill."""
        if record._probing or record.state != READY or record._client is None:
            return
        record._probing = True

        def answered(reply):
            if record.health_misses:
                log.info("backend {key} answers Health again after {n} misses",
                         key=record.key, n=record.health_misses)
            record.health_misses = 0
            record.last_health_error = None

        def missed(failure):
            if failure.check(defer.CancelledError):
                return
            record.health_misses += 1
            record.last_health_error = describe_rpc_error(failure)
            log.warn("backend {key} missed a Health probe ({n} in a row): {error}; the "
                     "process is alive, so it is left running", key=record.key,
                     n=record.health_misses, error=record.last_health_error)

        def done(_):
            record._probing = False

        record._client.call("Health", backend_pb2.HealthMessage(), self.liveness_timeout) \
            .addCallbacks(answered, missed).addBoth(done)

    # -- stop ---------------------------------------------------------------------------------

    def stop(self, name: str, *, force: bool = False) -> defer.Deferred:
        """Stop a live backend: Free (unless ``force``), SIGTERM to its group, SIGKILL after
        the grace.  Fires with the ended record.  Stopping twice shares one stop."""
        try:
            record = self.find(name, include_ended=True)
        except NoSuchBackend as e:
            return defer.fail(e)
        if record.ended:
            return defer.succeed(record)
        if record._stop is None:
            starting = record.state in (STARTING, LOADING)
            record.state = STOPPING
            if starting and record._start is not None:
                record._start.cancel()
            self._stop_process(record, free=not force and not starting)
        return record._stop_outcome.when()

    def _stop_process(self, record: BackendProcess, *, free: bool) -> defer.Deferred:
        if record._stop is None:
            record._stop = defer.ensureDeferred(self._terminate(record, free))
            record._stop_outcome = shared_outcome(record._stop)
        return record._stop_outcome.when()

    async def _terminate(self, record: BackendProcess, free: bool) -> BackendProcess:
        if record._liveness is not None and record._liveness.running:
            record._liveness.stop()
        if free and record._client is not None and not record.ended:
            try:
                await self._until_ended(record, record._client.call(
                    "Free", backend_pb2.HealthMessage(), self.free_timeout))
            except BackendStartError:
                pass  # exited during Free: nothing left to signal
            except Exception as e:
                failure = Failure(e)
                if not is_unimplemented(failure):
                    record.output.note(f"Free failed ({describe_rpc_error(failure)}); "
                                       "stopping anyway")
        if record.ended:
            return record
        if record.in_process:
            return await self._stop_in_process(record)
        record.output.note(f"sending SIGTERM to process group {record.pid}")
        signal_group(record, signal.SIGTERM, fall_back_to_pid=True)

        def kill():
            if not record.ended:
                record.output.note(f"still running {self.stop_grace:g}s after SIGTERM: "
                                   f"sending SIGKILL to process group {record.pid}")
                log.warn("backend {key} ignored SIGTERM for {grace}s: SIGKILL",
                         key=record.key, grace=self.stop_grace)
                signal_group(record, signal.SIGKILL, fall_back_to_pid=True)

        killer = self._reactor.callLater(self.stop_grace, kill)
        ended = record.when_ended()
        ended.addTimeout(self.stop_grace + self.kill_wait, self._reactor)
        try:
            await ended
        except defer.TimeoutError:
            raise BackendStopError(
                f"backend {record.key} (pid {record.pid}) did not exit "
                f"{self.kill_wait:g}s after SIGKILL") from None
        finally:
            if killer.active():
                killer.cancel()
        return record

    async def _stop_in_process(self, record: BackendProcess) -> BackendProcess:
        from twisted.internet.threads import deferToThread

        event = record._server.stop(min(self.stop_grace, 5.0))
        await deferToThread(event.wait, self.stop_grace + self.kill_wait)
        self._processEnded(record, 0, None)
        return record

    def _no_process(self, record: BackendProcess) -> None:
        """A start that failed before anything ran: release what it took."""
        record.state = FAILED
        record._ended = True
        record.ended_at = time.time()
        self._release(record)
        self._forget(record)
        self._notify(record)

    # -- exit ---------------------------------------------------------------------------------

    def _processEnded(self, record: BackendProcess, code: int | None, sig: int | None) -> None:
        record.exit_code, record.exit_signal = code, sig
        record.ended_at = time.time()
        record._ended = True
        record.output.flush()
        # Sweep whatever the backend left in its group (grandchildren that outlived it).
        if not record.in_process:
            signal_group(record, signal.SIGKILL, fall_back_to_pid=False)
            if self.ledger is not None:
                self.ledger.remove(record.pid)
        record._transport = None
        was_ready = record.state == READY
        if record.state == STOPPING:
            record.state = record._final_state
        elif record.state in (STARTING, LOADING, READY):
            record.state = CRASHED
        record.output.note(f"{record.exit_description()} ({record.state})")
        if record.state == CRASHED:
            if was_ready:  # a crash during the start is logged once, as the start's failure
                log.warn("backend {key} ({backend}, pid {pid}) {how}", key=record.key,
                         backend=record.backend, pid=record.pid, how=record.exit_description())
            if record.error is None:
                record.error = f"backend {record.exit_description()}"
        if record._liveness is not None and record._liveness.running:
            record._liveness.stop()
        self._release(record)
        self._forget(record)
        # Listeners first: a waiter's callbacks may run a whole coroutine onward.
        self._notify(record)
        record._end_waiters.fire(record)

    def _release(self, record: BackendProcess) -> None:
        if record.port is not None:
            self.ports.release(record.port)
        if record._client is not None:
            record._client.close()

    def _forget(self, record: BackendProcess) -> None:
        if self._live.get(record.key) is record:
            del self._live[record.key]
            self._ended.append(record)

    def _notify(self, record: BackendProcess) -> None:
        for listener in list(self._exit_listeners):
            try:
                listener(record)
            except Exception:
                log.failure("backend exit listener failed for {key}", key=record.key)

    # -- service ------------------------------------------------------------------------------

    def stop_all(self, *, force: bool = False) -> defer.Deferred:
        stops = [self.stop(key, force=force) for key in list(self._live)]
        return defer.DeferredList(stops, consumeErrors=True)

    def startService(self):
        if self.ledger is not None:
            self.ledger.reap()  # before any backend of this run is started
        super().startService()

    def stopService(self):
        super().stopService()
        return self.stop_all()

