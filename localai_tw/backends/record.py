"""One backend process as the supervisor (``process.py``) records it: its state, its bounded
output, its gRPC client, its exit, and the errors a start or stop ends with.

Apart from the supervisor because these are what the rest of the worker reads (a record's
state and output for ``node.status`` and ``backend.exit``, the errors for the control verbs),
while the supervisor is what changes them.
"""

from __future__ import annotations

import collections
import os
import signal
from typing import TYPE_CHECKING, Any, Callable, Mapping

import grpc
from google.protobuf import json_format
from twisted.internet import defer, error as ierror
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.grpcfuture import deferred_from_future
from localai_tw.backends.grpcoptions import CLIENT_OPTIONS
from localai_tw.backends.grpcthread import close_channel, open_channel
from localai_tw.deferreds import OneShotObserver
from localai_tw.logsafe import untrusted

if TYPE_CHECKING:  # the supervisor makes records; a record only names it
    from localai_tw.backends.process import BackendSupervisor

log = Logger()

STARTING, LOADING, READY, STOPPING = "starting", "loading", "ready", "stopping"
STOPPED, CRASHED, FAILED = "stopped", "crashed", "failed"
LIVE_STATES = frozenset({STARTING, LOADING, READY, STOPPING})

#: Lines of a crashed backend's output in its crash report (``crash_report``), each cut at
#: :data:`CRASH_LINE_CHARS` characters: the report reaches an API client.
CRASH_TAIL_LINES = 10
CRASH_LINE_CHARS = 300


# -- errors ---------------------------------------------------------------------------------------


class BackendStartError(Exception):
    """A start that did not end with a ready backend.  ``str()`` is the worker's answer."""

    def __init__(self, message: str, record: "BackendProcess | None" = None):
        super().__init__(message)
        self.record = record


class BackendLoadFailed(BackendStartError):
    """LoadModel failed: a gRPC error or ``success=false`` with the backend's message."""


class BackendStopError(Exception):
    """The process did not exit even after SIGKILL (uninterruptible sleep, most likely)."""


class NoSuchBackend(LookupError):
    pass


# -- bounded output -------------------------------------------------------------------------------


class OutputRing:
    """The last output of one backend: complete lines, at most ``max_lines`` and
    ``max_bytes`` (of UTF-8 text) together; a line longer than ``max_line_bytes`` is cut into
    pieces.  stdout and stderr are interleaved in arrival order; supervisor notes start with
    ``[localai-tw]``."""

    def __init__(self, max_bytes: int = 1 << 20, max_lines: int = 5000,
                 max_line_bytes: int = 64 * 1024):
        self.max_bytes, self.max_lines, self.max_line_bytes = max_bytes, max_lines, \
            max_line_bytes
        self._lines: collections.deque[str] = collections.deque()
        self._bytes = 0
        self._partial: dict[str, bytes] = {}
        self.dropped_lines = 0

    def feed(self, stream: str, data: bytes) -> None:
        buffered = self._partial.get(stream, b"") + data
        *complete, rest = buffered.split(b"\n")
        for raw in complete:
            self._append(raw)
        while len(rest) > self.max_line_bytes:
            self._append(rest[: self.max_line_bytes])
            rest = rest[self.max_line_bytes:]
        self._partial[stream] = rest

    def flush(self) -> None:
        for stream, rest in list(self._partial.items()):
            if rest:
                self._append(rest)
        self._partial.clear()

    def note(self, text: str) -> None:
        self._append(f"[localai-tw] {text}".encode("utf-8"))

    def _append(self, raw: bytes) -> None:
        line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
        size = len(line.encode("utf-8")) + 1
        self._lines.append(line)
        self._bytes += size
        while self._lines and (len(self._lines) > self.max_lines or
                               self._bytes > self.max_bytes):
            dropped = self._lines.popleft()
            self._bytes -= len(dropped.encode("utf-8")) + 1
            self.dropped_lines += 1

    def lines(self, tail: int | None = None) -> list[str]:
        if tail is None or tail >= len(self._lines):
            return list(self._lines)
        if tail <= 0:
            return []
        return list(self._lines)[-tail:]

    def __len__(self) -> int:
        return len(self._lines)


# -- gRPC from the reactor ------------------------------------------------------------------------


class BackendClient:
    """Unary calls to one backend as Deferreds, on a grpcio channel in future mode (see the
    module docstring).  Cancelling a returned Deferred cancels the RPC."""

    def __init__(self, reactor, address: str, auth_token: str | None = None):
        self._reactor = reactor
        self.address = address
        self._channel = open_channel(address, CLIENT_OPTIONS)  # no thread per call
        self._stub = backend_pb2_grpc.BackendStub(self._channel)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        self._raw: dict[tuple[str, bool], Any] = {}

    def call(self, method: str, request, timeout: float | None) -> defer.Deferred:
        future = getattr(self._stub, method).future(request, timeout=timeout,
                                                    metadata=self._metadata)
        return deferred_from_future(self._reactor, future)

    def raw(self, path: str, server_streaming: bool):
        """The multi-callable for ``path`` that takes and returns serialized bytes as they are
        (a ``call`` tunnel stream's body, ``worker/backendcalls.py``); made once per method."""
        key = (path, server_streaming)
        callable_ = self._raw.get(key)
        if callable_ is None:
            make = self._channel.unary_stream if server_streaming else self._channel.unary_unary
            callable_ = self._raw[key] = make(path)
        return callable_

    @property
    def metadata(self):
        """The call metadata carrying this backend's own token."""
        return self._metadata

    def close(self) -> None:
        close_channel(self._channel)  # a kept channel ends its thread first (grpcthread.py)


def describe_rpc_error(failure: Failure) -> str:
    exc = failure.value
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return failure.getErrorMessage()


def is_unimplemented(failure: Failure) -> bool:
    exc = failure.value
    return isinstance(exc, grpc.RpcError) and hasattr(exc, "code") and \
        exc.code() == grpc.StatusCode.UNIMPLEMENTED


def shared_outcome(source: defer.Deferred) -> OneShotObserver:
    """``source``'s outcome handed to any number of callers, each with a fresh Deferred, so
    one caller's callbacks never change what another sees."""
    outcome = OneShotObserver()
    source.addBoth(outcome.fire)
    return outcome


# -- one backend ----------------------------------------------------------------------------------


class BackendProcess:
    """What the supervisor knows about one backend (live or recently ended)."""

    def __init__(self, key: str, model: str, backend: str, output: OutputRing):
        self.key, self.model, self.backend = key, model, backend
        self.output = output
        self.port: int | None = None
        self.address: str | None = None
        self.pid: int | None = None
        #: The program started (argv[0] of the backend's command), named in start failures.
        self.program: str | None = None
        self.state = STARTING
        self.started_at: float | None = None  # wall clock, seconds
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.error: str | None = None
        self.health_misses = 0
        self.last_health_error: str | None = None
        #: What a start-environment provider changed for this start (e.g. llama.cpp's extra
        #: buffer types turned off after a crash); shown by ``backend.list`` and ``/api/nodes``.
        self.note: str | None = None
        #: Set by an exit listener when a crash of this process made it change the next start
        #: of the same model (quoted in the crash report).
        self.fallback: str | None = None
        self.in_process = False
        #: this process's own gRPC bearer token (``LOCALAI_GRPC_AUTH_TOKEN``), minted when it
        #: starts; held by the worker, told only to frontends over the control channel
        #: (``backend.start``, ``backend.token``), never in ``describe()`` or a log
        self.grpc_token: str | None = None
        self._transport = None
        self._server = None  # in-process grpc.Server
        self._client: BackendClient | None = None
        self._end_waiters = OneShotObserver()
        self._ended = False
        self._start: defer.Deferred | None = None
        self._start_outcome: OneShotObserver | None = None
        self._stop: defer.Deferred | None = None
        self._stop_outcome: OneShotObserver | None = None
        self._final_state = STOPPED
        self._liveness: LoopingCall | None = None
        self._probing = False

    @property
    def ended(self) -> bool:
        return self._ended

    def when_ended(self) -> defer.Deferred:
        """Fires (with this record) when the process has exited.  Cancellable."""
        if self._ended:
            return defer.succeed(self)
        return self._end_waiters.when()

    def exit_description(self) -> str:
        if self.exit_signal is not None:
            return f"killed by signal {self.signal_name()}"
        if self.exit_code is not None:
            return f"exited with code {self.exit_code}"
        return "exited"

    def describe(self) -> dict[str, Any]:
        described = {
            "model": self.model, "backend": self.backend, "process_key": self.key,
            "address": self.address, "state": self.state, "pid": self.pid,
            "started_at": self.started_at, "health_misses": self.health_misses,
        }
        if self._ended:
            described.update(ended_at=self.ended_at, exit_code=self.exit_code,
                             exit_signal=self.exit_signal)
        if self.error:
            described["error"] = self.error
        if self.note:
            described["note"] = self.note
        return described

    def signal_name(self) -> str | None:
        if self.exit_signal is None:
            return None
        try:
            return signal.Signals(self.exit_signal).name
        except ValueError:
            return str(self.exit_signal)

    def crash_report(self) -> dict[str, Any]:
        """How this process ended, for the frontend's crash answer: ``crashed`` only for an
        exit nobody asked for (``state`` crashed); the last lines of its output, without the
        supervisor's own notes, each bounded."""
        tail = [line[:CRASH_LINE_CHARS] for line in self.output.lines(CRASH_TAIL_LINES + 8)
                if not line.startswith("[localai-tw] ")][-CRASH_TAIL_LINES:]
        return {
            "crashed": self._ended and self.state == CRASHED,
            "state": self.state, "model": self.model, "backend": self.backend,
            "process_key": self.key, "pid": self.pid, "exit_code": self.exit_code,
            "exit_signal": self.exit_signal, "signal": self.signal_name(),
            "description": self.exit_description() if self._ended else "running",
            "output": tail if self._ended else [], "fallback": self.fallback or "",
        }


class BackendProcessProtocol(ProcessProtocol):
    def __init__(self, supervisor: "BackendSupervisor", record: BackendProcess):
        self._supervisor = supervisor
        self._record = record

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self._record.output.feed("stdout" if childFD == 1 else "stderr", data)

    def processEnded(self, reason: Failure) -> None:
        code = sig = None
        if isinstance(reason.value, ierror.ProcessTerminated):
            code, sig = reason.value.exitCode, reason.value.signal
        elif isinstance(reason.value, ierror.ProcessDone):
            code = 0
        self._supervisor._processEnded(self._record, code, sig)


def signal_group(record: BackendProcess, sig: int, *, fall_back_to_pid: bool) -> None:
    """Signal the backend's process group (its pgid is its pid, from the setsid wrapper).
    Before the wrapper reached setsid there is no such group yet: then signal the pid."""
    pid = record.pid
    if pid is None or pid <= 1 or pid == os.getpgrp():
        return
    try:
        os.killpg(pid, sig)
        return
    except ProcessLookupError:
        pass
    except PermissionError as e:
        log.warn("cannot signal process group {pid} of backend {key}: {error}", pid=pid,
                 key=record.key, error=e)
    if fall_back_to_pid and record._transport is not None and not record.ended:
        try:
            record._transport.signalProcess(sig)
        except ierror.ProcessExitedAlready:
            pass


def one_line(message: str, limit: int = 500) -> str:
    """A failure message for one log line: its first line, plus the last line of the
    backend's output it quotes (usually the cause: an ImportError, a missing library)."""
    head, _, rest = message.partition("\n")
    tail = [line.strip() for line in rest.splitlines() if line.strip()]
    text = head.removesuffix("; last output:") + (f"; last output: {tail[-1]}" if tail else "")
    return untrusted(text, limit)  # the backend's words: escaped, on one line, bounded


def load_options_of(load) -> backend_pb2.ModelOptions:
    if isinstance(load, backend_pb2.ModelOptions):
        return load
    if not isinstance(load, Mapping):
        raise ValueError("load must be an object of ModelOptions fields")
    try:
        return json_format.ParseDict(dict(load), backend_pb2.ModelOptions())
    except json_format.ParseError as e:
        raise ValueError(f"load is not valid ModelOptions: {e}") from None


# -- the supervisor -------------------------------------------------------------------------------

ExitListener = Callable[[BackendProcess], None]
#: ``provider(backend, model) -> (environment, note)``: variables added to a backend's
#: environment at its start, and a note saying why (None: nothing changed).
StartEnvironment = Callable[[str, str], "tuple[Mapping[str, str], str | None]"]
