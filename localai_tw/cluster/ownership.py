"""Which replica holds a worker's tunnel: fenced claims, releases and presence.

A worker holds one tunnel, accepted by one replica.  That replica records itself in
``node_connections`` with an *epoch* drawn from the sequence ``node_connection_epochs``; the
epoch is the fence token.  Every other replica learns the owner here, joined with live
``instances`` in the same statement, so a dead replica is never named.

Rules this module keeps, and that callers must keep too:

- Every statement is one statement (no read-then-write), and every time comparison is made
  with the database's ``now()``, never the process clock.
- Epochs are unique but NOT ordered (a claimer can draw a lower number than one issued before
  it and still write last).  Compare them with equality only, never ``<`` or ``>``; a unit test
  greps the package for such comparisons.
- A release records a departure (owner ``''``, ``disconnected_at = now()``) instead of
  deleting, and only when node, owner and epoch all match: a stale holder changes nothing.
- Presence is one of four values.  **Only ``Presence.GONE`` may ever be read as absence.**
  ``RECONNECTING`` and ``UNKNOWN`` (including a failed query) mean "do nothing".
- ``NoConnection`` and ``FencedOut`` are internal: the tunnel layer turns them into the routing
  fact ``WorkerUnroutable`` (``localai_tw.errors``); they never reach a user and are never a
  statement about the worker.

This module must never delete a held row, never name a non-live owner, and never read a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from twisted.logger import Logger

from .clock import (
    CONNECTION_IS_HELD_SQL,
    INSTANCE_IS_LIVE_SQL,
    INSTANCE_LIVENESS,
    effective_grace,
    interval_seconds,
)

log = Logger()


class NoConnection(Exception):
    """No live replica holds this node's tunnel (no row, a departed row, or a dead owner).

    Internal to the cluster layer; never shown to users and never evidence about the worker.
    """

    def __init__(self, node_id: str, detail: str = "no live replica holds its tunnel"):
        self.node_id = node_id
        super().__init__(f"node {node_id}: {detail}")


class FencedOut(NoConnection):
    """A release found no row matching node, owner and epoch: someone claimed since.

    Normal when a worker has already moved to another replica; the release changed nothing.
    """

    def __init__(self, node_id: str, owner_id: str):
        self.owner_id = owner_id
        super().__init__(node_id, f"replica {owner_id} no longer holds this epoch (fenced out)")


class Presence(enum.Enum):
    """Where a worker's tunnel stands, as read from the database.

    Only ``GONE`` may be read as absence.  ``RECONNECTING`` and ``UNKNOWN`` mean: leave the node
    alone, it stays schedulable and healthy.
    """

    #: No row: never dialled, or its departure was purged.  Also the value of a failed query.
    UNKNOWN = "unknown"
    #: Held by a live replica.
    CONNECTED = "connected"
    #: Departed within the grace, or held by a dead replica the sweep has not reached yet.
    RECONNECTING = "reconnecting"
    #: Departed longer ago than the grace.  The only absence verdict.
    GONE = "gone"


@dataclass(frozen=True)
class Ownership:
    """The live owner of a node's tunnel and the epoch it claimed."""

    owner_id: str
    epoch: int


@dataclass(frozen=True)
class ConnectionRow:
    """A raw ``node_connections`` row, for diagnostics and tests only: never dial it."""

    node_id: str
    owner_id: str  # '' = held by nobody
    epoch: int
    connected_at: datetime
    disconnected_at: datetime | None


@dataclass(frozen=True)
class ConnectionView:
    """One node's tunnel as :meth:`OwnershipFence.connections` reads it: the live owner (or
    None), the presence, and for a recorded departure the seconds of grace left."""

    owner: Ownership | None
    presence: Presence
    grace_left: float | None


@dataclass(frozen=True)
class PresenceReading:
    """A presence value plus the error that produced it, if the query failed."""

    presence: Presence
    error: BaseException | None = None


# -- SQL ------------------------------------------------------------------------------------
# One statement each.  Parameters are always bound, never formatted; the f-strings below only
# splice in the constant fragments from ``clock``.

_CLAIM_SQL = (
    "INSERT INTO node_connections"
    " (node_id, owner_instance_id, epoch, connected_at, disconnected_at)"
    " VALUES (%s, %s, nextval('node_connection_epochs'), now(), NULL)"
    " ON CONFLICT (node_id) DO UPDATE SET"
    "  owner_instance_id = EXCLUDED.owner_instance_id,"
    # EXCLUDED.epoch is the number this very statement drew; a second nextval would only waste one.
    "  epoch = EXCLUDED.epoch,"
    "  connected_at = now(),"
    "  disconnected_at = NULL"
    " RETURNING epoch"
)

_RELEASE_SQL = (
    "UPDATE node_connections SET owner_instance_id = '', disconnected_at = now()"
    " WHERE node_id = %s AND owner_instance_id = %s AND epoch = %s"
    f" AND {CONNECTION_IS_HELD_SQL}"
    " RETURNING node_id"
)

# Bind: node ids, epochs (two arrays of equal length), owner.  The fence of _RELEASE_SQL for
# many nodes in one statement: a replica stopping with thousands of tunnels must not issue
# thousands of statements inside its stop time.
_RELEASE_MANY_SQL = (
    "UPDATE node_connections SET owner_instance_id = '', disconnected_at = now()"
    " FROM unnest(%s::text[], %s::bigint[]) AS released(node_id, epoch)"
    " WHERE node_connections.node_id = released.node_id"
    "  AND node_connections.epoch = released.epoch"
    "  AND node_connections.owner_instance_id = %s"
    f" AND {CONNECTION_IS_HELD_SQL}"
    " RETURNING node_connections.node_id"
)

#: Claims released per statement by :meth:`OwnershipFence.release_many`.
RELEASE_BATCH = 500

# Bind: liveness, node.
_OWNER_SQL = (
    "SELECT node_connections.owner_instance_id, node_connections.epoch"
    " FROM node_connections"
    " JOIN instances ON instances.id = node_connections.owner_instance_id"
    f"  AND {INSTANCE_IS_LIVE_SQL}"
    f" WHERE node_connections.node_id = %s AND {CONNECTION_IS_HELD_SQL}"
)

_OWNER_ROW_SQL = (
    "SELECT node_id, owner_instance_id, epoch, connected_at, disconnected_at"
    " FROM node_connections WHERE node_id = %s"
)

# Bind: grace, liveness, node.  No row -> UNKNOWN (decided in Python from the empty result).
_PRESENCE_SQL = (
    "SELECT"
    f" ({CONNECTION_IS_HELD_SQL} AND instances.id IS NOT NULL) AS held,"
    f" (NOT {CONNECTION_IS_HELD_SQL}"
    "   AND node_connections.disconnected_at IS NOT NULL"
    "   AND node_connections.disconnected_at < now() - make_interval(secs => %s)) AS departed"
    " FROM node_connections"
    " LEFT JOIN instances ON instances.id = node_connections.owner_instance_id"
    f"  AND {INSTANCE_IS_LIVE_SQL}"
    " WHERE node_connections.node_id = %s"
)

# Bind: grace, grace, liveness, node ids.  What _OWNER_SQL, _PRESENCE_SQL and the grace left
# say, for many nodes in one statement (the admin node list at thousands of nodes).
_CONNECTIONS_SQL = (
    "SELECT node_connections.node_id, node_connections.owner_instance_id,"
    " node_connections.epoch,"
    f" ({CONNECTION_IS_HELD_SQL} AND instances.id IS NOT NULL) AS held,"
    f" (NOT {CONNECTION_IS_HELD_SQL}"
    "   AND node_connections.disconnected_at IS NOT NULL"
    "   AND node_connections.disconnected_at < now() - make_interval(secs => %s)) AS departed,"
    " CASE WHEN node_connections.disconnected_at IS NULL THEN NULL ELSE"
    "  GREATEST(0, %s - EXTRACT(EPOCH FROM now() - node_connections.disconnected_at))::float"
    " END AS grace_left"
    " FROM node_connections"
    " LEFT JOIN instances ON instances.id = node_connections.owner_instance_id"
    f"  AND {INSTANCE_IS_LIVE_SQL}"
    " WHERE node_connections.node_id = ANY(%s)"
)

_PURGE_SQL = (
    "DELETE FROM node_connections"
    f" WHERE NOT {CONNECTION_IS_HELD_SQL}"
    "  AND node_connections.disconnected_at < now() - make_interval(secs => %s)"
)

#: Record departures for held rows whose owner has no ``instances`` row any more.  Used by the
#: membership sweep right after it deletes dead replicas, in the same transaction.  The held
#: filter matters: without it every sweep would re-stamp old departures and they would never age.
RECORD_DEPARTURES_OF_MISSING_OWNERS_SQL = (
    "UPDATE node_connections SET owner_instance_id = '', disconnected_at = now()"
    f" WHERE {CONNECTION_IS_HELD_SQL}"
    "  AND NOT EXISTS (SELECT 1 FROM instances"
    "                  WHERE instances.id = node_connections.owner_instance_id)"
)

#: Record departures for every row held by one replica (bind: its id).  Used on deregister.
RECORD_DEPARTURES_OF_OWNER_SQL = (
    "UPDATE node_connections SET owner_instance_id = '', disconnected_at = now()"
    f" WHERE node_connections.owner_instance_id = %s AND {CONNECTION_IS_HELD_SQL}"
)


def _require_ids(node_id: str, owner_id: str | None = None) -> None:
    if not node_id:
        raise ValueError("node_id must not be empty")
    if owner_id is not None and not owner_id:
        # '' is the "held by nobody" marker; letting a caller pass it would match departed rows.
        raise ValueError("owner_id must not be empty")


class OwnershipFence:
    """Claims, releases and reads tunnel ownership in ``node_connections``.

    :param db: a started ``localai_tw.db.pool.Database``.
    :param liveness: the replica liveness window in seconds (default 30 s).
    """

    def __init__(self, db, liveness: float = INSTANCE_LIVENESS):
        self._db = db
        self._liveness = interval_seconds(liveness)

    async def claim(self, node_id: str, owner_id: str) -> int:
        """Make ``owner_id`` the holder of ``node_id``'s tunnel; return the new epoch.

        One upsert: concurrent claimers serialise on the row lock and the last writer wins.
        """
        _require_ids(node_id, owner_id)
        rows = await self._db.runQuery(_CLAIM_SQL, (node_id, owner_id))
        return int(rows[0][0])

    async def release(self, node_id: str, owner_id: str, epoch: int) -> None:
        """Record that ``owner_id`` no longer holds ``node_id`` at ``epoch``.

        :raises FencedOut: node, owner and epoch did not all match; nothing changed.
        """
        _require_ids(node_id, owner_id)
        rows = await self._db.runQuery(_RELEASE_SQL, (node_id, owner_id, int(epoch)))
        if not rows:
            raise FencedOut(node_id, owner_id)

    async def release_many(self, owner_id: str,
                           claims: list[tuple[str, int]]) -> set[str]:
        """:meth:`release` for many ``(node_id, epoch)`` pairs, :data:`RELEASE_BATCH` per
        statement; returns the node ids released.  The others were fenced out (the worker
        already moved), exactly as :meth:`release` would have raised ``FencedOut`` for them."""
        for node, _ in claims:
            _require_ids(node, owner_id)
        released: set[str] = set()
        for start in range(0, len(claims), RELEASE_BATCH):
            batch = claims[start:start + RELEASE_BATCH]
            rows = await self._db.runQuery(
                _RELEASE_MANY_SQL,
                ([node for node, _ in batch], [int(epoch) for _, epoch in batch], owner_id))
            released.update(row[0] for row in rows)
        return released

    async def owner(self, node_id: str) -> Ownership:
        """The live replica holding ``node_id``'s tunnel, the read to act on.

        :raises NoConnection: no row, a departed row, or an owner that is not live.
        """
        _require_ids(node_id)
        rows = await self._db.runQuery(_OWNER_SQL, (self._liveness, node_id))
        if not rows:
            raise NoConnection(node_id)
        owner_id, epoch = rows[0]
        return Ownership(owner_id, int(epoch))

    async def owner_row(self, node_id: str) -> ConnectionRow | None:
        """The raw row without the liveness join.  Diagnostics and tests only."""
        _require_ids(node_id)
        rows = await self._db.runQuery(_OWNER_ROW_SQL, (node_id,))
        if not rows:
            return None
        node, owner_id, epoch, connected_at, disconnected_at = rows[0]
        return ConnectionRow(node, owner_id, int(epoch), connected_at, disconnected_at)

    async def presence(self, node_id: str, grace: float | None = None) -> PresenceReading:
        """Read presence in one statement.  Never raises for a database failure: a failed query
        is ``UNKNOWN`` plus the error, which nobody may act on.

        :param grace: reconnect grace in seconds; zero, negative or None means the default 90 s.
        """
        _require_ids(node_id)
        grace = effective_grace(grace)
        try:
            rows = await self._db.runQuery(_PRESENCE_SQL, (grace, self._liveness, node_id))
        except Exception as e:
            log.warn("presence of node {node} unknown, query failed: {err}", node=node_id, err=e)
            return PresenceReading(Presence.UNKNOWN, e)
        if not rows:
            return PresenceReading(Presence.UNKNOWN)
        held, departed = rows[0]
        if held:
            return PresenceReading(Presence.CONNECTED)
        if departed:
            return PresenceReading(Presence.GONE)
        return PresenceReading(Presence.RECONNECTING)

    async def connections(self, node_ids: list[str],
                          grace: float | None = None) -> dict[str, "ConnectionView"]:
        """:meth:`owner`, :meth:`presence` and the reconnect grace left, for many nodes in one
        statement.  A node without a row is absent from the answer (presence ``UNKNOWN``, no
        owner).  Raises what the query raises: the caller decides how to show a failed read."""
        for node in node_ids:
            _require_ids(node)
        grace = effective_grace(grace)
        rows = await self._db.runQuery(_CONNECTIONS_SQL,
                                       (grace, grace, self._liveness, list(node_ids)))
        views = {}
        for node_id, owner_id, epoch, held, departed, grace_left in rows:
            if held:
                views[node_id] = ConnectionView(Ownership(owner_id, int(epoch)),
                                                Presence.CONNECTED, None)
            elif departed:
                views[node_id] = ConnectionView(None, Presence.GONE, None)
            else:
                views[node_id] = ConnectionView(
                    None, Presence.RECONNECTING,
                    None if grace_left is None else float(grace_left))
        return views

    async def purge_departed_before(self, age: float) -> int:
        """Delete departure rows older than ``age`` seconds; return how many.  Held rows are
        never deleted, whatever their age."""
        rows = await self._db.runQuery(_PURGE_SQL + " RETURNING node_id",
                                       (interval_seconds(age),))
        return len(rows)
