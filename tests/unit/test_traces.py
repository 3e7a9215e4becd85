"""The trace ring behind ``/api/traces``: fed by the replica's metrics, bounded, newest first,
and never holding what a client said."""

from __future__ import annotations

from localai_tw import errors
from localai_tw.frontend.traces import TraceRing
from localai_tw.metrics import ReplicaMetrics

ALLOWED = {"id", "time", "endpoint", "model", "nodes", "path", "status", "condition",
           "seconds", "first_token_seconds", "prompt_tokens", "completion_tokens"}


def finish(metrics, model, status=200, nodes=("n1",), cause=None, streamed=False):
    record = metrics.request([b"chat", b"completions"])
    record.model = model
    if streamed:
        record.replied()
    record.usage({"prompt_tokens": 3, "completion_tokens": 2})
    record.failed(cause)
    record.finished(status, nodes)


def test_the_ring_is_bounded_and_newest_first():
    metrics = ReplicaMetrics()
    ring = TraceRing(capacity=3)
    ring.watch(metrics)
    for i in range(5):
        finish(metrics, f"m{i}")
    traces = ring.recent(10)
    assert [t["model"] for t in traces] == ["m4", "m3", "m2"]  # the two oldest dropped
    assert [t["model"] for t in ring.recent(1)] == ["m4"]
    assert traces[0]["id"] > traces[1]["id"]


def test_a_trace_has_the_hops_and_the_condition_but_no_prompt():
    metrics = ReplicaMetrics()
    ring = TraceRing()
    ring.watch(metrics)
    finish(metrics, "echo", streamed=True)
    finish(metrics, "echo", status=503, nodes=(),
           cause=errors.PeerUnreachable("replica-b", "my secret prompt"))
    failed, ok = ring.recent()
    assert set(ok) == ALLOWED and set(failed) == ALLOWED
    assert ok["endpoint"] == "chat" and ok["nodes"] == ["n1"] and ok["path"] == "owner"
    assert ok["status"] == "200" and ok["condition"] is None
    assert ok["first_token_seconds"] is not None and ok["seconds"] >= ok["first_token_seconds"]
    assert ok["prompt_tokens"] == 3 and ok["completion_tokens"] == 2
    assert failed["status"] == "503" and failed["path"] == "none"
    assert failed["condition"] == "peer-unreachable" and failed["first_token_seconds"] is None
    assert "secret" not in repr(ring.recent())


def test_a_failing_listener_does_not_break_the_metrics():
    metrics = ReplicaMetrics()
    ring = TraceRing()
    metrics.listeners.append(lambda *a: 1 / 0)
    ring.watch(metrics)
    finish(metrics, "echo")
    assert len(ring.recent()) == 1
