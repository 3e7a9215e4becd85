"""Peer links between two frontend replicas sharing one real database: credentials, pooling, the
owner-side relay, and a 20 MiB upload through the relay."""

from __future__ import annotations

import os

import pytest_twisted
from twisted.internet import defer, reactor

from localai_tw import errors
from localai_tw.cluster.membership import InstanceIdentity
from localai_tw.mux.session import Session
from localai_tw.tunnel import preamble
from localai_tw.tunnel.endpoint import upload_file
from localai_tw.tunnel.peer import PEER_MAX_WINDOW, PeerPool
from localai_tw.tunnel.websocket import HandshakeFailed, connectWebSocket
from tests.integration.harness_tunnel import TOKEN, Collect, MiB, scripted, sha256_hex
from tests.integration.support import eventually, failure_of, within


async def raw_peer_dial(target, headers, peer_id):
    try:
        session = await within(connectWebSocket(
            reactor, f"ws://{target.address}/api/cluster/peer?id={peer_id}",
            lambda: Session(client=True), headers=headers))
    except HandshakeFailed as e:
        return e.status
    session.loseConnection()
    return 101


@pytest_twisted.ensureDeferred
async def test_peer_link_needs_both_credentials(db, frontends):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    secret = {"X-LocalAI-Peer-Token": b.identity.peer_secret}
    assert await raw_peer_dial(a, {}, "replica-b") == 401
    assert await raw_peer_dial(a, bearer, "replica-b") == 401  # the shared token alone
    assert await raw_peer_dial(a, secret, "replica-b") == 401  # the secret alone
    assert await raw_peer_dial(a, {**bearer, "X-LocalAI-Peer-Token": "wrong"}, "replica-b") == 401
    assert await raw_peer_dial(a, {"Authorization": "Bearer wrong", **secret}, "replica-b") == 401
    assert await raw_peer_dial(a, {**bearer, **secret}, "no-such-replica") == 401
    assert await raw_peer_dial(a, {**bearer, **secret}, "replica-b") == 101


@pytest_twisted.ensureDeferred
async def test_a_pool_presenting_only_the_shared_token_is_rejected(db, frontends, workers):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    await worker.attach_to(a)
    # B's pool with an empty secret sends only the shared token.
    blank = InstanceIdentity("replica-b", "test", b.address, peer_secret="")
    b.pool = PeerPool(db, blank, TOKEN, reactor)
    b.dialer._pool = b.pool
    error = await failure_of(b.dialer.open(worker.node_id, "http", "", Collect(1)))
    assert isinstance(error, errors.PeerRejected)
    assert not isinstance(error, (errors.WorkerAnswer, errors.RoutingFact))
    b.pool.close()


@pytest_twisted.ensureDeferred
async def test_wrong_secret_or_wrong_shared_token_is_rejected(db, frontends, workers):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    worker = await workers(a.nodes, "w-1", scripted(("echo",)))
    await worker.attach_to(a)
    impostor = InstanceIdentity("replica-b", "test", b.address, peer_secret="not-the-secret")
    for pool in (PeerPool(db, impostor, TOKEN, reactor),
                 PeerPool(db, b.identity, "other-token", reactor)):
        error = await failure_of(pool.open_stream("replica-a", Collect(1)))
        assert isinstance(error, errors.PeerRejected)
        pool.close()


@pytest_twisted.ensureDeferred
async def test_concurrent_opens_share_one_dial_and_a_dead_link_is_redialled(db, frontends):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    opened = await within(defer.gatherResults([
        b.pool.open_stream("replica-a", Collect(1)) for _ in range(5)]))
    assert len(opened) == 5
    assert len(a.accepted.sessions()) == 1  # one link for all five
    link = b.pool._sessions["replica-a"]
    # The cached link received go-away: the next open closes it and dials once more.
    a.accepted.sessions()["replica-b"].goAway()
    await eventually(lambda: link.remoteGoAway, what="go-away to arrive")
    await within(b.pool.open_stream("replica-a", Collect(1)))
    assert b.pool._sessions["replica-a"] is not link
    await eventually(lambda: not link.isOpen, what="old link closed")


@pytest_twisted.ensureDeferred
async def test_peer_links_advertise_the_bigger_window_on_both_ends(db, frontends):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    await within(b.pool.open_stream("replica-a", Collect(1)))
    dialled = b.pool._sessions["replica-a"]
    accepted = a.accepted.sessions()["replica-b"]
    assert dialled.config.max_window == accepted.config.max_window == PEER_MAX_WINDOW
    assert not dialled.config.accept_streams and accepted.config.accept_streams


class RawRelay(Collect):
    def connectionMade(self):
        pass


@pytest_twisted.ensureDeferred
async def test_owner_answers_malformed_or_late_relay_frames_with_bad_request(db, frontends):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    probe = RawRelay(2)
    stream = await within(b.pool.open_stream("replica-a", probe))
    stream.write(preamble.encode_frame(b"only-two fields"))
    payload, _ = preamble.split_frame(await within(probe.done))
    reply = preamble.parse_relay_reply(payload) if payload is not None else None
    if reply is None:  # the whole frame may come in more pieces
        await eventually(lambda: preamble.split_frame(probe.data)[0] is not None)
        reply = preamble.parse_relay_reply(preamble.split_frame(probe.data)[0])
    assert reply.code == preamble.RELAY_BAD_REQUEST


@pytest_twisted.ensureDeferred
async def test_20_mib_upload_through_the_relay_arrives_intact(
        db, frontends, workers, real_worker, tmp_path):
    a = await frontends("replica-a")
    b = await frontends("replica-b")
    worker = await workers(a.nodes, "w-1", real_worker.router)
    await worker.attach_to(a)
    payload = os.urandom(20 * MiB)
    source = tmp_path / "weights.bin"
    source.write_bytes(payload)
    assert (await b.fence.owner(worker.node_id)).owner_id == "replica-a"
    staged = await within(upload_file(b.http, worker.node_id, "models/m/weights.bin",
                                      str(source), token=TOKEN), 120)
    assert staged.sha256 == sha256_hex(payload) and not staged.skipped
    landed = os.path.join(real_worker.roots.models_dir, "m", "weights.bin")
    with open(landed, "rb") as f:
        assert sha256_hex(f.read()) == sha256_hex(payload)
    assert (await b.fence.owner(worker.node_id)).owner_id == "replica-a"
    assert not b.registry.holds(worker.node_id)
    # A second upload of the same bytes is skipped by the worker (HEAD through the relay).
    again = await within(upload_file(b.http, worker.node_id, "models/m/weights.bin",
                                     str(source), token=TOKEN), 60)
    assert again.skipped
