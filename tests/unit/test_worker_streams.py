"""The worker's stream acceptor over an in-memory yamux pair with a ``task.Clock``: the pure
decisions (errno classification, targets, port range), the 15 s header timeout, every refusal
code, the hand-off of leftover bytes, and one failing stream leaving its neighbours alone."""

from __future__ import annotations

import errno

import pytest
from twisted.internet import defer, error
from twisted.python.failure import Failure

from localai_tw.config import PortRange
from localai_tw.mux.testing import HalfCloseRecorder, Recorder, connectedSessions
from localai_tw.tunnel import preamble
from localai_tw.worker import streams
from localai_tw.worker.control import ControlAuth, ControlVerbs, build_worker_site
from localai_tw.worker.streams import (
    BadTarget,
    StreamRouter,
    backend_port,
    classify_errno,
    classify_local_dial_error,
    port_of_target,
)

RANGE = PortRange(30000, 30009)


# -- pure decisions ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ECONNREFUSED", "EHOSTUNREACH", "ENETUNREACH", "ECONNRESET"])
def test_errnos_that_speak_about_the_target_are_unavailable(name):
    assert classify_errno(getattr(errno, name)) == preamble.UNAVAILABLE


@pytest.mark.parametrize("name", ["EMFILE", "ENFILE", "ENOBUFS", "ENOMEM", "EADDRNOTAVAIL",
                                  "EACCES", "EPERM", "ETIMEDOUT"])
def test_errnos_that_say_nothing_about_the_target_are_not_served(name):
    assert classify_errno(getattr(errno, name)) == preamble.NOT_SERVED


def test_an_unlisted_errno_is_not_classified_by_number():
    assert classify_errno(errno.EIO) is None
    assert classify_errno(None) is None


@pytest.mark.parametrize("exc, code", [
    (error.ConnectionRefusedError(errno.ECONNREFUSED, "refused"), preamble.UNAVAILABLE),
    (error.ConnectionRefusedError(), preamble.UNAVAILABLE),
    (error.NoRouteError(errno.ENETUNREACH, "no route"), preamble.UNAVAILABLE),
    (error.ConnectError(errno.EHOSTUNREACH, "host unreachable"), preamble.UNAVAILABLE),
    (error.ConnectionLost(), preamble.UNAVAILABLE),
    (error.ConnectError(errno.EMFILE, "too many open files"), preamble.NOT_SERVED),
    (error.ConnectError(errno.EADDRNOTAVAIL, "no address"), preamble.NOT_SERVED),
    (OSError(errno.ENOBUFS, "no buffers"), preamble.NOT_SERVED),
    (PermissionError(errno.EACCES, "denied"), preamble.NOT_SERVED),
    (error.TCPTimedOutError(errno.ETIMEDOUT, "timed out"), preamble.NOT_SERVED),
    (error.TimeoutError(), preamble.NOT_SERVED),
    (defer.TimeoutError(), preamble.NOT_SERVED),
    (defer.CancelledError(), preamble.NOT_SERVED),
    (TimeoutError(), preamble.NOT_SERVED),
])
def test_local_dial_errors_are_classified(exc, code):
    assert classify_local_dial_error(Failure(exc)) == code
    assert classify_local_dial_error(exc) == code


@pytest.mark.parametrize("exc", [
    error.ConnectError(errno.EIO, "i/o error"),
    error.ConnectError(),
    RuntimeError("something nobody foresaw"),
])
def test_an_unrecognised_dial_error_is_unavailable_deliberately(exc):
    # Deliberate (module docstring): a dead backend's row must stay reapable.
    assert classify_local_dial_error(exc) == preamble.UNAVAILABLE


@pytest.mark.parametrize("target, port", [
    ("127.0.0.1:30001", 30001),
    ("[::1]:30001", 30001),
    ("evil.example.com:30001", 30001),  # the host is thrown away, never resolved
    ("10.0.0.1:1", 1),
    (":65535", 65535),
])
def test_only_the_port_of_a_target_is_kept(target, port):
    assert port_of_target(target) == port


@pytest.mark.parametrize("target", [
    "30001", "", "host:", "host:0", "host:65536", "host:+1", "host:-1", "host: 1", "host:1 ",
    "host:0x10", "host:\uff11\uff12", "host:000030001", "[::1:30001", "::1]:30001",
])
def test_malformed_targets_are_bad_targets(target):
    with pytest.raises(BadTarget):
        port_of_target(target)


def test_the_port_must_be_inside_the_backend_range():
    assert backend_port("127.0.0.1:30000", RANGE) == 30000
    assert backend_port("127.0.0.1:30009", RANGE) == 30009
    for port in (29999, 30010, 22, 5432):
        with pytest.raises(BadTarget, match="outside the backend port range"):
            backend_port(f"127.0.0.1:{port}", RANGE)


# -- the acceptor over an in-memory session ---------------------------------------------------------


class FakeBackends:
    """``connect_backend`` for tests: records each connect and lets the test decide it."""

    def __init__(self):
        self.calls: list[tuple[int, object, defer.Deferred]] = []
        self.cancelled: list[int] = []

    def __call__(self, port, protocol):
        d = defer.Deferred(lambda _: self.cancelled.append(port))
        self.calls.append((port, protocol, d))
        return d


class FakeBackendTransport:
    """The backend side of a splice: keeps what was written to it."""

    def __init__(self):
        self.written = bytearray()
        self.closed = False
        self.producer = None

    def write(self, data):
        self.written += data

    def writeSequence(self, seq):
        self.write(b"".join(seq))

    def loseConnection(self):
        self.closed = True

    abortConnection = loseConnection

    def loseWriteConnection(self):
        self.closed = True

    def registerProducer(self, producer, streaming):
        self.producer = producer

    def unregisterProducer(self):
        self.producer = None

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass

    def getPeer(self):
        return None

    getHost = getPeer


def make_router(clock, backends=None, site=None):
    if site is None:
        site = build_worker_site(ControlVerbs(), ControlAuth(None), lambda: None)
    return StreamRouter(site, RANGE, clock, connect_backend=backends or FakeBackends())


def pair(router):
    worker, frontend, pump, clock = connectedSessions(client_acceptor=router.acceptor,
                                                      clock=router.reactor)
    return worker, frontend, pump


def reply_of(data: bytes):
    payload, rest = preamble.split_frame(data)
    assert payload is not None, f"no whole reply frame in {data!r}"
    return preamble.parse_reply(payload), rest


@pytest.fixture
def clock():
    from twisted.internet import task

    return task.Clock()


def test_a_frame_that_does_not_arrive_within_15s_is_not_served(clock):
    router = make_router(clock)
    worker, frontend, pump = pair(router)
    recorder = Recorder()
    frontend.openStream(recorder)
    pump.flush()
    clock.advance(streams.HEADER_TIMEOUT_SECONDS - 0.1)
    pump.flush()
    assert recorder.received == b""
    clock.advance(0.1)
    pump.flush()
    reply, rest = reply_of(recorder.received)
    assert reply.code == preamble.NOT_SERVED and not reply.is_evidence
    assert "15" in reply.text
    assert rest == b""
    assert recorder.reason is not None  # the worker closed the stream after refusing
    assert worker.isOpen


def test_a_partial_frame_still_times_out_as_not_served(clock):
    router = make_router(clock)
    worker, frontend, pump = pair(router)
    recorder = Recorder()
    frontend.openStream(recorder, preamble.encode_request("grpc", "127.0.0.1:30001")[:5])
    pump.flush()
    clock.advance(streams.HEADER_TIMEOUT_SECONDS)
    pump.flush()
    assert reply_of(recorder.received)[0].code == preamble.NOT_SERVED


def test_a_frame_in_time_cancels_the_header_timer(clock):
    backends = FakeBackends()
    router = make_router(clock, backends)
    worker, frontend, pump = pair(router)
    recorder = Recorder()
    frontend.openStream(recorder, preamble.encode_request("grpc", "127.0.0.1:30001"))
    pump.flush()
    assert len(backends.calls) == 1
    clock.advance(60)
    pump.flush()
    assert recorder.received == b""  # still connecting: no timeout reply


@pytest.mark.parametrize("frame", [
    preamble.encode_frame(b"nospace"),
    preamble.encode_frame(b" leading-space"),
    preamble.encode_frame(b"grpc \x01\x02"),
    b"\x04\x01" + b"x" * 10,  # announces 1025 bytes: over the limit
])
def test_a_malformed_frame_is_a_bad_request(clock, frame):
    router = make_router(clock)
    worker, frontend, pump = pair(router)
    recorder = Recorder()
    frontend.openStream(recorder, frame)
    pump.flush()
    reply, _ = reply_of(recorder.received)
    assert reply.code == preamble.BAD_REQUEST and reply.is_evidence
    assert worker.isOpen


def test_an_unknown_tag_is_unknown_tag(clock):
    router = make_router(clock)
    worker, frontend, pump = pair(router)
    recorder = Recorder()
    frontend.openStream(recorder, preamble.encode_request("ssh", "127.0.0.1:22"))
    pump.flush()
    reply, _ = reply_of(recorder.received)
    assert reply.code == preamble.UNKNOWN_TAG
    assert "ssh" in reply.text


@pytest.mark.parametrize("target", ["127.0.0.1:22", "127.0.0.1:30010", "127.0.0.1", "x:y"])
def test_a_grpc_target_outside_the_range_is_a_bad_request_and_never_dialled(clock, target):
    backends = FakeBackends()
    router = make_router(clock, backends)
    worker, frontend, pump = pair(router)
    recorder = Recorder()
    frontend.openStream(recorder, preamble.encode_request("grpc", target))
    pump.flush()
    assert reply_of(recorder.received)[0].code == preamble.BAD_REQUEST
    assert backends.calls == []


def test_grpc_connects_loopback_port_only_and_sends_leftover_bytes_first(clock):
    backends = FakeBackends()
    router = make_router(clock, backends)
    worker, frontend, pump = pair(router)
    recorder = Recorder()
    frontend.openStream(
        recorder, preamble.encode_request("grpc", "backend.example:30003") + b"PRI * HTTP/2")
    pump.flush()
    [(port, backend_protocol, connecting)] = backends.calls
    assert port == 30003
    assert recorder.received == b""  # no reply before the backend is there
    backend = FakeBackendTransport()
    backend_protocol.makeConnection(backend)
    connecting.callback(backend_protocol)
    pump.flush()
    reply, rest = reply_of(recorder.received)
    assert reply.accepted and rest == b""
    assert bytes(backend.written) == b"PRI * HTTP/2"
    # Both directions flow through the splice from now on.
    recorder.transport.write(b" more")
    backend_protocol.dataReceived(b"from-backend")
    pump.flush()
    assert bytes(backend.written) == b"PRI * HTTP/2 more"
    assert recorder.received.endswith(b"from-backend")


def test_an_eof_right_after_the_frame_reaches_the_backend_after_the_data(clock):
    backends = FakeBackends()
    router = make_router(clock, backends)
    worker, frontend, pump = pair(router)
    recorder = HalfCloseRecorder()
    stream = frontend.openStream(recorder, preamble.encode_request("grpc", "h:30001") + b"req")
    stream.loseWriteConnection()
    pump.flush()
    [(port, backend_protocol, connecting)] = backends.calls
    backend = FakeBackendTransport()
    backend_protocol.makeConnection(backend)
    connecting.callback(backend_protocol)
    pump.flush()
    assert reply_of(recorder.received)[0].accepted
    assert bytes(backend.written) == b"req"
    assert backend.closed  # the half-close was passed on


@pytest.mark.parametrize("exc, code", [
    (error.ConnectionRefusedError(errno.ECONNREFUSED, "refused"), preamble.UNAVAILABLE),
    (error.ConnectError(errno.EMFILE, "too many open files"), preamble.NOT_SERVED),
    (error.TimeoutError(), preamble.NOT_SERVED),
    (RuntimeError("strange"), preamble.UNAVAILABLE),
])
def test_a_failed_backend_connect_is_refused_with_its_class(clock, exc, code):
    backends = FakeBackends()
    router = make_router(clock, backends)
    worker, frontend, pump = pair(router)
    recorder = Recorder()
    frontend.openStream(recorder, preamble.encode_request("grpc", "127.0.0.1:30001"))
    pump.flush()
    backends.calls[0][2].errback(exc)
    pump.flush()
    reply, _ = reply_of(recorder.received)
    assert reply.code == code
    assert "127.0.0.1:30001" in reply.text
    assert worker.isOpen


def test_a_stream_that_ends_while_connecting_cancels_the_connect(clock):
    backends = FakeBackends()
    router = make_router(clock, backends)
    worker, frontend, pump = pair(router)
    stream = frontend.openStream(Recorder(), preamble.encode_request("grpc", "h:30001"))
    pump.flush()
    stream.abortConnection()
    pump.flush()
    assert backends.cancelled == [30001]


def test_http_is_accepted_and_served_by_the_control_site(clock):
    router = make_router(clock)
    worker, frontend, pump = pair(router)
    recorder = Recorder()
    frontend.openStream(
        recorder,
        preamble.encode_request("http", "")
        + b"GET /healthz HTTP/1.1\r\nHost: worker.invalid\r\nConnection: close\r\n\r\n")
    pump.flush()
    reply, rest = reply_of(recorder.received)
    assert reply.accepted
    assert rest.startswith(b"HTTP/1.1 200 ")
    assert b'"alive": true' in rest


def test_one_failing_stream_is_reset_and_the_session_serves_the_next(clock):
    calls = []

    def connect_backend(port, protocol):
        calls.append(port)
        if port == 30001:
            raise RuntimeError("a bug in one stream")
        return defer.Deferred()

    router = make_router(clock, connect_backend)
    worker, frontend, pump = pair(router)
    broken = Recorder()
    frontend.openStream(broken, preamble.encode_request("grpc", "h:30001"))
    pump.flush()
    assert broken.reason is not None and "reset" in str(broken.reason.value).lower()
    assert worker.isOpen and frontend.isOpen
    fine = Recorder()
    frontend.openStream(fine, preamble.encode_request("ssh", "x"))
    pump.flush()
    assert reply_of(fine.received)[0].code == preamble.UNKNOWN_TAG
    assert calls == [30001]


def test_the_acceptor_gives_every_stream_its_own_protocol(clock):
    router = make_router(clock)
    first, second = router(object()), router.acceptor(object())
    assert first is not second


def test_many_refused_streams_make_a_few_lines_and_one_summary(clock):
    """A frontend opening stream after stream this worker refuses (here: an unknown tag) gets a
    few log lines and one summary with the true count, not a line per stream."""
    from twisted.logger import formatEvent, globalLogPublisher

    router = make_router(clock)
    worker, frontend, pump = pair(router)
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        for _ in range(300):
            recorder = Recorder()
            frontend.openStream(recorder, preamble.encode_request("ssh", "127.0.0.1:22"))
            pump.flush()
            assert reply_of(recorder.received)[0].code == preamble.UNKNOWN_TAG
        clock.advance(router.refusals.window)
    finally:
        globalLogPublisher.removeObserver(events.append)
    lines = [formatEvent(e) for e in events if "tunnel stream" in formatEvent(e)]
    assert len(lines) == router.refusals.burst + 1, lines
    assert lines[-1].startswith(f"refused 300 tunnel streams with {preamble.UNKNOWN_TAG} ")
