"""``PlacementSweep``: a backend's channel is closed once no placement names it -- never with a
call in flight, never before a second look with no use in between, and no statement at all
while no channel is open."""

from __future__ import annotations

import pytest_twisted
from twisted.internet import defer, task

from localai_tw.frontend.inference.channels import PlacementSweep


class FakeClient:
    def __init__(self):
        self.in_flight = 0
        self.used = True
        self.closed = False


class FakeClients:
    def __init__(self, *keys):
        self.clients = {key: FakeClient() for key in keys}
        self.dropped = []

    def open_clients(self):
        return {k: c for k, c in self.clients.items() if not c.closed}

    def drop(self, node, port):
        self.clients[(node, port)].closed = True
        self.dropped.append((node, port))
        return defer.succeed(None)


class FakeDB:
    def __init__(self, rows=(), fail=None):
        self.rows = list(rows)
        self.fail = fail
        self.queries = []

    def runQuery(self, sql, args):
        self.queries.append(args)
        if self.fail is not None:
            return defer.fail(self.fail)
        nodes = set(args[0])
        return defer.succeed([r for r in self.rows if r[0] in nodes])


def sweep_of(db, clients):
    return PlacementSweep(db, clients, task.Clock())


@pytest_twisted.ensureDeferred
async def test_no_channel_open_reads_nothing():
    db = FakeDB()
    assert await sweep_of(db, FakeClients()).run_once() == []
    assert db.queries == []


@pytest_twisted.ensureDeferred
async def test_a_placed_channel_stays_an_orphan_closes_at_the_second_unused_look():
    clients = FakeClients(("n1", 40000), ("n1", 40001))
    db = FakeDB([("n1", "127.0.0.1:40000")])
    sweep = sweep_of(db, clients)
    assert await sweep.run_once() == []  # first look: both were used since their creation
    assert await sweep.run_once() == [("n1", 40001)]
    assert clients.dropped == [("n1", 40001)] and sweep.closed == 1
    assert db.queries[0] == (["n1"],)
    assert await sweep.run_once() == []  # the placed one stays, look after look


@pytest_twisted.ensureDeferred
async def test_use_between_looks_or_a_call_in_flight_keeps_an_orphan():
    clients = FakeClients(("n1", 40001))
    client = clients.clients[("n1", 40001)]
    sweep = sweep_of(FakeDB(), clients)
    await sweep.run_once()
    client.used = True  # a call between the looks (a placement read before its row went)
    assert await sweep.run_once() == []
    client.in_flight = 1
    assert await sweep.run_once() == [] and await sweep.run_once() == []
    client.in_flight = 0
    assert await sweep.run_once() == [("n1", 40001)]


@pytest_twisted.ensureDeferred
async def test_a_failed_read_closes_nothing():
    clients = FakeClients(("n1", 40001))
    sweep = sweep_of(FakeDB(fail=RuntimeError("database down")), clients)
    for _ in range(3):
        assert await sweep.run_once() == []
    assert clients.dropped == []
