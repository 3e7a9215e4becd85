"""WorkerDialer: one test per row of the four-conditions table, including the negative ones.

Real PostgreSQL, real sockets, real Autobahn and yamux.  Each test states the condition it pins
and, where it matters, the conditions the outcome must NOT be confused with.
"""

from __future__ import annotations

import pytest_twisted
from twisted.internet import protocol, reactor

from localai_tw import errors
from localai_tw.cluster.membership import InstanceIdentity, register_instance
from localai_tw.db.pool import Database
from localai_tw.cluster.ownership import OwnershipFence
from localai_tw.tunnel import preamble
from localai_tw.tunnel.route import WorkerDialer, deadline_after
from tests.integration.harness_tunnel import Collect, only_condition, scripted
from tests.integration.support import eventually, failure_of, within


# -- local route -------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_local_grpc_stream_reaches_the_backend_through_the_real_worker(
        db, frontends, workers, real_worker):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", real_worker.router)
    await worker.attach_to(a)
    caller = Collect(5)
    got = await within(a.dialer.open(worker.node_id, "grpc",
                                     f"10.9.9.9:{real_worker.backend_port}", caller))
    assert got is caller
    caller.transport.write(b"hello")
    assert await within(caller.done) == b"hello"


@pytest_twisted.ensureDeferred
async def test_worker_evidence_refusal_is_its_answer_never_no_route(
        db, frontends, workers, real_worker):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", real_worker.router)
    await worker.attach_to(a)
    # The port right above the backend is in range but nothing listens: "unavailable".
    error = await failure_of(a.dialer.open(worker.node_id, "grpc",
                                           f"127.0.0.1:{real_worker.backend_port + 1}",
                                           Collect(1)))
    only_condition(error, errors.StreamRefused)
    assert error.code == "unavailable"
    # Out of range: "bad-request"; unknown tag: "unknown-tag".  Both evidence, both answers.
    error = await failure_of(a.dialer.open(worker.node_id, "grpc", "127.0.0.1:1", Collect(1)))
    only_condition(error, errors.StreamRefused)
    assert error.code == "bad-request"
    error = await failure_of(a.dialer.open(worker.node_id, "ftp", "x", Collect(1)))
    only_condition(error, errors.StreamRefused)
    assert error.code == "unknown-tag"


@pytest_twisted.ensureDeferred
async def test_not_served_is_routing_not_evidence(db, frontends, workers):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", scripted(("refuse", "not-served", "EMFILE")))
    await worker.attach_to(a)
    error = await failure_of(a.dialer.open(worker.node_id, "grpc", "127.0.0.1:1", Collect(1)))
    only_condition(error, errors.WorkerUnroutable)


@pytest_twisted.ensureDeferred
async def test_unknown_refusal_code_is_a_protocol_error(db, frontends, workers):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", scripted(("raw", b"err from-the-future text")))
    await worker.attach_to(a)
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.TunnelProtocolError)


@pytest_twisted.ensureDeferred
async def test_stream_broken_before_the_reply_is_a_transport_failure(db, frontends, workers):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", scripted(("drop",)))
    await worker.attach_to(a)
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.TransportFailure)


@pytest_twisted.ensureDeferred
async def test_caller_deadline_is_the_callers_never_the_workers(db, frontends, workers):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", scripted(("silent",)))
    await worker.attach_to(a)
    started = reactor.seconds()
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1),
                                           deadline=deadline_after(reactor, 0.3)))
    only_condition(error, errors.CallerDeadlineExceeded)
    assert reactor.seconds() - started < 5  # the deadline, not the 15 s backstop
    # An already expired deadline fails before any I/O.
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1),
                                           deadline=reactor.seconds() - 1))
    only_condition(error, errors.CallerDeadlineExceeded)


# -- classification when nobody live holds the node ------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_no_row_at_all_says_no_route(db, frontends, workers):
    """The negative control: tunnel dials blocked from the start (the worker never connects)."""
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-never", scripted(("echo",)))
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.WorkerUnroutable)
    assert "no route" in str(error)
    assert not isinstance(error, errors.WorkerGone)


@pytest_twisted.ensureDeferred
async def test_recent_departure_is_absent_within_grace(db, frontends, workers):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    session = await worker.attach_to(a)
    session.loseConnection()
    await eventually(lambda: not a.registry.holds(worker.node_id), what="detach")

    async def departed():
        return (await a.fence.owner_row(worker.node_id)).owner_id == ""

    await eventually(departed, what="departure")
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.AbsentWithinGrace)
    assert error.presence == "reconnecting"


@pytest_twisted.ensureDeferred
async def test_departure_older_than_the_grace_is_gone(db, frontends, workers):
    a = await frontends("replica-a", grace=60)
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    await db.runOperation(
        "INSERT INTO node_connections (node_id, owner_instance_id, epoch, connected_at,"
        " disconnected_at) VALUES (%s, '', nextval('node_connection_epochs'),"
        " now() - interval '1 hour', now() - interval '10 minutes')", (worker.node_id,))
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.WorkerGone)


@pytest_twisted.ensureDeferred
async def test_owner_replica_dead_but_not_swept_is_absent_within_grace(db, frontends, workers):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    await register_instance(db, InstanceIdentity("replica-dead", "test", "127.0.0.1:9"))
    await db.runOperation("UPDATE instances SET last_seen = now() - interval '5 minutes'"
                          " WHERE id = 'replica-dead'")
    await OwnershipFence(db).claim(worker.node_id, "replica-dead")
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.AbsentWithinGrace)


@pytest_twisted.ensureDeferred
async def test_database_failure_while_resolving_the_owner_is_absent_within_grace(
        db, pg_dsn, frontends, workers):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    broken = Database(pg_dsn, size=1)
    await broken.start()
    broken.close()
    dialer = WorkerDialer(a.registry, OwnershipFence(broken), a.pool, "replica-a",
                          reactor=reactor)
    error = await failure_of(dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.AbsentWithinGrace)
    assert error.presence == "unknown" and error.cause is not None


@pytest_twisted.ensureDeferred
async def test_owner_is_self_but_not_held_is_unroutable_never_relayed_to_self(
        db, frontends, workers):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    await a.fence.claim(worker.node_id, "replica-a")  # a stale claim of ours, no session
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.WorkerUnroutable)
    assert "never relayed to self" in str(error)
    assert a.pool.cached_peers() == []


# -- the relay ------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_worker_on_a_reached_through_b_by_relay(db, frontends, workers, real_worker):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    worker = await workers(a.nodes, "w-1", real_worker.router)
    await worker.attach_to(a)
    before = await b.fence.owner(worker.node_id)
    assert before.owner_id == "replica-a" and not b.registry.holds(worker.node_id)
    caller = Collect(11)
    await within(b.dialer.open(worker.node_id, "grpc", f"x:{real_worker.backend_port}", caller))
    caller.transport.write(b"hello relay")
    assert await within(caller.done) == b"hello relay"
    after = await b.fence.owner(worker.node_id)
    assert after == before  # the route went through A; B never claimed
    assert b.pool.cached_peers() == ["replica-a"] and not b.registry.holds(worker.node_id)
    assert list(a.accepted.sessions()) == ["replica-b"]


@pytest_twisted.ensureDeferred
async def test_worker_refusal_through_the_relay_is_still_its_answer(
        db, frontends, workers, real_worker):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    worker = await workers(a.nodes, "w-1", real_worker.router)
    await worker.attach_to(a)
    error = await failure_of(b.dialer.open(worker.node_id, "grpc",
                                           f"127.0.0.1:{real_worker.backend_port + 1}",
                                           Collect(1)))
    only_condition(error, errors.StreamRefused)


@pytest_twisted.ensureDeferred
async def test_relay_not_owner_is_unroutable(db, frontends, workers):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    # The database names B, but B holds no session: B answers relay-not-owner.
    await a.fence.claim(worker.node_id, "replica-b")
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.WorkerUnroutable)
    assert preamble.RELAY_NOT_OWNER in str(error)


@pytest_twisted.ensureDeferred
async def test_a_peer_failure_is_never_a_workers_answer(db, frontends, workers):
    a = await frontends("replica-a")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    # A live replica row whose advertised address nobody listens on.
    listening = reactor.listenTCP(0, protocol.Factory(), interface="127.0.0.1")
    dead_port = listening.getHost().port
    await listening.stopListening()
    await register_instance(db, InstanceIdentity("replica-x", "test", f"127.0.0.1:{dead_port}"))
    await a.fence.claim(worker.node_id, "replica-x")
    error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.PeerUnreachable)
    assert not isinstance(error, errors.PeerRejected)


@pytest_twisted.ensureDeferred
async def test_pool_closed_surfaces_as_itself(db, frontends, workers):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    await worker.attach_to(a)
    b.pool.close()
    error = await failure_of(b.dialer.open(worker.node_id, "http", "", Collect(1)))
    only_condition(error, errors.PoolClosed)


@pytest_twisted.ensureDeferred
async def test_repeated_relay_refusals_are_summarised_per_peer(db, frontends, workers):
    """A replica relaying stream after stream that is refused (here: the database names B as
    owner, but B holds no tunnel) makes a few lines on B and a summary with the true count."""
    from twisted.logger import formatEvent, globalLogPublisher

    a = await frontends("replica-a")
    b = await frontends("replica-b")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    await a.fence.claim(worker.node_id, "replica-b")
    refusals = b.accepted._relay_refusals
    refusals.window = 2.0
    events = []

    def told() -> int:
        lines = [e for e in events if "relay from replica" in formatEvent(e)]
        summaries = [e for e in events if "relayed streams from replica" in formatEvent(e)]
        return (sum(e["count"] for e in summaries) + len(lines)
                - refusals.burst * len(summaries))

    globalLogPublisher.addObserver(events.append)
    try:
        for _ in range(60):
            error = await failure_of(a.dialer.open(worker.node_id, "http", "", Collect(1)))
            assert preamble.RELAY_NOT_OWNER in str(error)
        await eventually(lambda: told() == 60, timeout=10)
    finally:
        globalLogPublisher.removeObserver(events.append)
    ours = [e for e in events if "relay" in (formatEvent(e) or "") and "replica-a" in
            formatEvent(e)]
    assert len(ours) < 20, [formatEvent(e) for e in ours]
