"""Supervisor pieces without processes: the bounded output ring, signal-group safety, and the
stop sequence (Free, SIGTERM, SIGKILL after the grace) on a MemoryReactorClock with a fake
process transport."""

from __future__ import annotations

import os
import signal

import pytest
from twisted.internet import defer
from twisted.internet.error import ProcessTerminated
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure

from localai_tw.backends import process
from localai_tw.backends import record as record_module
from localai_tw.backends.ports import PortAllocator
from localai_tw.backends.process import BackendSupervisor
from localai_tw.backends.record import BackendProcess, BackendStopError, OutputRing, STOPPED


def test_ring_keeps_complete_lines_from_both_streams():
    ring = OutputRing()
    ring.feed("stdout", b"one\ntw")
    ring.feed("stderr", b"err\r\n")
    ring.feed("stdout", b"o\n")
    ring.note("hello")
    assert ring.lines() == ["one", "err", "two", "[localai-tw] hello"]
    ring.feed("stdout", b"partial")
    ring.flush()
    assert ring.lines(2) == ["[localai-tw] hello", "partial"]
    assert ring.lines(0) == []


def test_ring_is_bounded_in_lines_and_bytes():
    ring = OutputRing(max_bytes=100, max_lines=5)
    for i in range(20):
        ring.feed("stdout", f"line {i}\n".encode())
    assert ring.lines() == [f"line {i}" for i in range(15, 20)]
    assert ring.dropped_lines == 15
    ring = OutputRing(max_bytes=50, max_lines=1000)
    ring.feed("stdout", b"x" * 30 + b"\n" + b"y" * 30 + b"\n")
    assert ring.lines() == ["y" * 30]


def test_ring_cuts_endless_lines_and_replaces_bad_utf8():
    ring = OutputRing(max_line_bytes=10)
    ring.feed("stderr", b"a" * 25)
    assert ring.lines() == ["a" * 10, "a" * 10]
    ring.feed("stderr", b"\n\xff\xfeok\n")
    assert ring.lines()[-2:] == ["aaaaa", "\ufffd\ufffdok"]


def test_never_signals_its_own_group(monkeypatch):
    sent = []
    monkeypatch.setattr(os, "killpg", lambda pid, sig: sent.append((pid, sig)))
    record = BackendProcess("m#0", "m", "echo", OutputRing())
    record.pid = os.getpgrp()
    record_module.signal_group(record, signal.SIGKILL, fall_back_to_pid=True)
    record.pid = 1
    record_module.signal_group(record, signal.SIGKILL, fall_back_to_pid=True)
    assert sent == []


class FakeTransport:
    def __init__(self, pid):
        self.pid = pid
        self.signals = []

    def signalProcess(self, sig):
        self.signals.append(sig)


class FakeClient:
    def __init__(self, free_result=None):
        self.calls = []
        self.free = defer.Deferred()

    def call(self, method, request, timeout):
        self.calls.append((method, timeout))
        return self.free

    def close(self):
        self.calls.append(("close", None))


@pytest.fixture
def ready_record(monkeypatch):
    """A supervisor on a MemoryReactorClock holding one 'ready' fake process."""
    sent = []
    monkeypatch.setattr(os, "killpg", lambda pid, sig: sent.append((pid, sig)))
    reactor = MemoryReactorClock()
    ports = PortAllocator(40000, 40001, clock=reactor, bind_probe=lambda h, p: None,
                          ephemeral_range_file="/nonexistent")
    supervisor = BackendSupervisor(reactor, ports, factories=None, stop_grace=10.0,
                                   kill_wait=5.0, free_timeout=5.0, liveness_interval=None)
    record = BackendProcess("m#0", "m", "echo", OutputRing())
    record.state = record_module.READY
    record.port = ports.allocate(record.key)
    record.address = f"127.0.0.1:{record.port}"
    record.pid = 4242424
    record._transport = FakeTransport(record.pid)
    record._client = FakeClient()
    supervisor._live[record.key] = record
    return supervisor, record, reactor, sent


def test_stop_frees_then_terms_the_group_then_kills_after_the_grace(ready_record):
    supervisor, record, reactor, sent = ready_record
    done = supervisor.stop("m")
    assert record._client.calls == [("Free", 5.0)]
    assert sent == []  # nothing is signalled before Free answers (or times out)
    record._client.free.callback(None)
    assert sent == [(record.pid, signal.SIGTERM)]
    reactor.advance(9.9)
    assert sent == [(record.pid, signal.SIGTERM)]
    reactor.advance(0.1)
    assert sent[-1] == (record.pid, signal.SIGKILL)
    assert not done.called
    supervisor._processEnded(record, None, signal.SIGKILL)
    assert done.result is record
    assert record.state == STOPPED
    assert supervisor.ports.quarantined()[record.port][1] == "released"
    # The sweep after the exit: one more SIGKILL to the (now empty) group.
    assert sent[-1] == (record.pid, signal.SIGKILL)


def test_a_failed_free_does_not_prevent_the_stop(ready_record):
    supervisor, record, reactor, sent = ready_record
    done = supervisor.stop("m")
    record._client.free.errback(RuntimeError("connection reset"))
    assert sent == [(record.pid, signal.SIGTERM)]
    supervisor._processEnded(record, 0, None)
    assert done.result.state == STOPPED
    assert any("Free failed" in line for line in record.output.lines())


def test_force_skips_free_and_two_stops_share_one(ready_record):
    supervisor, record, reactor, sent = ready_record
    first = supervisor.stop("m", force=True)
    second = supervisor.stop("m#0")
    assert record._client.calls == []
    assert sent == [(record.pid, signal.SIGTERM)]
    supervisor._processEnded(record, 0, None)
    assert first.result is record and second.result is record


def test_a_process_that_survives_sigkill_is_an_error(ready_record):
    supervisor, record, reactor, sent = ready_record
    done = supervisor.stop("m", force=True)
    reactor.advance(15)
    assert isinstance(done.result, Failure)
    assert done.result.check(BackendStopError)
    assert "did not exit 5s after SIGKILL" in str(done.result.value)
    done.addErrback(lambda f: None)


def test_process_terminated_is_translated():
    record = BackendProcess("m#0", "m", "echo", OutputRing())
    seen = []

    class Sup:
        def _processEnded(self, r, code, sig):
            seen.append((code, sig))

    proto = record_module.BackendProcessProtocol(Sup(), record)
    proto.childDataReceived(2, b"bye\n")
    proto.processEnded(Failure(ProcessTerminated(exitCode=None, signal=9)))
    assert seen == [(None, 9)]
    assert record.output.lines() == ["bye"]
