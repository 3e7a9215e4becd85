"""Backends: the LocalAI ``backend.Backend`` gRPC contract and the worker's backend processes.

- ``backend.proto`` with its committed stubs ``backend_pb2`` / ``backend_pb2_grpc``: the
  wire-compatible subset of LocalAI's contract (package ``backend``, service ``Backend``);
- ``ports``: the loopback port allocator for backend gRPC servers;
- ``interfaces``: ``IBackendFactory``, the seam operator plugins fill (found through
  ``twisted.plugin`` in ``localai_tw.plugins``);
- ``process``: the supervisor that starts, watches and stops one process per loaded model;
- ``verbs``: the worker control verbs ``backend.start/stop/list/logs`` over a supervisor;
- ``builtin``: the shipped backends (``external``, ``echo``, ``bert-numpy``,
  ``sentence-transformers``, ``transformers``, ``llama-cpp``).

Nothing in this package imports from ``localai_tw.frontend`` or ``localai_tw.worker`` at
module level.
"""
