"""Both ends of a ``call`` stream over an in-memory yamux pair with a ``task.Clock``: the
frontend's ``TunnelBackendClient`` (through the real preamble handshake) and the worker's real
``StreamRouter``, with a scripted gRPC client on the worker side.  Answers, statuses, backpressure
down to the worker's item reads, cancel and deadline cancelling the worker's call, the
``unavailable`` refusal, garbage both ways, a cut stream, and an older worker's fallback.
Keep-alive: calls reuse one stream, a cancelled call's stream is not reused, idle streams close
after the idle timeout, route events empty the pool, the worker reads a request after a status
and refuses one when its backend went away meanwhile."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from twisted.internet import defer, task
from twisted.internet.protocol import Protocol

from localai_tw import errors
from localai_tw.backends import backend_pb2, callframes
from localai_tw.backends.grpcfuture import STREAM_END
from localai_tw.config import PortRange
from localai_tw.frontend.inference import tunnelcalls
from localai_tw.frontend.inference.tunnelcalls import TunnelBackendClient
from localai_tw.mux.testing import Recorder, connectedSessions
from localai_tw.tunnel import preamble
from localai_tw.tunnel.handshake import PreambleClient
from localai_tw.worker import backendcalls
from localai_tw.worker.backendcalls import BackendCalls
from localai_tw.worker.control import ControlAuth, ControlVerbs, build_worker_site
from localai_tw.worker.streams import StreamRouter

RANGE = PortRange(30000, 30009)
PORT = 30001
NODE = "node-1"


class RpcFailure(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class ScriptedStream:
    """A server stream's call object: the test decides each item (via FakeCalls)."""

    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class FakeClient:
    """The worker's gRPC client of one backend: records every call, answered by the test."""

    metadata = (("authorization", "Bearer backend-own-token"),)

    def __init__(self):
        self.calls: list[dict] = []

    def raw(self, path, server_streaming):
        client = self

        class Callable:
            def future(self, body, timeout, metadata):
                future = concurrent.futures.Future()
                client.calls.append({"path": path, "body": body, "timeout": timeout,
                                     "metadata": metadata, "future": future})
                return future

            def __call__(self, body, timeout, metadata):
                stream = ScriptedStream()
                client.calls.append({"path": path, "body": body, "timeout": timeout,
                                     "metadata": metadata, "stream": stream})
                return stream

        return Callable()


class FakeCalls(BackendCalls):
    """``BackendCalls`` whose item reads the test fires (no threads)."""

    def __init__(self, clock, client):
        super().__init__(None, clock)
        self.client = client
        self.reads: list[defer.Deferred] = []

    def client_for(self, port):
        return self.client if port == PORT else None

    def read_item(self, iterator):
        d = defer.Deferred()
        self.reads.append(d)
        return d


class SessionDialer:
    """``WorkerDialer.open`` on one in-memory session: the real preamble handshake."""

    def __init__(self, session, clock):
        self.session, self.clock = session, clock
        self.tags: list[str] = []

    def open(self, node_id, tag, target, protocol, deadline=None, early=b"", lasting=False):
        self.tags.append(tag)
        client = PreambleClient(node_id, tag, target, protocol, self.clock, deadline,
                                early=early)
        self.session.openStream(client)
        return client.whenReady()


class Harness:
    def __init__(self, acceptor=None):
        self.clock = task.Clock()
        self.clock.callFromThread = lambda f, *a, **kw: f(*a, **kw)
        self.backend = FakeClient()
        self.calls = FakeCalls(self.clock, self.backend)
        site = build_worker_site(ControlVerbs(), ControlAuth(None), lambda: None)
        self.router = StreamRouter(site, RANGE, self.clock, backend_calls=self.calls)
        #: streams the worker accepted
        self.accepted = 0

        def counting(stream):
            self.accepted += 1
            return self.router.acceptor(stream)

        self.worker, self.frontend, self.pump, _ = connectedSessions(
            client_acceptor=acceptor or counting, clock=self.clock)
        self.dialer = SessionDialer(self.frontend, self.clock)
        self.fallback_calls: list = []
        self.old_nodes: set[str] = set()
        self.client = TunnelBackendClient(self.dialer, NODE, PORT, self.clock,
                                          fallback=self._fallback, old_nodes=self.old_nodes)

    def _fallback(self):
        harness = self

        class Bridged:
            def call(self, method, request, deadline):
                harness.fallback_calls.append(method)
                return defer.succeed(backend_pb2.Reply(message=b"bridged"))

        return Bridged()

    def flush(self):
        self.pump.flush()


def outcome(d):
    box = []
    d.addBoth(box.append)
    return box


def test_a_unary_call_carries_the_request_and_the_backends_token():
    h = Harness()
    result = outcome(h.client.call("Predict", backend_pb2.PredictOptions(Prompt="hi"),
                                   deadline=30.0))
    h.flush()
    [call] = h.backend.calls
    assert call["path"] == "/backend.Backend/Predict"
    assert backend_pb2.PredictOptions.FromString(call["body"]).Prompt == "hi"
    assert call["metadata"] == FakeClient.metadata  # the worker's token, not the frontend's
    assert call["timeout"] == pytest.approx(30.0, abs=0.01)
    assert h.client.in_flight == 1
    call["future"].set_result(backend_pb2.Reply(message=b"hello").SerializeToString())
    h.flush()
    [reply] = result
    assert reply.message == b"hello"
    assert h.client.in_flight == 0 and h.dialer.tags == [preamble.TAG_CALL]


def test_a_backend_status_passes_through_as_its_answer():
    h = Harness()
    result = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    h.backend.calls[0]["future"].set_exception(
        RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded"))
    h.flush()
    [failure] = result
    assert failure.check(errors.BackendAnswer)
    assert (failure.value.code, failure.value.details) == ("FAILED_PRECONDITION",
                                                           "model not loaded")
    assert failure.value.node_id == NODE if hasattr(failure.value, "node_id") else True


def test_deadline_exceeded_from_the_backend_is_the_callers():
    h = Harness()
    result = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    h.backend.calls[0]["future"].set_exception(
        RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    h.flush()
    assert result[0].check(errors.CallerDeadlineExceeded)


def test_a_slow_consumer_stops_the_workers_item_reads():
    h = Harness()
    seen, gate = [], defer.Deferred()

    def on_item(reply):
        seen.append(reply)
        return gate if len(seen) == 1 else None

    result = outcome(h.client.stream("PredictStream", backend_pb2.PredictOptions(Prompt="x"),
                                     on_item))
    h.flush()
    [call] = h.backend.calls
    item = backend_pb2.Reply(message=b"y" * 64 * 1024).SerializeToString()
    served = 0
    for _ in range(100):  # answer every read the worker makes, as fast as it asks
        pending = [d for d in h.calls.reads if not d.called]
        if not pending:
            break
        pending[0].callback(item)
        served += 1
        h.flush()
    # the frontend holds item 1; the window and the worker's write buffer hold a few more;
    # then the worker stops reading from the backend
    assert len(seen) == 1
    assert 2 <= served < 10
    assert not any(not d.called for d in h.calls.reads)
    gate.callback(None)
    h.flush()
    for _ in range(3):
        pending = [d for d in h.calls.reads if not d.called]
        pending[0].callback(item)
        h.flush()
    [d for d in h.calls.reads if not d.called][0].callback(STREAM_END)
    h.flush()
    assert len(seen) == served + 3
    assert result == [None] and not call["stream"].cancelled


def test_cancelling_mid_stream_cancels_the_workers_call():
    h = Harness()
    seen = []
    done = h.client.stream("PredictStream", backend_pb2.PredictOptions(Prompt="x"), seen.append)
    result = outcome(done)
    h.flush()
    h.calls.reads[0].callback(backend_pb2.Reply(message=b"a").SerializeToString())
    h.flush()
    assert len(seen) == 1
    done.cancel()
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert result[0].check(defer.CancelledError)
    assert h.backend.calls[0]["stream"].cancelled
    assert h.client.in_flight == 0


def test_the_deadline_fails_the_call_and_cancels_the_workers():
    h = Harness()
    result = outcome(h.client.call("Predict", backend_pb2.PredictOptions(), deadline=5.0))
    h.flush()
    future = h.backend.calls[0]["future"]
    h.clock.advance(5.0)
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert result[0].check(errors.CallerDeadlineExceeded)
    assert future.cancelled()


def test_no_backend_on_the_port_is_refused_unavailable():
    h = Harness()
    h.calls.client = None
    result = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    failure = result[0]
    assert failure.check(errors.StreamRefused)
    assert failure.value.code == preamble.UNAVAILABLE
    assert errors.may_act_on(failure.value)
    assert NODE not in h.old_nodes and h.fallback_calls == []


class ScriptedWorker(Protocol):
    """Answers the preamble ``ok``, then writes what the test gives it."""

    def __init__(self, answer: bytes, close: bool = False, refuse: str | None = None):
        self.answer, self.close, self.refuse = answer, close, refuse
        self.received = b""

    def dataReceived(self, data):
        first = not self.received
        self.received += data
        if first:
            self.first = data
            if self.refuse:
                self.transport.write(preamble.encode_refused(self.refuse, "old worker"))
                self.transport.loseConnection()
                return
            self.transport.write(preamble.encode_accepted() + self.answer)
            if self.close:
                self.transport.loseConnection()


def scripted(answer=b"", close=False, refuse=None):
    workers = []

    def acceptor(stream):
        worker = ScriptedWorker(answer, close, refuse)
        workers.append(worker)
        return worker

    return Harness(acceptor=acceptor), workers


@pytest.mark.parametrize("answer, match", [
    (b"\x09\x00\x00\x00\x00", "kind 9"),
    (b"\x02" + (callframes.MAX_PAYLOAD + 1).to_bytes(4, "big"), "more than the limit"),
    (callframes.encode_message(b"\xff\xff\xff"), "does not decode"),
    (callframes.encode_status(0), "status OK without a message"),
    (callframes.encode_message(b"") * 2, "second message"),
    (b"\x03\x00\x00\x00\x01\x63", "not a gRPC status"),
])
def test_garbage_from_the_worker_is_a_protocol_error(answer, match):
    h, _ = scripted(answer)
    result = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    assert result[0].check(callframes.CallProtocolError), result
    assert match in str(result[0].value)
    assert h.client.in_flight == 0


def test_a_stream_cut_before_the_status_is_a_transport_failure():
    h, _ = scripted(callframes.encode_message(b"")[:3], close=True)
    result = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert result[0].check(errors.TransportFailure)
    assert "ended inside a call frame header" in str(result[0].value)


def test_an_older_worker_is_remembered_and_served_through_the_bridge():
    h, workers = scripted(refuse=preamble.UNKNOWN_TAG)
    first = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    assert first[0].message == b"bridged"
    assert NODE in h.old_nodes and len(workers) == 1
    second = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    assert second[0].message == b"bridged" and len(workers) == 1  # no second stream
    assert h.fallback_calls == ["Health", "Health"] and h.client.in_flight == 0


@pytest.mark.parametrize("request_bytes", [
    b"\x01\x00\x00\x00\x03abc",                                 # not a request
    b"\x01\x00\x00\x00\x09\x04Nope\x00\x00\x00\x00",            # an unknown method
    b"\x02\x00\x00\x00\x00",                                    # a kind the worker never reads
    b"\x01" + (callframes.MAX_PAYLOAD + 1).to_bytes(4, "big"),  # oversize
    callframes.encode_request("Health", 0, b"") + b"more",      # bytes after the request
])
def test_garbage_to_the_worker_resets_that_stream_only(request_bytes):
    h = Harness()
    recorder = Recorder()
    client = PreambleClient(NODE, preamble.TAG_CALL, f"127.0.0.1:{PORT}", recorder, h.clock)
    h.frontend.openStream(client)
    h.flush()
    recorder.transport.write(request_bytes)
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert recorder.reason is not None  # reset, no answer
    assert not h.backend.calls
    # the session goes on: another call on it is served
    result = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    h.backend.calls[0]["future"].set_result(backend_pb2.Reply(message=b"OK")
                                            .SerializeToString())
    h.flush()
    assert result[0].message == b"OK"


def test_a_request_that_never_arrives_is_reset_after_the_timeout():
    h = Harness()
    recorder = Recorder()
    client = PreambleClient(NODE, preamble.TAG_CALL, f"127.0.0.1:{PORT}", recorder, h.clock)
    h.frontend.openStream(client)
    h.flush()
    recorder.transport.write(callframes.encode_request("Health", 0, b"")[:4])
    h.flush()
    h.clock.advance(backendcalls.REQUEST_TIMEOUT_SECONDS)
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert recorder.reason is not None and not h.backend.calls


def test_the_request_rides_behind_the_stream_request_frame():
    # No round trip waits for ``ok``: the worker's first read holds the call request too.
    h, workers = scripted(callframes.encode_message(backend_pb2.Reply().SerializeToString())
                          + callframes.encode_status(0))
    result = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    payload, rest = preamble.split_frame(workers[0].first)
    assert preamble.parse_request(payload).tag == preamble.TAG_CALL
    decoder = callframes.FrameDecoder({callframes.REQUEST})
    decoder.feed(rest)
    kind, body = decoder.next_frame()
    assert callframes.parse_request(body).method.name == "Health"
    assert result[0] == backend_pb2.Reply()


def test_a_request_over_the_message_cap_fails_without_a_stream():
    h = Harness()
    huge = backend_pb2.PredictOptions(Prompt="x" * (callframes.MAX_MESSAGE_BYTES + 1))
    result = outcome(h.client.call("Predict", huge))
    h.flush()
    assert result[0].check(errors.BackendAnswer)
    assert result[0].value.code == "RESOURCE_EXHAUSTED" and "message cap" in str(result[0].value)
    assert h.dialer.tags == [] and h.client.in_flight == 0


# -- keep-alive ---------------------------------------------------------------------------------


def answer_unary(h, index, message=b"OK"):
    h.backend.calls[index]["future"].set_result(
        backend_pb2.Reply(message=message).SerializeToString())
    h.flush()


def test_sequential_calls_reuse_one_stream():
    h = Harness()
    first = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 0, b"one")
    assert first[0].message == b"one" and h.client.idle_streams == 1
    # a failed status is a clean end too: the stream goes back to the pool
    second = outcome(h.client.call("Predict", backend_pb2.PredictOptions(Prompt="p"),
                                   deadline=20.0))
    h.flush()
    h.backend.calls[1]["future"].set_exception(
        RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded"))
    h.flush()
    assert second[0].check(errors.BackendAnswer)
    items = []
    third = outcome(h.client.stream("PredictStream", backend_pb2.PredictOptions(Prompt="s"),
                                    items.append))
    h.flush()
    h.calls.reads[0].callback(backend_pb2.Reply(message=b"a").SerializeToString())
    h.flush()
    h.calls.reads[1].callback(STREAM_END)
    h.flush()
    assert third == [None] and [i.message for i in items] == [b"a"]
    fourth = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 3, b"four")
    assert fourth[0].message == b"four"
    # one stream opened on the worker, one handshake: later calls wrote only their request
    assert h.accepted == 1 and h.dialer.tags == [preamble.TAG_CALL]
    assert h.client.streams_reused == 3 and h.client.dials_ok == 1
    assert h.backend.calls[1]["timeout"] == pytest.approx(20.0, abs=0.01)  # its own deadline
    assert h.client.in_flight == 0 and h.client.idle_streams == 1


def test_a_cancelled_calls_stream_is_not_reused_and_the_next_call_works():
    h = Harness()
    done = h.client.call("Predict", backend_pb2.PredictOptions())
    result = outcome(done)
    h.flush()
    future = h.backend.calls[0]["future"]
    done.cancel()
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert result[0].check(defer.CancelledError) and future.cancelled()
    assert h.client.idle_streams == 0
    after = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 1)
    assert after[0].message == b"OK"
    assert h.accepted == 2 and h.client.streams_reused == 0


def test_an_expired_calls_stream_is_not_reused():
    h = Harness()
    result = outcome(h.client.call("Predict", backend_pb2.PredictOptions(), deadline=5.0))
    h.flush()
    h.clock.advance(5.0)
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert result[0].check(errors.CallerDeadlineExceeded)
    assert h.client.idle_streams == 0
    after = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 1)
    assert after[0].message == b"OK" and h.accepted == 2


def test_an_idle_stream_is_closed_after_the_idle_timeout_and_never_by_the_worker():
    h = Harness()
    outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 0)
    assert h.worker.streamCount == 1
    # the worker's request timeout does not apply to the idle wait
    assert backendcalls.REQUEST_TIMEOUT_SECONDS > tunnelcalls.IDLE_TIMEOUT
    h.clock.advance(tunnelcalls.IDLE_TIMEOUT - 1)
    h.flush()
    assert h.client.idle_streams == 1
    h.clock.advance(1)
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert h.client.idle_streams == 0 and h.worker.streamCount == 0  # closed both ways
    after = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 1)
    assert after[0].message == b"OK" and h.accepted == 2


def test_an_idle_stream_used_again_gets_a_full_idle_timeout_from_its_last_call():
    # One sweep timer serves the whole pool: it must measure idleness from each stream's last
    # call, not from when the timer was set.
    h = Harness()
    outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 0)
    h.clock.advance(tunnelcalls.IDLE_TIMEOUT - 1)
    h.flush()
    again = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 1, b"again")
    assert again[0].message == b"again" and h.accepted == 1
    h.clock.advance(tunnelcalls.IDLE_TIMEOUT - 1)  # past the first call's timeout
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert h.client.idle_streams == 1 and h.worker.streamCount == 1
    h.clock.advance(1)  # a full timeout after the last call
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert h.client.idle_streams == 0 and h.worker.streamCount == 0
    assert h.clock.getDelayedCalls() == [] or all(
        not c.func.__name__.startswith("_sweep") for c in h.clock.getDelayedCalls())


def test_the_worker_keeps_an_idle_stream_past_its_request_timeout():
    h = Harness()
    h.client._idle_timeout = backendcalls.REQUEST_TIMEOUT_SECONDS * 3
    outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 0)
    h.clock.advance(backendcalls.REQUEST_TIMEOUT_SECONDS * 2)
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert h.client.idle_streams == 1 and h.worker.streamCount == 1
    again = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 1, b"again")
    assert again[0].message == b"again" and h.accepted == 1


def test_at_most_max_idle_streams_are_kept():
    h = Harness()
    h.client._max_idle = 2
    results = [outcome(h.client.call("Health", backend_pb2.HealthMessage())) for _ in range(3)]
    h.flush()
    for index in range(3):
        answer_unary(h, index)
    h.clock.advance(0)
    h.flush()
    assert all(r[0].message == b"OK" for r in results)
    assert h.accepted == 3 and h.client.idle_streams == 2


def test_closing_the_client_empties_the_pool():
    # BackendClients.drop(node, port) and forget(node) close the clients they drop.
    h = Harness()
    outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 0)
    assert h.client.idle_streams == 1
    h.client.close()
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert h.client.idle_streams == 0 and h.worker.streamCount == 0


def test_backend_clients_drop_and_forget_close_the_pooled_streams():
    from localai_tw.frontend.inference.backend_client import BackendClients

    class Bridges:
        def drop(self, node_id, port):
            return defer.succeed(None)

        forget = close = lambda self, *a: defer.succeed(None)

    h = Harness()
    clients = BackendClients(Bridges(), h.clock, dialer=h.dialer)
    for event in (lambda: clients.drop(NODE, PORT), lambda: clients.forget(NODE)):
        client = clients.client(NODE, PORT)
        outcome(client.call("Health", backend_pb2.HealthMessage()))
        h.flush()
        answer_unary(h, len(h.backend.calls) - 1)
        assert client.idle_streams == 1
        event()
        h.flush()
        assert client.idle_streams == 0 and client.closed
    clients.stream_threads.stop()


def test_the_tunnel_going_empties_the_pool():
    h = Harness()
    outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 0)
    assert h.client.idle_streams == 1
    h.frontend.transport.loseConnection()
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert h.client.idle_streams == 0


def test_the_worker_reads_a_second_request_after_a_status():
    h = Harness()
    recorder = Recorder()
    client = PreambleClient(NODE, preamble.TAG_CALL, f"127.0.0.1:{PORT}", recorder, h.clock,
                            early=callframes.encode_request("Health", 0, b""))
    h.frontend.openStream(client)
    h.flush()
    answer_unary(h, 0, b"first")
    recorder.transport.write(callframes.encode_request("Status", 0, b""))
    h.flush()
    assert [c["path"] for c in h.backend.calls] == ["/backend.Backend/Health",
                                                    "/backend.Backend/Status"]
    h.backend.calls[1]["future"].set_result(
        backend_pb2.StatusResponse().SerializeToString())
    h.flush()
    decoder = callframes.FrameDecoder({callframes.MESSAGE, callframes.STATUS})
    decoder.feed(b"".join(recorder.chunks))
    kinds = []
    while (frame := decoder.next_frame()) is not None:
        kinds.append(frame[0])
    assert kinds == [callframes.MESSAGE, callframes.STATUS] * 2
    assert recorder.reason is None  # still open: the worker waits for the next request


def test_a_request_while_a_call_runs_resets_the_stream():
    h = Harness()
    recorder = Recorder()
    client = PreambleClient(NODE, preamble.TAG_CALL, f"127.0.0.1:{PORT}", recorder, h.clock,
                            early=callframes.encode_request("Predict", 0, b""))
    h.frontend.openStream(client)
    h.flush()
    future = h.backend.calls[0]["future"]
    recorder.transport.write(callframes.encode_request("Health", 0, b""))
    h.flush()
    h.clock.advance(0)
    h.flush()
    assert recorder.reason is not None and future.cancelled() and len(h.backend.calls) == 1


def test_a_pooled_stream_whose_backend_went_away_is_the_workers_refusal():
    h = Harness()
    outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 0)
    h.calls.client = None  # the backend on the port stopped while the stream was idle
    result = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    h.clock.advance(0)
    h.flush()
    failure = result[0]
    assert failure.check(errors.StreamRefused), failure
    assert failure.value.code == preamble.UNAVAILABLE and "no backend process" in str(
        failure.value)
    assert len(h.backend.calls) == 1 and h.client.idle_streams == 0
    # a backend started on that port again: served on a new stream
    h.calls.client = h.backend
    again = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    answer_unary(h, 1)
    assert again[0].message == b"OK" and h.accepted == 2


def relay_frame_of(lasting):
    """The relay frame a ``WorkerDialer`` writes for a relayed stream (peer pool faked)."""
    from localai_tw.cluster.ownership import Ownership
    from localai_tw.tunnel.route import WorkerDialer

    clock = task.Clock()
    opened = []

    class Registry:
        def holds(self, node_id):
            return False

    class Fence:
        async def owner(self, node_id):
            return Ownership("replica-b", 1)

    class Pool:
        def open_stream(self, owner_id, client):
            opened.append(client)
            return defer.succeed(None)

    dialer = WorkerDialer(Registry(), Fence(), Pool(), "replica-a", reactor=clock)
    recorder = Recorder()
    dialer.open(NODE, preamble.TAG_CALL, f"127.0.0.1:{PORT}", recorder, deadline=5.0,
                lasting=lasting)
    [client] = opened
    payload, _ = preamble.split_frame(client._relay_frame)
    return preamble.parse_relay_request(payload)


def test_a_pooled_relayed_stream_states_no_budget_and_a_single_use_one_its_deadline():
    # The stream outlives its first call: a budget of that call's deadline would be wrong for
    # the next ones (each call's deadline is enforced by the frontend and the worker).
    assert relay_frame_of(lasting=True).budget_ms == 0
    assert relay_frame_of(lasting=False).budget_ms == 5000


def test_the_client_opens_its_streams_as_lasting():
    h = Harness()
    seen = []
    original = h.dialer.open

    def open_(*args, lasting=False, **kw):
        seen.append(lasting)
        return original(*args, lasting=lasting, **kw)

    h.dialer.open = open_
    outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    assert seen == [True]


def test_a_stream_paused_by_a_slow_consumer_is_resumed_before_its_reuse():
    # Two items and the status in one read: the status is decoded while the stream is paused
    # for the second item, so nothing in the item path resumes it; the pool must.
    item = callframes.encode_message(backend_pb2.Reply(message=b"i").SerializeToString())
    h, workers = scripted(item + item + callframes.encode_status(0))
    gates = []

    def on_item(reply):
        gates.append(defer.Deferred())
        return gates[-1]

    result = outcome(h.client.stream("PredictStream", backend_pb2.PredictOptions(), on_item))
    h.flush()
    gates[0].callback(None)
    h.flush()
    gates[1].callback(None)
    h.flush()
    assert result == [None] and h.client.idle_streams == 1
    again = outcome(h.client.call("Health", backend_pb2.HealthMessage()))
    h.flush()
    workers[0].transport.write(callframes.encode_message(
        backend_pb2.Reply(message=b"again").SerializeToString()) + callframes.encode_status(0))
    h.flush()
    assert again[0].message == b"again" and len(workers) == 1


def test_idle_streams_are_bounded_per_node_over_its_clients():
    # Every idle stream holds a stream of the worker's tunnel (limit shared by all replicas).
    h = Harness()
    shared: dict[str, int] = {}
    first, second = (TunnelBackendClient(h.dialer, NODE, PORT, h.clock, idle_by_node=shared,
                                         max_idle_per_node=1) for _ in range(2))
    for index, client in enumerate((first, second)):
        outcome(client.call("Health", backend_pb2.HealthMessage()))
        h.flush()
        answer_unary(h, index)
    h.clock.advance(0)
    h.flush()
    assert (first.idle_streams, second.idle_streams, shared) == (1, 0, {NODE: 1})
    assert h.worker.streamCount == 1  # the second stream was closed, both ways
    first.close()
    assert shared == {}
