"""Preload: the models marked ``preload: true`` in their config, and those named by
``--preload-models`` (or LocalAI's ``--load-to-memory``), are loaded when a replica starts, on
a node the scheduler picks, so the first request after a restart does not pay the cold load.

:class:`Preloader` is a service of the replica.  Every ``interval`` (2 s) until each wanted
model is settled, it looks at where the model could go (``NodeChooser.candidates``):

- loaded on a connected node: settled (another replica, or a worker that kept its backends
  across a frontend restart, already holds it);
- not loaded anywhere, and some candidate node is connected: the cold load a request would
  make, through the load lock (so replicas starting together load it once); settled when it
  loads, or when the load fails with the backend's own answer (logged; requests then meet the
  failed-load memory like any other);
- otherwise (no connected worker yet, or loaded only on a node that is away): wait.  A worker
  that restarted registers again and its rows go, so its models are loaded afresh once it is
  connected.

After ``give_up_after`` (10 min) the models still waiting are logged and left to the first
request.  A settled model is never loaded again by this service: an operator's unload, or an
eviction, holds.

What this module must never do: load a model twice at once (the load lock does the loading),
block the replica's start (it runs beside it), or retry a model whose load the backend refused
in a loop.
"""

from __future__ import annotations

from typing import Iterable

from twisted.logger import Logger

from localai_tw import errors

from localai_tw.frontend.inference.interfaces import ModelLoadFailed, NoNodeAvailable
from localai_tw.periodic import PeriodicPass

log = Logger()

#: What makes a preload wait for the next pass rather than give up on the model.
_WAIT_ON = (NoNodeAvailable, errors.RoutingFact, errors.AbsentWithinGrace,
            errors.PeerUnreachable, errors.TransportFailure, errors.CallerDeadlineExceeded)

DEFAULT_INTERVAL = 2.0
DEFAULT_GIVE_UP_AFTER = 600.0


class Preloader(PeriodicPass):
    """Loads the wanted models once workers are connected (module docstring).

    :param inference: the ``InferenceRouter`` (``models()``, ``model(name)``, ``chooser``,
        ``loads``); :param names: the models named on the command line.
    """

    name = "preload"
    pass_name = "preload pass"
    run_first = True

    def __init__(self, inference, names: Iterable[str], reactor, *,
                 interval: float = DEFAULT_INTERVAL,
                 give_up_after: float = DEFAULT_GIVE_UP_AFTER):
        self._inference = inference
        self.names = tuple(dict.fromkeys(n for n in names if n))
        self._reactor = reactor
        self.interval = interval
        self.give_up_after = give_up_after
        self.settled: dict[str, str] = {}  # model -> how ("loaded on <node>", ...)
        self._started_at = 0.0

    def wanted(self) -> list[str]:
        marked = [m.name for m in self._inference.models() if m.preload]
        return list(dict.fromkeys([*self.names, *marked]))

    def startService(self) -> None:
        self._started_at = self._reactor.seconds()
        super().startService()

    async def run_once(self) -> bool:
        """One pass; True when nothing is left to preload (the loop then stops)."""
        waiting = [name for name in self.wanted() if name not in self.settled]
        for name in waiting:
            if not self.running:
                return True
            await self._preload(name)
        left = [name for name in self.wanted() if name not in self.settled]
        if not left:
            self.stop_passes()
            return True
        if self._reactor.seconds() - self._started_at >= self.give_up_after:
            log.warn("preload gave up after {seconds:g} s waiting for a connected worker for "
                     "{models}; the first request will load them",
                     seconds=self.give_up_after, models=", ".join(left))
            self.stop_passes()
            return True
        return False

    async def _preload(self, name: str) -> None:
        inference = self._inference
        config = inference.model(name)
        if config is None:
            log.warn("preload of model {model}: no such model is configured (check "
                     "--preload-models and the models directory)", model=name)
            self.settled[name] = "not configured"
            return
        candidates = await inference.chooser.candidates(config)
        held = [c for c in candidates if c.loaded_address and c.connected]
        if held:
            self.settled[name] = f"already loaded on {held[0].node_id}"
            log.info("preload of model {model}: already loaded on node {node}", model=name,
                     node=held[0].node_id)
            return
        if any(c.loaded_address for c in candidates) or not any(c.connected
                                                                for c in candidates):
            return  # loaded on a node that is away, or no worker connected yet: wait
        try:
            placement = await inference.loads.load(config)
        except _WAIT_ON as e:  # nothing learned about the model: try again next pass
            log.info("preload of model {model} waits: {err}", model=name, err=e)
            return
        except (ModelLoadFailed, errors.ClusterError) as e:
            self.settled[name] = "load failed"
            log.warn("preload of model {model} failed: {err}", model=name, err=e)
            return
        self.settled[name] = f"loaded on {placement.node_id}"
        log.info("preloaded model {model} on node {node}", model=name, node=placement.node_id)
