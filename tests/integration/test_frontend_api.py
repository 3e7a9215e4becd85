"""The registration API and the admin API over real sockets (treq) against a real PostgreSQL."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import pytest
import pytest_twisted
import treq
from twisted.internet import defer, protocol, reactor
from twisted.web.client import HTTPConnectionPool
from twisted.web.resource import Resource

from localai_tw.cluster import nodes as nodes_module
from localai_tw.cluster.membership import InstanceIdentity, register_instance
from localai_tw.cluster.nodes import NodeRegistry
from localai_tw.cluster.ownership import OwnershipFence
from localai_tw.frontend.api.nodes import InstancesResource, NodesAdminResource
from localai_tw.frontend.api.probes import StartingGate
from localai_tw.frontend.api.kit import APIKeyGuard, ClusterParts
from localai_tw.web.listener import BoundedSite, MAX_BODY_BYTES
from localai_tw.frontend.api.workers import WorkerRegistrationResource

TOKEN = "registration-token-for-tests"
ADMIN = "sk-admin-key"
REPLICA = "replica-a"


@dataclass
class Frontend:
    url: str
    port: int
    db: object
    registry: NodeRegistry
    fence: OwnershipFence
    parts: ClusterParts
    registered: list = field(default_factory=list)
    deleted: list = field(default_factory=list)


def build_root(parts, guard) -> Resource:
    root, api, cluster = Resource(), Resource(), Resource()
    root.putChild(b"api", api)
    api.putChild(b"node", WorkerRegistrationResource(parts))
    api.putChild(b"nodes", NodesAdminResource(parts, guard))
    api.putChild(b"cluster", cluster)
    cluster.putChild(b"instances", InstancesResource(parts, guard))
    return root


@pytest_twisted.async_yield_fixture
async def frontend(db):
    registry = NodeRegistry(db, registration_token=TOKEN)
    fence = OwnershipFence(db)
    parts = ClusterParts(db=db, nodes=registry, fence=fence, instance_id=REPLICA,
                         reconnect_grace=90)
    fe = Frontend("", 0, db, registry, fence, parts)
    parts.on_registered = fe.registered.append
    parts.on_deleted = fe.deleted.append
    port = reactor.listenTCP(0, BoundedSite(build_root(parts, APIKeyGuard([ADMIN, "sk-2"]))),
                             interface="127.0.0.1")
    fe.port = port.getHost().port
    fe.url = f"http://127.0.0.1:{fe.port}"
    try:
        yield fe
    finally:
        await port.stopListening()


@pytest_twisted.async_yield_fixture
async def http():
    pool = HTTPConnectionPool(reactor, persistent=False)
    yield _Http(pool)
    await pool.closeCachedConnections()


class _Http:
    def __init__(self, pool):
        self.pool = pool

    async def call(self, method, url, *, body=None, raw: bytes | None = None, token=None,
                   headers=None) -> tuple[int, dict, object]:
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        kwargs = {}
        if raw is not None:
            kwargs["data"] = raw
            hdrs.setdefault("Content-Type", "application/json")
        elif body is not None:
            kwargs["json"] = body
        response = await treq.request(method, url, headers=hdrs, pool=self.pool,
                                      reactor=reactor, **kwargs).addTimeout(10, reactor)
        content = await treq.content(response)
        decoded = json.loads(content) if content else None
        return response.code, decoded, response


def node_key_of(name: str) -> str:
    """The node key a worker called ``name`` presents (one per name, as a data directory)."""
    return hashlib.sha256(b"key of " + name.encode()).hexdigest()


def registration(name="gpu-1", **extra):
    return {"name": name, "node_key": node_key_of(name), "node_type": "backend",
            "labels": {"zone": "a"},
            "capacity": {"total_vram": 24 << 30, "available_vram": 20 << 30},
            "max_replicas_per_model": 2, **extra}


async def register(http, fe, name="gpu-1", **extra):
    status, body, _ = await http.call("POST", fe.url + "/api/node/register",
                                      body=registration(name, **extra), token=TOKEN)
    assert status == 201, body
    return body


# -- registration -------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_register_returns_the_credential_once_and_stores_only_its_hash(frontend, http):
    body = await register(http, frontend)
    assert set(body) == {"id", "status", "tunnel_token"}
    assert body["status"] == "healthy" and len(body["tunnel_token"]) >= 22
    rows = await frontend.db.runQuery("SELECT * FROM backend_nodes WHERE id = %s", (body["id"],))
    row_text = " ".join(str(v) for v in rows[0])
    assert body["tunnel_token"] not in row_text and TOKEN not in row_text
    stored = (await frontend.db.runQuery(
        "SELECT tunnel_token_hash, total_vram, max_replicas_per_model FROM backend_nodes"))[0]
    assert stored == (hashlib.sha256(body["tunnel_token"].encode()).hexdigest(), 24 << 30, 2)
    node = await frontend.registry.verify_tunnel_credential(body["id"], body["tunnel_token"])
    assert node.labels == {"zone": "a"}
    assert frontend.registered == [body["id"]]


@pytest_twisted.ensureDeferred
async def test_re_registration_rotates_the_credential_and_runs_the_hook(frontend, http):
    first = await register(http, frontend)
    second = await register(http, frontend)
    assert second["id"] == first["id"] and second["tunnel_token"] != first["tunnel_token"]
    await frontend.registry.verify_tunnel_credential(first["id"], second["tunnel_token"])
    with pytest.raises(nodes_module.Unauthorized):
        await frontend.registry.verify_tunnel_credential(first["id"], first["tunnel_token"])
    assert frontend.registered == [first["id"], first["id"]]


@pytest_twisted.ensureDeferred
async def test_a_failing_hook_does_not_fail_the_registration(frontend, http):
    def broken(node_id):
        raise RuntimeError("tunnel registry exploded")

    frontend.parts.on_registered = broken
    body = await register(http, frontend)
    assert body["tunnel_token"]


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong-token"}, {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": "Bearer "},
])
@pytest_twisted.ensureDeferred
async def test_register_without_the_right_token_is_401_before_validation(frontend, http,
                                                                         headers):
    # the body is invalid too: 401 comes first, so the schema is not revealed
    status, body, response = await http.call("POST", frontend.url + "/api/node/register",
                                             body={"name": 7}, headers=headers)
    assert status == 401
    assert body["error"]["type"] == "unauthorized"
    assert "--registration-token" in body["error"]["message"]
    assert "wrong-token" not in json.dumps(body)
    assert response.headers.getRawHeaders("www-authenticate") == ["Bearer"]
    assert await frontend.db.runQuery("SELECT id FROM backend_nodes") == []


@pytest_twisted.ensureDeferred
async def test_the_registration_token_is_compared_in_constant_time(frontend, http,
                                                                   monkeypatch):
    compared = []
    real = nodes_module.hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(nodes_module.hmac, "compare_digest", spy)
    status, _, _ = await http.call("POST", frontend.url + "/api/node/register",
                                   body=registration(), token="x")
    assert status == 401
    # digests of equal length whatever the presented token's length
    assert compared and all(pair == (32, 32) for pair in compared)


BAD_FIELDS = [
    ({"name": None}, "name"),
    ({"name": 42}, "name"),
    ({"name": "has space"}, "name"),
    ({"name": "x" * 300}, "name"),
    ({"node_type": "gpu"}, "node_type"),
    ({"node_type": 1}, "node_type"),
    ({"labels": ["a"]}, "labels"),
    ({"labels": {"bad key!": "v"}}, "labels.bad key!"),
    ({"labels": {"zone": 3}}, "labels.zone"),
    ({"labels": {"zone": "x" * 300}}, "labels.zone"),
    ({"capacity": [1]}, "capacity"),
    ({"capacity": {"gpus": 1}}, "capacity.gpus"),
    ({"capacity": {"total_ram": -1}}, "capacity.total_ram"),
    ({"capacity": {"total_ram": True}}, "capacity.total_ram"),
    ({"capacity": {"total_ram": 1.5}}, "capacity.total_ram"),
    ({"max_replicas_per_model": 0}, "max_replicas_per_model"),
    ({"max_replicas_per_model": "2"}, "max_replicas_per_model"),
    ({"gpu_vendor": "v" * 100}, "gpu_vendor"),
    ({"token": TOKEN}, "token"),
]


@pytest.mark.parametrize("change, named", BAD_FIELDS, ids=[f for _, f in BAD_FIELDS])
@pytest_twisted.ensureDeferred
async def test_register_400_names_the_field(frontend, http, change, named):
    body = registration()
    body.update(change)
    if change.get("name", "") is None:
        del body["name"]
    status, answer, _ = await http.call("POST", frontend.url + "/api/node/register", body=body,
                                        token=TOKEN)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request"
    assert answer["error"]["field"] == named
    assert named.split(".")[0] in answer["error"]["message"]
    assert await frontend.db.runQuery("SELECT id FROM backend_nodes") == []


@pytest.mark.parametrize("raw, says", [
    (b"", "empty"),
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"name": "\xff"}', "UTF-8"),
    (b'{"name": NaN}', "not valid JSON"),
    (b"[" * 5000 + b"]" * 5000, "JSON"),
    (b'{"name": "w\\u0000"}', "NUL"),
    (b'{"name": "gpu-1", "labels": {"zone": "a\\ud800"}}', "lone surrogate"),
])
@pytest_twisted.ensureDeferred
async def test_register_400_for_a_body_that_is_not_a_json_object(frontend, http, raw, says):
    status, answer, _ = await http.call("POST", frontend.url + "/api/node/register", raw=raw,
                                        token=TOKEN)
    assert status == 400 and says in answer["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_register_415_for_another_content_type(frontend, http):
    status, answer, _ = await http.call("POST", frontend.url + "/api/node/register",
                                        raw=b"name=x", token=TOKEN,
                                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415 and answer["error"]["type"] == "unsupported_media_type"


def padded(total: int) -> bytes:
    head = b'{"name": "gpu-1", "pad": "'
    return head + b"x" * (total - len(head) - 2) + b'"}'


@pytest_twisted.ensureDeferred
async def test_body_at_the_cap_is_read_and_one_byte_more_is_413(frontend, http):
    status, answer, _ = await http.call("POST", frontend.url + "/api/node/register",
                                        raw=padded(MAX_BODY_BYTES), token=TOKEN)
    assert (status, answer["error"]["field"]) == (400, "pad")  # read and validated
    status, answer, _ = await http.call("POST", frontend.url + "/api/node/register",
                                        raw=padded(MAX_BODY_BYTES + 1), token=TOKEN)
    assert status == 413 and answer["error"]["type"] == "request_too_large"


class RawExchange(protocol.Protocol):
    def __init__(self, request: bytes, send_after: bytes = b""):
        self.request, self.send_after = request, send_after
        self.received = b""
        self.done = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.received += data

    def connectionLost(self, reason):
        self.done.callback(self.received)


async def raw_exchange(port: int, request: bytes) -> bytes:
    proto = RawExchange(request)
    await protocol.ClientCreator(reactor, lambda: proto).connectTCP("127.0.0.1", port)
    return await proto.done.addTimeout(10, reactor)


@pytest_twisted.ensureDeferred
async def test_an_announced_oversized_body_is_refused_before_it_is_sent(frontend):
    answer = await raw_exchange(frontend.port, (
        b"POST /api/node/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: 10000000\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"100 Continue" not in answer
    assert b"request_too_large" in answer


@pytest_twisted.ensureDeferred
async def test_a_chunked_body_growing_past_the_cap_is_cut_off(frontend):
    chunk = b"x" * 8192
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(20)) + b"0\r\n\r\n"
    answer = await raw_exchange(frontend.port, (
        b"POST /api/node/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + body))
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert answer.count(b"HTTP/1.1") == 1  # nothing else was processed
    assert await frontend.db.runQuery("SELECT id FROM backend_nodes") == []


# -- heartbeat --------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_heartbeat_returns_status_and_updates_capacity(frontend, http):
    node = await register(http, frontend)
    url = f"{frontend.url}/api/node/{node['id']}/heartbeat"
    status, answer, _ = await http.call("POST", url, body={"capacity": {"available_vram": 7}},
                                        token=TOKEN)
    assert (status, answer) == (200, {"status": "healthy"})
    assert (await frontend.db.runQuery("SELECT available_vram FROM backend_nodes"))[0][0] == 7
    status, answer, _ = await http.call("POST", url, raw=b"", token=TOKEN)  # no body at all
    assert (status, answer) == (200, {"status": "healthy"})


@pytest_twisted.ensureDeferred
async def test_heartbeat_of_a_pending_node_says_pending(db, frontend, http):
    frontend.parts.nodes = NodeRegistry(db, registration_token=TOKEN, require_approval=True)
    node = await register(http, frontend)
    status, answer, _ = await http.call("POST", f"{frontend.url}/api/node/{node['id']}/heartbeat",
                                        body={}, token=TOKEN)
    assert (status, answer) == (200, {"status": "pending"})


@pytest.mark.parametrize("node_id", ["0d4f8a8e-0000-4000-8000-000000000000", "x" * 100,
                                     "%E2%98%83"])
@pytest_twisted.ensureDeferred
async def test_heartbeat_of_an_unknown_node_is_404(frontend, http, node_id):
    status, answer, _ = await http.call("POST", f"{frontend.url}/api/node/{node_id}/heartbeat",
                                        body={}, token=TOKEN)
    assert status == 404 and answer["error"]["type"] == "not_found"
    assert "register again" in answer["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_heartbeat_needs_the_token_before_anything(frontend, http):
    node = await register(http, frontend)
    for node_id in (node["id"], "unknown"):
        status, _, _ = await http.call("POST", f"{frontend.url}/api/node/{node_id}/heartbeat",
                                       body={}, token="wrong")
        assert status == 401


@pytest_twisted.ensureDeferred
async def test_heartbeat_400_names_the_field(frontend, http):
    node = await register(http, frontend)
    url = f"{frontend.url}/api/node/{node['id']}/heartbeat"
    for body, named in (({"capacity": {"vram": 1}}, "capacity.vram"),
                        ({"capacity": {"total_ram": -5}}, "capacity.total_ram"),
                        ({"status": "healthy"}, "status")):
        status, answer, _ = await http.call("POST", url, body=body, token=TOKEN)
        assert (status, answer["error"]["field"]) == (400, named)


@pytest_twisted.ensureDeferred
async def test_wrong_method_and_unknown_path(frontend, http):
    status, answer, response = await http.call("GET", frontend.url + "/api/node/register",
                                               token=TOKEN)
    assert status == 405 and response.headers.getRawHeaders("allow") == ["POST"]
    status, answer, _ = await http.call("POST", frontend.url + "/api/node/x/y/z", token=TOKEN)
    assert status == 404 and answer["error"]["type"] == "not_found"


@pytest_twisted.ensureDeferred
async def test_503_while_the_frontend_is_starting(db, http):
    # what the listener serves until the replica is built (frontend/api/probes.py)
    port = reactor.listenTCP(0, BoundedSite(StartingGate({}, {})), interface="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{port.getHost().port}"
        status, answer, response = await http.call("POST", url + "/api/node/register",
                                                   body=registration(), token=TOKEN)
        assert status == 503 and answer["error"]["type"] == "not_ready"
        assert response.headers.getRawHeaders("retry-after") == ["5"]
        status, _, _ = await http.call("GET", url + "/api/nodes", token=ADMIN)
        assert status == 503
    finally:
        await port.stopListening()


# -- admin API --------------------------------------------------------------------------------------

ADMIN_ROUTES = [
    ("GET", "/api/nodes"), ("GET", "/api/nodes/{id}"), ("PUT", "/api/nodes/{id}/labels"),
    ("GET", "/api/nodes/{id}/labels"), ("POST", "/api/nodes/{id}/approve"),
    ("POST", "/api/nodes/{id}/drain"), ("POST", "/api/nodes/{id}/resume"),
    ("DELETE", "/api/nodes/{id}"), ("GET", "/api/cluster/instances"),
]


@pytest.mark.parametrize("method, path", ADMIN_ROUTES)
@pytest_twisted.ensureDeferred
async def test_admin_api_needs_an_api_key(frontend, http, method, path):
    node = await register(http, frontend)
    url = frontend.url + path.format(id=node["id"])
    for token in (None, "sk-wrong", TOKEN):
        status, answer, response = await http.call(method, url, body={"labels": {}},
                                                   token=token)
        assert status == 401, (token, answer)
        assert answer["error"]["type"] == "unauthorized"
        assert response.headers.getRawHeaders("www-authenticate") == ["Bearer"]
    assert (await frontend.registry.get_node(node["id"])).status.value == "healthy"


@pytest_twisted.ensureDeferred
async def test_admin_api_with_no_key_configured_refuses_everything(frontend, http):
    port = reactor.listenTCP(0, BoundedSite(build_root(frontend.parts, APIKeyGuard([]))),
                             interface="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{port.getHost().port}/api/nodes"
        for token in (None, "", "anything"):
            status, answer, _ = await http.call("GET", url, token=token)
            assert status == 401 and "--api-key" in answer["error"]["message"]
    finally:
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_any_configured_key_works(frontend, http):
    for key in (ADMIN, "sk-2"):
        status, _, _ = await http.call("GET", frontend.url + "/api/nodes", token=key)
        assert status == 200


@pytest_twisted.ensureDeferred
async def test_list_and_get_show_status_owner_presence_and_models(frontend, http):
    a = await register(http, frontend, "gpu-a")
    b = await register(http, frontend, "gpu-b")
    await frontend.db.runOperation("INSERT INTO node_models (node_id, model_name, state)"
                                   " VALUES (%s, 'llama', 'loaded')", (a["id"],))
    await register_instance(frontend.db, InstanceIdentity(REPLICA, "test"))
    epoch = await frontend.fence.claim(a["id"], REPLICA)

    status, answer, _ = await http.call("GET", frontend.url + "/api/nodes", token=ADMIN)
    assert status == 200
    by_name = {n["name"]: n for n in answer["nodes"]}
    assert list(by_name) == ["gpu-a", "gpu-b"]
    node_a = by_name["gpu-a"]
    assert node_a["status"] == "healthy" and node_a["node_type"] == "backend"
    assert node_a["labels"] == {"zone": "a"}
    assert node_a["owner"] == {"replica": REPLICA, "epoch": epoch}
    assert node_a["presence"] == "connected"
    assert [m["model_name"] for m in node_a["models"]] == ["llama"]
    assert node_a["capacity"]["total_vram"] == 24 << 30
    assert by_name["gpu-b"]["owner"] is None and by_name["gpu-b"]["presence"] == "unknown"
    text = json.dumps(answer)
    assert "hash" not in text and a["tunnel_token"] not in text

    status, single, _ = await http.call("GET", f"{frontend.url}/api/nodes/{b['id']}",
                                        token=ADMIN)
    assert status == 200 and single["id"] == b["id"] and single["models"] == []

    status, filtered, _ = await http.call("GET", frontend.url + "/api/nodes?status=offline",
                                          token=ADMIN)
    assert (status, filtered) == (200, {"nodes": [], "next": None})
    status, bad, _ = await http.call("GET", frontend.url + "/api/nodes?status=bogus",
                                     token=ADMIN)
    assert (status, bad["error"]["field"]) == (400, "status")


@pytest_twisted.ensureDeferred
async def test_the_node_list_pages_by_name_and_reads_each_node_like_the_single_reads(
        frontend, http):
    """Issue 15 §4: the list made two queries per node (4 s at 4000 nodes); now a page costs a
    fixed number of statements.  Each node's owner, presence and grace left must still say
    exactly what the per-node reads say: connected, reconnecting (departure recorded, grace
    left), reconnecting (held by a replica that is not live), gone, unknown."""
    names = [f"n-{i:02d}" for i in range(7)]
    ids = {name: (await register(http, frontend, name))["id"] for name in names}
    await register_instance(frontend.db, InstanceIdentity(REPLICA, "test"))
    await register_instance(frontend.db, InstanceIdentity("dead-replica", "test"))
    await frontend.db.runOperation(
        "UPDATE instances SET last_seen = now() - interval '1 hour' WHERE id = 'dead-replica'")
    fence = frontend.fence
    epoch = await fence.claim(ids["n-00"], REPLICA)
    await fence.release(ids["n-01"], REPLICA, await fence.claim(ids["n-01"], REPLICA))
    await fence.claim(ids["n-02"], "dead-replica")
    await fence.release(ids["n-03"], REPLICA, await fence.claim(ids["n-03"], REPLICA))
    await frontend.db.runOperation(
        "UPDATE node_connections SET disconnected_at = now() - interval '1 day'"
        " WHERE node_id = %s", (ids["n-03"],))

    seen, after, pages = [], None, 0
    while True:
        url = frontend.url + "/api/nodes?limit=3" + (f"&after={after}" if after else "")
        status, page, _ = await http.call("GET", url, token=ADMIN)
        assert status == 200 and len(page["nodes"]) <= 3
        seen += page["nodes"]
        pages += 1
        after = page["next"]
        if after is None:
            break
    assert pages == 3 and [n["name"] for n in seen] == names
    by_name = {n["name"]: n for n in seen}
    assert by_name["n-00"]["owner"] == {"replica": REPLICA, "epoch": epoch}
    expected = {"n-00": "connected", "n-01": "reconnecting", "n-02": "reconnecting",
                "n-03": "gone", "n-04": "unknown"}
    for name, presence in expected.items():
        node_id = ids[name]
        assert by_name[name]["presence"] == presence
        assert (await fence.presence(node_id, 90.0)).presence.value == presence
    assert 80 < by_name["n-01"]["reconnect_grace_left"] <= 90
    assert by_name["n-02"]["reconnect_grace_left"] is None  # no departure recorded
    assert by_name["n-02"]["owner"] is None  # its holder is not live
    assert by_name["n-04"]["never_connected"] and not by_name["n-01"]["never_connected"]
    for bad in ("0", "1001", "x", "-1"):
        status, answer, _ = await http.call("GET", f"{frontend.url}/api/nodes?limit={bad}",
                                            token=ADMIN)
        assert (status, answer["error"]["field"]) == (400, "limit")


@pytest.mark.parametrize("method, path", [r for r in ADMIN_ROUTES if "{id}" in r[1]])
@pytest_twisted.ensureDeferred
async def test_unknown_node_ids_are_404(frontend, http, method, path):
    for node_id in ("no-such-node", "x" * 80):
        status, answer, _ = await http.call(method, frontend.url + path.format(id=node_id),
                                            body={"labels": {"a": "b"}}, token=ADMIN)
        assert status == 404, answer
        assert answer["error"]["type"] == "not_found" and "unknown node" in answer["error"][
            "message"]


@pytest_twisted.ensureDeferred
async def test_put_labels_replaces_and_validates(frontend, http):
    node = await register(http, frontend)
    url = f"{frontend.url}/api/nodes/{node['id']}/labels"
    status, answer, _ = await http.call("PUT", url, body={"labels": {"gpu": "a100", "rack": "7"}},
                                        token=ADMIN)
    assert (status, answer) == (200, {"id": node["id"], "labels": {"gpu": "a100", "rack": "7"}})
    assert (await frontend.registry.get_labels(node["id"])) == {"gpu": "a100", "rack": "7"}
    for body, named in (({}, "labels"), ({"labels": "x"}, "labels"),
                        ({"labels": {"-bad": "v"}}, "labels.-bad"),
                        ({"labels": {"k": 1}}, "labels.k"),
                        ({"labels": {}, "extra": 1}, "extra"),
                        ({"labels": {f"k{i}": "v" for i in range(65)}}, "labels")):
        status, answer, _ = await http.call("PUT", url, body=body, token=ADMIN)
        assert (status, answer["error"]["field"]) == (400, named), answer
    assert (await frontend.registry.get_labels(node["id"])) == {"gpu": "a100", "rack": "7"}
    status, answer, _ = await http.call("PUT", url, body={"labels": {}}, token=ADMIN)
    assert answer["labels"] == {}
    status, answer, _ = await http.call("GET", url, token=ADMIN)
    assert (status, answer) == (200, {"id": node["id"], "labels": {}})


@pytest_twisted.ensureDeferred
async def test_approve_drain_resume(db, frontend, http):
    frontend.parts.nodes = NodeRegistry(db, registration_token=TOKEN, require_approval=True)
    node = await register(http, frontend)
    assert node["status"] == "pending"
    base = f"{frontend.url}/api/nodes/{node['id']}"
    status, answer, _ = await http.call("POST", base + "/drain", token=ADMIN)
    assert status == 409 and answer["error"]["code"] == "not_approved"
    status, answer, _ = await http.call("POST", base + "/approve", token=ADMIN)
    assert (status, answer) == (200, {"id": node["id"], "status": "healthy"})
    status, answer, _ = await http.call("POST", base + "/approve", token=ADMIN)
    assert status == 409 and answer["error"]["code"] == "not_pending"
    assert "healthy" in answer["error"]["message"]
    status, answer, _ = await http.call("POST", base + "/resume", token=ADMIN)
    assert status == 409 and answer["error"]["code"] == "not_draining"
    status, answer, _ = await http.call("POST", base + "/drain", token=ADMIN)
    assert (status, answer["status"]) == (200, "draining")
    status, answer, _ = await http.call("POST", base + "/drain", token=ADMIN)  # idempotent
    assert (status, answer["status"]) == (200, "draining")
    status, answer, _ = await http.call("POST", base + "/resume", token=ADMIN)
    assert (status, answer["status"]) == (200, "healthy")


@pytest_twisted.ensureDeferred
async def test_delete_removes_the_node_and_runs_the_hook(frontend, http):
    node = await register(http, frontend)
    url = f"{frontend.url}/api/nodes/{node['id']}"
    status, answer, _ = await http.call("DELETE", url, token=ADMIN)
    assert (status, answer) == (200, {"id": node["id"], "deleted": True})
    assert frontend.deleted == [node["id"]]
    assert (await http.call("GET", url, token=ADMIN))[0] == 404
    assert (await http.call("DELETE", url, token=ADMIN))[0] == 404
    # the worker's next heartbeat learns it must register again
    status, _, _ = await http.call("POST", url.replace("/api/nodes/", "/api/node/") +
                                   "/heartbeat", body={}, token=TOKEN)
    assert status == 404


@pytest_twisted.ensureDeferred
async def test_instances_lists_live_replicas_without_credentials(frontend, http):
    await register_instance(frontend.db, InstanceIdentity(REPLICA, "1.0", "10.0.0.1:8080"))
    await register_instance(frontend.db, InstanceIdentity("replica-b", "1.1", "10.0.0.2:8080"))
    await register_instance(frontend.db, InstanceIdentity("replica-dead", "0.9"))
    await frontend.db.runOperation("UPDATE instances SET last_seen = now() - interval '5 min'"
                                   " WHERE id = 'replica-dead'")
    status, answer, _ = await http.call("GET", frontend.url + "/api/cluster/instances",
                                        token=ADMIN)
    assert status == 200
    assert [(i["id"], i["version"], i["advertised_addr"], i["self"])
            for i in answer["instances"]] == [(REPLICA, "1.0", "10.0.0.1:8080", True),
                                              ("replica-b", "1.1", "10.0.0.2:8080", False)]
    assert all(set(i) == {"id", "version", "advertised_addr", "last_seen", "registered_at",
                          "self"} for i in answer["instances"])


@pytest.mark.parametrize("path, good", [("/api/nodes", ADMIN), ("/api/node/register", TOKEN)])
@pytest_twisted.ensureDeferred
async def test_a_repeated_authorization_header_is_refused_even_if_one_copy_is_right(
        frontend, http, path, good):
    """One rule for every endpoint (the tunnel endpoints already refuse it): two
    Authorization headers are ambiguous, whichever copy a proxy would have kept."""
    from twisted.web.http_headers import Headers

    for pair in ([good, "sk-wrong"], ["sk-wrong", good], [good, good]):
        headers = Headers({b"Authorization": [f"Bearer {t}".encode() for t in pair],
                           b"Content-Type": [b"application/json"]})
        response = await treq.request("POST" if "register" in path else "GET",
                                      frontend.url + path, headers=headers,
                                      data=json.dumps(registration()).encode(), pool=http.pool,
                                      reactor=reactor).addTimeout(10, reactor)
        answer = json.loads(await treq.content(response))
        assert response.code == 401, (pair, answer)
    assert await frontend.db.runQuery("SELECT id FROM backend_nodes") == []


@pytest_twisted.ensureDeferred
async def test_nodes_are_found_by_name_as_x_localai_node_names_them(frontend, http):
    node = await register(http, frontend, "gpu-named")
    status, single, _ = await http.call("GET", f"{frontend.url}/api/nodes/gpu-named",
                                        token=ADMIN)
    assert (status, single["id"], single["name"]) == (200, node["id"], "gpu-named")
    status, labels, _ = await http.call("PUT", f"{frontend.url}/api/nodes/gpu-named/labels",
                                        body={"labels": {"rack": "3"}}, token=ADMIN)
    assert (status, labels) == (200, {"id": node["id"], "labels": {"rack": "3"}})
    status, gone, _ = await http.call("DELETE", f"{frontend.url}/api/nodes/gpu-named",
                                      token=ADMIN)
    assert (status, gone) == (200, {"id": node["id"], "deleted": True})
    assert frontend.deleted == [node["id"]]


@pytest_twisted.ensureDeferred
async def test_registrations_per_source_are_limited_with_a_clear_429(db, http):
    """Issue 15 §4: 2000 registrations in 10 s were all accepted.  ``--registration-limit``
    answers 429 with Retry-After, at the end of the headers, for registrations with the right
    token (wrong tokens have their own limit, issue 21 §4); heartbeats are not limited; the
    bucket refills.  Remove the registrations' limit from the guard: this fails."""
    from twisted.internet import task

    from localai_tw.web.ratelimit import SourceRateLimit

    clock = task.Clock()
    registry = NodeRegistry(db, registration_token=TOKEN)
    parts = ClusterParts(db=db, nodes=registry, fence=OwnershipFence(db), instance_id=REPLICA,
                         registration_limit=SourceRateLimit(3 / 60.0, 3, clock))
    registration_api = WorkerRegistrationResource(parts)
    site = BoundedSite(build_root(parts, APIKeyGuard([ADMIN])),
                        header_guards={b"/api/node": registration_api.guard})
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    url = f"http://127.0.0.1:{port.getHost().port}/api/node"
    try:
        first = None
        for i in range(3):
            status, body, _ = await http.call("POST", url + "/register",
                                              body=registration(f"w-{i}"), token=TOKEN)
            assert status == 201, body
            first = first or body
        status, body, response = await http.call("POST", url + "/register",
                                                 body=registration("w-3"), token=TOKEN)
        assert status == 429 and body["error"]["type"] == "rate_limited"
        assert "--registration-limit" in body["error"]["message"]
        assert response.headers.getRawHeaders(b"retry-after") == [b"20"]
        status, _, _ = await http.call("POST", url + "/register", body=registration("w-4"),
                                       token="wrong")
        assert status == 401  # issue 21 §4: failures have their own budget, not the workers'
        status, _, _ = await http.call("POST", f"{url}/{first['id']}/heartbeat", body={},
                                       token=TOKEN)
        assert status == 200
        clock.advance(20)
        status, body, _ = await http.call("POST", url + "/register", body=registration("w-3"),
                                          token=TOKEN)
        assert status == 201, body
        assert len(await registry.list_nodes()) == 4
    finally:
        await port.stopListening()
