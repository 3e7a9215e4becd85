"""Fixtures of the cluster e2e suite: clusters of real twistd processes, always reaped.

``make_cluster(grace=...)`` builds a :class:`~tests.e2e.cluster.harness.Cluster` on the test's
fresh database (``pg_dsn``); every cluster made is closed (each process terminated, waited for
and killed if need be) when the test ends, whatever happened.  When a test fails, the tail of
every process log and the balancer counters are attached to its report ("cluster logs").

The work directories live outside pytest's tmp_path for the reason given in
``tests/e2e/test_twistd_plugins.py`` and are removed afterwards unless the test failed or
``LOCALAI_E2E_KEEP_LOGS`` is set (their path is printed).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from localai_tw.db.pool import dsn_with

from . import harness


HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: the cluster e2e suite (real twistd processes, "
                            "about four minutes); deselect with -m 'not cluster'")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and harness.OPEN_CLUSTERS:
        report.sections.append(("cluster logs", harness.failure_report()))
    if report.failed:
        item._cluster_failed = True


@pytest.fixture
def workdir(request):
    path = Path(tempfile.mkdtemp(prefix="ltw-cluster-"))
    yield path
    if not getattr(request.node, "_cluster_failed", False) \
            and not os.environ.get("LOCALAI_E2E_KEEP_LOGS"):
        shutil.rmtree(path, ignore_errors=True)
    else:
        print(f"cluster work directory kept: {path}")


@pytest.fixture
def make_cluster(pg_dsn, workdir):
    clusters: list[harness.Cluster] = []

    def make(**kwargs) -> harness.Cluster:
        cluster = harness.Cluster(pg_dsn, workdir / f"c{len(clusters)}", **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()


# -- one shared two-by-two cluster for the read-mostly tests ----------------------------------


@pytest.fixture(scope="module")
def module_dsn(pg_admin_dsn):
    import psycopg2

    name = "ltw_e2e_" + uuid.uuid4().hex[:12]

    def admin(sql):
        conn = psycopg2.connect(pg_admin_dsn)
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(sql)
        finally:
            conn.close()

    admin(f'CREATE DATABASE "{name}"')
    try:
        yield dsn_with(pg_admin_dsn, dbname=name)
    finally:
        admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def two_by_two(module_dsn):
    """2 frontends x 2 workers; worker i behind its own balancer preferring frontend i % 2.
    Shared by the tests of one module that do not break it."""
    path = Path(tempfile.mkdtemp(prefix="ltw-cluster-mod-"))
    cluster = harness.Cluster(module_dsn, path)
    try:
        start_two_by_two(cluster)
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(path, ignore_errors=True)


def start_two_by_two(cluster: harness.Cluster, *, probe: bool = True,
                     frontend_args: tuple[str, ...] = ()) -> None:
    f0 = cluster.start_frontend(probe=probe, extra_args=frontend_args)
    f1 = cluster.start_frontend(probe=probe, extra_args=frontend_args)
    w0 = cluster.start_worker(prefer=0)
    w1 = cluster.start_worker(prefer=1)
    for w, fe in ((w0, f0), (w1, f1)):
        cluster.wait_registered(w)
        cluster.wait_owned(w, by=fe)
