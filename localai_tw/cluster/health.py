"""The health monitor: one replica at a time turns heartbeats and presence into node status.

Every ``interval`` seconds (15 s) each replica tries advisory lock ``LOCK_HEALTH_CHECK`` (104)
without waiting; the one that gets it runs a *pass*, the others skip that tick.  The lock is not
sticky: any replica may win the next tick.  A pass reads every node with its staleness computed
in SQL on the database clock, then decides per node, in this order:

=======================================  ==================================================
what the pass finds                      what it does
=======================================  ==================================================
status ``draining``                      nothing (a drain is an operator's decision)
stale heartbeat, presence                nothing: the tunnel left less than the grace ago
``reconnecting``, or presence read       (or nobody knows), and nothing is acted on inside
failed                                   the grace
stale heartbeat, any other presence      ``mark_offline`` (status offline, the node's
(connected, gone, unknown)               ``node_models`` rows deleted: explicit lifecycle),
                                         unless it is already offline.  No departure.
fresh heartbeat, presence ``gone``       ``mark_unhealthy`` (status only; rows are kept) and
                                         ``notifier.departed(node)`` (edge-triggered)
fresh heartbeat, presence ``connected``  ``notifier.present(node)``; unhealthy or offline ->
                                         ``mark_healthy`` (never promotes an unapproved node);
                                         offline -> healthy also calls ``on_back(node)``
fresh heartbeat, ``reconnecting``, or    ``notifier.present(node)`` only: these are not
``unknown`` (no row)                     absence, so nothing is demoted, deleted or
                                         announced -- and nothing is promoted either, since
                                         the worker holds no tunnel to be served through
presence read failed                     nothing at all (not even re-arming)
=======================================  ==================================================

A heartbeat is *stale* when it is older than ``max(stale_after, grace)``: 90 s by default
(the reference's 60 s threshold is raised to the reconnect grace).  With the presence rule
above, one timeline holds for every fault (``docs/cluster-state.md``): nothing is marked offline
or deleted until the grace has passed both since the last heartbeat and since the tunnel left.
A 60 s threshold inside a 90 s grace marked a crashed, partitioned or frozen worker offline and
deleted its rows at 57-75 s, while the tunnel layer still promised it the grace.

Decisions worth knowing:

- A stale node that is ``unhealthy`` *is* marked offline (the reference skips it "to avoid log
  spam").  Here stale heartbeats never produce ``unhealthy``, so an unhealthy node is one whose
  tunnel went away; if its heartbeats stop too, the stale heartbeat is the lifecycle event that
  clears its ``node_models`` rows, and skipping it would leave them forever.  Log spam is avoided
  by skipping nodes that are already offline (and ``mark_offline`` is itself a no-op on them).
- Re-arming on ``reconnecting``/``unknown`` is not an action on the node: it only lets a later
  ``gone`` be announced again.  ``reconnecting`` after ``gone`` proves the worker reconnected in
  between.
- ``on_back(node_id)``: a node found offline that is back (fresh heartbeat, tunnel connected)
  may still run backends whose rows ``offline`` deleted, and when its tunnel stayed attached
  (a frozen heartbeat path) no attach tells anyone.  The seam is called, not awaited, after
  the promotion (the replica wires the reconciler of ``frontend/inference/reconcile.py``).
- Per-model probes (gRPC ``HealthCheck`` through the node's tunnel, three misses to reap a row,
  an unroutable probe counting as neither hit nor miss) arrive with the inference layer.  The
  seam is ``model_probe``: an object with ``probe_nodes(node_ids)`` returning a Deferred or
  coroutine, called after the per-node loop with the nodes found ``connected`` and ``healthy``,
  and only when the node list was read (so it can prune its miss streaks safely).

This module must never compare times in Python (the database decides staleness), never act on
``reconnecting`` or ``unknown`` presence (a stale heartbeat with no tunnel row is acted on for
its heartbeat), never delete ``node_models`` rows except through ``mark_offline`` on a stale
heartbeat, never run a pass without the advisory lock, and never let a failed tick stop the
loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twisted.internet import defer
from twisted.logger import Logger

from localai_tw.periodic import PeriodicPass
from localai_tw.db.pool import LOCK_HEALTH_CHECK, DatabaseUnavailable, PoolClosed

from .clock import effective_grace, interval_seconds
from .nodes import NodeStatus
from .ownership import Presence, PresenceReading

log = Logger()

#: Seconds between ticks.
HEALTH_CHECK_INTERVAL = 15.0
#: A node whose last heartbeat is older than this is stale (worker heartbeat: every 10 s).  The
#: monitor raises it to the reconnect grace when the grace is longer (see the module docstring).
STALE_NODE_THRESHOLD = 60.0

#: Nodes whose presence one statement of a pass reads.
PRESENCE_BATCH = 1000

# Bind: stale threshold in seconds.  A node that never beat (NULL) counts as stale.
_NODES_SQL = (
    "SELECT id, name, status,"
    " (last_heartbeat IS NULL OR last_heartbeat < now() - make_interval(secs => %s)) AS stale"
    " FROM backend_nodes ORDER BY id"
)

_PROMOTABLE = (NodeStatus.UNHEALTHY, NodeStatus.OFFLINE)


@dataclass
class PassReport:
    """What one pass did, for logs and tests."""

    checked: int = 0
    marked_offline: list[str] = field(default_factory=list)
    marked_unhealthy: list[str] = field(default_factory=list)
    marked_healthy: list[str] = field(default_factory=list)
    departed: list[str] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)  # presence read failed
    failed: list[str] = field(default_factory=list)      # a status change failed
    list_error: BaseException | None = None
    #: Nodes by status once the pass is done, and by the presence it read (``read-failed``
    #: when the read failed; draining and already-offline nodes are not read): for metrics.
    statuses: dict[str, int] = field(default_factory=dict)
    presence: dict[str, int] = field(default_factory=dict)


class HealthMonitor(PeriodicPass):
    """Periodic node health pass under the health-check advisory lock.

    :param db: a started ``Database`` (``tryWithAdvisoryLock``, ``runQuery``).
    :param registry: the ``NodeRegistry`` (status changes).
    :param fence: the ``OwnershipFence`` (presence).
    :param notifier: the ``DepartureNotifier`` told about ``gone`` nodes.
    :param reactor: drives the tick (a ``task.Clock`` in tests).  Never used to judge time.
    :param interval: seconds between ticks.
    :param stale_after: heartbeat age, in seconds on the database clock, that makes a node stale;
        raised to ``grace`` when shorter, so a stale heartbeat is never acted on inside it.
    :param grace: the reconnect grace in seconds (presence ``gone`` after it).
    :param model_probe: the per-model probe seam (see the module docstring), or None.
    :param on_back: ``on_back(node_id)`` after an offline node was promoted, or None.
    """

    name = "health"
    pass_name = "health check pass"

    def __init__(self, db, registry, fence, notifier, reactor=None,
                 interval: float = HEALTH_CHECK_INTERVAL,
                 stale_after: float = STALE_NODE_THRESHOLD,
                 grace: float | None = None, *, model_probe=None, on_back=None):
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        if notifier is None:
            raise TypeError("the health monitor needs a DepartureNotifier")
        if not interval > 0:
            raise ValueError("the health-check interval must be positive")
        if not stale_after > 0:
            raise ValueError("the stale-heartbeat threshold must be positive")
        self._db = db
        self._registry = registry
        self._fence = fence
        self._notifier = notifier
        self._reactor = reactor
        self.interval = float(interval)
        self.grace = effective_grace(grace)
        self.stale_after = max(interval_seconds(stale_after), self.grace)
        self._model_probe = model_probe
        self._on_back = on_back
        #: The report of the last pass this replica ran (None before the first), and the
        #: number of the tick that ran it (ticks count from 1; no clock is read for this).
        self.last_report: PassReport | None = None
        self.ticks = 0
        self.last_report_tick = 0

    # -- lifecycle --------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        log.info("health monitor started: every {interval:g}s, stale after {stale:g}s, "
                 "reconnect grace {grace:g}s", interval=self.interval, stale=self.stale_after,
                 grace=self.grace)

    def stopService(self) -> defer.Deferred:
        # an in-flight pass finishes (and unlocks) before we report stopped
        return super().stopService().addCallback(lambda _: log.info("health monitor stopped"))

    async def run_once(self) -> None:
        await self.tick()

    # -- one tick ---------------------------------------------------------------------------

    def tick(self) -> defer.Deferred:
        """Try the lock and, if it is free, run one pass.  Fires with True when this replica
        ran the pass, False when another replica held the lock or the attempt failed.  Never
        fails (a failed tick would end the loop)."""
        return defer.ensureDeferred(self._tick())

    async def _tick(self) -> bool:
        self.ticks += 1
        tick = self.ticks
        try:
            ran, report = await self._db.tryWithAdvisoryLock(LOCK_HEALTH_CHECK, self.run_pass)
        except (DatabaseUnavailable, PoolClosed) as e:
            # The pool logs an outage once; a line per tick would repeat it.
            log.debug("health check tick failed ({err}); the next tick retries", err=e)
            return False
        except Exception as e:
            log.warn("health check tick failed ({err}); the next tick retries",
                     err=f"{type(e).__name__}: {e}")
            return False
        if ran:
            self.last_report = report
            self.last_report_tick = tick
        return ran

    def run_pass(self) -> defer.Deferred:
        """One pass over every node.  Call only while holding ``LOCK_HEALTH_CHECK`` (``tick``
        does).  Fires with a :class:`PassReport`; never fails."""
        return defer.ensureDeferred(self._pass())

    async def _pass(self) -> PassReport:
        report = PassReport()
        try:
            rows = await self._db.runQuery(_NODES_SQL, (self.stale_after,))
        except Exception as e:
            log.warn("health pass: reading the node list failed ({err}); nothing changed",
                     err=f"{type(e).__name__}: {e}")
            report.list_error = e
            return report
        probe_candidates = []
        readings = await self._presences(rows)
        for node_id, name, status_text, stale in rows:
            report.checked += 1
            try:
                status = NodeStatus(status_text)
                if await self._check_node(node_id, name, status, bool(stale), report,
                                          readings):
                    probe_candidates.append(node_id)
            except Exception as e:
                report.failed.append(node_id)
                log.warn("health pass: node {node} ({name}) not updated ({err}); the next pass "
                         "retries", node=node_id, name=name, err=f"{type(e).__name__}: {e}")
        _count_statuses(report, rows)
        if self._model_probe is not None:
            try:
                await defer.maybeDeferred(_awaitable, self._model_probe.probe_nodes,
                                          probe_candidates)
            except Exception as e:
                log.warn("health pass: model probe failed ({err})",
                         err=f"{type(e).__name__}: {e}")
        return report

    async def _presences(self, rows) -> dict[str, PresenceReading]:
        """The presence of every node the pass may act on, :data:`PRESENCE_BATCH` nodes per
        statement (one statement per node before: 4000 nodes every 15 s were 270 statements a
        second at idle).  A batch whose read failed gives its nodes ``UNKNOWN`` and the error
        (left alone, as a failed read of one node was); a node without a connection row
        ``UNKNOWN``."""
        wanted = [node_id for node_id, _name, status_text, stale in rows
                  if status_text != NodeStatus.DRAINING.value
                  and not (stale and status_text == NodeStatus.OFFLINE.value)]
        readings: dict[str, PresenceReading] = {}
        for start in range(0, len(wanted), PRESENCE_BATCH):
            batch = wanted[start:start + PRESENCE_BATCH]
            try:
                views = await self._fence.connections(batch, self.grace)
            except Exception as e:
                log.warn("health pass: presence of {count} nodes unknown, query failed: {err}",
                         count=len(batch), err=f"{type(e).__name__}: {e}")
                readings.update((node_id, PresenceReading(Presence.UNKNOWN, e))
                                for node_id in batch)
                continue
            for node_id in batch:
                view = views.get(node_id)
                readings[node_id] = PresenceReading(
                    view.presence if view is not None else Presence.UNKNOWN)
        return readings

    async def _check_node(self, node_id: str, name: str, status: NodeStatus, stale: bool,
                          report: PassReport,
                          readings: dict[str, PresenceReading] | None = None) -> bool:
        """Apply the rules to one node.  True when the node may be probed (connected and
        healthy after this pass)."""
        if status is NodeStatus.DRAINING:
            return False
        if stale and status is NodeStatus.OFFLINE:
            return False  # already offline: nothing to read or repeat

        reading = readings.get(node_id) if readings is not None else None
        if reading is None:
            reading = await self._fence.presence(node_id, self.grace)
        seen = "read-failed" if reading.error is not None else reading.presence.value
        report.presence[seen] = report.presence.get(seen, 0) + 1
        if reading.error is not None:
            report.left_alone.append(node_id)
            return False  # a failed read is not a statement about the worker
        if stale:
            if reading.presence is Presence.RECONNECTING:
                # Heartbeats and tunnel stopped together (a crash, a partition): the tunnel
                # left less than the grace ago, so the worker may still come back.
                return False
            if await self._registry.mark_offline(node_id):
                report.marked_offline.append(node_id)
                log.info("node {node} ({name}) marked offline: no heartbeat for more than "
                         "{stale:g}s (tunnel {presence}); its model rows were cleared",
                         node=node_id, name=name, stale=self.stale_after,
                         presence=reading.presence.value)
            return False
        if reading.presence is Presence.GONE:
            if await self._registry.mark_unhealthy(node_id):
                report.marked_unhealthy.append(node_id)
                log.info("node {node} ({name}) marked unhealthy: its tunnel departed more "
                         "than {grace:g}s ago (presence gone); model rows kept", node=node_id,
                         name=name, grace=self.grace)
            if not self._notifier.is_departed(node_id):
                report.departed.append(node_id)
            # Not awaited: a slow subscriber must not hold the lock; failures are logged.
            self._notifier.departed(node_id)
            return False

        self._notifier.present(node_id)
        if reading.presence is not Presence.CONNECTED:
            return False  # reconnecting / unknown: nobody acts
        if status in _PROMOTABLE and await self._registry.mark_healthy(node_id):
            report.marked_healthy.append(node_id)
            log.info("node {node} ({name}) healthy again: heartbeat fresh and tunnel connected",
                     node=node_id, name=name)
            if status is NodeStatus.OFFLINE and self._on_back is not None:
                defer.maybeDeferred(self._on_back, node_id).addErrback(
                    lambda f: log.failure("health pass: on_back failed for node {node}", f,
                                          node=node_id))
            status = NodeStatus.HEALTHY
        return status is NodeStatus.HEALTHY


def _count_statuses(report: PassReport, rows) -> None:
    """``report.statuses``: each node's status as read, changed by what the pass did."""
    changed = {**{n: NodeStatus.OFFLINE.value for n in report.marked_offline},
               **{n: NodeStatus.UNHEALTHY.value for n in report.marked_unhealthy},
               **{n: NodeStatus.HEALTHY.value for n in report.marked_healthy}}
    for node_id, _name, status_text, _stale in rows:
        status = changed.get(node_id, status_text)
        report.statuses[status] = report.statuses.get(status, 0) + 1


def _awaitable(fn, *args):
    result = fn(*args)
    if hasattr(result, "__await__") and not isinstance(result, defer.Deferred):
        return defer.ensureDeferred(result)
    return result
