"""Private local bridges that let grpcio reach a backend through a worker's tunnel.

Used for ``--backend-calls grpc`` and for workers too old for ``call`` streams (the default path
is ``tunnelcalls.py``, which needs no bridge).

grpcio cannot take a custom dialer: a channel connects to an address it resolves itself.  So
each (node, backend port) gets a :class:`GrpcBridge`: a Unix socket in a 0700 directory of this
replica, and every connection grpcio makes to it is joined (:class:`~localai_tw.splice.Splice`)
to a fresh ``grpc`` tunnel stream opened by the :class:`~localai_tw.tunnel.route.WorkerDialer`
with target ``127.0.0.1:<port>`` -- locally, or through the relay when another replica holds the
worker's tunnel.  grpcio then speaks HTTP/2 end to end with the backend; the bridge only copies
bytes, with backpressure both ways.

Why the bridge records dial errors: grpcio flattens every connect failure into ``UNAVAILABLE``,
the same status a dead backend produces.  The bridge therefore keeps

- ``last_dial_error``: the condition of the most recent failed dial, cleared by the next
  successful dial (ref §4, ``unroutable(client)``); and
- a counter of *route events* (failed dials, and tunnel streams that ended by a transport
  failure) with the latest one, so a caller can ask "did the route fail during my call?"
  (:meth:`GrpcBridge.route_failure_since`).

A call that failed while a route event happened, or while ``last_dial_error`` is set, failed on
the route, and the recorded condition says which (a routing fact, absence within the grace, an
unreachable peer, a transport failure, or ``StreamRefused`` -- the worker's own answer that the
backend port is not there).  Otherwise the backend itself answered.

Directory and names: ``<run-dir>/grpc-<replica>`` when that keeps socket paths under the 107
byte limit of ``sun_path``, else a fresh ``mkdtemp`` under the system temp directory (mode 0700
either way, removed by :meth:`GrpcBridges.close`; empty ``grpc-*`` leftovers beside it are
removed at start); a socket is ``<sha256(node:port)[:16]>.sock``.  Only this process's user can
connect.

What this module must never do: listen anywhere but a Unix socket in a 0700 directory; dial a
worker other than the bridge's node or a port other than its port; buffer without bound (the
accepted side is paused until its stream is open; then the splice's backpressure applies);
classify anything (it records conditions exactly as the dialer raised them); leave a socket file
behind after :meth:`GrpcBridges.forget` or :meth:`GrpcBridges.close`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile

from twisted.internet import defer
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw import errors
from localai_tw.splice import Splice
from localai_tw.tunnel import preamble

log = Logger()

#: Seconds a grpc connection waits for its tunnel stream before the dial is given up.
DIAL_TIMEOUT = 15.0
#: Longest socket path we create (``sun_path`` holds 108 bytes with the NUL).
MAX_SOCKET_PATH = 100
#: Live connections per bridge (each is one HTTP/2 connection of grpcio; it opens very few).
MAX_CONNECTIONS = 64


def _as_condition(failure: Failure, node_id: str, port: int) -> errors.ClusterError:
    if isinstance(failure.value, errors.ClusterError):
        return failure.value
    if failure.check(defer.CancelledError):
        return errors.TransportFailure(f"grpc stream to worker {node_id} port {port}: the dial "
                                       "was cancelled")
    return errors.TransportFailure(f"grpc stream to worker {node_id} port {port}: "
                                   f"{failure.getErrorMessage()}")


class _BridgeFactory(Factory):
    noisy = False  # one "Starting/Stopping factory" line per bridge is noise

    def __init__(self, bridge: "GrpcBridge"):
        self.bridge = bridge

    def buildProtocol(self, addr):
        return self.bridge._accepted()


class GrpcBridge:
    """One Unix socket whose connections become ``grpc`` streams to (node, port)."""

    def __init__(self, dialer, node_id: str, port: int, socket_path: str, reactor,
                 dial_timeout: float = DIAL_TIMEOUT):
        self.node_id = node_id
        self.port = port
        self.target = f"127.0.0.1:{port}"
        preamble.encode_request(preamble.TAG_GRPC, self.target)  # validates
        self.socket_path = socket_path
        self.address = f"unix:{socket_path}"
        self._dialer = dialer
        self._reactor = reactor
        self._dial_timeout = dial_timeout
        self._listening = None
        self._splices: set[Splice] = set()
        self._dials: set[defer.Deferred] = set()
        self.closed = False
        #: The condition of the last failed dial; None after a successful one.
        self.last_dial_error: errors.ClusterError | None = None
        #: Failed dials plus streams that ended by a transport failure, ever.
        self.route_events = 0
        #: The latest of those events (kept after a successful dial clears last_dial_error).
        self.last_route_failure: errors.ClusterError | None = None
        self.dials_ok = 0
        #: Seconds the last successful dial took to open its tunnel stream (relay included).
        self.last_dial_seconds: float | None = None
        #: Called (no argument) after every failed dial, once it is recorded: the client
        #: closes an idle channel that grpcio would otherwise redial (``backend_client.py``).
        self.on_dial_failed = None
        #: Dials this bridge started (one per connection grpcio made to its socket).
        self.dials = 0

    def listen(self) -> None:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a stale socket of ours (same name, same process dir)
        self._listening = self._reactor.listenUNIX(self.socket_path, _BridgeFactory(self),
                                                   mode=0o600, wantPID=False)

    # -- what a caller asks -----------------------------------------------------------------

    def snapshot(self) -> int:
        """The route-event counter now; pass it to :meth:`route_failure_since` later."""
        return self.route_events

    def route_failure_since(self, snapshot: int) -> errors.ClusterError | None:
        """The route condition to blame for a call started at ``snapshot``: the latest route
        event if one happened since, else the standing ``last_dial_error``, else None (the
        route worked: whatever failed was the backend's answer)."""
        if self.route_events > snapshot and self.last_route_failure is not None:
            return self.last_route_failure
        return self.last_dial_error

    # -- connections --------------------------------------------------------------------------

    def _accepted(self):
        if self.closed or len(self._splices) >= MAX_CONNECTIONS:
            log.warn("grpc bridge to worker {node} port {port}: refusing a connection "
                     "({why})", node=self.node_id, port=self.port,
                     why="closed" if self.closed else f"{MAX_CONNECTIONS} already open")
            return None
        splice = Splice()
        self._splices.add(splice)
        self.dials += 1
        deadline = self._reactor.seconds() + self._dial_timeout
        dialing = self._dialer.open(self.node_id, preamble.TAG_GRPC, self.target, splice.b,
                                    deadline)
        self._dials.add(dialing)
        dialing.addCallbacks(self._dialed, self._dial_failed,
                             callbackArgs=(splice, deadline - self._dial_timeout),
                             errbackArgs=(splice,))
        dialing.addBoth(lambda _: self._dials.discard(dialing))
        splice.whenDone().addCallback(self._ended, splice)
        return splice.a

    def _dialed(self, _protocol, splice: Splice, started: float | None = None) -> None:
        if started is not None:  # a request's trace counts it as its tunnel hop
            self.last_dial_seconds = max(0.0, self._reactor.seconds() - started)
        self.dials_ok += 1
        if self.last_dial_error is not None:
            log.info("grpc bridge to worker {node} port {port}: route back after "
                     "{err}", node=self.node_id, port=self.port, err=self.last_dial_error)
        self.last_dial_error = None

    def _dial_failed(self, failure: Failure, splice: Splice) -> None:
        condition = _as_condition(failure, self.node_id, self.port)
        if not self.closed:
            # Recorded BEFORE the accepted side is closed, so the RPC that fails because of
            # this close already sees the reason when its result reaches the reactor.
            self.last_dial_error = condition
            self._note_route_event(condition)
            log.info("grpc bridge to worker {node} port {port}: dial failed ({cond}): {err}",
                     node=self.node_id, port=self.port, cond=condition.condition,
                     err=condition)
        splice.abandon(failure)
        if not self.closed and self.on_dial_failed is not None:
            self.on_dial_failed()

    def _note_route_event(self, condition: errors.ClusterError) -> None:
        self.route_events += 1
        self.last_route_failure = condition

    def _ended(self, ending, splice: Splice) -> None:
        self._splices.discard(splice)
        if ending.normal or self.closed:
            return
        if "never connected" in ending.cause:
            return  # an abandoned dial: already recorded as the dial's own condition
        self._note_route_event(errors.TransportFailure(
            f"grpc stream to worker {self.node_id} port {self.port} broke: {ending.cause}"))

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> defer.Deferred:
        """Stop listening, abort open streams and pending dials, remove the socket file."""
        if self.closed:
            return defer.succeed(None)
        self.closed = True
        for dialing in list(self._dials):
            dialing.cancel()
        for splice in list(self._splices):
            splice.abort()
        listening, self._listening = self._listening, None
        stopping = defer.maybeDeferred(listening.stopListening) if listening is not None \
            else defer.succeed(None)

        def unlink(_):
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warn("could not remove bridge socket {path}: {err}",
                         path=self.socket_path, err=e)

        return stopping.addBoth(unlink)


def _private_directory(run_dir: str | None, replica: str) -> tuple[str, bool]:
    """A 0700 directory for sockets whose paths stay short enough; (path, created_by_mkdtemp)."""
    if run_dir:
        candidate = os.path.join(os.path.abspath(run_dir), f"grpc-{replica[:12]}")
        if len(candidate) + 1 + 16 + 5 <= MAX_SOCKET_PATH:
            os.makedirs(candidate, mode=0o700, exist_ok=True)
            os.chmod(candidate, 0o700)
            st = os.lstat(candidate)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise OSError(f"{candidate} is not a directory owned by this user")
            _remove_empty_siblings(candidate)
            return candidate, False
    return tempfile.mkdtemp(prefix="ltw-grpc-"), True


def _remove_empty_siblings(directory: str) -> None:
    """Remove the empty ``grpc-*`` directories beside ``directory``: left by replicas that
    stopped without cleaning up (or ran under another instance id).  Non-empty ones may be a
    live replica's on a shared data directory and are left alone; a live replica whose empty
    directory goes here makes it again at its next bridge."""
    parent = os.path.dirname(directory)
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        path = os.path.join(parent, name)
        if name.startswith("grpc-") and path != directory:
            try:
                os.rmdir(path)
            except OSError:
                pass


class GrpcBridges:
    """The bridges of this replica, one per (node, port), created on first use.

    :param dialer: the replica's ``WorkerDialer``.
    :param run_dir: directory for the sockets (None: a private temporary directory).
    :param replica: this replica's id (names the directory).
    """

    def __init__(self, dialer, run_dir: str | None, replica: str, reactor,
                 dial_timeout: float = DIAL_TIMEOUT):
        self._dialer = dialer
        self._reactor = reactor
        self._dial_timeout = dial_timeout
        self.directory, self._temporary = _private_directory(run_dir, replica)
        self._bridges: dict[tuple[str, int], GrpcBridge] = {}
        self.closed = False

    def bridge(self, node_id: str, port: int) -> GrpcBridge:
        if self.closed:
            raise errors.TransportFailure("the grpc bridges of this replica are closed "
                                          "(shutting down)")
        key = (node_id, int(port))
        existing = self._bridges.get(key)
        if existing is not None and not existing.closed:
            return existing
        if not self._temporary:  # a sibling replica may have tidied it away while empty
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        name = hashlib.sha256(f"{node_id}:{port}".encode()).hexdigest()[:16] + ".sock"
        bridge = GrpcBridge(self._dialer, node_id, int(port),
                            os.path.join(self.directory, name), self._reactor,
                            self._dial_timeout)
        bridge.listen()
        self._bridges[key] = bridge
        return bridge

    def get(self, node_id: str, port: int) -> GrpcBridge | None:
        return self._bridges.get((node_id, int(port)))

    def bridges_of(self, node_id: str) -> list[GrpcBridge]:
        return [b for (n, _), b in self._bridges.items() if n == node_id]

    def drop(self, node_id: str, port: int) -> defer.Deferred:
        bridge = self._bridges.pop((node_id, int(port)), None)
        return bridge.close() if bridge is not None else defer.succeed(None)

    def forget(self, node_id: str) -> defer.Deferred:
        """Drop every bridge of ``node_id`` (it departed or was deleted)."""
        closing = [self._bridges.pop(key).close() for key in list(self._bridges)
                   if key[0] == node_id]
        return defer.DeferredList(closing, consumeErrors=True).addCallback(lambda _: None)

    def close(self) -> defer.Deferred:
        self.closed = True
        closing = [b.close() for b in self._bridges.values()]
        self._bridges.clear()

        def tidy(_):
            # Ours in either case; an empty <run-dir>/grpc-<replica> would otherwise stay
            # after every stop.  Not empty (a socket we failed to unlink): left, and logged
            # by the bridge that failed.
            try:
                os.rmdir(self.directory)
            except OSError:
                pass

        return defer.DeferredList(closing, consumeErrors=True).addCallback(tidy)
