"""Stamp notices over an in-memory yamux pair (``iosim``, ``task.Clock``): the replica's
``StampNotices`` opens one ``stamped`` stream per tunnel whose worker takes notices, writes a
notice only for nodes a pass wrote, at most every ``NOTICE_EVERY`` (sooner on a status
change), and the worker's ``StreamRouter`` hands each to ``on_stamped``.  The registry is a
stand-in holding the real sessions (the real one is in tests/integration/
test_liveness_over_tunnel.py)."""

from __future__ import annotations

import pytest
from twisted.internet import task

from localai_tw import errors
from localai_tw.mux.testing import Recorder, connectedSessions
from localai_tw.tunnel import preamble
from localai_tw.tunnel.stampnotice import (
    MAX_STATUS,
    NOTICE_EVERY,
    NoticePhase,
    NoticeStream,
    StampNotices,
    encode_notice,
    parse_notice,
)
from localai_tw.worker.control import ControlAuth, ControlVerbs, build_worker_site
from localai_tw.worker.streams import StreamRouter

INTERVAL = 10.0


class Held:
    """The replica's sessions by node id, as ``TunnelRegistry`` answers for them."""

    def __init__(self):
        self.sessions = {}

    def session_for(self, node_id):
        return self.sessions.get(node_id)

    def open_stream(self, node_id, protocol, data=b""):
        return self.sessions[node_id].openStream(protocol, data)


class Tunnel:
    """One worker's tunnel: its real worker-side router and the replica's session."""

    def __init__(self, clock, takes_notices=True, serves_notices=True):
        site = build_worker_site(ControlVerbs(), ControlAuth(None), lambda: None)
        self.router = StreamRouter(site, None, clock)
        self.notices: list[str] = []
        if serves_notices:
            self.router.on_stamped = self.notices.append
        self.worker, self.replica, self.pump, _ = connectedSessions(
            client_acceptor=self.router.acceptor, clock=clock)
        self.replica.takes_stamp_notices = takes_notices


@pytest.fixture
def clock():
    return task.Clock()


def make(clock, **tunnels):
    held = Held()
    for node_id, tunnel in tunnels.items():
        held.sessions[node_id] = tunnel.replica
    return held, StampNotices(held, clock, INTERVAL, random_fraction=lambda: 0.0)


def flush(*tunnels):
    for tunnel in tunnels:
        tunnel.pump.flush()


def test_a_written_stamp_reaches_the_worker_and_the_next_waits_its_turn(clock):
    tunnel = Tunnel(clock)
    held, notices = make(clock, n1=tunnel)
    notices.stamped({"n1": "healthy"})
    flush(tunnel)
    assert tunnel.notices == ["healthy"] and notices.streams_opened == 1
    # Passes every 10 s: the next notice leaves when waiting one more pass would exceed 50 s.
    for _ in range(3):
        clock.advance(INTERVAL)
        notices.stamped({"n1": "healthy"})
        flush(tunnel)
    assert tunnel.notices == ["healthy"]
    clock.advance(INTERVAL)  # 40 s since the last: the pass after would be 50 s
    notices.stamped({"n1": "healthy"})
    flush(tunnel)
    assert tunnel.notices == ["healthy", "healthy"]
    assert notices.streams_opened == 1 and tunnel.replica.streamCount == 1


def test_tunnels_that_attached_together_take_their_notices_at_different_passes(clock):
    """A replica's restart: every tunnel attaches at once and gets its first notice at the same
    pass; their second comes 1 to 4 passes later by each one's phase, and each keeps its
    phase (a notice every 40 s), so no pass carries them all."""
    fractions = iter([0.0, 0.34, 0.67, 0.99] * 3)
    tunnels = {f"n{i}": Tunnel(clock) for i in range(12)}
    held = Held()
    held.sessions.update({node: tunnel.replica for node, tunnel in tunnels.items()})
    notices = StampNotices(held, clock, INTERVAL, random_fraction=lambda: next(fractions))
    everyone = dict.fromkeys(tunnels, "healthy")
    per_pass = []
    for _ in range(9):  # the first pass and 80 s more
        before = notices.sent
        notices.stamped(everyone)
        per_pass.append(notices.sent - before)
        for step in range(10):  # the tunnels' keepalive answered meanwhile
            clock.advance(INTERVAL / 10)
            flush(*tunnels.values())
    assert per_pass == [12, 3, 3, 3, 3, 3, 3, 3, 3]
    assert all(len(tunnel.notices) == 3 for tunnel in tunnels.values())


def test_a_status_change_is_noticed_at_once(clock):
    tunnel = Tunnel(clock)
    held, notices = make(clock, n1=tunnel)
    notices.stamped({"n1": "healthy"})
    flush(tunnel)
    clock.advance(INTERVAL)
    notices.stamped({"n1": "draining"})
    flush(tunnel)
    assert tunnel.notices == ["healthy", "draining"]


def test_only_the_nodes_a_pass_wrote_and_only_workers_that_take_notices(clock):
    taking, old_worker, fenced = Tunnel(clock), Tunnel(clock, takes_notices=False), Tunnel(clock)
    held, notices = make(clock, n1=taking, n2=old_worker, n3=fenced)
    notices.stamped({"n1": "healthy", "n2": "healthy"})  # n3's stamp was fenced out
    flush(taking, old_worker, fenced)
    assert taking.notices == ["healthy"]
    assert old_worker.notices == [] and old_worker.replica.streamCount == 0
    assert fenced.notices == [] and fenced.replica.streamCount == 0


def test_a_worker_that_refuses_is_not_asked_again_on_that_session(clock):
    tunnel = Tunnel(clock, serves_notices=False)  # says it takes them, serves no such stream
    held, notices = make(clock, n1=tunnel)
    notices.stamped({"n1": "healthy"})
    flush(tunnel)
    assert tunnel.replica.streamCount == 0
    for _ in range(10):
        clock.advance(INTERVAL)
        notices.stamped({"n1": "healthy"})
        flush(tunnel)
    assert notices.streams_opened == 1


def test_a_new_session_gets_a_new_stream_and_ended_ones_are_forgotten(clock):
    first, second = Tunnel(clock), Tunnel(clock)
    held, notices = make(clock, n1=first)
    notices.stamped({"n1": "healthy"})
    flush(first)
    held.sessions["n1"] = second.replica  # the worker redialled
    notices.stamped({"n1": "healthy"})
    flush(second)
    assert second.notices == ["healthy"] and notices.streams_opened == 2
    del held.sessions["n1"]  # the tunnel ended
    notices.stamped({})
    assert notices._noticed == {}


def test_a_notice_before_the_reply_is_held_and_written_once_accepted(clock):
    tunnel = Tunnel(clock)
    held, notices = make(clock, n1=tunnel)
    notices.stamped({"n1": "healthy"})
    clock.advance(0)
    stream = notices._noticed["n1"].stream
    assert stream.phase is NoticePhase.AWAITING_REPLY
    stream.send("draining")  # newer than the held one: only the latest is written
    flush(tunnel)
    assert stream.phase is NoticePhase.OPEN
    assert tunnel.notices == ["draining"]


def test_notices_split_and_joined_across_reads_all_arrive(clock):
    tunnel = Tunnel(clock)
    recorder = Recorder()
    tunnel.replica.openStream(recorder, preamble.encode_request(preamble.TAG_STAMPED, "-"))
    flush(tunnel)
    stream = next(iter(tunnel.replica._streams.values()))
    wire = encode_notice("healthy") + encode_notice("draining") + encode_notice("healthy")
    stream.write(wire[:1])
    flush(tunnel)
    stream.write(wire[1:12])
    flush(tunnel)
    stream.write(wire[12:])
    flush(tunnel)
    assert tunnel.notices == ["healthy", "draining", "healthy"]


@pytest.mark.parametrize("payload", [b"", b"two words", b"x" * (MAX_STATUS + 1), b"caf\xc3\xa9",
                                     b"nul\x00", b"line\n"])
def test_a_bad_notice_resets_its_stream_and_is_not_counted(clock, payload):
    tunnel = Tunnel(clock)
    recorder = Recorder()
    tunnel.replica.openStream(recorder, preamble.encode_request(preamble.TAG_STAMPED, "-"))
    flush(tunnel)
    stream = next(iter(tunnel.replica._streams.values()))
    stream.write(preamble.encode_frame(payload))
    flush(tunnel)
    assert tunnel.notices == []
    assert recorder.reason is not None  # reset by the worker
    assert tunnel.worker.isOpen  # the session is untouched
    with pytest.raises(errors.TunnelProtocolError):
        parse_notice(payload)


def test_encode_refuses_what_parse_would_refuse():
    assert parse_notice(encode_notice("healthy")[preamble.HEADER_SIZE:]) == "healthy"
    for status in ("", "two words", "x" * (MAX_STATUS + 1), "café"):
        with pytest.raises(ValueError):
            encode_notice(status)


def test_a_worker_that_writes_after_its_reply_loses_the_stream(clock):
    from twisted.internet.testing import StringTransport

    stream = NoticeStream()
    transport = StringTransport()
    stream.makeConnection(transport)
    stream.dataReceived(preamble.encode_accepted())
    assert stream.phase is NoticePhase.OPEN
    stream.dataReceived(b"\x00\x01x")
    assert stream.phase is NoticePhase.CLOSED
    assert transport.disconnecting or getattr(transport, "aborted", False)
    assert not stream.send("healthy")


def test_notice_every_leaves_room_inside_the_workers_refresh():
    from localai_tw.cluster.liveness import MAX_TUNNEL_LIVENESS
    from localai_tw.worker.service import CAPACITY_REFRESH_SECONDS

    # A notice leaves at the pass after which waiting would exceed NOTICE_EVERY; with the
    # longest pass interval allowed, a worker still hears one well before its refresh.
    assert NOTICE_EVERY + 1.0 < CAPACITY_REFRESH_SECONDS
    assert MAX_TUNNEL_LIVENESS < NOTICE_EVERY
