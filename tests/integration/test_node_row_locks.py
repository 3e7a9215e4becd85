"""A heartbeat batch and a liveness stamp on the same nodes, at once, never deadlock
(``cluster/rowlocks.py``), against a real PostgreSQL.

At 4000 idle workers PostgreSQL ended a heartbeat batch or a stamp with "deadlock detected"
every few seconds (the batch's heartbeats were answered 500): each statement locked the rows
in its own plan's order.  Here two connections run the two statements over the same 1000
nodes, each in a shuffled order, over and over; every statement must succeed and write every
node.
"""

from __future__ import annotations

import hashlib
import random

import pytest_twisted
from twisted.internet import defer, task

from localai_tw.cluster.liveness import stamp_liveness
from localai_tw.cluster.nodes import HeartbeatBatch, NodeStatus

from .harness_claims import make_live

NODES = 1000
ROUNDS = 12


async def _nodes(db) -> list[tuple[str, int, str]]:
    """(id, epoch, tunnel credential) of NODES healthy nodes, each held by replica-a."""
    await make_live(db, "replica-a")
    await db.runOperation(
        "INSERT INTO backend_nodes (id, name, status, approved, tunnel_token_hash)"
        " SELECT 'node-' || i, 'w' || i, 'healthy', true,"
        " encode(sha256(('secret-' || i)::bytea), 'hex') FROM generate_series(1, %s) AS i",
        (NODES,))
    await db.runOperation(
        "INSERT INTO node_connections (node_id, owner_instance_id, epoch, connected_at)"
        " SELECT id, 'replica-a', nextval('node_connection_epochs'), now() FROM backend_nodes")
    rows = await db.runQuery(
        "SELECT b.id, c.epoch FROM backend_nodes b JOIN node_connections c ON c.node_id = b.id")
    assert len(rows) == NODES
    return [(node, int(epoch), "secret-" + node.split("-", 1)[1]) for node, epoch in rows]


def _shuffled(items, seed):
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


@pytest_twisted.ensureDeferred
async def test_a_heartbeat_batch_and_a_stamp_on_the_same_nodes_never_deadlock(db):
    nodes = await _nodes(db)

    async def beats():
        batch = HeartbeatBatch(db, task.Clock(), max_batch=NODES)  # one statement a round
        for round_ in range(ROUNDS):
            answers = [batch.beat(n, secret) for n, _, secret in _shuffled(nodes, round_)]
            statuses = await defer.gatherResults(answers, consumeErrors=True)
            assert statuses == [NodeStatus.HEALTHY] * NODES

    async def stamps():
        for round_ in range(ROUNDS):
            claims = [(n, e) for n, e, _ in _shuffled(nodes, 1000 + round_)]
            assert len(await stamp_liveness(db, "replica-a", claims, 11.0)) == NODES

    # Two of each at once, on four connections of the pool: any two of them can meet.
    await defer.gatherResults([defer.ensureDeferred(work()) for work in
                               (beats, stamps, beats, stamps)], consumeErrors=True)
