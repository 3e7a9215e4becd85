"""The departure notifier: tell per-node caches that a worker is gone, once per departure.

A worker whose tunnel departed longer ago than the reconnect grace (presence ``gone``, the only
absence verdict; see ``localai_tw.errors``) no longer needs whatever this process keeps for it:
pooled HTTP connections through its tunnel, probe caches, staging trackers.  The health monitor
calls :meth:`DepartureNotifier.departed` from its ``gone`` branch and nowhere else, and each
*subscriber* drops its own per-node state.

Rules:

- **Named subscribers, fixed at construction.**  ``DepartureNotifier(subscribers)`` takes a
  mapping of name -> ``callable(node_id)``; the argument is required (pass ``{}`` explicitly
  for none), so forgetting to wire a cache is a visible decision, not a default.  Names appear
  in logs.
- **Edge-triggered.**  ``departed(node)`` fires every subscriber once when the node *enters*
  departure; further ``departed(node)`` calls do nothing until ``present(node)`` re-arms it.  The
  health monitor calls ``present`` on every pass that does not find the node gone, so a worker
  that comes back and leaves again is announced again.
- **Isolated.**  A subscriber that raises, or whose Deferred/coroutine fails, is logged with its
  name and does not keep the others from running; :meth:`departed` never fails.

The edge state lives in this process only.  That matches what subscribers clear (caches of this
process) and means two replicas each clear their own.

This module must never decide that a worker departed (it is told), never act on anything but
``departed`` (no demotion, no row deletion), never let one subscriber's failure reach another
or the caller, and never block the reactor (subscribers run as they are called; a subscriber
that needs I/O returns a Deferred or a coroutine).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger()

Subscriber = Callable[[str], Any]
"""``subscriber(node_id)``: drop this process's state for ``node_id``.  May return a Deferred or
a coroutine; its outcome is awaited by :meth:`DepartureNotifier.departed` and logged if it
fails."""


class DepartureNotifier:
    """Edge-triggered fan-out of "this worker is gone" to named subscribers.

    :param subscribers: name -> ``callable(node_id)``.  Required; ``{}`` means no subscriber.
        Copied at construction: the set of subscribers does not change afterwards.
    """

    def __init__(self, subscribers: Mapping[str, Subscriber]):
        if not isinstance(subscribers, Mapping):
            raise TypeError("subscribers must be a mapping of name -> callable(node_id); "
                            "pass {} explicitly for none")
        for name, subscriber in subscribers.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"subscriber names must be non-empty strings, got {name!r}")
            if not callable(subscriber):
                raise TypeError(f"subscriber {name!r} is not callable")
        self._subscribers: Mapping[str, Subscriber] = MappingProxyType(dict(subscribers))
        self._departed: set[str] = set()

    @property
    def subscribers(self) -> Mapping[str, Subscriber]:
        """The subscribers, read-only."""
        return self._subscribers

    def is_departed(self, node_id: str) -> bool:
        """Whether ``node_id`` was announced and not re-armed since."""
        return node_id in self._departed

    def present(self, node_id: str) -> None:
        """Re-arm: the node is not (or no longer) gone, so its next departure is announced."""
        self._departed.discard(node_id)

    def departed(self, node_id: str) -> defer.Deferred:
        """Announce that ``node_id`` is gone.

        The first call after construction or after ``present(node_id)`` calls every subscriber
        (synchronously, in name order) and fires with ``{name: None | Failure}`` once all of them
        have finished; any other call fires with ``{}`` at once.  Never fails.
        """
        if node_id in self._departed:
            return defer.succeed({})
        self._departed.add(node_id)
        if self._subscribers:
            log.info("node {node} departed: notifying {names}", node=node_id,
                     names=", ".join(sorted(self._subscribers)))
        names = sorted(self._subscribers)
        outcomes = [self._notify(name, node_id) for name in names]
        gathered = defer.DeferredList(outcomes, consumeErrors=True)
        return gathered.addCallback(
            lambda results: {name: (None if ok else value)
                             for name, (ok, value) in zip(names, results)})

    def _notify(self, name: str, node_id: str) -> defer.Deferred:
        subscriber = self._subscribers[name]
        try:
            result = subscriber(node_id)
            if hasattr(result, "__await__") and not isinstance(result, defer.Deferred):
                result = defer.ensureDeferred(result)
            d = result if isinstance(result, defer.Deferred) else defer.succeed(result)
        except Exception:
            d = defer.fail()

        def done(outcome):
            if isinstance(outcome, Failure):
                log.failure("departure subscriber {name} failed for node {node}", outcome,
                            name=name, node=node_id)
                return outcome
            return None

        return d.addBoth(done)
