"""Replica churn (ref §10 scenario 2): the owner of a worker's tunnel is SIGKILLed.

Worker 0's tunnel is blocked at its balancer (registration and heartbeats still pass) and its
owner replica is killed, so the tunnel cannot come back until the test allows it.

- Inside the grace (90 s) nothing acts: the node stays ``healthy``, its ``node_models`` row
  survives, no departure is announced, and requests for it are never a routing fact -- first an
  unreachable peer (the dead owner still counts as live for up to 30 s), then absent within the
  grace once the survivor swept it.  Worker 1, held by the survivor, serves throughout.
- Unblocked, worker 0 re-homes on the survivor: a NEW epoch, the SAME node id, and its
  ``node_models`` row still there (a re-registration would have cleared it).  The dead owner's late
  fenced release changes nothing.
- The killer check: the same procedure with a 1 s grace must demote the node, which is what
  makes the "nothing acts inside the grace" assertion meaningful.  The same test shows the
  departure notifier firing exactly once for that departure, and never for a stale heartbeat.
"""

from __future__ import annotations

import re
import time

from localai_tw.cluster.ownership import _RELEASE_SQL

from .conftest import start_two_by_two
from .harness import INSTANCE_LIVENESS_SECONDS, wait_for

MODEL = "e2e-alpha-model"


def _insert_model_row(cluster, fe, node_id: str, model: str = MODEL) -> None:
    """A real backend on the worker and a ``loaded`` row naming its address (inserted by SQL).
    The backend must be real: a worker whose tunnel attaches is reconciled against the rows,
    and a row naming nothing it runs would be deleted then (issue 26 §2)."""
    started = cluster.control(fe, node_id, "backend.start",
                              {"backend": "echo", "model": model, "load": {"Model": model}})
    assert started.get("reply", {}).get("success"), started
    cluster.sql("INSERT INTO node_models (node_id, model_name, replica_index, address, state)"
                " VALUES (%s, %s, 0, %s, 'loaded')",
                (node_id, model, started["reply"]["address"]))


def _model_rows(cluster, node_id: str) -> list[str]:
    return [r[0] for r in cluster.sql("SELECT model_name FROM node_models WHERE node_id = %s",
                                      (node_id,))]


def _departures(cluster, node_id: str) -> list[str]:
    """Lines where a replica's departure notifier announced ``node_id`` (departure.py)."""
    pattern = re.compile(rf"node {re.escape(node_id)} departed: notifying")
    return [f"{p.name}: {line}" for p in cluster.frontends
            for line in p.log().splitlines() if pattern.search(line)]


def _demotions(cluster, node_id: str) -> list[str]:
    return [f"{p.name}: {line}" for p in cluster.frontends for line in p.log().splitlines()
            if f"node {node_id} " in line and "marked unhealthy" in line]


def test_owner_killed_nothing_acts_inside_the_grace_then_the_worker_rehomes(make_cluster):
    grace = 90.0
    cluster = make_cluster(grace="90s")
    start_two_by_two(cluster)
    f0, f1 = cluster.frontends
    w0, w1 = cluster.workers
    _insert_model_row(cluster, f0, w0.node_id)
    owner0, epoch0 = cluster.owner(w0.node_id)
    owner1 = cluster.owner(w1.node_id)
    assert owner0 == f0.instance_id and owner1[0] == f1.instance_id

    w0.balancer.block_tunnel()
    f0.kill()
    killed_at = time.monotonic()
    assert f0.popen.returncode == -9
    seen_conditions = set()

    def nothing_acts() -> None:
        assert cluster.node_status(w0.node_id) == "healthy"
        assert _model_rows(cluster, w0.node_id) == [MODEL]
        assert _departures(cluster, w0.node_id) == []
        assert _demotions(cluster, w0.node_id) == []
        assert cluster.heartbeat_age(w0.node_id) < 60  # heartbeats still flow (unblocked)
        # worker 1 keeps its owner and epoch, and keeps serving through the survivor
        assert cluster.owner(w1.node_id) == owner1
        served = cluster.control(f1, w1.node_id, "node.status")
        assert served.get("reply", {}).get("node_name") == w1.name, served
        # a request for worker 0 is never a routing fact and never the worker's answer
        answer = cluster.control(f1, w0.node_id, "node.status")
        assert "error" in answer, answer
        assert answer["error"]["type"] in ("PeerUnreachable", "AbsentWithinGrace"), answer
        seen_conditions.add(answer["error"]["condition"])

    # leg 1: until the killed replica leaves the live set (30 s liveness on the DB clock)
    def dead_owner_gone():
        nothing_acts()
        return f0.instance_id not in cluster.live_instances()
    wait_for(dead_owner_gone, 2 * INSTANCE_LIVENESS_SECONDS + 30, "the killed replica to leave "
             "the live set", interval=1.0)
    assert cluster.owner(w0.node_id) is None
    # the survivor's sweep records the departure (owner '' and disconnected_at set)
    wait_for(lambda: (nothing_acts(), (cluster.owner_row(w0.node_id) or ("x",))[0] == "")[1],
             30, "the departure of worker 0 to be recorded by the sweep", interval=1.0)
    row = cluster.owner_row(w0.node_id)
    assert row[1] == epoch0 and row[2] is not None

    # leg 2: 20 s with the departure recorded, still inside the grace: nothing acts, and the
    # admin API shows the worker as reconnecting (not gone)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        nothing_acts()
        view = cluster.admin(f1, "GET", f"/api/nodes/{w0.node_id}").json()
        assert (view["status"], view["presence"], view["owner"]) == \
            ("healthy", "reconnecting", None), view
        time.sleep(1.0)
    assert "absent-within-grace" in seen_conditions, seen_conditions
    # the scenario is only valid if all of that happened inside the grace
    assert time.monotonic() - killed_at < grace - 5, "the legs outran the grace; raise it"

    # the dead owner's late release (its socket noticed late) changes nothing
    assert cluster.sql(_RELEASE_SQL, (w0.node_id, f0.instance_id, epoch0)) == []

    # leg 3: unblock; the worker re-homes on the survivor with a new epoch, same node id
    w0.balancer.unblock_tunnel()
    owner_after = cluster.wait_owned(w0, by=f1, timeout=90)
    assert owner_after[1] != epoch0  # epochs are compared with = only
    assert cluster.sql("SELECT id FROM backend_nodes WHERE name = %s", (w0.name,)) == \
        [(w0.node_id,)]
    assert _model_rows(cluster, w0.node_id) == [MODEL]  # no re-registration happened
    assert cluster.node_status(w0.node_id) == "healthy"
    served = cluster.control(f1, w0.node_id, "node.status")
    assert served.get("reply", {}).get("node_name") == w0.name, served
    assert served["held_here_before"] is True
    # and a late release with the old epoch still changes nothing
    assert cluster.sql(_RELEASE_SQL, (w0.node_id, f0.instance_id, epoch0)) == []
    assert cluster.owner(w0.node_id) == owner_after
    assert cluster.owner(w1.node_id) == owner1
    assert _departures(cluster, w0.node_id) == [] and _demotions(cluster, w0.node_id) == []


def test_killer_check_tiny_grace_demotes_and_notifies_once_never_on_stale(make_cluster):
    """Same procedure with a 1 s grace: the node IS demoted (so the assertion above has teeth),
    the departure notifier fires exactly once for it, its model row is kept, and a stale
    heartbeat of another node marks that node offline without any departure."""
    cluster = make_cluster(grace="1s")
    # The replicas do not stamp liveness from the tunnel here: worker 1 keeps its tunnel, and a
    # replica that stamps would vouch for it whatever its HTTP heartbeats do (operators.md,
    # "Liveness from the tunnel"); this test needs a stale heartbeat with the tunnel held.
    start_two_by_two(cluster, frontend_args=("--tunnel-liveness", "0"))
    f0, f1 = cluster.frontends
    w0, w1 = cluster.workers
    _insert_model_row(cluster, f0, w0.node_id)
    assert cluster.owner(w0.node_id)[0] == f0.instance_id

    w0.balancer.block_tunnel()
    f0.kill()
    # the survivor sweeps the dead replica (30 s), the departure ages past 1 s, and the next
    # health pass (every 15 s) demotes: well inside what the 90 s test held "healthy" for
    wait_for(lambda: cluster.node_status(w0.node_id) == "unhealthy", 120,
             "worker 0 to be marked unhealthy with a 1 s grace", interval=1.0)
    assert _model_rows(cluster, w0.node_id) == [MODEL]  # status only: rows are kept
    wait_for(lambda: _departures(cluster, w0.node_id), 10, "the departure log line")
    assert len(_departures(cluster, w0.node_id)) == 1
    assert [d.split(":")[0] for d in _departures(cluster, w0.node_id)] == [f1.name]
    view = cluster.admin(f1, "GET", f"/api/nodes/{w0.node_id}").json()
    assert (view["status"], view["presence"]) == ("unhealthy", "gone"), view
    gone = cluster.control(f1, w0.node_id, "node.status")
    assert gone["error"]["type"] == "WorkerGone" and "no route" in gone["error"]["message"]

    # a stale heartbeat (worker 1: heartbeats refused at its balancer, the last one backdated)
    # marks it offline at the next pass -- a lifecycle event, not a departure
    w1.balancer.block_heartbeats()
    cluster.sql("UPDATE backend_nodes SET last_heartbeat = now() - interval '10 minutes'"
                " WHERE id = %s", (w1.node_id,))
    wait_for(lambda: cluster.node_status(w1.node_id) == "offline", 60,
             "worker 1 to be marked offline on a stale heartbeat", interval=1.0)
    assert _departures(cluster, w1.node_id) == []
    assert cluster.owner(w1.node_id)[0] == f1.instance_id  # its tunnel never moved
    # that pass also saw worker 0 still gone: the edge did not fire again
    assert len(_departures(cluster, w0.node_id)) == 1

    # both come back: worker 1's heartbeats resume, worker 0's tunnel re-homes on the survivor
    w1.balancer.unblock_heartbeats()
    w0.balancer.unblock_tunnel()
    wait_for(lambda: cluster.node_status(w1.node_id) == "healthy", 90,
             "worker 1 healthy again once its heartbeat is fresh", interval=1.0)
    cluster.wait_owned(w0, by=f1, timeout=90)
    wait_for(lambda: cluster.node_status(w0.node_id) == "healthy", 60,
             "worker 0 healthy again once its tunnel is connected", interval=1.0)
    assert _model_rows(cluster, w0.node_id) == [MODEL]
    assert len(_departures(cluster, w0.node_id)) == 1  # one departure, one announcement
    assert _departures(cluster, w1.node_id) == []


def test_graceful_stop_of_the_owner_rehomes_the_worker_without_any_verdict(make_cluster):
    """A rolling restart (SIGTERM): the stopping replica releases its tunnels and leaves
    ``instances``; its worker redials through the balancer onto the survivor, same node id, new
    epoch; the node never stops being healthy and nothing is announced."""
    cluster = make_cluster(grace="90s")
    start_two_by_two(cluster)
    f0, f1 = cluster.frontends
    w0, w1 = cluster.workers
    _insert_model_row(cluster, f0, w0.node_id)
    _, epoch0 = cluster.owner(w0.node_id)

    f0.popen.terminate()
    assert f0.popen.wait(timeout=30) in (0, -15)
    log = f0.log()
    assert "Server Shut Down" in log
    assert "Traceback" not in log and "Unhandled" not in log, log
    # it left the cluster at once (deregistered), rather than ageing out of the live set
    assert f0.instance_id not in cluster.live_instances()
    assert cluster.sql("SELECT 1 FROM instances WHERE id = %s", (f0.instance_id,)) == []

    _, epoch = cluster.wait_owned(w0, by=f1, timeout=60)
    assert epoch != epoch0
    assert cluster.sql("SELECT id FROM backend_nodes WHERE name = %s", (w0.name,)) == \
        [(w0.node_id,)]
    assert cluster.node_status(w0.node_id) == "healthy"
    assert _model_rows(cluster, w0.node_id) == [MODEL]
    served = cluster.control(f1, w0.node_id, "node.status")
    assert served.get("reply", {}).get("node_name") == w0.name and served["held_here_before"]
    assert cluster.sql(_RELEASE_SQL, (w0.node_id, f0.instance_id, epoch0)) == []
    assert _departures(cluster, w0.node_id) == [] and _demotions(cluster, w0.node_id) == []
    assert cluster.owner(w1.node_id)[0] == f1.instance_id
