"""The registration client against an in-memory frontend resource (treq's
``RequestTraversalAgent``): the request it sends, each answer it maps, its bounds, and that it
never repeats a secret."""

from __future__ import annotations

import json

import pytest
from treq.testing import RequestTraversalAgent
from twisted.internet import task
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from localai_tw.worker.registration import (
    FrontendUnavailable,
    NodeUnknown,
    ProtocolMismatch,
    Registration,
    RegistrationClient,
    RegistrationRejected,
    http_base_url,
    parse_registration,
    token_option,
)

TOKEN = "REG-TOKEN-secret"


class FakeNodeAPI(Resource):
    """``/prefix/api/node/register`` and ``/prefix/api/node/{id}/heartbeat`` answering what the
    test sets."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.requests: list[dict] = []
        self.answer = (201, {"id": "node-1", "status": "healthy", "tunnel_token": "CRED-1"})
        self.raw: bytes | None = None
        self.extra_headers: dict[bytes, bytes] = {}
        self.hang = False

    def render_POST(self, request):
        self.requests.append({
            "path": request.path,
            "authorization": request.getHeader(b"authorization"),
            "body": json.loads(request.content.read() or b"null"),
        })
        if self.hang:
            return NOT_DONE_YET
        code, body = self.answer
        request.setResponseCode(code)
        for name, value in self.extra_headers.items():
            request.setHeader(name, value)
        request.setHeader(b"content-type", b"application/json")
        return self.raw if self.raw is not None else json.dumps(body).encode()


@pytest.fixture
def api():
    return FakeNodeAPI()


@pytest.fixture
def clock():
    return task.Clock()


def client_for(api, clock, token=TOKEN, **kwargs):
    root = Resource()
    prefix = Resource()
    root.putChild(b"prefix", prefix)
    node_api = Resource()
    prefix.putChild(b"api", node_api)
    node_api.putChild(b"node", api)
    agent = RequestTraversalAgent(root)
    client = RegistrationClient(
        clock, "ws://frontend.example:8080/prefix/", token, "worker-a", "backend",
        {"gpu": "a100", "zone": "eu"}, lambda: {"total_ram": 64, "available_ram": 32,
                                                "bogus": "x", "flag": True},
        agent=agent, **kwargs)
    return client, agent


def result_of(d, agent):
    results = []
    d.addBoth(results.append)
    for _ in range(5):
        if results:
            break
        agent.flush()
    assert results, "the Deferred has not fired"
    return results[0]


def test_register_sends_the_contract_body_with_the_bearer_token(api, clock):
    client, agent = client_for(api, clock)
    registration = result_of(client.register(), agent)
    assert registration == Registration("node-1", "healthy", "CRED-1")
    [sent] = api.requests
    assert sent["path"] == b"/prefix/api/node/register"
    assert sent["authorization"] == b"Bearer " + TOKEN.encode()
    assert sent["body"] == {
        "name": "worker-a", "node_type": "backend", "labels": {"gpu": "a100", "zone": "eu"},
        "capacity": {"total_ram": 64, "available_ram": 32}, "max_replicas_per_model": 1}
    assert "address" not in sent["body"]  # a tunnel worker advertises nothing


def test_without_a_token_no_authorization_header_is_sent(api, clock):
    client, agent = client_for(api, clock, token=None)
    result_of(client.register(), agent)
    assert api.requests[0]["authorization"] is None


def test_the_credential_is_not_in_the_repr_of_a_registration(api, clock):
    client, agent = client_for(api, clock)
    registration = result_of(client.register(), agent)
    assert "CRED-1" not in repr(registration)


def test_401_keeps_the_status_and_names_the_registration_token(api, clock):
    api.answer = (401, {"error": {"message": "invalid registration token",
                                  "type": "unauthorized"}})
    client, agent = client_for(api, clock)
    failure = result_of(client.register(), agent)
    error = failure.value
    assert isinstance(error, RegistrationRejected) and not error.transient
    assert error.status == 401
    assert "--registration-token" in str(error)
    assert TOKEN not in str(error)


def test_401_names_the_token_file_when_the_token_came_from_one(api, clock):
    """Issue 26 §5: the worker's message named --registration-token when the token was read
    from --registration-token-file."""
    api.answer = (401, {"error": {"message": "invalid registration token",
                                  "type": "unauthorized"}})
    hint = token_option({"registration-token": "file"}, "/etc/localai-tw/registration-token")
    client, agent = client_for(api, clock, token_hint=hint)
    error = result_of(client.register(), agent).value
    assert "check the token in --registration-token-file /etc/localai-tw/registration-token " \
           "(LOCALAI_REGISTRATION_TOKEN_FILE): it must equal" in str(error)
    assert "check --registration-token " not in str(error)
    assert token_option({"registration-token": "flag"}) == \
        "--registration-token (LOCALAI_REGISTRATION_TOKEN)"


def test_400_names_the_field_the_frontend_rejected(api, clock):
    api.answer = (400, {"error": {"message": "name is too long", "type": "invalid_request",
                                  "field": "name"}})
    client, agent = client_for(api, clock)
    error = result_of(client.register(), agent).value
    assert isinstance(error, RegistrationRejected)
    assert error.status == 400 and error.field == "name"
    assert "'name'" in str(error) and "name is too long" in str(error)


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_failing_frontend_is_unavailable_and_transient(api, clock, status):
    api.answer = (status, {"error": "down"})
    client, agent = client_for(api, clock)
    error = result_of(client.register(), agent).value
    assert isinstance(error, FrontendUnavailable) and error.transient
    assert error.status == status


def test_a_redirect_is_not_followed_with_the_token(api, clock):
    api.answer = (302, {})
    api.extra_headers = {b"location": b"http://elsewhere.example/steal"}
    client, agent = client_for(api, clock)
    error = result_of(client.register(), agent).value
    assert isinstance(error, RegistrationRejected) and error.status == 302
    assert len(api.requests) == 1


@pytest.mark.parametrize("body", [
    b"not json", b"[]", b'{"status": "healthy", "tunnel_token": "x"}',
    b'{"id": "has space", "status": "healthy", "tunnel_token": "x"}',
    b'{"id": "n", "status": 3, "tunnel_token": "x"}',
    b'{"id": "n", "status": "healthy", "tunnel_token": "bad token\\n"}',
])
def test_an_unusable_2xx_body_is_a_protocol_mismatch(api, clock, body):
    api.raw = body
    client, agent = client_for(api, clock)
    error = result_of(client.register(), agent).value
    assert isinstance(error, ProtocolMismatch)
    assert "bad token" not in str(error)


def test_a_registration_without_a_credential_has_an_empty_one():
    assert parse_registration(b'{"id": "n", "status": "pending"}').tunnel_token == ""


def test_an_oversized_answer_is_refused(api, clock):
    api.raw = b'{"id": "n", "status": "healthy", "tunnel_token": "' + b"a" * 70000 + b'"}'
    client, agent = client_for(api, clock)
    error = result_of(client.register(), agent).value
    assert isinstance(error, ProtocolMismatch) and "over" in str(error)


def test_no_answer_within_10s_is_unavailable(api, clock):
    api.hang = True
    client, agent = client_for(api, clock)
    d = client.register()
    assert not d.called
    clock.advance(9.9)
    assert not d.called
    clock.advance(0.1)
    error = result_of(d, agent).value
    assert isinstance(error, FrontendUnavailable) and "10s" in str(error)


def test_heartbeat_posts_the_node_credential_and_capacity_and_returns_the_status(api, clock):
    api.answer = (200, {"status": "draining"})
    client, agent = client_for(api, clock)
    assert result_of(client.heartbeat("node/1", "node-credential"), agent) == "draining"
    [sent] = api.requests
    assert sent["path"] == b"/prefix/api/node/node%2F1/heartbeat"
    assert sent["body"] == {"tunnel_token": "node-credential",
                            "capacity": {"total_ram": 64, "available_ram": 32}}
    assert sent["authorization"] == b"Bearer " + TOKEN.encode()


def test_heartbeat_404_is_node_unknown(api, clock):
    api.answer = (404, {"error": {"message": "unknown node"}})
    client, agent = client_for(api, clock)
    error = result_of(client.heartbeat("node-1"), agent).value
    assert isinstance(error, NodeUnknown) and error.status == 404


def test_heartbeat_401_names_the_token(api, clock):
    api.answer = (401, {})
    client, agent = client_for(api, clock)
    error = result_of(client.heartbeat("node-1"), agent).value
    assert isinstance(error, RegistrationRejected) and "--registration-token" in str(error)


@pytest.mark.parametrize("url, base", [
    ("http://f.example:8080", "http://f.example:8080"),
    ("https://f.example/x/", "https://f.example/x"),
    ("ws://f.example", "http://f.example"),
    ("wss://f.example/p?q=1#f", "https://f.example/p"),
])
def test_the_http_base_url_maps_websocket_schemes(url, base):
    assert http_base_url(url) == base


def test_a_failing_capacity_provider_reports_no_capacity(api, clock):
    client, agent = client_for(api, clock)
    client._capacity_provider = lambda: 1 / 0
    result_of(client.register(), agent)
    assert api.requests[0]["body"]["capacity"] == {}


def test_a_429_is_transient_and_carries_the_frontends_retry_after(api, clock):
    """--registration-limit answers 429 with Retry-After: the worker waits that long, it does
    not give up and does not count it a rejection."""
    api.answer = (429, {"error": {"message": "too many registrations from this address",
                                  "type": "rate_limited"}})
    api.extra_headers = {b"retry-after": b"12"}
    client, agent = client_for(api, clock)
    failure = result_of(client.register(), agent)
    error = failure.value
    assert isinstance(error, FrontendUnavailable) and error.transient
    assert error.status == 429 and error.retry_after == 12.0
    assert "--registration-limit" in str(error)
    api.extra_headers = {b"retry-after": b"soon"}
    assert result_of(client.register(), agent).value.retry_after is None
