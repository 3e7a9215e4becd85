"""The worker control plane over real loopback TCP with treq, and over a TCP connection that
starts with a preamble, handed to the site by ``serve_http_on_transport`` as a tunnel stream
would be."""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from twisted.internet import defer, protocol, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.web.client import Agent
from zope.interface import implementer
from twisted.internet.interfaces import IStreamClientEndpoint

from localai_tw.worker import control
from localai_tw.worker.control import ControlAuth, ControlVerbs, NoFreeSlot, build_worker_site
from localai_tw.worker.httpserve import TunnelStreamAddress, serve_http_on_transport

from .harness_tcp import raw_exchange, with_timeout


class PreambleThenHTTP(protocol.Protocol):
    """Reads a ``<tag>\\n`` preamble, then hands the connection to the site with whatever
    followed the preamble: the role the tunnel plays for a yamux stream."""

    def __init__(self, site, accepted):
        self.site = site
        self.accepted = accepted
        self.buffer = b""
        self.http = None

    def dataReceived(self, data):
        if self.http is not None:
            self.http.dataReceived(data)
            return
        self.buffer += data
        if b"\n" in self.buffer:
            tag, _, leftover = self.buffer.partition(b"\n")
            assert tag == b"http"
            self.http = serve_http_on_transport(self.site, self.transport, leftover)
            self.accepted.append(self.http)

    def connectionLost(self, reason):
        if self.http is not None:
            self.http.connectionLost(reason)


@implementer(IStreamClientEndpoint)
class PreambleEndpoint:
    """Writes the preamble first on every connection, as the frontend's stream dialer does."""

    def __init__(self, inner):
        self.inner = inner

    def connect(self, factory):
        def opened(proto):
            proto.transport.write(b"http\n")
            return proto

        return self.inner.connect(factory).addCallback(opened)


class PreambleAgentFactory:
    def __init__(self, port):
        self.port = port

    def endpointForURI(self, uri):
        return PreambleEndpoint(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port))


@pytest.fixture
def verbs():
    verbs = ControlVerbs()
    verbs.register("model.unload", lambda body: {"success": False, "error": "not loaded"})
    verbs.register("node.stop", lambda body: None)
    verbs.register("backend.list", lambda body: {"backends": []})

    def busy(body):
        raise NoFreeSlot()

    verbs.register("agent.execute", busy)
    verbs.register("broken", lambda body: 1 / 0)
    control.register_node_status(verbs, "node-a", "backend", lambda: [], reactor)
    return verbs


def listen(site):
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    return port, f"http://127.0.0.1:{port.getHost().port}"


@pytest.fixture
def served(verbs):
    site = build_worker_site(verbs, ControlAuth(None), lambda: None)
    port, base = listen(site)
    yield base, verbs
    pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


async def post(base, path, body=b"{}", headers=None):
    response = await with_timeout(treq.post(base + path, data=body, headers=headers,
                                            persistent=False))
    return response.code, response.headers, await treq.content(response)


@pytest_twisted.ensureDeferred
async def test_every_status_of_the_contract(served):
    base, _ = served
    code, _, body = await post(base, "/v1/control/model/unload", b'{"model_name": "m"}')
    assert (code, json.loads(body)) == (200, {"success": False, "error": "not loaded"})
    assert (await post(base, "/v1/control/node/stop"))[0] == 204
    code, _, body = await post(base, "/v1/control/backend/list", b"{oops")
    assert code == 400 and "not valid JSON" in json.loads(body)["problem"]
    code, _, body = await post(base, "/v1/control/" + "z" * 300)
    assert code == 404
    assert body == b"unknown worker control path " + (b"/v1/control/" + b"z" * 300)[:128]
    response = await with_timeout(treq.get(base + "/v1/control/backend/list", persistent=False))
    assert response.code == 405 and response.headers.getRawHeaders(b"allow") == [b"POST"]
    await treq.content(response)
    code, _, body = await post(base, "/v1/control/agent/execute")
    assert (code, json.loads(body)) == (503, {"busy": control.NO_FREE_SLOT})
    assert (await post(base, "/v1/control/broken"))[0] == 500
    code, _, body = await post(base, "/v1/control/node/status", b"")
    assert code == 200 and json.loads(body)["node_name"] == "node-a"


@pytest_twisted.ensureDeferred
async def test_413_is_answered_from_the_headers_and_the_connection_closed(verbs):
    called = []
    verbs.register("files.stage", lambda body: called.append(body) or {})
    site = build_worker_site(verbs, ControlAuth(None), lambda: None)
    port, _ = listen(site)
    try:
        client = await raw_exchange(
            port.getHost().port,
            b"POST /v1/control/files/stage HTTP/1.1\r\nHost: w\r\n"
            b"Content-Length: 9437184\r\n\r\n",
        )
        received = await with_timeout(client.closed)  # the server closes: it will not read
        assert received.startswith(b"HTTP/1.1 413 ")
        assert called == []
    finally:
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_ndjson_lines_arrive_as_produced_with_one_final_reply(verbs):
    gates = [defer.Deferred() for _ in range(3)]

    async def install(body, progress):
        for i, gate in enumerate(gates):
            await progress({"step": i})
            await gate  # opened by the client only once it has read this line
        return {"success": True}

    verbs.register("backend.install", install, streaming=True)
    site = build_worker_site(verbs, ControlAuth(None), lambda: None)
    port, base = listen(site)
    try:
        response = await with_timeout(treq.post(base + "/v1/control/backend/install",
                                                data=b"{}", persistent=False))
        assert response.headers.getRawHeaders(b"content-type") == [b"application/x-ndjson"]
        assert response.headers.getRawHeaders(b"x-content-type-options") == [b"nosniff"]
        pending = b""
        lines = []

        def collect(data):
            nonlocal pending
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                lines.append(json.loads(line))
                if "progress" in lines[-1]:
                    gates[lines[-1]["progress"]["step"]].callback(None)

        await with_timeout(treq.collect(response, collect))
        assert lines == [{"progress": {"step": i}} for i in range(3)] + [
            {"reply": {"success": True}}]
        assert pending == b""
    finally:
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_client_disconnect_cancels_the_handler(verbs):
    started = defer.Deferred()
    cancelled = defer.Deferred()

    def long_tool(body):
        work = defer.Deferred(lambda d: cancelled.callback("cancelled"))
        started.callback(None)
        return work

    verbs.register("mcp.tools.execute", long_tool)
    site = build_worker_site(verbs, ControlAuth(None), lambda: None)
    port, base = listen(site)
    try:
        request = treq.post(base + "/v1/control/mcp/tools/execute", data=b"{}",
                            persistent=False)
        await with_timeout(started)
        request.cancel()  # closes the connection
        assert await with_timeout(cancelled) == "cancelled"
        with pytest.raises(Exception) as caught:
            await request
        assert "CancelledError" in repr(caught.value)
    finally:
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_bearer_auth_over_tcp(verbs):
    site = build_worker_site(verbs, ControlAuth("tok-123"), lambda: None)
    port, base = listen(site)
    try:
        assert (await post(base, "/v1/control/backend/list"))[0] == 401
        assert (await post(base, "/v1/control/backend/list",
                           headers={"Authorization": "Bearer tok-124"}))[0] == 401
        code, _, body = await post(base, "/v1/control/backend/list",
                                   headers={"Authorization": "Bearer tok-123"})
        assert (code, json.loads(body)) == (200, {"backends": []})
        response = await with_timeout(treq.get(base + "/healthz", persistent=False))
        assert response.code == 200
        await treq.content(response)
    finally:
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_site_served_on_a_connection_after_its_preamble(verbs):
    """No listener for the site: a protocol consumes the preamble and hands the rest over."""
    site = build_worker_site(verbs, ControlAuth(None), lambda: None)
    accepted = []
    factory = protocol.Factory.forProtocol(lambda: PreambleThenHTTP(site, accepted))
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")
    try:
        # treq through an endpoint that writes the preamble, as the stream dialer does
        agent = Agent.usingEndpointFactory(reactor, PreambleAgentFactory(port.getHost().port))
        client = treq.client.HTTPClient(agent)
        response = await with_timeout(client.post("http://node-a.invalid/v1/control/node/status",
                                                   data=b"{}"))
        assert response.code == 200
        assert json.loads(await treq.content(response))["node_name"] == "node-a"
        assert accepted[0].getPeer() == TunnelStreamAddress(accepted[0].transport.getPeer())

        # the preamble and the start of the request in one segment: leftover bytes replayed
        raw = (b"http\nPOST /v1/control/backend/list HTTP/1.1\r\nHost: w\r\n"
               b"Connection: close\r\nContent-Length: 2\r\n\r\n{}")
        client = await raw_exchange(port.getHost().port, raw[:60])
        await task.deferLater(reactor, 0.05, lambda: None)
        client.transport.write(raw[60:])
        received = await with_timeout(client.closed)
        assert received.startswith(b"HTTP/1.1 200 OK")
        assert received.endswith(b'{"backends": []}')
    finally:
        await port.stopListening()
