"""Broadcast fan-out between replicas over PostgreSQL LISTEN/NOTIFY, with spill for big messages.

A subject such as ``jobs.42.progress`` travels on the channel of its root (``localai_jobs``);
the roots form a closed set (``ROOTS``) and anything else is refused with ``UnservedSubject``,
because a channel per id would make every replica LISTEN without bound.  Subscribers filter by
the full subject: exact, or ``*`` for exactly one token (``>`` is refused).

A message is the compact JSON envelope ``{"s":subject,"d":payload}``.  PostgreSQL refuses a
NOTIFY payload of 8000 bytes or more, so an encoded envelope of that size is *spilled*: the
payload goes to a ``bus_messages`` row and only ``{"s":subject,"i":row-id}`` is notified, in the
same statement, so the row is committed before anyone hears of it.  ``fits_inline`` answers
"would this go inline" with exactly the encoder and comparison ``publish`` uses.

Delivery is **at-most-once**.  One pinned LISTEN connection per bus (not from the pool) feeds a
bounded inbound queue; a single resolver keeps arrival order between inline and spilled
messages (spilled rows are fetched by primary key) and hands each message to bounded
per-subscriber queues.  A full queue drops and counts.  A reconnecting bus misses whatever was
sent meanwhile; after re-LISTENing it runs the ``onReconnect`` callbacks so consumers can re-read
their state from tables.  Anything that must survive a gap lives in a table; a broadcast is a hint.

This module must never block the reactor, never let the LISTEN connection wait on anything (a
listener that stops reading fills PostgreSQL's shared notification queue and eventually blocks
COMMIT server-wide), never hold an unbounded queue, and never treat silence as evidence about a
node or a replica.

One module of about 820 lines, because the LISTEN connection's life (connect, LISTEN, health,
reconnect, the ``onReconnect`` callbacks), the ordered resolver and the per-subscriber queues
share one arrival order and one stop: apart, a message could be delivered past a stop or out
of order across a reconnect.
"""

from __future__ import annotations

import inspect
import itertools
import json
import re
import uuid
from collections import deque
from typing import Any, Callable

import psycopg2
from twisted.application import service
from twisted.internet import defer, task
from twisted.logger import Logger, LogLevel
from txpostgres import txpostgres

from localai_tw.deferreds import wait_at_most
from localai_tw.db.pool import Database, DatabaseUnavailable, PoolClosed

log = Logger()

#: Subject roots that have a channel.  ``claims`` carries the claim queue's wake hint.
ROOTS = frozenset({
    "jobs", "agent", "gallery", "cache", "staging", "prefixcache", "responses", "state",
    "claims",
})
CHANNEL_PREFIX = "localai_"

#: PostgreSQL refuses a NOTIFY payload whose length is >= 8000 bytes; 7999 is the largest.
NOTIFY_LIMIT_BYTES = 8000
#: Largest encoded payload a broadcast may carry (inline or spilled), shared by every carrier.
MAX_BROADCAST_BYTES = 8 * 1024 * 1024
#: Subjects are stored in ``bus_messages.subject varchar(255)``.
MAX_SUBJECT_CHARS = 255

INBOUND_QUEUE_LIMIT = 1024
SUBSCRIBER_QUEUE_LIMIT = 256
SPILL_RETENTION_SECONDS = 600.0
SPILL_PURGE_INTERVAL_SECONDS = SPILL_RETENTION_SECONDS / 2
RECONNECT_BASE_SECONDS = 0.1
RECONNECT_MAX_SECONDS = 5.0
HEALTH_INTERVAL_SECONDS = 5.0
HEALTH_TIMEOUT_SECONDS = 5.0
SUBSCRIBE_TIMEOUT_SECONDS = 30.0
FETCH_TIMEOUT_SECONDS = 8.0


# -- errors -------------------------------------------------------------------------------------


class BusError(Exception):
    """Base of every error this module raises."""


class InvalidSubject(BusError, ValueError):
    """The subject or pattern is malformed (empty token, whitespace, ``>``, too long)."""


class UnservedSubject(BusError, ValueError):
    """The subject's root is not one of ``ROOTS``, so no channel carries it."""


class PayloadTooLarge(BusError, ValueError):
    """The encoded payload is larger than ``MAX_BROADCAST_BYTES``."""


class PayloadNotJSON(BusError, TypeError):
    """The payload cannot be encoded as JSON."""


class BusStopped(BusError):
    """The bus was stopped while the caller waited."""


class SubscribeTimeout(BusError):
    """LISTEN was not acknowledged in time (the bus kept failing to connect)."""


# -- subjects, channels and the envelope (pure) --------------------------------------------------

_BAD_TOKEN_CHARS = re.compile(r"[\s*>]")


def _tokens(text: str, *, pattern: bool) -> list[str]:
    if not isinstance(text, str) or not text:
        raise InvalidSubject(f"subject must be a non-empty string, got {text!r}")
    if len(text) > MAX_SUBJECT_CHARS:
        raise InvalidSubject(f"subject is {len(text)} characters; the limit is "
                             f"{MAX_SUBJECT_CHARS}")
    tokens = text.split(".")
    for tok in tokens:
        if tok == "":
            raise InvalidSubject(f"subject {text!r} has an empty token")
        if tok == ">" or (">" in tok):
            raise InvalidSubject(f"{text!r}: the '>' wildcard is not supported; "
                                 "use '*' for exactly one token")
        if pattern and tok == "*":
            continue
        if _BAD_TOKEN_CHARS.search(tok):
            what = "pattern" if pattern else "subject (publish needs a concrete subject)"
            raise InvalidSubject(f"{what} {text!r} has an invalid token {tok!r}")
    return tokens


def channel_for(subject_or_pattern: str, *, pattern: bool = False) -> str:
    """The LISTEN/NOTIFY channel carrying this subject (``localai_<root>``).

    Raises ``InvalidSubject`` for a malformed subject and ``UnservedSubject`` for a root outside
    ``ROOTS`` (a wildcard root included: it would need every channel).
    """
    root = _tokens(subject_or_pattern, pattern=pattern)[0]
    if root not in ROOTS:
        raise UnservedSubject(
            f"subject {subject_or_pattern!r} has root {root!r}, which no channel serves; "
            f"served roots: {', '.join(sorted(ROOTS))}"
        )
    return CHANNEL_PREFIX + root


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` matches ``pattern`` (exact, or ``*`` standing for one token)."""
    p = pattern.split(".")
    s = subject.split(".")
    if len(p) != len(s):
        return False
    return all(a == "*" or a == b for a, b in zip(p, s))


def encode_payload(payload: Any) -> str:
    """Compact JSON of a payload: no spaces, ASCII only.

    ASCII (non-ASCII escaped) keeps the byte count independent of the server and client
    encodings, so the 8000-byte comparison means the same thing on every database.
    """
    try:
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise PayloadNotJSON(f"broadcast payload cannot be encoded as JSON: {e}") from e


def _envelope(subject: str, key: str, value_json: str) -> str:
    # Byte-for-byte what json.dumps({"s": subject, key: value}, separators=(",", ":")) gives,
    # without encoding a large payload twice.
    return '{"s":' + json.dumps(subject, ensure_ascii=True) + ',"' + key + '":' + value_json + "}"


def encode_envelope(subject: str, payload: Any) -> str:
    """The inline envelope ``{"s":subject,"d":payload}`` exactly as it would be notified."""
    return _envelope(subject, "d", encode_payload(payload))


class _Plan:
    __slots__ = ("channel", "subject", "data", "envelope", "inline")

    def __init__(self, subject: str, payload: Any):
        self.channel = channel_for(subject)
        self.subject = subject
        self.data = encode_payload(payload)
        if len(self.data) > MAX_BROADCAST_BYTES:
            raise PayloadTooLarge(
                f"broadcast payload for {subject!r} is {len(self.data)} bytes encoded; the cap "
                f"is {MAX_BROADCAST_BYTES} (8 MiB). Put large results in a table and "
                "broadcast a reference."
            )
        self.envelope = _envelope(subject, "d", self.data)
        # ASCII only, so characters are bytes.
        self.inline = len(self.envelope) < NOTIFY_LIMIT_BYTES


def fits_inline(subject: str, payload: Any) -> bool:
    """Whether ``publish(subject, payload)`` would NOTIFY the payload inline (no spill row).

    Same encoder and same comparison as ``publish``; raises what ``publish`` would raise.
    """
    return _Plan(subject, payload).inline


# -- subscriptions --------------------------------------------------------------------------------


class Subscription:
    """One subscriber: a pattern, a handler and its own bounded queue.

    The handler is called as ``handler(subject, payload)`` one message at a time, in arrival
    order; if it returns a Deferred or a coroutine, the next message waits for it.  Exceptions
    are logged and the next message is delivered.
    """

    def __init__(self, bus: "PgBus", pattern: str, channel: str,
                 handler: Callable[[str, Any], Any], limit: int):
        self.pattern = pattern
        self.channel = channel
        self._bus = bus
        self._handler = handler
        self._limit = limit
        self._queue: deque[tuple[str, Any]] = deque()
        self._pumping = False
        self.active = True
        #: Messages dropped because this subscriber's queue was full.
        self.dropped = 0
        #: Messages handed to the handler.
        self.delivered = 0

    def unsubscribe(self) -> defer.Deferred:
        return self._bus.unsubscribe(self)

    def _offer(self, subject: str, payload: Any) -> None:
        if not self.active:
            return
        if len(self._queue) >= self._limit:
            self.dropped += 1
            self._bus._count_drop("subscriber")
            return
        self._queue.append((subject, payload))
        if not self._pumping:
            self._pump()

    def _pump(self) -> None:
        self._pumping = True
        while self._queue and self.active:
            subject, payload = self._queue.popleft()
            self.delivered += 1
            d = self._call(subject, payload)
            if d is not None and not d.called:
                d.addBoth(self._resume)  # the next message waits for this one
                return
        self._pumping = False

    def _resume(self, _ignored) -> None:
        self._pumping = False
        if self._queue and self.active:
            self._pump()

    def _call(self, subject: str, payload: Any) -> defer.Deferred | None:
        try:
            result = self._handler(subject, payload)
            if inspect.isawaitable(result) and not isinstance(result, defer.Deferred):
                result = defer.ensureDeferred(result)
        except Exception:
            log.failure("bus handler for {pattern} failed on {subject}",
                        pattern=self.pattern, subject=subject)
            return None
        if not isinstance(result, defer.Deferred):
            return None
        return result.addErrback(lambda f: log.failure(
            "bus handler for {pattern} failed on {subject}", f,
            pattern=self.pattern, subject=subject))

    def __repr__(self) -> str:
        return f"<Subscription {self.pattern!r} on {self.channel}>"


class _InOrderCooperator:
    """Runs txpostgres' notify dispatch at once instead of on the global Cooperator.

    The global Cooperator interleaves separate tasks round-robin, so two batches of notifies
    read in two reactor turns could reach us out of order.  Our observer only appends to a
    bounded deque, so running it inline costs nothing and keeps arrival order.
    """

    def cooperate(self, iterator):
        for _ in iterator:
            pass


class _LossDetector:
    """txpostgres' dead-connection hook: tells the bus the moment the socket dies."""

    def __init__(self, bus: "PgBus", generation: int):
        self._bus = bus
        self._generation = generation

    def setReconnectable(self, *args, **kwargs):
        pass

    def callChecking(self, method, *args, **kwargs):
        return method(*args, **kwargs)

    def checkForDeadConnection(self, reason):
        self._bus._lost(self._generation, reason.value)


_bus_ids = itertools.count(1)


class PgBus(service.Service):
    """LISTEN/NOTIFY fan-out as a Twisted service (see the module docstring).

    :param db: a started ``Database``; publishes and spill fetches use its pool, and the LISTEN
        connection is pinned from it (same server, same database).
    """

    name = "pgbus"

    def __init__(self, db: Database, *, reactor=None,
                 health_interval: float = HEALTH_INTERVAL_SECONDS,
                 health_timeout: float = HEALTH_TIMEOUT_SECONDS,
                 spill_retention: float = SPILL_RETENTION_SECONDS,
                 purge_interval: float = SPILL_PURGE_INTERVAL_SECONDS,
                 inbound_limit: int = INBOUND_QUEUE_LIMIT,
                 subscriber_limit: int = SUBSCRIBER_QUEUE_LIMIT,
                 subscribe_timeout: float = SUBSCRIBE_TIMEOUT_SECONDS,
                 fetch_timeout: float = FETCH_TIMEOUT_SECONDS,
                 reconnect_base: float = RECONNECT_BASE_SECONDS,
                 reconnect_max: float = RECONNECT_MAX_SECONDS):
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        self._db = db
        self._reactor = reactor
        self._health_interval = health_interval
        self._health_timeout = health_timeout
        self._retention = spill_retention
        self._purge_interval = purge_interval
        self._inbound_limit = inbound_limit
        self._subscriber_limit = subscriber_limit
        self._subscribe_timeout = subscribe_timeout
        self._fetch_timeout = fetch_timeout
        self._reconnect_base = reconnect_base
        self._reconnect_max = reconnect_max
        # A unique purpose makes the LISTEN backend findable in pg_stat_activity.
        self._purpose = f"pgbus_{next(_bus_ids)}_{uuid.uuid4().hex[:8]}"

        self._subs: dict[str, set[Subscription]] = {}
        self._listening: set[str] = set()  # channels LISTENed on the current connection
        self._cmd_lock = defer.DeferredLock()  # decide-and-issue LISTEN/UNLISTEN in one step
        self._conn: txpostgres.Connection | None = None
        self._generation = 0
        self._connected = False
        self._ever_connected = False
        self._connecting = False
        self._connected_waiters: list[defer.Deferred] = []
        self._reconnect_callbacks: list[Callable[[], Any]] = []
        self._reconnect_wait: defer.Deferred | None = None
        self._health_loop: task.LoopingCall | None = None
        self._health_running = False
        self._purge_loop: task.LoopingCall | None = None

        self._inbound: deque[tuple[str, str]] = deque()
        self._resolving = False
        self._resolve_call = None

        #: Drops by stage: inbound (listener queue full), decode (malformed notify),
        #: resolve (spill row missing or fetch failed), subscriber (a subscriber queue full).
        self.dropped = {"inbound": 0, "decode": 0, "resolve": 0, "subscriber": 0}
        self.reconnects = 0
        #: Messages PostgreSQL took from ``publish``, and how many of them were spilled.
        self.published = 0
        self.spilled = 0
        self.listener_pid: int | None = None

    # -- introspection (logs and tests only) ----------------------------------------------------

    @property
    def isConnected(self) -> bool:
        return self._connected

    @property
    def applicationName(self) -> str:
        """``application_name`` of the LISTEN connection in ``pg_stat_activity``."""
        return f"{self._db._app}_{self._purpose}"

    @property
    def droppedTotal(self) -> int:
        return sum(self.dropped.values())

    def _count_drop(self, stage: str) -> None:
        self.dropped[stage] += 1

    # -- service lifecycle ------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._health_loop = task.LoopingCall(self._health_check)
        self._health_loop.clock = self._reactor
        self._health_loop.start(self._health_interval, now=False)
        self._purge_loop = task.LoopingCall(self.purgeSpill)
        self._purge_loop.clock = self._reactor
        self._purge_loop.start(self._purge_interval, now=True)
        self._start_connecting(0.0)

    def stopService(self):
        super().stopService()
        for loop in (self._health_loop, self._purge_loop):
            if loop is not None and loop.running:
                loop.stop()
        wait, self._reconnect_wait = self._reconnect_wait, None
        if wait is not None and not wait.called:
            wait.cancel()  # ends the connect loop (CancelledError inside it)
        if self._resolve_call is not None and self._resolve_call.active():
            self._resolve_call.cancel()
        self._resolve_call = None
        self._drop_connection()
        self._inbound.clear()
        waiters, self._connected_waiters = self._connected_waiters, []
        for d in waiters:
            d.errback(BusStopped("the bus was stopped"))
        return defer.succeed(None)

    def whenConnected(self) -> defer.Deferred:
        """Fires once the LISTEN connection is up (at once if it already is)."""
        if self._connected:
            return defer.succeed(None)
        if not self.running:
            return defer.fail(BusStopped("the bus is not running"))
        d = defer.Deferred(lambda d: self._connected_waiters.remove(d)
                           if d in self._connected_waiters else None)
        self._connected_waiters.append(d)
        return d

    def onReconnect(self, callback: Callable[[], Any]) -> Callable[[], None]:
        """Call ``callback()`` after every reconnect, once every channel is LISTENed again.

        Messages sent during the gap are lost; the callback is where a consumer re-reads its
        state from tables.  Each callback runs on its own (a failing or slow one does not affect
        the others).  Returns a function that removes the callback.
        """
        self._reconnect_callbacks.append(callback)
        return lambda: (self._reconnect_callbacks.remove(callback)
                        if callback in self._reconnect_callbacks else None)

    # -- connection management --------------------------------------------------------------

    def _start_connecting(self, delay: float) -> None:
        if self._connecting or not self.running:
            return
        self._connecting = True
        d = defer.ensureDeferred(self._connect_loop(delay))
        d.addErrback(lambda f: log.failure("pgbus connect loop crashed", f))

    async def _connect_loop(self, delay: float) -> None:
        failed = 0
        try:
            while self.running:
                if delay > 0:
                    try:
                        await self._sleep(delay)
                    except defer.CancelledError:
                        return
                    if not self.running:
                        return
                next_delay = min(max(delay * 2, self._reconnect_base), self._reconnect_max)
                try:
                    conn = await self._db.connectPinned(self._purpose)
                except (DatabaseUnavailable, psycopg2.Error) as e:
                    # One warning per outage (the pool logs the outage itself); the attempts
                    # after it only at debug, not a line every few seconds for its length.
                    log.emit(LogLevel.debug if failed else LogLevel.warn,
                             "pgbus: LISTEN connection failed, retrying in {delay:.1f}s{more}: "
                             "{err}", delay=next_delay, err=e,
                             more="" if failed else " (further attempts are not logged)")
                    failed += 1
                    delay = next_delay
                    continue
                if not self.running:
                    conn.close()
                    return
                if await self._adopt(conn):
                    return
                delay = next_delay
        finally:
            self._connecting = False

    async def _adopt(self, conn: txpostgres.Connection) -> bool:
        """Make ``conn`` the LISTEN connection: observers, re-LISTEN, then callbacks."""
        self._generation += 1
        generation = self._generation
        conn.cooperator = _InOrderCooperator()
        conn.detector = _LossDetector(self, generation)
        conn.addNotifyObserver(self._on_notify)
        await self._cmd_lock.acquire()
        try:
            try:
                ((pid,),) = await conn.runQuery("SELECT pg_backend_pid()")
                listened = set()
                for channel in sorted(ch for ch, subs in self._subs.items() if subs):
                    await conn.runOperation(f'LISTEN "{channel}"')
                    listened.add(channel)
            except (psycopg2.Error, txpostgres.AlreadyPolling) as e:
                log.warn("pgbus: re-LISTEN failed on a fresh connection: {err}", err=e)
                _close_quietly(conn)
                return False
            if not self.running or generation != self._generation:
                _close_quietly(conn)
                return True
            self._conn = conn
            self._listening = listened
            self._connected = True
            self.listener_pid = pid
        finally:
            self._cmd_lock.release()
        reconnect = self._ever_connected
        self._ever_connected = True
        if reconnect:
            self.reconnects += 1
            log.info("pgbus: reconnected; re-LISTENed {n} channels", n=len(listened))
        waiters, self._connected_waiters = self._connected_waiters, []
        for d in waiters:
            d.callback(None)
        if reconnect:
            for cb in list(self._reconnect_callbacks):
                self._reactor.callLater(0, self._run_reconnect_callback, cb)
        return True

    def _run_reconnect_callback(self, cb) -> None:
        try:
            result = cb()
            if inspect.isawaitable(result) and not isinstance(result, defer.Deferred):
                result = defer.ensureDeferred(result)
        except Exception:
            log.failure("pgbus on-reconnect callback {cb!r} failed", cb=cb)
            return
        if isinstance(result, defer.Deferred):
            result.addErrback(lambda f: log.failure(
                "pgbus on-reconnect callback {cb!r} failed", f, cb=cb))

    def _lost(self, generation: int, reason: Any) -> None:
        """The LISTEN connection of ``generation`` is dead (or presumed so): start over."""
        if generation != self._generation or not self._connected:
            return
        log.warn("pgbus: LISTEN connection lost ({reason}); reconnecting", reason=reason)
        self._drop_connection()
        if self.running:
            self._start_connecting(self._reconnect_base)

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._connected = False
        self._listening = set()
        self._generation += 1
        self.listener_pid = None
        if conn is not None:
            _close_quietly(conn)

    def checkNow(self) -> None:
        """Probe the LISTEN connection at once (used when the pool reports a dead connection)."""
        if self.running:
            self._health_check()

    def _health_check(self):
        # txpostgres does not always notice a dead idle socket (a half-open TCP connection never
        # becomes readable), so a cheap round trip on the LISTEN connection is the backstop.
        if not self._connected or self._health_running:
            return None
        conn, generation = self._conn, self._generation
        self._health_running = True
        d = wait_at_most(self._reactor, conn.runQuery("SELECT 1"), self._health_timeout,
                         "the LISTEN connection's health probe")

        def failed(f):
            self._lost(generation, f.value)

        def finished(_):
            self._health_running = False

        d.addCallbacks(lambda _: None, failed)
        d.addBoth(finished)
        return None  # never make the LoopingCall wait on (or die of) the probe

    def _sleep(self, seconds: float) -> defer.Deferred:
        d = defer.Deferred(lambda _: call.cancel() if call.active() else None)
        call = self._reactor.callLater(seconds, d.callback, None)
        self._reconnect_wait = d
        return d

    # -- publish ------------------------------------------------------------------------------

    def publish(self, subject: str, payload: Any) -> defer.Deferred:
        """Broadcast ``payload`` (any JSON value) on ``subject``; fires when PostgreSQL took it.

        Inline when the encoded envelope is under 8000 bytes, otherwise spilled to
        ``bus_messages`` and announced by id in the same statement.  At-most-once: firing
        means the NOTIFY was committed, not that anyone received it.
        """
        try:
            plan = _Plan(subject, payload)
        except BusError:
            return defer.fail()
        if plan.inline:
            d = self._db.runOperation("SELECT pg_notify(%s, %s)", (plan.channel, plan.envelope))
        else:
            row_id = str(uuid.uuid4())
            pointer = _envelope(subject, "i", json.dumps(row_id))
            # One statement, one transaction: the NOTIFY is delivered at commit, when the row
            # is already visible to the resolver that will fetch it.
            d = self._db.runOperation(
                "WITH spilled AS ("
                " INSERT INTO bus_messages (id, subject, payload) VALUES (%s, %s, %s)"
                " RETURNING id)"
                " SELECT pg_notify(%s, %s) FROM spilled",
                (row_id, subject, psycopg2.Binary(plan.data.encode("ascii")),
                 plan.channel, pointer),
            )

        def failed(f):
            if f.check(DatabaseUnavailable):
                self.checkNow()
            return f

        def taken(result):
            self.published += 1
            self.spilled += 0 if plan.inline else 1
            return result

        return d.addCallbacks(taken, failed)

    # -- subscribe ------------------------------------------------------------------------------

    def subscribe(self, pattern: str, handler: Callable[[str, Any], Any]) -> defer.Deferred:
        """Subscribe ``handler(subject, payload)`` to ``pattern``.

        Fires with a ``Subscription`` once the channel's LISTEN has been acknowledged by
        PostgreSQL (waiting for a connection if the bus is reconnecting, up to 30 s).  Only
        messages sent after that are guaranteed to be seen; earlier ones may or may not be.
        """
        try:
            channel = channel_for(pattern, pattern=True)
        except BusError:
            return defer.fail()
        if not self.running:
            return defer.fail(BusStopped("the bus is not running; start the service first"))
        sub = Subscription(self, pattern, channel, handler, self._subscriber_limit)
        # Registered before LISTEN so a reconnect in between LISTENs for it too.
        self._subs.setdefault(channel, set()).add(sub)
        # Not addTimeout: cancelling would interrupt a LISTEN mid-flight on the connection.  A
        # late LISTEN for a subscription that timed out is harmless: it finds no subscriber.
        d = wait_at_most(self._reactor, defer.ensureDeferred(self._ensure_listening(channel)),
                         self._subscribe_timeout, f"LISTEN on {channel}")

        def failed(f):
            self._forget(sub)
            if f.check(defer.TimeoutError):
                raise SubscribeTimeout(
                    f"LISTEN {channel} for {pattern!r} was not acknowledged within "
                    f"{self._subscribe_timeout:g}s (the bus could not reach PostgreSQL)")
            return f

        d.addCallbacks(lambda _: sub, failed)
        return d

    async def _ensure_listening(self, channel: str) -> None:
        while True:
            if not self._connected:
                await self.whenConnected()
            await self._cmd_lock.acquire()
            try:
                if not self._subs.get(channel):
                    return  # everyone left before we got here
                if channel in self._listening:
                    return
                if not self._connected:
                    continue
                conn, generation = self._conn, self._generation
                try:
                    await conn.runOperation(f'LISTEN "{channel}"')
                except psycopg2.Error as e:
                    # The reconnect will LISTEN for this channel (it has subscribers).
                    self._lost(generation, e)
                    continue
                if generation == self._generation:
                    self._listening.add(channel)
                return
            finally:
                self._cmd_lock.release()

    def unsubscribe(self, sub: Subscription) -> defer.Deferred:
        """Stop delivering to ``sub``; UNLISTEN its channel if it was the last subscriber."""
        if not sub.active:
            return defer.succeed(None)
        self._forget(sub)
        return defer.ensureDeferred(self._maybe_unlisten(sub.channel))

    def _forget(self, sub: Subscription) -> None:
        sub.active = False
        sub._queue.clear()
        subs = self._subs.get(sub.channel)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.channel]

    async def _maybe_unlisten(self, channel: str) -> None:
        await self._cmd_lock.acquire()
        try:
            if self._subs.get(channel) or channel not in self._listening or not self._connected:
                return
            conn, generation = self._conn, self._generation
            try:
                await conn.runOperation(f'UNLISTEN "{channel}"')
            except psycopg2.Error as e:
                self._lost(generation, e)  # the reconnect will not LISTEN it: no subscribers
                return
            self._listening.discard(channel)
        finally:
            self._cmd_lock.release()

    # -- inbound: listener -> resolver -> subscribers ------------------------------------------

    def _on_notify(self, notify) -> None:
        # Runs inside txpostgres' read handler: append and return, nothing else.
        if len(self._inbound) >= self._inbound_limit:
            self.dropped["inbound"] += 1
            return
        self._inbound.append((notify.channel, notify.payload))
        if not self._resolving and self._resolve_call is None:
            self._resolve_call = self._reactor.callLater(0, self._start_resolver)

    def _start_resolver(self) -> None:
        self._resolve_call = None
        if self._resolving:
            return
        self._resolving = True
        d = defer.ensureDeferred(self._resolve())
        d.addErrback(lambda f: log.failure("pgbus resolver crashed", f))

    async def _resolve(self) -> None:
        """The single resolver: preserves arrival order across inline and spilled messages."""
        try:
            while self._inbound and self.running:
                batch = list(self._inbound)
                self._inbound.clear()
                entries = []
                spilled: list[str] = []
                for channel, text in batch:
                    entry = self._decode(channel, text)
                    if entry is None:
                        continue
                    entries.append(entry)
                    if entry[2] is not None:
                        spilled.append(entry[2])
                rows: dict[str, bytes] = {}
                if spilled:
                    rows = await self._fetch_spilled(spilled)
                for channel, subject, spill_id, payload in entries:
                    if spill_id is not None:
                        raw = rows.get(spill_id)
                        if raw is None:
                            self.dropped["resolve"] += 1
                            continue
                        try:
                            payload = json.loads(bytes(raw).decode("utf-8"))
                        except ValueError:
                            self.dropped["decode"] += 1
                            continue
                    self._dispatch(channel, subject, payload)
        finally:
            self._resolving = False

    def _decode(self, channel: str, text: str):
        try:
            env = json.loads(text)
            subject = env["s"]
            if channel_for(subject) != channel:
                raise ValueError("subject root does not match the channel")
            if "i" in env:
                return (channel, subject, str(uuid.UUID(env["i"])), None)
            return (channel, subject, None, env["d"])
        except (ValueError, KeyError, TypeError, BusError):
            self.dropped["decode"] += 1
            log.warn("pgbus: dropped a malformed notification on {channel}", channel=channel)
            return None

    async def _fetch_spilled(self, ids: list[str]) -> dict[str, bytes]:
        d = wait_at_most(self._reactor, self._db.runQuery(
            "SELECT id::text, payload FROM bus_messages WHERE id = ANY(%s::uuid[])", (ids,)),
            self._fetch_timeout, "fetching spilled messages")
        try:
            return {row_id: payload for row_id, payload in await d}
        except (DatabaseUnavailable, PoolClosed, psycopg2.Error, defer.TimeoutError,
                defer.CancelledError) as e:
            log.warn("pgbus: could not fetch {n} spilled messages; dropping them: {err}",
                     n=len(ids), err=e)
            if isinstance(e, DatabaseUnavailable):
                self.checkNow()
            return {}

    def _dispatch(self, channel: str, subject: str, payload: Any) -> None:
        for sub in tuple(self._subs.get(channel, ())):
            if subject_matches(sub.pattern, subject):
                sub._offer(subject, payload)

    # -- spill retention ------------------------------------------------------------------------

    def purgeSpill(self) -> defer.Deferred:
        """Delete spill rows older than the retention (DB clock).  Idempotent; every replica runs
        it.  Errors are logged, never raised (the purge loop must keep running)."""
        d = self._db.runOperation(
            "DELETE FROM bus_messages WHERE created_at < now() - make_interval(secs => %s)",
            (self._retention,))
        d.addErrback(lambda f: log.warn("pgbus: spill purge failed: {err}", err=f.value))
        return d


def _close_quietly(conn: txpostgres.Connection) -> None:
    try:
        conn.close()
    except Exception:
        pass
