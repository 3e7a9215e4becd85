"""Issue 26 §1 and §2 with real ``twistd`` processes: what a worker fault leaves behind.

- A killed worker's backend channel (the bridged gRPC path, ``--backend-calls grpc``) is not
  redialled by the replica with no call at all (it
  was: one tunnel dial and one ``dial failed`` line a second, forever), and once the worker
  restarted (its registration deleted the rows naming the old ports) the replica closes that
  channel.
- A worker frozen past the grace (SIGSTOP) is marked offline, its rows deleted; thawed, its
  tunnel comes back without a registration, and the backend nobody tracks any more is stopped:
  the worker's processes and the cluster's records agree again.

Windows in which nothing may happen are bounded real time; a count is asserted, never a
duration.  Deliberate breaks (each checked once): the channel reset disabled
(``BridgedBackendClient._idle_channel_down`` returning at once) -> the first window counts
redials; the reconciler unwired (its attach listener and the health monitor's ``on_back`` in
``service.py``) -> the orphan backend is never stopped.
"""

from __future__ import annotations

import signal
import time

from .harness import wait_for

#: Seconds watched for redials (grpcio redialled a failed channel every second).
WINDOW = 5.0
DIAL_FAILED = "dial failed"


def write_model(models_dir) -> None:
    models_dir.mkdir(parents=True, exist_ok=True)
    (models_dir / "m.yaml").write_text("name: m\nbackend: echo\noptions: ['echo.dim:4']\n")


def embed(cluster, fe):
    return cluster.admin(fe, "POST", "/v1/embeddings", {"model": "m", "input": "x"})


def backends(cluster, fe, node_id) -> list[str]:
    answer = cluster.admin(fe, "GET", f"/api/nodes/{node_id}/backends")
    assert answer.status == 200, answer.body
    return sorted(b["process_key"] for b in answer.json()["answer"]["backends"])


def records(cluster, node_id) -> list[tuple]:
    return cluster.sql("SELECT model_name, address, state FROM node_models WHERE node_id = %s",
                       (node_id,))


def test_a_killed_workers_channel_is_not_redialled_and_closes_with_its_placement(make_cluster):
    cluster = make_cluster()
    models_dir = cluster.workdir / "models"
    write_model(models_dir)
    # The bridged gRPC path (grpcio's channel is what redialled); ``call`` streams open only
    # for a call and are pooled per client (tests/unit/test_backend_call_streams.py).
    fe = cluster.start_frontend(extra_args=("--models-dir", str(models_dir),
                                            "--backend-calls", "grpc"))
    worker = cluster.start_worker(0, name="crashy")
    node_id = cluster.wait_registered(worker)
    cluster.wait_owned(worker, by=fe)
    assert embed(cluster, fe).status == 200
    [(_, address, _)] = records(cluster, node_id)
    port = address.rsplit(":", 1)[1]

    worker.kill()  # a crash: no deregistration, its backends die with it
    wait_for(lambda: cluster.owner(node_id) is None, 30, "the tunnel released")
    assert embed(cluster, fe).status != 200  # one request meets the dead route
    dialled = len(cluster.grep(fe, DIAL_FAILED))
    assert dialled >= 1
    time.sleep(WINDOW)
    assert len(cluster.grep(fe, DIAL_FAILED)) == dialled, "redials with no request"

    # The worker restarts on its data directory: it registers again, which deletes the rows
    # naming its old ports; the replica closes the channel it held to the old one.
    again = cluster.start_worker(0, name="crashy")
    assert cluster.wait_registered(again) == node_id
    closed = f"closed the gRPC channel to worker {node_id} port {port}"
    wait_for(lambda: cluster.grep(fe, closed), 60, "the old channel closed")
    dialled = len(cluster.grep(fe, DIAL_FAILED))
    time.sleep(WINDOW)
    assert len(cluster.grep(fe, DIAL_FAILED)) == dialled
    cluster.wait_owned(again, by=fe)
    assert embed(cluster, fe).status == 200  # served again, by a new channel


def test_a_worker_thawed_after_offline_has_its_untracked_backend_stopped(make_cluster):
    cluster = make_cluster(grace="5s")
    models_dir = cluster.workdir / "models"
    write_model(models_dir)
    fe = cluster.start_frontend(extra_args=("--models-dir", str(models_dir)))
    worker = cluster.start_worker(0, name="frozen")
    node_id = cluster.wait_registered(worker)
    cluster.wait_owned(worker, by=fe)
    assert embed(cluster, fe).status == 200
    [key] = backends(cluster, fe, node_id)

    worker.popen.send_signal(signal.SIGSTOP)
    try:
        # past the stale threshold (60 s) and the grace: offline, its records deleted
        wait_for(lambda: cluster.node_status(node_id) == "offline", 150, "offline",
                 interval=2)
        assert records(cluster, node_id) == []
    finally:
        worker.popen.send_signal(signal.SIGCONT)
    # Thawed: the same registration, its tunnel back; its backend still ran, nobody tracked it.
    cluster.wait_owned(worker, by=fe)
    wait_for(lambda: backends(cluster, fe, node_id) == [], 60, "the orphan backend stopped")
    assert cluster.grep(fe, f"stopped backend {key}")
    assert records(cluster, node_id) == []
    wait_for(lambda: cluster.node_status(node_id) == "healthy", 60, "healthy again")
    assert embed(cluster, fe).status == 200  # loaded again the ordinary way
    assert backends(cluster, fe, node_id) == [key]
