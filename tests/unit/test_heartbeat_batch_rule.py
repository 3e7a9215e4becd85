"""The batching rule of ``HeartbeatBatch`` (window, size, duplicates, failure) on a
``task.Clock`` with a recording database; the statement itself runs against PostgreSQL in
``tests/integration/test_heartbeat_batch.py``."""

from __future__ import annotations

import pytest
from twisted.internet import defer, task

from localai_tw.cluster.membership import hash_secret
from localai_tw.cluster.nodes import HeartbeatBatch, NodeCapacity, NodeStatus, Unauthorized


class RecordingDb:
    """Answers each statement with a deferred the test fires."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.answers: list[defer.Deferred] = []

    def runQuery(self, sql, params):
        self.calls.append((sql, params))
        d = defer.Deferred()
        self.answers.append(d)
        return d


def _results(ds):
    out = []
    for d in ds:
        d.addBoth(out.append)
    return out


def test_one_statement_per_window_however_many_beats():
    db, clock = RecordingDb(), task.Clock()
    batch = HeartbeatBatch(db, clock, window=0.2)
    ds = [batch.beat(f"n{i}", f"secret-{i}") for i in range(50)]
    clock.advance(0.19)
    assert db.calls == []  # the window is not over: nothing written, nobody answered
    clock.advance(0.01)
    assert len(db.calls) == 1 and batch.writes == 1 and clock.getDelayedCalls() == []
    ids, hashes = db.calls[0][1][:2]
    assert ids == [f"n{i}" for i in range(50)]
    assert hashes == [hash_secret(f"secret-{i}") for i in range(50)]
    results = _results(ds)
    assert results == []  # answered only once the statement is written
    db.answers[0].callback([(f"n{i}", hash_secret(f"secret-{i}"), "healthy")
                            for i in range(49)])
    assert results[:49] == [NodeStatus.HEALTHY] * 49
    results[49].trap(Unauthorized)  # no row back: unknown node or wrong credential
    # The next beat opens a new window.
    batch.beat("n0", "secret-0")
    assert len(clock.getDelayedCalls()) == 1 and len(db.calls) == 1


def test_a_full_batch_is_written_at_once():
    db, clock = RecordingDb(), task.Clock()
    batch = HeartbeatBatch(db, clock, window=0.2, max_batch=3)
    for i in range(3):
        batch.beat(f"n{i}", "s")
    assert len(db.calls) == 1 and clock.getDelayedCalls() == []
    batch.beat("n9", "s")
    clock.advance(0.2)
    assert len(db.calls) == 2 and db.calls[1][1][0] == ["n9"]


def test_the_same_node_twice_is_one_row_with_the_later_capacity_and_both_answered():
    db, clock = RecordingDb(), task.Clock()
    batch = HeartbeatBatch(db, clock, window=0.2)
    first = batch.beat("n1", "s", NodeCapacity(available_vram=1))
    second = batch.beat("n1", "s", NodeCapacity(available_vram=2))
    other = batch.beat("n1", "another-credential")  # its own row: only one can match
    assert batch.waiting == 3
    clock.advance(0.2)
    params = db.calls[0][1]
    assert params[0] == ["n1", "n1"]
    vram = params[2 + NodeCapacity.FIELDS.index("available_vram")]
    assert vram == [2, None]
    results = _results([first, second, other])
    db.answers[0].callback([("n1", hash_secret("s"), "draining")])
    assert results[:2] == [NodeStatus.DRAINING] * 2
    results[2].trap(Unauthorized)


def test_a_failed_statement_fails_every_waiter_and_keeps_nothing():
    db, clock = RecordingDb(), task.Clock()
    batch = HeartbeatBatch(db, clock, window=0.2)
    results = _results([batch.beat("n1", "s"), batch.beat("n2", "s")])
    clock.advance(0.2)
    db.answers[0].errback(RuntimeError("connection lost"))
    assert [r.check(RuntimeError) for r in results] == [RuntimeError] * 2
    assert batch.waiting == 0
    clock.advance(10)
    assert len(db.calls) == 1  # nothing retried behind the waiters' backs


def test_refused_before_queueing():
    db, clock = RecordingDb(), task.Clock()
    batch = HeartbeatBatch(db, clock, window=0.2)
    out = _results([batch.beat("n1", "")])
    out[0].trap(Unauthorized)
    with pytest.raises(Exception):
        batch.beat("x" * 37, "s")  # not a node id
    with pytest.raises(ValueError):
        HeartbeatBatch(db, clock, window=-1)
    assert batch.waiting == 0 and clock.getDelayedCalls() == []
