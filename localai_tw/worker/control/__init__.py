"""The worker's control plane: verbs served over HTTP under ``/v1/control/``.

A frontend calls a verb with ``POST /v1/control/<verb with dots replaced by slashes>`` and a
JSON object body.  The status of the reply is the contract the frontend classifies by (see
``docs/control-plane.md``): 200 is the worker's answer (an ``error`` field included), 204 a
verb with no reply, 400 a request the worker could not decode (never evidence), 404 a verb this
worker version does not serve (an answer, never absence), 405 a method other than POST, 413 a
body over the cap, 503 no free slot (the work did not start), 500 a verb that could not be
served.  Streaming verbs answer ``application/x-ndjson``: ``{"progress": ...}`` lines, then
exactly one final ``{"reply": ...}`` line.

Verbs are registered in a :class:`ControlVerbs` registry; this package ships only
``node.status`` and knows nothing of backends or agents.  ``/healthz`` and ``/readyz`` live
here too and need no credentials.

What this package must never do:

- answer a verb to an unauthorized caller: with a token configured every verb needs
  ``Authorization: Bearer <token>`` (compared in constant time); with none configured only a
  local caller (a tunnel stream, loopback, a Unix socket) is served;
- read an unbounded body: bodies are capped at :data:`MAX_REQUEST_BYTES` while they arrive;
- echo a request back except the first 128 bytes of an unknown path (printable ASCII only);
- let a failure of one verb look like absence: every reply that reaches the frontend is a
  status from the contract, and a streaming reply ends with its reply line or not at all
  (the link broke).

The package, one module per concern: :mod:`.verbs` (errors, schemas, the registry, the path
rule, ``node.status``), :mod:`.auth` (who may call), :mod:`.replies` (JSON and NDJSON replies),
:mod:`.probes` (``/healthz``, ``/readyz``) and :mod:`.plane` (dispatch, the body policy and the
whole site).  Its names are re-exported here.
"""

from localai_tw.worker.control.auth import ControlAuth, Refusal, is_local_caller
from localai_tw.worker.control.plane import (
    MAX_REQUEST_BYTES,
    ControlBodyPolicy,
    ControlPlaneResource,
    build_worker_site,
)
from localai_tw.worker.control.probes import LivenessResource, ReadinessCheck, ReadinessResource
from localai_tw.worker.control.replies import (
    JSON_TYPE,
    MAX_ECHOED_PATH_BYTES,
    MAX_UNREAD_STREAM_BYTES,
    NDJSON_TYPE,
    NDJSONReplyStream,
    write_json,
    write_no_content,
    write_problem,
    write_unknown_control_path,
)
from localai_tw.worker.control.verbs import (
    CONTROL_PREFIX,
    NO_FREE_SLOT,
    BadVerbRequest,
    ControlVerbs,
    FieldType,
    IControlVerb,
    NoFreeSlot,
    RegisteredVerb,
    RunningBackends,
    StreamingHandler,
    UnaryHandler,
    VerbRequestSchema,
    canonical_verb_name,
    decode_request_object,
    node_status_verb,
    path_of,
    register_node_status,
)

__all__ = [
    "BadVerbRequest", "CONTROL_PREFIX", "ControlAuth", "ControlBodyPolicy",
    "ControlPlaneResource", "ControlVerbs", "FieldType", "IControlVerb", "JSON_TYPE",
    "LivenessResource", "MAX_ECHOED_PATH_BYTES", "MAX_REQUEST_BYTES",
    "MAX_UNREAD_STREAM_BYTES", "NDJSONReplyStream", "NDJSON_TYPE", "NO_FREE_SLOT",
    "NoFreeSlot", "ReadinessCheck", "ReadinessResource", "Refusal", "RegisteredVerb",
    "RunningBackends", "StreamingHandler", "UnaryHandler", "VerbRequestSchema",
    "build_worker_site", "canonical_verb_name", "decode_request_object", "is_local_caller",
    "node_status_verb", "path_of", "register_node_status", "write_json", "write_no_content",
    "write_problem", "write_unknown_control_path",
]
