"""The worker's dial loop on a ``task.Clock`` with a fake WebSocket dialler: the equal-jitter
schedule and its cap, the 30-second reset rule, the credential read per dial, no dial without a
credential, re-registration at most once per wait on 401/403, and stopping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import defer, error, task
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from localai_tw.tunnel import dialer as dialer_module
from localai_tw.tunnel.dialer import (
    DialState,
    TunnelDialer,
    backoff_ceiling,
    equal_jitter_delay,
    refusal_hint,
    websocket_url,
)
from localai_tw.tunnel.websocket import HandshakeFailed

# -- pure schedule ----------------------------------------------------------------------------------


def test_the_ceiling_doubles_from_half_a_second_to_the_30s_cap():
    assert [backoff_ceiling(a) for a in range(9)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]


@pytest.mark.parametrize("attempt", [64, 1023, 1024, 10**6, 2**70])
def test_a_huge_attempt_count_is_the_cap_without_overflow(attempt):
    assert backoff_ceiling(attempt) == 30.0
    assert equal_jitter_delay(attempt, 0.999) <= 30.0


@given(attempt=st.integers(min_value=0, max_value=10**9),
       fraction=st.floats(min_value=0.0, max_value=1.0))
def test_equal_jitter_stays_between_half_and_all_of_the_ceiling(attempt, fraction):
    d = backoff_ceiling(attempt)
    delay = equal_jitter_delay(attempt, fraction)
    assert d / 2 <= delay <= d
    assert delay <= 30.0


def test_the_jitter_source_picks_the_point_inside_the_bounds():
    assert equal_jitter_delay(3, 0.0) == 2.0
    assert equal_jitter_delay(3, 1.0) == 4.0
    assert equal_jitter_delay(3, 0.5) == 3.0


@pytest.mark.parametrize("base, node, url", [
    ("http://lb.example:8080", "n1", "ws://lb.example:8080/api/cluster/connect?id=n1"),
    ("https://lb.example", "n1", "wss://lb.example/api/cluster/connect?id=n1"),
    ("https://lb.example/prefix/", "n1", "wss://lb.example/prefix/api/cluster/connect?id=n1"),
    ("ws://lb.example/p", "n1", "ws://lb.example/p/api/cluster/connect?id=n1"),
    ("HTTP://lb.example?x=1#f", "a b&c", "ws://lb.example/api/cluster/connect?id=a%20b%26c"),
])
def test_the_tunnel_url_maps_the_scheme_and_appends_the_path(base, node, url):
    assert websocket_url(base, node) == url


@pytest.mark.parametrize("base", ["ftp://lb.example", "http://", "lb.example:8080"])
def test_a_url_that_cannot_be_dialled_is_a_configuration_error(base):
    with pytest.raises(ValueError):
        websocket_url(base, "n1")


def test_each_refusal_status_has_its_own_hint():
    assert "--node-name" in refusal_hint(401)
    assert "approv" in refusal_hint(403)
    assert "predates tunnels" in refusal_hint(404)
    assert "distributed" in refusal_hint(503)
    assert "418" in refusal_hint(418)
    assert "no HTTP answer" in refusal_hint(None)


# -- the loop -----------------------------------------------------------------------------------------


class FakeConnect:
    """Stands in for ``connectWebSocket``: records each dial; the test answers it."""

    def __init__(self):
        self.dials: list[dict] = []
        self.cancelled = 0

    def __call__(self, reactor, url, protocol_factory, headers):
        d = defer.Deferred(lambda _: setattr(self, "cancelled", self.cancelled + 1))
        self.dials.append({"url": url, "headers": dict(headers), "factory": protocol_factory,
                           "d": d})
        return d

    def accept(self, index=-1):
        """The frontend accepted: build the session and connect it to a memory transport."""
        dial = self.dials[index]
        session = dial["factory"]()
        session.makeConnection(StringTransport())
        dial["d"].callback(session)
        return session

    def refuse(self, status, index=-1):
        self.dials[index]["d"].errback(HandshakeFailed(status, f"refused {status}"))

    def unreachable(self, index=-1):
        self.dials[index]["d"].errback(error.ConnectionRefusedError())


class Credentials:
    def __init__(self, node_id="node-1", token="cred-1"):
        self.value = (node_id, token) if token else None
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return self.value


def make_dialer(clock, connect, credentials=None, reauthorize=None, fraction=1.0):
    return TunnelDialer(
        clock, "http://frontend.example:8080", credentials or Credentials(),
        lambda: (lambda stream: None), reauthorize=reauthorize, node_name="w1",
        connect=connect, random_fraction=lambda: fraction)


@pytest.fixture
def clock():
    return task.Clock()


def fail_n(clock, connect, dialer, n):
    """Let ``n`` dials fail as unreachable, advancing through each wait."""
    for _ in range(n):
        connect.unreachable()
        clock.advance(dialer.delays[-1])


def test_it_dials_at_once_with_the_credential_and_the_node_id(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect)
    dialer.startService()
    [dial] = connect.dials
    assert dial["url"] == "ws://frontend.example:8080/api/cluster/connect?id=node-1"
    # The worker says it pings every interval, so the frontend sends it no keepalive ping.
    assert dial["headers"] == {"Authorization": "Bearer cred-1",
                               "X-LocalAI-Keepalive": "worker-pings"}
    assert dialer.state is DialState.DIALING and not dialer.isConnected
    session = connect.accept()
    assert dialer.isConnected and dialer.readiness() is None
    assert session.client  # the worker is the yamux client
    dialer.stopService()


def test_failed_dials_back_off_doubling_to_the_cap(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect, fraction=1.0)
    dialer.startService()
    fail_n(clock, connect, dialer, 9)
    assert dialer.delays == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert len(connect.dials) == 10


def test_no_dial_happens_before_the_wait_is_over(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect, fraction=0.0)
    dialer.startService()
    connect.unreachable()
    assert dialer.delays == [0.25]
    clock.advance(0.2499)
    assert len(connect.dials) == 1
    clock.advance(0.0001)
    assert len(connect.dials) == 2


def test_readiness_says_why_while_not_connected(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect)
    dialer.startService()
    connect.refuse(503)
    reason = dialer.readiness()
    assert reason is not None and "503" in reason and "backing-off" in reason


def test_a_session_of_30s_resets_the_attempt_counter(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect, fraction=1.0)
    dialer.startService()
    fail_n(clock, connect, dialer, 5)
    assert dialer.attempt == 5
    session = connect.accept()
    clock.advance(30)
    session.connectionLost(Failure(error.ConnectionLost("frontend went away")))
    assert dialer.delays[-1] == 0.5
    assert dialer.attempt == 1


def test_a_short_session_does_not_reset_the_attempt_counter(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect, fraction=1.0)
    dialer.startService()
    fail_n(clock, connect, dialer, 5)
    session = connect.accept()
    clock.advance(29.9)
    session.connectionLost(Failure(error.ConnectionLost("frontend went away")))
    assert dialer.delays[-1] == 16  # the wait of attempt 5, as if the session never happened
    assert dialer.attempt == 6


def test_immediate_drops_after_connecting_keep_growing_the_wait(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect, fraction=1.0)
    dialer.startService()
    for _ in range(8):
        session = connect.accept()
        session.connectionLost(Failure(error.ConnectionDone()))
        clock.advance(dialer.delays[-1])
    assert dialer.delays == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_the_credential_is_read_again_on_every_dial(clock):
    connect = FakeConnect()
    credentials = Credentials(token="cred-1")
    dialer = make_dialer(clock, connect, credentials)
    dialer.startService()
    credentials.value = ("node-1", "cred-2")
    connect.refuse(401)
    clock.advance(dialer.delays[-1])
    assert [d["headers"]["Authorization"] for d in connect.dials] == [
        "Bearer cred-1", "Bearer cred-2"]


def test_without_a_credential_it_does_not_dial_until_told(clock):
    connect = FakeConnect()
    credentials = Credentials(token="")
    dialer = make_dialer(clock, connect, credentials)
    dialer.startService()
    clock.advance(3600)
    assert connect.dials == []
    assert dialer.state is DialState.NO_CREDENTIAL
    assert "no tunnel credential yet" in dialer.readiness()
    credentials.value = ("node-1", "cred-1")
    dialer.credentialsChanged()
    assert len(connect.dials) == 1


def test_an_empty_node_id_counts_as_no_credential(clock):
    connect = FakeConnect()
    credentials = Credentials()
    credentials.value = ("", "cred")
    dialer = make_dialer(clock, connect, credentials)
    dialer.startService()
    assert connect.dials == []


@pytest.mark.parametrize("status", [401, 403])
def test_a_401_or_403_re_registers_once_per_wait(clock, status):
    connect = FakeConnect()
    calls = []
    dialer = make_dialer(clock, connect, reauthorize=lambda: calls.append(1))
    dialer.startService()
    connect.refuse(status)
    assert len(calls) == 1
    clock.advance(dialer.delays[-1])
    connect.refuse(status)
    assert len(calls) == 2
    clock.advance(dialer.delays[-1])
    connect.unreachable()
    assert len(calls) == 2


def test_a_re_registration_still_running_is_not_started_again(clock):
    connect = FakeConnect()
    pending = []

    def reauthorize():
        d = defer.Deferred()
        pending.append(d)
        return d

    dialer = make_dialer(clock, connect, reauthorize=reauthorize)
    dialer.startService()
    connect.refuse(401)
    clock.advance(dialer.delays[-1])
    connect.refuse(401)
    assert len(pending) == 1  # the first is still running: it counts for this wait too
    pending[0].errback(RuntimeError("frontend down"))
    clock.advance(dialer.delays[-1])
    connect.refuse(401)
    assert len(pending) == 2


@pytest.mark.parametrize("status", [404, 409, 500, 503, None])
def test_other_refusals_are_retried_without_re_registering(clock, status):
    connect = FakeConnect()
    calls = []
    dialer = make_dialer(clock, connect, reauthorize=lambda: calls.append(1))
    dialer.startService()
    connect.refuse(status)
    assert dialer.last_status == status
    clock.advance(dialer.delays[-1])
    assert len(connect.dials) == 2
    assert calls == []


def test_stop_cancels_the_wait_and_dials_no_more(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect)
    dialer.startService()
    connect.unreachable()
    dialer.stopService()
    clock.advance(3600)
    assert len(connect.dials) == 1
    assert dialer.state is DialState.STOPPED


def test_stop_while_dialling_drops_a_session_that_opens_late(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect)
    dialer.startService()
    dial = connect.dials[0]
    dialer.stopService()
    assert connect.cancelled == 1
    # The WebSocket opens anyway (the cancel came during its handshake): no session is built.
    assert dial["factory"]() is None


def test_stop_closes_the_session_and_waits_for_the_carrier(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect)
    dialer.startService()
    session = connect.accept()
    stopped = dialer.stopService()
    assert not session.isOpen
    assert session.transport.disconnecting
    assert not stopped.called
    session.connectionLost(Failure(error.ConnectionDone()))
    assert stopped.called
    clock.advance(3600)
    assert len(connect.dials) == 1


def test_stop_aborts_a_carrier_that_does_not_close(clock):
    connect = FakeConnect()
    dialer = make_dialer(clock, connect)
    dialer.startService()
    connect.accept()
    stopped = dialer.stopService()
    clock.advance(dialer_module.STOP_CLOSE_TIMEOUT_SECONDS)
    assert stopped.called


def test_a_new_node_id_drops_the_session_of_the_old_one(clock):
    connect = FakeConnect()
    credentials = Credentials("node-1", "cred-1")
    dialer = make_dialer(clock, connect, credentials)
    dialer.startService()
    session = connect.accept()
    credentials.value = ("node-1", "cred-2")
    dialer.credentialsChanged()
    assert session.isOpen  # same node, rotated credential: the session stays
    credentials.value = ("node-2", "cred-3")
    dialer.credentialsChanged()
    assert not session.isOpen
    session.connectionLost(Failure(error.ConnectionDone()))
    clock.advance(dialer.delays[-1])
    assert connect.dials[-1]["url"].endswith("?id=node-2")


def test_the_credential_never_appears_in_logs(clock):
    from twisted.logger import formatEvent, globalLogPublisher

    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        connect = FakeConnect()
        dialer = make_dialer(clock, connect, Credentials("node-1", "SECRET-CRED"))
        dialer.startService()
        connect.refuse(401)
        clock.advance(dialer.delays[-1])
        session = connect.accept()
        session.connectionLost(Failure(error.ConnectionLost()))
        dialer.stopService()
    finally:
        globalLogPublisher.removeObserver(events.append)
    text = "\n".join(formatEvent(e) for e in events)
    assert "node-1" in text and "w1" in text
    assert "SECRET-CRED" not in text
    assert "backing off" in text and "tunnel connected" in text and "disconnected" in text
