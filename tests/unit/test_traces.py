"""The trace ring behind ``/api/traces``: fed by the replica's metrics, bounded, newest first,
and never holding what a client said."""

from __future__ import annotations

from localai_tw import errors
from localai_tw.frontend.api.traces import TraceRing
from localai_tw.metrics import ReplicaMetrics

ALLOWED = {"id", "time", "endpoint", "model", "nodes", "path", "status", "condition",
           "seconds", "first_token_seconds", "prompt_tokens", "completion_tokens", "hops"}


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


class FakeBridge:
    """What ``Hops.calling`` reads of a ``GrpcBridge``."""

    def __init__(self):
        self.dials_ok = 0
        self.last_dial_seconds = None


def test_hops_split_the_wait_the_cold_load_its_phases_and_the_backend_call():
    from twisted.internet.task import Clock

    from localai_tw.metrics import HOPS, Hops

    clock = Clock()
    hops = Hops(clock.seconds)
    since = hops.now()
    clock.advance(0.5)
    since = hops.add("placement", since)  # no loaded placement: to the load lock
    clock.advance(2)  # waiting for the lock
    hops.locked()
    clock.advance(0.25)  # picking the node, under the lock
    for phase, took in (("starting", 1), ("staging", 3), ("loading", 4)):
        hops.phase(phase)
        clock.advance(took)
    hops.loaded(since)
    bridge = FakeBridge()
    with hops.calling(bridge):
        clock.advance(0.75)  # the bridge opens a tunnel stream for the call: 0.75 s of it
        bridge.dials_ok, bridge.last_dial_seconds = 1, 0.75
        clock.advance(1.5)
    assert hops.as_dict() == {"queue": 2.0, "placement": 0.5, "cold_load": 8.25,
                              "tunnel": 0.75, "backend": 1.5, "starting": 1.0,
                              "staging": 3.0, "loading": 4.0}
    assert sum(hops.as_dict()[h] for h in HOPS) == clock.seconds()  # nothing counted twice

    warm = Hops(clock.seconds)
    with warm.calling(bridge):  # the bridge's connection is open: no dial, no tunnel hop
        clock.advance(0.5)
    assert warm.as_dict() == {"backend": 0.5}


def test_a_request_that_waited_for_another_load_has_a_queue_but_no_cold_load():
    from twisted.internet.task import Clock

    from localai_tw.metrics import Hops

    clock = Clock()
    hops = Hops(clock.seconds)
    since = hops.now()
    clock.advance(3)  # another replica loaded it meanwhile
    hops.loaded(since)
    assert hops.as_dict() == {"queue": 3.0}


def test_outside_a_request_nothing_is_kept_and_a_trace_carries_its_hops():
    from localai_tw.metrics import Hops, current_hops, trace_hops
    import contextvars

    nowhere = current_hops()
    nowhere.add("backend", nowhere.now() - 5)
    nowhere.phase("staging")
    with nowhere.calling(FakeBridge()):
        pass
    assert nowhere.as_dict() == {}

    def in_a_request():
        hops = Hops()
        trace_hops(hops)
        return current_hops() is hops
    assert contextvars.copy_context().run(in_a_request)
    assert current_hops() is nowhere  # set in that request's context only

    metrics = ReplicaMetrics()
    ring = TraceRing()
    ring.watch(metrics)
    record = metrics.request([b"chat", b"completions"])
    record.hops.backend = 0.25
    record.finished(200, ["n1"])
    assert ring.recent()[0]["hops"] == {"backend": 0.25}


def test_staging_progress_counts_the_bytes_of_the_uploads_in_its_context():
    import io
    import contextvars

    from twisted.internet.task import Clock

    from localai_tw.frontend.inference.loadlock import StagingProgress
    from localai_tw.staging_client import STAGING_WATCH, _CountingFile

    clock = Clock()
    watch = StagingProgress(clock.seconds)

    def upload():
        STAGING_WATCH.set(watch)
        f = _CountingFile(io.BytesIO(b"x" * 1000), 1000, None)
        while f.read(300):
            clock.advance(1)
    contextvars.copy_context().run(upload)
    assert watch.view() == {"staged_bytes": 1000, "total_bytes": 1000, "files": 1,
                            "bytes_per_second": 250.0}
    other = _CountingFile(io.BytesIO(b"y" * 10), 10, None)  # another context: not counted
    other.read(10)
    assert watch.staged == 1000


def test_the_router_times_placement_the_load_it_drove_the_tunnel_and_the_first_token():
    """``InferenceRouter`` with fakes on a ``task.Clock``: a streamed request finds no loaded
    placement (0.125 s), waits 2 s for the lock and loads (phases 1 + 3 + 0.5 s), then its call
    opens a tunnel stream (0.25 s) and the first of two replies comes 0.5 s into the call."""
    import contextvars

    from twisted.internet import defer, task

    from localai_tw.backends import backend_pb2
    from localai_tw.frontend.inference.router import InferenceRouter
    from localai_tw.localai.model_config import parse_model_config
    from localai_tw.frontend.inference.placement import Placement
    from localai_tw.metrics import HOPS, Hops, current_hops, trace_hops

    clock = task.Clock()
    config = parse_model_config({"name": "m", "backend": "echo", "known_usecases": ["chat"]},
                                "m.yaml")

    class Catalog:
        models_dir = "/nowhere"

        def get(self, name):
            return config

    class Chooser:
        async def loaded_placement(self, config, exclude):
            await task.deferLater(clock, 0.125, lambda: None)
            return None

        def touch(self, placement):
            pass

    class Loads:
        async def load(self, config, exclude, deadline):
            await task.deferLater(clock, 2, lambda: None)
            current_hops().locked()
            for phase, took in (("starting", 1), ("staging", 3), ("loading", 0.5)):
                current_hops().phase(phase)
                await task.deferLater(clock, took, lambda: None)
            return Placement("m", "n1", "127.0.0.1:5000", "m")

    bridge = FakeBridge()

    class Client:
        node_id = "n1"

        def __init__(self):
            self.route = bridge  # what the trace reads its tunnel hop from

        async def _stream(self, on_item):
            await task.deferLater(clock, 0.25, lambda: None)  # the bridge dials
            bridge.dials_ok, bridge.last_dial_seconds = 1, 0.25
            for _ in range(2):
                await task.deferLater(clock, 0.25, lambda: None)
                on_item(backend_pb2.Reply(message=b"x"))

        def stream(self, method, request, on_item, deadline):
            return defer.ensureDeferred(self._stream(on_item))

    class Clients:
        def client(self, node_id, port):
            return Client()

    router = InferenceRouter(Catalog(), Chooser(), Loads(), None, Clients(), clock)
    hops = Hops(clock.seconds)

    def request():
        trace_hops(hops)  # as OpenAIResource does, in the request's own context
        return router.predict_stream("m", backend_pb2.PredictOptions(), lambda reply: None)
    serving = contextvars.copy_context().run(request)
    clock.pump([0.125] * 80)  # exact in binary: no drift
    assert serving.called
    assert hops.as_dict() == {"placement": 0.125, "queue": 2.0, "cold_load": 4.5,
                              "starting": 1.0, "staging": 3.0, "loading": 0.5,
                              # first_token is within backend: from the stream's
                              # opening (0.25 s) to the first reply (0.5 s)
                              "tunnel": 0.25, "backend": 0.5, "first_token": 0.25}
    assert sum(hops.as_dict()[h] for h in HOPS) <= clock.seconds()


def test_staging_progress_has_the_announced_total_and_counts_a_held_file_as_staged():
    from twisted.internet.task import Clock

    from localai_tw.frontend.inference.loadlock import StagingProgress

    clock = Clock()
    watch = StagingProgress(clock.seconds)
    watch.expect(1500)  # the plan: a file the worker holds (500 B), then one to send (1000 B)
    watch.skipped(500)
    assert watch.view()["staged_bytes"] == 500 and watch.view()["total_bytes"] == 1500
    watch.begin(1000)
    watch.moved(400)
    clock.advance(2)
    assert watch.view() == {"staged_bytes": 900, "total_bytes": 1500, "files": 2,
                            "bytes_per_second": 200.0}  # the rate of what moved
