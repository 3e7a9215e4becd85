"""Liveness carried by the tunnel, end to end: a real frontend replica (connect route, tunnel
registry, real PostgreSQL) and the worker's real dial loop over a real WebSocket and yamux.

The replica tells the worker in the upgrade's answer that it stamps its heartbeat
(``X-LocalAI-Liveness: tunnel``); the worker's dialer reports it (``livenessByTunnel``); the
replica's stamp (``cluster/liveness.py``) writes the held tunnel's heartbeat and stops once the
tunnel ended.  A replica that does not stamp says nothing, and the worker keeps its 10 s beat.  The stamps a
pass wrote are noticed to the workers that asked (``tunnel/stampnotice.py``).
"""

from __future__ import annotations

import pytest_twisted
from twisted.internet import reactor, task
from twisted.internet.task import deferLater

from localai_tw.cluster.ownership import OwnershipFence
from localai_tw.tunnel.dialer import TunnelDialer
from localai_tw.tunnel.liveness import TunnelLiveness
from localai_tw.tunnel.stampnotice import NOTICE_EVERY, StampNotices
from localai_tw.worker.control import ControlAuth, ControlVerbs, build_worker_site
from localai_tw.worker.streams import StreamRouter

from .harness_claims import heartbeat_age as _age, make_heartbeat_old as _make_old, make_live
from .support import eventually

LAG = 11.0


def _dialer(frontend, node_id, credential) -> TunnelDialer:
    return TunnelDialer(reactor, f"http://{frontend.address}", lambda: (node_id, credential),
                        lambda: (lambda stream: None), node_name="w1")


async def _stamp(stamper: TunnelLiveness) -> dict[str, str]:
    return await stamper.run_once()


@pytest_twisted.ensureDeferred
async def test_a_stamping_replica_says_so_and_stamps_its_tunnel_until_it_ends(db, frontends):
    frontend = await frontends("replica-a")
    frontend.registry.stamps_liveness = True
    registration = await frontend.nodes.register("w1", presented_token=frontend.token)
    node = registration.node.id
    stamper = TunnelLiveness(db, "replica-a", frontend.registry.live_claims, LAG, task.Clock())
    dialer = _dialer(frontend, node, registration.tunnel_credential)
    dialer.startService()
    try:
        await eventually(lambda: frontend.registry.holds(node) and dialer.isConnected,
                         what="the tunnel to attach")
        assert dialer.livenessByTunnel
        await _make_old(db, node, 600)
        assert await _stamp(stamper) == {node: "healthy"}
        assert LAG - 0.5 <= await _age(db, node) < LAG + 5

        await dialer.stopService()  # the tunnel ends: the replica stops vouching for it
        await eventually(lambda: not frontend.registry.holds(node), what="the detach")
        assert not dialer.livenessByTunnel
        await _make_old(db, node, 600)
        assert await _stamp(stamper) == {}
        assert await _age(db, node) >= 599
    finally:
        if dialer.running:
            await dialer.stopService()


@pytest_twisted.ensureDeferred
async def test_a_replica_that_does_not_stamp_says_nothing(db, frontends):
    frontend = await frontends("replica-a")  # stamps_liveness is off by default
    registration = await frontend.nodes.register("w1", presented_token=frontend.token)
    dialer = _dialer(frontend, registration.node.id, registration.tunnel_credential)
    dialer.startService()
    try:
        await eventually(lambda: dialer.isConnected, what="the tunnel to attach")
        assert not dialer.livenessByTunnel
    finally:
        await dialer.stopService()


def _noticed_worker(frontend, node_id, credential, takes_notices=True):
    """The worker's real dial loop and stream router; returns (dialer, notices heard)."""
    heard: list[str] = []
    site = build_worker_site(ControlVerbs(), ControlAuth(None), lambda: None)
    router = StreamRouter(site, None, reactor)
    router.on_stamped = heard.append
    dialer = TunnelDialer(reactor, f"http://{frontend.address}", lambda: (node_id, credential),
                          lambda: router.acceptor, node_name="w1",
                          takes_stamp_notices=takes_notices)
    return dialer, heard


@pytest_twisted.ensureDeferred
async def test_written_stamps_are_noticed_to_the_worker_over_its_tunnel(db, frontends):
    """A pass's written stamp reaches the worker as a notice carrying the node's status (a
    status change at once, the same status once per NOTICE_EVERY); a stamp fenced out sends
    nothing; a worker that did not ask gets no notice stream."""
    frontend = await frontends("replica-a")
    frontend.registry.stamps_liveness = True
    clock = task.Clock()
    # (the phase fixed: a session's second notice due 40 s after its first)
    notices = StampNotices(frontend.registry, clock, 10.0, random_fraction=lambda: 0.0)
    stamper = TunnelLiveness(db, "replica-a", frontend.registry.live_claims, LAG, clock,
                             on_stamped=notices.stamped)
    first = await frontend.nodes.register("w1", presented_token=frontend.token)
    old = await frontend.nodes.register("w2", presented_token=frontend.token)
    node, old_node = first.node.id, old.node.id
    dialer, heard = _noticed_worker(frontend, node, first.tunnel_credential)
    old_dialer, old_heard = _noticed_worker(frontend, old_node, old.tunnel_credential,
                                            takes_notices=False)
    dialer.startService()
    old_dialer.startService()
    try:
        await eventually(lambda: frontend.registry.holds(node) and dialer.isConnected
                         and frontend.registry.holds(old_node) and old_dialer.isConnected,
                         what="both tunnels to attach")
        assert await _stamp(stamper) == {node: "healthy", old_node: "healthy"}
        await eventually(lambda: heard == ["healthy"], what="the first notice")
        clock.advance(10)
        await _stamp(stamper)  # the same status, 10 s later: not yet due
        assert await frontend.nodes.drain(node)
        clock.advance(10)
        await _stamp(stamper)  # a status change: at once
        await eventually(lambda: heard == ["healthy", "draining"], what="the status change")
        assert old_heard == [] and frontend.registry.session_for(old_node).streamCount == 0

        await make_live(db, "replica-b")
        await OwnershipFence(db).claim(node, "replica-b")  # fenced out: nothing written
        clock.advance(NOTICE_EVERY)
        assert node not in await _stamp(stamper)
        await _stamp(stamper)
        await deferLater(reactor, 0.2)
        assert heard == ["healthy", "draining"] and notices.sent == 2
    finally:
        for each in (dialer, old_dialer):
            if each.running:
                await each.stopService()
