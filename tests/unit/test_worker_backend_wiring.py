"""The worker's service tree carries the backend supervisor and its verbs for backend nodes."""

from twisted.internet.testing import MemoryReactorClock

from localai_tw.backends.process import BackendSupervisor
from localai_tw.config import PortRange
from localai_tw.worker.service import WorkerService, makeWorkerService


def options(node_type):
    return {
        "register-to": "http://frontend.invalid:8080",
        "registration-token": "tok",
        "node-name": "w1",
        "node-type": node_type,
        "backend-port-range": PortRange(30000, 30009),
        "labels": {},
        "data-dir": None,
    }


def test_backend_worker_runs_a_supervisor_and_serves_backend_verbs():
    worker = makeWorkerService(options("backend"), MemoryReactorClock())
    assert isinstance(worker, WorkerService)
    assert any(isinstance(s, BackendSupervisor) for s in worker)
    for verb in ("backend.start", "backend.stop", "backend.list", "backend.logs", "node.status"):
        assert worker.verbs.lookup(verb) is not None, verb


def test_agent_worker_runs_no_backends():
    worker = makeWorkerService(options("agent"), MemoryReactorClock())
    assert not any(isinstance(s, BackendSupervisor) for s in worker)
    assert worker.verbs.lookup("backend.start") is None
