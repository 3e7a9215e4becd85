"""PgBus against a real PostgreSQL: two buses on two separate pools, as two replicas would be."""

from __future__ import annotations

import random

import psycopg2
import pytest
import pytest_twisted
from twisted.internet import defer

from localai_tw.bus import pgbus
from localai_tw.bus.pgbus import (
    InvalidSubject,
    PayloadTooLarge,
    PgBus,
    UnservedSubject,
    encode_envelope,
    encode_payload,
    fits_inline,
)
from localai_tw.db.pool import Database

from .support import eventually, within


@pytest_twisted.async_yield_fixture
async def pair(db, pg_dsn):
    """(publisher bus, subscriber bus, publisher db): separate pools, separate LISTEN
    connections, one migrated database."""
    other = Database(pg_dsn, size=2)
    await other.start()
    pub = PgBus(db, health_interval=0.5)
    sub = PgBus(other, health_interval=0.5)
    pub.startService()
    sub.startService()
    await pub.whenConnected()
    await sub.whenConnected()
    try:
        yield pub, sub, db
    finally:
        await pub.stopService()
        await sub.stopService()
        other.close()


class Inbox:
    def __init__(self):
        self.items: list[tuple[str, object]] = []

    def __call__(self, subject, payload):
        self.items.append((subject, payload))


async def spill_rows(db) -> int:
    return (await db.runQuery("SELECT count(*) FROM bus_messages"))[0][0]


def payload_for_envelope_size(subject: str, size: int) -> str:
    """An ASCII string payload whose encoded envelope is exactly ``size`` bytes."""
    overhead = len(encode_envelope(subject, "").encode())
    payload = "x" * (size - overhead)
    assert len(encode_envelope(subject, payload).encode()) == size
    return payload


@pytest_twisted.ensureDeferred
async def test_envelope_of_7999_bytes_goes_inline_and_8000_spills(pair):
    pub, sub, db = pair
    inbox = Inbox()
    await sub.subscribe("jobs.*.result", inbox)
    subject = "jobs.j1.result"

    at_7999 = payload_for_envelope_size(subject, 7999)
    await pub.publish(subject, at_7999)
    await eventually(lambda: len(inbox.items) == 1, timeout=5, what="the 7999-byte envelope")
    assert inbox.items[0] == (subject, at_7999)
    assert await spill_rows(db) == 0, "a 7999-byte envelope must be notified inline"

    at_8000 = payload_for_envelope_size(subject, 8000)
    await pub.publish(subject, at_8000)
    await eventually(lambda: len(inbox.items) == 2, timeout=5, what="the 8000-byte envelope")
    assert inbox.items[1] == (subject, at_8000)
    assert await spill_rows(db) == 1, "an 8000-byte envelope must spill to bus_messages"
    # fits_inline answers with the same encoder and comparison
    assert fits_inline(subject, at_7999)
    assert not fits_inline(subject, at_8000)


@pytest_twisted.ensureDeferred
async def test_9000_byte_payload_arrives_byte_identical_through_the_spill_row(pair):
    pub, sub, db = pair
    inbox = Inbox()
    await sub.subscribe("gallery.op7.progress", inbox)
    rnd = random.Random(9000)
    # Quotes, backslashes, control characters and non-ASCII all need escaping in JSON.
    alphabet = 'ab"\\\n\t\x00\x7f é€😀/<>&'
    payload = "".join(rnd.choice(alphabet) for _ in range(3000))
    while len(payload.encode("utf-8")) < 9000:
        payload += "z"
    payload = payload.encode("utf-8")[:9000].decode("utf-8", "ignore")
    payload += "z" * (9000 - len(payload.encode("utf-8")))
    assert len(payload.encode("utf-8")) == 9000

    await pub.publish("gallery.op7.progress", payload)
    await eventually(lambda: inbox.items, timeout=5, what="the spilled message")
    ((subject, got),) = inbox.items
    assert subject == "gallery.op7.progress"
    assert got.encode("utf-8") == payload.encode("utf-8")
    ((stored,),) = await db.runQuery("SELECT payload FROM bus_messages")
    assert bytes(stored) == encode_payload(payload).encode("ascii")


@pytest_twisted.ensureDeferred
async def test_order_is_kept_between_inline_and_spilled_messages(pair):
    pub, sub, db = pair
    inbox = Inbox()
    await sub.subscribe("jobs.ordered.progress", inbox)
    sent = []
    for i in range(40):
        # Runs of inline and spilled messages, so an inline one always trails a spill fetch.
        big = (i // 3) % 2 == 1
        payload = {"n": i, "pad": "p" * (9000 if big else 10)}
        sent.append(payload)
        await pub.publish("jobs.ordered.progress", payload)
    await eventually(lambda: len(inbox.items) == len(sent), timeout=5, what="all 40 messages")
    assert [p["n"] for _, p in inbox.items] == list(range(40))
    assert [p for _, p in inbox.items] == sent
    assert await spill_rows(db) > 0


@pytest_twisted.ensureDeferred
async def test_wildcards_match_exactly_one_token(pair):
    pub, sub, _ = pair
    star, exact, other_root = Inbox(), Inbox(), Inbox()
    await sub.subscribe("jobs.*.progress", star)
    await sub.subscribe("jobs.a.progress", exact)
    await sub.subscribe("gallery.*", other_root)
    for subject in ("jobs.a.progress", "jobs.b.progress", "jobs.a.result",
                    "jobs.a.b.progress", "gallery.x", "gallery.x.y", "jobs.progress"):
        await pub.publish(subject, subject)
    await pub.publish("gallery.end", "end")
    await eventually(lambda: ("gallery.end", "end") in other_root.items, timeout=5,
                     what="the end marker")
    assert [s for s, _ in star.items] == ["jobs.a.progress", "jobs.b.progress"]
    assert [s for s, _ in exact.items] == ["jobs.a.progress"]
    assert [s for s, _ in other_root.items] == ["gallery.x", "gallery.end"]


@pytest_twisted.ensureDeferred
async def test_unknown_roots_and_full_wildcards_are_refused(pair):
    pub, sub, _ = pair
    with pytest.raises(UnservedSubject, match="no channel serves"):
        await pub.publish("metrics.cpu", 1)
    with pytest.raises(UnservedSubject):
        await sub.subscribe("metrics.*", Inbox())
    with pytest.raises(UnservedSubject):
        await sub.subscribe("*.progress", Inbox())  # a wildcard root would need every channel
    with pytest.raises(InvalidSubject, match="'>'"):
        await sub.subscribe("jobs.>", Inbox())
    with pytest.raises(InvalidSubject):
        await pub.publish("jobs.*.progress", 1)  # publish needs a concrete subject
    with pytest.raises(InvalidSubject):
        await pub.publish("jobs..x", 1)
    assert sub._subs == {}


@pytest_twisted.ensureDeferred
async def test_broadcast_over_8_mib_is_refused(pair):
    pub, _, db = pair
    with pytest.raises(PayloadTooLarge, match="8 MiB"):
        await pub.publish("jobs.big.result", "x" * (8 * 1024 * 1024))
    assert await spill_rows(db) == 0


@pytest_twisted.ensureDeferred
async def test_full_subscriber_queue_drops_and_counts_without_hurting_others(pair):
    pub, sub, _ = pair
    gate = defer.Deferred()
    stuck_seen = []

    def stuck(subject, payload):
        stuck_seen.append(payload)
        return gate  # the first message never finishes until the gate opens

    fast = Inbox()
    slow_sub = await sub.subscribe("cache.invalidate.*", stuck)
    await sub.subscribe("cache.invalidate.*", fast)
    total = pgbus.SUBSCRIBER_QUEUE_LIMIT + 44
    await defer.gatherResults([pub.publish("cache.invalidate.models", i) for i in range(total)])
    await eventually(lambda: len(fast.items) == total, timeout=5, what="the fast subscriber")
    # one message in the handler, 256 queued, the rest dropped and counted
    assert len(stuck_seen) == 1
    assert slow_sub.dropped == total - 1 - pgbus.SUBSCRIBER_QUEUE_LIMIT == 43
    assert sub.dropped["subscriber"] == 43
    gate.callback(None)
    await eventually(lambda: len(stuck_seen) == 1 + pgbus.SUBSCRIBER_QUEUE_LIMIT,
                     timeout=5, what="the queued messages")
    # concurrent publishes on a pool commit in any order; all of them reach the fast one
    assert sorted(p for _, p in fast.items) == list(range(total))


@pytest_twisted.ensureDeferred
async def test_full_inbound_queue_drops_and_counts(db):
    bus = PgBus(db, inbound_limit=3)
    bus.startService()
    try:
        await bus.whenConnected()
        inbox = Inbox()
        await bus.subscribe("state.x", inbox)
        # Deliver a burst faster than the resolver can take it: notifications committed in one
        # transaction arrive in one read.
        await db.runOperation(
            "SELECT pg_notify('localai_state', '{\"s\":\"state.x\",\"d\":' || g || '}')"
            " FROM generate_series(1, 10) g")
        await eventually(lambda: len(inbox.items) + bus.dropped["inbound"] == 10,
                         timeout=5, what="the burst")
        assert bus.dropped["inbound"] == 7
        assert [p for _, p in inbox.items] == [1, 2, 3]
    finally:
        await bus.stopService()


async def listening_channels(bus: PgBus) -> list[str]:
    rows = await bus._conn.runQuery("SELECT pg_listening_channels() ORDER BY 1")
    return [r[0] for r in rows]


@pytest_twisted.ensureDeferred
async def test_listen_on_first_subscriber_unlisten_on_last(pair):
    _, sub, _ = pair
    assert await listening_channels(sub) == []
    a = await sub.subscribe("jobs.*.progress", Inbox())
    b = await sub.subscribe("jobs.x.cancel", Inbox())
    c = await sub.subscribe("state.y", Inbox())
    assert await listening_channels(sub) == ["localai_jobs", "localai_state"]
    await a.unsubscribe()
    assert await listening_channels(sub) == ["localai_jobs", "localai_state"]
    await b.unsubscribe()
    assert await listening_channels(sub) == ["localai_state"]
    await sub.unsubscribe(c)
    assert await listening_channels(sub) == []


def terminate_backend_by_application_name(dsn: str, application_name: str) -> int:
    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True
        cur = conn.cursor()
        cur.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                    (application_name,))
        rows = cur.fetchall()
        assert len(rows) == 1, f"expected one LISTEN backend named {application_name}: {rows}"
        cur.execute("SELECT pg_terminate_backend(%s)", (rows[0][0],))
        return rows[0][0]
    finally:
        conn.close()


@pytest.mark.parametrize("noticed_by", ["loss-hook", "probe"])
@pytest_twisted.ensureDeferred
async def test_listen_survives_a_killed_backend_and_runs_on_reconnect_callbacks(
        pair, pg_dsn, noticed_by, monkeypatch):
    pub, _, db = pair
    if noticed_by == "loss-hook":
        # No periodic probe within the test: txpostgres' connectionLost hook must do it.
        sub = PgBus(db, health_interval=60)
    else:
        # The hook silenced, as when the socket never turns readable: the probe must do it.
        monkeypatch.setattr(pgbus._LossDetector, "checkForDeadConnection", lambda self, r: None)
        sub = PgBus(db, health_interval=0.3, health_timeout=1)
    sub.startService()
    try:
        await _killed_backend_scenario(pub, sub, pg_dsn)
    finally:
        await sub.stopService()


async def _killed_backend_scenario(pub, sub, pg_dsn):
    await sub.whenConnected()
    inbox = Inbox()
    await sub.subscribe("responses.*.cancel", inbox)
    await sub.subscribe("agent.a1", Inbox())
    calls = []
    reconnected = defer.Deferred()

    def failing_callback():
        calls.append("failing")
        raise RuntimeError("a broken callback must not stop the others")

    def good_callback():
        calls.append("good")
        reconnected.callback(None)

    sub.onReconnect(failing_callback)
    sub.onReconnect(good_callback)

    await pub.publish("responses.r1.cancel", "before")
    await eventually(lambda: inbox.items, timeout=5, what="delivery before the kill")

    old_pid = terminate_backend_by_application_name(pg_dsn, sub.applicationName)
    await eventually(lambda: not sub.isConnected, timeout=3, what="the loss to be noticed")
    await within(reconnected, 10)
    assert sub.isConnected
    assert sub.reconnects == 1
    assert sorted(calls) == ["failing", "good"]
    assert sub.listener_pid != old_pid
    assert sorted(await listening_channels(sub)) == ["localai_agent", "localai_responses"]

    await pub.publish("responses.r2.cancel", "after")
    await eventually(lambda: ("responses.r2.cancel", "after") in inbox.items,
                     timeout=5, what="delivery after the reconnect")


@pytest_twisted.ensureDeferred
async def test_spill_rows_older_than_the_retention_are_purged_on_the_db_clock(pair):
    pub, _, db = pair
    await pub.publish("jobs.p.result", "y" * 9000)
    await db.runOperation(
        "INSERT INTO bus_messages (id, subject, payload, created_at)"
        " VALUES (gen_random_uuid(), 'jobs.old.result', '\\x00', now() - interval '11 minutes')")
    assert await spill_rows(db) == 2
    await pub.purgeSpill()
    assert await db.runQuery("SELECT subject FROM bus_messages") == [("jobs.p.result",)]
