"""One thread, shared by the replica, for CPU work a request or an answer makes too big to do
on the reactor within its inline budget: checking and compiling a request's big schemas, and
validating a large structured answer.

Why one thread and not the reactor's pool: that work is pure Python, so it holds the GIL
between switches.  With one such thread the reactor waits at most a switch interval (5 ms) each
time it wants the GIL, and ``/healthz`` stays fast (``tests/integration/test_cpu_attacks.py``);
with ten it could wait for each of them in turn, and the reactor's pool also serves DNS and
file work.  Jobs queue behind each other; each is bounded by its caller.

What this module must never do: run a job on the reactor, or start a thread before the first
job (a replica that never needs it has none).
"""

from __future__ import annotations

from twisted.internet import threads
from twisted.python.threadpool import ThreadPool

_pool: ThreadPool | None = None


def run(reactor, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in the shared thread: a Deferred of its result."""
    global _pool
    if _pool is None:
        _pool = ThreadPool(minthreads=0, maxthreads=1, name="localai-answer-checks")
        _pool.start()
        reactor.addSystemEventTrigger("during", "shutdown", _stop)
    return threads.deferToThreadPool(reactor, _pool, fn, *args, **kwargs)


def _stop() -> None:
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.stop()


__all__ = ["run"]
