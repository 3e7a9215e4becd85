"""What this replica knows of model use: requests in flight per (node, model), and the batched
"last used" touches of ``node_models``.

:class:`ModelUse` is a service of the replica.

- **In flight**: :meth:`ModelUse.begin` / :meth:`ModelUse.end` around every backend call the
  router makes.  The count is exact for *this* replica and lives only in its memory: it is what
  an unload or an eviction decided here checks first (never unload a model with requests in
  flight unless forced).  Requests other replicas run on the same backend are not counted here;
  the worker answers for them (``backend.stop`` with ``if_idle`` asks the backend's own
  ``Status``; see :mod:`.lifecycle`).  The start time of each call is kept, so the busy
  watchdog can find a call that has run too long.
- **Touches**: :meth:`ModelUse.touch` only records the (node, model) pair in memory; a
  ``LoopingCall`` every ``flush_interval`` (1 s) writes every pending pair in **one**
  ``UPDATE ... FROM unnest(...)`` statement.  So a model on a node costs at most one row write
  per second however many requests it serves, and the database load does not grow with the
  request rate.  ``last_used`` is the database's ``now()`` at the flush (at most one interval
  late; the LRU order eviction reads needs no more).  A failed flush keeps its pairs for the
  next one; stopping the service flushes once more.

What this module must never do: write to the database on a request's path (a touch is memory
only), let the pending set grow past the pairs that exist (it is a set, emptied every flush),
or compare times in Python for anything the cluster shares (``last_used`` is ``now()``).
"""

from __future__ import annotations

import itertools

from twisted.application.service import Service
from twisted.internet import defer, task
from twisted.logger import Logger

from localai_tw import metrics as replica_metrics

log = Logger()

#: Seconds between two flushes of the touched pairs: at most one write per pair per interval.
DEFAULT_FLUSH_INTERVAL = 1.0

_TOUCH_SQL = (
    "UPDATE node_models AS m SET last_used = now()"
    " FROM unnest(%s::text[], %s::text[]) AS t(node_id, model_name)"
    " WHERE m.node_id = t.node_id AND m.model_name = t.model_name"
)


class ModelUse(Service):
    """In-flight counts and batched touches of this replica (module docstring).

    :param db: the replica's ``Database`` (``runOperation``); None keeps touches in memory only
        (unit tests of the router).
    """

    name = "model-use"

    def __init__(self, db, reactor, *, flush_interval: float = DEFAULT_FLUSH_INTERVAL,
                 metrics: replica_metrics.ReplicaMetrics = replica_metrics.DISCARD):
        self._db = db
        self._metrics = metrics
        self._reactor = reactor
        self.flush_interval = flush_interval
        self._pending: set[tuple[str, str]] = set()
        # (node, model) -> {call id: reactor time it began}
        self._calls: dict[tuple[str, str], dict[int, float]] = {}
        self._ids = itertools.count(1)
        self._loop: task.LoopingCall | None = None
        self._flushing: defer.Deferred | None = None
        #: Statements written (tests and the benchmark read it).
        self.writes = 0

    # -- in flight --------------------------------------------------------------------------

    def begin(self, node_id: str, model_name: str) -> int:
        """A call to ``model_name`` on ``node_id`` starts; returns its id for :meth:`end`."""
        call_id = next(self._ids)
        self._calls.setdefault((node_id, model_name), {})[call_id] = self._reactor.seconds()
        return call_id

    def end(self, node_id: str, model_name: str, call_id: int) -> None:
        calls = self._calls.get((node_id, model_name))
        if calls is None:
            return
        calls.pop(call_id, None)
        if not calls:
            del self._calls[(node_id, model_name)]

    def in_flight(self, node_id: str, model_name: str) -> int:
        return len(self._calls.get((node_id, model_name), ()))

    def in_flight_counts(self) -> dict[tuple[str, str], int]:
        """Every (node, model) with calls running here, and how many."""
        return {key: len(calls) for key, calls in self._calls.items()}

    def running_longer_than(self, seconds: float) -> list[tuple[str, str]]:
        """The (node, model) pairs with a call here that began more than ``seconds`` ago."""
        limit = self._reactor.seconds() - seconds
        return [key for key, calls in self._calls.items()
                if any(began < limit for began in calls.values())]

    # -- touches ----------------------------------------------------------------------------

    def touch(self, node_id: str, model_name: str) -> None:
        """Record use of ``model_name`` on ``node_id``; written at the next flush."""
        self._pending.add((node_id, model_name))

    def pending(self) -> frozenset[tuple[str, str]]:
        return frozenset(self._pending)

    def flush(self) -> defer.Deferred:
        """Write every pending touch in one statement (a flush already running is joined)."""
        if self._flushing is not None:
            return self._flushing
        if not self._pending or self._db is None:
            return defer.succeed(None)
        batch, self._pending = self._pending, set()
        nodes = [node for node, _ in batch]
        models = [model for _, model in batch]
        self.writes += 1
        self._metrics.last_used_write()
        d = self._db.runOperation(_TOUCH_SQL, (nodes, models))

        def failed(failure):
            self._pending |= batch  # try again at the next flush
            log.warn("writing last-used of {count} models failed (kept for the next flush): "
                     "{err}", count=len(batch), err=failure.getErrorMessage())

        def done(result):
            self._flushing = None
            return result

        self._flushing = d  # before the callbacks: a flush that ends at once clears it
        d.addErrback(failed).addBoth(done)
        return d

    # -- service ----------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._loop = task.LoopingCall(self.flush)
        self._loop.clock = self._reactor
        self._loop.start(self.flush_interval, now=False).addErrback(
            lambda f: log.failure("the last-used flush loop stopped", f))

    def stopService(self) -> defer.Deferred:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        return self.flush()
