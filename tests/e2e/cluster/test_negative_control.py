"""Negative control (ref §10 scenario 3): unreachable is not absent.

Both workers' tunnel dials are refused at their balancers from the very first dial, while
registration and heartbeats pass.  Every request for either worker, at either replica, is a
routing fact saying "no route" -- never "absent within the grace", never the worker's answer --
yet both nodes stay ``healthy`` with fresh heartbeats, because a missing route is not a verdict
on the worker.  Unblocking one tunnel brings back exactly that worker.
"""

from __future__ import annotations

import time

from .harness import hold_for, wait_for


def _no_route(cluster, fe, node_id: str, verb: str = "node.status") -> dict:
    answer = cluster.control(fe, node_id, verb)
    assert "error" in answer, answer
    error = answer["error"]
    assert (error["type"], error["condition"]) == ("WorkerUnroutable", "routing-fact"), answer
    assert "no route" in error["message"], answer
    assert answer["held_here_before"] is False
    return error


def test_blocked_tunnels_are_no_route_while_the_nodes_stay_healthy(make_cluster, tmp_path):
    cluster = make_cluster(grace="90s")
    f0 = cluster.start_frontend()
    f1 = cluster.start_frontend()
    w0 = cluster.start_worker(prefer=0, tunnel_blocked=True)
    w1 = cluster.start_worker(prefer=1, tunnel_blocked=True)
    for w in (w0, w1):
        cluster.wait_registered(w)
        wait_for(lambda: w.balancer.counters.tunnel_refused > 0, 30, f"{w.name} to dial")

    # no owner exists, for 5 s
    def no_owner() -> None:
        for w in (w0, w1):
            assert cluster.owner(w.node_id) is None, f"{w.name} has an owner"
    hold_for(no_owner, 5)
    assert all(cluster.owner_row(w.node_id) is None for w in (w0, w1))

    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 4096)

    def all_refused_as_no_route() -> None:
        for w in (w0, w1):
            for fe in (f0, f1):
                _no_route(cluster, fe, w.node_id, "node.status")
                _no_route(cluster, fe, w.node_id, "backend.list")
                upload = cluster.upload(fe, w.node_id, "models/e2e/small.bin", small)
                assert upload["error"]["type"] == "WorkerUnroutable", upload
                assert "no route" in upload["error"]["message"], upload

    all_refused_as_no_route()

    # unreachable is not absent: both stay healthy for 15 s with fresh heartbeats
    def healthy_and_beating() -> None:
        for w in (w0, w1):
            assert cluster.node_status(w.node_id) == "healthy"
            assert cluster.heartbeat_age(w.node_id) < 60
            view = cluster.admin(f1, "GET", f"/api/nodes/{w.node_id}").json()
            assert (view["status"], view["owner"], view["presence"]) == \
                ("healthy", None, "unknown"), view
        _no_route(cluster, f0, w0.node_id)
        _no_route(cluster, f1, w1.node_id)
    start = time.monotonic()
    hold_for(healthy_and_beating, 15)
    assert time.monotonic() - start >= 15
    beats = {w.name: w.balancer.counters.heartbeats for w in (w0, w1)}
    assert all(n >= 1 for n in beats.values()), beats  # heartbeats really passed the balancer
    all_refused_as_no_route()

    # restore worker 0's tunnel: exactly that worker recovers
    w0.balancer.unblock_tunnel()
    cluster.wait_owned(w0, by=f0, timeout=90)
    for fe in (f0, f1):
        served = cluster.control(fe, w0.node_id, "backend.list")
        assert "error" not in served, served
        assert served["held_here_before"] is (fe is f0)  # f1 relays through f0
        _no_route(cluster, fe, w1.node_id)
        _no_route(cluster, fe, w1.node_id, "backend.list")
    assert cluster.owner(w1.node_id) is None
    assert cluster.node_status(w1.node_id) == "healthy"

    # and then the second one
    w1.balancer.unblock_tunnel()
    cluster.wait_owned(w1, by=f1, timeout=90)
    for fe in (f0, f1):
        for w in (w0, w1):
            served = cluster.control(fe, w.node_id, "node.status")
            assert served.get("reply", {}).get("node_name") == w.name, served
