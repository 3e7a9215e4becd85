"""The frontend side of the stream preamble, over a StringTransport and a task.Clock."""

from __future__ import annotations

import pytest
from twisted.internet import defer, task
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.protocol import Protocol
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from localai_tw import errors
from localai_tw.tunnel import preamble
from localai_tw.tunnel.handshake import HANDSHAKE_BACKSTOP, PreambleClient


class Caller(Protocol):
    def __init__(self):
        self.received = b""
        self.made = False

    def connectionMade(self):
        self.made = True

    def dataReceived(self, data):
        self.received += data


def connected(deadline=None, relay=None, clock=None):
    clock = clock or task.Clock()
    caller = Caller()
    client = PreambleClient("node-1", "grpc", "127.0.0.1:50051", caller, clock, deadline,
                            relay=relay)
    transport = StringTransport()
    client.makeConnection(transport)
    return clock, caller, client, transport


def outcome(d: defer.Deferred):
    box = []
    d.addBoth(box.append)
    assert box, "the handshake has not settled"
    return box[0]


def test_request_is_written_and_ok_hands_over_the_bytes_after_it():
    clock, caller, client, transport = connected()
    assert transport.value() == preamble.encode_request("grpc", "127.0.0.1:50051")
    reply = preamble.encode_accepted() + b"\x00\x00\x00\x12HTTP/2 preface"
    client.dataReceived(reply[:1])
    client.dataReceived(reply[1:])
    assert outcome(client.whenReady()) is caller
    assert caller.made and caller.received == b"\x00\x00\x00\x12HTTP/2 preface"
    # The timer was cleared after ok: a quiet inference is not cut off.
    assert clock.getDelayedCalls() == []
    clock.advance(HANDSHAKE_BACKSTOP * 10)
    assert not transport.disconnecting


@pytest.mark.parametrize("code", ["unknown-tag", "unavailable", "bad-request"])
def test_evidence_refusals_are_the_workers_answer(code):
    _, _, client, transport = connected()
    client.dataReceived(preamble.encode_refused(code, "no such port"))
    result = outcome(client.whenReady())
    assert isinstance(result.value, errors.StreamRefused) and result.value.code == code
    assert not isinstance(result.value, errors.RoutingFact)  # never reported as no route
    assert transport.disconnecting


def test_not_served_is_a_routing_fact_not_evidence():
    _, _, client, _ = connected()
    client.dataReceived(preamble.encode_refused("not-served", "header timeout"))
    result = outcome(client.whenReady())
    assert isinstance(result.value, errors.WorkerUnroutable)
    assert not isinstance(result.value, errors.WorkerAnswer)


def test_unknown_code_is_a_protocol_error():
    _, _, client, transport = connected()
    client.dataReceived(preamble.encode_frame(b"err brand-new-code something"))
    result = outcome(client.whenReady())
    assert isinstance(result.value, errors.TunnelProtocolError)


def test_a_relay_reply_on_a_direct_stream_is_a_protocol_error():
    _, _, client, _ = connected()
    client.dataReceived(preamble.encode_relay_accepted())
    assert isinstance(outcome(client.whenReady()).value, errors.TunnelProtocolError)


@pytest.mark.parametrize("reason", [ConnectionDone(), ConnectionLost("reset")])
def test_stream_ending_before_the_reply_is_a_transport_failure(reason):
    _, _, client, _ = connected()
    client.dataReceived(b"\x00")  # half a length
    client.connectionLost(Failure(reason))
    result = outcome(client.whenReady())
    assert isinstance(result.value, errors.TransportFailure)
    assert not isinstance(result.value, (errors.WorkerAnswer, errors.RoutingFact))


def test_backstop_without_caller_deadline_is_a_transport_failure():
    clock, _, client, transport = connected()
    clock.advance(HANDSHAKE_BACKSTOP - 0.1)
    assert not client.whenReady().called
    clock.advance(0.2)
    result = outcome(client.whenReady())
    assert isinstance(result.value, errors.TransportFailure)


def test_caller_deadline_earlier_than_backstop_is_the_callers():
    clock = task.Clock()
    clock.advance(100)
    _, _, client, _ = connected(deadline=102.0, clock=clock)
    clock.advance(2.0)
    result = outcome(client.whenReady())
    assert isinstance(result.value, errors.CallerDeadlineExceeded)


def test_deadline_already_past_fails_without_waiting():
    clock = task.Clock()
    clock.advance(10)
    _, _, client, transport = connected(deadline=5.0, clock=clock)
    assert isinstance(outcome(client.whenReady()).value, errors.CallerDeadlineExceeded)


def test_cancel_after_the_deadline_blames_the_caller_and_before_it_is_a_cancel():
    clock = task.Clock()
    _, _, client, _ = connected(deadline=50.0, clock=clock)
    clock.advance(1)
    d = client.whenReady()
    d.cancel()
    assert outcome(d).check(defer.CancelledError)
    clock2 = task.Clock()
    _, _, client2, _ = connected(deadline=100.0, clock=clock2)
    clock2.advance(100.0)  # the timer fires exactly at the deadline
    assert isinstance(outcome(client2.whenReady()).value, errors.CallerDeadlineExceeded)


def test_relay_frames_are_pipelined_and_both_replies_read():
    _, caller, client, transport = connected(relay=("replica-b", "inference", 1500))
    assert transport.value() == (preamble.encode_relay_request("node-1", "inference", 1500)
                                 + preamble.encode_request("grpc", "127.0.0.1:50051"))
    client.dataReceived(preamble.encode_relay_accepted() + preamble.encode_accepted() + b"x")
    assert outcome(client.whenReady()) is caller
    assert caller.received == b"x"


@pytest.mark.parametrize("code", sorted(preamble.RELAY_REFUSAL_CODES))
def test_relay_refusals_are_routing_facts(code):
    _, _, client, _ = connected(relay=("replica-b", "inference", 0))
    client.dataReceived(preamble.encode_relay_refused(code, "why"))
    result = outcome(client.whenReady())
    assert isinstance(result.value, errors.WorkerUnroutable) and code in str(result.value)


def test_relayed_stream_lost_before_relay_reply_is_the_peer_not_the_worker():
    _, _, client, _ = connected(relay=("replica-b", "inference", 0))
    client.connectionLost(Failure(ConnectionLost("link died")))
    result = outcome(client.whenReady())
    assert isinstance(result.value, errors.PeerUnreachable)
    assert not isinstance(result.value, (errors.WorkerAnswer, errors.RoutingFact))


def test_relayed_stream_lost_after_relay_ok_is_a_transport_failure():
    _, _, client, _ = connected(relay=("replica-b", "inference", 0))
    client.dataReceived(preamble.encode_relay_accepted())
    client.connectionLost(Failure(ConnectionLost("link died")))
    assert isinstance(outcome(client.whenReady()).value, errors.TransportFailure)


def test_worker_stream_reply_must_not_be_read_as_relay_reply():
    _, _, client, _ = connected(relay=("replica-b", "inference", 0))
    client.dataReceived(preamble.encode_accepted())
    assert isinstance(outcome(client.whenReady()).value, errors.TunnelProtocolError)


def test_connection_lost_after_handoff_is_never_delivered_inside_lose_connection():
    """A protocol that closes its transport must not see connectionLost re-entrantly (Agent's
    HTTP11ClientProtocol.abort() would wait forever), even if the stream delivers it there."""
    clock = task.Clock()
    seen = []

    class Closer(Caller):
        def closeNow(self):
            self.transport.loseConnection()
            seen.append("after loseConnection")

        def connectionLost(self, reason):
            seen.append("connectionLost")

    class ReentrantTransport(StringTransport):
        def loseConnection(self):
            super().loseConnection()
            client.connectionLost(Failure(ConnectionDone()))  # as a yamux stream does

    caller = Closer()
    client = PreambleClient("node-1", "http", "", caller, clock)
    client.makeConnection(ReentrantTransport())
    client.dataReceived(preamble.encode_accepted())
    caller.closeNow()
    assert seen == ["after loseConnection"]
    clock.advance(0)
    assert seen == ["after loseConnection", "connectionLost"]
