"""The worker registry against a real PostgreSQL."""

import threading
import time

import pytest
import pytest_twisted
from twisted.internet import defer

from localai_tw.cluster import nodes as nodes_module
from localai_tw.cluster.membership import hash_secret
from localai_tw.cluster.nodes import (
    InvalidNodeInput,
    NodeCapacity,
    NodeNotFound,
    NodeRegistry,
    NodeStatus,
    NodeType,
    NotPending,
    RegistrationTokenRequired,
    Unauthorized,
    token_record_matches,
)
from localai_tw.cluster.ownership import OwnershipFence

TOKEN = "deployment-registration-token"


async def _add_model(db, node_id, model="llama", replica=0):
    await db.runOperation(
        "INSERT INTO node_models (node_id, model_name, replica_index, state)"
        " VALUES (%s, %s, %s, 'loaded')", (node_id, model, replica))


async def _model_count(db, node_id):
    return (await db.runQuery("SELECT count(*) FROM node_models WHERE node_id = %s",
                              (node_id,)))[0][0]


@pytest_twisted.ensureDeferred
async def test_register_stores_only_hashes_and_returns_credential_once(db):
    reg = NodeRegistry(db, registration_token=TOKEN)
    out = await reg.register("gpu-1", presented_token=TOKEN,
                             capacity=NodeCapacity(total_vram=24 << 30, available_vram=20 << 30),
                             gpu_vendor="nvidia", labels={"zone": "a"})
    assert out.created and out.node.status is NodeStatus.HEALTHY and out.node.approved
    assert len(out.tunnel_credential) >= 22  # >= 128 bits
    assert out.tunnel_credential not in repr(out)
    row = (await db.runQuery("SELECT * FROM backend_nodes WHERE id = %s", (out.node.id,)))[0]
    text = " ".join(str(v) for v in row)
    assert out.tunnel_credential not in text and TOKEN not in text
    record, tunnel_hash = (await db.runQuery(
        "SELECT token_hash, tunnel_token_hash FROM backend_nodes"))[0]
    assert tunnel_hash == hash_secret(out.tunnel_credential)
    # The registration token is kept as a salted, slow record: not the bare sha256 (one guess
    # tested against every row), and another row presenting the same token gets another record.
    assert record != hash_secret(TOKEN) and record.startswith("scrypt$")
    assert token_record_matches(TOKEN, record) and not token_record_matches("guess", record)
    other = await reg.register("gpu-2", presented_token=TOKEN)
    [(other_record,)] = await db.runQuery("SELECT token_hash FROM backend_nodes WHERE id = %s",
                                          (other.node.id,))
    assert other_record != record and token_record_matches(TOKEN, other_record)
    assert out.node.labels == {"zone": "a"}
    assert out.node.total_vram == 24 << 30 and out.node.gpu_vendor == "nvidia"


@pytest_twisted.ensureDeferred
async def test_a_registration_storm_hashes_tokens_in_at_most_two_threads(db, monkeypatch):
    """Each thread that ran an scrypt keeps its 16 MiB resident (glibc's arena): a storm of
    registrations must not spread them over the reactor's pool of ten threads."""
    threads_seen: set[str] = set()
    real = nodes_module.token_record

    def record(token, salt=None):
        threads_seen.add(threading.current_thread().name)
        time.sleep(0.01)  # hold the thread, so that waiting registrations would need others
        return real(token, salt)

    monkeypatch.setattr(nodes_module, "token_record", record)
    reg = NodeRegistry(db, registration_token=TOKEN)
    done = await defer.gatherResults([
        defer.ensureDeferred(reg.register(f"storm-{i}", presented_token=TOKEN))
        for i in range(12)])
    assert len(done) == 12 and all(r.created for r in done)
    assert 1 <= len(threads_seen) <= nodes_module.SCRYPT_THREADS
    assert all("localai-scrypt" in name for name in threads_seen), threads_seen


@pytest_twisted.ensureDeferred
async def test_reregistration_rotates_credential_keeps_id_and_deletes_models(db):
    reg = NodeRegistry(db, registration_token=TOKEN)
    first = await reg.register("gpu-1", presented_token=TOKEN, labels={"zone": "a"})
    await reg.set_labels(first.node.id, {"admin": "pinned"})
    await _add_model(db, first.node.id)
    assert (await reg.verify_tunnel_credential(first.node.id, first.tunnel_credential)).id == \
        first.node.id

    second = await reg.register("gpu-1", presented_token=TOKEN, labels={"zone": "b"})
    assert not second.created
    assert second.node.id == first.node.id
    assert second.tunnel_credential != first.tunnel_credential
    assert await _model_count(db, first.node.id) == 0
    assert second.node.labels == {"zone": "b", "admin": "pinned"}
    with pytest.raises(Unauthorized):
        await reg.verify_tunnel_credential(first.node.id, first.tunnel_credential)
    assert (await reg.verify_tunnel_credential(second.node.id, second.tunnel_credential)).name \
        == "gpu-1"

    other = await reg.register("gpu-2", presented_token=TOKEN)
    assert other.created and other.node.id != first.node.id


@pytest_twisted.ensureDeferred
async def test_verify_refuses_wrong_empty_unknown_and_unset(db):
    reg = NodeRegistry(db, registration_token=TOKEN)
    out = await reg.register("gpu-1", presented_token=TOKEN)
    for node_id, presented in [(out.node.id, "wrong"), (out.node.id, ""), (out.node.id, None),
                               ("no-such-node", out.tunnel_credential)]:
        with pytest.raises(Unauthorized) as info:
            await reg.verify_tunnel_credential(node_id, presented)
        assert out.tunnel_credential not in str(info.value)
    # A node whose stored hash is empty never verifies, not even with an empty credential.
    await db.runOperation("UPDATE backend_nodes SET tunnel_token_hash = ''")
    for presented in ("", out.tunnel_credential):
        with pytest.raises(Unauthorized):
            await reg.verify_tunnel_credential(out.node.id, presented)


@pytest_twisted.ensureDeferred
async def test_registration_token_policy(db):
    reg = NodeRegistry(db, registration_token=TOKEN)
    for presented in ("", None, "wrong", TOKEN + "x", TOKEN[:-1]):
        with pytest.raises(Unauthorized):
            await reg.register("gpu-1", presented_token=presented)
    assert await db.runQuery("SELECT count(*) FROM backend_nodes") == [(0,)]

    open_reg = NodeRegistry(db)  # empty token, require_auth off: open registration
    assert (await open_reg.register("gpu-1")).created
    with pytest.raises(RegistrationTokenRequired):
        NodeRegistry(db, require_auth=True)
    NodeRegistry(db, registration_token=TOKEN, require_auth=True)  # fine with a token


@pytest_twisted.ensureDeferred
async def test_pending_approve_flow_and_approval_survives(db):
    reg = NodeRegistry(db, require_approval=True)
    out = await reg.register("gpu-1")
    assert out.node.status is NodeStatus.PENDING and not out.node.approved
    # A pending node still gets a credential; the connect route refuses it until approval.
    assert (await reg.verify_tunnel_credential(out.node.id, out.tunnel_credential)).status \
        is NodeStatus.PENDING
    assert not await reg.mark_healthy(out.node.id)  # health never approves
    assert not await reg.drain(out.node.id)
    assert (await reg.get_node(out.node.id)).status is NodeStatus.PENDING
    again = await reg.register("gpu-1")
    assert again.node.status is NodeStatus.PENDING  # re-registering does not approve either

    await reg.approve(out.node.id)
    assert (await reg.get_node(out.node.id)).status is NodeStatus.HEALTHY
    with pytest.raises(NotPending):
        await reg.approve(out.node.id)
    with pytest.raises(NodeNotFound):
        await reg.approve("nope")

    await reg.mark_offline(out.node.id)
    back = await reg.register("gpu-1")
    assert back.node.status is NodeStatus.HEALTHY and back.node.approved


@pytest_twisted.ensureDeferred
async def test_heartbeat_uses_db_clock_and_skips_capacity_when_pending_or_offline(db):
    reg = NodeRegistry(db, require_approval=True)
    node = (await reg.register("gpu-1", capacity=NodeCapacity(available_vram=100))).node
    await db.runOperation("UPDATE backend_nodes SET last_heartbeat = now() - interval '1 day'")
    assert await reg.heartbeat(node.id, NodeCapacity(available_vram=5)) is NodeStatus.PENDING
    got = await reg.get_node(node.id)
    assert got.available_vram == 100  # pending: heartbeat only
    (fresh,) = (await db.runQuery(
        "SELECT now() - last_heartbeat < interval '5 s' FROM backend_nodes"))[0]
    assert fresh

    await reg.approve(node.id)
    await reg.heartbeat(node.id, NodeCapacity(available_vram=7, available_ram=9))
    got = await reg.get_node(node.id)
    assert (got.available_vram, got.available_ram) == (7, 9)
    await reg.heartbeat(node.id)  # no capacity: unchanged
    assert (await reg.get_node(node.id)).available_vram == 7

    await reg.mark_offline(node.id)
    await reg.heartbeat(node.id, NodeCapacity(available_vram=1))
    assert (await reg.get_node(node.id)).available_vram == 7
    with pytest.raises(NodeNotFound):
        await reg.heartbeat("nope")


@pytest_twisted.ensureDeferred
async def test_status_transitions_and_which_ones_delete_models(db):
    reg = NodeRegistry(db)
    node_id = (await reg.register("gpu-1")).node.id
    await _add_model(db, node_id)

    assert await reg.mark_unhealthy(node_id)
    assert (await reg.get_node(node_id)).status is NodeStatus.UNHEALTHY
    assert await _model_count(db, node_id) == 1  # status only
    assert await reg.mark_healthy(node_id)
    assert await reg.drain(node_id)
    assert (await reg.get_node(node_id)).status is NodeStatus.DRAINING
    assert await _model_count(db, node_id) == 1  # drain keeps rows for the drain wait
    assert not await reg.mark_unhealthy(node_id)  # draining is left alone
    assert await reg.mark_healthy(node_id)  # resume

    assert await reg.mark_offline(node_id)
    assert await _model_count(db, node_id) == 0
    assert not await reg.mark_offline(node_id)
    assert (await reg.get_node(node_id)).status is NodeStatus.OFFLINE
    for op in (reg.mark_offline, reg.mark_unhealthy, reg.mark_healthy, reg.drain):
        with pytest.raises(NodeNotFound):
            await op("nope")


@pytest_twisted.ensureDeferred
async def test_labels_round_trip(db):
    reg = NodeRegistry(db)
    node_id = (await reg.register("gpu-1", labels={"a": "1"})).node.id
    assert await reg.set_labels(node_id, {"b": "2", "node.replica-slots": "4"}) == \
        {"a": "1", "b": "2", "node.replica-slots": "4"}
    assert await reg.set_labels(node_id, {"c": "3", "a": "x"}, replace=True) == \
        {"a": "x", "c": "3"}
    assert await reg.delete_label(node_id, "c")
    assert not await reg.delete_label(node_id, "c")
    assert await reg.get_labels(node_id) == {"a": "x"}
    with pytest.raises(NodeNotFound):
        await reg.set_labels("nope", {"a": "1"})
    listed = await reg.list_nodes()
    assert [(n.name, n.labels) for n in listed] == [("gpu-1", {"a": "x"})]


@pytest_twisted.ensureDeferred
async def test_list_get_and_delete(db):
    reg = NodeRegistry(db)
    a = (await reg.register("a-node", labels={"k": "v"})).node
    b = (await reg.register("b-agent", node_type="agent")).node
    await reg.mark_unhealthy(a.id)
    assert [n.name for n in await reg.list_nodes()] == ["a-node", "b-agent"]
    assert [n.name for n in await reg.list_nodes(node_type=NodeType.AGENT)] == ["b-agent"]
    assert [n.name for n in await reg.list_nodes(status="unhealthy")] == ["a-node"]
    assert (await reg.get_node_by_name("b-agent")).node_type is NodeType.AGENT

    await OwnershipFence(db).claim(a.id, "some-replica")
    await _add_model(db, a.id)
    await reg.delete_node(a.id)
    with pytest.raises(NodeNotFound):
        await reg.get_node(a.id)
    for table in ("node_labels", "node_models", "node_connections"):
        assert await db.runQuery(f"SELECT count(*) FROM {table} WHERE node_id = %s",
                                 (a.id,)) == [(0,)]
    with pytest.raises(NodeNotFound):
        await reg.delete_node(a.id)
    assert [n.id for n in await reg.list_nodes()] == [b.id]


@pytest.mark.parametrize("kwargs, field", [
    ({"name": ""}, "name"),
    ({"name": "x" * 254}, "name"),
    ({"name": "bad name"}, "name"),
    ({"name": "-lead"}, "name"),
    ({"name": "n'; DROP TABLE backend_nodes; --"}, "name"),
    ({"node_type": "gpu"}, "node_type"),
    ({"labels": {"": "v"}}, "labels"),
    ({"labels": {"k" * 129: "v"}}, "labels."),
    ({"labels": {"bad key": "v"}}, "labels.bad key"),
    ({"labels": {"k": "v" * 256}}, "labels.k"),
    ({"labels": {"k": "line\nbreak"}}, "labels.k"),
    ({"labels": {"k": 3}}, "labels.k"),
    ({"capacity": NodeCapacity(total_vram=-1)}, "total_vram"),
    ({"capacity": NodeCapacity(available_ram=2**63)}, "available_ram"),
    ({"capacity": NodeCapacity(total_disk=1.5)}, "total_disk"),
    ({"max_replicas_per_model": 0}, "max_replicas_per_model"),
    ({"gpu_vendor": "v" * 65}, "gpu_vendor"),
])
@pytest_twisted.ensureDeferred
async def test_bad_inputs_are_rejected_naming_the_field(db, kwargs, field):
    reg = NodeRegistry(db)
    args = {"name": "ok-node", **kwargs}
    name = args.pop("name")
    with pytest.raises(InvalidNodeInput) as info:
        await reg.register(name, **args)
    assert info.value.field.startswith(field)
    assert str(info.value).startswith(info.value.field)
    assert await db.runQuery("SELECT count(*) FROM backend_nodes") == [(0,)]
