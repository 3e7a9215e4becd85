"""TunnelRegistry ordering rules with a fence whose answers the test releases by hand.

The database behaviour itself is covered against real PostgreSQL in
tests/integration/test_tunnel_connect.py; here only the in-memory ordering is pinned (the gate,
claim-then-install, token-matched detach), which needs control over when each claim lands.
"""

from __future__ import annotations

import itertools

from twisted.internet import defer, task

from localai_tw.cluster.ownership import FencedOut
from localai_tw.tunnel.registry import NotHeldHere, TunnelRegistry, TunnelUnavailable
from localai_tw.mux.errors import SessionNotOpen


class HandFence:
    """claim/release return Deferreds the test fires; records every call."""

    def __init__(self):
        self.calls = []
        self.pending = []
        self._epochs = itertools.count(100)

    def claim(self, node_id, owner_id):
        d = defer.Deferred()
        self.calls.append(("claim", node_id))
        self.pending.append(("claim", node_id, d))
        return d

    def release(self, node_id, owner_id, epoch):
        self.calls.append(("release", node_id, epoch))
        return defer.succeed(None)

    def release_many(self, owner_id, claims):
        """The batch form a closing registry uses: every claim released, none fenced out."""
        self.calls += [("release", node_id, epoch) for node_id, epoch in claims]
        return defer.succeed({node_id for node_id, _ in claims})

    def land_next_claim(self):
        kind, node, d = self.pending.pop(0)
        d.callback(next(self._epochs))


class FakeSession:
    def __init__(self):
        self.isOpen = True
        self.streams = []
        self.bytesReceived = self.bytesSent = 0
        self._closed = defer.Deferred()

    def whenClosed(self):
        return self._closed

    def loseConnection(self):
        if self.isOpen:
            self.isOpen = False
            self._closed.callback(None)

    def openStream(self, protocol, data=b""):
        if not self.isOpen:
            raise SessionNotOpen("closed")
        self.streams.append(protocol)
        return protocol


def result_of(d):
    box = []
    d.addBoth(box.append)
    return box[0] if box else None


def test_two_attaches_of_one_node_cannot_cross_claim_and_install():
    fence, clock = HandFence(), task.Clock()
    registry = TunnelRegistry(fence, "replica-a", clock)
    first, second = FakeSession(), FakeSession()
    d1 = registry.attach("n1", first)
    d2 = registry.attach("n1", second)
    # The gate: the second claim is not even issued while the first is in flight.
    assert fence.calls == [("claim", "n1")]
    fence.land_next_claim()
    assert result_of(d1) == 100
    assert fence.calls == [("claim", "n1"), ("claim", "n1")]
    fence.land_next_claim()
    assert result_of(d2) == 101
    # The later claim is the installed one; the older session was closed after the gate.
    assert registry.session_for("n1") is second and registry.held("n1").claim_epoch == 101
    assert not first.isOpen and second.isOpen


def test_different_nodes_do_not_wait_for_each_other():
    fence = HandFence()
    registry = TunnelRegistry(fence, "replica-a", task.Clock())
    registry.attach("n1", FakeSession())
    registry.attach("n2", FakeSession())
    assert fence.calls == [("claim", "n1"), ("claim", "n2")]


def test_a_failed_claim_publishes_nothing_and_closes_the_session():
    fence = HandFence()
    registry = TunnelRegistry(fence, "replica-a", task.Clock())
    session = FakeSession()
    d = registry.attach("n1", session)
    fence.pending.pop(0)[2].errback(RuntimeError("db down"))
    assert result_of(d).check(RuntimeError)
    assert registry.held_nodes() == [] and not session.isOpen


def test_a_claim_that_outlives_its_bound_is_released_when_it_lands():
    fence, clock = HandFence(), task.Clock()
    registry = TunnelRegistry(fence, "replica-a", clock, claim_timeout=10)
    session = FakeSession()
    d = registry.attach("n1", session)
    clock.advance(10)
    assert result_of(d).check(defer.TimeoutError) and not session.isOpen
    fence.land_next_claim()
    assert ("release", "n1", 100) in fence.calls and registry.held_nodes() == []


def test_late_detach_of_a_replaced_holder_changes_nothing():
    fence = HandFence()
    registry = TunnelRegistry(fence, "replica-a", task.Clock())
    d1 = registry.attach("n1", FakeSession())
    fence.land_next_claim()
    d2 = registry.attach("n1", FakeSession())
    fence.land_next_claim()
    old_token, new_token = result_of(d1), result_of(d2)
    assert result_of(registry.detach("n1", old_token)) is False
    assert registry.held("n1").token == new_token
    assert [c for c in fence.calls if c[0] == "release"] == []
    assert result_of(registry.detach("n1", new_token)) is True
    assert fence.calls[-1] == ("release", "n1", new_token) and registry.held_nodes() == []


def test_fenced_out_release_is_normal():
    fence = HandFence()
    fence.release = lambda n, o, e: defer.fail(FencedOut(n, o))
    registry = TunnelRegistry(fence, "replica-a", task.Clock())
    d = registry.attach("n1", FakeSession())
    fence.land_next_claim()
    assert result_of(registry.detach("n1", result_of(d))) is True


def test_reclaim_keeps_the_token_and_moves_the_claim_epoch():
    fence = HandFence()
    registry = TunnelRegistry(fence, "replica-a", task.Clock())
    token = registry.attach("n1", FakeSession())
    fence.land_next_claim()
    token = result_of(token)
    reclaiming = registry.reclaim()
    fence.land_next_claim()
    assert result_of(reclaiming) == ["n1"]
    assert registry.held("n1").token == token and registry.held("n1").claim_epoch == 101
    registry.detach("n1", token)
    assert fence.calls[-1] == ("release", "n1", 101)  # the current claim is the one released


def test_open_stream_distinguishes_not_held_from_a_dead_session():
    fence = HandFence()
    registry = TunnelRegistry(fence, "replica-a", task.Clock())
    session = FakeSession()
    registry.attach("n1", session)
    fence.land_next_claim()
    try:
        registry.open_stream("n2", object())
    except NotHeldHere:
        pass
    else:
        raise AssertionError("expected NotHeldHere")
    session.isOpen = False
    try:
        registry.open_stream("n1", object())
    except TunnelUnavailable:
        pass
    else:
        raise AssertionError("a dead session must not read as 'not held here'")


def test_close_closes_sessions_releases_and_refuses_new_attaches():
    fence = HandFence()
    registry = TunnelRegistry(fence, "replica-a", task.Clock())
    session = FakeSession()
    registry.attach("n1", session)
    fence.land_next_claim()
    closing = registry.close()
    assert result_of(closing) is None
    assert not session.isOpen and ("release", "n1", 100) in fence.calls
    late = FakeSession()
    assert result_of(registry.attach("n2", late)) is not None and not late.isOpen
    assert registry.held_nodes() == []


def test_live_claims_list_open_sessions_with_their_current_epoch():
    """What the replica vouches for (cluster/liveness.py): an ended session whose detach has
    not run yet is not listed, and a re-claimed tunnel is listed with its new epoch."""
    fence = HandFence()
    registry = TunnelRegistry(fence, "replica-a", task.Clock())
    sessions = {node: FakeSession() for node in ("n1", "n2")}
    for node, session in sessions.items():
        registry.attach(node, session)
        fence.land_next_claim()
    assert sorted(registry.live_claims()) == [("n1", 100), ("n2", 101)]
    sessions["n2"].isOpen = False  # ended; its detach is still to come
    reclaiming = registry.reclaim()
    fence.land_next_claim()
    assert result_of(reclaiming) == ["n1"]
    assert registry.live_claims() == [("n1", 102)]
