"""Credentials at the real frontends' doors (raw HTTP, no client library in between).

Refusals must happen before any upgrade: the answer is the refusal status and never ``101``.
Every refusal is paired with a control that the same door does upgrade with the right
credential, so a door that refuses everything would fail here.
"""

from __future__ import annotations

import hashlib
import time
import uuid

from .harness import raw_exchange, request, status_of, upgrade_request, wait_for


def _key_of(name: str) -> str:
    """The node key these tests register ``name`` with (a worker keeps its own on disk)."""
    return hashlib.sha256(b"e2e node key " + name.encode()).hexdigest()


def _register(cluster, fe, name: str, token: str | None = None, key: str | None = None):
    return request("POST", fe.port, "/api/node/register",
                   {"name": name, "node_type": "backend", "node_key": key or _key_of(name)},
                   headers={"Authorization": f"Bearer {token or cluster.token}"})


def _connect(fe, node_id: str, bearer: str | None) -> int:
    return status_of(raw_exchange(fe.port, upgrade_request(f"/api/cluster/connect?id={node_id}",
                                                           bearer)))


def test_connect_and_peer_doors_refuse_before_any_upgrade(make_cluster):
    cluster = make_cluster()
    f0 = cluster.start_frontend(probe=False)
    f1 = cluster.start_frontend(probe=False, require_approval=True)

    # registration itself needs the shared token
    assert _register(cluster, f0, "intruder", token="wrong-token").status == 401

    answer = _register(cluster, f0, "auth-a")
    assert answer.status == 201, answer.body
    node, first = answer.json()["id"], answer.json()["tunnel_token"]

    # unauthenticated, wrong credential, unknown node: 401, no upgrade
    assert _connect(f0, node, None) == 401
    assert _connect(f0, node, "not-the-credential") == 401
    assert _connect(f0, str(uuid.uuid4()), first) == 401
    # control: the right credential upgrades (at either replica)
    assert _connect(f0, node, first) == 101
    assert _connect(f1, node, first) == 101

    # a rotated credential (same name registered again) stops the old one at once
    again = _register(cluster, f0, "auth-a")
    assert again.status == 201 and again.json()["id"] == node
    second = again.json()["tunnel_token"]
    assert second != first
    assert _connect(f0, node, first) == 401
    assert _connect(f1, node, first) == 401
    assert _connect(f0, node, second) == 101
    # the shared token and the name without the node's key: 409, and nothing rotated
    taken = _register(cluster, f1, "auth-a", key=_key_of("someone-else"))
    assert taken.status == 409 and b"node_name_taken" in taken.body, taken.body
    assert _connect(f1, node, second) == 101

    # a pending node (registered at the replica that requires approval) gets 403 everywhere
    pending = _register(cluster, f1, "auth-pending")
    assert pending.status == 201 and pending.json()["status"] == "pending", pending.body
    pid, ptoken = pending.json()["id"], pending.json()["tunnel_token"]
    assert _connect(f0, pid, ptoken) == 403
    assert _connect(f1, pid, ptoken) == 403
    assert _connect(f1, pid, "wrong") == 401  # the credential is checked first
    assert cluster.admin(f0, "POST", f"/api/nodes/{pid}/approve").status == 200
    assert _connect(f1, pid, ptoken) == 101

    # a peer presenting only the shared registration token is rejected
    for fe, other in ((f0, f1), (f1, f0)):
        path = f"/api/cluster/peer?id={other.instance_id}"
        only_shared = raw_exchange(fe.port, upgrade_request(path, cluster.token))
        assert status_of(only_shared) in (401, 403), only_shared
        forged = raw_exchange(fe.port, upgrade_request(
            path, cluster.token, {"X-LocalAI-Peer-Token": "forged-peer-secret"}))
        assert status_of(forged) in (401, 403), forged
        anonymous = raw_exchange(fe.port, upgrade_request(path))
        assert status_of(anonymous) == 401, anonymous
    # (the control for the peer door is the relay itself, which test_topology_and_relay and
    # test_negative_control exercise between these same real processes)


def test_rotated_credential_drops_the_live_tunnel_and_the_worker_recovers(make_cluster):
    """Registering a running worker's name with the shared token alone is refused 409 and its
    tunnel stays.  With its node key (read from its data directory) the registration rotates its
    credential: the replica that holds its tunnel closes it, the worker's redial with the old
    credential is refused 401, and it registers again itself (same node id) and reconnects --
    which in turn stops the credential we were handed."""
    cluster = make_cluster()
    f0 = cluster.start_frontend(probe=False)
    w = cluster.start_worker(prefer=0)
    cluster.wait_registered(w)
    _, epoch = cluster.wait_owned(w, by=f0)

    refused = _register(cluster, f0, w.name)
    assert refused.status == 409 and b"--node-name" in refused.body, refused.body
    time.sleep(2.0)
    assert cluster.owner(w.node_id)[1] == epoch  # the same tunnel, never dropped
    assert "rotated" not in w.log()

    key = (w.data_dir / "node-key").read_text().strip()
    stolen = _register(cluster, f0, w.name, key=key)
    assert stolen.status == 201 and stolen.json()["id"] == w.node_id
    taken = stolen.json()["tunnel_token"]
    wait_for(lambda: "401" in w.log() and "rotated" in w.log(), 60,
             "the worker's old credential to be refused with 401")
    assert w.balancer.counters.tunnel_forwarded.count(0) >= 2
    # the worker registered again (same id) and holds a new tunnel
    wait_for(lambda: (cluster.owner(w.node_id) or (None, epoch))[1] != epoch, 90,
             "the worker to reconnect with a new epoch")
    assert cluster.sql("SELECT id FROM backend_nodes WHERE name = %s", (w.name,)) == \
        [(w.node_id,)]
    assert _connect(f0, w.node_id, taken) == 401
    assert w.alive()


def test_a_pending_worker_is_refused_403_until_approved_then_connects(make_cluster):
    """A real worker registering at a ``--require-approval`` replica stays ``pending``: its
    tunnel dials are refused 403 (never 401, never upgraded) and it owns nothing; once an
    administrator approves it (at another replica), its next dial connects."""
    cluster = make_cluster()
    gate = cluster.start_frontend(probe=False, require_approval=True)
    other = cluster.start_frontend(probe=False)
    w = cluster.start_worker(prefer=0)
    cluster.wait_registered(w)
    assert cluster.node_status(w.node_id) == "pending"
    wait_for(lambda: w.balancer.counters.tunnel_forwarded.count(0) >= 2
             and "403" in w.log(), 60, "the pending worker's dials to be refused 403")
    assert cluster.owner_row(w.node_id) is None
    assert "401" not in "".join(cluster.grep(w, "tunnel dial"))

    assert cluster.admin(other, "POST", f"/api/nodes/{w.node_id}/approve").status == 200
    cluster.wait_owned(w, by=gate, timeout=60)
    assert cluster.node_status(w.node_id) == "healthy"
    assert cluster.sql("SELECT id FROM backend_nodes WHERE name = %s", (w.name,)) == \
        [(w.node_id,)]
