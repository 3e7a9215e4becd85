"""Liveness carried by the tunnel, end to end: a real frontend replica (connect route, tunnel
registry, real PostgreSQL) and the worker's real dial loop over a real WebSocket and yamux.

The replica tells the worker in the upgrade's answer that it stamps its heartbeat
(``X-LocalAI-Liveness: tunnel``); the worker's dialer reports it (``livenessByTunnel``); the
replica's stamp (``cluster/liveness.py``) writes the held tunnel's heartbeat and stops once the
tunnel ended.  A replica that does not stamp says nothing, and the worker keeps its 10 s beat.
"""

from __future__ import annotations

import pytest_twisted
from twisted.internet import reactor, task

from localai_tw.tunnel.liveness import TunnelLiveness
from localai_tw.tunnel.dialer import TunnelDialer

from .harness_claims import heartbeat_age as _age, make_heartbeat_old as _make_old
from .support import eventually

LAG = 11.0


def _dialer(frontend, node_id, credential) -> TunnelDialer:
    return TunnelDialer(reactor, f"http://{frontend.address}", lambda: (node_id, credential),
                        lambda: (lambda stream: None), node_name="w1")


async def _stamp(stamper: TunnelLiveness) -> set[str]:
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
        assert await _stamp(stamper) == {node}
        assert LAG - 0.5 <= await _age(db, node) < LAG + 5

        await dialer.stopService()  # the tunnel ends: the replica stops vouching for it
        await eventually(lambda: not frontend.registry.holds(node), what="the detach")
        assert not dialer.livenessByTunnel
        await _make_old(db, node, 600)
        assert await _stamp(stamper) == set()
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
