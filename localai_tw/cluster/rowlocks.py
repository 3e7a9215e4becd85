"""Statements that write many rows of ``backend_nodes`` lock them in ``id`` order first.

Two such statements running at once (a replica's heartbeat batch, ``cluster/nodes.py``, and a
replica's liveness stamp, ``cluster/liveness.py``, on the same nodes; or two replicas' batches)
took each row's lock in the order of their own plans: one walking the table, the other its
array of ids.  Each then waited for a row the other held and PostgreSQL ended one of them with
"deadlock detected" after a second: the heartbeats of that batch were answered 500 (seen at
4000 idle workers, docs/benchmarks.md, "An idle fleet").  Locked in one order, a statement
waits for the other and never holds a row the other needs before it.

:func:`locked_first` puts a ``MATERIALIZED`` CTE in front of the ``UPDATE``, read by a
scalar subquery (an init plan, evaluated once before the first row is written), that locks
the rows with ``FOR NO KEY UPDATE`` (the lock an ``UPDATE`` of non-key columns takes) after
sorting them by ``id``.  Single-row writers cannot close a cycle with it and are unchanged.
"""

from __future__ import annotations


def locked_first(ids_sql: str) -> tuple[str, str]:
    """(``WITH`` clause, condition) locking the ``backend_nodes`` rows whose ids
    ``ids_sql`` selects (a subquery over the statement's own ``WITH`` relations), in ``id``
    order, before the ``UPDATE`` they precede writes any of them."""
    cte = ("node_rows_locked AS MATERIALIZED (SELECT n.id FROM backend_nodes AS n"
           f" WHERE n.id IN ({ids_sql}) ORDER BY n.id FOR NO KEY UPDATE OF n)")
    condition = "(SELECT count(*) FROM node_rows_locked) >= 0"
    return cte, condition
