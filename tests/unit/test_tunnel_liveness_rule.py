"""The stamping loop of ``tunnel/liveness.py`` on a ``task.Clock`` with a recording database;
the statement itself runs against PostgreSQL in ``tests/integration/test_tunnel_liveness.py``."""

from __future__ import annotations

from twisted.internet import defer, task

from localai_tw.tunnel.liveness import TunnelLiveness


class RecordingDb:
    """Answers each statement at once with every node it was asked to stamp (and its
    status, as the statement returns it)."""

    def __init__(self):
        self.calls = []

    def runQuery(self, sql, params):
        self.calls.append(params)
        return defer.succeed([(node, "healthy") for node in params[0]])


def test_every_interval_one_statement_for_the_open_tunnels_and_a_late_pass_stamps_nothing():
    clock, db = task.Clock(), RecordingDb()
    claims = [("n1", 7), ("n2", 9)]
    noticed = []
    stamper = TunnelLiveness(db, "replica-a", lambda: claims, 11.0, clock, interval=10,
                             on_stamped=noticed.append)
    stamper.startService()
    clock.advance(10)
    assert [(ids, epochs, owner) for ids, epochs, _, _, owner in db.calls] == \
        [(["n1", "n2"], [7, 9], "replica-a")]
    assert db.calls[0][2] == 11.0 and stamper.last_written == 2
    assert noticed == [{"n1": "healthy", "n2": "healthy"}]  # what was written, for notices
    clock.advance(10)
    assert len(db.calls) == 2
    # The reactor stalled for 25 s: keepalive expiries of dead tunnels are due but not run
    # yet, so this pass must not vouch for any session (nor notice one).
    clock.advance(35)
    assert len(db.calls) == 2 and stamper.late_passes == 1 and stamper.last_written == 0
    assert len(noticed) == 2
    clock.advance(10)
    assert len(db.calls) == 3
    stamper.stopService()


def test_failing_notices_do_not_stop_the_stamps():
    clock, db = task.Clock(), RecordingDb()

    def broken(written):
        raise RuntimeError("a notice bug")

    stamper = TunnelLiveness(db, "replica-a", lambda: [("n1", 1)], 11.0, clock, interval=10,
                             on_stamped=broken)
    stamper.startService()
    for _ in range(3):
        clock.advance(10)
    assert len(db.calls) == 3 and stamper.last_written == 1
    stamper.stopService()


def test_zero_turns_stamping_off():
    clock, db = task.Clock(), RecordingDb()
    stamper = TunnelLiveness(db, "replica-a", lambda: [("n1", 1)], 11.0, clock, interval=0)
    assert not stamper.enabled
    stamper.startService()
    clock.advance(100)
    assert db.calls == []
    stamper.stopService()
