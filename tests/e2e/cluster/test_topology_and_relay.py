"""Two frontends x two workers, real twistd processes: the topology, and both routes to a worker.

The shared cluster (``two_by_two``): worker ``i`` registers through its own balancer, which
prefers frontend ``i % 2``, so the two tunnels land on different replicas.  These tests only
read and call; they do not break the cluster.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from .harness import listening_sockets


def _owners(cluster):
    return {w.name: cluster.owner(w.node_id) for w in cluster.workers}


def test_topology_precondition(two_by_two):
    cluster = two_by_two
    f0, f1 = cluster.frontends
    w0, w1 = cluster.workers

    # both replicas are live and know each other's advertised address
    assert cluster.live_instances() >= {f0.instance_id, f1.instance_id}
    for fe in (f0, f1):
        listed = cluster.admin(fe, "GET", "/api/cluster/instances")
        assert listed.status == 200
        seen = {i["id"]: i["advertised_addr"] for i in listed.json()["instances"]}
        assert seen[f0.instance_id] == f"127.0.0.1:{f0.port}"
        assert seen[f1.instance_id] == f"127.0.0.1:{f1.port}"

    # both workers healthy in one roster, with the same ids at both replicas
    rosters = []
    for fe in (f0, f1):
        answer = cluster.admin(fe, "GET", "/api/nodes")
        assert answer.status == 200, answer.body
        nodes = answer.json()["nodes"]
        rosters.append({n["name"]: (n["id"], n["status"], n["presence"],
                                    (n["owner"] or {}).get("replica")) for n in nodes})
    assert rosters[0] == rosters[1]
    assert rosters[0] == {
        w0.name: (w0.node_id, "healthy", "connected", f0.instance_id),
        w1.name: (w1.node_id, "healthy", "connected", f1.instance_id),
    }

    # the two tunnels are owned by different replicas (node_connections joined to live instances)
    owners = _owners(cluster)
    assert owners[w0.name][0] == f0.instance_id
    assert owners[w1.name][0] == f1.instance_id
    assert owners[w0.name][0] != owners[w1.name][0]
    # each tunnel went through its own balancer, to the preferred replica
    assert w0.balancer.counters.tunnel_forwarded[-1] == 0
    assert w1.balancer.counters.tunnel_forwarded[-1] == 1

    # neither worker (nor any child of it) listens on anything
    for w in (w0, w1):
        assert w.alive()
        assert listening_sockets(w.pid) == [], f"{w.name} listens: {listening_sockets(w.pid)}"
    # ... while the frontends do (a control: the probe can see a listening socket)
    assert listening_sockets(f0.pid)


@pytest.mark.parametrize("verb", ["node.status", "backend.list"])
def test_control_verbs_through_the_owner_and_through_a_relay(two_by_two, verb):
    cluster = two_by_two
    f0, f1 = cluster.frontends
    before = _owners(cluster)
    for w in cluster.workers:
        owner_id = before[w.name][0]
        for fe in (f0, f1):
            answer = cluster.control(fe, w.node_id, verb)
            assert "error" not in answer, answer
            assert answer["replica"] == fe.instance_id
            local = fe.instance_id == owner_id
            # the owner serves from its own tunnel; the other replica holds nothing and relays
            assert answer["held_here_before"] is local and answer["held_here_after"] is local
            if verb == "node.status":
                assert answer["reply"]["node_name"] == w.name, answer
            else:
                assert isinstance(answer["reply"].get("backends"), list), answer
    # the route was what we said: ownership did not move while we called
    assert _owners(cluster) == before


def test_twenty_mib_upload_through_the_owner_and_through_a_relay(two_by_two, tmp_path):
    cluster = two_by_two
    f0, f1 = cluster.frontends
    before = _owners(cluster)
    for w in cluster.workers:
        for fe in (f0, f1):
            # bytes of their own each time: the same bytes under a second key would be linked
            # from the worker's content store and never cross the route (issue 26 §4)
            payload = tmp_path / f"{w.name}-{fe.name}.bin"
            payload.write_bytes(os.urandom(20 * 1024 * 1024))
            digest = hashlib.sha256(payload.read_bytes()).hexdigest()
            local = before[w.name][0] == fe.instance_id
            key = f"models/e2e/{fe.name}-{'owner' if local else 'relay'}.bin"
            answer = cluster.upload(fe, w.node_id, key, payload)
            assert "error" not in answer, answer
            assert answer["held_here_before"] is local and answer["held_here_after"] is local
            staged = answer["staged"]
            assert (staged["size"], staged["sha256"], staged["skipped"]) == \
                (20 * 1024 * 1024, digest, False)
            # the bytes are on the worker's disk, intact
            on_disk = w.data_dir / "models" / "e2e" / key.rsplit("/", 1)[1]
            assert hashlib.sha256(on_disk.read_bytes()).hexdigest() == digest
            # a second upload of the same content is skipped by digest (HEAD through the route)
            again = cluster.upload(fe, w.node_id, key, payload)
            assert again["staged"]["skipped"] is True, again
    assert _owners(cluster) == before
