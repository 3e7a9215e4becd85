"""backend.start/stop/list/logs through the worker's control site (ControlVerbs, the real
control resource over a StringTransport) with a real echo backend process."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.task import deferLater
from twisted.internet.testing import StringTransport

from localai_tw.backends import builtin
from localai_tw.backends.interfaces import BackendFactories
from localai_tw.backends.ports import PortAllocator
from localai_tw.backends.process import BackendSupervisor
from localai_tw.worker.backend_verbs import register_backend_verbs
from localai_tw.worker.control import ControlAuth, ControlVerbs, build_worker_site

LOOPBACK = IPv4Address("TCP", "127.0.0.1", 40000)


@pytest.fixture
def site_and_supervisor():
    first = random.randrange(31000, 32500, 50)
    supervisor = BackendSupervisor(reactor, PortAllocator(first, first + 49),
                                   BackendFactories([builtin.echo_backend]), stop_grace=3.0)
    verbs = ControlVerbs()
    register_backend_verbs(verbs, supervisor)
    site = build_worker_site(verbs, ControlAuth(None), lambda: None)
    yield site, supervisor
    pids = [r.pid for r in supervisor._live.values() if r.pid]
    pytest_twisted.blockon(supervisor.stop_all(force=True))
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def post(site, verb: str, body) -> tuple[int, dict]:
    """POST /v1/control/<verb> with a JSON body; wait for the whole response."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    transport = StringTransport(peerAddress=LOOPBACK)
    protocol = site.buildProtocol(LOOPBACK)
    protocol.makeConnection(transport)
    protocol.dataReceived(
        f"POST /v1/control/{verb} HTTP/1.1\r\nHost: worker.invalid\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    deadline = time.monotonic() + 30
    while True:
        head, sep, rest = transport.value().partition(b"\r\n\r\n")
        if sep:
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")]
            if length and len(rest) >= length[0]:
                code = int(head.split(b" ", 2)[1])
                return code, json.loads(rest[: length[0]])
        assert time.monotonic() < deadline, f"no complete response: {transport.value()!r}"
        await deferLater(reactor, 0.05)


@pytest_twisted.ensureDeferred
async def test_start_list_logs_stop_through_the_control_plane(site_and_supervisor):
    site, supervisor = site_and_supervisor
    code, reply = await post(site, "backend/start", {
        "backend": "echo", "model": "tiny", "options": {},
        "load": {"Model": "tiny"}})
    assert code == 200, reply
    assert reply["success"] is True and reply["error"] == ""
    assert reply["process_key"] == "tiny#0"
    host, port = reply["address"].split(":")
    assert host == "127.0.0.1" and int(port) in supervisor.ports

    code, listed = await post(site, "backend/list", {})
    assert code == 200
    [entry] = listed["backends"]
    assert {k: entry[k] for k in ("model", "backend", "address", "state")} == {
        "model": "tiny", "backend": "echo", "address": reply["address"], "state": "ready"}
    assert isinstance(entry["pid"], int) and isinstance(entry["started_at"], float)

    code, logs = await post(site, "backend/logs", {"model": "tiny", "tail": 50})
    assert code == 200 and logs["state"] == "ready"
    assert any("Server started. Listening on" in line for line in logs["lines"])

    code, stopped = await post(site, "backend/stop", {"model": "tiny"})
    assert code == 200
    assert stopped["success"] is True and stopped["state"] == "stopped"
    code, listed = await post(site, "backend/list", {})
    assert listed == {"backends": []}
    code, listed = await post(site, "backend/list", {"include_ended": True})
    assert [b["state"] for b in listed["backends"]] == ["stopped"]


@pytest_twisted.ensureDeferred
async def test_failures_are_answers_not_errors(site_and_supervisor):
    site, _ = site_and_supervisor
    code, reply = await post(site, "backend/start", {
        "backend": "echo", "model": "bad",
        "load": {"Model": "bad", "Options": ["echo.fail_load:no such weights"]}})
    assert code == 200
    assert reply["success"] is False and "no such weights" in reply["error"]
    code, reply = await post(site, "backend/start", {"backend": "vllm", "model": "m"})
    assert code == 200 and reply["success"] is False
    assert "unknown backend 'vllm'" in reply["error"]
    code, reply = await post(site, "backend/stop", {"model": "never-started"})
    assert code == 200 and reply["success"] is False
    code, reply = await post(site, "backend/logs", {"model": "never-started"})
    assert code == 200 and reply["lines"] == [] and "no backend process" in reply["error"]


@pytest_twisted.ensureDeferred
async def test_malformed_requests_are_400(site_and_supervisor):
    site, _ = site_and_supervisor
    code, reply = await post(site, "backend/start", {"model": "m"})
    assert code == 400 and "backend" in reply["problem"]
    code, reply = await post(site, "backend/start", {"backend": "echo", "model": 3})
    assert code == 400
    code, reply = await post(site, "backend/stop", {})
    assert code == 400 and "model or process_key" in reply["problem"]
    code, reply = await post(site, "backend/logs", {"model": "m", "tail": 10**9})
    assert code == 400


@pytest_twisted.ensureDeferred
async def test_stop_if_idle_leaves_a_busy_backend_running_and_absent_ok(site_and_supervisor):
    """``backend.stop`` with ``if_idle`` asks the backend's own Status; BUSY (a request in
    flight, whoever sent it) stops nothing.  Break: drop the Status check: the backend is
    stopped under its request and the busy assertion goes red."""
    from localai_tw.backends import backend_pb2

    site, supervisor = site_and_supervisor
    code, reply = await post(site, "backend/start", {
        "backend": "echo", "model": "tiny", "load": {"Model": "tiny"}})
    assert code == 200 and reply["success"], reply
    request = backend_pb2.PredictOptions(Prompt="a b c d e f")
    request.Metadata["echo.delay_ms"] = "300"
    running = supervisor.client("tiny").call("Predict", request, 30)
    await deferLater(reactor, 0.3)
    code, reply = await post(site, "backend/stop", {"model": "tiny", "if_idle": True})
    assert code == 200 and reply == {"success": False, "busy": True, "error": "",
                                     "process_key": "tiny"}
    assert (await running).message == b"a b c d e f"  # it ran to the end
    code, reply = await post(site, "backend/stop", {"model": "tiny", "if_idle": True})
    assert code == 200 and reply["success"] is True and reply["state"] == "stopped"
    code, reply = await post(site, "backend/stop", {"model": "gone", "absent_ok": True})
    assert code == 200 and reply["success"] is True and reply["state"] == "absent"
    code, reply = await post(site, "backend/stop", {"model": "gone"})
    assert code == 200 and reply["success"] is False  # without absent_ok: as before


@pytest_twisted.ensureDeferred
async def test_backend_exit_tells_a_crash_from_a_live_or_unknown_process(site_and_supervisor):
    site, supervisor = site_and_supervisor
    code, started = await post(site, "backend/start", {"backend": "echo", "model": "m"})
    assert code == 200 and started["success"] and started["note"] == ""
    port = int(started["address"].rsplit(":", 1)[1])
    code, alive = await post(site, "backend/exit", {"port": port})
    assert code == 200 and alive["crashed"] is False and alive["state"] == "ready"
    code, absent = await post(site, "backend/exit", {"port": port + 1})
    assert absent == {"crashed": False, "state": "absent", "node_name": ""}
    code, refused = await post(site, "backend/exit", {"port": "x"})
    assert code == 400
    os.kill(supervisor.find("m").pid, signal.SIGKILL)
    code, crashed = await post(site, "backend/exit", {"port": port})
    assert crashed["crashed"] is True and crashed["signal"] == "SIGKILL", crashed
    assert crashed["description"] == "killed by signal SIGKILL" and crashed["model"] == "m"
    assert all(not line.startswith("[localai-tw]") for line in crashed["output"])
    # a stop that was asked for is not a crash
    code, again = await post(site, "backend/start", {"backend": "echo", "model": "m"})
    await post(site, "backend/stop", {"model": "m"})
    code, stopped = await post(site, "backend/exit",
                               {"port": int(again["address"].rsplit(":", 1)[1])})
    assert stopped["crashed"] is False and stopped["state"] == "stopped"
