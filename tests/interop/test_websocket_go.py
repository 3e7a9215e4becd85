"""The WebSocket carrier against gorilla/websocket: bearer-token refusals before any upgrade,
and a clean WebSocket close both ways.  (The yamux tests in test_yamux_go.py also run over
WebSocket; these cover what only the carrier decides.)"""

from __future__ import annotations

import pytest
import pytest_twisted

from localai_tw.mux.errors import SessionEnded
from localai_tw.mux.session import Session
from tests.interop import ws_support
from tests.interop.support import EchoClient, within

pytestmark = pytest.mark.interop


@pytest_twisted.ensureDeferred
async def test_python_dial_with_wrong_token_gets_401_from_gorilla(gopeer):
    ws = ws_support.carrier()
    go = await gopeer.start("-role", "server", "-transport", "ws", "-token", "right",
                            "-ws-path", ws_support.WS_PATH)
    with pytest.raises(ws.HandshakeFailed) as info:
        await ws_support.python_ws_dial(go.port, lambda: Session(client=True), "wrong")
    assert info.value.status == 401
    ev = await go.wait_event("http_rejected")
    assert ev["authorization"] == "Bearer wrong"


@pytest_twisted.ensureDeferred
async def test_gorilla_dial_with_wrong_token_gets_401_from_our_resource(gopeer):
    port, first, sessions = ws_support.python_ws_server(lambda: Session(client=False), "right")
    try:
        go = await gopeer.start("-role", "client", "-transport", "ws", "-token", "wrong",
                                "-ws-path", ws_support.WS_PATH,
                                "-dial", f"127.0.0.1:{port.getHost().port}")
        await within(go.ended, 10, "Go to give up after the refusal")
        err = go.find("error")
        assert err and "401" in err[0]["msg"], go.describe()
        assert go.exit_code == 1 and sessions == []
    finally:
        await port.stopListening()


@pytest.mark.parametrize("py_client", [True, False], ids=["py-ws-client", "py-ws-server"])
@pytest_twisted.ensureDeferred
async def test_clean_websocket_close_both_ways(yamux_pair, py_client):
    # our close: go-away(0), WebSocket close 1000, Go reads a clean EOF
    pair = await yamux_pair.open(transport="ws", py_client=py_client)
    client = EchoClient(b"over websocket")
    pair.session.openStream(client)
    await within(client.done, 10, "echo over WebSocket")
    assert client.echo_ok()
    closed = pair.session.whenClosed()
    pair.session.loseConnection()
    assert isinstance(await within(closed, 5, "our end"), SessionEnded)
    ev = await pair.go.wait_event("session_closed")
    assert ev["read_eof"] is True and ev["frames_in"]["goaway_codes"] == [0], ev

    # Go's close: WebSocket close 1000 from gorilla, our session ends normally
    pair = await yamux_pair.open(transport="ws", py_client=py_client)
    closed = pair.session.whenClosed()
    pair.go.send("close")
    assert isinstance(await within(closed, 5, "end after Go's close"), SessionEnded)
