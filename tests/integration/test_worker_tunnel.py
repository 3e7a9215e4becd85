"""The worker end to end over real loopback sockets against a minimal in-test frontend.

The frontend here is a ``twisted.web`` site with a register/heartbeat resource written for the
test and a ``TunnelWebSocketResource`` at ``/api/cluster/connect`` whose authorizer checks the
bearer credential issued by the last registration.  It runs a yamux *server* session over each
accepted WebSocket and opens streams on it, as the real frontend does.  The worker is a real
``WorkerService``: it registers over HTTP, dials over WebSocket, and serves ``http`` streams from
its control site and ``grpc`` streams by splicing to a local TCP echo server.
"""

from __future__ import annotations

import hashlib
import json
import os

import psutil
import pytest
import pytest_twisted
from twisted.internet import defer, protocol, reactor
from twisted.web.resource import Resource
from twisted.web.server import Site

from localai_tw.nodekey import control_token, node_key_hash
from localai_tw.config import PortRange
from localai_tw.mux.session import Session, SessionConfig
from localai_tw.tunnel import preamble
from localai_tw.tunnel.websocket import (
    ConnectRefused,
    TunnelWebSocketResource,
    bearer_credential,
)
from localai_tw.worker.service import WorkerService

from .support import eventually, within

REGISTRATION_TOKEN = "REG-TOKEN-for-tests"
TIMEOUT = 20
FIVE_MIB = 5 * 1024 * 1024


# -- the minimal frontend -----------------------------------------------------------------------


class NodeAPI(Resource):
    """POST /api/node/register and /api/node/{id}/heartbeat, as the contract says."""

    isLeaf = True

    def __init__(self, frontend):
        super().__init__()
        self.frontend = frontend

    def render_POST(self, request):
        presented = (request.getHeader(b"authorization") or b"").decode()
        request.setHeader(b"content-type", b"application/json")
        if presented != f"Bearer {REGISTRATION_TOKEN}":
            request.setResponseCode(401)
            return json.dumps({"error": {"message": "bad token", "type": "unauthorized"}}).encode()
        body = json.loads(request.content.read())
        if request.postpath == [b"register"]:
            return self.frontend.register(request, body)
        if len(request.postpath) == 2 and request.postpath[1] == b"heartbeat":
            node_id = request.postpath[0].decode()
            self.frontend.heartbeats.append(node_id)
            if node_id not in self.frontend.credentials:
                request.setResponseCode(404)
                return b'{"error": {"message": "unknown node"}}'
            return b'{"status": "healthy"}'
        request.setResponseCode(404)
        return b"{}"


class FakeFrontend:
    def __init__(self, port: int = 0):
        self.registrations: list[dict] = []
        self.heartbeats: list[str] = []
        self.credentials: dict[str, str] = {}  # node id -> current tunnel credential
        self.ids: dict[str, str] = {}  # name -> node id
        self.dials: list[tuple[str, str]] = []  # (node id, presented credential)
        self.sessions: list[Session] = []
        self.refusals: list[int] = []  # statuses to answer the next dials with, in order
        self.session_arrived: defer.Deferred = defer.Deferred()
        root = Resource()
        api = Resource()
        cluster = Resource()
        root.putChild(b"api", api)
        api.putChild(b"node", NodeAPI(self))
        api.putChild(b"cluster", cluster)
        cluster.putChild(b"connect", TunnelWebSocketResource(self._session_for, self._authorize))
        self.site = Site(root)
        self.port = reactor.listenTCP(port, self.site, interface="127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port.getHost().port}"

    def register(self, request, body) -> bytes:
        self.registrations.append(body)
        name = body["name"]
        node_id = self.ids.setdefault(name, f"node-{len(self.ids) + 1}")
        credential = f"cred-{len(self.registrations)}"
        self.credentials[node_id] = credential
        request.setResponseCode(201)
        return json.dumps({"id": node_id, "status": "healthy",
                           "tunnel_token": credential}).encode()

    def _authorize(self, request):
        credential = bearer_credential(request).decode()
        node_id = (request.args.get(b"id") or [b""])[0].decode()
        self.dials.append((node_id, credential))
        if self.refusals:
            raise ConnectRefused(self.refusals.pop(0), "refused by the test")
        if not node_id:
            raise ConnectRefused(400, "missing id")
        if self.credentials.get(node_id) != credential:
            raise ConnectRefused(401, "wrong credential")
        return node_id

    def _session_for(self, request, node_id):
        session = Session(False, SessionConfig(accept_streams=False), reactor=reactor)
        self.sessions.append(session)
        arrived, self.session_arrived = self.session_arrived, defer.Deferred()
        reactor.callLater(0, arrived.callback, session)
        return session

    @property
    def session(self) -> Session:
        return self.sessions[-1]

    def stop(self):
        for session in self.sessions:
            if session.isOpen:
                session.abort("frontend stopping")
        return self.port.stopListening()


class StreamClient(protocol.Protocol):
    """The frontend's side of one stream: writes the request frame, reads the reply frame, then
    collects (and optionally checksums) everything that follows."""

    def __init__(self, tag: str, target: str, after: bytes = b"", expect: int = 0):
        self.request = preamble.encode_request(tag, target) + after
        self.reader = preamble.FrameReader()
        self.reply: defer.Deferred = defer.Deferred()
        self.body = bytearray()
        self.body_digest = hashlib.sha256()
        self.body_size = 0
        self.keep_body = expect == 0
        self.expect = expect
        self.got_all: defer.Deferred = defer.Deferred()
        self.ended: defer.Deferred = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        if not self.reply.called:
            payload, data = self.reader.feed(data)
            if payload is None:
                return
            self.reply.callback(preamble.parse_reply(payload))
        if data:
            self.body_size += len(data)
            self.body_digest.update(data)
            if self.keep_body:
                self.body += data
            if self.expect and self.body_size >= self.expect and not self.got_all.called:
                self.got_all.callback(self.body_digest.hexdigest())

    def connectionLost(self, reason):
        if not self.reply.called:
            self.reply.errback(reason)
        self.ended.callback(reason.value)


def open_stream(session, tag, target, after=b"", expect=0) -> StreamClient:
    client = StreamClient(tag, target, after, expect)
    session.openStream(client)
    return client


class Echo(protocol.Protocol):
    def dataReceived(self, data):
        self.transport.write(data)


def listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.Process(os.getpid()).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def free_port_in(port_range: PortRange) -> int:
    import socket

    for port in range(port_range.first, port_range.last + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in the range")


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def cleanup():
    stops = []
    yield stops
    for stop in reversed(stops):
        pytest_twisted.blockon(defer.maybeDeferred(stop).addErrback(lambda _: None))


@pytest.fixture
def frontend(cleanup):
    fe = FakeFrontend()
    cleanup.append(fe.stop)
    return fe


@pytest.fixture
def echo_server(cleanup):
    factory = protocol.Factory.forProtocol(Echo)
    # Listen inside a small backend range; find a free port there.
    port_range = PortRange(41000, 41099)
    port = reactor.listenTCP(free_port_in(port_range), factory, interface="127.0.0.1")
    cleanup.append(port.stopListening)
    return port.getHost().port, port_range


def worker_for(frontend, tmp_path, cleanup, port_range=PortRange(41000, 41099), registrar=None,
               **dialer):
    options = {
        "register-to": frontend.url,
        "registration-token": REGISTRATION_TOKEN,
        "node-name": "worker-a",
        "node-type": "backend",
        "backend-port-range": port_range,
        "data-dir": str(tmp_path / "worker"),
        "labels": {"zone": "test"},
    }
    worker = WorkerService(options, reactor, dialer_options=dialer, registrar_options=registrar)
    worker.startService()
    cleanup.append(worker.stopService)
    return worker


# -- tests --------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_the_worker_registers_dials_and_serves_every_kind_of_stream(
        frontend, echo_server, tmp_path, cleanup):
    echo_port, port_range = echo_server
    listening_before = listening_ports()
    worker = worker_for(frontend, tmp_path, cleanup, port_range)
    session = await within(frontend.session_arrived)

    assert frontend.registrations[0]["name"] == "worker-a"
    assert frontend.registrations[0]["labels"] == {"zone": "test"}
    assert frontend.dials == [("node-1", "cred-1")]
    await eventually(lambda: worker.dialer.isConnected, timeout=TIMEOUT)
    assert worker.readiness() is None

    # http: node.status through the control plane, with the control token a frontend derives
    # from the node key the worker registered with (never the registration token)
    control = control_token(node_key_hash(frontend.registrations[0]["node_key"]))
    status = open_stream(session, "http", "", (
        b"POST /v1/control/node/status HTTP/1.1\r\nHost: node-1.worker.invalid\r\n"
        b"Authorization: Bearer " + control.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"))
    assert (await within(status.reply)).accepted
    await within(status.ended)
    head, _, body = bytes(status.body).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(body)["node_name"] == "worker-a"

    # /readyz through the tunnel reports the tunnel
    ready = open_stream(session, "http", "", b"GET /readyz HTTP/1.1\r\nHost: w\r\n"
                                             b"Connection: close\r\n\r\n")
    await within(ready.ended)
    assert bytes(ready.body).startswith(b"HTTP/1.1 200")

    # grpc: 5 MiB each way through the splice, checksummed
    payload = os.urandom(FIVE_MIB)
    echo = open_stream(session, "grpc", f"ignored-host.example:{echo_port}", expect=FIVE_MIB)
    assert (await within(echo.reply)).accepted
    echo.transport.write(payload)
    received = await within(echo.got_all, 60)
    assert received == hashlib.sha256(payload).hexdigest()
    echo.transport.loseConnection()
    await within(echo.ended)

    # refusals
    out_of_range = open_stream(session, "grpc", f"127.0.0.1:{port_range.last + 1}")
    assert (await within(out_of_range.reply)).code == preamble.BAD_REQUEST
    closed_port = free_port_in(PortRange(echo_port + 1, port_range.last))
    closed = open_stream(session, "grpc", f"127.0.0.1:{closed_port}")
    reply = await within(closed.reply)
    assert reply.code == preamble.UNAVAILABLE and reply.is_evidence
    unknown = open_stream(session, "ssh", "127.0.0.1:22")
    assert (await within(unknown.reply)).code == preamble.UNKNOWN_TAG

    # the worker listens on nothing: no listening socket appeared in this process
    assert listening_ports() <= listening_before
    assert session.isOpen


@pytest_twisted.ensureDeferred
async def test_a_failing_stream_leaves_the_session_serving_others(
        frontend, echo_server, tmp_path, cleanup):
    echo_port, port_range = echo_server
    worker = worker_for(frontend, tmp_path, cleanup, port_range)
    session = await within(frontend.session_arrived)
    real_connect = worker.router.connect_backend
    poison_port = port_range.last

    def connect_backend(port, proto):
        if port == poison_port:
            raise RuntimeError("a bug that only this stream hits")
        return real_connect(port, proto)

    worker.router.connect_backend = connect_backend

    poisoned = open_stream(session, "grpc", f"127.0.0.1:{poison_port}")
    reason = await within(poisoned.ended)
    no_reply = []
    poisoned.reply.addErrback(no_reply.append)
    assert len(no_reply) == 1  # reset before any reply frame
    assert "reset" in str(reason).lower()

    garbage = StreamClient("x", "y")
    garbage.request = b"\xff\xff" + b"z" * 64  # an over-long frame
    session.openStream(garbage)
    assert (await within(garbage.reply)).code == preamble.BAD_REQUEST

    # A stream reset by the frontend in the middle of a transfer.
    aborted = open_stream(session, "grpc", f"127.0.0.1:{echo_port}", expect=1)
    assert (await within(aborted.reply)).accepted
    aborted.transport.write(b"x" * 100_000)
    await within(aborted.got_all)
    aborted.transport.abortConnection()
    await within(aborted.ended)

    # The session still serves both kinds of stream.
    healthy = open_stream(session, "http", "", b"GET /healthz HTTP/1.1\r\nHost: w\r\n"
                                               b"Connection: close\r\n\r\n")
    await within(healthy.ended)
    assert bytes(healthy.body).startswith(b"HTTP/1.1 200")
    echo = open_stream(session, "grpc", f"127.0.0.1:{echo_port}", expect=5)
    assert (await within(echo.reply)).accepted
    echo.transport.write(b"hello")
    await within(echo.got_all)
    echo.transport.loseConnection()
    await within(echo.ended)
    assert session.isOpen and worker.dialer.isConnected
    assert len(frontend.sessions) == 1


@pytest.fixture
def log_text():
    from twisted.logger import formatEvent, globalLogPublisher

    events = []
    globalLogPublisher.addObserver(events.append)
    yield lambda: "\n".join(formatEvent(e) or "" for e in events)
    globalLogPublisher.removeObserver(events.append)


@pytest_twisted.ensureDeferred
async def test_a_401_re_registers_once_per_wait_and_the_next_dial_uses_the_new_credential(
        frontend, tmp_path, cleanup, log_text):
    frontend.refusals = [401, 401]
    worker = worker_for(frontend, tmp_path, cleanup, random_fraction=lambda: 0.0)
    await within(frontend.session_arrived)
    await eventually(lambda: worker.dialer.isConnected, timeout=TIMEOUT)
    # dial 1 (cred-1) refused -> re-register (cred-2); dial 2 (cred-2) refused -> re-register
    # (cred-3); dial 3 uses cred-3 and is accepted.
    assert frontend.dials == [("node-1", "cred-1"), ("node-1", "cred-2"), ("node-1", "cred-3")]
    assert len(frontend.registrations) == 3
    assert worker.dialer.delays == [0.25, 0.5]
    text = log_text()
    assert "--node-name is unique" in text and "worker-a" in text and "node-1" in text
    assert "cred-" not in text and REGISTRATION_TOKEN not in text


@pytest_twisted.ensureDeferred
async def test_a_rotated_credential_is_refused_and_recovered_by_re_registering(
        frontend, tmp_path, cleanup):
    worker = worker_for(frontend, tmp_path, cleanup, random_fraction=lambda: 0.0)
    first = await within(frontend.session_arrived)
    # Another registration of the node elsewhere rotated the credential, and the frontend
    # dropped this session.
    frontend.credentials["node-1"] = "rotated-elsewhere"
    first.abort("replaced")
    second = await within(frontend.session_arrived)
    assert second is not first
    assert [c for _, c in frontend.dials] == ["cred-1", "cred-1", "cred-2"]
    assert len(frontend.registrations) == 2
    await eventually(lambda: worker.dialer.isConnected, timeout=TIMEOUT)


@pytest_twisted.ensureDeferred
async def test_the_worker_reconnects_with_backoff_when_the_frontend_goes_away(
        frontend, tmp_path, cleanup):
    worker = worker_for(frontend, tmp_path, cleanup, random_fraction=lambda: 1.0)
    await within(frontend.session_arrived)
    await eventually(lambda: worker.dialer.isConnected, timeout=TIMEOUT)
    port_number = frontend.port.getHost().port
    await frontend.stop()
    await eventually(lambda: not worker.dialer.isConnected, timeout=TIMEOUT)
    assert worker.readiness() is not None
    # Down for a while: refused dials, each wait twice the one before.
    await eventually(lambda: len(worker.dialer.delays) >= 4, timeout=30)
    assert worker.dialer.delays[:4] == [0.5, 1, 2, 4]
    # Back on the same address: the worker comes back by itself.
    revived = FakeFrontend(port_number)
    cleanup.append(revived.stop)
    revived.credentials.update(frontend.credentials)
    revived.ids.update(frontend.ids)
    session = await within(revived.session_arrived, 40)
    assert revived.dials == [("node-1", "cred-1")]
    await eventually(lambda: worker.dialer.isConnected, timeout=TIMEOUT)
    healthy = open_stream(session, "http", "", b"GET /healthz HTTP/1.1\r\nHost: w\r\n"
                                               b"Connection: close\r\n\r\n")
    await within(healthy.ended)
    assert bytes(healthy.body).startswith(b"HTTP/1.1 200")


@pytest_twisted.ensureDeferred
async def test_the_worker_starts_while_the_frontend_is_down(tmp_path, cleanup):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port_number = s.getsockname()[1]
    down = type("Down", (), {"url": f"http://127.0.0.1:{port_number}"})()
    worker = worker_for(down, tmp_path, cleanup)
    assert worker.running
    await eventually(lambda: worker.registrar._retry_call is not None, timeout=10)
    assert worker.readiness() == "not registered with the frontend yet"
    revived = FakeFrontend(port_number)
    cleanup.append(revived.stop)
    await within(revived.session_arrived, 10)
    assert len(revived.registrations) >= 1


@pytest_twisted.ensureDeferred
async def test_heartbeat_404_re_registers(frontend, tmp_path, cleanup):
    worker = worker_for(frontend, tmp_path, cleanup, registrar={"heartbeat_interval": 0.2})
    await within(frontend.session_arrived)
    await eventually(lambda: len(frontend.heartbeats) >= 1, timeout=TIMEOUT)
    del frontend.credentials["node-1"]  # the frontend forgot the node
    await eventually(lambda: len(frontend.registrations) == 2, timeout=TIMEOUT)
    assert worker.registrar.registration.tunnel_token == "cred-2"
    # The heartbeat goes on for the node the frontend knows again.
    count = len(frontend.heartbeats)
    await eventually(lambda: len(frontend.heartbeats) > count + 1, timeout=TIMEOUT)
    assert frontend.heartbeats[-1] == "node-1"
