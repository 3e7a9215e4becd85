"""Liveness from the tunnel with real processes (issue 25 §5): a ``twistd`` replica and worker.

The replica holding the worker's tunnel writes its heartbeat (``--tunnel-liveness``, 10 s), so
the worker's HTTP heartbeats are no longer what keeps it fresh: with them refused at its
balancer and its heartbeat backdated to 70 s, it stays ``healthy`` and its heartbeat comes back
within a stamp (without the stamps it would be stale 20 s later).  The worker, told so in the
upgrade's answer, beats over HTTP only now and then (its first beat, capacity changes, the 60 s
refresh), not every 10 s; and the replica's stamp notices (``tunnel/stampnotice.py``) reach it
over the tunnel, which its own metrics count.
"""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from .harness import hold_for, wait_for


def stamp_notices(cluster, fe, worker) -> float:
    """The worker's ``localai_worker_stamp_notices_total``, scraped through the replica."""
    answer = cluster.admin(fe, "GET", f"/api/nodes/{worker.node_id}/metrics")
    assert answer.status == 200, (answer.status, answer.body[:200])
    return sum(sample.value for family in text_string_to_metric_families(answer.body.decode())
               for sample in family.samples
               if sample.name == "localai_worker_stamp_notices_total")


def test_the_replica_keeps_a_tunnelled_worker_fresh_without_its_http_heartbeats(make_cluster):
    cluster = make_cluster(grace="90s")
    fe = cluster.start_frontend()
    # A memory budget far below the machine's free RAM keeps the reported memory constant, so
    # only the disk could count as a capacity change here.
    worker = cluster.start_worker(prefer=0, extra_args=("--memory-budget", "256MiB"))
    cluster.wait_registered(worker)
    cluster.wait_owned(worker, by=fe)

    # The worker beats over HTTP rarely once its tunnel carries liveness: after its first beat
    # (10 s after registration) and before its 60 s refresh, none but a disk change (every
    # 10 s would be 3 in 30 s).
    time.sleep(12)
    before = worker.balancer.counters.heartbeats
    time.sleep(30)
    assert worker.balancer.counters.heartbeats - before <= 1, \
        worker.balancer.counters.heartbeats - before
    # The replica said over the tunnel that it stamped the worker (a pass every 10 s; the first
    # notice at the first pass after the attach): the worker's refresh waits on them.
    assert stamp_notices(cluster, fe, worker) >= 1

    # No HTTP heartbeat passes any more, and the last one is made 70 s old (20 s short of the
    # stale threshold: a health pass must not find it stale before the next stamp).
    worker.balancer.block_heartbeats()
    cluster.sql("UPDATE backend_nodes SET last_heartbeat = now() - interval '70 seconds'"
                " WHERE id = %s", (worker.node_id,))
    # The next stamp (every 10 s) writes now() - 11 s: fresh again without any HTTP heartbeat.
    wait_for(lambda: cluster.heartbeat_age(worker.node_id) < 30, 30,
             "the replica's stamp to freshen the heartbeat", interval=0.5)

    def healthy_and_fresh() -> None:
        assert cluster.node_status(worker.node_id) == "healthy"
        assert cluster.heartbeat_age(worker.node_id) < 30

    hold_for(healthy_and_fresh, 20)  # a health pass (every 15 s) ran meanwhile
    worker.balancer.unblock_heartbeats()
