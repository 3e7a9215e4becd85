"""localai_tw.mux against Go's hashicorp/yamux (Debian df201c7) on real sockets on 127.0.0.1.

Each test runs over plain TCP and over WebSocket (our Autobahn carrier on the Python side,
gorilla/websocket on the Go side, binary messages, bearer token), and starts its own Go peer
(``gopeer/main.go``); see ``support.py`` for the echo conventions (Go echoes only after our FIN;
we echo Go's streams as bytes arrive).
"""

from __future__ import annotations

import hashlib
import os
import signal

import pytest
import pytest_twisted

from localai_tw.mux.errors import (
    KeepaliveTimeout,
    SessionEnded,
    SessionFailed,
    SessionNotOpen,
    StreamClosed,
    StreamReset,
)
from localai_tw.mux.session import SessionConfig
from tests.interop.support import (
    KiB,
    MiB,
    EchoClient,
    EchoVerifier,
    PausedSink,
    eventually,
    sleep,
    within,
)

pytestmark = pytest.mark.interop

@pytest.fixture(params=["tcp", "ws"])
def transport(request):
    return request.param


ROLES = [pytest.param(True, id="py-client-go-server"),
         pytest.param(False, id="py-server-go-client")]


def echo_acceptor(registry):
    return lambda stream: EchoVerifier(registry)


async def python_echo_round(pair, payloads, timeout=30.0):
    """Python opens one stream per payload to Go's echo; checks every echo and Go's report."""
    clients = [EchoClient(p) for p in payloads]
    streams = [pair.session.openStream(c) for c in clients]
    ids = [s.id for s in streams]
    assert len(set(ids)) == len(ids)
    parity = 1 if pair.session.client else 0
    assert all(i % 2 == parity for i in ids), ids
    for c in clients:
        await within(c.done, timeout, f"echo of {len(c.payload)} bytes")
    for c, sid in zip(clients, ids):
        assert c.echo_ok(), (sid, c.received, len(c.payload), c.reason)
        assert c.reason.check(StreamClosed), (sid, c.reason)
        ev = await pair.go.wait_event("echoed", id=sid)
        assert "err" not in ev, ev
        assert ev["bytes"] == len(c.payload)
        assert ev["sha256"] == hashlib.sha256(c.payload).hexdigest()  # Go's checksum of our bytes
    return clients


async def go_echo_round(pair, registry, n, size, tag, timeout=30.0):
    """Go opens ``n`` streams carrying ``size`` bytes each; Python echoes and checks sha256."""
    mark = len(pair.go.events)
    before = len(registry)
    pair.go.send("open", n=n, size=size, tag=tag)
    done = await pair.go.wait_event("open_done", tag=tag, after=mark, timeout=timeout)
    results = pair.go.find("open_result", after=mark, tag=tag)
    bad = [r for r in results if not r["ok"]]
    assert done["ok"] == n and not bad, (done, bad[:3], pair.go.describe())
    mine = registry[before:]
    assert len(mine) == n
    for v in mine:
        await within(v.done, 10, "Python echo side to finish")
        assert v.checksum_ok, (v.length, v.received)
        assert v.reason.check(StreamClosed), v.reason
    go_parity = 0 if pair.session.client else 1
    assert all(r["id"] % 2 == go_parity for r in results), [r["id"] for r in results]
    return results


# -- streams from both sides ------------------------------------------------------------------


@pytest.mark.parametrize("py_client", ROLES)
@pytest_twisted.ensureDeferred
async def test_streams_opened_from_both_sides(yamux_pair, transport, py_client):
    registry = []
    pair = await yamux_pair.open(transport=transport, py_client=py_client,
                                 acceptor=echo_acceptor(registry))
    sizes = [0, 1, 3, 4096, 65536, 256 * KiB, 256 * KiB + 1, 700 * KiB]
    payloads = [os.urandom(s) for s in sizes]
    await python_echo_round(pair, payloads)
    await go_echo_round(pair, registry, n=8, size=300 * KiB, tag="both")
    # both directions at the same time
    d_go = go_echo_round(pair, registry, n=5, size=200 * KiB, tag="mixed")
    await python_echo_round(pair, [os.urandom(200 * KiB) for _ in range(5)])
    await d_go
    assert pair.session.isOpen
    stats = await pair.go.stats()
    assert not stats["closed"] and stats["num_streams"] == 0, stats
    assert stats["frames_in"].get("rst", 0) == 0 and stats["frames_out"].get("rst", 0) == 0


@pytest.mark.parametrize("py_client", ROLES)
@pytest_twisted.ensureDeferred
async def test_hundred_concurrent_1mib_streams_each_way(yamux_pair, transport, py_client):
    """100 Python-opened and 100 Go-opened streams of 1 MiB, all at once, sha256 checked by
    both ends."""
    registry = []
    pair = await yamux_pair.open(transport=transport, py_client=py_client,
                                 acceptor=echo_acceptor(registry))
    base = os.urandom(MiB)
    payloads = [i.to_bytes(4, "big") + base[4:] for i in range(100)]
    d_go = go_echo_round(pair, registry, n=100, size=MiB, tag="hundred", timeout=90)
    await python_echo_round(pair, payloads, timeout=90)
    results = await d_go
    assert len({r["sha256"] for r in results}) == 100
    # Go reports its round done once it has read every echo, and only then sends its FINs for
    # the streams it opened: our side forgets those streams when the FINs arrive, a few frames
    # later.  Every stream must be forgotten, with the session still open.
    await eventually(lambda: pair.session.streamCount == 0, 10,
                     "every stream forgotten after both rounds")
    assert pair.session.isOpen


# -- half close ---------------------------------------------------------------------------------


@pytest.mark.parametrize("py_client", ROLES)
@pytest_twisted.ensureDeferred
async def test_half_close_then_read_echo(yamux_pair, transport, py_client):
    pair = await yamux_pair.open(transport=transport, py_client=py_client)
    payload = os.urandom(600 * KiB)   # more than one window each way
    client = EchoClient(payload, autostart=False, keep=True)
    stream = pair.session.openStream(client)
    stream.write(payload)
    await sleep(0.2)
    assert client.received == 0       # Go echoes only after our FIN
    stream.loseWriteConnection()
    await within(client.eof, 15, "Go's echo and FIN after our half-close")
    assert client.write_lost, "writeConnectionLost was not delivered after loseWriteConnection"
    assert client.read_eof, "readConnectionLost was not delivered for Go's FIN"
    assert bytes(client.data) == payload
    await within(client.done, 5, "connectionLost after FIN both ways")
    assert client.reason.check(StreamClosed), client.reason
    ev = await pair.go.wait_event("echoed", id=stream.id)
    assert ev["bytes"] == len(payload) and "err" not in ev
    stats = await pair.go.stats()
    assert stats["num_streams"] == 0, stats   # Go forgot the stream: FIN went both ways


# -- go-away ----------------------------------------------------------------------------------


@pytest.mark.parametrize("py_client", ROLES)
@pytest_twisted.ensureDeferred
async def test_go_goaway_stops_python_opens_existing_stream_finishes(yamux_pair, transport,
                                                                    py_client):
    pair = await yamux_pair.open(transport=transport, py_client=py_client)
    payload = os.urandom(400 * KiB)
    client = EchoClient(payload, autostart=False)
    stream = pair.session.openStream(client)
    stream.write(payload[:100 * KiB])
    await pair.go.wait_event("accepted", id=stream.id)

    pair.go.send("goaway")
    ev = await pair.go.wait_event("goaway_sent")
    assert ev["err"] is None
    # Go queued go-away before it could see our ping: the pong comes after it on the wire.
    await within(pair.session.ping(), 5, "pong after go-away")
    assert pair.session.remoteGoAway
    with pytest.raises(SessionNotOpen):
        pair.session.openStream(EchoClient(b"x"))

    stream.write(payload[100 * KiB:])
    stream.loseWriteConnection()
    await within(client.done, 15, "the existing stream to finish after go-away")
    assert client.reason.check(StreamClosed), client.reason
    assert client.echo_ok(), (client.received, len(payload), pair.go.find("echoed"))
    assert pair.session.isOpen
    stats = await pair.go.stats()
    assert stats["frames_in"].get("syn", 0) == 1, stats   # no SYN after go-away reached Go
    assert not stats["closed"]


@pytest.mark.parametrize("py_client", ROLES)
@pytest_twisted.ensureDeferred
async def test_python_goaway_then_close_is_clean_end_for_go(yamux_pair, transport, py_client):
    registry = []
    pair = await yamux_pair.open(transport=transport, py_client=py_client,
                                 acceptor=echo_acceptor(registry))
    client = EchoClient(os.urandom(300 * KiB), autostart=False)
    stream = pair.session.openStream(client)
    stream.write(client.payload[:1000])

    pair.session.goAway()
    await within(pair.session.ping(), 5, "pong after our go-away")   # Go has read it
    pair.go.send("open", n=1, size=10, tag="after-goaway")
    failed = await pair.go.wait_event("open_failed", tag="after-goaway")
    assert "not accepting" in failed["err"], failed         # Go's ErrRemoteGoAway
    assert registry == []

    stream.write(client.payload[1000:])                       # existing stream goes on
    stream.loseWriteConnection()
    await within(client.done, 15, "existing stream after our go-away")
    assert client.echo_ok()

    closed = pair.session.whenClosed()
    pair.session.loseConnection()
    ending = await within(closed, 5, "our session to end")
    assert isinstance(ending, SessionEnded), ending
    ev = await pair.go.wait_event("session_closed")
    assert ev["frames_in"]["goaway_codes"] == [0], ev        # exactly one go-away(0)
    assert ev["read_eof"] is True, ev                          # a clean EOF, not a reset
    assert not pair.go.find("yamux_log", pred=lambda e: "[ERR]" in e["msg"]), pair.go.describe()
    await within(pair.go.ended, 5, "Go peer to exit")
    assert pair.go.exit_code == 0


@pytest.mark.parametrize("py_client", ROLES)
@pytest_twisted.ensureDeferred
async def test_go_close_without_goaway_is_clean_end_for_python(yamux_pair, transport, py_client):
    pair = await yamux_pair.open(transport=transport, py_client=py_client)
    closed = pair.session.whenClosed()
    pair.go.send("close")
    ending = await within(closed, 5, "session end after Go's Close()")
    assert isinstance(ending, SessionEnded), ending
    with pytest.raises(SessionNotOpen):
        pair.session.openStream(EchoClient(b"x"))


# -- keepalive -------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_keepalive_pings_answered_both_ways(yamux_pair, transport):
    config = SessionConfig(keepalive_interval=0.1, keepalive_timeout=0.5)
    pair = await yamux_pair.open(transport=transport, py_client=True, config=config,
                                 go_args=["-keepalive", "100ms", "-write-timeout", "500ms"])
    await sleep(1.5)
    stats = await pair.go.stats()
    fin, fout = stats["frames_in"], stats["frames_out"]
    assert not stats["closed"] and pair.session.isOpen, pair.go.describe()
    # Go's keepalive pings, answered by Python
    assert fout.get("ping_req", 0) >= 8 and fin.get("ping_ack", 0) >= fout["ping_req"] - 1, stats
    # Python's keepalive pings, answered by Go
    assert fin.get("ping_req", 0) >= 8 and fout.get("ping_ack", 0) >= fin["ping_req"] - 1, stats
    rtt = await within(pair.session.ping(), 2, "explicit ping")
    assert 0 <= rtt < 1
    mark = len(pair.go.events)
    pair.go.send("ping")
    await pair.go.wait_event("pong", after=mark, timeout=2)


@pytest_twisted.ensureDeferred
async def test_keepalive_timeout_when_go_is_stopped(yamux_pair, transport):
    config = SessionConfig(keepalive_interval=0.2, keepalive_timeout=0.5)
    pair = await yamux_pair.open(transport=transport, py_client=True, config=config)
    client = EchoClient(b"hello", half_close=False)
    stream = pair.session.openStream(client)
    await pair.go.wait_event("accepted", id=stream.id)
    closed = pair.session.whenClosed()
    pair.go.signal(signal.SIGSTOP)
    try:
        ending = await within(closed, 5, "KeepaliveTimeout while Go is stopped")
    finally:
        pair.go.signal(signal.SIGCONT)
    assert isinstance(ending, KeepaliveTimeout), ending
    assert ending.timeout == pytest.approx(0.5)
    await within(client.done, 2, "the open stream to learn about the session end")
    assert client.reason.check(SessionFailed) and isinstance(client.reason.value, KeepaliveTimeout)
    await pair.go.wait_event("session_closed", timeout=5)


@pytest_twisted.ensureDeferred
async def test_go_keepalive_ends_session_when_python_stops_reading(yamux_pair, transport):
    pair = await yamux_pair.open(transport=transport, py_client=True,
                                 go_args=["-keepalive", "100ms", "-write-timeout", "300ms"])
    await sleep(0.3)
    pair.session.transport.pauseProducing()   # we read nothing: Go's pings go unanswered
    ev = await pair.go.wait_event("session_closed", timeout=5)
    assert pair.go.find("yamux_log", pred=lambda e: "keepalive" in e["msg"]), pair.go.describe()
    closed = pair.session.whenClosed()
    pair.session.transport.resumeProducing()
    ending = await within(closed, 5, "our session to notice Go's close")
    assert isinstance(ending, (SessionEnded, SessionFailed)), ending
    assert ev["closed"]


# -- flow control -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_window", [256 * KiB, MiB], ids=["window-256k", "window-1m"])
@pytest_twisted.ensureDeferred
async def test_paused_python_stream_stops_go_writer_at_window(yamux_pair, transport, max_window):
    sinks = []

    def acceptor(stream):
        sink = PausedSink()
        sinks.append(sink)
        return sink

    pair = await yamux_pair.open(transport=transport, py_client=True, acceptor=acceptor,
                                 config=SessionConfig(max_window=max_window))
    size = max_window + MiB
    pair.go.send("write", size=size, chunk=4096, tag="w")
    stalled = await pair.go.wait_event("write_stalled", tag="w", timeout=10)
    assert stalled["written"] == max_window, stalled
    assert len(sinks) == 1 and sinks[0].received == 0
    await sleep(0.5)
    stats = await pair.go.stats()
    assert stats["writers"]["w"] == max_window, stats        # still exactly the window
    assert pair.session.isOpen

    sinks[0].transport.resumeProducing()
    done = await pair.go.wait_event("write_done", tag="w", timeout=15)
    assert done["written"] == size and "err" not in done, done
    await within(sinks[0].done, 10, "Go's FIN after the 1 MiB")
    assert sinks[0].received == size
    assert sinks[0].sha256 == done["sha256"]
    assert sinks[0].reason.check(StreamClosed), sinks[0].reason


class WindowWatchingSink(PausedSink):
    """A ``PausedSink`` that notes the largest receive window its stream reached."""

    largest_window = 0

    def dataReceived(self, data):
        super().dataReceived(data)
        self.largest_window = max(self.largest_window, self.transport._window)


@pytest_twisted.ensureDeferred
async def test_auto_tuned_window_grows_against_a_go_writer(yamux_pair, transport):
    """Grown windows are plain, larger window-update deltas: Go's writer uses them, every byte
    arrives in order (sha256 on both ends), and Go's reader-side checks see no violation."""
    sinks = []

    def acceptor(stream):
        sink = WindowWatchingSink()
        sinks.append(sink)
        return sink

    pair = await yamux_pair.open(transport=transport, py_client=True, acceptor=acceptor,
                                 config=SessionConfig(auto_window=4 * MiB, rtt_max_age=3600))
    # As far as the rule can tell this is a very long link: every full epoch grows the window,
    # whatever the loopback's real round trip (no timing in the assertion).
    pair.session._rttSample(10.0)
    pair.session._rttSample = lambda rtt: None  # the loopback's own samples would replace it
    size = 48 * MiB
    pair.go.send("write", size=size, chunk=65536, tag="w")
    await eventually(lambda: sinks, 10, "Go's stream to arrive")
    sinks[0].transport.resumeProducing()
    done = await pair.go.wait_event("write_done", tag="w", timeout=60)
    assert done["written"] == size and "err" not in done, done
    await within(sinks[0].done, 30, "Go's FIN after the transfer")
    assert sinks[0].received == size
    assert sinks[0].sha256 == done["sha256"]
    assert sinks[0].largest_window == 4 * MiB
    assert pair.session._flow.extra == 0  # the stream ended: its share went back
    stats = await pair.go.stats()
    assert not stats["closed"] and stats["frames_in"].get("rst", 0) == 0, stats
    assert pair.session.isOpen


# -- refusal ----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_python_refusal_is_a_reset_for_go(yamux_pair, transport):
    pair = await yamux_pair.open(transport=transport, py_client=True,
                                 acceptor=lambda stream: None)
    pair.go.send("open", n=1, size=1000, tag="refused")
    res = await pair.go.wait_event("open_result", tag="refused")
    assert not res["ok"] and "reset" in res.get("err", ""), res
    assert pair.go.find("frame_in", type="rst"), pair.go.describe()
    assert pair.session.isOpen
    await python_echo_round(pair, [b"still fine"])


@pytest_twisted.ensureDeferred
async def test_go_refuses_after_its_goaway_python_stream_reset(yamux_pair, transport):
    """A SYN racing Go's go-away is answered with RST: the stream ends StreamReset(remote)."""
    pair = await yamux_pair.open(transport=transport, py_client=True)
    pair.session.transport.pauseProducing()     # we do not read Go's go-away yet
    pair.go.send("goaway")
    await pair.go.wait_event("goaway_sent")
    client = EchoClient(b"raced")
    pair.session.openStream(client)             # the SYN crosses Go's go-away
    pair.session.transport.resumeProducing()
    await within(client.done, 5, "RST from Go for a SYN after its go-away")
    assert client.reason.check(StreamReset) and client.reason.value.remote, client.reason
    assert pair.session.remoteGoAway and pair.session.isOpen


@pytest_twisted.ensureDeferred
async def test_no_empty_data_frames_when_the_send_window_runs_out(yamux_pair, transport):
    """Writing more than the peer's window must queue, not emit Data frames of length 0 with no
    flags (pure overhead; a loop of them floods the carrier while the window is exhausted)."""
    pair = await yamux_pair.open(transport=transport, py_client=True)
    await python_echo_round(pair, [os.urandom(MiB)])
    stats = await pair.go.stats()
    empty = stats["frames_in"].get("data_empty_noflags", 0)
    assert empty == 0, (f"{empty} empty flagless Data frames reached Go for one 1 MiB stream "
                        f"(data frames total: {stats['frames_in'].get('data')})")


# -- FIN placement (Go df201c7 race) -----------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_fin_goes_on_its_own_frame_not_on_the_last_data_frame(yamux_pair, transport):
    """Go df201c7 handles a Data frame's FIN *before* it buffers that frame's payload
    (``Stream.readData``: ``processFlags`` then ``io.Copy`` into ``recvBuf``).  A Go reader
    blocked in ``Read`` is woken by the FIN, finds the buffer empty and returns EOF: the bytes of
    the FIN-carrying frame are lost (see the slow test below, and docs/interop.md).  Go itself
    always sends FIN as a separate zero-length window update; so must we, to interoperate.

    Deterministic check on the wire: Go's frame tap counts Data frames with FIN and payload.
    """
    registry = []
    pair = await yamux_pair.open(transport=transport, py_client=True,
                                 acceptor=echo_acceptor(registry))
    clients = [EchoClient(os.urandom(size)) for size in (10, 100 * KiB, 300 * KiB)]
    for c in clients:
        pair.session.openStream(c)
    mark = len(pair.go.events)
    pair.go.send("open", n=3, size=300 * KiB, tag="fin")
    await pair.go.wait_event("open_done", tag="fin", after=mark, timeout=20)
    for c in clients:
        await within(c.done, 20, "echo")
    stats = await pair.go.stats()
    with_payload = stats["frames_in"].get("data_fin_with_payload", 0)
    assert with_payload == 0, (
        f"{with_payload} Data frame(s) carried FIN together with payload; Go df201c7 may drop "
        f"that payload (FIN processed before the bytes are buffered). frames_in={stats}")
    assert stats["frames_in"].get("fin", 0) >= 6


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_go_df201c7_drops_payload_of_fin_carrying_frame_repro(yamux_pair):
    """Statistical reproduction of the data loss behind the test above: Go opens 8 streams of
    300 KiB per round; we echo and close.  Our echo's last frame carries FIN; when Go's reader
    is blocked at that moment Go reads EOF early (observed: 262,144 of 307,240 bytes).  It is a
    race: most runs hit it within 40 rounds, some pass by luck; the deterministic check is the
    test above."""
    registry = []
    pair = await yamux_pair.open(transport="tcp", py_client=True,
                                 acceptor=echo_acceptor(registry))
    for rnd in range(40):
        mark = len(pair.go.events)
        tag = f"r{rnd}"
        pair.go.send("open", n=8, size=300 * KiB, tag=tag)
        await pair.go.wait_event("open_done", tag=tag, after=mark, timeout=20)
        bad = [r for r in pair.go.find("open_result", after=mark, tag=tag) if not r["ok"]]
        assert not bad, (f"round {rnd}: Go lost echoed bytes", bad[0])
