"""The departure notifier: named subscribers, edge-triggered, failures isolated.  No I/O."""

import pytest
from twisted.internet import defer
from twisted.logger import LogLevel, globalLogPublisher

from localai_tw.cluster.departure import DepartureNotifier


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, node_id):
        self.calls.append(node_id)


@pytest.fixture
def logged():
    events = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


def result_of(d):
    out = []
    d.addBoth(out.append)
    assert out, "the Deferred did not fire"
    return out[0]


def test_subscribers_are_required_at_construction():
    with pytest.raises(TypeError):
        DepartureNotifier()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="mapping"):
        DepartureNotifier([lambda n: None])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not callable"):
        DepartureNotifier({"cache": "nope"})
    with pytest.raises(TypeError, match="names"):
        DepartureNotifier({"": lambda n: None})
    assert dict(DepartureNotifier({}).subscribers) == {}  # none: an explicit, visible choice


def test_subscribers_are_fixed_at_construction():
    wiring = {"a": Recorder()}
    notifier = DepartureNotifier(wiring)
    wiring["b"] = Recorder()
    result_of(notifier.departed("n1"))
    assert wiring["b"].calls == []
    with pytest.raises(TypeError):
        notifier.subscribers["c"] = Recorder()  # type: ignore[index]


def test_fires_each_subscriber_once_per_departure():
    a, b = Recorder(), Recorder()
    notifier = DepartureNotifier({"a": a, "b": b})
    assert result_of(notifier.departed("n1")) == {"a": None, "b": None}
    assert a.calls == ["n1"] and b.calls == ["n1"]
    # edge-triggered: again without present() in between does nothing
    assert result_of(notifier.departed("n1")) == {}
    assert result_of(notifier.departed("n1")) == {}
    assert a.calls == ["n1"] and b.calls == ["n1"]
    assert notifier.is_departed("n1")


def test_present_re_arms_the_edge():
    a = Recorder()
    notifier = DepartureNotifier({"a": a})
    notifier.departed("n1")
    notifier.present("n1")
    assert not notifier.is_departed("n1")
    notifier.departed("n1")
    assert a.calls == ["n1", "n1"]
    # present() on a node never announced is harmless
    notifier.present("never")


def test_nodes_are_independent():
    a = Recorder()
    notifier = DepartureNotifier({"a": a})
    notifier.departed("n1")
    notifier.departed("n2")
    notifier.departed("n1")
    assert a.calls == ["n1", "n2"]


def test_a_raising_subscriber_is_isolated_and_logged(logged):
    before, after = Recorder(), Recorder()

    def broken(node_id):
        raise RuntimeError("cache exploded")

    notifier = DepartureNotifier({"a-before": before, "broken": broken, "z-after": after})
    outcome = result_of(notifier.departed("n1"))
    assert before.calls == ["n1"] and after.calls == ["n1"]
    assert outcome["a-before"] is None and outcome["z-after"] is None
    assert outcome["broken"].check(RuntimeError)
    failures = [e for e in logged if e.get("log_level") == LogLevel.critical
                and e.get("name") == "broken"]
    assert len(failures) == 1 and failures[0]["node"] == "n1"


def test_a_failing_deferred_or_coroutine_is_isolated():
    slow = defer.Deferred()
    ok = Recorder()

    async def coroutine_fails(node_id):
        raise ValueError("no")

    notifier = DepartureNotifier({"coro": coroutine_fails, "deferred": lambda n: slow, "ok": ok})
    d = notifier.departed("n1")
    assert ok.calls == ["n1"]
    assert not d.called  # waits for the Deferred subscriber
    slow.errback(KeyError("late"))
    outcome = result_of(d)
    assert outcome["coro"].check(ValueError)
    assert outcome["deferred"].check(KeyError)
    assert outcome["ok"] is None


def test_a_failing_subscriber_still_counts_the_departure():
    calls = []

    def broken(node_id):
        calls.append(node_id)
        raise RuntimeError("x")

    notifier = DepartureNotifier({"broken": broken})
    result_of(notifier.departed("n1"))
    result_of(notifier.departed("n1"))
    assert calls == ["n1"]  # not retried on every tick: the edge is consumed
