"""FrontendService without I/O: readiness combines the database and membership; the starting
gate; the route tree of a wired replica."""

from types import SimpleNamespace

import pytest
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.web.resource import Resource

from localai_tw.frontend.service import FrontendService, FrontendStartupError, StartupState
from localai_tw.frontend.api.kit import ClusterParts
from localai_tw.metrics import ReplicaMetrics


class StubDatabaseService(Service):
    name = "database"

    def __init__(self):
        self.state = (False, "starting the embedded PostgreSQL")
        self.database = None

    def readiness(self):
        return self.state

    def whenReady(self):
        return defer.Deferred()


def frontend():
    db = StubDatabaseService()
    service = FrontendService({"listen": "tcp:0", "instance-id": "replica-u", "api-key": ["k"]},
                              reactor=MemoryReactorClock(), database_service=db)
    return service, db


def wired():
    """A service whose gate is open on a replica of stand-ins (the tree only routes here)."""
    service, db = frontend()
    replica = SimpleNamespace(
        cluster_parts=lambda: ClusterParts(db=None, nodes=None, fence=None,
                                           instance_id="replica-u"),
        db=None, gallery=None, responses=None,  # nothing below reads them: the tree only routes
        inference=object(), node_name=lambda node_id: None, nodes=None, tunnels=None,
        peer_links=SimpleNamespace(resource=Resource), metrics=ReplicaMetrics(), control=None,
        jobs=SimpleNamespace(store=None, kinds=None, fanout=None))
    service._open(replica)
    return service


def test_ready_only_when_the_database_is_ready_and_membership_registered():
    service, db = frontend()
    assert service.readiness() == (False, "starting the embedded PostgreSQL")
    db.state = (True, "ready")
    service.replica_service.state = StartupState.JOINING
    assert service.readiness() == (False, "joining the cluster (registering this replica)")
    service.replica_service.state = StartupState.READY
    assert service.readiness() == (True, "ready")
    service.replica_service._start_failed(
        Failure(FrontendStartupError("advertised address 'x': bad")))
    ready, reason = service.readiness()
    assert not ready and "startup failed" in reason and "advertised address" in reason
    assert service.state is StartupState.FAILED


def test_readyz_reports_the_startup_state():
    from tests.unit.support_openai import call

    service, db = frontend()
    db.state = (True, "ready")
    service.replica_service.state = StartupState.JOINING
    response = call(service.site, "GET", "/readyz")
    assert response.status == 503
    assert response.json() == {"ready": False, "state": "joining",
                               "reason": "joining the cluster (registering this replica)"}


def test_routes_answer_503_json_until_wired():
    from tests.unit.support_openai import call

    service, _ = frontend()
    for path in ("/api/cluster/connect", "/api/cluster/peer", "/api/node/register", "/nope"):
        response = call(service.site, "GET", path)
        assert response.status == 503 and response.json()["error"]["type"] == "not_ready"
        assert response.header("retry-after") == "5"
    assert call(service.site, "GET", "/healthz").status == 200


def test_the_openai_api_is_503_starting_until_wired():
    from tests.unit.support_openai import call

    service, _ = frontend()
    response = call(service.site, "GET", "/v1/models", headers={"Authorization": "Bearer k"})
    assert response.status == 503
    assert response.json()["error"]["type"] == "service_unavailable"
    assert response.json()["error"]["code"] == "starting"
    assert response.header("retry-after") == "5"


def test_a_stopping_replica_says_it_is_stopping_not_starting():
    """Issue 15 §4: a stopping replica answered heartbeats and API calls with 503 "the frontend
    is starting", which sends an operator looking for the wrong problem."""
    from tests.unit.support_openai import call

    service, _ = frontend()
    service.gate.open(service.gate.tree)
    service.gate.close()
    heartbeat = call(service.site, "POST", "/api/node/n1/heartbeat")
    assert heartbeat.status == 503 and heartbeat.header("retry-after") == "5"
    assert "stopping" in heartbeat.json()["error"]["message"]
    assert "starting" not in heartbeat.json()["error"]["message"]
    openai = call(service.site, "GET", "/v1/models", headers={"Authorization": "Bearer k"})
    assert openai.status == 503 and openai.json()["error"]["code"] == "stopping"


def test_a_missing_api_key_is_refused_while_starting_too():
    from tests.unit.support_openai import call

    service, _ = frontend()
    openai = call(service.site, "GET", "/v1/models")
    assert openai.status == 401 and openai.json()["error"]["code"] == "invalid_api_key"
    for path in ("/api/nodes", "/api/cluster/instances"):
        assert call(service.site, "GET", path).status == 401
        assert call(service.site, "GET", path, headers={"Authorization": "Bearer k"}).status \
            == 503


def test_the_peer_secret_is_minted_once_and_kept_out_of_repr():
    service, _ = frontend()
    seed = service.config.identity_seed
    assert len(seed.peer_secret) >= 22 and seed.peer_secret not in repr(seed)
    assert frontend()[0].config.identity_seed.peer_secret != seed.peer_secret  # per process


def test_the_root_says_where_the_apis_are():
    from localai_tw import __version__
    from tests.unit.support_openai import call

    service, _ = frontend()
    response = call(service.site, "GET", "/")
    assert response.status == 200 and response.header("content-type") == "application/json"
    index = response.json()
    assert index["name"] == "localai-tw" and index["version"] == __version__
    assert index["openai_api"] == "/v1" and "openai-api.md" in index["docs"]
    posted = call(service.site, "POST", "/", {"a": 1})
    assert posted.status == 405 and posted.header("allow") == "GET, HEAD"
    assert posted.json()["error"]["type"] == "method_not_allowed"


@pytest.mark.parametrize("method, path", [
    ("GET", "/nope"), ("GET", "/index.html"), ("POST", "/v2/chat/completions"),
    ("GET", "/api"), ("GET", "/api/"), ("GET", "/api/nope"), ("DELETE", "/api/nope/deeper"),
    ("GET", "/api/cluster"), ("GET", "/api/cluster/nope"),
])
def test_unknown_paths_are_json_404_in_the_project_shape(method, path):
    from tests.unit.support_openai import call

    service = wired()
    response = call(service.site, method, path)
    assert response.status == 404, response.raw_body
    assert response.header("content-type") == "application/json"
    error = response.json()["error"]
    assert error["type"] == "not_found" and path.split("?")[0] in error["message"]


def test_unknown_paths_under_v1_are_json_404_in_the_openai_shape():
    from tests.unit.support_openai import call

    service = wired()
    response = call(service.site, "GET", "/v1/nope", headers={"Authorization": "Bearer k"})
    assert response.status == 404
    assert response.json() == {"error": {
        "message": "unknown endpoint /v1/nope", "type": "invalid_request_error",
        "param": None, "code": "unknown_url"}}


def test_the_unprefixed_openai_routes_have_their_v1_twins_cap_and_guard():
    """Each alias of ``openai.resource.UNPREFIXED`` takes the body cap of its /v1 twin (a twin
    with its own cap, as an upload route may have, passes it on) and the API-key guard; a path
    that merely starts like an alias does not."""
    import dataclasses

    from localai_tw.frontend.api import routes
    from localai_tw.frontend.api.kit import APIKeyGuard
    from localai_tw.frontend.api.openai import OPENAI_MAX_BODY_BYTES
    from localai_tw.web.listener import MAX_BODY_BYTES, BoundedSite

    table = tuple(dataclasses.replace(row, body_cap=10**9)
                  if row.path == b"/v1/audio/transcriptions" else row for row in routes.ROUTES)
    site = BoundedSite(None)
    routes.apply_policies(site, APIKeyGuard(["k"]), table)
    assert site.body_limit_for(b"/chat/completions") == OPENAI_MAX_BODY_BYTES
    assert site.body_limit_for(b"/models/capabilities") == OPENAI_MAX_BODY_BYTES
    assert site.body_limit_for(b"/audio/transcriptions") == 10**9
    assert site.body_limit_for(b"/tts") == OPENAI_MAX_BODY_BYTES
    assert site.body_limit_for(b"/embeddingsx") == MAX_BODY_BYTES
    service, _ = frontend()  # the replica's listener has the same guards
    for checked in (site, service.site):
        guarded = {prefix for prefix, _ in checked.header_guards}
        assert {(b"v1",), (b"chat",), (b"completions",), (b"embeddings",), (b"models",),
                (b"audio",), (b"tts",), (b"images",)} <= guarded
