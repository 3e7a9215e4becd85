"""The warm path's placement cache: where a model is loaded, kept in memory per replica so a
warm request reads no database.

Without it every request ran two statements before its gRPC call (the model's scheduling row,
then the candidate query with four subqueries, ``placement.py``).  :class:`PlacementCache`
keeps, per model, the *loaded* candidates that query returned (node, address, model identity,
connected); :class:`~localai_tw.frontend.inference.placement.NodeChooser` still makes the choice among
them per request, as before.  Only a non-empty answer for a request that excludes no node is
kept: a miss, a cold load and every retry (``exclude`` not empty) read the database.

An entry is dropped -- and the next request reads the database -- when:

=========================================  ==================================================
what happened                              who drops
=========================================  ==================================================
a call on the placement failed (a routing  the router, at once (``NodeChooser.forget``), before
fact, an absence within the grace, the     it classifies the failure exactly as before: the
worker's answer, any other failure)        cache never decides what a failure means
a row was reaped on the worker's answer    the reaping replica, and every replica through
                                           the fan-out (subject ``cache.placement``)
a node departed (the health monitor's      the replica that saw it (a ``DepartureNotifier``
``gone``), or its status, labels or        subscriber; ``NodeRegistry.on_changed``), and
existence changed                          every replica through the fan-out
a model's scheduling row changed           same (``SchedulingResource``)
the bus reconnected (messages may have     this replica: everything (``PgBus.onReconnect``)
been lost), or is not connected now        (not connected: no entry is used)
``DEFAULT_TTL`` seconds passed             the entry expires: a missed invalidation (a write
                                           that publishes nothing, a lost NOTIFY) heals itself
=========================================  ==================================================

Bounds: at most ``DEFAULT_MAX_MODELS`` models (the least recently filled goes first) and the
candidates of one model as the query returns them (one per node).  A fill that started before
an invalidation is not stored (a generation counter), so a read racing a departure cannot
bring the departed node back.

Why the four conditions are unchanged: a cached placement is only a guess of where to call,
as good as the database's a moment ago.  The call still dials through the tunnel layer, whose
answer (routed, absent within the grace, gone, unreachable peer, the worker's answer) is
classified by ``inference.py`` exactly as for a placement read from the database.  A stale
entry can make one call go to a node the database already stopped offering (drained,
unhealthy, or its row deleted): that call gets the same classified answer the node gives
anyone, the entry is dropped, and the request goes on as before (another node, or a reload).
Nothing here marks, demotes, deletes or announces anything.

This module must never read the database, never serve an entry while the fan-out is not
subscribed and connected, and never hold more than its bounds.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from twisted.application.service import Service
from twisted.internet import defer
from twisted.logger import Logger

log = Logger()

#: Seconds an entry is used at most: the backstop for a missed invalidation.
DEFAULT_TTL = 2.0
#: Models kept at most (the least recently filled entry is evicted first).
DEFAULT_MAX_MODELS = 1024
#: The fan-out subject (root ``cache`` of ``bus/pgbus.py``).
SUBJECT = "cache.placement"
#: Longest node id or model name accepted from a fan-out message.
MAX_NAME_CHARS = 255
#: Seconds between attempts to subscribe when the bus could not (the cache is off meanwhile).
RESUBSCRIBE_SECONDS = 5.0


class _Entry:
    __slots__ = ("config", "candidates", "expires", "nodes")

    def __init__(self, config, candidates: tuple, expires: float):
        self.config = config
        self.candidates = candidates
        self.expires = expires
        self.nodes = frozenset(c.node_id for c in candidates)


class PlacementCache:
    """Per model: the loaded candidates, the config they were read for, an expiry.

    :param clock: ``seconds()`` (the reactor; ``task.Clock`` in tests).
    :param live: ``() -> bool``: whether invalidations can reach this cache now (the fan-out
        is subscribed and its bus connected).  While False nothing is served.
    """

    def __init__(self, clock, *, ttl: float = DEFAULT_TTL,
                 max_models: int = DEFAULT_MAX_MODELS,
                 live: Callable[[], bool] = lambda: True):
        if ttl <= 0 or max_models < 1:
            raise ValueError("the placement cache needs ttl > 0 and max_models >= 1")
        self._clock = clock
        self.ttl = float(ttl)
        self.max_models = int(max_models)
        self.live = live
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._generation = 0
        #: Counters (hits, misses, drops), for the benchmark and for tests.
        self.hits = 0
        self.misses = 0
        self.drops = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, config) -> tuple | None:
        """The cached loaded candidates of ``config`` (its name), or None: read the database."""
        entry = self._entries.get(config.name)
        if entry is None:
            self.misses += 1
            return None
        if entry.config is not config or self._clock.seconds() >= entry.expires:
            # The YAML changed (another selector or identity), or the backstop expired.
            del self._entries[config.name]
            self.misses += 1
            return None
        if not self.live():
            self.misses += 1
            return None
        self.hits += 1
        return entry.candidates

    def token(self) -> int:
        """Take before reading the database; hand to :meth:`put` after."""
        return self._generation

    def put(self, config, candidates, token: int) -> bool:
        """Keep ``candidates`` (loaded ones, non-empty) for ``config``, unless something was
        invalidated since ``token`` was taken or the fan-out is not live.  Returns whether
        it was kept."""
        if token != self._generation or not candidates or not self.live():
            return False
        self._entries.pop(config.name, None)
        self._entries[config.name] = _Entry(config, tuple(candidates),
                                            self._clock.seconds() + self.ttl)
        while len(self._entries) > self.max_models:
            self._entries.popitem(last=False)
        return True

    # -- invalidation ----------------------------------------------------------------------

    def drop_model(self, name: str) -> None:
        self._generation += 1
        if self._entries.pop(name, None) is not None:
            self.drops += 1

    def drop_node(self, node_id: str) -> None:
        """Every entry that offers ``node_id``."""
        self._generation += 1
        for name in [n for n, e in self._entries.items() if node_id in e.nodes]:
            del self._entries[name]
            self.drops += 1

    def clear(self) -> None:
        self._generation += 1
        self.drops += len(self._entries)
        self._entries.clear()


class PlacementFanout(Service):
    """Carries invalidations between replicas on the bus (subject :data:`SUBJECT`), and
    applies them here first.  Payloads: ``{"node": id}`` or ``{"model": name}``.

    Publishing is best effort (a failed NOTIFY is logged; the TTL heals it).  Messages from
    other replicas are untrusted input: anything but one bounded string field is ignored.

    :param bus: a ``PgBus`` started before this service (or None: local only, and the cache
        is live, for a replica built without a bus, as in unit tests).
    """

    name = "placement-fanout"

    def __init__(self, cache: PlacementCache, bus=None, reactor=None):
        self.cache = cache
        self._bus = bus
        self._reactor = reactor
        self._subscription = None
        self._retry = None
        self._remove_reconnect: Callable[[], Any] | None = None
        cache.live = self.live

    def live(self) -> bool:
        if self._bus is None:
            return True
        return self._subscription is not None and bool(self._bus.isConnected)

    # -- what this replica learnt ------------------------------------------------------------

    def node_changed(self, node_id: str) -> defer.Deferred:
        self.cache.drop_node(node_id)
        return self._publish({"node": node_id})

    def model_changed(self, name: str) -> defer.Deferred:
        self.cache.drop_model(name)
        return self._publish({"model": name})

    def _publish(self, payload: dict) -> defer.Deferred:
        if self._bus is None or not self.running:
            return defer.succeed(None)
        d = self._bus.publish(SUBJECT, payload)
        d.addErrback(lambda f: log.warn(
            "placement cache: publishing {payload} failed ({err}); other replicas drop the "
            "entry within {ttl:g}s", payload=payload, err=f.value, ttl=self.cache.ttl))
        return d

    def _received(self, subject: str, payload: Any) -> None:
        if not isinstance(payload, dict) or len(payload) != 1:
            return
        (kind, value), = payload.items()
        if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
            return
        if kind == "node":
            self.cache.drop_node(value)
        elif kind == "model":
            self.cache.drop_model(value)

    # -- service -----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        if self._bus is not None:
            self._remove_reconnect = self._bus.onReconnect(self.cache.clear)
            self._subscribe()

    def _subscribe(self) -> None:
        self._retry = None
        if not self.running:
            return

        def subscribed(sub):
            if not self.running:
                return sub.unsubscribe()
            self._subscription = sub
            self.cache.clear()  # anything put before the subscription may have missed news

        def failed(f):
            if not self.running:
                return  # stopping (it may stop right after it started): nothing to retry
            log.warn("placement cache off: subscribing to {subject} failed ({err}); "
                     "retrying in {s:g}s", subject=SUBJECT, err=f.value, s=RESUBSCRIBE_SECONDS)
            self._retry = self._reactor.callLater(RESUBSCRIBE_SECONDS, self._subscribe)

        self._bus.subscribe(SUBJECT, self._received).addCallbacks(subscribed, failed)

    def stopService(self):
        super().stopService()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self._remove_reconnect is not None:
            self._remove_reconnect()
            self._remove_reconnect = None
        self.cache.clear()
        sub, self._subscription = self._subscription, None
        if sub is not None:
            return sub.unsubscribe()
        return None
