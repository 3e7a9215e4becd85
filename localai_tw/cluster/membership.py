"""Replica membership: each frontend replica's ``instances`` row, liveness and the sweep.

A replica registers a row (id, version, advertised peer address, sha256 of its peer secret),
refreshes ``last_seen`` every 5 s with the database's ``now()``, and is live while that is
younger than 30 s.  Every replica, every tick, also sweeps: it deletes replicas that stopped
being live (never itself) and records departures for tunnels they held, then purges old
departures.  There is no leader.  On stop it deregisters, which makes rolling restarts fast;
the sweep covers crashes.

This module must never compare times in Python (the database clock decides liveness), never
log or store the peer secret's plaintext (only its sha256 hex leaves the process), never block
the reactor (address discovery, which may resolve a host name, runs in a thread), and never
reap its own row.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import socket
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Awaitable, Callable

import psycopg2.extensions
from twisted.application.service import Service
from twisted.internet import defer, task, threads
from twisted.logger import Logger
from twisted.python.failure import Failure


from localai_tw.db.pool import DatabaseUnavailable, PoolClosed
from localai_tw.deferreds import wait_at_most
from .clock import (
    DEFAULT_RECONNECT_GRACE,
    INSTANCE_HEARTBEAT,
    INSTANCE_IS_LIVE_SQL,
    INSTANCE_LIVENESS,
    LIVE_INSTANCE_IDS_SQL,  # re-exported: the one spelling other modules use
    departure_retention,
    effective_grace,
    interval_seconds,
)
from .ownership import (
    RECORD_DEPARTURES_OF_MISSING_OWNERS_SQL,
    RECORD_DEPARTURES_OF_OWNER_SQL,
    OwnershipFence,
)

__all__ = [
    "LIVE_INSTANCE_IDS_SQL", "INSTANCE_IS_LIVE_SQL", "AdvertiseAddressError",
    "InstanceNotFound", "InstanceIdentity", "LiveInstance", "MembershipService",
    "check_advertised_address", "discover_advertised_address", "discover_advertised_address_async",
    "hash_secret", "mint_peer_secret", "resolve_instance_id", "secret_matches_hash",
    "register_instance", "heartbeat_instance", "sweep_instances", "deregister_instance",
    "live_instances", "peer_token_hash",
]

log = Logger()

#: Bound on deregistration at shutdown.
DEREGISTER_TIMEOUT = 5.0
_ADVERTISE_FLAG = "--advertise-address"


class InstanceNotFound(Exception):
    """This replica's row is gone (swept while the process stalled).  Internal: the heartbeat
    answers it by registering again."""


class AdvertiseAddressError(ValueError):
    """The advertised peer address is missing, malformed or not dialable by other replicas."""


# -- credentials ----------------------------------------------------------------------------


def mint_peer_secret() -> str:
    """A fresh random secret (192 bits, URL-safe text)."""
    return secrets.token_urlsafe(24)


def hash_secret(secret: str) -> str:
    """The sha256 hex of ``secret``: what is stored in place of a credential."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def secret_matches_hash(presented: str | None, stored_hash: str | None) -> bool:
    """Whether ``presented`` hashes to ``stored_hash``, compared in constant time.

    An empty presented secret or an empty stored hash never matches: an unset credential must
    authorise nobody.
    """
    if not presented or not stored_hash:
        return False
    return hmac.compare_digest(hash_secret(presented).encode("ascii"),
                               stored_hash.strip().lower().encode("ascii", "replace"))


# -- identity and advertised address ------------------------------------------------------------


_INSTANCE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,35}$")


def resolve_instance_id(configured: str | None) -> str:
    """The configured ``--instance-id`` (checked), else a fresh UUID.

    A configured id is stable across restarts, which lets a restarted replica find the rows it
    held under the same name.
    """
    if not configured:
        return str(uuid.uuid4())
    if not _INSTANCE_ID.match(configured):
        raise ValueError("--instance-id must be 1-36 characters of letters, digits, '.', '_' "
                         f"or '-', starting with a letter or digit; got {configured!r}")
    return configured


@dataclass(frozen=True)
class InstanceIdentity:
    """What a replica publishes about itself.  The plaintext secret stays in the process."""

    instance_id: str
    version: str
    advertised_addr: str = ""
    peer_secret: str = field(default_factory=mint_peer_secret, repr=False)

    @property
    def peer_token_hash(self) -> str:
        return hash_secret(self.peer_secret) if self.peer_secret else ""


def _check_port(port, what: str) -> int:
    try:
        value = int(port)
    except (TypeError, ValueError):
        raise AdvertiseAddressError(f"{what}: port {port!r} is not a number") from None
    if not 1 <= value <= 65535:
        raise AdvertiseAddressError(f"{what}: port {value} is outside 1..65535")
    return value


def _format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_ip(ip_text: str, scope: int, single_host: bool, what: str) -> None:
    """Refuse addresses other machines cannot dial: unspecified always; loopback, link-local and
    zoned (scoped) addresses unless the deployment is explicitly single-host."""
    if "%" in ip_text:
        ip_text, scope_text = ip_text.split("%", 1)
        scope = scope or (1 if scope_text else 0)
    ip = ipaddress.ip_address(ip_text)
    if ip.is_unspecified:
        raise AdvertiseAddressError(
            f"{what}: {ip} is the unspecified address, which no peer can dial; set "
            f"{_ADVERTISE_FLAG} to an address other replicas can reach")
    if single_host:
        return
    if ip.is_loopback:
        kind = "a loopback address"
    elif ip.is_link_local:
        kind = "a link-local address"
    elif scope:
        kind = "a zoned (scoped) address"
    else:
        return
    raise AdvertiseAddressError(
        f"{what}: {ip} is {kind}, which other replicas cannot dial; set {_ADVERTISE_FLAG} to "
        "an address they can reach (or enable single-host mode if every replica runs on this "
        "machine)")


def check_advertised_address(addr: str, *, single_host: bool = False) -> str:
    """Validate a configured ``host:port`` (``[v6]:port`` for IPv6) and return it normalised.

    :raises AdvertiseAddressError: unparsable, missing host, bad port, or an address other
        replicas cannot dial (loopback and the like are allowed only with ``single_host``).
    """
    what = f"advertised address {addr!r}"
    text = (addr or "").strip()
    if not text:
        raise AdvertiseAddressError(f"{what}: empty; set {_ADVERTISE_FLAG} as host:port")
    if text.startswith("["):
        m = re.match(r"^\[([^\]]*)\]:(.*)$", text)
        if m is None:
            raise AdvertiseAddressError(f"{what}: expected [ipv6]:port")
        host, port_text = m.group(1), m.group(2)
    else:
        if text.count(":") != 1:
            raise AdvertiseAddressError(
                f"{what}: expected host:port (write IPv6 addresses as [addr]:port)")
        host, port_text = text.split(":")
    if not host:
        raise AdvertiseAddressError(f"{what}: missing host")
    port = _check_port(port_text, what)
    try:
        _check_ip(host, 0, single_host, what)
    except ValueError as e:
        if isinstance(e, AdvertiseAddressError):
            raise
        # Not an IP literal: a host name.  Check its shape; only "localhost" is known loopback.
        if not re.match(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$", host):
            raise AdvertiseAddressError(f"{what}: {host!r} is not a valid host name") from None
        if host.lower().rstrip(".") in ("localhost", "localhost.localdomain") and not single_host:
            raise AdvertiseAddressError(
                f"{what}: {host} is loopback, which other replicas cannot dial; set "
                f"{_ADVERTISE_FLAG} to an address they can reach") from None
    return _format_hostport(host, port)


def database_host_port(dsn: str) -> tuple[str, int]:
    """The database host and port named by a URL or key=value DSN (first host of a list).

    :raises AdvertiseAddressError: no host, or a Unix socket (which says nothing about the
        network interface other replicas could reach).
    """
    try:
        params = psycopg2.extensions.parse_dsn(dsn)
    except psycopg2.ProgrammingError:
        raise AdvertiseAddressError("cannot parse the database DSN to discover the advertised "
                                    f"address; set {_ADVERTISE_FLAG}") from None
    host = (params.get("hostaddr") or params.get("host") or "").split(",")[0].strip()
    if not host or host.startswith("/") or host.startswith("@"):
        raise AdvertiseAddressError(
            "the database is reached through a Unix socket, so the route to it names no "
            f"network address; set {_ADVERTISE_FLAG}")
    port_text = (params.get("port") or "5432").split(",")[0].strip() or "5432"
    return host, _check_port(port_text, "database DSN")


def discover_advertised_address(dsn: str, api_port: int, *, single_host: bool = False) -> str:
    """``<local address toward the database>:<api_port>``.

    Opens a UDP socket "connected" to the database host (no packet is sent) and reads the local
    address the kernel picked: the interface other replicas, which reach the same database,
    most likely reach too.  Blocking (it may resolve a host name): call it from a thread, see
    ``discover_advertised_address_async``.
    """
    port = _check_port(api_port, "API port")
    host, db_port = database_host_port(dsn)
    try:
        infos = socket.getaddrinfo(host, db_port, type=socket.SOCK_DGRAM)
    except OSError as e:
        raise AdvertiseAddressError(f"cannot resolve database host {host!r} ({e}); set "
                                    f"{_ADVERTISE_FLAG}") from None
    last_error: OSError | None = None
    for family, socktype, proto, _, sockaddr in infos:
        sock = socket.socket(family, socktype, proto)
        try:
            sock.connect(sockaddr)
            local = sock.getsockname()
        except OSError as e:
            last_error = e
            continue
        finally:
            sock.close()
        ip_text = local[0]
        scope = local[3] if len(local) >= 4 else 0
        _check_ip(ip_text, scope, single_host, "discovered advertised address")
        return _format_hostport(ip_text.split("%", 1)[0], port)
    raise AdvertiseAddressError(f"no route to database host {host!r} ({last_error}); set "
                                f"{_ADVERTISE_FLAG}")


def discover_advertised_address_async(dsn: str, api_port: int, *,
                                      single_host: bool = False) -> defer.Deferred:
    """``discover_advertised_address`` in the reactor's thread pool."""
    return threads.deferToThread(discover_advertised_address, dsn, api_port,
                                 single_host=single_host)


# -- SQL ------------------------------------------------------------------------------------

_REGISTER_SQL = (
    "INSERT INTO instances"
    " (id, version, advertised_addr, peer_token_hash, last_seen, registered_at)"
    " VALUES (%s, %s, %s, %s, now(), now())"
    " ON CONFLICT (id) DO UPDATE SET"
    "  version = EXCLUDED.version,"
    "  last_seen = now(),"
    # An empty value never wipes a published one.
    "  advertised_addr = CASE WHEN EXCLUDED.advertised_addr <> ''"
    "    THEN EXCLUDED.advertised_addr ELSE instances.advertised_addr END,"
    "  peer_token_hash = CASE WHEN EXCLUDED.peer_token_hash <> ''"
    "    THEN EXCLUDED.peer_token_hash ELSE instances.peer_token_hash END"
)

_HEARTBEAT_SQL = "UPDATE instances SET last_seen = now() WHERE id = %s RETURNING id"

# Bind: self id, liveness.  SKIP LOCKED: two replicas sweeping at once each take the dead rows
# the other is not already deleting, instead of waiting on (or deadlocking against) each other.
_DELETE_DEAD_INSTANCES_SQL = (
    "DELETE FROM instances WHERE id IN ("
    "  SELECT id FROM instances"
    f"  WHERE id <> %s AND NOT ({INSTANCE_IS_LIVE_SQL})"
    "  ORDER BY id FOR UPDATE SKIP LOCKED)"
    " RETURNING id"
)

_DELETE_INSTANCE_SQL = "DELETE FROM instances WHERE id = %s"

_LIVE_INSTANCES_SQL = (
    "SELECT id, version, advertised_addr, last_seen, registered_at FROM instances"
    f" WHERE {INSTANCE_IS_LIVE_SQL} ORDER BY id"
)

_PEER_TOKEN_HASH_SQL = f"SELECT peer_token_hash FROM instances WHERE id = %s AND {INSTANCE_IS_LIVE_SQL}"
_PEER_CREDENTIAL_SQL = (f"SELECT peer_token_hash, ({INSTANCE_IS_LIVE_SQL}) FROM instances"
                        " WHERE id = %s")


@dataclass(frozen=True)
class LiveInstance:
    """A live replica as shown by ``GET /api/cluster/instances`` (no credential material)."""

    id: str
    version: str
    advertised_addr: str
    last_seen: datetime
    registered_at: datetime


@dataclass(frozen=True)
class SweepResult:
    reaped: tuple[str, ...]
    departures: int


async def register_instance(db, identity: InstanceIdentity) -> None:
    """Upsert this replica's row; address and hash are written only when non-empty."""
    await db.runOperation(_REGISTER_SQL, (identity.instance_id, identity.version,
                                          identity.advertised_addr, identity.peer_token_hash))


async def heartbeat_instance(db, instance_id: str) -> None:
    """Refresh ``last_seen``.  :raises InstanceNotFound: the row was swept."""
    if not await db.runQuery(_HEARTBEAT_SQL, (instance_id,)):
        raise InstanceNotFound(instance_id)


async def sweep_instances(db, self_id: str, liveness: float = INSTANCE_LIVENESS) -> SweepResult:
    """Delete non-live replicas except ``self_id``, then record departures for connection rows
    held by replicas that no longer exist.  One transaction, instances first (the same order as
    deregistration, so the two cannot deadlock)."""
    liveness = interval_seconds(liveness)

    async def sweep(cursor) -> SweepResult:
        await cursor.execute(_DELETE_DEAD_INSTANCES_SQL, (self_id, liveness))
        reaped = tuple(r[0] for r in cursor.fetchall())
        await cursor.execute(RECORD_DEPARTURES_OF_MISSING_OWNERS_SQL)
        return SweepResult(reaped, cursor.rowcount)

    return await db.runInteraction(sweep)


async def deregister_instance(db, instance_id: str) -> None:
    """Delete this replica's row and record departures for every row it held."""
    async def leave(cursor) -> None:
        await cursor.execute(_DELETE_INSTANCE_SQL, (instance_id,))
        await cursor.execute(RECORD_DEPARTURES_OF_OWNER_SQL, (instance_id,))

    await db.runInteraction(leave)


async def live_instances(db, liveness: float = INSTANCE_LIVENESS) -> list[LiveInstance]:
    """Every live replica, ordered by id."""
    rows = await db.runQuery(_LIVE_INSTANCES_SQL, (interval_seconds(liveness),))
    return [LiveInstance(*row) for row in rows]


async def peer_token_hash(db, instance_id: str,
                          liveness: float = INSTANCE_LIVENESS) -> str | None:
    """The published peer-secret hash of a live replica, or None (unknown or not live).  Use
    with ``secret_matches_hash`` to check an incoming peer link."""
    rows = await db.runQuery(_PEER_TOKEN_HASH_SQL, (instance_id, interval_seconds(liveness)))
    return rows[0][0] if rows else None


async def peer_credential(db, instance_id: str,
                          liveness: float = INSTANCE_LIVENESS) -> tuple[str, bool] | None:
    """``(published peer-secret hash, live)`` of a known replica, or None (unknown).  A replica
    whose row is known but not live is re-joining (its heartbeat is late, e.g. its database
    connection was being re-established): a link it dials is refused for now, not for ever."""
    rows = await db.runQuery(_PEER_CREDENTIAL_SQL, (interval_seconds(liveness), instance_id))
    return (rows[0][0], bool(rows[0][1])) if rows else None


def _follow(d: defer.Deferred) -> defer.Deferred:
    """A new Deferred firing with ``d``'s result, leaving ``d`` itself untouched."""
    follower: defer.Deferred = defer.Deferred()

    def both(result):
        follower.callback(result) if not isinstance(result, Failure) else \
            follower.errback(result)
        return result
    d.addBoth(both)
    return follower


# -- the service ----------------------------------------------------------------------------


class MembershipService(Service):
    """Keeps this replica's ``instances`` row alive and sweeps departed replicas.

    :param db: a started ``Database``.
    :param identity: the id, version, address and peer secret to publish.
    :param reactor: provides ``callLater``/``seconds`` for the tick and the shutdown bound (a
        ``task.Clock`` in tests).  Liveness itself is decided by the database clock only.
    :param on_reregistered: called (may return a Deferred/coroutine) after the row had been swept
        and was written again, so held tunnels can be re-claimed.
    :param reconnect_grace: sizes the departure retention, so purging never outruns the grace.
    """

    name = "membership"

    def __init__(self, db, identity: InstanceIdentity, *, reactor=None,
                 heartbeat_interval: float = INSTANCE_HEARTBEAT,
                 liveness: float = INSTANCE_LIVENESS,
                 reconnect_grace: float = DEFAULT_RECONNECT_GRACE,
                 on_reregistered: Callable[[], Awaitable[None] | None] | None = None,
                 deregister_timeout: float = DEREGISTER_TIMEOUT):
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        if not identity.instance_id:
            raise ValueError("instance id must not be empty")
        self._db = db
        self.identity = identity
        self._reactor = reactor
        self._interval = float(heartbeat_interval)
        self._liveness = interval_seconds(liveness)
        self._grace = effective_grace(reconnect_grace)
        self._on_reregistered = on_reregistered
        self._deregister_timeout = float(deregister_timeout)
        self._ownership = OwnershipFence(db, liveness=self._liveness)
        self._loop: task.LoopingCall | None = None
        self._loop_done: defer.Deferred | None = None
        self._registration: Failure | str | None = None  # outcome of the first registration
        self._registration_waiters: list[defer.Deferred] = []
        self._in_flight: defer.Deferred | None = None  # the tick running now, if any

    def whenRegistered(self) -> defer.Deferred:
        """A new Deferred firing with the instance id once the first registration is written,
        or failing with its error (startup should fail then)."""
        if isinstance(self._registration, Failure):
            return defer.fail(self._registration)
        if self._registration is not None:
            return defer.succeed(self._registration)
        d = defer.Deferred()
        self._registration_waiters.append(d)
        return d

    def _settle_registration(self, outcome) -> None:
        self._registration = outcome
        waiters, self._registration_waiters = self._registration_waiters, []
        for d in waiters:
            d.errback(outcome) if isinstance(outcome, Failure) else d.callback(outcome)

    @property
    def instance_id(self) -> str:
        return self.identity.instance_id

    def live_instances(self) -> defer.Deferred:
        """Every live replica (for ``GET /api/cluster/instances``), on the database clock."""
        return defer.ensureDeferred(live_instances(self._db, self._liveness))

    def set_reconnect_grace(self, grace: float | None) -> None:
        self._grace = effective_grace(grace)

    @property
    def retention(self) -> float:
        return departure_retention(self._grace, self._liveness)

    def startService(self) -> None:
        super().startService()
        on_restored = getattr(self._db, "on_restored", None)
        if callable(on_restored):
            # After an outage the other replicas may have swept this one's row: heartbeat (and
            # re-register) as soon as the database is back, not up to an interval later, so
            # its peer links are refused for as short a time as possible.
            on_restored(self._tick_after_outage)
        registering = defer.ensureDeferred(register_instance(self._db, self.identity))
        registering.addCallbacks(self._registered, self._registration_failed)

    def _registered(self, _):
        log.info("replica {id} registered (advertised {addr})", id=self.instance_id,
                 addr=self.identity.advertised_addr or "<none>")
        if self.running:
            self._loop = task.LoopingCall(self.tick)
            self._loop.clock = self._reactor
            self._loop_done = self._loop.start(self._interval, now=False)
        self._settle_registration(self.instance_id)

    def _registration_failed(self, failure):
        log.failure("replica {id} could not register", failure, id=self.instance_id)
        self._settle_registration(failure)

    def _tick_after_outage(self) -> defer.Deferred | None:
        if not self.running or self._loop is None:
            return None
        return self.tick()

    def tick(self) -> defer.Deferred:
        """One heartbeat + sweep + purge.  Never fails (a failed tick would stop the loop).
        A tick asked for while one runs (the loop's and the restored database's) shares it."""
        if self._in_flight is not None:
            return _follow(self._in_flight)
        self._in_flight = d = defer.ensureDeferred(self._tick())

        def done(result):
            self._in_flight = None
            return result
        d.addBoth(done)
        return _follow(d)

    async def _tick(self) -> None:
        try:
            try:
                await heartbeat_instance(self._db, self.instance_id)
            except InstanceNotFound:
                log.warn("replica {id} found its row swept (stalled?); registering again",
                         id=self.instance_id)
                await register_instance(self._db, self.identity)
                if self._on_reregistered is not None:
                    try:
                        await defer.maybeDeferred(_call, self._on_reregistered)
                    except Exception:
                        log.failure("on_reregistered callback failed")
            result = await sweep_instances(self._db, self.instance_id, self._liveness)
            if result.reaped or result.departures:
                log.info("sweep reaped replicas {ids}, recorded {n} departures",
                         ids=list(result.reaped), n=result.departures)
            await self._ownership.purge_departed_before(self.retention)
        except (DatabaseUnavailable, PoolClosed) as e:
            # The pool logs an outage once; a line (or a traceback) per tick would repeat it.
            log.debug("membership tick for replica {id} failed ({err}); next tick retries",
                      id=self.instance_id, err=e)
        except Exception:
            log.failure("membership tick for replica {id} failed; next tick retries",
                        id=self.instance_id)

    def stopService(self) -> defer.Deferred:
        super().stopService()
        return defer.ensureDeferred(self._stop())

    async def _stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        if self._loop_done is not None:
            await self._loop_done  # lets an in-flight tick finish before we leave
            self._loop_done = None
        if self._registration is None:
            # Stopped while the first registration is in flight: let it land, then leave.
            try:
                await wait_at_most(self._reactor, self.whenRegistered(), self._deregister_timeout,
                               "registration")
            except Exception:
                pass
        if not isinstance(self._registration, str):
            return  # never registered: nothing to leave
        try:
            await wait_at_most(self._reactor,
                           defer.ensureDeferred(deregister_instance(self._db, self.instance_id)),
                           self._deregister_timeout, "deregistration")
        except Exception:
            log.failure("replica {id} could not deregister; the sweep will reap it",
                        id=self.instance_id)
        else:
            log.info("replica {id} deregistered", id=self.instance_id)


def _call(fn):
    result = fn()
    if hasattr(result, "__await__") and not isinstance(result, defer.Deferred):
        return defer.ensureDeferred(result)
    return result
