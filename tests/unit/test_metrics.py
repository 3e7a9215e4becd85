"""The label rules of localai_tw/metrics.py: bounded values, the four conditions, one registry
per replica."""

from prometheus_client.parser import text_string_to_metric_families

from localai_tw import errors
from localai_tw.metrics import DISCARD, ReplicaMetrics, condition_label, endpoint_of, exposition


def test_endpoints_are_a_fixed_set():
    assert endpoint_of([b"chat", b"completions"]) == "chat"
    assert endpoint_of([b"embeddings", b""]) == "embeddings"
    assert endpoint_of([b"models", b"some", b"name"]) == "model"
    assert endpoint_of([b"responses"]) == "responses"
    assert endpoint_of([b"responses", b"resp_1", b"cancel"]) == "response"  # ids: no label
    assert endpoint_of([b"anything-a-client-sends"]) == "other"
    assert (endpoint_of([b"tokenize"]), endpoint_of([b"rerank"])) == ("tokenize", "rerank")
    assert endpoint_of([b"detokenize"]) == "detokenize"
    assert endpoint_of([b"models", b"capabilities"]) == "capabilities"


def test_a_subclass_counts_as_its_condition():
    assert condition_label(errors.PeerRejected("r", "x")) == "peer-unreachable"
    assert condition_label(errors.WorkerGone("n", 90)) == "routing-fact"
    assert condition_label(errors.BackendAnswer("n", "UNAVAILABLE", "x")) == "worker-answer"
    assert condition_label(errors.AbsentWithinGrace("n", "reconnecting")) == \
        "absent-within-grace"
    assert condition_label(errors.CallerDeadlineExceeded("x")) == "caller-deadline"
    assert condition_label(ValueError()) == "unclassified"


def samples(metrics):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(exposition(metrics.registry).decode())
            for s in f.samples}


def test_replicas_do_not_share_counters_and_discard_keeps_nothing():
    one, two = ReplicaMetrics(), ReplicaMetrics()
    record = one.request([b"embeddings"])
    record.model = "m"
    record.usage({"prompt_tokens": 4, "completion_tokens": 0})
    record.failed(errors.WorkerAnswer("n", "no"))
    record.finished(502, ["node-1"])
    record.finished(502, ["node-1"])  # once only
    DISCARD.request([b"embeddings"]).finished(200)
    key = ("localai_requests_total", (("endpoint", "embeddings"), ("model", "m"),
                                      ("path", "owner"), ("status", "502")))
    assert samples(one)[key] == 1
    assert key not in samples(two)
    assert samples(one)[("localai_tokens_total", (("direction", "in"), ("model", "m")))] == 4
    assert samples(one)[("localai_errors_total", (("condition", "worker-answer"),
                                                  ("endpoint", "embeddings")))] == 1
    assert key not in samples(DISCARD)


def test_byte_tally_keeps_what_ended_sessions_carried():
    """localai_tunnel_bytes_total and localai_relay_bytes_total are counters: a session that
    ends (a worker reconnecting) must not take its bytes out of the total."""
    from twisted.internet import defer

    from localai_tw.mux.session import ByteTally

    class Carried:
        def __init__(self, received, sent):
            self.bytesReceived, self.bytesSent = received, sent
            self.closed = defer.Deferred()

        def whenClosed(self):
            return self.closed

    tally, first, second = ByteTally(), Carried(100, 10), Carried(5, 1)
    tally.watch(first)
    tally.watch(first)  # once only
    tally.watch(second)
    assert tally.totals() == (105, 11)
    first.closed.callback(None)
    first.bytesReceived = 10**6  # read no more once ended
    assert tally.totals() == (105, 11)
    second.bytesReceived = 50
    assert tally.totals() == (150, 11)


def test_node_counts_are_shown_only_while_the_last_pass_is_recent():
    """Only the replica that ran a health pass knows its counts; an old pass (another replica
    has been winning the lock) must not be shown as the present."""
    from types import SimpleNamespace

    from localai_tw.cluster.health import PassReport

    report = PassReport(statuses={"healthy": 2, "offline": 1}, presence={"connected": 2})
    health = SimpleNamespace(last_report=report, last_report_tick=7, ticks=7)
    metrics = ReplicaMetrics()
    metrics.watch_health(health)
    assert samples(metrics)[("localai_nodes", (("status", "healthy"),))] == 2
    assert samples(metrics)[("localai_node_presence", (("presence", "connected"),))] == 2
    health.ticks = 9  # two ticks another replica won: still shown
    assert samples(metrics)[("localai_nodes", (("status", "offline"),))] == 1
    health.ticks = 10  # three: too old
    assert not any(name.startswith("localai_node") for name, _ in samples(metrics))


def test_gathered_workers_are_labelled_by_node_and_failures_show():
    from localai_tw.metrics import WorkerMetrics, gathered_exposition

    replica = ReplicaMetrics()
    replica.cold_load("m", 2.0, ok=True)
    one = exposition(replica.registry).decode()  # any valid exposition
    worker = WorkerMetrics()
    text = gathered_exposition([("n1", one), ("n2", None), ("n3", "not { an exposition"),
                                ("n4", exposition(worker.registry).decode())])
    found = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    ok = {labels[0][1]: v for (name, labels), v in found.items()
          if name == "localai_worker_scrape_ok"}
    assert ok == {"n1": 1, "n2": 0, "n3": 0, "n4": 1}
    assert found[("localai_cold_loads_total", (("model", "m"), ("node", "n1"),
                                               ("outcome", "ok")))] == 1
    assert all(("node", "n1") in labels or ("node", "n4") in labels
               for (name, labels) in found if name != "localai_worker_scrape_ok")


def test_backend_calls_show_idle_pooled_streams_and_calls_in_flight():
    """Read from the replica's BackendClients at scrape time: the idle ``call`` streams of
    every node, and the calls of every open client not finished yet."""
    from twisted.internet import task

    from localai_tw.frontend.inference.backend_client import BackendClients

    clients = BackendClients(None, task.Clock(), dialer=object())
    replica = ReplicaMetrics()
    replica.watch_backend_calls(clients)
    idle, calls = ("localai_backend_call_streams_idle", ()), ("localai_backend_calls_in_flight", ())
    assert samples(replica)[idle] == 0 and samples(replica)[calls] == 0
    clients.idle_by_node.update({"n1": 2, "n2": 3})
    clients.client("n1", 50051).in_flight = 4
    clients.client("n2", 50052).in_flight = 1
    assert samples(replica)[idle] == 5 and samples(replica)[calls] == 5
