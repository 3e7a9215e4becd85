"""Model loading through a real replica and worker (echo backend as a real process): a request
for what the model's config does not list is asked of its backend (LocalAI's rule) and never
unloads a loaded model; a failed load is remembered for a short window, shared by requests already waiting,
and tried again after it (or at once when the config changes)."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task

from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.interfaces import ModelLoadFailed
from localai_tw.frontend.inference.loadlock import DEFAULT_FAILED_LOAD_MEMORY


class CountingControl:
    """The replica's real control client, counting the verbs it sends to workers."""

    def __init__(self, real):
        self.real = real
        self.verbs: list[str] = []

    def call(self, node_id, verb, *args, **kwargs):
        self.verbs.append(verb)
        return self.real.call(node_id, verb, *args, **kwargs)


def count_control(frontend) -> CountingControl:
    loader = frontend.replica.inference.loader
    counting = CountingControl(loader._control)
    loader._control = counting
    return counting


@pytest_twisted.ensureDeferred
async def test_a_request_the_config_does_not_list_is_served_and_unloads_nothing(cluster):
    # LocalAI's rule: use cases never refuse; the loaded model is asked, never reaped for it
    cluster.write_model("vec.yaml", "name: vec\nbackend: echo\nembeddings: true\n"
                                    "options: ['echo.dim:4']\n")
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    control = count_control(frontend)
    router = frontend.replica.inference

    served = await router.embed("vec", backend_pb2.PredictOptions(Embeddings="x"))
    [loaded] = await cluster.rows("vec")
    assert loaded[2] == "loaded" and control.verbs == ["backend.start"]
    answered = await router.predict("vec", backend_pb2.PredictOptions(Prompt="one two"))
    assert answered.value.message == b"one two"  # the echo backend answers it
    for _ in range(3):
        await router.predict_stream("vec", backend_pb2.PredictOptions(Prompt="x"),
                                    lambda reply: None)
    assert await cluster.rows("vec") == [loaded]  # same row, same address: never unloaded
    again = await router.embed("vec", backend_pb2.PredictOptions(Embeddings="x"))
    assert list(again.value.embeddings) == list(served.value.embeddings)
    assert control.verbs == ["backend.start"]


@pytest_twisted.ensureDeferred
async def test_rerank_on_a_chat_listed_model_is_asked_of_its_backend(cluster):
    cluster.write_model("talk.yaml", "name: talk\nbackend: echo\nknown_usecases: [chat]\n")
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    router = frontend.replica.inference

    served = await router.rerank("talk", backend_pb2.RerankRequest(
        query="red cat", documents=["a red cat", "blue sky"], top_n=2))
    assert [r.index for r in served.value.results][0] == 0  # echo's word-overlap ranking


BAD = "name: bad\nbackend: echo\noptions: ['echo.fail_load:{why}']\n"


@pytest_twisted.ensureDeferred
async def test_a_failed_load_is_remembered_then_retried(cluster):
    cluster.write_model("bad.yaml", BAD.format(why="no weights here"))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    control = count_control(frontend)
    router = frontend.replica.inference
    loads = router.loads
    assert loads.failed_load_memory == DEFAULT_FAILED_LOAD_MEMORY == 30.0

    with pytest.raises(ModelLoadFailed, match="no weights here") as first:
        await router.predict("bad", backend_pb2.PredictOptions(Prompt="x"))
    assert first.value.retry_in == 30.0
    assert "tried again in 30 s" in str(first.value)
    starts = control.verbs.count("backend.start")
    assert starts == 1

    # within the window: the same error at once, no worker asked
    with pytest.raises(ModelLoadFailed, match="no weights here") as second:
        await router.predict("bad", backend_pb2.PredictOptions(Prompt="x"))
    assert 0 < second.value.retry_in <= 30.0
    assert "tried again in" in str(second.value)
    assert control.verbs.count("backend.start") == 1

    # after the window the load is tried again (shortened here, on the same clock)
    loads._failed["bad"] = (*loads._failed["bad"][:2], reactor.seconds() + 0.2)
    await task.deferLater(reactor, 0.3, lambda: None)
    with pytest.raises(ModelLoadFailed, match="no weights here"):
        await router.predict("bad", backend_pb2.PredictOptions(Prompt="x"))
    assert control.verbs.count("backend.start") == 2

    # a changed config is a new model: tried at once
    cluster.write_model("bad.yaml", BAD.format(why="still broken"))
    frontend.replica.inference.catalog.refresh()
    with pytest.raises(ModelLoadFailed, match="still broken"):
        await router.predict("bad", backend_pb2.PredictOptions(Prompt="x"))
    assert control.verbs.count("backend.start") == 3


@pytest_twisted.ensureDeferred
async def test_requests_waiting_for_a_failing_load_share_its_failure(cluster):
    cluster.write_model("bad.yaml", BAD.format(why="corrupt"))
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    control = count_control(frontend)
    router = frontend.replica.inference

    results = await defer.DeferredList(
        [router.predict("bad", backend_pb2.PredictOptions(Prompt="x")) for _ in range(4)],
        consumeErrors=True)
    assert all(not ok and failure.check(ModelLoadFailed) for ok, failure in results)
    assert control.verbs.count("backend.start") == 1  # one load, four answers
