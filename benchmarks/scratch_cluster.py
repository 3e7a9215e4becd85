"""A benchmark's in-process cluster on a scratch database: the database created on the server
at ``dsn`` (and dropped), a temporary work directory (and removed), the integration tests'
``Cluster`` over both.  Shared by bench_touches.py, bench_staging_copies.py and
bench_prefix_routing.py; not a benchmark itself."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from typing import Awaitable, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psycopg2  # noqa: E402

from tests.integration.inference_harness import Cluster  # noqa: E402


def admin(dsn: str, sql: str) -> None:
    """One statement outside a transaction (CREATE / DROP DATABASE)."""
    connection = psycopg2.connect(dsn)
    connection.autocommit = True
    try:
        connection.cursor().execute(sql)
    finally:
        connection.close()


def scratch_cluster(dsn: str, label: str) -> tuple[Cluster, Callable[[], Awaitable[None]]]:
    """A ``Cluster`` on a new database ``bench_<label>_<random>`` and a new work directory,
    and the coroutine function that closes it and removes both (call it in a ``finally``)."""
    name = f"bench_{label}_{uuid.uuid4().hex[:8]}"
    admin(dsn, f"CREATE DATABASE {name}")
    base = dsn.rsplit("/", 1)[0]
    workdir = tempfile.mkdtemp(prefix=f"bench-{label}-")
    cluster = Cluster(f"{base}/{name}", workdir)

    async def dispose() -> None:
        await cluster.close()
        admin(dsn, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        shutil.rmtree(workdir, ignore_errors=True)

    return cluster, dispose
