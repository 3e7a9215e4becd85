"""Prefix-cache-aware routing (frontend/inference/prefix_index.py, prefix_fanout.py): the hash
chain, the index and its TTL (a ``task.Clock``), the load guard and the choice, the forced-away
pressure and the scale-up it asks for, the chooser's use of it, the bus messages (a small fake
with PgBus's surface; the real bus and real workers are tests/integration/test_prefix_routing.py),
and the model config's ``route_policy``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import pytest_twisted
from twisted.internet import defer, task
from twisted.python import usage

from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.placement import NodeChooser
from localai_tw.frontend.inference.prefix_fanout import INVALIDATE, OBSERVE, PrefixRouting
from localai_tw.frontend.inference.prefix_index import (
    DEFAULT_TTL,
    PrefixIndex,
    PrefixSettings,
    Pressure,
    choose,
    eligible,
    prefix_chain,
    prefix_source,
    valid_chain,
)
from localai_tw.localai.model_config import ModelConfigError, parse_model_config

SYSTEM = ("You are a careful assistant. " * 40).encode()  # 1160 bytes: 4 full windows


# -- the chain ----------------------------------------------------------------------------------


def test_the_chain_is_anchored_at_the_head_so_a_longer_prompt_extends_it():
    turn1 = prefix_chain(SYSTEM + b"user: hello\n")
    turn2 = prefix_chain(SYSTEM + b"user: hello\nassistant: hi\nuser: and now?\n")
    full = len(SYSTEM + b"user: hello\n") // 256  # the windows turn 1 filled completely
    assert turn1[:full] == turn2[:full]
    assert len(turn2) == -(-len(SYSTEM + b"user: hello\nassistant: hi\nuser: and now?\n") // 256)
    # the same text always gives the same values (every replica computes the same chain)
    assert prefix_chain(SYSTEM) == prefix_chain(bytes(SYSTEM))
    assert all(-2 ** 63 <= h < 2 ** 63 for h in turn2)


def test_a_change_in_one_window_changes_that_hash_and_every_later_one():
    other = bytearray(SYSTEM)
    other[300] ^= 1  # window 1
    a, b = prefix_chain(SYSTEM), prefix_chain(bytes(other))
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2] and a[3] != b[3]


def test_the_chain_is_bounded_and_empty_for_no_text():
    assert prefix_chain(b"") == ()
    assert len(prefix_chain(b"x" * 100_000, window=256, max_depth=8)) == 8
    assert len(prefix_chain(b"x", window=256)) == 1


def test_the_source_is_the_prompt_or_the_messages_head_first():
    assert prefix_source(backend_pb2.PredictOptions(Prompt="héllo")) == "héllo".encode()
    options = backend_pb2.PredictOptions(UseTokenizerTemplate=True)
    options.Messages.add(role="system", content="be brief")
    options.Messages.add(role="user", content="hi")
    assert prefix_source(options) == b"system\nbe brief\nuser\nhi\n"
    assert prefix_source(backend_pb2.PredictOptions()) == b""
    # bounded: what the chain can use, not the whole of a huge prompt
    assert prefix_source(backend_pb2.PredictOptions(Prompt="x" * 10**6), 1000) == b"x" * 1000
    for limit in range(1, 30):  # its first ``limit`` bytes are always the whole source's
        assert prefix_source(options, limit)[:limit] == prefix_source(options)[:limit]
    assert prefix_chain(prefix_source(backend_pb2.PredictOptions(Prompt="ab" * 99999), 512),
                        256, 2) == prefix_chain(("ab" * 99999).encode(), 256, 2)


def test_a_chain_from_the_bus_is_checked():
    assert valid_chain([1, -2, 3], 4) == (1, -2, 3)
    for bad in ([], [1] * 5, [True], [2 ** 63], ["1"], "123", None, [1.0]):
        assert valid_chain(bad, 4) is None


# -- the index ----------------------------------------------------------------------------------


def test_the_index_remembers_the_deepest_prefix_each_node_served_until_the_ttl():
    clock = task.Clock()
    index = PrefixIndex(clock, ttl=60)
    conversation = prefix_chain(SYSTEM + b"user: my question\n" * 20)
    assert index.observe("m", conversation[:6], "n1")
    assert index.matches("m", conversation) == {"n1": 6}
    assert index.matches("other-model", conversation) == {}
    # another conversation with the same system prompt on n2: the shared head moves to n2,
    # the deeper blocks n1 served stay n1's
    assert index.observe("m", conversation[:4], "n2")
    assert index.matches("m", conversation) == {"n1": 6, "n2": 4}
    clock.advance(59.9)
    assert index.matches("m", conversation) == {"n1": 6, "n2": 4}
    clock.advance(0.1)
    assert index.matches("m", conversation) == {}  # expired: never used again
    assert index.expire() == 6 and len(index) == 0


def test_observe_tells_what_is_news_for_the_other_replicas():
    clock = task.Clock()
    index = PrefixIndex(clock, ttl=100)
    chain = prefix_chain(SYSTEM)
    assert index.observe("m", chain, "n1")
    assert not index.observe("m", chain, "n1")  # nothing new
    assert index.observe("m", chain, "n2")  # moved
    clock.advance(26)
    assert index.observe("m", chain, "n2")  # refreshed after a quarter of the TTL
    assert not index.observe("m", chain, "")
    assert not index.observe("m", (), "n1")


def test_a_shared_head_is_known_on_every_node_that_served_it_and_the_load_decides():
    """Break: keep one node per hash (the last writer): every new conversation follows the
    shared system prompt to the same worker, and the spread assertion goes red."""
    clock = task.Clock()
    index = PrefixIndex(clock, max_nodes=2)
    head = prefix_chain(SYSTEM)
    one = prefix_chain(SYSTEM + b"user: first conversation, its own words\n" * 8)
    two = prefix_chain(SYSTEM + b"user: second conversation, other words\n" * 8)
    index.observe("m", one, "n1")
    index.observe("m", two, "n2")
    shared = len(SYSTEM) // 256  # the windows the system prompt fills completely
    assert index.matches("m", head) == {"n1": shared, "n2": shared}
    settings = PrefixSettings()
    # a new conversation with the same system prompt: a tie, the less loaded one takes it
    new = prefix_chain(SYSTEM + b"user: a third one\n")
    assert choose(new, index.matches("m", new), {"n1": 1, "n2": 0}, settings).node == "n2"
    assert choose(new, index.matches("m", new), {"n1": 0, "n2": 1}, settings).node == "n1"
    assert choose(new, index.matches("m", new), {"n1": 0, "n2": 0}, settings,
                  lambda nodes: nodes[-1]).node == "n2"  # equal: the replica picks at random
    # each conversation's own windows still name its worker
    assert choose(one, index.matches("m", one), {"n1": 0, "n2": 0}, settings).node == "n1"
    away = choose(one, index.matches("m", one), {"n1": 1, "n2": 0}, settings)
    assert away.node == "n2" and away.forced_away  # busy: the shared head's other node
    index.observe("m", head, "n3")  # a third node on the head: the least recently seen goes
    assert index.matches("m", head) == {"n2": shared, "n3": len(head)}
    assert index.matches("m", one) == {"n1": len(one), "n2": shared, "n3": shared}


def test_the_index_is_bounded_and_a_departed_node_is_dropped():
    clock = task.Clock()
    index = PrefixIndex(clock, max_entries=5)
    index.observe("m", (1, 2, 3), "n1")
    clock.advance(1)
    index.observe("m", (4, 5, 6), "n2")
    assert len(index) == 5  # the least recently seen went first
    assert index.matches("m", (1,)) == {}  # the oldest entry went
    # a deeper entry stands for its whole prefix (its hash covers every earlier window)
    assert index.matches("m", (1, 2, 3)) == {"n1": 3}
    assert index.matches("m", (4, 5, 6)) == {"n2": 3}
    assert index.drop_node("n2") == 3
    assert index.matches("m", (4, 5, 6)) == {}
    index.observe("a", (7,), "n3")
    index.observe("b", (8,), "n3")
    assert index.drop_node("n3", "a") == 1 and index.matches("b", (8,)) == {"n3": 1}
    with pytest.raises(ValueError):
        PrefixIndex(clock, ttl=0)


# -- the load guard and the choice --------------------------------------------------------------


def test_the_load_guard_has_an_absolute_and_a_relative_slack():
    assert eligible({"a": 10, "b": 12, "c": 13}, 2, 1.5) == {"a", "b"}  # abs: <= 10 + 2
    # rel: 4 * 1.5 = 6 bounds it before the absolute 4 + 8 would
    assert eligible({"a": 4, "b": 6, "c": 7}, 8, 1.5) == {"a", "b"}
    # while a node is idle, only idle nodes are eligible (no call queues behind another)
    assert eligible({"a": 0, "b": 0, "c": 1}, 2, 1.5) == {"a", "b"}
    assert eligible({}, 2, 1.5) == set()


def test_the_warm_node_wins_unless_it_is_too_busy():
    settings = PrefixSettings()
    chain = tuple(range(10))
    warm = {"n1": 10, "n2": 2}
    assert choose(chain, warm, {"n1": 0, "n2": 0}, settings).node == "n1"
    assert choose(chain, warm, {"n1": 12, "n2": 10}, settings).node == "n1"  # in the slack
    busy = choose(chain, warm, {"n1": 1, "n2": 0}, settings)
    assert busy.node is None and busy.forced_away  # n2's 2 of 10 is below min_match
    deeper_elsewhere = choose(chain, {"n1": 10, "n2": 5}, {"n1": 13, "n2": 10}, settings)
    assert deeper_elsewhere == type(deeper_elsewhere)("n2", 5, True)


def test_no_preference_without_a_useful_match_on_a_candidate():
    settings = PrefixSettings(min_match=0.5)
    chain = tuple(range(10))
    assert choose(chain, {"n1": 4}, {"n1": 0, "n2": 0}, settings).node is None  # too short
    gone = choose(chain, {"n9": 10}, {"n1": 0, "n2": 0}, settings)
    assert gone.node is None and not gone.forced_away  # not a candidate: never preferred
    assert choose((), {"n1": 10}, {"n1": 0}, settings).node is None
    # equal matches: the less loaded, then by name
    assert choose(chain, {"n1": 10, "n2": 10}, {"n1": 1, "n2": 0}, settings).node == "n2"


def test_settings_are_checked_and_the_model_policy_wins():
    with pytest.raises(ValueError):
        PrefixSettings(balance_rel=0.5)
    with pytest.raises(ValueError):
        PrefixSettings(min_match=1.5)
    with pytest.raises(ValueError):
        PrefixSettings(ttl=0)
    assert PrefixSettings().policy("") == "prefix_cache"
    assert PrefixSettings(enabled=False).policy("") == "round_robin"
    assert PrefixSettings(enabled=False).policy("prefix_cache") == "prefix_cache"
    assert PrefixSettings().policy("round_robin") == "round_robin"


def test_pressure_counts_forced_away_routings_within_its_window():
    clock = task.Clock()
    pressure = Pressure(clock, window=60)
    pressure.record("m")
    clock.advance(30)
    pressure.record("m")
    assert pressure.count("m") == 2 and pressure.count("other") == 0
    clock.advance(30.1)
    assert pressure.count("m") == 1
    pressure.reset("m")
    assert pressure.count("m") == 0 and list(pressure.models()) == []


# -- the routing object, the chooser, the scaler ------------------------------------------------


@dataclass
class Config:
    name: str
    route_policy: str = ""
    node_selector: dict = field(default_factory=dict)
    model: str = "m.bin"

    def file_for_model(self):
        return None


def chat(text: str):
    return backend_pb2.PredictOptions(Prompt=text)


def test_chain_for_follows_the_policy():
    clock = task.Clock()
    on = PrefixRouting(PrefixSettings(), clock)
    off = PrefixRouting(PrefixSettings(enabled=False), clock)
    assert on.chain_for(Config("m"), chat("hello")) == prefix_chain(b"hello")
    assert on.chain_for(Config("m", "round_robin"), chat("hello")) == ()
    assert off.chain_for(Config("m"), chat("hello")) == ()
    assert off.chain_for(Config("m", "prefix_cache"), chat("hello")) == prefix_chain(b"hello")


class RowsDB:
    """The chooser's two reads: no scheduling row, then the loaded candidates."""

    def __init__(self, nodes):
        self.nodes = nodes

    def runQuery(self, sql, params=None):
        if "backend_nodes" not in sql:
            return defer.succeed([])
        return defer.succeed([(n, 1, f"127.0.0.1:{30000 + i}", "m.bin", True)
                              for i, n in enumerate(self.nodes)])


@pytest_twisted.ensureDeferred
async def test_the_chooser_sends_a_conversation_to_its_warm_node_and_spreads_a_hot_one():
    """Break: drop the ``prefix.pick`` branch of ``NodeChooser.loaded_placement`` (the warm
    node is not preferred), or make ``eligible`` ignore the in-flight counts (the hot node
    takes everything): this goes red."""
    clock = task.Clock()
    in_flight: dict[str, int] = {"n1": 0, "n2": 0}
    routing = PrefixRouting(PrefixSettings(), clock)
    chooser = NodeChooser(RowsDB(["n1", "n2"]), nodes=None, fence=None,
                          in_flight=lambda node, model: in_flight[node], prefix=routing)
    config = Config("m")
    turn1 = routing.chain_for(config, chat(SYSTEM.decode() + "user: one\n"))
    routing.observe("m", turn1, "n2")
    turn2 = routing.chain_for(config, chat(SYSTEM.decode() + "user: one\nbot: two\nuser: 3\n"))
    for _ in range(20):  # no randomness left: always the warm node
        placement = await chooser.loaded_placement(config, frozenset(), turn2)
        assert placement.node_id == "n2" and placement.choice_of == 2
    in_flight["n2"] = 3  # the warm node runs 3 calls of this replica, n1 none
    placement = await chooser.loaded_placement(config, frozenset(), turn2)
    assert placement.node_id == "n1"
    assert routing.pressure.count("m") == 1  # forced away once
    # without a chain (round robin), the least loaded
    assert (await chooser.loaded_placement(config, frozenset(), ())).node_id == "n1"


@pytest_twisted.ensureDeferred
async def test_the_router_records_a_routing_only_when_it_was_a_choice():
    """Break: drop ``placement.choice_of > 1`` from the router: a model on one node publishes
    an observation for its request and this goes red."""
    from localai_tw.frontend.inference.router import InferenceRouter

    class Catalog:
        def get(self, name):
            return Config(name)

    class Client:
        def call(self, method, request, deadline):
            return defer.succeed(backend_pb2.Reply(message=b"ok"))

    class Clients:
        def client(self, node_id, port):
            return Client()

    class DB(RowsDB):
        def runOperation(self, sql, params=None):
            return defer.succeed(None)

    for nodes, told in ((["n1"], 0), (["n1", "n2"], 1)):
        clock = task.Clock()
        bus = FakeBus()
        routing = PrefixRouting(PrefixSettings(), clock, bus)
        routing.startService()
        chooser = NodeChooser(DB(nodes), nodes=None, fence=None, prefix=routing)
        router = InferenceRouter(Catalog(), chooser, None, None, Clients(), clock,
                                 prefix=routing)
        served = await router.predict("m", chat(SYSTEM.decode()))
        assert served.served_by in nodes
        assert len(bus.published) == told and (len(routing.index) > 0) == bool(told), nodes
        routing.stopService()


def test_forced_away_routings_ask_the_scaler_for_another_replica():
    """Break: drop the ``pressured`` branch of ``ReplicaScaler.note``: nothing is scaled."""
    from localai_tw.frontend.inference.replicas import ReplicaScaler
    from localai_tw.frontend.inference.usage import ModelUse
    from localai_tw.frontend.inference.placement import Candidate

    clock = task.Clock()
    pressure = Pressure(clock)
    scaled: list[int] = []

    class Chooser:
        async def replica_bounds(self, name):
            return 0, 3

        async def candidates(self, config):
            return [Candidate("n1", 1, "a:1"), Candidate("n2", 1, "a:2"),
                    Candidate("n3", 0, None)]

    class Loads:
        async def scale_up(self, config, want):
            scaled.append(want)

    scaler = ReplicaScaler(None, None, Chooser(), Loads(), ModelUse(None, clock), clock,
                           pressure=pressure)
    scaler.note(Config("m"), "n1")
    assert scaled == []  # idle, no pressure: not even a query
    pressure.record("m")
    scaler.note(Config("m"), "n1")
    assert scaled == [3] and pressure.count("m") == 0  # acted on, then reset
    scaler.note(Config("m"), "n1")
    assert scaled == [3]


class FakeSubscription:
    def __init__(self, bus, subject):
        self.bus, self.subject = bus, subject

    def unsubscribe(self):
        self.bus.handlers.pop(self.subject, None)
        return defer.succeed(None)


class FakeBus:
    isConnected = True

    def __init__(self, fail_subscribe: int = 0):
        self.handlers: dict = {}
        self.published: list = []
        self.fail_subscribe = fail_subscribe

    def subscribe(self, subject, handler):
        if subject == INVALIDATE and self.fail_subscribe:
            self.fail_subscribe -= 1
            return defer.fail(ConnectionError("bus down"))
        self.handlers[subject] = handler
        return defer.succeed(FakeSubscription(self, subject))

    def publish(self, subject, payload):
        self.published.append((subject, payload))
        return defer.succeed(None)


def test_news_goes_on_the_bus_and_what_arrives_is_checked():
    clock = task.Clock()
    bus = FakeBus()
    routing = PrefixRouting(PrefixSettings(), clock, bus)
    routing.startService()
    assert routing.live() and set(bus.handlers) == {OBSERVE, INVALIDATE}
    chain = prefix_chain(SYSTEM)
    routing.observe("m", chain, "n1")
    routing.observe("m", chain, "n1")  # not news: not published again
    assert bus.published == [(OBSERVE, {"m": "m", "n": "n1", "c": list(chain)})]

    other = PrefixRouting(PrefixSettings(), clock, FakeBus())
    other.startService()
    for subject, payload in bus.published:
        other._received(subject, payload)
    assert other.index.matches("m", chain) == {"n1": len(chain)}
    for bad in ({"m": "m", "n": "n2", "c": ["x"]}, {"m": "m", "n": "", "c": [1]},
                {"m": "m" * 300, "n": "n2", "c": [1]}, {"m": "m", "n": "n2", "c": [1], "x": 1},
                ["m"], None, {"n": 5}):
        other._received(OBSERVE, bad)
    assert other.index.matches("m", chain) == {"n1": len(chain)} and other.applied == 1

    routing.node_departed("n1")  # the departure notifier: dropped here and everywhere
    assert routing.index.matches("m", chain) == {}
    assert bus.published[-1] == (INVALIDATE, {"n": "n1"})
    other._received(INVALIDATE, {"n": "n1"})
    assert other.index.matches("m", chain) == {}

    clock.advance(DEFAULT_TTL)  # the expiry loop runs
    routing.stopService()
    other.stopService()
    assert bus.handlers == {} and not clock.getDelayedCalls()


def test_a_failed_subscription_is_undone_and_retried():
    from localai_tw.frontend.inference.prefix_fanout import RESUBSCRIBE_SECONDS

    clock = task.Clock()
    bus = FakeBus(fail_subscribe=1)
    routing = PrefixRouting(PrefixSettings(), clock, bus)
    routing.startService()
    assert not routing.live() and bus.handlers == {}  # the first one was undone
    routing.observe("m", (1, 2), "n1")
    assert bus.published == []  # nobody would hear it: not published
    clock.advance(RESUBSCRIBE_SECONDS)
    assert routing.live() and set(bus.handlers) == {OBSERVE, INVALIDATE}
    routing.stopService()
    assert bus.handlers == {} and not clock.getDelayedCalls()


# -- configuration ------------------------------------------------------------------------------


def test_route_policy_in_the_model_config():
    assert parse_model_config({"name": "a", "backend": "echo"}).route_policy == ""
    config = parse_model_config({"name": "a", "backend": "echo", "route_policy": "round_robin"})
    assert config.route_policy == "round_robin" and not config.warnings
    with pytest.raises(ModelConfigError, match="route_policy"):
        parse_model_config({"name": "a", "backend": "echo", "route_policy": "sticky"})


def test_the_frontend_options():
    from localai_tw.frontend.service import ReplicaConfig
    from localai_tw.frontend.tap import Options

    def parsed(argv, environ=None):
        options = Options(environ or {})
        options.parseOptions(["--single-host", *argv])
        return ReplicaConfig.from_options(options, "0", 1.0, 60.0)

    default = parsed([])
    assert default.prefix_cache is True and default.prefix_cache_ttl == 300.0
    off = parsed(["--distributed-prefix-cache=false", "--distributed-prefix-cache-ttl=90s"])
    assert off.prefix_cache is False and off.prefix_cache_ttl == 90.0
    assert parsed([], {"LOCALAI_DISTRIBUTED_PREFIX_CACHE": "off"}).prefix_cache is False
    with pytest.raises(usage.UsageError, match="distributed-prefix-cache"):
        parsed(["--distributed-prefix-cache=maybe"])
