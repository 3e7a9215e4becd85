"""/api/cluster/connect against real PostgreSQL, real Autobahn and real yamux on loopback."""

from __future__ import annotations

import pytest_twisted
import treq
from twisted.internet import defer, reactor

from localai_tw.cluster.nodes import NodeRegistry
from localai_tw.db.pool import Database
from localai_tw.mux.errors import SessionFailed
from localai_tw.mux.session import Session
from localai_tw.tunnel.websocket import HandshakeFailed, connectWebSocket
from tests.integration.support import eventually, within
from tests.integration.harness_tunnel import TOKEN, EchoBackend, scripted

UPGRADE = {"Upgrade": "websocket", "Connection": "Upgrade",
           "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13"}


async def http_status(frontend, query: str, headers: dict) -> tuple[int, bytes]:
    url = f"http://{frontend.address}/api/cluster/connect{query}"
    response = await within(treq.get(url, headers={**UPGRADE, **headers}))
    return response.code, await treq.content(response)


async def dial_status(frontend, node_id: str, credential: str) -> int | None:
    try:
        session = await within(connectWebSocket(
            reactor, f"{frontend.connect_url}?id={node_id}", lambda: Session(client=True),
            headers={"Authorization": f"Bearer {credential}"}))
    except HandshakeFailed as e:
        return e.status
    session.loseConnection()
    return 101


@pytest_twisted.ensureDeferred
async def test_authorization_order_before_any_upgrade(db, frontends, workers):
    frontend = await frontends("replica-a")
    worker = await workers(frontend.nodes, "w-auth", scripted(("echo",)))
    # 1. no bearer: 401 first, even with no id at all (an anonymous probe never sees 400)
    assert (await http_status(frontend, "", {}))[0] == 401
    assert (await http_status(frontend, f"?id={worker.node_id}", {}))[0] == 401
    assert (await http_status(frontend, "", {"Authorization": "Bearer "}))[0] == 401
    # 3. a bearer but no id: 400
    assert (await http_status(frontend, "", {"Authorization": "Bearer x"}))[0] == 400
    # 4. unknown node and wrong credential: the same 401
    assert await dial_status(frontend, "no-such-node", worker.credential) == 401
    assert await dial_status(frontend, worker.node_id, "wrong-" + worker.credential) == 401
    assert frontend.registry.held_nodes() == []
    # the right credential upgrades
    assert await dial_status(frontend, worker.node_id, worker.credential) == 101


@pytest_twisted.ensureDeferred
async def test_pending_node_gets_403(db, frontends, workers):
    approving = NodeRegistry(db, registration_token=TOKEN, require_approval=True)
    frontend = await frontends("replica-a", nodes=approving)
    worker = await workers(approving, "w-pending", scripted(("echo",)))
    assert await dial_status(frontend, worker.node_id, worker.credential) == 403
    await approving.approve(worker.node_id)
    assert await dial_status(frontend, worker.node_id, worker.credential) == 101


@pytest_twisted.ensureDeferred
async def test_database_down_is_503_not_401(db, pg_dsn, frontends, workers):
    """A dial the frontend cannot look up because its database is away is a 503 saying so
    (issue 15 §4: it was a 500 logged as "node lookup failed (CancelledError)"); never a 401,
    which would send the worker to re-register."""
    broken = Database(pg_dsn, size=1)
    await broken.start()
    broken.close()
    frontend = await frontends("replica-a", nodes=NodeRegistry(broken, registration_token=TOKEN))
    worker = await workers(NodeRegistry(db, registration_token=TOKEN), "w-db",
                           scripted(("echo",)))
    assert await dial_status(frontend, worker.node_id, worker.credential) == 503


async def owner_row(frontend, node_id):
    return await frontend.fence.owner_row(node_id)


@pytest_twisted.ensureDeferred
async def test_attach_claims_an_epoch_visible_in_node_connections(db, frontends, workers):
    frontend = await frontends("replica-a")
    worker = await workers(frontend.nodes, "w-1", scripted(("echo",)))
    await worker.attach_to(frontend)
    held = frontend.registry.held(worker.node_id)
    row = await owner_row(frontend, worker.node_id)
    assert row.owner_id == "replica-a" and row.epoch == held.claim_epoch
    assert row.disconnected_at is None
    owner = await frontend.fence.owner(worker.node_id)
    assert (owner.owner_id, owner.epoch) == ("replica-a", held.claim_epoch)


@pytest_twisted.ensureDeferred
async def test_second_session_replaces_the_first_and_its_late_detach_changes_nothing(
        db, frontends, workers):
    frontend = await frontends("replica-a")
    worker = await workers(frontend.nodes, "w-1", scripted(("echo",)))
    first = await worker.attach_to(frontend)
    first_token = frontend.registry.held(worker.node_id).token
    second = await worker.attach_to(frontend)
    second_entry = frontend.registry.held(worker.node_id)
    assert second_entry.session is not None and second_entry.token != first_token
    # The older session was closed by the frontend after the new claim.
    await within(first.whenClosed())
    row = await owner_row(frontend, worker.node_id)
    assert (row.owner_id, row.epoch, row.disconnected_at) == ("replica-a",
                                                              second_entry.claim_epoch, None)
    # Its detach has run (whenClosed) and a repeated late one still changes nothing.
    assert await frontend.registry.detach(worker.node_id, first_token) is False
    assert frontend.registry.held(worker.node_id) is second_entry
    row = await owner_row(frontend, worker.node_id)
    assert (row.owner_id, row.epoch, row.disconnected_at) == ("replica-a",
                                                              second_entry.claim_epoch, None)
    assert second.isOpen


@pytest_twisted.ensureDeferred
async def test_detach_on_close_records_the_departure(db, frontends, workers):
    frontend = await frontends("replica-a")
    worker = await workers(frontend.nodes, "w-1", scripted(("echo",)))
    session = await worker.attach_to(frontend)
    epoch = frontend.registry.held(worker.node_id).claim_epoch
    session.loseConnection()

    async def departed():
        row = await owner_row(frontend, worker.node_id)
        return row.owner_id == "" and row.disconnected_at is not None

    await eventually(departed, what="the departure to be recorded")
    assert frontend.registry.held_nodes() == []
    row = await owner_row(frontend, worker.node_id)
    assert row.epoch == epoch  # the release matched this epoch; nothing newer was written


@pytest_twisted.ensureDeferred
async def test_a_stream_opened_by_the_worker_ends_its_tunnel(db, frontends, workers):
    """Workers never open streams by contract: the first SYN is a protocol error (go-away 1),
    not an RST per SYN that a worker could make the frontend pile up."""
    frontend = await frontends("replica-a")
    worker = await workers(frontend.nodes, "w-1", scripted(("echo",)))
    session = await worker.attach_to(frontend)
    ended = defer.Deferred()

    class Probe(EchoBackend):
        def connectionLost(self, reason):
            ended.callback(reason.value)

    session.openStream(Probe(), b"hello")
    reason = await within(ended)
    assert isinstance(reason, SessionFailed) and "protocol error" in str(reason)
    await within(session.whenClosed())
    await eventually(lambda: frontend.registry.held(worker.node_id) is None,
                     what="the tunnel to be detached")


@pytest_twisted.ensureDeferred
async def test_registry_close_releases_and_closes_the_session(db, frontends, workers):
    frontend = await frontends("replica-a")
    worker = await workers(frontend.nodes, "w-1", scripted(("echo",)))
    session = await worker.attach_to(frontend)
    await frontend.registry.close()
    await within(session.whenClosed())
    row = await owner_row(frontend, worker.node_id)
    assert row.owner_id == "" and row.disconnected_at is not None


@pytest_twisted.ensureDeferred
async def test_crlf_in_an_anonymous_id_cannot_forge_log_lines(db, frontends, workers):
    """``?id=`` is chosen by whoever dials, before any credential is trusted: it is logged
    escaped, on one line, bounded (issue 9 §6)."""
    from twisted.logger import formatEvent, globalLogPublisher

    frontend = await frontends("replica-a")
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        forged = "?id=w1%0D%0A2026-12-01T00:00:00+0000 [-] FORGED admin login%1B[31m"
        long_id = "?id=" + "x" * 5000
        for path in ("/api/cluster/connect", "/api/cluster/peer"):
            for query in (forged, long_id):
                url = f"http://{frontend.address}{path}{query}"
                response = await within(treq.get(url, headers={
                    **UPGRADE, "Authorization": "Bearer wrong"}))
                await treq.content(response)
                assert response.code == 401
    finally:
        globalLogPublisher.removeObserver(events.append)
    text = "\n".join(formatEvent(e) or "" for e in events)
    assert "FORGED" in text  # it was logged ...
    for line in text.splitlines():
        assert not line.startswith("2026-12-01T00:00:00") and "\x1b" not in line, line
    assert "\\x0d\\x0a" in text  # ... as visible escapes
    # Our own lines are bounded; the access log line (Twisted's, URL-encoded, within its
    # 16 KiB request-line cap) is not ours to cut.
    ours = [line for line in text.splitlines() if ' HTTP/1.1" ' not in line]
    assert all("x" * 200 not in line for line in ours)


@pytest_twisted.ensureDeferred
async def test_repeated_refused_dials_are_summarised_with_the_true_count(db, frontends, workers):
    """A worker (or prober) dialling again and again with a wrong credential: the log gets a
    few refusal lines per window and a summary with the true count, not a line per dial."""
    from twisted.logger import formatEvent, globalLogPublisher

    frontend = await frontends("replica-a")
    worker = await workers(frontend.nodes, "w-flood", scripted(("echo",)))
    connect = frontend.port.factory.resource.children[b"api"].children[b"cluster"] \
        .children[b"connect"]
    refusals = connect._authorize.__self__.refusals
    refusals.window = 2.0
    events = []

    def told() -> int:
        lines = [e for e in events if "tunnel dial refused (401)" in formatEvent(e)]
        summaries = [e for e in events if "tunnel dials from" in formatEvent(e)]
        assert all(e["source"] == "127.0.0.1" for e in summaries)
        return (sum(e["count"] for e in summaries) + len(lines)
                - refusals.burst * len(summaries))

    globalLogPublisher.addObserver(events.append)
    try:
        for _ in range(300):
            status, _ = await http_status(frontend, f"?id={worker.node_id}",
                                          {"Authorization": "Bearer wrong"})
            assert status == 401
        await eventually(lambda: told() == 300, timeout=10)
    finally:
        globalLogPublisher.removeObserver(events.append)
    ours = [e for e in events if "tunnel dial" in (formatEvent(e) or "")]
    assert len(ours) < 30, [formatEvent(e) for e in ours]


@pytest_twisted.ensureDeferred
async def test_repeated_refused_peer_links_are_summarised(db, frontends):
    """The same bound for ``/api/cluster/peer``: its refusals are errors (a misconfigured
    replica), so one source must not turn them into a line per dial."""
    from twisted.logger import formatEvent, globalLogPublisher

    frontend = await frontends("replica-a")
    refusals = frontend.accepted._authorizer.refusals
    refusals.window = 2.0
    events = []

    def told() -> int:
        lines = [e for e in events if "peer link from replica" in formatEvent(e)]
        summaries = [e for e in events if "peer links from" in formatEvent(e)]
        return (sum(e["count"] for e in summaries) + len(lines)
                - refusals.burst * len(summaries))

    globalLogPublisher.addObserver(events.append)
    try:
        for _ in range(100):
            url = f"http://{frontend.address}/api/cluster/peer?id=replica-x"
            response = await within(treq.get(url, headers={
                **UPGRADE, "Authorization": "Bearer wrong"}))
            await treq.content(response)
            assert response.code == 401
        await eventually(lambda: told() == 100, timeout=10)
    finally:
        globalLogPublisher.removeObserver(events.append)
    ours = [e for e in events if "peer link" in (formatEvent(e) or "")]
    assert len(ours) < 30, [formatEvent(e) for e in ours]


@pytest_twisted.ensureDeferred
async def test_tunnel_lines_name_the_node_by_its_name(db, frontends, workers):
    """An operator reads names, not uuids: every line about a tunnel's life carries both."""
    from twisted.logger import formatEvent, globalLogPublisher

    frontend = await frontends("replica-a")
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        worker = await workers(frontend.nodes, "w-named", scripted(("echo",)))
        await worker.attach_to(frontend)
        assert frontend.registry.disconnect(worker.node_id)
        await eventually(lambda: any("departure recorded" in formatEvent(e) for e in events))
    finally:
        globalLogPublisher.removeObserver(events.append)
    lines = [formatEvent(e) for e in events if "tunnel node=" in formatEvent(e)]
    for what in ("session open", "attached", "disconnecting", "session ended",
                 "departure recorded"):
        line = next(line for line in lines if what in line)
        assert f"node={worker.node_id} (w-named)" in line, line


@pytest_twisted.ensureDeferred
async def test_dials_beyond_the_lookups_in_flight_are_deferred_with_503(db, pg_dsn, frontends,
                                                                          workers):
    """Issue 15 §4: after a restart thousands of workers dial at once; their credential
    lookups queued in the pool ahead of every other request.  Beyond ``max_authorizing``
    lookups in flight a dial is answered 503 with Retry-After at once, with no statement; the
    ones admitted still connect.  Remove the check in _authorize: the second dial waits and
    gets 101 instead of 503."""
    slow = Database(pg_dsn, size=1)
    await slow.start()
    try:
        frontend = await frontends("replica-a", nodes=NodeRegistry(slow, registration_token=TOKEN))
        worker = await workers(NodeRegistry(db, registration_token=TOKEN), "w-storm",
                               scripted(("echo",)))
        connect = frontend.port.factory.resource.children[b"api"].children[b"cluster"] \
            .children[b"connect"]
        authorizer = connect._authorize.__self__
        authorizer.max_authorizing = 1
        busy = slow.runQuery("SELECT pg_sleep(1.5)")  # the pool's one connection is taken
        first = defer.ensureDeferred(dial_status(frontend, worker.node_id, worker.credential))
        await eventually(lambda: authorizer.authorizing == 1)
        url = f"http://{frontend.address}/api/cluster/connect?id={worker.node_id}"
        response = await within(treq.get(url, headers={
            **UPGRADE, "Authorization": f"Bearer {worker.credential}"}))
        await treq.content(response)
        assert response.code == 503
        assert response.headers.getRawHeaders(b"retry-after") == [b"2"]
        await busy
        assert await first == 101
        assert authorizer.authorizing == 0
    finally:
        slow.close()
