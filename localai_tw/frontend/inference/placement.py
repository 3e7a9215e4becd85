"""Node choice: which node serves a model, which node a cold load goes to, and what a request
tells of a placement it used (its use; the worker's answer that it is gone).

:meth:`NodeChooser.candidates`: healthy ``backend`` nodes whose labels carry every pair of the
model's selector -- the YAML ``node_selector`` with the ``model_scheduling_configs`` row
(``POST /api/nodes/scheduling``) on top (the row wins per key).  Nodes where the model is
``loaded`` come first; among loaded replicas the one with the fewest requests in flight
through this replica is chosen (``in_flight``, when set), so requests spread over the
replicas of a model; among equals the choice is random.  With a prefix chain (chat and
completion requests of a ``prefix_cache`` model), the replica warm for the prompt's head comes
first unless the load guard refuses it (``prefix_index.py``).  (Cold loads prefer nodes holding
fewer models, then random; with a ``room`` policy (:mod:`.lifecycle`), nodes with room for the model
come before those without).  Connected nodes (tunnel held by a live replica, read in the same query)
come before the others, both for a loaded replica and for a cold load: a node that heartbeats
but never dials holds no models and would otherwise win every cold load.  Before a cold load
the picked node's presence is read: ``gone`` -> ``mark_unhealthy`` (status only, reversible)
and pick again, at most ``MAX_PICKS`` times; ``reconnecting``/``unknown`` stay eligible (nobody
acts on absence within the grace).

The loaded candidates of a model are kept by a ``PlacementCache`` when one is set
(``placement_cache.py``: the warm path reads no database; a request that excludes a node, a
miss and a cold load read it).  :meth:`NodeChooser.forget` drops a model's entry after a
failed call.

Reaping (:meth:`NodeChooser.reap`) deletes a ``loaded`` row, and is called by the router ONLY on
the worker's answer (``WorkerAnswer``: ``StreamRefused`` at the dial, ``BackendAnswer`` of a
dead or wrong backend).  It asserts that: handing it a routing fact, absence, a peer failure, a
transport failure or a caller deadline raises ``ValueError`` and deletes nothing.

What this module must never do: delete a ``loaded`` row on anything but the worker's answer
(writing rows is :mod:`.coldload`'s); demote a node on anything but ``gone``; compare times in
Python (the database clock decides liveness).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Mapping

from twisted.logger import Logger

from localai_tw import errors
from localai_tw.cluster.clock import (
    CONNECTION_IS_HELD_SQL,
    INSTANCE_IS_LIVE_SQL,
    INSTANCE_LIVENESS,
)
from localai_tw.cluster.ownership import Presence

from localai_tw.frontend.inference.interfaces import NoNodeAvailable
from localai_tw.localai.model_config import ModelConfig

log = Logger()

#: Nodes one cold load may pick (and skip) before it gives up.
MAX_PICKS = 4


@dataclass(frozen=True)
class Candidate:
    node_id: str
    models_held: int
    loaded_address: str | None  # address of a loaded replica of the model here, if any
    loaded_model: str = ""      # its ModelOptions.Model
    connected: bool = False     # a live replica holds its tunnel now (read with the rows)


@dataclass(frozen=True)
class Placement:
    """A loaded model replica: where calls go."""

    model_name: str
    node_id: str
    address: str
    model_id: str  # ModelOptions.Model as loaded; sent as ModelIdentity
    #: How many loaded replicas it was chosen among (the prefix routing records only real
    #: choices: a model on one node costs no observation and no bus message).
    choice_of: int = 1

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


_CANDIDATES_SQL = (
    "SELECT n.id,"
    " (SELECT count(*) FROM node_models m WHERE m.node_id = n.id),"
    " (SELECT m.address FROM node_models m WHERE m.node_id = n.id AND m.model_name = %(model)s"
    "   AND m.state = 'loaded' ORDER BY m.replica_index LIMIT 1),"
    " (SELECT m.loaded_model FROM node_models m WHERE m.node_id = n.id"
    "   AND m.model_name = %(model)s AND m.state = 'loaded' ORDER BY m.replica_index LIMIT 1),"
    " EXISTS (SELECT 1 FROM node_connections JOIN instances"
    "   ON instances.id = node_connections.owner_instance_id"
    f"   AND {INSTANCE_IS_LIVE_SQL.replace('%s', '%(live)s')}"
    f"   WHERE node_connections.node_id = n.id AND {CONNECTION_IS_HELD_SQL})"
    " FROM backend_nodes n"
    " WHERE n.status = 'healthy' AND n.node_type = 'backend'"
    " AND NOT EXISTS (SELECT 1 FROM jsonb_each_text(%(selector)s::jsonb) s"
    "   WHERE NOT EXISTS (SELECT 1 FROM node_labels l"
    "     WHERE l.node_id = n.id AND l.key = s.key AND l.value = s.value))"
    " ORDER BY n.id"
)


def merged_selector(model: ModelConfig, configured: Mapping[str, str] | None) -> dict[str, str]:
    selector = dict(model.node_selector)
    selector.update(configured or {})
    return selector


def model_identity(model: ModelConfig, worker_paths: Mapping[str, str] | None) -> str:
    """``ModelOptions.Model``: the worker path of the staged model file, else the identifier
    (also the ``ModelIdentity`` of every call).  Deterministic from the config, so every
    replica computes the same value without asking the worker."""
    staged = model.file_for_model()
    if staged is None:
        return model.model
    if worker_paths and worker_paths.get(staged.key):
        return worker_paths[staged.key]
    return staged.key


class NodeChooser:
    """Reads where a model is loaded, picks the node for a cold load, and hears what requests
    learn of a placement (module docstring).

    :param nodes: the ``NodeRegistry`` (status only); :param fence: the ``OwnershipFence``
    (presence)."""

    def __init__(self, db, nodes, fence, *, grace: float | None = None,
                 liveness: float = INSTANCE_LIVENESS, room=None, in_flight=None, cache=None,
                 on_reaped=None, prefix=None):
        self._db = db
        #: ``prefix_fanout.PrefixRouting``: the preferred replica for a prompt's prefix chain.
        self.prefix = prefix
        #: ``room.prefer(model, candidates)`` -> the candidates with room (or all of them).
        self.room = room
        #: ``in_flight(node_id, model_name)`` -> this replica's calls running there.
        self.in_flight = in_flight
        self._nodes = nodes
        self._fence = fence
        self._grace = grace
        self._liveness = liveness
        self._random = random.Random()
        #: ``PlacementCache`` of the warm path (``placement_cache.py``); None: always read.
        self.cache = cache
        #: ``on_reaped(model_name)``: tell every replica's cache (``PlacementFanout``).
        self.on_reaped = on_reaped

    # -- reads ------------------------------------------------------------------------------

    async def configured_selector(self, model_name: str) -> dict[str, str]:
        rows = await self._db.runQuery(
            "SELECT node_selector FROM model_scheduling_configs WHERE model_name = %s",
            (model_name,))
        return dict(rows[0][0]) if rows else {}

    async def replica_bounds(self, model_name: str) -> tuple[int, int]:
        """``(min_replicas, max_replicas)`` of the model's scheduling row ((0, 0) without)."""
        rows = await self._db.runQuery(
            "SELECT min_replicas, max_replicas FROM model_scheduling_configs"
            " WHERE model_name = %s", (model_name,))
        return (int(rows[0][0]), int(rows[0][1])) if rows else (0, 0)

    async def candidates(self, model: ModelConfig) -> list[Candidate]:
        selector = merged_selector(model, await self.configured_selector(model.name))
        rows = await self._db.runQuery(_CANDIDATES_SQL, {
            "model": model.name, "selector": json.dumps(selector),
            "live": float(self._liveness)})
        return [Candidate(r[0], int(r[1]), r[2], r[3] or "", bool(r[4])) for r in rows]

    async def _loaded_candidates(self, model: ModelConfig, exclude: frozenset[str]):
        """The candidates holding ``model`` loaded: from the cache on the warm path, else
        read (and kept when the request excludes no node; see ``placement_cache.py``)."""
        cache = self.cache
        if cache is None or exclude:
            return await self.candidates(model)
        cached = cache.get(model)
        if cached is not None:
            return cached
        token = cache.token()
        loaded = [c for c in await self.candidates(model) if c.loaded_address]
        cache.put(model, loaded, token)
        return loaded

    def forget(self, placement: Placement) -> None:
        """A call on ``placement`` failed: the next request reads the database (whatever the
        failure means is decided by the caller, as without a cache)."""
        if self.cache is not None:
            self.cache.drop_model(placement.model_name)

    def _shuffled(self, items: list) -> list:
        items = list(items)
        self._random.shuffle(items)
        return items

    async def loaded_placement(self, model: ModelConfig,
                               exclude: frozenset[str] = frozenset(),
                               chain: tuple[int, ...] = ()) -> Placement | None:
        """A loaded replica of ``model`` on a node that still matches: on a connected node
        when there is one; the one warm for ``chain`` (the prompt's prefix chain) when the
        prefix routing prefers one, else the least loaded, random among equals."""
        loaded = [c for c in await self._loaded_candidates(model, exclude)
                  if c.loaded_address and c.node_id not in exclude]
        if not loaded:
            return None
        connected = [c for c in loaded if c.connected] or loaded
        chosen = None
        if chain and self.prefix is not None and len(connected) > 1:
            # Prefix-cache-aware routing: the replica warm for this prompt's head, unless the
            # load guard says it is too busy (prefix_index.py); None: no preference.
            loads = {c.node_id: (self.in_flight(c.node_id, model.name)
                                 if self.in_flight is not None else 0) for c in connected}
            preferred = self.prefix.pick(model.name, chain, loads)
            chosen = next((c for c in connected if c.node_id == preferred), None)
        if chosen is None:
            if self.in_flight is not None:
                least = min(self.in_flight(c.node_id, model.name) for c in connected)
                connected = [c for c in connected
                             if self.in_flight(c.node_id, model.name) == least]
            chosen = self._shuffled(connected)[0]
        return Placement(model.name, chosen.node_id, chosen.loaded_address,
                         chosen.loaded_model or model_identity(model, None),
                         choice_of=len(loaded))

    # -- presence ------------------------------------------------------------------------------

    async def _usable(self, node_id: str) -> bool:
        """False (and the node demoted, status only) when its presence is ``gone``."""
        reading = await self._fence.presence(node_id, self._grace)
        if reading.presence is Presence.GONE:
            log.info("node {node} is gone (departed past the grace): marked unhealthy, "
                     "skipped", node=node_id)
            await self.mark_gone(node_id)
            return False
        return True

    async def mark_gone(self, node_id: str) -> None:
        try:
            await self._nodes.mark_unhealthy(node_id)
        except Exception as e:  # a status write failing changes nothing about the choice
            log.warn("marking node {node} unhealthy failed: {err}", node=node_id, err=e)

    async def pick_for_load(self, model: ModelConfig,
                            exclude: frozenset[str] = frozenset()) -> str:
        excluded = set(exclude)
        for _ in range(MAX_PICKS):
            candidates = [c for c in await self.candidates(model) if c.node_id not in excluded]
            if not candidates:
                break
            # Connected nodes first: a node that heartbeats but holds no tunnel (never dialled,
            # or reconnecting) holds no models either, and would otherwise win every cold load.
            candidates = [c for c in candidates if c.connected] or candidates
            if self.room is not None:
                candidates = await self.room.prefer(model, candidates)
            fewest = min(c.models_held for c in candidates)
            chosen = self._shuffled([c for c in candidates if c.models_held == fewest])[0]
            if await self._usable(chosen.node_id):
                return chosen.node_id
            excluded.add(chosen.node_id)
        selector = merged_selector(model, await self.configured_selector(model.name))
        reason = "no healthy backend node" + (f" with labels {selector}" if selector else "")
        if excluded - set(exclude):
            reason += f" (skipped gone nodes: {', '.join(sorted(excluded - set(exclude)))})"
        raise NoNodeAvailable(model.name, reason)

    # -- what a request tells of a placement ------------------------------------------------

    async def reap(self, placement: Placement, evidence: BaseException) -> bool:
        """Delete the loaded row of ``placement`` because the worker answered ``evidence``.

        :raises ValueError: ``evidence`` is not the worker's answer (nothing is deleted)."""
        if not isinstance(evidence, errors.WorkerAnswer):
            raise ValueError(f"refusing to reap {placement.model_name} on {placement.node_id}: "
                             f"{errors.condition_of(evidence)} is not the worker's answer")
        rows = await self._db.runQuery(
            "DELETE FROM node_models WHERE node_id = %s AND model_name = %s AND address = %s"
            " RETURNING id", (placement.node_id, placement.model_name, placement.address))
        if self.on_reaped is not None:
            self.on_reaped(placement.model_name)
        if rows:
            log.info("reaped model {model} on node {node} ({address}) on the worker's answer: "
                     "{evidence}", model=placement.model_name, node=placement.node_id,
                     address=placement.address, evidence=evidence)
        return bool(rows)

    def touch(self, placement: Placement) -> None:
        """Record use (LRU information) with one write; best effort, never awaited by a
        request.  The router batches its touches instead (``usage.ModelUse``)."""
        self._db.runOperation(
            "UPDATE node_models SET last_used = now() WHERE node_id = %s AND model_name = %s",
            (placement.node_id, placement.model_name)).addErrback(lambda _: None)
