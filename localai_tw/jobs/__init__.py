"""Jobs: batch work a user submits to any replica (``POST /api/jobs``) and an ``agent`` worker
runs (docs/jobs.md).  This package holds what both sides share: the :class:`~.kinds.IJobKind`
seam, the bounds, the built-in kinds and the client of the cluster's own API that they use.
The frontend's side (table, API, claim-queue dispatch, cancel fan-out) is in
``localai_tw/frontend/jobs/``; the worker's (the ``job.run`` and ``job.cancel`` verbs) in
``localai_tw/worker/agent.py``."""
