"""Loaded by every Python process started with this directory on ``PYTHONPATH`` (``site``
imports ``sitecustomize``); acts only in a ``localai-frontend`` started by
``bench_fleet.py --snapshots DIR``.  It starts ``tracemalloc`` at once, and on ``SIGUSR2``
writes into ``$FLEET_SNAPSHOT_DIR``: ``snap-<n>.pickle`` (a tracemalloc snapshot) and
``types-<n>.json`` (live objects per type, after a full collection), then ``done-<n>``.
Not part of the product: a measuring aid of the benchmark."""

import os
import sys

if os.environ.get("FLEET_SNAPSHOT_DIR") and "localai-frontend" in sys.argv:
    import signal
    import tracemalloc

    tracemalloc.start(int(os.environ.get("FLEET_SNAPSHOT_FRAMES", "1")))
    _taken = [0]

    def _dump(signum, frame):
        import collections
        import gc
        import json

        _taken[0] += 1
        out = os.path.join(os.environ["FLEET_SNAPSHOT_DIR"], str(_taken[0]))
        gc.collect()
        counts = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}"
                                     for o in gc.get_objects())
        with open(f"{out}-types.json", "w") as f:
            json.dump(dict(counts), f)
        tracemalloc.take_snapshot().dump(f"{out}-snap.pickle")
        open(f"{out}-done", "w").close()

    signal.signal(signal.SIGUSR2, _dump)
