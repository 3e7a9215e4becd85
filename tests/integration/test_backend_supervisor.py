"""BackendSupervisor with real backend processes: the echo backend over real gRPC, and
misbehaving programs (tests/fixtures/backends/misbehaving.py).  Every process started here is
stopped and its group killed by the fixture's finalizer."""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import pytest
import pytest_twisted
from twisted.internet import defer, reactor
from zope.interface import implementer

from localai_tw.backends import backend_pb2, backend_pb2_grpc, builtin
from localai_tw.backends.interfaces import BackendFactories, IBackendFactory
from localai_tw.backends.ports import PortAllocator
from localai_tw.backends.process import BackendSupervisor
from localai_tw.backends.record import (
    BackendLoadFailed,
    BackendStartError,
    CRASHED,
    FAILED,
    READY,
    STOPPED,
    STOPPING,
)

from .support import backend_channel, eventually

MISBEHAVING = os.path.join(os.path.dirname(__file__), "..", "fixtures", "backends",
                           "misbehaving.py")


@implementer(IBackendFactory)
class MisbehavingFactory:
    description = "test program"

    def __init__(self, name, mode, *extra):
        self.name, self.mode, self.extra = name, mode, list(extra)

    def unavailable_reason(self):
        return None

    def command(self, address, options):
        return [sys.executable, os.path.abspath(MISBEHAVING), "--mode", self.mode,
                *self.extra, "--addr", address]

    def environment(self, options):
        return {"PYTHONPATH": builtin.PACKAGE_ROOT}

    def servicer(self, options):
        raise NotImplementedError


def process_gone(pid: int) -> bool:
    """True when ``pid`` does not exist or is a zombie nobody reaped yet (no init here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def child_pidfile(tmp_path):
    return str(tmp_path / "child.pid")


@pytest.fixture
def make_supervisor(child_pidfile):
    made: list[BackendSupervisor] = []
    pids: list[int] = []

    def make(**kwargs):
        first = random.randrange(31000, 32500, 50)
        ports = PortAllocator(first, first + 49)
        factories = BackendFactories([
            builtin.echo_backend,
            MisbehavingFactory("exit-at-once", "exit-at-once"),
            MisbehavingFactory("ignore-sigterm", "ignore-sigterm"),
            MisbehavingFactory("never-ready", "never-ready"),
            MisbehavingFactory("spawn-child", "spawn-child", "--child-pidfile",
                               child_pidfile),
        ])
        kwargs.setdefault("stop_grace", 3.0)
        kwargs.setdefault("ready_timeout", 20.0)
        supervisor = BackendSupervisor(reactor, ports, factories, **kwargs)
        supervisor.add_exit_listener(lambda r: pids.append(r.pid) if r.pid else None)
        made.append(supervisor)
        return supervisor

    yield make
    for supervisor in made:
        for record in list(supervisor._live.values()):
            if record.pid:
                pids.append(record.pid)
        pytest_twisted.blockon(supervisor.stop_all(force=True))
    for pid in pids:  # belt and braces: nothing this test started may survive it
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if os.path.exists(child_pidfile):
        try:
            os.kill(int(open(child_pidfile).read()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def stub_for(record):
    """A channel and stub to ``record``'s backend, presenting its own gRPC token."""
    channel = backend_channel(record)
    return channel, backend_pb2_grpc.BackendStub(channel)


@pytest_twisted.ensureDeferred
async def test_echo_start_ready_predict_stop(make_supervisor):
    exits = []
    supervisor = make_supervisor()
    supervisor.add_exit_listener(exits.append)
    record = await supervisor.start("echo", "tiny", {},
                                    load={"Model": "tiny", "Options": ["echo.dim:4"]})
    assert record.state == READY
    assert record.address == f"127.0.0.1:{record.port}"
    assert os.getpgid(record.pid) == record.pid  # its own process group
    assert os.getppid() != record.pid
    assert supervisor.ports.holder(record.port) == "tiny#0"

    channel, stub = stub_for(record)
    try:
        from twisted.internet.threads import deferToThread

        reply = await deferToThread(stub.Predict, backend_pb2.PredictOptions(
            Prompt="hello twisted world", ModelIdentity="tiny"), timeout=10)
        assert reply.message == b"hello twisted world" and reply.tokens == 3
        pieces = await deferToThread(lambda: [r.message for r in stub.PredictStream(
            backend_pb2.PredictOptions(Prompt="a b c"), timeout=10)])
        assert pieces == [b"a ", b"b ", b"c"]
        emb = await deferToThread(stub.Embedding, backend_pb2.PredictOptions(Embeddings="x"),
                                  timeout=10)
        assert emb.dim == 4 and len(emb.embeddings) == 4
    finally:
        channel.close()

    assert supervisor.list() == [record.describe()]
    assert supervisor.running_backends() == [
        {"model_id": "tiny", "address": record.address, "backend": "echo"}]
    assert any("Server started" in line for line in supervisor.logs("tiny"))

    stopped = await supervisor.stop("tiny")
    assert stopped.state == STOPPED and stopped.exit_code == 0
    assert process_gone(record.pid)
    assert exits == [record]
    assert record.port in supervisor.ports.quarantined()
    # Free was sent before SIGTERM: the echo backend logged nothing about it, but the
    # supervisor's notes show the order.
    notes = [l for l in supervisor.logs("tiny") if l.startswith("[localai-tw]")]
    assert any("SIGTERM" in n for n in notes)
    assert supervisor.list() == []
    assert supervisor.list(include_ended=True)[0]["state"] == STOPPED


@pytest_twisted.ensureDeferred
async def test_a_child_of_the_backend_is_gone_after_stop(make_supervisor, child_pidfile):
    supervisor = make_supervisor()
    record = await supervisor.start("spawn-child", "kids")
    await eventually(lambda: os.path.exists(child_pidfile)
                     and open(child_pidfile).read().strip())
    child = int(open(child_pidfile).read())
    assert os.getpgid(child) == record.pid  # the child shares the backend's group
    await supervisor.stop("kids")
    # The child ignores SIGTERM; the sweep after the backend exited kills it.
    await eventually(lambda: process_gone(child), timeout=5)


@pytest_twisted.ensureDeferred
async def test_a_backend_that_exits_at_once_is_reported_crashed_with_output(make_supervisor):
    exits = []
    supervisor = make_supervisor()
    supervisor.add_exit_listener(exits.append)
    with pytest.raises(BackendStartError) as e:
        await supervisor.start("exit-at-once", "doomed")
    text = str(e.value)
    assert "exited with code 3 before it was ready" in text
    assert "cannot open model weights" in text
    record = e.value.record
    assert record.state == CRASHED and record.exit_code == 3
    assert exits == [record]
    lines = supervisor.logs("doomed")
    assert "booting misbehaving backend" in lines
    assert "fatal: cannot open model weights (on purpose)" in lines
    assert supervisor.list() == []
    assert supervisor.ports.held() == {}


@pytest_twisted.ensureDeferred
async def test_a_backend_that_ignores_sigterm_is_killed_after_the_grace(make_supervisor):
    supervisor = make_supervisor(stop_grace=0.5)
    record = await supervisor.start("ignore-sigterm", "stubborn")
    began = time.monotonic()
    stopped = await supervisor.stop("stubborn", force=True)
    took = time.monotonic() - began
    assert stopped.state == STOPPED
    assert stopped.exit_signal == signal.SIGKILL
    assert 0.5 <= took < 5
    assert any("SIGKILL" in line for line in supervisor.logs("stubborn"))
    assert process_gone(record.pid)


@pytest_twisted.ensureDeferred
async def test_a_start_while_the_same_backend_stops_waits_and_starts_a_fresh_one(
        make_supervisor):
    """An eviction's stop still running when the model is asked for again (seen under load:
    the load failed with "is stopping"): the start waits for the old process, then starts a
    new one."""
    supervisor = make_supervisor(stop_grace=0.5)
    old = await supervisor.start("ignore-sigterm", "again")
    stopping = supervisor.stop("again", force=True)  # ignores SIGTERM: ends after the grace
    assert supervisor.find("again").state == STOPPING
    new = await supervisor.start("ignore-sigterm", "again")
    assert (await stopping).state == STOPPED and process_gone(old.pid)
    assert new is not old and new.state == READY and new.pid != old.pid


@pytest_twisted.ensureDeferred
async def test_load_failure_surfaces_with_the_backends_message(make_supervisor):
    exits = []
    supervisor = make_supervisor()
    supervisor.add_exit_listener(exits.append)
    with pytest.raises(BackendLoadFailed) as e:
        await supervisor.start("echo", "broken", load={
            "Model": "broken", "Options": ["echo.fail_load:weights are corrupt"]})
    assert "LoadModel of broken#0 failed: weights are corrupt" in str(e.value)
    record = e.value.record
    await eventually(lambda: record.ended)
    assert record.state == FAILED
    assert process_gone(record.pid)
    assert [r.state for r in exits] == [FAILED]


@pytest_twisted.ensureDeferred
async def test_never_ready_fails_with_grpc_service_not_ready(make_supervisor):
    supervisor = make_supervisor(ready_timeout=3.0)
    with pytest.raises(BackendStartError, match="grpc service not ready"):
        await supervisor.start("never-ready", "slowpoke")
    record = supervisor.find("slowpoke")
    await eventually(lambda: record.ended)
    assert record.state == FAILED
    assert "pretending to import torch forever" in supervisor.logs("slowpoke")


@pytest_twisted.ensureDeferred
async def test_a_crash_after_ready_is_noticed_and_reported(make_supervisor):
    exits = []
    supervisor = make_supervisor()
    supervisor.add_exit_listener(exits.append)
    record = await supervisor.start("echo", "victim")
    os.kill(record.pid, signal.SIGKILL)
    await eventually(lambda: bool(exits))
    assert exits[0] is record
    assert record.state == CRASHED and record.exit_signal == signal.SIGKILL
    assert "killed by signal SIGKILL" in record.error
    assert supervisor.find("victim") is record
    assert record.port in supervisor.ports.quarantined()


@pytest_twisted.ensureDeferred
async def test_slow_health_during_predict_is_not_death(make_supervisor):
    """One server thread, a 2 s Predict, probes every 0.2 s with a 0.3 s timeout: the probes
    miss, the backend stays up and serves."""
    supervisor = make_supervisor(liveness_interval=0.2, liveness_timeout=0.3)
    record = await supervisor.start("echo", "busy", {"env": {"PYTHON_GRPC_MAX_WORKERS": "1"}},
                                    load={"Model": "busy", "Options": ["echo.delay_ms:1000"]})
    channel, stub = stub_for(record)
    try:
        from twisted.internet.threads import deferToThread

        predicting = deferToThread(stub.Predict, backend_pb2.PredictOptions(Prompt="x y"),
                                   timeout=10)
        # The probes time out while the only server thread runs the Predict ...
        await eventually(lambda: record.health_misses >= 2, timeout=3)
        assert record.state == READY and not record.ended
        reply = await predicting
        assert reply.message == b"x y"
    finally:
        channel.close()
    # ... and nobody killed the backend for it; the next probe answers again.
    assert record.state == READY and not record.ended
    await eventually(lambda: record.health_misses == 0, timeout=3)


@pytest_twisted.ensureDeferred
async def test_concurrent_starts_share_one_process_and_a_different_backend_is_refused(
        make_supervisor):
    supervisor = make_supervisor()
    first, second = supervisor.start("echo", "shared"), supervisor.start("echo", "shared")
    a, b = await defer.gatherResults([first, second])
    assert a is b
    with pytest.raises(BackendStartError, match="already runs backend echo"):
        await supervisor.start("exit-at-once", "shared")
    assert len(supervisor.list()) == 1


@pytest_twisted.ensureDeferred
async def test_stop_during_start_stops_the_process(make_supervisor):
    supervisor = make_supervisor()
    starting = supervisor.start("never-ready", "cancelled")
    await eventually(lambda: supervisor.find("cancelled").pid is not None)
    record = supervisor.find("cancelled")
    stopped = await supervisor.stop("cancelled")
    assert stopped.state == STOPPED
    with pytest.raises(BackendStartError, match="stopped while starting"):
        await starting
    assert process_gone(record.pid)


@pytest_twisted.ensureDeferred
async def test_unknown_and_unavailable_backends_fail_without_a_process(make_supervisor):
    supervisor = make_supervisor()
    with pytest.raises(BackendStartError, match="unknown backend 'nope'"):
        await supervisor.start("nope", "m")
    assert supervisor.ports.held() == {}
    assert supervisor.find("m").state == FAILED


@implementer(IBackendFactory)
class InProcessEchoFactory:
    name = "in-process-echo"
    description = "echo served by the worker itself"

    def unavailable_reason(self):
        return None

    def command(self, address, options):
        return None

    def environment(self, options):
        return {}

    def servicer(self, options):
        from localai_tw.backends.builtin.echo import EchoServicer

        return EchoServicer()


@pytest_twisted.ensureDeferred
async def test_an_in_process_servicer_is_served_and_stopped(make_supervisor):
    supervisor = make_supervisor()
    supervisor.factories.add(InProcessEchoFactory())
    record = await supervisor.start("in-process-echo", "inproc", load={"Model": "inproc"})
    assert record.state == READY and record.pid is None and record.in_process
    channel, stub = stub_for(record)
    try:
        from twisted.internet.threads import deferToThread

        reply = await deferToThread(stub.Predict, backend_pb2.PredictOptions(Prompt="hi"),
                                    timeout=10)
        assert reply.message == b"hi"
    finally:
        channel.close()
    stopped = await supervisor.stop("inproc")
    assert stopped.state == STOPPED
    assert record.port in supervisor.ports.quarantined()
