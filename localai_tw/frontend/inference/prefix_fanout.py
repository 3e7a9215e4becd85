"""Prefix-cache-aware routing shared by every replica: this replica's :class:`PrefixIndex`
(``prefix_index.py``), fed by what every replica routed, through the bus.

Why the bus and not a table: the index is read on every chat request to a model with two or
more loaded replicas, and the warm path reads no database (``placement_cache.py``); a lookup
here is a few dictionary reads.  What one replica learns (a node served a prompt whose head
the index did not know there yet) is published once on ``prefixcache.observe``, and every
replica, this one included, applies it; a conversation served by replica A whose next turn
arrives at replica B is routed by B to the same worker, as soon as the NOTIFY arrived
(milliseconds; a user's next turn comes seconds later).  What can be lost is only a hint: a
replica that starts, or a NOTIFY lost in a reconnect, means a miss (the usual least-loaded
choice), never a wrong answer.  Entries expire on each replica's own clock after the TTL, as
in LocalAI.

A departed node (the ``DepartureNotifier``) is dropped here and on every replica
(``prefixcache.invalidate``); a model unloaded from a node needs nothing: only loaded
candidates are ever preferred, and a reload starts with a cold cache that the next observation
overwrites.

Messages from other replicas are untrusted input: anything but the expected shape (bounded
names, a chain of 64-bit integers no longer than ``max_depth``) is ignored.

This module must never read the database on a request's path, never make a request wait for
the bus (publishing is fire and forget; a failure is logged and costs a miss elsewhere), and
never decide anything but a preference among the candidates it is handed.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

from twisted.application.service import Service
from twisted.internet import defer, task
from twisted.logger import Logger

from localai_tw import metrics as replica_metrics

from localai_tw.frontend.inference.prefix_index import (
    PREFIX_CACHE,
    PrefixIndex,
    PrefixSettings,
    Pressure,
    choose,
    prefix_chain,
    prefix_source,
    valid_chain,
)

log = Logger()

OBSERVE, INVALIDATE = "prefixcache.observe", "prefixcache.invalidate"
#: Longest node id or model name accepted from a bus message.
MAX_NAME_CHARS = 255
#: Seconds between attempts to subscribe when the bus could not.
RESUBSCRIBE_SECONDS = 5.0


def _name(value) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS:
        return value
    return None


class PrefixRouting(Service):
    """The prefix routing of one replica (module docstring).

    :param bus: a ``PgBus`` started before this service, or None (this replica only).
    :param metrics: ``ReplicaMetrics`` (``prefix_routed``).
    """

    name = "prefix-routing"

    def __init__(self, settings: PrefixSettings, reactor, bus=None, *,
                 metrics: replica_metrics.ReplicaMetrics = replica_metrics.DISCARD,
                 index: PrefixIndex | None = None, pressure: Pressure | None = None):
        self.settings = settings
        self.index = index if index is not None else PrefixIndex(reactor, ttl=settings.ttl)
        self.pressure = pressure if pressure is not None else Pressure(reactor)
        self._reactor = reactor
        self._random = random.Random()
        self._bus = bus
        self._metrics = metrics
        self._subscriptions: list = []
        self._retry = None
        self._expiry: task.LoopingCall | None = None
        #: Counters (tests and the benchmark): published observations, received ones applied.
        self.published = 0
        self.applied = 0

    # -- the request path -------------------------------------------------------------------

    def chain_for(self, config, options) -> tuple[int, ...]:
        """The chain of a ``PredictOptions`` for ``config``; empty when its policy is not
        ``prefix_cache`` (or there is no text)."""
        if self.settings.policy(getattr(config, "route_policy", "")) != PREFIX_CACHE:
            return ()
        window, depth = self.settings.window, self.settings.max_depth
        return prefix_chain(prefix_source(options, window * depth), window, depth)

    def pick(self, model: str, chain: Sequence[int], loads: Mapping[str, int]) -> str | None:
        """The preferred node among ``loads`` (node -> calls in flight here), or None."""
        if not chain or len(loads) < 2:
            return None
        choice = choose(chain, self.index.matches(model, chain), loads, self.settings,
                        self._random.choice)
        if choice.forced_away:
            self.pressure.record(model)
            self._metrics.prefix_routed(model, "forced-away")
            log.debug("model {model}: the warm replica is too busy, routed elsewhere",
                      model=model)
        else:
            self._metrics.prefix_routed(model, "warm" if choice.node else "cold")
        return choice.node

    def observe(self, model: str, chain: Sequence[int], node_id: str) -> None:
        """``node_id`` served ``chain``: remembered here, and told to every replica when it
        is news."""
        if not chain or not self.index.observe(model, chain, node_id):
            return
        self._publish(OBSERVE, {"m": model, "n": node_id, "c": list(chain)})

    def node_departed(self, node_id: str) -> None:
        """A ``DepartureNotifier`` subscriber: forget the node here and on every replica."""
        self.index.drop_node(node_id)
        self._publish(INVALIDATE, {"n": node_id})

    # -- the bus ----------------------------------------------------------------------------

    def _publish(self, subject: str, payload: dict) -> None:
        if self._bus is None or not self.running or not self._subscriptions:
            return
        self.published += 1
        self._bus.publish(subject, payload).addErrback(lambda f: log.warn(
            "prefix routing: publishing on {subject} failed ({err}); other replicas miss "
            "this hint", subject=subject, err=f.value))

    def _received(self, subject: str, payload: Any) -> None:
        if not isinstance(payload, dict):
            return
        node = _name(payload.get("n"))
        if node is None:
            return
        if subject == OBSERVE and len(payload) == 3:
            model = _name(payload.get("m"))
            chain = valid_chain(payload.get("c"), self.settings.max_depth)
            if model is not None and chain is not None:
                self.index.observe(model, chain, node)
                self.applied += 1
        elif subject == INVALIDATE and len(payload) == 1:
            self.index.drop_node(node)
            self.applied += 1

    def live(self) -> bool:
        """Whether this replica hears the others now (always, without a bus)."""
        if self._bus is None:
            return True
        return len(self._subscriptions) == 2 and bool(self._bus.isConnected)

    # -- service ----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._expiry = task.LoopingCall(self.index.expire)
        self._expiry.clock = self._reactor
        self._expiry.start(max(1.0, self.settings.ttl / 2), now=False).addErrback(
            lambda f: log.failure("the prefix index's expiry loop stopped", f))
        if self._bus is not None:
            self._subscribe()

    def _subscribe(self) -> None:
        self._retry = None
        if self.running:
            defer.ensureDeferred(self._subscribe_both())

    async def _subscribe_both(self) -> None:
        subs = []
        try:
            for subject in (OBSERVE, INVALIDATE):
                subs.append(await self._bus.subscribe(subject, self._received))
        except Exception as e:
            for sub in subs:
                sub.unsubscribe()
            if self.running:
                log.warn("prefix routing hears no other replica: subscribing failed ({err}); "
                         "retrying in {s:g}s", err=e, s=RESUBSCRIBE_SECONDS)
                self._retry = self._reactor.callLater(RESUBSCRIBE_SECONDS, self._subscribe)
            return
        if not self.running:
            for sub in subs:
                sub.unsubscribe()
            return
        self._subscriptions = subs

    def stopService(self):
        super().stopService()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self._expiry is not None and self._expiry.running:
            self._expiry.stop()
        self._expiry = None
        subs, self._subscriptions = self._subscriptions, []
        return defer.gatherResults([s.unsubscribe() for s in subs], consumeErrors=True)
