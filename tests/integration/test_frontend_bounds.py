"""A frontend listener under attack: raw sockets against a real ``FrontendService`` (real
PostgreSQL).  Each test plays one attack from issue 9 §3 and checks the listener's bound:
authentication decided when the headers end, a connection cap, deadlines for a request's head
and body, and a cap on the body bytes in flight."""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from twisted.internet import defer, endpoints, protocol, reactor, task
from twisted.logger import formatEvent, globalLogPublisher

from localai_tw.frontend.service import FrontendService

from .support import eventually
from .harness_frontend import ADMIN, TOKEN, Client, options


class RawClient(protocol.Protocol):
    """A TCP client that sends exactly the bytes it is told to and records what comes back."""

    def __init__(self):
        self.received = b""
        self.lost = defer.Deferred()

    def dataReceived(self, data):
        self.received += data

    def connectionLost(self, reason):
        self.lost.callback(None)

    @property
    def closed(self) -> bool:
        return self.lost.called

    def send(self, data: bytes) -> None:
        self.transport.write(data)

    def complete_response(self):
        """(status, headers, decoded JSON body) once a whole response has arrived, else None."""
        head, sep, body = self.received.partition(b"\r\n\r\n")
        if not sep:
            return None
        lines = head.split(b"\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.decode("latin-1").partition(": ")
            headers[name.lower()] = value
        if len(body) < int(headers.get("content-length", "0")):
            return None
        return int(lines[0].split()[1]), headers, json.loads(body) if body else None

    async def response(self, timeout: float = 5.0):
        for _ in range(int(timeout / 0.02)):
            answer = self.complete_response()
            if answer is not None:
                return answer
            if self.closed:
                raise AssertionError(f"closed without a whole response: {self.received[:200]!r}")
            await task.deferLater(reactor, 0.02, lambda: None)
        raise AssertionError(f"no response within {timeout} s: {self.received[:200]!r}")

    def close(self) -> None:
        if not self.closed:
            self.transport.abortConnection()


async def connect(port: int) -> RawClient:
    endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port)
    return await endpoints.connectProtocol(endpoint, RawClient())


def head(method: str, path: str, length: int | None, authorization: str | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: frontend", "Content-Type: application/json"]
    if authorization is not None:
        lines.append(f"Authorization: {authorization}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@pytest_twisted.async_yield_fixture
async def frontend(pg_dsn):
    """Starts a replica (registration token and admin key set) and closes every raw client."""
    services, clients = [], []

    async def start(**overrides):
        service = FrontendService(options(pg_dsn, **overrides), reactor=reactor)
        service.startService()
        services.append(service)
        await service.whenReady().addTimeout(30, reactor)
        return service

    async def dial(service) -> RawClient:
        client = await connect(service.listener.tcp_port())
        clients.append(client)
        return client

    start.dial = dial
    yield start
    for client in clients:
        client.close()
    for service in services:
        if service.running:
            await service.stopService()


async def silent_for(client: RawClient, seconds: float) -> None:
    await task.deferLater(reactor, seconds, lambda: None)
    assert client.received == b"" and not client.closed


# -- authentication when the headers end --------------------------------------------------------


REFUSED_BEFORE_THE_BODY = [
    # (path, Authorization, announced length, what the 401 says)
    ("/v1/chat/completions", None, 8_000_000, "invalid_api_key"),
    ("/v1/chat/completions", "Bearer sk-wrong", 8_000_000, "invalid_api_key"),
    ("/%761/embeddings", "Bearer sk-wrong", 8_000_000, "invalid_api_key"),  # routed as /v1
    ("/api/nodes/some-node/approve", "Bearer sk-wrong", 60_000, "unauthorized"),
    ("/api/nodes/scheduling", None, 60_000, "unauthorized"),
    ("/api/node/register", "Bearer wrong-token", 60_000, "unauthorized"),
    ("/api/node/some-node/heartbeat", None, 60_000, "unauthorized"),
]


@pytest.mark.parametrize("path, authorization, length, kind", REFUSED_BEFORE_THE_BODY)
@pytest_twisted.ensureDeferred
async def test_a_client_without_the_credential_is_refused_before_its_body(
        frontend, path, authorization, length, kind):
    """The attack: announce a big body with no or a wrong credential.  The answer comes when
    the headers end, before a body byte is sent; the connection is closed and nothing was
    reserved for the body."""
    service = await frontend()
    client = await frontend.dial(service)
    client.send(head("POST", path, length, authorization))
    status, headers, body = await client.response()
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert kind in (body["error"].get("code"), body["error"]["type"])
    await client.lost.addTimeout(5, reactor)
    assert service.site.body_bytes_in_flight == 0


@pytest_twisted.ensureDeferred
async def test_the_right_credential_still_sends_its_body(frontend):
    service = await frontend()
    client = await frontend.dial(service)
    body = json.dumps({"name": "w1", "node_key": "k" * 64}).encode()
    client.send(head("POST", "/api/node/register", len(body), f"Bearer {TOKEN}"))
    await silent_for(client, 0.3)  # waiting for the body, as it should
    assert service.site.body_bytes_in_flight == len(body)
    client.send(body)
    status, _, answer = await client.response()
    assert status == 201 and answer["tunnel_token"]
    await eventually(lambda: service.site.body_bytes_in_flight == 0)


@pytest_twisted.ensureDeferred
async def test_without_an_api_key_the_openai_api_stays_open(frontend):
    """Documented: with no --api-key the OpenAI API is open (the admin API is then closed)."""
    service = await frontend(**{"api-key": []})
    client = await frontend.dial(service)
    body = json.dumps({"model": "no-such-model",
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    client.send(head("POST", "/v1/chat/completions", len(body)))
    await silent_for(client, 0.3)
    client.send(body)
    status, _, answer = await client.response(timeout=10)
    assert status != 401, answer
    admin = await frontend.dial(service)
    admin.send(head("POST", "/api/nodes/x/approve", 10, "Bearer anything"))
    status, _, answer = await admin.response()
    assert status == 401 and "--api-key" in answer["error"]["message"]


# -- the connection cap -----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_connections_beyond_the_cap_that_send_nothing_are_bounded(frontend):
    """Beyond the cap, connections that have sent nothing wait for their request line, at
    most ``probe_reserve`` of them: a newer one closes the one that waited longest (a probe
    sends its line at once; an empty connection must not crowd it out)."""
    service = await frontend()
    service.site.max_connections = 4
    service.site.probe_reserve = 1
    holders = [await frontend.dial(service) for _ in range(4)]
    await eventually(lambda: service.site.open_connections == 4)
    lines = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        waiting = [await frontend.dial(service) for _ in range(4)]
        for client in waiting[:-1]:
            await client.lost.addTimeout(5, reactor)
            assert client.received == b""  # closed before a byte was read or written
    finally:
        globalLogPublisher.removeObserver(observer)
    assert not waiting[-1].closed and not any(client.closed for client in holders)
    assert (service.site.open_connections, service.site.undecided_connections) == (4, 1)
    evictions = [line for line in lines if "had not sent a request line" in line]
    assert evictions == ["closed 1 connection(s) since the last such line that were accepted "
                         "beyond the connection cap and had not sent a request line while 1 "
                         "newer ones waited"]  # one line, not one each

    # Once two holders leave, a client is served again.
    holders[0].close()
    holders[1].close()
    await eventually(lambda: service.site.open_connections == 2)
    status, instances = await Client(
        f"http://127.0.0.1:{service.listener.tcp_port()}").call(
            "GET", "/api/cluster/instances", token=ADMIN)
    assert status == 200 and instances["instances"]


# -- the probe reserve: a full cap does not make a serving replica look down -------------------


async def fill_the_cap(frontend, service, cap: int = 4, reserve: int = 2) -> list[RawClient]:
    """``cap`` idle anonymous connections (nobody vouched for them), the cap full."""
    service.site.max_connections = cap
    service.site.probe_reserve = reserve
    holders = [await frontend.dial(service) for _ in range(cap)]
    await eventually(lambda: service.site.open_connections == cap)
    return holders


@pytest.mark.parametrize("request_line", [b"GET /readyz HTTP/1.1", b"GET /healthz HTTP/1.1",
                                          b"HEAD /readyz HTTP/1.1", b"GET /readyz HTTP/1.0"])
@pytest_twisted.ensureDeferred
async def test_a_probe_is_answered_while_the_cap_is_full(frontend, request_line):
    """Issue 15 §4: during a reconnect storm the cap of connections nobody vouched for fills
    with worker dials and heartbeats, and the load balancer's probe was closed at accept like
    any other: a serving replica was pulled.  Beyond the cap, the probe reserve serves the
    probes.  Make ``buildProtocol`` refuse every connection over the cap again: this fails."""
    service = await frontend()
    holders = await fill_the_cap(frontend, service)
    probe = await frontend.dial(service)
    await eventually(lambda: service.site.undecided_connections == 1)
    probe.send(request_line + b"\r\nHost: frontend\r\n\r\n")
    await probe.lost.addTimeout(5, reactor)  # one probe per reserve connection, then closed
    assert probe.received.startswith(request_line.split(b" ")[2] + b" 200 "), probe.received
    if request_line.startswith(b"GET /readyz"):
        assert probe.received.endswith(b'{"ready": true}')
    await eventually(lambda: (service.site.undecided_connections,
                              service.site.reserve_connections) == (0, 0))
    assert not any(h.closed for h in holders) and service.site.open_connections == 4


REFUSED_ON_THE_RESERVE = [
    # (what is sent, the error shape's kind)
    (b"POST /api/node/register HTTP/1.1\r\nHost: f\r\nContent-Length: 2\r\n\r\n{}", None),
    (b"GET /api/cluster/connect?id=w1 HTTP/1.1\r\nHost: f\r\nUpgrade: websocket\r\n\r\n",
     None),
    (b"GET /readyz?x=1 HTTP/1.1\r\nHost: f\r\n\r\n", None),  # not spelled as a probe
    (b"GET /%72eadyz HTTP/1.1\r\nHost: f\r\n\r\n", None),
    (b"OPTIONS /readyz HTTP/1.1\r\nHost: f\r\n\r\n", None),
    (b"GET /readyz HTTP/1.1\r\nHost: f\r\nContent-Length: 5\r\n\r\nhello", None),  # a body
    (b"GET /readyz HTTP/1.1\r\nHost: f\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", None),
    (b"GET /v1/models HTTP/1.1\r\nHost: f\r\n\r\n", "openai"),
]


@pytest.mark.parametrize("sent, shape", REFUSED_ON_THE_RESERVE)
@pytest_twisted.ensureDeferred
async def test_anything_but_a_probe_on_the_reserve_is_refused_clearly(frontend, sent, shape):
    """A worker's dial or registration that lands on the reserve learns why (503, code
    ``too_many_connections``, ``Retry-After``) instead of a closed connection, and frees its
    slot at once.  Remove the request-line check: this fails."""
    service = await frontend()
    await fill_the_cap(frontend, service)
    client = await frontend.dial(service)
    await eventually(lambda: service.site.undecided_connections == 1)
    client.send(sent)
    status, headers, body = await client.response()
    assert status == 503 and headers["retry-after"] == "2"
    assert body["error"]["code"] == "too_many_connections"
    assert "only /healthz and /readyz" in body["error"]["message"]
    if shape == "openai":
        assert "param" in body["error"]  # the OpenAI API's error shape
    await client.lost.addTimeout(5, reactor)
    await eventually(lambda: (service.site.undecided_connections,
                              service.site.reserve_connections,
                              service.site.refusing_connections) == (0, 0, 0))


@pytest_twisted.ensureDeferred
async def test_a_probe_in_a_storm_of_dials_beyond_the_cap_is_answered(frontend):
    """The storm as the listener sees it: many connections wait in the listen backlog, each
    with its request already sent, and are accepted in one batch.  Each is decided on the line
    already waiting in its socket: the dials are answered 503 ``too_many_connections`` without
    taking a reserve slot, so the probe among them finds one.  Decide only on the request line
    read later (every connection takes a slot until then): the dials take both slots and the
    probe is closed at accept."""
    service = await frontend()
    holders = await fill_the_cap(frontend, service, reserve=2)
    port = service.listener.port
    port.stopReading()  # the storm queues in the backlog, as behind a busy reactor
    try:
        dials = []
        for i in range(12):
            client = await frontend.dial(service)
            client.send(f"GET /api/cluster/connect?id=w{i} HTTP/1.1\r\nHost: f\r\n"
                        "Upgrade: websocket\r\n\r\n".encode())
            dials.append(client)
            if i == 6:
                probe = await frontend.dial(service)
                probe.send(b"GET /readyz HTTP/1.1\r\nHost: f\r\n\r\n")
        await task.deferLater(reactor, 0.2, lambda: None)  # let the requests reach the backlog
    finally:
        port.startReading()
    await probe.lost.addTimeout(5, reactor)
    assert probe.received.startswith(b"HTTP/1.1 200 "), probe.received
    for client in dials:
        status, headers, body = await client.response()
        assert status == 503 and body["error"]["code"] == "too_many_connections"
    await eventually(lambda: (service.site.reserve_connections,
                              service.site.refusing_connections) == (0, 0))
    assert not any(h.closed for h in holders) and service.site.open_connections == 4


@pytest_twisted.ensureDeferred
async def test_the_probe_reserve_is_bounded(frontend):
    """A prober cannot use the space beyond the cap to hold more file descriptors or heads:
    at most ``probe_reserve`` connections wait for their request line (a newer one closes the
    oldest), and each is cut at the reserve's short head deadline; a probe still gets through.
    Remove the eviction in ``decide_over_cap``, or the short deadline in ``_start_deadline``:
    this fails."""
    service = await frontend()
    await fill_the_cap(frontend, service, reserve=2)
    service.site.probe_reserve_headers_deadline = 1.0
    silent = [await frontend.dial(service) for _ in range(5)]
    for client in silent[:3]:
        await client.lost.addTimeout(5, reactor)
        assert client.received == b""
    assert service.site.undecided_connections == 2
    probe = await frontend.dial(service)  # evicts silent[3]
    await silent[3].lost.addTimeout(5, reactor)
    probe.send(b"GET /healthz HTTP/1.1\r\nHost: f\r\n\r\n")
    await probe.lost.addTimeout(5, reactor)
    assert probe.received.startswith(b"HTTP/1.1 200 ")
    # the cap's own head deadline (30 s) does not apply to the last one
    await silent[4].lost.addTimeout(5, reactor)
    assert silent[4].received.startswith(b"HTTP/1.1 408 ")
    await eventually(lambda: (service.site.undecided_connections,
                              service.site.reserve_connections) == (0, 0))
    assert service.site.open_connections == 4


# -- deadlines for the head and the body --------------------------------------------------------


async def dribble(client: RawClient, data: bytes, every: float, until: float) -> float:
    """Send ``data`` one byte per ``every`` seconds until the server closes; the seconds it
    took (fails after ``until`` seconds)."""
    started = reactor.seconds()
    for byte in data:
        if client.closed:
            break
        if reactor.seconds() - started > until:
            raise AssertionError(f"still open after {until} s: the deadline did not cut it")
        client.send(bytes([byte]))
        await task.deferLater(reactor, every, lambda: None)
    await client.lost.addTimeout(until, reactor)
    return reactor.seconds() - started


@pytest_twisted.ensureDeferred
async def test_a_slowloris_head_is_cut_at_the_headers_deadline(frontend):
    service = await frontend()
    service.site.headers_deadline = 1.0
    client = await frontend.dial(service)
    took = await dribble(client, head("POST", "/api/node/register", 100, f"Bearer {TOKEN}"),
                         every=0.1, until=4.0)
    assert 0.9 <= took < 3.0
    assert client.received.startswith(b"HTTP/1.1 408 ")
    assert b"request_timeout" in client.received


@pytest_twisted.ensureDeferred
async def test_a_silent_connection_is_cut_at_the_headers_deadline(frontend):
    service = await frontend()
    service.site.headers_deadline = 1.0
    client = await frontend.dial(service)
    await client.lost.addTimeout(4, reactor)
    assert client.received.startswith(b"HTTP/1.1 408 ")


@pytest_twisted.ensureDeferred
async def test_a_dribbled_body_is_cut_at_the_body_deadline(frontend):
    service = await frontend()
    service.site.body_deadline = 1.0
    client = await frontend.dial(service)
    client.send(head("POST", "/api/node/register", 1000, f"Bearer {TOKEN}"))
    took = await dribble(client, b"{" + b" " * 998 + b"}", every=0.1, until=4.0)
    assert 0.9 <= took < 3.0
    status, _, answer = client.complete_response()
    assert status == 408 and answer["error"]["code"] == "request_timeout"
    assert service.site.body_bytes_in_flight == 0


# -- request bodies in flight ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_bodies_beyond_the_in_flight_cap_get_503_before_they_are_read(frontend):
    service = await frontend()
    service.site.max_body_bytes_in_flight = 100_000
    first = await frontend.dial(service)
    first.send(head("POST", "/api/node/register", 60_000, f"Bearer {TOKEN}"))
    await eventually(lambda: service.site.body_bytes_in_flight == 60_000)

    second = await frontend.dial(service)
    second.send(head("POST", "/api/node/register", 60_000, f"Bearer {TOKEN}"))
    status, headers, answer = await second.response()
    assert status == 503 and headers["retry-after"] == "5"
    assert answer["error"]["code"] == "too_many_bodies_in_flight"
    await second.lost.addTimeout(5, reactor)

    first.close()  # its reservation goes back
    await eventually(lambda: service.site.body_bytes_in_flight == 0)
    third = await frontend.dial(service)
    body = json.dumps({"name": "w1", "node_key": "k" * 64}).encode().ljust(60_000)
    third.send(head("POST", "/api/node/register", len(body), f"Bearer {TOKEN}") + body)
    status, _, answer = await third.response()
    assert status == 201, answer


# -- log volume -------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_thousands_of_refused_requests_make_a_few_log_lines_and_a_true_count(frontend):
    """The attack: 5000 requests with a wrong API key from one address.  The log gets the first
    few access lines of each window and one summary with the true count, not 5000 lines."""
    service = await frontend()
    limiter = service.site.refused_access
    limiter.window = 3.0
    events = []

    def access_lines():
        return [e for e in events if '"GET /v1/models HTTP/1.1" 401' in formatEvent(e)]

    def summaries():
        return [e for e in events if "with a 4xx status in the last" in formatEvent(e)]

    def told() -> int:
        """Refusals the log accounts for: each summary's count (its window's logged lines
        included) and the lines of windows that needed no summary."""
        summarised = sum(e["count"] for e in summaries())
        return summarised + len(access_lines()) - limiter.burst * len(summaries())

    globalLogPublisher.addObserver(events.append)
    try:
        client = await frontend.dial(service)
        request = head("GET", "/v1/models", None, "Bearer sk-wrong")
        for _ in range(50):  # pipelined, 100 at a time
            before = client.received.count(b"HTTP/1.1 401 ")
            client.send(request * 100)
            await eventually(lambda: client.received.count(b"HTTP/1.1 401 ") == before + 100)
        await eventually(lambda: told() == 5000, timeout=10)
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert len(events) < 50, [formatEvent(e) for e in events]
    assert summaries() and all(e["source"] == "127.0.0.1" for e in summaries())


@pytest_twisted.ensureDeferred
async def test_authorized_tunnels_do_not_count_against_the_connection_cap(frontend):
    """Issue 15 §4: a replica holds thousands of workers, but the cap on connections (1024)
    counted tunnels too, so the 1025th worker could never connect.  A connection upgraded for
    an authorized tunnel leaves the cap; anonymous connections are still capped.  Remove the
    ``authorized()`` call in tunnel.websocket: this fails."""
    from localai_tw.mux.session import Session
    from localai_tw.tunnel.websocket import connectWebSocket

    service = await frontend()
    port = service.listener.tcp_port()
    client = Client(f"http://127.0.0.1:{port}")
    sessions = []
    for i in range(3):
        status, node = await client.call(
            "POST", "/api/node/register",
            {"name": f"w{i}", "node_key": f"w{i}-node-key-" + "k" * 32}, token=TOKEN)
        assert status == 201
        sessions.append(await connectWebSocket(
            reactor, f"ws://127.0.0.1:{port}/api/cluster/connect?id={node['id']}",
            lambda: Session(client=True),
            headers={"Authorization": f"Bearer {node['tunnel_token']}"}).addTimeout(10, reactor))
    await eventually(lambda: service.site.held_connections == 3)
    await eventually(lambda: service.site.open_connections == 0)
    service.site.max_connections = 2
    service.site.probe_reserve = 0
    holders = [await frontend.dial(service) for _ in range(2)]
    await eventually(lambda: service.site.open_connections == 2)
    extra = await frontend.dial(service)
    await extra.lost.addTimeout(5, reactor)  # anonymous connections are still capped
    assert all(s.isOpen for s in sessions) and not any(h.closed for h in holders)
    for session in sessions:
        session.loseConnection()
    await eventually(lambda: service.site.held_connections == 0)
    assert service.site.open_connections == 2


@pytest_twisted.ensureDeferred
async def test_a_fleets_kept_alive_heartbeat_connections_do_not_fill_the_cap(frontend):
    """A worker keeps its heartbeat connection alive between beats (10 s, under the 60 s idle
    timer), so a fleet larger than the cap (1024) held the whole cap with heartbeat connections
    and every API client was refused.  The connection that carries a known node's heartbeats
    leaves the cap like a tunnel, one per node; a second one of the same node, and a heartbeat
    of an unknown node, stay counted.  Remove the hold_connection call in api/workers.py: this
    fails."""
    service = await frontend()
    port = service.listener.tcp_port()
    client = Client(f"http://127.0.0.1:{port}")
    nodes, credentials = [], {}
    for i in range(3):
        status, node = await client.call(
            "POST", "/api/node/register",
            {"name": f"hb{i}", "node_key": f"hb{i}-node-key-" + "k" * 32}, token=TOKEN)
        assert status == 201
        nodes.append(node["id"])
        credentials[node["id"]] = node["tunnel_token"]
    await eventually(lambda: service.site.open_connections == 0)

    def beat(node_id: str) -> bytes:
        body = json.dumps({"tunnel_token": credentials.get(node_id, "t" * 32)}).encode()
        return head("POST", f"/api/node/{node_id}/heartbeat", len(body),
                    f"Bearer {TOKEN}") + body

    beaters = []
    for node_id in nodes:
        beater = await frontend.dial(service)
        beater.send(beat(node_id))
        assert (await beater.response())[0] == 200
        beaters.append(beater)
    await eventually(lambda: service.site.held_connections == 3)
    assert service.site.open_connections == 0

    second = await frontend.dial(service)  # the same node on a second connection: counted
    second.send(beat(nodes[0]))
    assert (await second.response())[0] == 200
    stranger = await frontend.dial(service)  # an unknown node: 404, counted
    stranger.send(beat("0" * 8 + "-0000-4000-8000-" + "0" * 12))
    assert (await stranger.response())[0] == 404
    await eventually(lambda: service.site.open_connections == 2)
    assert service.site.held_connections == 3

    service.site.max_connections = 2
    service.site.probe_reserve = 0
    api = await frontend.dial(service)  # the cap is full of the two counted ones
    await api.lost.addTimeout(5, reactor)
    second.close()
    await eventually(lambda: service.site.open_connections == 1)
    api = await frontend.dial(service)  # room again: the three heartbeat connections hold none
    api.send(b"GET /healthz HTTP/1.1\r\nHost: frontend\r\n\r\n")
    await eventually(lambda: api.received.startswith(b"HTTP/1.1 200 "))
    assert not any(b.closed for b in beaters)

    beaters[0].close()  # a closed heartbeat connection leaves the held count and the map
    await eventually(lambda: service.site.held_connections == 2)
    assert nodes[0] not in service.site.held_for_key
