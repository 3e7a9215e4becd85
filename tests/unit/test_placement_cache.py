"""The warm path's placement cache (frontend/inference/placement_cache.py): what it keeps, for how long,
and every way an entry is dropped (the fan-out, the bus reconnecting, a failed call, the TTL).

Time is a ``task.Clock``; the bus is a small fake with PgBus's surface (publish, subscribe,
onReconnect, isConnected); the real bus carries the messages in the integration test
(tests/integration/test_placement_cache.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from twisted.internet import defer, task

from localai_tw import errors
from localai_tw.frontend.inference.placement import Candidate, NodeChooser, Placement
from localai_tw.frontend.inference.placement_cache import (
    DEFAULT_TTL,
    RESUBSCRIBE_SECONDS,
    SUBJECT,
    PlacementCache,
    PlacementFanout,
)


@dataclass
class Config:
    name: str
    node_selector: dict = field(default_factory=dict)

    def file_for_model(self):
        return None

    model: str = "m.bin"


def loaded(*nodes):
    return [Candidate(n, 1, f"127.0.0.1:{30000 + i}", "m.bin", True)
            for i, n in enumerate(nodes)]


def test_an_entry_is_served_until_the_ttl_then_read_again():
    clock = task.Clock()
    cache = PlacementCache(clock)
    a = Config("a")
    assert cache.get(a) is None
    assert cache.put(a, loaded("n1"), cache.token())
    assert [c.node_id for c in cache.get(a)] == ["n1"]
    clock.advance(DEFAULT_TTL - 0.01)
    assert cache.get(a) is not None
    clock.advance(0.01)
    assert cache.get(a) is None and len(cache) == 0
    assert (cache.hits, cache.misses) == (2, 2)


def test_nothing_empty_is_kept_and_a_changed_config_misses():
    cache = PlacementCache(task.Clock())
    a = Config("a")
    assert not cache.put(a, [], cache.token())  # not loaded anywhere: the next one reads
    cache.put(a, loaded("n1"), cache.token())
    edited = Config("a", {"gpu": "yes"})  # the YAML was reloaded: another selector
    assert cache.get(edited) is None and len(cache) == 0


def test_drop_node_drops_every_model_it_serves_and_nothing_else():
    cache = PlacementCache(task.Clock())
    a, b, c = Config("a"), Config("b"), Config("c")
    cache.put(a, loaded("n1", "n2"), cache.token())
    cache.put(b, loaded("n2"), cache.token())
    cache.put(c, loaded("n3"), cache.token())
    cache.drop_node("n2")
    assert cache.get(a) is None and cache.get(b) is None
    assert [x.node_id for x in cache.get(c)] == ["n3"]
    cache.drop_model("c")
    assert cache.get(c) is None


def test_a_fill_that_raced_an_invalidation_is_not_kept():
    cache = PlacementCache(task.Clock())
    a = Config("a")
    token = cache.token()        # the request starts reading the database ...
    cache.drop_node("n1")        # ... n1 departs meanwhile ...
    assert not cache.put(a, loaded("n1"), token)  # ... so what it read is not kept
    assert cache.get(a) is None


def test_bounded_the_least_recently_filled_goes_first():
    cache = PlacementCache(task.Clock(), max_models=2)
    configs = [Config(f"m{i}") for i in range(3)]
    for config in configs:
        cache.put(config, loaded("n1"), cache.token())
    assert len(cache) == 2
    assert cache.get(configs[0]) is None
    assert cache.get(configs[1]) is not None and cache.get(configs[2]) is not None
    with pytest.raises(ValueError):
        PlacementCache(task.Clock(), max_models=0)
    with pytest.raises(ValueError):
        PlacementCache(task.Clock(), ttl=0)


# -- the fan-out -----------------------------------------------------------------------------


class FakeSubscription:
    def __init__(self, bus):
        self.bus = bus

    def unsubscribe(self):
        self.bus.handler = None
        return defer.succeed(None)


class FakeBus:
    """PgBus's surface: what the fan-out uses of it."""

    def __init__(self, subscribe_fails: int = 0):
        self.isConnected = True
        self.published: list[tuple[str, object]] = []
        self.handler = None
        self.reconnect_callbacks = []
        self.subscribe_fails = subscribe_fails

    def publish(self, subject, payload):
        self.published.append((subject, payload))
        return defer.succeed(None)

    def subscribe(self, pattern, handler):
        if self.subscribe_fails:
            self.subscribe_fails -= 1
            return defer.fail(RuntimeError("LISTEN failed"))
        assert pattern == SUBJECT
        self.handler = handler
        return defer.succeed(FakeSubscription(self))

    def onReconnect(self, callback):
        self.reconnect_callbacks.append(callback)
        return lambda: self.reconnect_callbacks.remove(callback)

    def reconnect(self):
        for callback in self.reconnect_callbacks:
            callback()


def started(bus, clock=None):
    clock = clock or task.Clock()
    fanout = PlacementFanout(PlacementCache(clock), bus, clock)
    fanout.startService()
    return fanout, clock


def test_a_message_from_another_replica_drops_the_node_or_the_model():
    bus = FakeBus()
    fanout, _ = started(bus)
    cache = fanout.cache
    a, b = Config("a"), Config("b")
    cache.put(a, loaded("n1"), cache.token())
    cache.put(b, loaded("n2"), cache.token())
    bus.handler(SUBJECT, {"node": "n1"})
    assert cache.get(a) is None and cache.get(b) is not None
    bus.handler(SUBJECT, {"model": "b"})
    assert cache.get(b) is None


@pytest.mark.parametrize("payload", [
    None, "n1", ["n1"], {}, {"node": 1}, {"node": ""}, {"node": "n1", "model": "a"},
    {"node": "x" * 256}, {"what": "n1"},
])
def test_a_malformed_message_is_ignored(payload):
    bus = FakeBus()
    fanout, _ = started(bus)
    a = Config("a")
    fanout.cache.put(a, loaded("n1"), fanout.cache.token())
    bus.handler(SUBJECT, payload)
    assert fanout.cache.get(a) is not None


def test_what_this_replica_learns_is_dropped_here_and_published():
    bus = FakeBus()
    fanout, _ = started(bus)
    a = Config("a")
    fanout.cache.put(a, loaded("n1"), fanout.cache.token())
    fanout.node_changed("n1")
    assert fanout.cache.get(a) is None
    fanout.cache.put(a, loaded("n1"), fanout.cache.token())
    fanout.model_changed("a")
    assert fanout.cache.get(a) is None
    assert bus.published == [(SUBJECT, {"node": "n1"}), (SUBJECT, {"model": "a"})]


def test_nothing_is_served_while_the_bus_is_down_and_a_reconnect_clears_everything():
    bus = FakeBus()
    fanout, _ = started(bus)
    a = Config("a")
    fanout.cache.put(a, loaded("n1"), fanout.cache.token())
    bus.isConnected = False  # a message sent now would be lost
    assert fanout.cache.get(a) is None
    assert not fanout.cache.put(a, loaded("n1"), fanout.cache.token())
    bus.isConnected = True
    bus.reconnect()
    assert fanout.cache.get(a) is None and len(fanout.cache) == 0


def test_off_until_subscribed_and_the_subscription_is_retried():
    bus = FakeBus(subscribe_fails=1)
    fanout, clock = started(bus)
    a = Config("a")
    assert not fanout.live()
    assert not fanout.cache.put(a, loaded("n1"), fanout.cache.token())
    clock.advance(RESUBSCRIBE_SECONDS)
    assert fanout.live()
    assert fanout.cache.put(a, loaded("n1"), fanout.cache.token())
    fanout.stopService()
    assert not fanout.live() and len(fanout.cache) == 0 and bus.handler is None
    assert bus.reconnect_callbacks == []


# -- the chooser with a cache -------------------------------------------------------------


class CountingDB:
    """Answers the chooser's two reads (scheduling row, candidates) and counts statements."""

    def __init__(self, rows):
        self.rows = rows
        self.statements = 0

    def runQuery(self, sql, params=None):
        self.statements += 1
        if "model_scheduling_configs" in sql and "backend_nodes" not in sql:
            return defer.succeed([])
        if sql.startswith("DELETE FROM node_models"):
            return defer.succeed([("row",)])
        return defer.succeed(list(self.rows))


def chooser_with_cache(rows):
    db = CountingDB(rows)
    chooser = NodeChooser(db, nodes=None, fence=None)
    chooser.cache = PlacementCache(task.Clock())
    return chooser, db


def placement_of(chooser, config, exclude=frozenset()):
    return defer.ensureDeferred(chooser.loaded_placement(config, exclude))


def test_a_warm_placement_reads_nothing_and_a_retry_reads_again():
    chooser, db = chooser_with_cache([("n1", 1, "127.0.0.1:1", "m.bin", True)])
    a = Config("a")
    first = placement_of(chooser, a)
    assert first.result.node_id == "n1" and db.statements == 2
    second = placement_of(chooser, a)
    assert second.result == first.result and db.statements == 2  # warm: no statement
    placement_of(chooser, a, frozenset({"n2"}))  # a retry excludes a node: it reads
    assert db.statements == 4


def test_a_failed_call_and_a_reap_drop_the_entry():
    chooser, db = chooser_with_cache([("n1", 1, "127.0.0.1:1", "m.bin", True)])
    told = []
    chooser.on_reaped = told.append
    a = Config("a")
    placement = placement_of(chooser, a).result
    chooser.forget(placement)
    placement_of(chooser, a)
    assert db.statements == 4  # read again after the failure
    defer.ensureDeferred(chooser.reap(placement, errors.StreamRefused("n1", "no_backend", "nothing listens")))
    assert told == ["a"]


def test_a_reap_on_anything_but_the_worker_answer_still_refuses():
    chooser, _ = chooser_with_cache([])
    told = []
    chooser.on_reaped = told.append
    placement = Placement("a", "n1", "127.0.0.1:1", "m.bin")
    d = defer.ensureDeferred(chooser.reap(placement, errors.AbsentWithinGrace("n1", "away")))
    assert isinstance(d.result.value, ValueError)
    d.addErrback(lambda _: None)
    assert told == []


# -- the OpenAI layer's model view, built once per config object --------------------------


def test_a_model_view_is_built_once_per_config_object():
    from localai_tw.localai.model_config import parse_model_config
    from localai_tw.frontend.api.openai.requests import ModelView

    first = parse_model_config({"name": "viewed", "backend": "echo"})
    assert ModelView.of(first) is ModelView.of(first)
    edited = parse_model_config({"name": "viewed", "backend": "other"})  # the file changed
    assert ModelView.of(edited).backend == "other" and ModelView.of(first).backend == "echo"
    assert ModelView.of({"name": "plain"}) is not ModelView.of({"name": "plain"})
