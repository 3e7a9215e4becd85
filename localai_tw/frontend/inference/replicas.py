"""Replicas of one model on several nodes: ``min_replicas`` and ``max_replicas`` of its
scheduling row (``POST /api/nodes/scheduling``).

- **Busy scale-up** (:meth:`ReplicaScaler.note`, called by the router for each call it is
  about to make): when every node holding the model already runs a call of *this* replica for
  it, and fewer than ``max_replicas`` nodes hold it, one more replica is loaded on another node
  in the background (``LoadLock.scale_up``: counted and loaded under the model's load lock, so
  replicas noticing at once never overshoot).  The call itself does not wait: it goes to an
  existing replica.  ``max_replicas`` 0 or 1 means one replica, as before.  Requests spread
  over the replicas because the chooser sends each call to the replica with the fewest calls
  of this replica in flight (``NodeChooser.in_flight``).
- **Prefix pressure** (the same :meth:`ReplicaScaler.note`): when the prefix routing had to
  send a request away from the replica warm for its prompt because the load guard found it too
  busy (``prefix_index.Pressure``: at least ``pressure_threshold`` such routings in the last
  minute), one more replica is loaded the same way, within ``max_replicas``, even if another
  replica is idle: the warm one is the hot spot.  The count is reset when it is acted on.
- **Floor** (:class:`ReplicaScaler` as a service): every ``interval`` (15 s) the models whose
  row asks ``min_replicas`` > 0 and that fewer nodes hold are loaded on one more node each,
  until the floor is met.  An unload that takes a model below its floor is undone at the next
  pass (the floor is the operator's standing order; lower it first).

"Busy" is judged from this replica's own calls: with several frontends each sees its share,
and a model busy through several replicas scales when one of them finds all its replicas busy.

What this module must never do: make a request wait for a scale-up, load more replicas than
``max_replicas`` (the count is taken under the lock), or retry a failed scale-up in a loop (the
load lock's failed-load memory answers at once meanwhile).
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.logger import Logger

from localai_tw import errors

from localai_tw.frontend.inference.interfaces import NoNodeAvailable
from localai_tw.periodic import PeriodicPass

log = Logger()

DEFAULT_INTERVAL = 15.0
#: Forced-away routings within the pressure window that ask for one more replica.
DEFAULT_PRESSURE_THRESHOLD = 1


class ReplicaScaler(PeriodicPass):
    """Busy scale-up and the ``min_replicas`` floor (module docstring).

    :param catalog: the ``ModelCatalog`` (``get(name)``);
    :param chooser: the ``NodeChooser``; :param loads: the ``LoadLock`` (``scale_up``);
    :param use: this replica's ``ModelUse``.
    """

    name = "replica-scaler"
    pass_name = "replica floor pass"

    def __init__(self, db, catalog, chooser, loads, use, reactor, *,
                 interval: float = DEFAULT_INTERVAL, pressure=None,
                 pressure_threshold: int = DEFAULT_PRESSURE_THRESHOLD):
        #: ``prefix_index.Pressure``: forced-away routings per model (None: not read).
        self.pressure = pressure
        self.pressure_threshold = pressure_threshold
        self._db = db
        self._catalog = catalog
        self._chooser = chooser
        self._loads = loads
        self._use = use
        self._reactor = reactor
        self.interval = interval
        self._scaling: set[str] = set()

    # -- busy scale-up --------------------------------------------------------------------

    def note(self, config, node_id: str) -> None:
        """A call of ``config`` is about to go to ``node_id``.  Costs nothing unless this
        replica already runs a call there, or the prefix routing was forced away from the warm
        replica (then the bounds are read, in the background)."""
        if config.name in self._scaling:
            return
        pressured = (self.pressure is not None
                     and self.pressure.count(config.name) >= self.pressure_threshold)
        if not pressured and not self._use.in_flight(node_id, config.name):
            return
        self._scaling.add(config.name)
        d = defer.ensureDeferred(self._consider(config, pressured))
        d.addErrback(lambda f: log.failure("scaling model {model} failed", f,
                                           model=config.name))
        d.addBoth(lambda _: self._scaling.discard(config.name))

    async def _consider(self, config, pressured: bool = False) -> None:
        if pressured:
            forced = self.pressure.count(config.name)
            self.pressure.reset(config.name)  # one burst, one decision
        chooser = self._chooser
        _, most = await chooser.replica_bounds(config.name)
        if most <= 1:
            return
        candidates = await chooser.candidates(config)
        holders = [c for c in candidates if c.loaded_address]
        if not holders or len(holders) >= most or len(holders) == len(candidates):
            return
        if pressured:
            log.info("model {model}: the replica warm for its prompts was too busy {forced} "
                     "times in the last {window:g}s (max_replicas {most}): loading one more",
                     model=config.name, forced=forced, window=self.pressure.window, most=most)
            await self._scale(config, len(holders) + 1)
            return
        if any(not self._use.in_flight(c.node_id, config.name) for c in holders):
            return  # a replica is idle here: the chooser sends calls there
        log.info("model {model} is busy on all {count} of its replicas (max_replicas {most}): "
                 "loading one more", model=config.name, count=len(holders), most=most)
        await self._scale(config, len(holders) + 1)

    async def _scale(self, config, want: int) -> None:
        try:
            placement = await self._loads.scale_up(config, want)
        except (NoNodeAvailable, errors.ClusterError) as e:
            log.info("another replica of model {model} could not be loaded: {err}",
                     model=config.name, err=e)
            return
        if placement is not None:
            log.info("model {model}: replica loaded on node {node}", model=config.name,
                     node=placement.node_id)

    # -- floor ----------------------------------------------------------------------------

    async def run_once(self) -> None:
        rows = await self._db.runQuery(
            "SELECT model_name, min_replicas FROM model_scheduling_configs"
            " WHERE min_replicas > 0 ORDER BY model_name")
        for name, least in rows:
            config = self._catalog.get(name)
            if config is None or name in self._scaling:
                continue
            candidates = await self._chooser.candidates(config)
            held = sum(1 for c in candidates if c.loaded_address)
            if held >= least or held == len(candidates):
                continue
            log.info("model {model} is loaded on {held} nodes, below its min_replicas "
                     "{least}: loading one more", model=name, held=held, least=least)
            self._scaling.add(name)
            try:
                await self._scale(config, held + 1)
            finally:
                self._scaling.discard(name)
