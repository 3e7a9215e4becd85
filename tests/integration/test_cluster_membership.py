"""Replica membership against a real PostgreSQL: register, heartbeat, sweep, deregister,
and liveness/presence decided by the database clock whatever the process clock says."""

import datetime as dt
import time

import pytest
import pytest_twisted
from twisted.internet import task

from localai_tw.cluster import membership, ownership
from localai_tw.cluster.clock import LIVE_INSTANCE_IDS_SQL, departure_retention
from localai_tw.cluster.membership import (
    InstanceIdentity,
    InstanceNotFound,
    MembershipService,
    deregister_instance,
    heartbeat_instance,
    live_instances,
    peer_token_hash,
    register_instance,
    secret_matches_hash,
    sweep_instances,
)
from localai_tw.cluster.ownership import NoConnection, OwnershipFence, Presence

from .support import eventually


async def _age(db, instance_id, interval="1 hour"):
    await db.runOperation(
        "UPDATE instances SET last_seen = now() - %s::interval WHERE id = %s",
        (interval, instance_id))


async def _instance_ids(db):
    return sorted(r[0] for r in await db.runQuery("SELECT id FROM instances"))


# -- register / heartbeat -------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_register_publishes_hash_only_and_never_wipes_address(db):
    ident = InstanceIdentity("r1", "1.0", "10.1.2.3:8080")
    await register_instance(db, ident)
    rows = await db.runQuery(
        "SELECT version, advertised_addr, peer_token_hash FROM instances WHERE id = 'r1'")
    version, addr, stored = rows[0]
    assert (version, addr) == ("1.0", "10.1.2.3:8080")
    assert ident.peer_secret not in repr(ident)
    assert stored != ident.peer_secret and len(stored) == 64
    assert secret_matches_hash(ident.peer_secret, stored)
    # A later registration with empty address and secret changes the version only.
    await register_instance(db, InstanceIdentity("r1", "1.1", "", peer_secret=""))
    assert await db.runQuery(
        "SELECT version, advertised_addr, peer_token_hash FROM instances WHERE id = 'r1'"
    ) == [("1.1", "10.1.2.3:8080", stored)]
    assert await peer_token_hash(db, "r1") == stored
    await _age(db, "r1")
    assert await peer_token_hash(db, "r1") is None  # not live: no peer credential offered


@pytest_twisted.ensureDeferred
async def test_heartbeat_writes_db_now_and_reports_a_missing_row(db):
    await register_instance(db, InstanceIdentity("r1", "1"))
    await _age(db, "r1")
    assert [i.id for i in await live_instances(db)] == []
    await heartbeat_instance(db, "r1")
    live = await live_instances(db)
    assert [i.id for i in live] == ["r1"]
    (fresh,) = (await db.runQuery("SELECT now() - last_seen < interval '5 s' FROM instances"))[0]
    assert fresh
    with pytest.raises(InstanceNotFound):
        await heartbeat_instance(db, "nobody")


def test_secret_matching_refuses_empty_values():
    h = membership.hash_secret("s3cret")
    assert secret_matches_hash("s3cret", h)
    assert secret_matches_hash("s3cret", h.upper())
    assert not secret_matches_hash("other", h)
    assert not secret_matches_hash("", h)
    assert not secret_matches_hash("", "")
    assert not secret_matches_hash("s3cret", "")
    assert not secret_matches_hash(None, h)
    assert len(membership.mint_peer_secret()) >= 22  # >= 128 bits in url-safe base64


# -- sweep -----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_sweep_reaps_dead_replica_and_records_departures_once(db):
    fence = OwnershipFence(db)
    for rid in ("self", "dead", "alive"):
        await register_instance(db, InstanceIdentity(rid, "1"))
    held_by_dead = await fence.claim("n-dead", "dead")
    await fence.claim("n-alive", "alive")
    await fence.claim("n-self", "self")
    await _age(db, "dead")
    await _age(db, "self")  # even a stale self is never reaped by its own sweep

    # Inside the grace a dead owner reads as reconnecting, never gone.
    assert (await fence.presence("n-dead", 90)).presence is Presence.RECONNECTING
    result = await sweep_instances(db, "self")
    assert result.reaped == ("dead",)
    assert result.departures == 1
    assert await _instance_ids(db) == ["alive", "self"]

    row = await fence.owner_row("n-dead")
    assert row.owner_id == "" and row.disconnected_at is not None and row.epoch == held_by_dead
    assert (await fence.owner_row("n-alive")).owner_id == "alive"
    assert (await fence.owner_row("n-self")).owner_id == "self"

    # The departure is not re-stamped by later sweeps, so it can age past the grace.
    await db.runOperation("UPDATE node_connections SET disconnected_at = now() - interval '2 min'"
                          " WHERE node_id = 'n-dead'")
    before = (await fence.owner_row("n-dead")).disconnected_at
    again = await sweep_instances(db, "self")
    assert again.departures == 0
    assert (await fence.owner_row("n-dead")).disconnected_at == before
    assert (await fence.presence("n-dead", 90)).presence is Presence.GONE


@pytest_twisted.ensureDeferred
async def test_deregister_leaves_and_departs_own_rows_only(db):
    fence = OwnershipFence(db)
    await register_instance(db, InstanceIdentity("a", "1"))
    await register_instance(db, InstanceIdentity("b", "1"))
    e = await fence.claim("n1", "a")
    await fence.release("n1", "a", e)
    await db.runOperation("UPDATE node_connections SET disconnected_at = now() - interval '1 h'")
    await fence.claim("n2", "a")
    await fence.claim("n3", "b")
    await deregister_instance(db, "a")
    assert await _instance_ids(db) == ["b"]
    assert (await fence.owner_row("n2")).owner_id == ""
    assert (await fence.owner_row("n3")).owner_id == "b"
    # The already-departed row kept its old departure time (held filter).
    (old,) = (await db.runQuery("SELECT disconnected_at < now() - interval '30 min'"
                                " FROM node_connections WHERE node_id = 'n1'"))[0]
    assert old


# -- the service -----------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_service_registers_ticks_and_deregisters(db):
    clock = task.Clock()
    svc = MembershipService(db, InstanceIdentity("svc", "1", "10.0.0.9:8080"), reactor=clock)
    svc.startService()
    assert await svc.whenRegistered() == "svc"
    assert [(i.id, i.advertised_addr) for i in await svc.live_instances()] == [
        ("svc", "10.0.0.9:8080")]
    await register_instance(db, InstanceIdentity("dead", "1"))
    await _age(db, "dead")
    clock.advance(5)  # one tick: heartbeat + sweep + purge

    async def dead_reaped():
        return await _instance_ids(db) == ["svc"]
    await eventually(dead_reaped, timeout=5)
    await svc.stopService()
    assert await _instance_ids(db) == []


@pytest_twisted.ensureDeferred
async def test_heartbeat_finding_no_row_registers_again_and_calls_back(db):
    called = []
    ident = InstanceIdentity("svc", "1", "10.0.0.9:8080")
    svc = MembershipService(db, ident, reactor=task.Clock(),
                            on_reregistered=lambda: called.append(True))
    svc.startService()
    await svc.whenRegistered()
    await db.runOperation("DELETE FROM instances")  # swept while we stalled
    await svc.tick()
    assert called == [True]
    assert await db.runQuery("SELECT advertised_addr, peer_token_hash FROM instances") == [
        ("10.0.0.9:8080", ident.peer_token_hash)]
    await svc.tick()
    assert called == [True]  # a normal heartbeat does not call back
    await svc.stopService()


@pytest_twisted.ensureDeferred
async def test_tick_purges_departures_older_than_retention(db):
    svc = MembershipService(db, InstanceIdentity("svc", "1"), reactor=task.Clock(),
                            reconnect_grace=100)
    assert svc.retention == departure_retention(100) == 500
    svc.startService()
    await svc.whenRegistered()
    fence = OwnershipFence(db)
    for node in ("old", "young"):
        await fence.release(node, "svc", await fence.claim(node, "svc"))
    await db.runOperation("UPDATE node_connections SET disconnected_at = now() - interval '501 s'"
                          " WHERE node_id = 'old'")
    await db.runOperation("UPDATE node_connections SET disconnected_at = now() - interval '499 s'"
                          " WHERE node_id = 'young'")
    await svc.tick()
    assert [r[0] for r in await db.runQuery("SELECT node_id FROM node_connections")] == ["young"]
    await svc.stopService()


def test_retention_never_below_ten_livenesses_and_grace_defaults():
    assert departure_retention(10) == 300
    assert departure_retention(0) == departure_retention(90) == 450
    assert departure_retention(-1) == 450


@pytest_twisted.ensureDeferred
async def test_failed_registration_fails_when_registered(pg_dsn):
    from localai_tw.db.pool import Database
    database = Database(pg_dsn, size=1)
    await database.start()  # not migrated: no instances table
    try:
        svc = MembershipService(database, InstanceIdentity("x", "1"), reactor=task.Clock())
        svc.startService()
        with pytest.raises(Exception):
            await svc.whenRegistered()
        await svc.stopService()  # nothing to leave; must not raise
    finally:
        database.close()


# -- the clock rule ----------------------------------------------------------------------------


class _SkewedDatetime(dt.datetime):
    offset = dt.timedelta(0)

    @classmethod
    def now(cls, tz=None):
        return dt.datetime.now(tz) + cls.offset

    @classmethod
    def utcnow(cls):
        return dt.datetime.utcnow() + cls.offset


@pytest.mark.parametrize("skew_days", [-3, 3])
@pytest_twisted.ensureDeferred
async def test_outcomes_do_not_depend_on_the_process_clock(db, monkeypatch, skew_days):
    """Set up fixed situations relative to the DB clock, then read them with the process clock
    (time, datetime, and the service's reactor clock) days away.  Nothing changes."""
    fence = OwnershipFence(db)
    await register_instance(db, InstanceIdentity("live", "1"))
    await register_instance(db, InstanceIdentity("dead", "1"))
    await _age(db, "dead", "40 seconds")
    await fence.claim("n-live", "live")
    await fence.claim("n-dead-owner", "dead")
    await fence.release("n-recent", "live", await fence.claim("n-recent", "live"))
    await fence.release("n-old", "live", await fence.claim("n-old", "live"))
    await db.runOperation("UPDATE node_connections SET disconnected_at = now() - interval '100 s'"
                          " WHERE node_id = 'n-old'")

    async def observe():
        owners = {}
        for node in ("n-live", "n-dead-owner", "n-recent", "n-old", "n-none"):
            try:
                owners[node] = (await fence.owner(node)).owner_id
            except NoConnection:
                owners[node] = None
        presence = {node: (await fence.presence(node, 90)).presence for node in owners}
        live = [i.id for i in await live_instances(db)]
        live_sql = sorted(r[0] for r in await db.runQuery(LIVE_INSTANCE_IDS_SQL, (30,)))
        return owners, presence, live, live_sql

    before = await observe()
    assert before[1] == {"n-live": Presence.CONNECTED, "n-dead-owner": Presence.RECONNECTING,
                         "n-recent": Presence.RECONNECTING, "n-old": Presence.GONE,
                         "n-none": Presence.UNKNOWN}
    assert before[2] == before[3] == ["live"]

    skew = skew_days * 86400.0
    real_time, real_monotonic = time.time, time.monotonic
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + skew)
    monkeypatch.setattr(_SkewedDatetime, "offset", dt.timedelta(days=skew_days))
    for module in (membership, ownership):
        monkeypatch.setattr(module, "datetime", _SkewedDatetime)
    assert await observe() == before

    # The service, driven by a reactor clock days away, reaps exactly what the DB says is dead.
    clock = task.Clock()
    clock.advance(max(skew, 0) + 1e6)
    svc = MembershipService(db, InstanceIdentity("live", "1"), reactor=clock)
    svc.startService()
    await svc.whenRegistered()
    await svc.tick()
    assert await _instance_ids(db) == ["live"]
    assert (await fence.owner_row("n-dead-owner")).owner_id == ""
    await svc.stopService()
