"""Fixtures shared by the integration tests (``pg_dsn`` and ``db`` come from ``tests/conftest.py``).

- ``cluster``: an in-process :class:`~tests.integration.inference_harness.Cluster` (real
  ``FrontendService`` replicas and real workers on the test's database), closed at the end.
- ``frontends``, ``workers``, ``real_worker``: the tunnel harness's pieces
  (``harness_tunnel.py``), each stopped at the end.
- ``consumers``: starts ``ClaimConsumer`` services and stops the running ones at the end.

Waiting helpers live in ``tests/integration/support.py``.
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer

from localai_tw.bus.claims import ClaimConsumer

from .inference_harness import Cluster
from .harness_tunnel import Frontend, RealWorkerParts, TestWorker


@pytest_twisted.async_yield_fixture
async def cluster(pg_dsn, tmp_path):
    c = Cluster(pg_dsn, str(tmp_path))
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
def frontends(db):
    """``await make(name, **kw)`` builds and starts a Frontend on the test's database."""
    made = []

    async def make(name, **kwargs):
        frontend = Frontend(db, name, **kwargs)
        made.append(frontend)
        return await frontend.start()

    yield make
    for frontend in reversed(made):
        pytest_twisted.blockon(defer.ensureDeferred(frontend.stop()))


@pytest.fixture
def workers():
    """``await make(nodes, name, acceptor, **kw)`` registers and dials a TestWorker."""
    made = []

    async def make(nodes, name, acceptor, **kwargs):
        worker = await TestWorker.register(nodes, name, acceptor, **kwargs)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


@pytest.fixture
def real_worker(tmp_path):
    """The real worker stream router with a control site, file staging and an echo backend."""
    parts = RealWorkerParts(tmp_path)
    yield parts
    pytest_twisted.blockon(defer.maybeDeferred(parts.stop))


@pytest_twisted.async_yield_fixture
async def consumers():
    """``start(*args, **kw)`` builds and starts a ClaimConsumer; running ones are stopped."""
    started = []

    def start(*args, **kwargs):
        c = ClaimConsumer(*args, **kwargs)
        c.startService()
        started.append(c)
        return c

    try:
        yield start
    finally:
        for c in started:
            if c.running:
                await c.stopService()
