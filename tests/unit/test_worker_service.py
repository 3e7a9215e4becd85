"""The worker's service tree on a ``MemoryReactorClock`` with a fake registration client:
registration retried 2 s doubling to 30 s (never a start failure), the 10 s heartbeat that
never stops and re-registers on 404, single-flight re-registration, readiness, and that the
worker opens no listening socket."""

from __future__ import annotations

import pytest
from twisted.internet import defer
from twisted.internet.testing import MemoryReactorClock

from localai_tw.config import PortRange
from localai_tw.worker.registration import (
    FrontendUnavailable,
    NodeUnknown,
    Registration,
    RegistrationRejected,
)
from localai_tw.worker.service import (
    NodeRegistrar,
    WorkerService,
    makeWorkerService,
    registration_retry_delay,
)


class FakeRegistrationClient:
    """Answers register/heartbeat with Deferreds the test fires."""

    node_name = "worker-a"
    base_url = "http://frontend.example:8080"

    def __init__(self):
        self.registers: list[defer.Deferred] = []
        self.heartbeats: list[tuple[str, defer.Deferred]] = []
        self.closed = False

    def register(self):
        d = defer.Deferred()
        self.registers.append(d)
        return d

    capacity = {"total_ram": 8 << 30, "available_ram": 4 << 30}

    def current_capacity(self):
        return dict(self.capacity)

    def heartbeat(self, node_id, tunnel_token="", capacity=None):
        d = defer.Deferred()
        self.heartbeats.append((node_id, d))
        return d

    def close(self):
        self.closed = True
        return defer.succeed(None)


def unavailable():
    return FrontendUnavailable(None, "registration: cannot reach the frontend", "retrying")


@pytest.fixture
def reactor():
    return MemoryReactorClock()


@pytest.fixture
def client():
    return FakeRegistrationClient()


def test_the_retry_schedule_doubles_from_2s_to_30s():
    assert [registration_retry_delay(n) for n in range(1, 8)] == [2, 4, 8, 16, 30, 30, 30]
    assert registration_retry_delay(10**9) == 30


def test_registration_is_retried_until_it_works_and_start_never_fails(reactor, client):
    registered = []
    registrar = NodeRegistrar(reactor, client, on_registered=registered.append)
    registrar.startService()  # the frontend is down: this must not raise
    waits = []
    for _ in range(6):
        client.registers[-1].errback(unavailable())
        [call] = reactor.getDelayedCalls()
        waits.append(call.getTime() - reactor.seconds())
        reactor.advance(waits[-1])
    assert waits == [2, 4, 8, 16, 30, 30]
    client.registers[-1].callback(Registration("node-1", "healthy", "cred"))
    assert registered == [Registration("node-1", "healthy", "cred")]
    assert registrar.credentials() == ("node-1", "cred")
    registrar.stopService()


def test_a_rejected_registration_is_retried_too(reactor, client):
    registrar = NodeRegistrar(reactor, client)
    registrar.startService()
    client.registers[-1].errback(RegistrationRejected(401, "registration refused", "check"))
    reactor.advance(2)
    assert len(client.registers) == 2
    registrar.stopService()


def test_heartbeats_every_10s_and_keep_going_through_failures(reactor, client):
    registrar = NodeRegistrar(reactor, client)
    registrar.startService()
    client.registers[-1].callback(Registration("node-1", "healthy", "cred"))
    assert client.heartbeats == []
    reactor.advance(10)
    assert [node for node, _ in client.heartbeats] == ["node-1"]
    client.heartbeats[-1][1].errback(unavailable())
    reactor.advance(10)
    client.heartbeats[-1][1].errback(RegistrationRejected(401, "heartbeat refused"))
    reactor.advance(10)
    client.heartbeats[-1][1].callback("healthy")
    reactor.advance(10)
    assert len(client.heartbeats) == 4
    assert registrar.heartbeat_failures == 0 and registrar.last_heartbeat_status == "healthy"
    registrar.stopService()


def test_while_the_tunnel_carries_liveness_heartbeats_carry_only_capacity(reactor, client):
    """The tunnel's replica stamps the node's liveness: a tick beats only when the capacity
    changed, the last beat failed, or 60 s passed; without it, every 10 s again."""
    tunnel = {"liveness": True}
    registrar = NodeRegistrar(reactor, client, tunnel_liveness=lambda: tunnel["liveness"])
    registrar.startService()
    client.registers[-1].callback(Registration("node-1", "healthy", "cred"))
    reactor.advance(10)  # the first beat goes whatever the tunnel does
    assert len(client.heartbeats) == 1
    client.heartbeats[-1][1].callback("healthy")
    for _ in range(5):  # 5 ticks, nothing changed, the refresh not due
        reactor.advance(10)
    assert len(client.heartbeats) == 1 and registrar.heartbeats_skipped == 5
    reactor.advance(10)  # 60 s since the last answered beat: the slow refresh
    assert len(client.heartbeats) == 2
    client.heartbeats[-1][1].callback("healthy")

    client.capacity = {**client.capacity, "available_ram": 1 << 30}  # a model was loaded
    reactor.advance(10)
    assert len(client.heartbeats) == 3
    client.heartbeats[-1][1].errback(unavailable())
    reactor.advance(10)  # the change was not delivered: beat again
    assert len(client.heartbeats) == 4
    client.heartbeats[-1][1].callback("healthy")
    reactor.advance(10)
    assert len(client.heartbeats) == 4

    tunnel["liveness"] = False  # the tunnel went away (or its replica does not stamp)
    for expected in (5, 6, 7):
        reactor.advance(10)
        assert len(client.heartbeats) == expected
        client.heartbeats[-1][1].callback("healthy")
    registrar.stopService()


def test_stamp_notices_put_the_refresh_off_and_their_absence_brings_it_back(reactor, client):
    """A notice from the tunnel's replica (it stamped this node) counts as an answered beat:
    with one every 50 s no HTTP heartbeat leaves at idle; once they stop, the 60 s refresh
    follows the last one; a notice never silences the 10 s beat without tunnel liveness."""
    tunnel = {"liveness": True}
    registrar = NodeRegistrar(reactor, client, tunnel_liveness=lambda: tunnel["liveness"])
    registrar.startService()
    client.registers[-1].callback(Registration("node-1", "healthy", "cred"))
    reactor.advance(10)
    client.heartbeats[-1][1].callback("healthy")  # t=10: the first beat, answered
    for second in range(11, 611):  # ten minutes, a notice every 50 s
        reactor.advance(1)
        if second % 50 == 0:
            registrar.note_stamped("healthy")
    assert len(client.heartbeats) == 1 and registrar.stamp_notices == 12
    # The notices stop (the replica's stamps fail): the last came at t=600, it is t=610.
    reactor.advance(40)
    assert len(client.heartbeats) == 1
    reactor.advance(10)  # t=660: 60 s since the last notice
    assert len(client.heartbeats) == 2
    client.heartbeats[-1][1].callback("healthy")

    registrar.note_stamped("draining")  # the status a notice carries is the node's
    assert registrar.last_heartbeat_status == "draining"
    tunnel["liveness"] = False
    reactor.advance(10)
    registrar.note_stamped("draining")
    assert len(client.heartbeats) == 3
    registrar.stopService()


def test_small_drifts_of_free_memory_are_not_a_capacity_change():
    from localai_tw.worker.capacity import capacity_changed

    sent = {"total_ram": 64 << 30, "available_ram": 32 << 30, "total_disk": 1 << 40,
            "available_disk": 1 << 39}
    assert not capacity_changed(sent, {**sent, "available_ram": (32 << 30) - (100 << 20)})
    assert capacity_changed(sent, {**sent, "available_ram": 30 << 30})  # > 2 % of 64 GiB
    assert capacity_changed(sent, {**sent, "total_ram": 32 << 30})
    assert capacity_changed(sent, {k: v for k, v in sent.items() if k != "total_disk"})
    assert capacity_changed(None, sent)


def test_a_slow_heartbeat_is_not_stacked(reactor, client):
    registrar = NodeRegistrar(reactor, client)
    registrar.startService()
    client.registers[-1].callback(Registration("node-1", "healthy", "cred"))
    reactor.advance(10)
    reactor.advance(10)
    reactor.advance(10)
    assert len(client.heartbeats) == 1
    registrar.stopService()


def test_heartbeat_404_registers_again_and_heartbeats_the_new_id(reactor, client):
    registered = []
    registrar = NodeRegistrar(reactor, client, on_registered=registered.append)
    registrar.startService()
    client.registers[-1].callback(Registration("node-1", "healthy", "cred-1"))
    reactor.advance(10)
    client.heartbeats[-1][1].errback(NodeUnknown("node-1"))
    assert len(client.registers) == 2
    client.registers[-1].errback(unavailable())
    reactor.advance(2)
    client.registers[-1].callback(Registration("node-2", "pending", "cred-2"))
    reactor.advance(10)
    assert client.heartbeats[-1][0] == "node-2"
    assert [r.node_id for r in registered] == ["node-1", "node-2"]
    registrar.stopService()


def test_concurrent_re_registrations_share_one_attempt(reactor, client):
    registrar = NodeRegistrar(reactor, client)
    registrar.startService()
    client.registers[-1].callback(Registration("node-1", "healthy", "cred-1"))
    first, second = registrar.register_once(), registrar.register_once()
    assert len(client.registers) == 2
    client.registers[-1].callback(Registration("node-1", "healthy", "cred-2"))
    assert first.result == second.result == Registration("node-1", "healthy", "cred-2")
    failed = registrar.register_once()
    client.registers[-1].errback(unavailable())
    assert isinstance(failed.result.value, FrontendUnavailable)
    failed.addErrback(lambda _: None)
    registrar.stopService()


def test_stop_cancels_the_retry_and_the_heartbeat_and_closes_the_client(reactor, client):
    registrar = NodeRegistrar(reactor, client)
    registrar.startService()
    client.registers[-1].errback(unavailable())
    registrar.stopService()
    reactor.advance(3600)
    assert len(client.registers) == 1
    assert client.closed


# -- the whole worker --------------------------------------------------------------------------------


def options(tmp_path):
    return {
        "register-to": "http://frontend.example:8080",
        "registration-token": "REG-TOKEN",
        "node-name": "worker-a",
        "node-type": "backend",
        "backend-port-range": PortRange(30000, 30009),
        "data-dir": str(tmp_path / "data"),
        "label": [("gpu", "a100")],
    }


class NoDial:
    def __init__(self):
        self.dials = []

    def __call__(self, reactor, url, factory, headers):
        self.dials.append((url, headers))
        return defer.Deferred()


def test_the_worker_listens_on_nothing_and_dials_after_registering(reactor, client, tmp_path):
    dial = NoDial()
    worker = WorkerService(options(tmp_path), reactor, registration_client=client,
                           dialer_options={"connect": dial})
    worker.startService()
    assert reactor.tcpServers == [] and reactor.unixServers == []
    assert reactor.sslServers == [] and reactor.adoptedPorts == []
    assert dial.dials == []  # no credential yet
    assert worker.readiness() == "not registered with the frontend yet"
    client.registers[-1].callback(Registration("node-1", "healthy", "cred-1"))
    assert dial.dials == [("ws://frontend.example:8080/api/cluster/connect?id=node-1",
                           {"Authorization": "Bearer cred-1",
                            "X-LocalAI-Keepalive": "worker-pings",
                            "X-LocalAI-Stamp-Notices": "stream"})]
    assert "tunnel not connected" in worker.readiness()
    assert reactor.tcpServers == [] and reactor.unixServers == []
    for root in ("models", "data", "staging"):
        assert (tmp_path / "data" / root).is_dir()
    worker.stopService()


def test_labels_from_repeated_options_reach_the_registration_body(reactor, tmp_path):
    worker = makeWorkerService(options(tmp_path), reactor)
    body = worker.client.registration_body()
    assert body["labels"] == {"gpu": "a100"}
    assert body["name"] == "worker-a" and body["node_type"] == "backend"
    assert "REG-TOKEN" not in repr(body)


def test_the_control_site_serves_node_status(reactor, client, tmp_path):
    worker = WorkerService(options(tmp_path), reactor, registration_client=client,
                           running_backends=lambda: [{"model_id": "m", "address": "x:1"}])
    assert worker.verbs.lookup("node.status") is not None
    assert worker.router.control_site is worker.site
    assert worker.router.backend_ports == PortRange(30000, 30009)


def test_registration_and_heartbeat_report_the_real_ram_and_model_disk(reactor, tmp_path):
    import psutil

    worker = makeWorkerService(options(tmp_path), reactor)
    capacity = worker.client.registration_body()["capacity"]
    memory = psutil.virtual_memory()
    disk = psutil.disk_usage(str(tmp_path))  # the models directory is created under it
    assert capacity["total_ram"] == memory.total
    assert 0 < capacity["available_ram"] <= memory.total
    assert capacity["total_disk"] == disk.total
    assert 0 < capacity["available_disk"] <= disk.total
    assert "total_vram" not in capacity  # unknown is left out, never reported as 0


def test_an_unreadable_capacity_is_left_out_not_fatal(monkeypatch, tmp_path):
    import psutil

    from localai_tw.worker.capacity import HostCapacity

    def broken(path):
        raise OSError("no statvfs here")

    monkeypatch.setattr(psutil, "disk_usage", broken)
    capacity = HostCapacity(str(tmp_path / "models" / "not-yet"))()
    assert set(capacity) == {"total_ram", "available_ram"}


def test_a_memory_budget_caps_every_memory_field_and_gpu_memory_needs_pynvml(monkeypatch,
                                                                             tmp_path):
    import sys
    import types

    from localai_tw.worker import capacity as capacity_module
    from localai_tw.worker.capacity import HostCapacity

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: no GPU fields
    assert capacity_module.gpu_memory() == {}
    capped = HostCapacity(str(tmp_path), memory_budget=30000)()
    assert capped["total_ram"] == capped["available_ram"] == 30000
    assert capped["total_disk"] > 30000  # the disk is not memory

    info = types.SimpleNamespace(total=8 << 30, free=6 << 30)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetMemoryInfo=lambda h: info)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert capacity_module.gpu_memory() == {"total_vram": 16 << 30, "available_vram": 12 << 30}
    capped = HostCapacity(str(tmp_path), memory_budget=1 << 30)()
    assert capped["total_vram"] == capped["available_vram"] == 1 << 30
