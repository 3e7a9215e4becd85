"""Shared frontend web helpers: API-key checks, bearer parsing, body caps per path.  No I/O."""

import json

import pytest
from twisted.internet import task
from twisted.internet.testing import StringTransport
from twisted.web import server
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyRequest

from localai_tw.frontend.api import kit as web
from localai_tw.frontend.api.kit import APIKeyGuard, bearer_token
from localai_tw.web import auth
from localai_tw.web.errors import APIError, bad_request, conflict
from localai_tw.web.listener import MAX_BODY_BYTES, BoundedSite


def request_with(authorization: bytes | None):
    request = DummyRequest([b""])
    if authorization is not None:
        request.requestHeaders.setRawHeaders(b"authorization", [authorization])
    return request


@pytest.mark.parametrize("header, expected", [
    (None, None), (b"Bearer abc", "abc"), (b"bearer   abc  ", "abc"), (b"Basic abc", None),
    (b"Bearer ", None), (b"Bearer", None), (b"Bearer \xff\xfe", None),
])
def test_bearer_token(header, expected):
    assert bearer_token(request_with(header)) == expected


def test_a_repeated_authorization_header_gives_no_bearer_token():
    request = DummyRequest([b""])
    request.requestHeaders.setRawHeaders(b"authorization", [b"Bearer a", b"Bearer a"])
    assert bearer_token(request) is None


def test_api_key_guard_compares_every_key_in_constant_time(monkeypatch):
    compared = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)  # where the keys are compared
    guard = APIKeyGuard(["first-key", "a-much-longer-second-key", "k3"])
    guard.check(request_with(b"Bearer first-key"))  # matches the first: no early exit
    assert compared == [(32, 32)] * 3
    compared.clear()
    with pytest.raises(APIError) as refused:
        guard.check(request_with(b"Bearer x"))
    assert compared == [(32, 32)] * 3
    assert refused.value.status == 401 and "x" not in refused.value.message.split()


def test_api_key_guard_without_keys_refuses_and_says_what_to_set():
    guard = APIKeyGuard([])
    assert not guard.configured
    for header in (None, b"Bearer ", b"Bearer anything"):
        with pytest.raises(APIError) as refused:
            guard.check(request_with(header))
        assert refused.value.status == 401 and "--api-key" in refused.value.message
    assert not APIKeyGuard(["", ""]).configured  # empty keys authorize nobody


def test_api_key_guard_scopes_compare_every_key_of_both_scopes(monkeypatch):
    compared = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    guard = APIKeyGuard(["inf-1", "inf-2"], admin_keys=["adm-1"])
    assert guard.configured and guard.scoped
    guard.check_any(request_with(b"Bearer inf-1"))
    assert compared == [(32, 32)] * 3  # both lists, in full
    guard.check(request_with(b"Bearer adm-1"))
    with pytest.raises(APIError) as refused:
        guard.check(request_with(b"Bearer inf-2"))
    assert refused.value.status == 403 and "--admin-api-key-file" in refused.value.message
    assert "inf-2" not in refused.value.message
    with pytest.raises(APIError) as refused:
        guard.check(request_with(b"Bearer nope"))
    assert refused.value.status == 401
    inference = guard.caller(request_with(b"Bearer inf-1"))
    assert not inference.admin and len(inference.owner) == 64 and "inf-1" not in inference.owner
    assert guard.caller(request_with(b"Bearer adm-1")).admin
    # One scope only: every key is an admin key (the single-machine default).
    assert APIKeyGuard(["inf-1"]).caller(request_with(b"Bearer inf-1")).admin
    # Admin keys only: they serve the OpenAI API too.
    APIKeyGuard([], admin_keys=["adm-1"]).check_any(request_with(b"Bearer adm-1"))


def test_error_body_shape():
    error = bad_request("name: is required", field="name")
    assert error.body() == {"error": {"message": "name: is required",
                                      "type": "invalid_request", "field": "name"}}
    assert conflict("x", code="not_pending").body()["error"]["code"] == "not_pending"


def test_body_limit_for_picks_the_longest_prefix():
    site = BoundedSite(Resource(), body_limits={b"/v1/": 1000, b"/v1/files/": 5000})
    assert site.body_limit_for(b"/v1/chat?x=1") == 1000
    assert site.body_limit_for(b"/v1/files/a") == 5000
    assert site.body_limit_for(b"/api/node/register") == MAX_BODY_BYTES
    assert site.body_limit_for(None) == MAX_BODY_BYTES


def test_a_body_limit_without_a_trailing_slash_covers_that_path_and_below_only():
    site = BoundedSite(Resource(), body_limits={b"/completions": 1000})
    assert site.body_limit_for(b"/completions") == 1000
    assert site.body_limit_for(b"/completions?stream=1") == 1000
    assert site.body_limit_for(b"/completions/x") == 1000
    # no header guard covers this path: it keeps the small default cap
    assert site.body_limit_for(b"/completionsx") == MAX_BODY_BYTES


def feed(site: BoundedSite, data: bytes) -> bytes:
    channel = site.buildProtocol(None)
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(data)
    return transport.value()


def test_the_request_path_is_known_before_the_body():
    """Pins the Twisted internal the per-path cap relies on (``HTTPChannel._path`` while the
    headers end).  If it disappears, the default cap applies (fail closed) and this goes red."""
    site = BoundedSite(Resource(), body_limits={b"/big/": 200_000})
    head = b"Host: x\r\nContent-Length: 100000\r\n\r\n"
    assert feed(site, b"POST /big/upload HTTP/1.1\r\n" + head) == b""  # waiting for the body
    refused = feed(site, b"POST /small HTTP/1.1\r\n" + head)
    assert refused.startswith(b"HTTP/1.1 413 ")
    assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "request_too_large"


class Pending(Resource):
    """Answers only when the test says so (a long generation)."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.requests = []

    def render(self, request):
        self.requests.append(request)
        return server.NOT_DONE_YET


def test_deadlines_stop_while_answering_and_start_again_with_the_next_request():
    """The head and body deadlines bound how long a request takes to *arrive*; answering it
    may take longer (a slow generation), and a keep-alive connection's next request gets a
    deadline of its own from its first byte."""
    clock = task.Clock()
    resource = Pending()
    site = BoundedSite(resource, reactor=clock, headers_deadline=30, body_deadline=120)
    channel = site.buildProtocol(None)
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    clock.advance(1000)  # still answering
    assert not transport.disconnecting and transport.value() == b""
    resource.requests[0].write(b"done")
    resource.requests[0].finish()
    assert b" 200 " in transport.value() and site.body_bytes_in_flight == 0
    clock.advance(29)  # waiting between requests is the idle timer's business (60 s)
    channel.dataReceived(b"GET /b HTT")  # the next request starts...
    clock.advance(29)
    assert not transport.disconnecting
    clock.advance(2)  # ...and its head is 31 s late
    assert transport.disconnecting
    assert transport.value().split(b"done\r\n0\r\n\r\n", 1)[1].startswith(b"HTTP/1.1 408 ")


def deadline_timers(clock: task.Clock) -> list:
    return [call for call in clock.getDelayedCalls()
            if getattr(call.func, "__name__", "") == "_deadline_passed"]


def test_a_request_arriving_in_one_read_arms_no_deadline_and_a_split_one_keeps_them():
    """A deadline started and stopped within one read is never armed (no timer per request
    on the warm path); one still running when the read ends is armed and answers 408."""
    clock = task.Clock()
    resource = Pending()
    site = BoundedSite(resource, reactor=clock, headers_deadline=30, body_deadline=120)
    site.body_first_byte_deadline = 10
    channel = site.buildProtocol(None)
    transport = StringTransport()
    channel.makeConnection(transport)
    clock.advance(1)  # the connection's head deadline runs from its opening
    channel.dataReceived(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    resource.requests[0].finish()
    # The next request, whole in one read: its head, body and first-byte deadlines start and
    # stop without a timer.
    armed = []
    inner = getattr(channel, "wrappedProtocol", channel)
    call_later = inner.callLater
    inner.callLater = lambda seconds, f, *a, **kw: armed.append(f.__name__) or call_later(
        seconds, f, *a, **kw)
    channel.dataReceived(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    assert len(resource.requests) == 2 and "_deadline_passed" not in armed
    assert deadline_timers(clock) == []
    resource.requests[1].finish()
    # The next request's head arrives, its body not: the body's deadlines are armed.
    channel.dataReceived(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
    assert sorted(call.args[0] for call in deadline_timers(clock)) == ["body", "body's first byte"]
    clock.advance(9)
    assert not transport.disconnecting
    clock.advance(1)  # not one byte of the body in 10 s: 408
    assert transport.disconnecting and b"HTTP/1.1 408 " in transport.value()
    assert deadline_timers(clock) == []


class Keeps(Resource):
    """Keeps each request it is given (to look at its body)."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.requests = []

    def render(self, request):
        self.requests.append(request)
        return server.NOT_DONE_YET


def test_uploads_are_spooled_to_a_file_and_still_capped():
    from localai_tw.web.bodies import CappedBody, SpooledCappedBody

    keeps = Keeps()
    site = BoundedSite(keeps, body_limits={b"/v1/": 1000, b"/v1/up": 5000},
                        spool_prefixes=(b"/v1/up",))
    body = b"x" * 3000
    feed(site, b"POST /v1/up HTTP/1.1\r\nHost: x\r\nContent-Length: 3000\r\n\r\n" + body)
    content = keeps.requests[0].content
    assert isinstance(content, SpooledCappedBody) and content.size == 3000
    content.seek(0)
    assert content.read() == body
    feed(site, b"POST /v1/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    assert isinstance(keeps.requests[1].content, CappedBody)  # not an upload: in memory
    assert not site.spools(b"/v1/upper") and site.spools(b"/v1/up/x?y=1")
    # Chunked (no length announced): cut off with 413 naming the limit while it arrives.
    refused = feed(site, b"POST /v1/up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + b"1770\r\n" + b"y" * 6000 + b"\r\n0\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 413 ")
    assert "5000 bytes" in json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert len(keeps.requests) == 2
