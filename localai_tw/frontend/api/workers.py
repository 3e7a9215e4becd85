"""The worker-facing registration API: ``POST /api/node/register`` and the node heartbeat.

Mounted at ``/api/node``.  Both routes take ``Authorization: Bearer <registration token>``,
checked in constant time by the ``NodeRegistry`` (which also decides what an empty configured
token means: see ``localai_tw.cluster.nodes``).  The token is checked before the body is looked
at, so a caller without it learns nothing about the schema or about which node ids exist.

``POST /api/node/register``, body (at most 64 KiB)::

    {"name": str, "node_key": str, "node_type": "backend"|"agent", "labels": {k: v},
     "capacity": {"total_vram"|"available_vram"|"total_ram"|"available_ram"|
                  "total_disk"|"available_disk": int},
     "max_replicas_per_model": int, "gpu_vendor": str}

``name`` and ``node_key`` (the worker's per-node key, ``nodekey.py``) are required; the
rest is optional (``backend``, no labels, no capacity, 1, "").  An unknown field, in the body or
in ``capacity``, is a 400 naming it: a typo must not be dropped silently.  Answers
``201 {"id", "status", "tunnel_token"}``; the tunnel credential is the only copy of the plaintext
(the database keeps its sha256) and every registration rotates it.  Right after a registration,
before the answer, ``on_registered(node_id)`` runs: the frontend wires it to drop any tunnel this
replica still holds for the node with the previous credential.

An existing name with another node key is ``409 {"error": {"type": "conflict", "code":
"node_name_taken"}}`` naming the fix; nothing changes (no credential rotated, no tunnel dropped,
no approval handed over): the shared token admits workers, it does not make them a given node.

``POST /api/node/{id}/heartbeat``, body ``{"tunnel_token": str, "capacity": {...}}``:
``200 {"status"}``.  The registration token admits the request; ``tunnel_token``, the node's own
credential from its last registration, proves it is that node (the shared token alone would let
any worker report another node's capacity and have its models evicted).  Missing: 401 naming
the fix (upgrade the worker).  An unknown node id and a credential that is not that node's get
the same ``404``, which tells the worker to register again (a stale credential after a
re-registration recovers so) and tells anyone else nothing about which ids exist.  The check
and the write of many nodes' beats share one statement (``--heartbeat-batch``, 0.2 s by
default: ``cluster/nodes.py``, ``HeartbeatBatch``); the answer waits for that write.

Errors are ``{"error": {"message", "type", "field"?}}``: 400 ``invalid_request`` naming the
field, 401 ``unauthorized`` (the registration token is missing or wrong), 404 ``not_found``,
409 ``conflict`` (the name belongs to another node), 413 over the body cap, 429
``rate_limited`` with ``Retry-After``, 503 while the frontend is starting.

Rate limits, per source (an IPv4 address, an IPv6 /64: ``web.listener.source_key``), after
the token check, so that anonymous requests never spend the budget of the workers behind the
same NAT or balancer: a request with a missing or wrong token, on any ``/api/node`` route,
takes from the source's *failures* (:data:`FAILURES_PER_MINUTE`; beyond them 429 instead of
401); a registration with the right token takes from its *registrations*
(``--registration-limit`` per minute).  Heartbeats with the right token are not limited.  The
route is told from the percent-decoded path, as it is dispatched (``regi%73ter`` is a
registration).

This module must never log or echo the registration token, the node key or the tunnel
credential (the credential appears only in the 201 body), never accept a body over the cap,
and never change a node except through the ``NodeRegistry``.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from twisted.logger import Logger

from localai_tw.cluster.nodes import (
    InvalidNodeInput,
    NodeCapacity,
    NodeNameTaken,
    NodeNotFound,
    Unauthorized,
)

from localai_tw.frontend.api.kit import (

    bearer_token,

    call_hook,

    ClusterParts,

    JSONResource,

    printable,

    read_json_object,

    reject_unknown_fields,

    Route,

)

from localai_tw.web.errors import APIError, bad_request, conflict, not_found, unauthorized
from localai_tw.web.listener import source_key
from localai_tw.web.ratelimit import SourceRateLimit

log = Logger()

REGISTER_FIELDS = ("name", "node_key", "node_type", "labels", "capacity",
                   "max_replicas_per_model", "gpu_vendor")
HEARTBEAT_FIELDS = ("capacity", "tunnel_token")

#: Requests with a missing or wrong registration token one source may make per minute (at
#: once, then refilled evenly) on ``/api/node``; more are answered 429.
FAILURES_PER_MINUTE = 30

#: What a node id in a URL may look like (ids are UUIDs; at most 36 characters in the table).
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,35}$")

_REGISTRATION_TOKEN_HINT = ("the registration token is missing or wrong; start the worker with "
                            "--registration-token-file (or --registration-token) holding the "
                            "frontend's")


def valid_node_id(node_id: str) -> bool:
    return bool(_NODE_ID.match(node_id))


def parse_capacity(value: Any) -> NodeCapacity | None:
    """``capacity`` from a request body: None, or an object of known integer fields.

    :raises APIError: 400 naming ``capacity`` or ``capacity.<field>``.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("capacity must be an object of byte counts", field="capacity")
    reject_unknown_fields(value, NodeCapacity.FIELDS, prefix="capacity.")
    try:
        return NodeCapacity(**value).validated()
    except InvalidNodeInput as e:
        raise bad_request(f"capacity.{e}", field=f"capacity.{e.field}") from None


class WorkerRegistrationResource(JSONResource):
    """``/api/node``: register and heartbeat.

    :param parts: the replica's :class:`~localai_tw.frontend.api.kit.ClusterParts`.
    :param hold_connection: ``hold_connection(request, node_id)``, called when a known node's
        heartbeat was answered: the listener's
        :meth:`~localai_tw.web.listener.BoundedSite.hold_connection`, so the connection a
        worker keeps alive between beats leaves the connection cap (one per node).
    """

    def __init__(self, parts: ClusterParts,
                 hold_connection: Callable[[Any, str], None] | None = None, clock=None):
        super().__init__()
        self._parts = parts
        self._hold_connection = hold_connection
        if clock is None:
            from twisted.internet import reactor as clock
        self.failures = SourceRateLimit(FAILURES_PER_MINUTE / 60.0, FAILURES_PER_MINUTE, clock)

    def routes(self):
        return (Route("POST", ("register",), self.register),
                Route("POST", ("{node_id}", "heartbeat"), self.heartbeat))

    def guard(self, request) -> None:
        """From the headers alone (``BoundedSite`` also runs it when the headers of a request
        with a body end, and it runs again at dispatch: the verdict is kept on the request, so
        a request is counted once): the token, then the source's limits (module docstring)."""
        verdict = getattr(request, "_ltw_node_verdict", None)
        if verdict is None:
            verdict = request._ltw_node_verdict = self._verdict(request)
        if isinstance(verdict, APIError):
            raise verdict

    def _verdict(self, request) -> APIError | bool:
        source = source_key(request.getClientAddress())
        try:
            self._check_token(self._parts, request)
        except APIError as refusal:
            wait = self.failures.take(source)
            if wait:
                return _rate_limited(
                    f"too many requests with a missing or wrong registration token from this "
                    f"address (at most {self.failures.burst} per minute); fix the worker's "
                    f"--registration-token-file (or --registration-token)", self.failures, wait)
            return refusal
        limit = self._parts.registration_limit
        segments = getattr(request, "guarded_segments", None)
        if segments is None:  # at dispatch: the path is parsed (and percent-decoded) by then
            segments = (*request.prepath, *request.postpath)
        if limit is not None and [s for s in segments if s][-1:] == [b"register"]:
            wait = limit.take(source)
            if wait:
                return _rate_limited(
                    f"too many registrations from this address (at most {limit.burst} per "
                    f"minute, --registration-limit)", limit, wait)
        return True

    @staticmethod
    def _check_token(parts, request) -> str | None:
        presented = bearer_token(request)
        try:
            parts.nodes.check_registration_token(presented)
        except Unauthorized:
            raise unauthorized(_REGISTRATION_TOKEN_HINT) from None
        return presented

    async def register(self, request) -> tuple[int, dict]:
        parts = self._parts
        presented = self._check_token(parts, request)
        body = read_json_object(request)
        reject_unknown_fields(body, REGISTER_FIELDS)
        for text_field in ("name", "node_key", "node_type", "gpu_vendor"):
            if text_field in body and not isinstance(body[text_field], str):
                raise bad_request(f"{text_field} must be a string", field=text_field)
        if not body.get("node_key"):
            raise bad_request("node_key is required: the worker's per-node key proves which node "
                              "it is (upgrade the worker)", field="node_key")
        capacity = parse_capacity(body.get("capacity"))
        try:
            registration = await parts.nodes.register(
                body.get("name"),
                node_type=body.get("node_type", "backend"),
                presented_token=presented or "",
                node_key=body["node_key"],
                capacity=capacity,
                gpu_vendor=body.get("gpu_vendor", ""),
                max_replicas_per_model=body.get("max_replicas_per_model", 1),
                labels=body.get("labels"),
            )
        except InvalidNodeInput as e:
            raise bad_request(str(e), field=e.field) from None
        except Unauthorized:
            raise unauthorized(_REGISTRATION_TOKEN_HINT) from None
        except NodeNameTaken as e:
            raise conflict(str(e), code="node_name_taken") from None
        node = registration.node
        await call_hook("on_registered", parts.on_registered, node.id)
        return 201, {"id": node.id, "status": node.status.value,
                     "tunnel_token": registration.tunnel_credential}

    async def heartbeat(self, request, node_id: str) -> tuple[int, dict]:
        parts = self._parts
        self._check_token(parts, request)
        unknown = not_found(f"unknown node {printable(node_id)!r}; register again")
        if not valid_node_id(node_id):
            raise unknown
        body = read_json_object(request, required=False)
        reject_unknown_fields(body, HEARTBEAT_FIELDS)
        credential = body.get("tunnel_token")
        if not isinstance(credential, str) or not credential:
            raise unauthorized("a heartbeat must carry the node's own credential (tunnel_token, "
                               "as its registration answered); upgrade the worker")
        capacity = parse_capacity(body.get("capacity"))
        try:
            # One statement for a whole batch of beats (--heartbeat-batch, cluster/nodes.py).
            status = await parts.nodes.beat(node_id, credential, capacity)
        except (Unauthorized, NodeNotFound):
            raise unknown from None  # as for an unknown id: the worker registers again
        except InvalidNodeInput as e:
            if e.field == "id":
                raise unknown from None
            raise bad_request(str(e), field=e.field) from None
        if self._hold_connection is not None:
            self._hold_connection(request, node_id)
        return 200, {"status": status.value}


def _rate_limited(why: str, limit: SourceRateLimit, wait: float) -> APIError:
    retry = limit.retry_after(wait)
    return APIError(429, f"{why}; retry after {retry} s", "rate_limited",
                    headers={"Retry-After": retry})


def is_heartbeat_path(path: bytes) -> bool:
    """Whether ``path`` is a node's heartbeat (whose successful answers get no access line)."""
    return path.startswith(b"/api/node/") and path.endswith(b"/heartbeat")
