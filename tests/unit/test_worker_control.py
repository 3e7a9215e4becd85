"""The worker control plane over in-memory transports: the status contract, streaming, auth,
and a Site fed by a stream whose preamble was consumed (no listener)."""

from __future__ import annotations

import json

import pytest
from twisted.internet import defer, task
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.internet.error import ConnectionClosed, ConnectionDone
from twisted.logger import capturedLogs

from localai_tw.web.streaming import PacedWriter
from localai_tw.worker import control, httpserve
from localai_tw.worker.control import auth as control_auth
from localai_tw.worker.control import (
    ControlAuth,
    ControlVerbs,
    NoFreeSlot,
    VerbRequestSchema,
    build_worker_site,
)
from localai_tw.worker.httpserve import (
    BoundedMemoryBody,
    TunnelStreamAddress,
    serve_http_on_transport,
)
from .support_worker_http import (LOOPBACK, REMOTE, connect, exchange, http_request,
                                  parse_response, post)


def make_site(verbs=None, token=None, readiness=lambda: None):
    verbs = verbs if verbs is not None else ControlVerbs()
    return build_worker_site(verbs, ControlAuth(token), readiness), verbs


# -- paths and the registry ------------------------------------------------------------------------


def test_path_rule_replaces_dots_with_slashes():
    assert control.path_of("backend.install") == b"/v1/control/backend/install"
    assert control.path_of("backend/stop") == b"/v1/control/backend/stop"
    assert control.path_of("mcp-ci.run") == b"/v1/control/mcp-ci/run"


@pytest.mark.parametrize("bad", ["", "Backend.x", "a..b", "a b", "a.", ".a", "x" * 200, "a/./b"])
def test_registry_refuses_names_that_cannot_be_paths(bad):
    with pytest.raises(ValueError):
        ControlVerbs().register(bad, lambda body: {})


def test_registry_refuses_duplicates_and_later_code_registers_its_own():
    verbs = ControlVerbs()
    verbs.register("backend/start", lambda body: {"started": True})
    with pytest.raises(ValueError):
        verbs.register("backend.start", lambda body: {})
    for name in ("backend.stop", "backend.list", "agent.cancel"):
        verbs.register(name, lambda body: {})
    assert verbs.names() == ["agent.cancel", "backend.list", "backend.start", "backend.stop"]
    assert control.IControlVerb.providedBy(verbs.lookup("backend.start"))


# -- the status contract ---------------------------------------------------------------------------


def test_node_status_reports_name_type_uptime_and_running_backends():
    clock = task.Clock()
    clock.advance(1000)
    site, verbs = make_site()
    control.register_node_status(
        verbs, "node-a", "backend",
        lambda: defer.succeed([{"model_id": "m1", "address": "127.0.0.1:50051"}]), clock,
        host=lambda: {"cpu_count": 8, "load_average": [0.5, 0.25, 0.1]},
    )
    clock.advance(12.5)
    code, headers, body = post(site, "/v1/control/node/status", b"")
    assert code == 200
    assert headers[b"content-type"] == [b"application/json"]
    assert json.loads(body) == {
        "node_name": "node-a", "node_type": "backend", "uptime_seconds": 12.5,
        "backends_running": [{"model_id": "m1", "address": "127.0.0.1:50051"}],
        "host": {"cpu_count": 8, "load_average": [0.5, 0.25, 0.1]},
    }


def test_node_status_reports_the_real_cpu_count_and_load_by_default():
    import psutil

    site, verbs = make_site()
    control.register_node_status(verbs, "node-a", "backend", lambda: [], task.Clock())
    code, _, body = post(site, "/v1/control/node/status", b"")
    host = json.loads(body)["host"]
    assert code == 200 and host["cpu_count"] == psutil.cpu_count(logical=True)
    assert len(host["load_average"]) == 3 and all(x >= 0 for x in host["load_average"])


def test_200_carries_the_workers_answer_including_an_error_field():
    site, verbs = make_site()
    verbs.register("model.unload", lambda body: {"success": False, "error": "no such model"})
    code, _, body = post(site, "/v1/control/model/unload", {"model_name": "x"})
    assert code == 200
    assert json.loads(body) == {"success": False, "error": "no such model"}


def test_verb_with_no_reply_answers_204():
    site, verbs = make_site()
    verbs.register("node.stop", lambda body: None)
    code, _, body = post(site, "/v1/control/node/stop")
    assert (code, body) == (204, b"")


def test_coroutine_and_deferred_handlers():
    site, verbs = make_site()

    async def coro(body):
        return {"n": body["n"] + 1}

    verbs.register("a.coro", coro)
    verbs.register("a.deferred", lambda body: defer.succeed({"ok": True}))
    assert json.loads(post(site, "/v1/control/a/coro", {"n": 1})[2]) == {"n": 2}
    assert json.loads(post(site, "/v1/control/a/deferred")[2]) == {"ok": True}


@pytest.mark.parametrize(
    "payload, words",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got array"),
        (b'"text"', "must be a JSON object, got string"),
        (b'{"n": NaN}', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        pytest.param(b"[" * 100000 + b"]" * 100000, "nested too deeply", id="deep-nesting"),
        (b'{"backend": "llama", "force": "yes"}', "field 'force' must be boolean, got string"),
        (b'{"backend": "b", "replica_index": true}', "field 'replica_index' must be integer, got boolean"),
        (b'{"force": true}', "field 'backend' is required"),
    ],
)
def test_400_names_the_problem(payload, words):
    site, verbs = make_site()
    called = []
    verbs.register(
        "backend.install",
        lambda body: called.append(body) or {},
        schema=VerbRequestSchema(
            {"backend": str, "force": bool, "replica_index": int}, frozenset({"backend"})
        ),
    )
    code, headers, body = post(site, "/v1/control/backend/install", payload)
    assert code == 400
    assert headers[b"content-type"] == [b"application/json"]
    assert words in json.loads(body)["problem"]
    assert called == []


def test_handler_may_refuse_with_400():
    site, verbs = make_site()

    def handler(body):
        raise control.BadVerbRequest("model_name must not be empty")

    verbs.register("model.delete", handler)
    code, _, body = post(site, "/v1/control/model/delete", {"model_name": ""})
    assert (code, json.loads(body)) == (400, {"problem": "model_name must not be empty"})


def test_unknown_verb_is_404_with_the_path_echoed_at_most_128_bytes():
    site, _ = make_site()
    long_path = "/v1/control/" + "a" * 500
    code, headers, body = post(site, long_path)
    assert code == 404
    assert headers[b"content-type"] == [b"text/plain; charset=utf-8"]
    prefix = b"unknown worker control path "
    assert body.startswith(prefix)
    echoed = body[len(prefix):]
    assert len(echoed) == 128
    assert echoed == long_path.encode()[:128]


@pytest.mark.parametrize(
    "path",
    ["/v1/control/", "/v1/control/node.status", "/v1/control/node/status/",
     "/v1/control//node/status", "/v1/control/node/%73tatus", "/v1/control/NODE/status"],
)
def test_only_the_exact_verb_path_is_served(path):
    site, verbs = make_site()
    verbs.register("node.status", lambda body: {})
    code, _, body = post(site, path)
    assert code == 404
    assert body.startswith(b"unknown worker control path /v1/control/")


def test_404_echo_is_printable_ascii_only():
    site, _ = make_site()
    code, _, body = post(site, "/v1/control/%0d%0aX-Evil:%20yes\x7f")
    assert code == 404
    assert all(0x20 <= b < 0x7F for b in body)


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "HEAD"])
def test_known_verb_with_another_method_is_405_with_allow(method):
    site, verbs = make_site()
    verbs.register("backend.list", lambda body: {"backends": []})
    (code, headers, _), _, _ = exchange(site, http_request(method, "/v1/control/backend/list"))
    assert code == 405
    assert headers[b"allow"] == [b"POST"]


def test_busy_is_503_with_a_busy_body():
    site, verbs = make_site()

    def run(body):
        raise NoFreeSlot()

    verbs.register("agent.execute", run)
    code, _, body = post(site, "/v1/control/agent/execute")
    assert code == 503
    assert json.loads(body) == {"busy": control.NO_FREE_SLOT}


def test_unexpected_failure_is_500_and_not_an_answer_with_error():
    site, verbs = make_site()
    verbs.register("mcp.discovery", lambda body: 1 / 0)
    code, _, body = post(site, "/v1/control/mcp/discovery")
    assert code == 500
    assert "ZeroDivisionError" in json.loads(body)["problem"]


def test_unserialisable_reply_is_500():
    site, verbs = make_site()
    verbs.register("odd.reply", lambda body: {"when": object()})
    assert post(site, "/v1/control/odd/reply")[0] == 500


# -- body caps -----------------------------------------------------------------------------------


def test_413_on_an_announced_length_over_the_cap_before_reading_the_body():
    site, verbs = make_site()
    called = []
    verbs.register("files.stage", lambda body: called.append(1) or {})
    transport, protocol = connect(site)
    head = (
        b"POST /v1/control/files/stage HTTP/1.1\r\nHost: w\r\n"
        b"Content-Length: %d\r\n\r\n" % (control.MAX_REQUEST_BYTES + 1)
    )
    protocol.dataReceived(head)
    code, headers, body = parse_response(transport.value())
    assert code == 413
    assert headers[b"connection"] == [b"close"]
    assert "8388608" in json.loads(body)["problem"]
    assert transport.disconnecting  # closes instead of reading
    assert transport.producerState == "paused"  # and stopped reading first
    request = protocol._channel.requests[0]
    assert not isinstance(request.content, BoundedMemoryBody)
    protocol.dataReceived(b"x" * 1024 * 1024)  # what was already in flight is dropped
    assert request.content.tell() == 1024 * 1024 and called == []


def test_413_while_receiving_a_chunked_body_stops_reading_and_holds_at_most_the_cap():
    site, verbs = make_site()
    called = []
    verbs.register("files.stage", lambda body: called.append(1) or {})
    transport, protocol = connect(site)
    protocol.dataReceived(
        b"POST /v1/control/files/stage HTTP/1.1\r\nHost: w\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    request = protocol._channel.requests[0]
    sink = request.content
    assert isinstance(sink, BoundedMemoryBody)
    chunk = b"x" * (1024 * 1024)
    fed = 0
    while not transport.disconnecting:
        protocol.dataReceived(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        fed += len(chunk)
        if not sink.closed:
            assert sink.tell() <= control.MAX_REQUEST_BYTES
        assert fed <= control.MAX_REQUEST_BYTES + len(chunk)
    assert parse_response(transport.value())[0] == 413
    assert transport.producerState == "paused"
    assert sink.closed and not isinstance(request.content, BoundedMemoryBody)
    assert called == []


def test_a_body_just_at_the_cap_is_read():
    site, verbs = make_site()
    verbs.register("big.body", lambda body: {"len": len(body["blob"])})
    blob_len = control.MAX_REQUEST_BYTES - len(b'{"blob": ""}')
    payload = b'{"blob": "' + b"y" * blob_len + b'"}'
    assert len(payload) == control.MAX_REQUEST_BYTES
    code, _, body = post(site, "/v1/control/big/body", payload)
    assert (code, json.loads(body)) == (200, {"len": blob_len})


def test_routes_without_a_policy_get_the_small_default_cap():
    site, _ = make_site()
    head = b"POST /healthz HTTP/1.1\r\nHost: w\r\nContent-Length: %d\r\n\r\n" % (
        httpserve.DEFAULT_BODY_LIMIT + 1
    )
    (code, _, _), transport, _ = exchange(site, head)
    assert code == 413 and transport.disconnecting


def test_request_line_is_read_from_the_channel_before_the_body():
    """Pins the Twisted internals the body policy depends on (``_command``, ``_path``)."""
    seen = []

    class Recorder:
        prefix = b"/probe"

        def sink_for(self, request, method, path, length):
            seen.append((method, path, length))
            return BoundedMemoryBody(100)

    site = httpserve.WorkerSite(control.LivenessResource(), [Recorder()])
    exchange(site, http_request("PUT", "/probe/x?y=1", b"abc"))
    assert seen == [(b"PUT", b"/probe/x", 3)]


# -- streaming verbs ---------------------------------------------------------------------------------


def ndjson_lines(body: bytes) -> list:
    assert body.endswith(b"\n")
    return [json.loads(line) for line in body.split(b"\n")[:-1]]


def test_streaming_lines_are_flushed_in_order_with_one_final_reply():
    site, verbs = make_site()
    steps = [defer.Deferred() for _ in range(3)]

    async def install(body, progress):
        for i, step in enumerate(steps):
            await step
            await progress({"step": i})
        return {"success": True, "address": "127.0.0.1:50052"}

    verbs.register("backend.install", install, streaming=True)
    transport, protocol = connect(site)
    protocol.dataReceived(http_request("POST", "/v1/control/backend/install", b"{}"))
    assert transport.value() == b""  # no status before the first line
    for i, step in enumerate(steps):
        step.callback(None)
        code, headers, body = parse_response(transport.value())
        # each line is on the wire as soon as it is produced
        assert ndjson_lines(body)[: i + 1] == [{"progress": {"step": j}} for j in range(i + 1)]
    code, headers, body = parse_response(transport.value())
    assert code == 200
    assert headers[b"content-type"] == [b"application/x-ndjson"]
    assert headers[b"x-content-type-options"] == [b"nosniff"]
    lines = ndjson_lines(body)
    assert lines[:-1] == [{"progress": {"step": i}} for i in range(3)]
    assert lines[-1] == {"reply": {"success": True, "address": "127.0.0.1:50052"}}
    assert transport.value().endswith(b"0\r\n\r\n")  # the chunked body is complete


def test_streaming_failure_after_progress_is_the_reply_line():
    site, verbs = make_site()

    def upgrade(body, progress):
        progress("downloading")
        raise RuntimeError("gallery unreachable")

    verbs.register("backend.upgrade", upgrade, streaming=True)
    code, _, body = post(site, "/v1/control/backend/upgrade")
    assert code == 200
    lines = ndjson_lines(body)
    assert lines[0] == {"progress": "downloading"}
    assert len(lines) == 2 and "gallery unreachable" in lines[1]["reply"]["error"]


def test_streaming_busy_before_any_progress_is_503():
    site, verbs = make_site()

    def run(body, progress):
        raise NoFreeSlot("all 2 slots are taken")

    verbs.register("agent.execute", run, streaming=True)
    code, _, body = post(site, "/v1/control/agent/execute")
    assert (code, json.loads(body)) == (503, {"busy": "all 2 slots are taken"})


def test_streaming_progress_waits_while_the_caller_is_not_reading():
    site, verbs = make_site()
    waits = []
    gate = defer.Deferred()

    async def run(body, progress):
        await progress(1)
        await gate
        waits.append(progress(2))
        await waits[-1]
        return {"done": True}

    verbs.register("slow.reader", run, streaming=True)
    transport, protocol = connect(site)
    protocol.dataReceived(http_request("POST", "/v1/control/slow/reader", b"{}"))
    request = protocol._channel.requests[0]
    assert isinstance(request.producer, PacedWriter)  # the stream follows the caller's pace
    transport.producer.pauseProducing()  # the transport's send buffer is full: the caller is not reading
    gate.callback(None)
    assert len(waits) == 1 and not waits[0].called
    assert b'"progress": 2' in transport.value()  # written, but the verb waits before more
    transport.producer.resumeProducing()
    assert waits[0].called
    lines = ndjson_lines(parse_response(transport.value())[2])
    assert lines[-1] == {"reply": {"done": True}}


def test_streaming_stream_dropped_when_unread_bytes_exceed_the_bound():
    site, verbs = make_site()
    gate = defer.Deferred()
    verbs.register("flood", lambda body, progress: gate, streaming=True)
    transport, protocol = connect(site)
    protocol.dataReceived(http_request("POST", "/v1/control/flood", b"{}"))
    request = protocol._channel.requests[0]
    stream = control.NDJSONReplyStream(request, "flood", max_unread_bytes=1000)
    stream.progress("first")
    transport.producer.pauseProducing()  # the caller stopped reading
    aborted = []
    transport.abortConnection = lambda: aborted.append(True)
    for _ in range(100):
        stream.progress("x" * 50)
        if aborted:
            break
    assert aborted


def _disconnect(protocol):
    protocol.connectionLost(Failure(ConnectionDone("caller went away")))


@pytest.mark.parametrize("streaming", [False, True])
def test_client_disconnect_cancels_the_handler(streaming):
    site, verbs = make_site()
    cancelled = []
    pending = defer.Deferred(lambda d: cancelled.append(True))
    if streaming:
        verbs.register("agent.execute", lambda body, progress: progress("started") and pending,
                       streaming=True)
    else:
        verbs.register("mcp.tools.execute", lambda body: pending)
    path = "/v1/control/agent/execute" if streaming else "/v1/control/mcp/tools/execute"
    transport, protocol = connect(site)
    protocol.dataReceived(http_request("POST", path, b"{}"))
    assert not cancelled
    _disconnect(protocol)
    assert cancelled == [True]


def _install_waiting_on_a_caller_that_leaves(cancel_on_disconnect: bool) -> list:
    """A streaming verb whose second progress line waits on a caller that stopped reading,
    then leaves: the transport stops producing first, as a TCP transport does, then the
    request hears of the loss.  Returns what the verb got to do and the failures logged."""
    site, verbs = make_site()
    steps = []
    gate = defer.Deferred()

    async def install(body, progress):
        await progress(1)
        await gate
        try:
            await progress(2)
        except ConnectionClosed:
            steps.append("learnt the caller left")
            raise
        steps.append("went on")
        return {"success": True}

    verbs.register("backend.install", install, streaming=True,
                   cancel_on_disconnect=cancel_on_disconnect)
    transport, protocol = connect(site)
    protocol.dataReceived(http_request("POST", "/v1/control/backend/install", b"{}"))
    transport.producer.pauseProducing()
    gate.callback(None)
    with capturedLogs() as events:
        transport.producer.stopProducing()
        _disconnect(protocol)
    return steps, [e for e in events if e.get("log_failure") is not None]


def test_a_streaming_verb_waiting_on_a_caller_that_left_learns_it_and_stops():
    """Released instead, the verb would go on installing for nobody until the cancel."""
    steps, failures = _install_waiting_on_a_caller_that_leaves(cancel_on_disconnect=True)
    assert steps == ["learnt the caller left"]
    assert failures == []  # nobody to answer, nothing went wrong on this side


def test_a_streaming_verb_that_must_finish_goes_on_when_the_caller_leaves():
    steps, failures = _install_waiting_on_a_caller_that_leaves(cancel_on_disconnect=False)
    assert steps == ["went on"]
    assert failures == []


def test_verbs_that_must_finish_are_not_cancelled_by_a_disconnect():
    site, verbs = make_site()
    pending = defer.Deferred(lambda d: pytest.fail("must not be cancelled"))
    verbs.register("model.stop", lambda body: pending, cancel_on_disconnect=False)
    transport, protocol = connect(site)
    protocol.dataReceived(http_request("POST", "/v1/control/model/stop", b"{}"))
    _disconnect(protocol)
    pending.callback({"matched": True})  # finishing after the caller left writes nothing


# -- authorization ---------------------------------------------------------------------------------


def test_bearer_token_missing_wrong_right(monkeypatch):
    compared = []
    real = control_auth.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(control_auth.hmac, "compare_digest", spy)  # where the token is compared
    site, verbs = make_site(token="s3cret")
    verbs.register("node.status", lambda body: {"ok": True})
    code, headers, body = post(site, "/v1/control/node/status")
    assert code == 401 and headers[b"www-authenticate"] == [b"Bearer"]
    assert b"s3cret" not in body
    code, _, _ = post(site, "/v1/control/node/status", headers=[("Authorization", "Bearer nope")])
    assert code == 401
    code, _, _ = post(site, "/v1/control/node/status", headers=[("Authorization", "Basic s3cret")])
    assert code == 401
    code, _, body = post(site, "/v1/control/node/status",
                         headers=[("Authorization", "Bearer s3cret")], peer=REMOTE)
    assert (code, json.loads(body)) == (200, {"ok": True})
    assert (b"nope", b"s3cret") in compared and (b"s3cret", b"s3cret") in compared


def test_auth_comes_before_the_verb_lookup():
    site, _ = make_site(token="t")
    assert post(site, "/v1/control/no/such/verb")[0] == 401


def test_unauthorized_body_is_refused_before_it_is_read():
    site, verbs = make_site(token="t")
    verbs.register("files.stage", lambda body: {})
    transport, protocol = connect(site)
    protocol.dataReceived(
        b"POST /v1/control/files/stage HTTP/1.1\r\nHost: w\r\nContent-Length: 5000000\r\n\r\n"
    )
    assert parse_response(transport.value())[0] == 401
    assert transport.disconnecting


@pytest.mark.parametrize(
    "peer, served",
    [
        (LOOPBACK, True),
        (IPv4Address("TCP", "127.8.9.10", 1), True),
        (IPv6Address("TCP", "::1", 1), True),
        (IPv6Address("TCP", "::ffff:127.0.0.1", 1), True),
        (UNIXAddress(b"/run/worker.sock"), True),
        (TunnelStreamAddress(REMOTE), True),
        (REMOTE, False),
        (IPv6Address("TCP", "2001:db8::1", 1), False),
        (IPv4Address("TCP", "0.0.0.0", 1), False),
    ],
)
def test_without_a_token_only_local_callers_are_served(peer, served):
    site, verbs = make_site(token=None)
    verbs.register("node.status", lambda body: {"ok": True})
    code, _, body = post(site, "/v1/control/node/status", peer=peer)
    assert code == (200 if served else 403)


def test_a_tunnel_stream_is_local_whatever_its_transport_reports():
    site, verbs = make_site(token=None)
    verbs.register("node.status", lambda body: {"ok": True})
    (code, _, _), _, _ = exchange(
        site, http_request("POST", "/v1/control/node/status"), peer=REMOTE, over_tunnel=True
    )
    assert code == 200


def test_health_and_readiness_need_no_token():
    reasons = iter([None, "backends still installing"])
    site, _ = make_site(token="t", readiness=lambda: next(reasons))
    (code, _, body), _, _ = exchange(site, http_request("GET", "/healthz", None), peer=REMOTE)
    assert (code, json.loads(body)) == (200, {"alive": True})
    (code, _, body), _, _ = exchange(site, http_request("GET", "/readyz", None), peer=REMOTE)
    assert (code, json.loads(body)) == (200, {"ready": True})
    (code, _, body), _, _ = exchange(site, http_request("GET", "/readyz", None), peer=REMOTE)
    assert code == 503
    assert json.loads(body) == {"ready": False, "reason": "backends still installing"}


def test_readiness_check_failing_is_not_ready():
    site, _ = make_site(readiness=lambda: defer.fail(RuntimeError("db down")))
    (code, _, body), _, _ = exchange(site, http_request("GET", "/readyz", None))
    assert code == 503 and "db down" in json.loads(body)["reason"]


# -- serving a stream without a listener ----------------------------------------------------------


@pytest.mark.parametrize("split", [0, 1, 5, 30, 60, None])
def test_serve_http_on_transport_replays_leftover_bytes(split):
    site, verbs = make_site()
    verbs.register("echo", lambda body: body)
    raw = http_request("POST", "/v1/control/echo", b'{"hello": "world"}')
    split = len(raw) if split is None else split
    transport = StringTransport(peerAddress=REMOTE)
    protocol = serve_http_on_transport(site, transport, raw[:split])
    if split < len(raw):
        protocol.dataReceived(raw[split:])
    code, _, body = parse_response(transport.value())
    assert (code, json.loads(body)) == (200, {"hello": "world"})
    assert protocol.getPeer() == TunnelStreamAddress(REMOTE)


def test_serve_http_on_transport_keeps_the_stream_for_further_requests():
    site, verbs = make_site()
    verbs.register("echo", lambda body: body)
    first = http_request("POST", "/v1/control/echo", b'{"n": 1}')
    second = http_request("POST", "/v1/control/echo", b'{"n": 2}')
    transport = StringTransport()
    protocol = serve_http_on_transport(site, transport, first + second[:10])
    protocol.dataReceived(second[10:])
    out = transport.value()
    assert out.count(b"HTTP/1.1 200 OK") == 2
    assert out.index(b'{"n": 1}') < out.index(b'{"n": 2}')
    _disconnect(protocol)
