"""WebSocket leg of the interop suite: our Autobahn carrier (localai_tw.tunnel.websocket) on the
Python side, gorilla/websocket on the Go side, binary messages, ``Authorization: Bearer``.

Imported lazily (only by WebSocket tests) so that the TCP tests do not depend on the carrier.
"""

from __future__ import annotations

from twisted.internet import defer, reactor
from twisted.web.resource import Resource
from twisted.web.server import Site

from tests.interop.support import sleep

WS_PATH = "/yamux"
DEFAULT_TOKEN = "interop-secret-token"


def carrier():
    """The module under test; a missing module fails the WebSocket tests with a clear message."""
    try:
        from localai_tw.tunnel import websocket
    except ImportError as exc:  # pragma: no cover - depends on the tree being complete
        import pytest

        pytest.fail(f"localai_tw.tunnel.websocket is not importable: {exc}", pytrace=False)
    return websocket


async def wait_open(session, timeout: float = 5.0) -> None:
    waited = 0.0
    while not session.isOpen:
        if waited >= timeout:
            raise AssertionError(f"session not open after {timeout:g}s")
        await sleep(0.02)
        waited += 0.02


def python_ws_server(make_session, token: str | None):
    """Serve our carrier at ``WS_PATH`` on 127.0.0.1:0.  Returns (listening port, Deferred
    firing with the first session once its carrier connected it, list of sessions)."""
    ws = carrier()
    first = defer.Deferred()
    sessions = []

    def protocol_factory(request, authorization):
        session = make_session()
        sessions.append(session)
        if not first.called:
            reactor.callLater(0, first.callback, session)
        return session

    authorizer = ws.BearerTokenAuthorizer(token) if token else (lambda request: None)
    root = Resource()
    root.putChild(WS_PATH.strip("/").encode(), ws.TunnelWebSocketResource(protocol_factory,
                                                                           authorizer))
    port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
    return port, first, sessions


async def python_ws_dial(port: int, make_session, token: str | None, path: str = WS_PATH):
    ws = carrier()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return await ws.connectWebSocket(reactor, f"ws://127.0.0.1:{port}{path}", make_session,
                                     headers=headers)


async def open_ws_pair(maker, py_client: bool, args: list[str], make_session, token):
    """Python dials Go's gorilla server when it is the yamux client, else Go dials ours."""
    from tests.interop.conftest import Pair

    token = DEFAULT_TOKEN if token is None else token
    if token and "-token" not in args:
        args = [*args, "-token", token]
    if py_client:
        go = await maker.launcher.start(*args, "-ws-path", WS_PATH)
        session = await python_ws_dial(go.port, make_session, token)
        await wait_open(session)
        return Pair(session, go)
    port, first, _sessions = python_ws_server(make_session, token)
    maker.cleanups.append(port.stopListening)
    go = await maker.launcher.start(*args, "-ws-path", WS_PATH,
                                    "-dial", f"127.0.0.1:{port.getHost().port}")
    session = await first.addTimeout(10, reactor)
    await wait_open(session)
    return Pair(session, go, port)
