"""The tunnels this replica holds: one yamux session per worker node, fenced in the database.

A worker's tunnel is accepted by one replica (``connect.py``); this registry records it in memory
and claims it in ``node_connections`` through the :class:`~localai_tw.cluster.ownership.OwnershipFence`.
Every other part of the replica asks here for a session to open a stream on
(:meth:`TunnelRegistry.open_stream`), and the peer relay asks the same question on behalf of other
replicas.

Rules (ref §2.4):

- **Per-node gate.**  Attach, detach and reclaim of one node run one at a time, so two concurrent
  attaches of the same node cannot cross their claim / record order.  Different nodes never wait
  for each other.
- **Claim first, then install.**  A failed claim publishes nothing and closes the session; the
  worker will redial.  A newer session for a node replaces the older one, which is closed *after*
  the gate is released.
- **Tokens.**  ``attach`` returns a token (the epoch of the first claim).  ``detach`` matches it by
  equality, so a replaced holder's late detach changes nothing.  The claim epoch itself may change
  (``reclaim``), which is why the two are kept apart.
- **Attach listeners.**  ``add_attach_listener(fn)``: ``fn(node_id)`` after every attach (the
  replica reconciles a returning worker's backends there), called beside the attach and never
  awaited by it; a failing listener is logged and changes nothing here.
- **Fenced release.**  ``detach`` releases in the database with node, owner *and* epoch;
  ``FencedOut`` is normal there (the worker already moved to another replica).

What this module must never do: say "not held here" (:class:`NotHeldHere`) because of a failure --
a dead session or a database error is :class:`TunnelUnavailable` or an exception of its own, never
a statement that another replica may hold the node; compare epochs other than for equality; relay
or dial anything (it only opens streams on sessions it holds); block the reactor; log credentials
(it never sees any).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger

from localai_tw.deferreds import wait_at_most
from localai_tw.cluster.ownership import NoConnection
from localai_tw.mux.errors import MuxError
from localai_tw.mux.session import ByteTally

log = Logger()

#: Bound on one release at detach time and on the whole release phase of ``close`` (ref §2.4).
RELEASE_TIMEOUT = 5.0
#: Bound on one claim; a claim that outlives it is released if it lands later.
CLAIM_TIMEOUT = 10.0


class NotHeldHere(Exception):
    """This replica holds no session for the node.  A routing fact for the caller, never the
    result of a failure."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        super().__init__(f"this replica holds no tunnel for node {node_id}")


class TunnelUnavailable(Exception):
    """This replica holds the node's session but it would not carry a new stream (closing,
    go-away received, stream limit)."""

    def __init__(self, node_id: str, cause: BaseException):
        self.node_id = node_id
        self.cause = cause
        super().__init__(f"the tunnel of node {node_id} would not carry a stream: {cause}")


class RegistryClosed(Exception):
    """The registry was closed (shutdown); no tunnel is accepted any more."""


@dataclass
class HeldTunnel:
    """One held tunnel.  ``token`` names this attach (fixed); ``claim_epoch`` is the epoch of the
    current database claim (changes on ``reclaim``); ``name`` is the node's name, for logs."""

    node_id: str
    session: Any
    token: int
    claim_epoch: int
    name: str = "-"


class _NodeGates:
    """A lock per node id, created on demand and dropped once nobody holds or waits on it, so the
    map stays bounded by the nodes in flight."""

    def __init__(self):
        self._locks: dict[str, defer.DeferredLock] = {}

    async def run(self, node_id: str, fn):
        lock = self._locks.get(node_id)
        if lock is None:
            lock = self._locks[node_id] = defer.DeferredLock()
        await lock.acquire()
        try:
            return await fn()
        finally:
            lock.release()
            if not lock.locked and not lock.waiting and self._locks.get(node_id) is lock:
                del self._locks[node_id]


class TunnelRegistry:
    """The worker tunnels held by this replica.

    :param fence: the ``OwnershipFence`` writing claims and releases.
    :param instance_id: this replica's id (the owner written in claims).
    :param reactor: ``callLater`` for the claim and release bounds.
    """

    def __init__(self, fence, instance_id: str, reactor=None, *,
                 claim_timeout: float = CLAIM_TIMEOUT, release_timeout: float = RELEASE_TIMEOUT):
        if not instance_id:
            raise ValueError("instance_id must not be empty")
        if reactor is None:
            from twisted.internet import reactor
        self._fence = fence
        self.instance_id = instance_id
        self._reactor = reactor
        self._claim_timeout = claim_timeout
        self._release_timeout = release_timeout
        self._held: dict[str, HeldTunnel] = {}
        #: Wire bytes of every tunnel held here, ended ones included, for metrics.
        self.bytes = ByteTally()
        self._gates = _NodeGates()
        self._closed = False
        self._attach_listeners: list = []
        #: This replica stamps the heartbeat of the tunnels it holds (``cluster/liveness.py``;
        #: set by the wiring): the upgrade tells each worker (``tunnel/connect.py``).
        self.stamps_liveness = False

    # -- queries ------------------------------------------------------------------------------

    def held_nodes(self) -> list[str]:
        """Ids of the nodes whose tunnel this replica holds, sorted."""
        return sorted(self._held)

    def live_claims(self) -> list[tuple[str, int]]:
        """``(node_id, claim epoch)`` of every held tunnel whose session is still open: the
        tunnels this replica vouches for (``cluster/liveness.py`` stamps their heartbeat)."""
        return [(held.node_id, held.claim_epoch) for held in self._held.values()
                if held.session.isOpen]

    def holds(self, node_id: str) -> bool:
        return node_id in self._held

    def session_for(self, node_id: str):
        """The held session of ``node_id``, or None."""
        held = self._held.get(node_id)
        return held.session if held is not None else None

    def held(self, node_id: str) -> HeldTunnel | None:
        """The entry of ``node_id`` (for diagnostics and tests), or None."""
        return self._held.get(node_id)

    def open_stream(self, node_id: str, protocol, data: bytes = b""):
        """Open a stream on ``node_id``'s session and connect ``protocol`` to it.

        :raises NotHeldHere: no session for the node on this replica.
        :raises TunnelUnavailable: the session exists but would not open a stream.
        """
        held = self._held.get(node_id)
        if held is None:
            raise NotHeldHere(node_id)
        try:
            return held.session.openStream(protocol, data)
        except MuxError as e:
            raise TunnelUnavailable(node_id, e) from e

    def add_attach_listener(self, listener) -> None:
        """Call ``listener(node_id)`` after every attach here (a worker's tunnel arrived or
        came back): beside the attach, never awaited by it; a failure is logged."""
        self._attach_listeners.append(listener)

    def _attached(self, node_id: str) -> None:
        for listener in self._attach_listeners:
            defer.maybeDeferred(listener, node_id).addErrback(
                lambda f: log.failure("attach listener failed for node {node}", f,
                                      node=node_id))

    # -- attach / detach -----------------------------------------------------------------------

    def attach(self, node_id: str, session, name: str = "-") -> defer.Deferred:
        """Claim ``node_id`` (named ``name``, for logs) for this replica and install ``session``;
        fires with the token that ``detach`` must present.  On any failure the session is closed
        and nothing is published.
        """
        return defer.ensureDeferred(self._attach(node_id, session, name))

    async def _attach(self, node_id: str, session, name: str = "-") -> int:
        replaced: list[HeldTunnel] = []

        async def claim_and_install() -> int:
            if self._closed:
                raise RegistryClosed("the tunnel registry is closed (shutting down)")
            epoch = await self._claim(node_id)
            if not session.isOpen:
                # The worker left while we claimed: record the departure at once.
                await self._release(node_id, epoch, name)
                raise ConnectionError(f"the session of node {node_id} ended during its claim")
            previous = self._held.get(node_id)
            if previous is not None:
                replaced.append(previous)
            self._held[node_id] = HeldTunnel(node_id, session, epoch, epoch, name)
            self.bytes.watch(session)
            return epoch

        try:
            token = await self._gates.run(node_id, claim_and_install)
        except BaseException:
            session.loseConnection()
            raise
        for old in replaced:
            log.info("tunnel node={node} ({name}) replica={replica}: epoch {new} replaces epoch "
                     "{old}; closing the older session", node=node_id, name=name,
                     replica=self.instance_id, new=token, old=old.claim_epoch)
            old.session.loseConnection()
        self._attached(node_id)
        return token

    async def _claim(self, node_id: str) -> int:
        abandoned = False

        def landed(epoch):
            if abandoned:
                # A claim that lands after we gave up belongs to a session we closed: undo it.
                defer.ensureDeferred(self._release(node_id, epoch))
            return epoch

        claiming = defer.ensureDeferred(self._fence.claim(node_id, self.instance_id))
        claiming.addCallback(landed)
        try:
            return await wait_at_most(self._reactor, claiming, self._claim_timeout,
                                 f"claiming node {node_id}")
        except defer.TimeoutError:
            abandoned = True
            raise

    def detach(self, node_id: str, token: int) -> defer.Deferred:
        """The session attached with ``token`` ended: forget it and release its claim.  Does
        nothing when ``token`` is not the current one (a replaced holder's late detach).  Fires
        with True when it removed the entry.  Never fails."""
        return defer.ensureDeferred(self._detach(node_id, token))

    async def _detach(self, node_id: str, token: int) -> bool:
        async def forget() -> HeldTunnel | None:
            held = self._held.get(node_id)
            if held is None or held.token != token:
                return None
            del self._held[node_id]
            return held

        held = await self._gates.run(node_id, forget)
        if held is None:
            log.debug("tunnel node={node} replica={replica}: late detach of token {token} "
                      "ignored (replaced or already released)", node=node_id,
                      replica=self.instance_id, token=token)
            return False
        # Outside the gate: the release is fenced by the epoch, so a newer attach that claims
        # meanwhile cannot be undone by it.
        await self._release(node_id, held.claim_epoch, held.name)
        return True

    async def _release(self, node_id: str, epoch: int, name: str = "-") -> None:
        """Release one claim, bounded; never raises.  ``FencedOut`` is normal."""
        try:
            await wait_at_most(self._reactor,
                          defer.ensureDeferred(self._fence.release(node_id, self.instance_id,
                                                                   epoch)),
                          self._release_timeout, f"releasing node {node_id}")
        except NoConnection:  # includes FencedOut
            log.info("tunnel node={node} ({name}) replica={replica} epoch={epoch}: release "
                     "fenced out (the worker already moved)", node=node_id, name=name,
                     replica=self.instance_id, epoch=epoch)
        except Exception as e:
            log.warn("tunnel node={node} ({name}) replica={replica} epoch={epoch}: release "
                     "failed ({err}); the next claim or the membership sweep settles it",
                     node=node_id, name=name, replica=self.instance_id, epoch=epoch, err=e)
        else:
            log.info("tunnel node={node} ({name}) replica={replica} epoch={epoch}: departure "
                     "recorded", node=node_id, name=name, replica=self.instance_id, epoch=epoch)

    def disconnect(self, node_id: str) -> bool:
        """Close ``node_id``'s session (node deleted, credential replaced).  Its detach follows
        when the session ends.  True when a session was held."""
        held = self._held.get(node_id)
        if held is None:
            return False
        log.info("tunnel node={node} ({name}) replica={replica} epoch={epoch}: disconnecting",
                 node=node_id, name=held.name, replica=self.instance_id,
                 epoch=held.claim_epoch)
        held.session.loseConnection()
        return True

    # -- membership and shutdown -------------------------------------------------------------------

    def reclaim(self) -> defer.Deferred:
        """Claim again every node whose session is still open.  Called after this replica's
        ``instances`` row was swept (a long stall) and written again, when the sweep had recorded
        departures for everything it held.  Fires with the node ids re-claimed; never fails."""
        return defer.ensureDeferred(self._reclaim())

    async def _reclaim(self) -> list[str]:
        reclaimed = []
        for node_id, held in list(self._held.items()):
            if not held.session.isOpen:
                continue
            ok = await self._gates.run(node_id, lambda n=node_id, h=held: self._reclaim_one(n, h))
            if ok:
                reclaimed.append(node_id)
        return reclaimed

    async def _reclaim_one(self, node_id: str, held: HeldTunnel) -> bool:
        if self._held.get(node_id) is not held:
            return False  # replaced or detached meanwhile
        try:
            epoch = await self._claim(node_id)
        except Exception as e:
            log.warn("tunnel node={node} ({name}) replica={replica}: re-claim failed ({err})",
                     node=node_id, name=held.name, replica=self.instance_id, err=e)
            return False
        if self._held.get(node_id) is not held:
            await self._release(node_id, epoch, held.name)  # the entry vanished mid-claim
            return False
        log.info("tunnel node={node} ({name}) replica={replica}: re-claimed, epoch {old} -> "
                 "{new}", node=node_id, name=held.name, replica=self.instance_id,
                 old=held.claim_epoch, new=epoch)
        held.claim_epoch = epoch
        return True

    def close(self) -> defer.Deferred:
        """Shutdown: refuse new attaches, close every session and release every claim, within
        ``release_timeout`` in total.  Call before leaving ``instances``.  Never fails.

        The claims are released in batches (one statement per ``ownership.RELEASE_BATCH`` nodes) and
        logged as one summary line: a replica holding thousands of tunnels stops within its stop
        time instead of issuing, and logging, one release per node."""
        self._closed = True
        held, self._held = list(self._held.values()), {}
        for entry in held:
            entry.session.loseConnection()  # its detach then finds no entry: a no-op
        if not held:
            return defer.succeed(None)
        waiting = wait_at_most(self._reactor, defer.ensureDeferred(self._release_all(held)),
                               self._release_timeout, "releasing the tunnels at shutdown")
        waiting.addErrback(lambda f: log.warn(
            "tunnel registry close replica={replica}: {err}; the membership sweep records the "
            "departures of the {count} nodes left", replica=self.instance_id,
            err=f.getErrorMessage(), count=len(held)))
        return waiting.addCallback(lambda _: None)

    async def _release_all(self, held: list[HeldTunnel]) -> None:
        claims = [(e.node_id, e.claim_epoch) for e in held]
        released = await self._fence.release_many(self.instance_id, claims)
        log.info("tunnel registry close replica={replica}: departure recorded for {released} "
                 "of {count} nodes ({fenced} fenced out: those workers already moved)",
                 replica=self.instance_id, released=len(released), count=len(claims),
                 fenced=len(claims) - len(released))
