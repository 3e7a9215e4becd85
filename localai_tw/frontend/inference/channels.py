"""A backend's gRPC channel lives only while a placement names it: the sweep that closes the
others.

This replica opens a client (a grpcio channel and its bridge socket, ``backend_client.py``,
``grpcbridge.py``) per (node, backend port) it calls.  The placement that named that port is a
``node_models`` row (one per model replica), and it goes in many ways, most of them on another
replica or with no message at all: ``offline`` clears a node's rows, an unload or a reap
deletes one, a re-registration clears them all, the worker restarts on new ports, the node is
deleted.  Only a departure (``gone``) and a node deletion were told here, so a crash followed
by ``offline``, or a restart inside the grace, left channels open for good.

:class:`PlacementSweep` therefore asks the database, every ``interval`` seconds, which of the
(node, port) pairs this replica holds a client for are still named by a row (any state: a
cold load writes its row before its first call), and closes the client and the bridge of
every pair no row names -- unless a call of it is in flight, or it was used since the sweep's
previous look (a placement read a moment before its row went is allowed its call; a client
orphaned at two looks in a row with no use in between is closed).  With no client open, a pass
reads nothing.  A failed read changes nothing, and says so once until a read works again (a
database outage is not a line every pass).

What this module must never do: close a client with a call in flight; delete or change any
row (it only reads ``node_models``); run a statement when no client is open.
"""

from __future__ import annotations

from twisted.logger import Logger

from localai_tw.periodic import PeriodicPass

log = Logger()

#: Seconds between looks.  A channel outlives its placement by at most about two of them.
SWEEP_INTERVAL = 10.0

_PLACED_SQL = "SELECT node_id, address FROM node_models WHERE node_id = ANY(%s)"


def _port_of(address) -> int | None:
    try:
        return int(str(address).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


class PlacementSweep(PeriodicPass):
    """Closes this replica's backend clients whose placement is gone (module docstring).

    :param db: the replica's ``Database``.
    :param clients: the replica's ``BackendClients``.
    """

    name = "placement-sweep"
    pass_name = "backend channel sweep"

    def __init__(self, db, clients, reactor, interval: float = SWEEP_INTERVAL):
        self._db = db
        self._clients = clients
        self._reactor = reactor
        self.interval = float(interval)
        #: (node, port) pairs closed by this sweep, ever (for tests and metrics)
        self.closed = 0
        self._read_failed = False

    async def run_once(self) -> list[tuple[str, int]]:
        """One look; returns the pairs it closed."""
        open_now = self._clients.open_clients()
        if not open_now:
            return []
        nodes = sorted({node for node, _ in open_now})
        try:
            rows = await self._db.runQuery(_PLACED_SQL, (nodes,))
        except Exception as e:
            if not self._read_failed:
                log.warn("backend channel sweep: reading the placements failed ({err}); "
                         "nothing closed", err=f"{type(e).__name__}: {e}")
            self._read_failed = True
            return []
        self._read_failed = False
        placed = {(node, _port_of(address)) for node, address in rows}
        closing = []
        for key, client in open_now.items():
            if key in placed:
                continue
            if client.in_flight or client.used:
                client.used = False  # looked at: the next look closes it if still unused
                continue
            closing.append(key)
        for node, port in closing:
            log.info("closed the gRPC channel to worker {node} port {port}: no placement names "
                     "it any more", node=node, port=port)
            await self._clients.drop(node, port)
            self.closed += 1
        return closing
