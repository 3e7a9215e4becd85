"""Shared pieces of the tunnel integration tests: frontend replicas and in-test workers.

A :class:`Frontend` is one replica as the services layer will compose it: a ``twisted.web`` Site
on ``127.0.0.1:<port>`` serving ``/api/cluster/connect`` and ``/api/cluster/peer``, its own
``MembershipService`` identity (single-host, advertised ``127.0.0.1:<port>``), a TunnelRegistry,
a PeerPool, a WorkerDialer and a WorkerHTTPClient.  Several share one real database.

A :class:`TestWorker` dials a frontend with ``connectWebSocket`` and runs a yamux client session
whose acceptor is either the real worker stream router (``localai_tw.worker.streams``) or a
scripted answer.  Nothing here mocks PostgreSQL, yamux or the WebSocket layer.

:class:`Collect` and :func:`only_condition` are what the routing tests assert with: the bytes
a caller received, and that a failure is one of the four conditions and none of the others.

The fixtures that build and stop them (``frontends``, ``workers``, ``real_worker``) are in
``conftest.py``.
"""

from __future__ import annotations

import hashlib
import os

from twisted.internet import defer, protocol, reactor
from twisted.internet.protocol import Factory, Protocol
from twisted.web.resource import Resource
from twisted.web.server import Site

from localai_tw import errors
from localai_tw.cluster.membership import InstanceIdentity, MembershipService
from localai_tw.cluster.nodes import NodeRegistry
from localai_tw.cluster.ownership import OwnershipFence
from localai_tw.config import PortRange
from localai_tw.mux.session import Session
from localai_tw.splice import HandoffProtocol
from localai_tw.tunnel import preamble
from localai_tw.tunnel.connect import connect_resource
from localai_tw.tunnel.endpoint import WorkerHTTPClient
from localai_tw.tunnel.peer import AcceptedPeerLinks, PeerPool
from localai_tw.tunnel.registry import TunnelRegistry
from localai_tw.tunnel.route import WorkerDialer
from localai_tw.tunnel.websocket import connectWebSocket
from localai_tw.worker.control import ControlAuth, ControlVerbs, build_worker_site
from localai_tw.worker.staging import FileStaging, StagingRoots
from localai_tw.worker.streams import StreamRouter

from .support import eventually, within

TOKEN = "shared-registration-token"
MiB = 1024 * 1024


class Frontend:
    """One frontend replica on a loopback port (see the module docstring)."""

    def __init__(self, db, name: str, *, token: str = TOKEN, grace: float | None = None,
                 peer_secret: str | None = None, nodes=None, start_membership: bool = True):
        self.db = db
        self.name = name
        self.token = token
        root = Resource()
        api, cluster = Resource(), Resource()
        root.putChild(b"api", api)
        api.putChild(b"cluster", cluster)
        self.port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.address = f"127.0.0.1:{self.port.getHost().port}"
        kwargs = {"peer_secret": peer_secret} if peer_secret is not None else {}
        self.identity = InstanceIdentity(instance_id=name, version="test",
                                         advertised_addr=self.address, **kwargs)
        self.fence = OwnershipFence(db)
        self.nodes = nodes if nodes is not None else NodeRegistry(db, registration_token=token)
        self.registry = TunnelRegistry(self.fence, name, reactor)
        self.membership = MembershipService(db, self.identity, reactor=reactor,
                                            on_reregistered=self.registry.reclaim)
        self.pool = PeerPool(db, self.identity, token, reactor)
        self.accepted = AcceptedPeerLinks(db, self.registry, token, reactor)
        cluster.putChild(b"connect", connect_resource(self.nodes, self.registry, reactor))
        cluster.putChild(b"peer", self.accepted.resource())
        self.dialer = WorkerDialer(self.registry, self.fence, self.pool, name, grace, reactor)
        self.http = WorkerHTTPClient(self.dialer, reactor)
        self._start_membership = start_membership

    @property
    def connect_url(self) -> str:
        return f"ws://{self.address}/api/cluster/connect"

    async def start(self):
        if self._start_membership:
            self.membership.startService()
            await self.membership.whenRegistered()
        return self

    async def stop(self):
        await within(self.http.close(), 10)
        self.pool.close()
        self.accepted.close()
        await within(self.registry.close(), 10)
        if self.membership.running:
            await within(self.membership.stopService(), 10)
        await within(self.port.stopListening(), 10)


# -- workers -----------------------------------------------------------------------------------


class EchoBackend(Protocol):
    def dataReceived(self, data):
        self.transport.write(data)


class ScriptedStream(HandoffProtocol):
    """A worker stream that reads the request frame, then behaves as ``script`` says:

    ``("refuse", code, text)``, ``("raw", bytes)`` (any reply payload, even outside the
    vocabulary), ``("drop",)`` (reset before replying), ``("silent",)`` (never answer),
    ``("echo",)`` (``ok`` then echo)."""

    def __init__(self, script, seen: list):
        self.script = script
        self.seen = seen
        self.reader = preamble.FrameReader()

    def preludeReceived(self, data):
        payload, leftover = self.reader.feed(data)
        if payload is None:
            return
        self.seen.append(preamble.parse_request(payload))
        kind = self.script[0]
        if kind == "refuse":
            self.transport.write(preamble.encode_refused(self.script[1], self.script[2]))
            self.transport.loseConnection()
        elif kind == "raw":
            self.transport.write(preamble.encode_frame(self.script[1]))
            self.transport.loseConnection()
        elif kind == "drop":
            self.transport.abortConnection()
        elif kind == "echo":
            self.transport.write(preamble.encode_accepted())
            echo = EchoBackend()
            self.handOff(echo, leftover)
        # "silent": nothing


class TestWorker:
    """One worker: registered in ``backend_nodes`` and able to dial a frontend."""

    __test__ = False  # not a test class

    def __init__(self, node_id: str, credential: str, acceptor):
        self.node_id = node_id
        self.credential = credential
        self.acceptor = acceptor
        self.sessions: list[Session] = []

    @classmethod
    async def register(cls, nodes: NodeRegistry, name: str, acceptor, token: str = TOKEN):
        registration = await nodes.register(name, presented_token=token)
        return cls(registration.node.id, registration.tunnel_credential, acceptor)

    async def dial(self, frontend: Frontend, credential: str | None = None) -> Session:
        session = await connectWebSocket(
            reactor, f"{frontend.connect_url}?id={self.node_id}",
            lambda: Session(client=True, acceptor=self.acceptor, reactor=reactor),
            headers={"Authorization": f"Bearer {credential or self.credential}"})
        self.sessions.append(session)
        return session

    async def attach_to(self, frontend: Frontend) -> Session:
        """Dial and wait until the frontend holds the tunnel under this session."""
        before = frontend.registry.held(self.node_id)
        session = await self.dial(frontend)
        await eventually(lambda: (frontend.registry.held(self.node_id) is not None
                                  and frontend.registry.held(self.node_id) is not before),
                         what=f"{frontend.name} to attach {self.node_id}")
        return session

    def close(self):
        for session in self.sessions:
            session.loseConnection()


def scripted(script, seen=None):
    seen = seen if seen is not None else []
    return lambda stream: ScriptedStream(script, seen)


# -- a real worker site (control plane + file staging) and a loopback "backend" --------------------


class RealWorkerParts:
    """The real worker stream router with a control site, file staging and an echo backend."""

    def __init__(self, tmp_path, token: str = TOKEN):
        for name in ("models", "data", "staging"):
            (tmp_path / name).mkdir(exist_ok=True)
        self.roots = StagingRoots(str(tmp_path / "models"), str(tmp_path / "data"),
                                  str(tmp_path / "staging"))
        auth = ControlAuth(token)
        self.verbs = ControlVerbs()
        files = FileStaging(self.roots, auth, reactor, max_upload_bytes=64 * MiB)
        self.site = build_worker_site(self.verbs, auth, lambda: None,
                                      v1_children=files.v1_children(),
                                      body_policies=files.body_policies())
        factory = Factory.forProtocol(EchoBackend)
        self.backend = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.backend_port = self.backend.getHost().port
        # The range holds the echo backend and the port right above it, which nobody serves
        # (so a stream to it is answered ``unavailable``).
        self.router = StreamRouter(self.site, PortRange(self.backend_port, self.backend_port + 1),
                                   reactor)

    def stop(self):
        return self.backend.stopListening()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def random_bytes(n: int) -> bytes:
    return os.urandom(n)


class Collect(protocol.Protocol):
    """A caller's end of a routed stream: ``done`` fires with the bytes once ``expect`` came."""

    def __init__(self, expect: int):
        self.expect = expect
        self.data = b""
        self.done = defer.Deferred()

    def dataReceived(self, data):
        self.data += data
        if len(self.data) >= self.expect and not self.done.called:
            self.done.callback(self.data)


def only_condition(error, expected):
    """``error`` is ``expected`` and none of the other conditions."""
    assert isinstance(error, expected), repr(error)
    for other in (errors.RoutingFact, errors.AbsentWithinGrace, errors.PeerUnreachable,
                  errors.WorkerAnswer, errors.CallerDeadlineExceeded):
        if not issubclass(expected, other):
            assert not isinstance(error, other), f"{error!r} must not be {other.__name__}"
