"""The web layer both HTTP servers share (localai_tw/web/): one bearer rule on every surface,
bodies capped while they arrive, early answers, JSON answers, bounded response readers.
No network: DummyRequest, StringTransport and a fake response."""

import json

import pytest
from twisted.internet import defer
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.test.requesthelper import DummyRequest

from localai_tw.frontend.api.kit import APIKeyGuard, bearer_token
from localai_tw.tunnel.websocket import BearerTokenAuthorizer, ConnectRefused
from localai_tw.web import auth
from localai_tw.web.bodies import BodyTooLarge, CappedBody, answer_early
from localai_tw.web.json import write_json
from localai_tw.web.readers import ResponseTooLarge, read_bounded
from localai_tw.worker.control import ControlAuth
from localai_tw.worker.httpserve import TunnelStreamAddress

SECRET = "s3cret"


def request_with(*authorization: bytes) -> DummyRequest:
    request = DummyRequest([b""])
    if authorization:
        request.requestHeaders.setRawHeaders(b"authorization", list(authorization))
    request.client = TunnelStreamAddress()
    return request


def frontend_accepts(request) -> bool:
    try:
        APIKeyGuard([SECRET], what="the test API").check(request)
    except Exception:
        return False
    return bearer_token(request) == SECRET


def tunnel_accepts(request) -> bool:
    try:
        BearerTokenAuthorizer(SECRET).authorize(request)
    except ConnectRefused:
        return False
    return True


def worker_accepts(request) -> bool:
    return ControlAuth(SECRET).refusal_for(request) is None


SURFACES = {"frontend": frontend_accepts, "tunnel": tunnel_accepts, "worker": worker_accepts}


@pytest.mark.parametrize("surface", sorted(SURFACES))
@pytest.mark.parametrize("headers, accepted", [
    ((b"Bearer s3cret",), True),
    ((b"bearer   s3cret  ",), True),  # the scheme in any case, spaces around the credential
    ((b"Bearer s3cret", b"Bearer s3cret"), False),  # repeated: refused, even when both agree
    ((b"Bearer s3cret", b"Bearer other"), False),
    ((), False),
    ((b"Basic s3cret",), False),
    ((b"Bearer",), False),
    ((b"Bearer ",), False),
    ((b"Bearer other",), False),
])
def test_every_surface_applies_the_same_bearer_rule(surface, headers, accepted):
    assert SURFACES[surface](request_with(*headers)) is accepted


def test_the_tunnel_says_why_a_credential_is_missing():
    with pytest.raises(ConnectRefused) as repeated:
        BearerTokenAuthorizer(SECRET).authorize(request_with(b"Bearer a", b"Bearer a"))
    assert (repeated.value.status, repeated.value.message) == (401, "ambiguous credential")
    with pytest.raises(ConnectRefused) as absent:
        BearerTokenAuthorizer(SECRET).authorize(request_with())
    assert absent.value.message == "missing bearer credential"


def test_matches_any_compares_with_every_digest():
    digests = [auth.digest("one"), auth.digest(b"two")]
    assert auth.matches_any(b"two", digests) and auth.matches_any("one", digests)
    assert not auth.matches_any("three", digests) and not auth.matches_any("one", [])


def test_a_capped_body_refuses_a_write_past_its_limit_and_keeps_nothing_of_it():
    body = CappedBody(5)
    body.write(b"abc")
    with pytest.raises(BodyTooLarge) as over:
        body.write(b"def")
    assert over.value.limit == 5
    assert body.accepts(2) and not body.accepts(3)
    body.write(b"de")
    body.seek(0)
    assert body.read() == b"abcde" and body.getvalue() == b"abcde"


class _Channel:
    persistent = True

    def __init__(self):
        self.transport = StringTransport()
        self.closed = False

    def loseConnection(self):
        self.closed = True


@pytest.mark.parametrize("stop_reading", [True, False])
def test_an_early_answer_is_a_whole_json_response_and_a_refusal_stops_reading(stop_reading):
    channel = _Channel()
    answer_early(channel, 413, {"problem": "too big"}, ((b"retry-after", b"5"),),
                 stop_reading=stop_reading)
    head, _, body = channel.transport.value().partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 413 Request Entity Too Large"
    assert {b"content-type: application/json", b"x-content-type-options: nosniff",
            b"retry-after: 5", b"connection: close",
            b"content-length: %d" % len(body)} <= set(lines)
    assert json.loads(body) == {"problem": "too big"} and channel.persistent is False
    assert channel.closed is stop_reading
    assert channel.transport.producerState == ("paused" if stop_reading else "producing")


def test_a_json_answer_has_the_shared_headers_and_no_body_for_head():
    request = DummyRequest([b""])
    write_json(request, 201, {"a": 1}, {"Retry-After": "5"})
    assert request.responseCode == 201 and json.loads(b"".join(request.written)) == {"a": 1}
    for name, value in ((b"content-type", b"application/json"), (b"cache-control", b"no-store"),
                        (b"x-content-type-options", b"nosniff"), (b"retry-after", b"5")):
        assert request.responseHeaders.getRawHeaders(name) == [value]
    head = DummyRequest([b""])
    head.method = b"HEAD"
    write_json(head, 200, {"a": 1})
    assert head.written == [] and head.finished
    gone = DummyRequest([b""])
    gone.finished = True
    write_json(gone, 200, {"a": 1})
    assert gone.written == []


class _Transport:
    stopped = False

    def stopProducing(self):
        self.stopped = True


class _Response:
    """Delivers ``chunks`` then ends (or never ends: ``done=False``)."""

    def __init__(self, chunks, done=True):
        self.chunks, self.done = chunks, done
        self.transport = _Transport()

    def deliverBody(self, protocol):
        protocol.makeConnection(self.transport)
        for chunk in self.chunks:
            protocol.dataReceived(chunk)
        if self.done:
            protocol.connectionLost(Failure(ResponseDone()))


def test_a_bounded_reader_returns_a_body_within_its_cap():
    result = []
    read_bounded(_Response([b"ab", b"cd"]), 4).addCallback(result.append)
    assert result == [b"abcd"]


def test_a_bounded_reader_stops_reading_one_byte_past_its_cap():
    response = _Response([b"ab", b"cd", b"e", b"never kept"])
    failures = []
    read_bounded(response, 4).addErrback(failures.append)
    assert response.transport.stopped
    error = failures[0].value
    assert isinstance(error, ResponseTooLarge)
    assert (error.limit, error.received, str(error)) == (4, b"abcd", "response body over 4 bytes")


def test_cancelling_a_bounded_read_stops_reading():
    response = _Response([b"ab"], done=False)
    reading = read_bounded(response, 4)
    reading.addErrback(lambda f: f.trap(defer.CancelledError))
    reading.cancel()
    assert response.transport.stopped


def test_a_key_checked_once_per_request_is_not_taken_by_another_guard_or_key():
    """The guard remembers the caller it found on the request (the listener's header guard,
    then the resource): that memory serves the same guard and key only."""
    first, other = APIKeyGuard([SECRET]), APIKeyGuard(["another-key"])
    request = request_with(b"Bearer s3cret")
    assert first.caller(request) == first.caller(request)
    with pytest.raises(Exception):
        other.check_any(request)  # another guard compares the key itself
    request.requestHeaders.setRawHeaders(b"authorization", [b"Bearer wrong"])
    with pytest.raises(Exception):
        first.check_any(request)  # another key on the same request is compared again
