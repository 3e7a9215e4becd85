"""Issue 13 §5, model lifecycle, with real ``twistd`` processes: eviction under a memory budget
set low on purpose, and preload visible in ``/api/nodes`` after a restart.

Two frontends share a models directory; one worker (``--memory-budget 30000``) is held by the
first; every request goes to the second, so each load, eviction and unload crosses the relay.
Three models of 12000 bytes (their file sizes are their memory need) cannot all fit: loading
the third evicts the least recently used.  A fourth model, ``keep``, is ``preload: true`` and
``pinned: true``: it is loaded with no request at all, never evicted, and loaded again after
every process restarted.

Deliberate breaks (each checked once): evict the most recently used model (``_HELD_SQL``
ordered ``DESC``) -> the evicted-model assertion goes red; a Preloader that treats a row on a
node that is not connected as loaded -> the after-restart assertion times out.
"""

from __future__ import annotations

import hashlib

from .harness import wait_for

WEIGHTS = {name: (name.encode() * 12000)[:12000] for name in ("a", "b", "c")}


def write_models(models_dir) -> None:
    models_dir.mkdir(parents=True, exist_ok=True)
    for name, weights in WEIGHTS.items():
        (models_dir / f"{name}.bin").write_bytes(weights)
        (models_dir / f"{name}.yaml").write_text(
            f"name: {name}\nbackend: echo\nparameters:\n  model: {name}.bin\n"
            f"files:\n  - path: {name}.bin\n    sha256: '{hashlib.sha256(weights).hexdigest()}'\n"
            "options: ['echo.dim:4']\n")
    (models_dir / "keep.yaml").write_text(
        "name: keep\nbackend: echo\noptions: ['echo.dim:4']\npreload: true\npinned: true\n")


def loaded(cluster, fe, node_id) -> list[str]:
    answer = cluster.admin(fe, "GET", f"/api/nodes/{node_id}")
    assert answer.status == 200, answer.body
    return sorted(m["model_name"] for m in answer.json()["models"] if m["state"] == "loaded")


def running(cluster, fe, node_id) -> list[str]:
    answer = cluster.admin(fe, "GET", f"/api/nodes/{node_id}/backends")
    assert answer.status == 200, answer.body
    return sorted(b["model"] for b in answer.json()["answer"]["backends"])


def embed(cluster, fe, model: str) -> None:
    answer = cluster.admin(fe, "POST", "/v1/embeddings", {"model": model, "input": "x"})
    assert answer.status == 200, (model, answer.status, answer.body)


def test_eviction_under_a_low_memory_budget_and_preload_after_a_restart(make_cluster):
    cluster = make_cluster()
    models_dir = cluster.workdir / "models"
    write_models(models_dir)
    args = ("--models-dir", str(models_dir))
    owner = cluster.start_frontend(extra_args=args)
    relay = cluster.start_frontend(extra_args=args)
    worker = cluster.start_worker(0, name="small", extra_args=("--memory-budget", "30000"))
    node_id = cluster.wait_registered(worker)
    cluster.wait_owned(worker, by=owner)
    view = cluster.admin(relay, "GET", f"/api/nodes/{node_id}").json()
    assert view["capacity"]["total_ram"] == 30000

    # preload: loaded with no request at all
    wait_for(lambda: loaded(cluster, relay, node_id) == ["keep"], 60, "keep preloaded")

    embed(cluster, relay, "a")
    embed(cluster, relay, "b")
    assert loaded(cluster, relay, node_id) == ["a", "b", "keep"]
    embed(cluster, relay, "c")  # 24000 + 12000 > 30000: a, least recently used, goes
    assert loaded(cluster, relay, node_id) == ["b", "c", "keep"]
    assert running(cluster, relay, node_id) == ["b", "c", "keep"]
    assert cluster.grep(relay, "evicted model a from node")

    # restart everything: the worker registers again (its rows go), the new replica preloads
    worker.reap()
    owner.reap()
    relay.reap()
    fresh = cluster.start_frontend(extra_args=args)
    again = cluster.start_worker(2, name="small", extra_args=("--memory-budget", "30000"))
    assert cluster.wait_registered(again) == node_id
    cluster.wait_owned(again, by=fresh)
    wait_for(lambda: loaded(cluster, fresh, node_id) == ["keep"], 60,
             "keep preloaded after the restart")
    assert running(cluster, fresh, node_id) == ["keep"]
