"""The admin API over workers and replicas, behind ``--api-key``.

Mounted at ``/api/nodes`` (:class:`NodesAdminResource`) and ``/api/cluster/instances``
(:class:`InstancesResource`).  Every request needs ``Authorization: Bearer <API key>``; with no
key configured every request is refused (401, see ``localai_tw.frontend.api.kit.APIKeyGuard``).

=================================  =============================================================
route                              answer
=================================  =============================================================
GET /api/nodes[?status=&node_type=&limit=&after=]
                                   ``{"nodes": [node, ...], "next": name | null}`` ordered by
                                   name, at most ``limit`` (default and maximum 1000) per
                                   page; pass ``next`` as ``after`` for the next page
GET /api/nodes/{id}                node (``{id}`` is a node id, or else a node name, on every
                                   route below)
PUT /api/nodes/{id}/labels         body ``{"labels": {k: v}}`` replaces every label;
                                   ``{"id", "labels"}``
GET /api/nodes/{id}/labels         ``{"id", "labels"}``
POST /api/nodes/{id}/approve       pending -> healthy; 409 ``not_pending`` otherwise
POST /api/nodes/{id}/drain         takes no new work; 409 ``not_approved`` for a pending node
POST /api/nodes/{id}/resume        draining -> healthy; 409 ``not_draining`` otherwise
DELETE /api/nodes/{id}             deletes the node (labels, model rows, connection row); a
                                   tunnel this replica holds for it is closed
GET /api/nodes/{id}/status         the worker's own ``node.status`` answer, through its tunnel
GET /api/nodes/{id}/backends       the worker's ``backend.list`` answer, through its tunnel
GET /api/nodes/{id}/backend-logs/{model}
                                   the worker's ``backend.logs`` answer for one model
POST /api/nodes/{id}/models/{model}/unload
                                   stops the model on that node (body ``{"force"?: bool}``,
                                   may be empty); the row follows the worker's answer
                                   (``frontend/inference/lifecycle.py``; statuses in
                                   ``frontend/api/lifecycle.py``)
GET /api/cluster/instances         ``{"instances": [{"id", "version", "advertised_addr",
                                   "last_seen", "registered_at", "self"}]}`` (live replicas;
                                   no credential material)
GET /api/cluster/loads             ``{"loads": [{"model", "node_id", "phase", "replica",
                                   "started_at", "seconds", "seconds_since_progress",
                                   "staging"}], "downloads": [{"model", "file", "url",
                                   "received", "total", "bytes_per_second", "seconds",
                                   "waiting_requests", "replica"}]}`` (cold loads in
                                   progress anywhere, with ``staging``: ``{"staged_bytes",
                                   "total_bytes", "files", "bytes_per_second"}`` from the
                                   replica driving a load in its ``staging`` phase, else null;
                                   this replica's model downloads)
=================================  =============================================================

A node is ``{"id", "name", "node_type", "status", "approved", "approved_at", "unapproved",
"new", "labels", "capacity": {...},
"gpu_vendor", "max_replicas_per_model", "last_heartbeat", "created_at", "owner": {"replica",
"epoch"} | null, "presence", "never_connected", "models": [{"model_name", "replica_index",
"state", "in_flight", "backend_type", "last_used", "note"}]}`` (``in_flight``: requests in
flight through this replica; ``note``: what the worker changed when it started the model's
backend, e.g. llama.cpp's extra buffer types off after a crash on an AMX CPU, else null).
``owner`` is the *live* replica holding the node's tunnel (null when none does); ``presence`` is ``connected``, ``reconnecting``, ``unknown`` or
``gone``, and when the presence query failed it is ``unknown`` with ``presence_error`` set.
``reconnect_grace_left`` is the seconds of the reconnect grace left to a ``reconnecting`` node
whose departure is recorded (null otherwise).
``unapproved`` is true while no administrator has approved the node (``approved_at`` null):
pending, or admitted by registration alone without ``--require-approval``; ``new`` is true for
a day after its first registration.  A new, unapproved node is one to look at: it takes cold
loads, and with them users' prompts, like any other.
``never_connected`` is true when no tunnel of the node is on record (it never dialled in, or its
last departure is older than the departure retention), false otherwise and on a failed query.  Unknown ids are 404, bad
input 400 naming the field, every refusal ``{"error": {"message", "type", ...}}``.

The three routes that ask the worker go through this replica's tunnel or the relay to the
owner, like any control call.  Their failures keep the four conditions apart in the status and
``code``: a routing fact is 503 ``routing-fact`` ("no route"), a connection absent within the
grace 503 ``absent-within-grace`` with ``Retry-After``, an unreachable peer replica 503
``peer-unreachable``, the worker's own failure 502 ``worker-answer`` with its message, the
deadline 504.

This module must never show credential material (hashes included), never change a node except
through the ``NodeRegistry``, and never act on presence or on a failed call (it only reports
them).  Its one query of its own is a read of ``node_models``; a page of nodes costs four
statements whatever its size (nodes, labels, models, connections).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from twisted.logger import Logger

from localai_tw import errors
from localai_tw.cluster.membership import live_instances
from localai_tw.cluster.nodes import (
    InvalidNodeInput,
    Node,
    NodeCapacity,
    NodeNotFound,
    NodeStatus,
    NodeType,
    NotPending,
)
from localai_tw.cluster.ownership import ConnectionView, Presence

from localai_tw.frontend.api.kit import (

    AdminResource,

    APIKeyGuard,

    call_hook,

    ClusterParts,

    DATABASE_DOWN,

    printable,

    read_json_object,

    reject_unknown_fields,

    Route,

    worker_call_error,

)

from localai_tw.web.errors import APIError, bad_request, conflict, not_found
from localai_tw.frontend.api.lifecycle import answer_results, force_field
from localai_tw.frontend.api.workers import valid_node_id

log = Logger()

_MODELS_SQL = (
    "SELECT node_id, model_name, replica_index, state, in_flight, backend_type, last_used,"
    " note FROM node_models WHERE node_id = ANY(%s) ORDER BY model_name, replica_index"
)



def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _unknown_node(node_id: str):
    return not_found(f"unknown node {printable(node_id)!r}")


def _query_arg(request, name: bytes) -> str | None:
    values = request.args.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise bad_request(f"{name.decode()} may be given once", field=name.decode())
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(f"{name.decode()} is not UTF-8", field=name.decode()) from None


#: Budget of one admin question to a worker (dial, relay and answer).
WORKER_CALL_TIMEOUT = 30.0


#: Nodes per page of ``GET /api/nodes`` when ``limit`` is not given, and the most it may ask.
NODES_PAGE = 1000


def _page_limit(raw: str | None) -> int:
    if raw is None:
        return NODES_PAGE
    if not raw.isdigit() or not 1 <= int(raw) <= NODES_PAGE:
        raise bad_request(f"limit must be a whole number from 1 to {NODES_PAGE}", field="limit")
    return int(raw)


#: How long after its first registration a node is shown as new.
NEW_NODE_SECONDS = 24 * 3600


def _is_new(created_at) -> bool:
    if created_at is None:
        return False
    return (datetime.now(timezone.utc) - created_at).total_seconds() < NEW_NODE_SECONDS


class NodesAdminResource(AdminResource):
    """``/api/nodes``: list, inspect, label, approve, drain, resume and delete workers.

    :param parts: the replica's ``ClusterParts``.
    :param guard: the :class:`APIKeyGuard` every request must pass.
    """

    def __init__(self, parts: ClusterParts, guard: APIKeyGuard, backends=None):
        super().__init__(guard)
        self._parts = parts
        #: the per-node backend installs (``api/backends.py`` ``NodeBackends``), or None
        self._backends = backends

    def routes(self):
        return (
            Route("GET", (), self.list_nodes),
            Route("POST", ("{node_id}", "backends", "install"), self.install_backend),
            Route("POST", ("{node_id}", "backends", "delete"), self.delete_backend),
            Route("GET", ("{node_id}",), self.get_node),
            Route("DELETE", ("{node_id}",), self.delete_node),
            Route("GET", ("{node_id}", "labels"), self.get_labels),
            Route("PUT", ("{node_id}", "labels"), self.put_labels),
            Route("POST", ("{node_id}", "approve"), self.approve),
            Route("POST", ("{node_id}", "drain"), self.drain),
            Route("POST", ("{node_id}", "resume"), self.resume),
            Route("GET", ("{node_id}", "status"), self.worker_status),
            Route("GET", ("{node_id}", "backends"), self.worker_backends),
            Route("GET", ("{node_id}", "backend-logs", "{model}"), self.worker_backend_logs),
            Route("POST", ("{node_id}", "models", "{model}", "unload"), self.unload_model),
        )

    # -- reads ---------------------------------------------------------------------------------

    async def list_nodes(self, request) -> tuple[int, dict]:
        parts = self._parts
        status = _query_arg(request, b"status")
        node_type = _query_arg(request, b"node_type")
        if status is not None and status not in {s.value for s in NodeStatus}:
            raise bad_request(f"status must be one of {', '.join(s.value for s in NodeStatus)}",
                              field="status")
        if node_type is not None and node_type not in {t.value for t in NodeType}:
            raise bad_request(f"node_type must be one of "
                              f"{', '.join(t.value for t in NodeType)}", field="node_type")
        limit = _page_limit(_query_arg(request, b"limit"))
        after = _query_arg(request, b"after")
        nodes = await parts.nodes.list_nodes(status=status, node_type=node_type, after=after,
                                             limit=limit + 1)
        more = len(nodes) > limit
        nodes = nodes[:limit]
        return 200, {"nodes": await self._views(parts, nodes),
                     "next": nodes[-1].name if more else None}

    async def get_node(self, request, node_id: str) -> tuple[int, dict]:
        parts = self._parts
        node = await self._node(parts, node_id)
        return 200, (await self._views(parts, [node]))[0]

    async def get_labels(self, request, node_id: str) -> tuple[int, dict]:
        parts = self._parts
        node = await self._node(parts, node_id)
        return 200, {"id": node.id, "labels": dict(node.labels)}

    @staticmethod
    async def _node(parts, node_id: str) -> Node:
        """The node whose id is ``node_id``, or else whose name is (``X-LocalAI-Node`` and
        the logs name nodes; an id wins over an equal name)."""
        if valid_node_id(node_id):
            try:
                return await parts.nodes.get_node(node_id)
            except (NodeNotFound, InvalidNodeInput):
                pass
        try:
            return await parts.nodes.get_node_by_name(node_id)
        except (NodeNotFound, InvalidNodeInput):
            raise _unknown_node(node_id) from None

    async def _views(self, parts, nodes: list[Node]) -> list[dict]:
        """The views of ``nodes`` in a fixed number of statements (models, connections),
        whatever their count."""
        if not nodes:
            return []
        ids = [n.id for n in nodes]
        rows = await parts.db.runQuery(_MODELS_SQL, (ids,))
        models: dict[str, list[dict]] = {}
        use = getattr(parts.lifecycle, "use", None)
        for node_id, model_name, replica_index, state, in_flight, backend_type, last_used, \
                note in rows:
            if use is not None:
                in_flight = use.in_flight(node_id, model_name)
            models.setdefault(node_id, []).append({
                "model_name": model_name, "replica_index": replica_index, "state": state,
                "in_flight": in_flight, "backend_type": backend_type,
                "last_used": _iso(last_used), "note": note or None})
        connections: dict[str, ConnectionView] = {}
        failed: BaseException | None = None
        try:
            connections = await parts.fence.connections(ids, parts.reconnect_grace)
        except DATABASE_DOWN as e:
            log.warn("presence of {count} nodes unknown, query failed: {err}",
                     count=len(ids), err=e)
            failed = e
        return [self._view(node, models.get(node.id, []), connections.get(node.id), failed)
                for node in nodes]

    @staticmethod
    def _view(node: Node, models: list[dict], connection: ConnectionView | None,
              failed: BaseException | None) -> dict[str, Any]:
        presence = connection.presence if connection is not None else Presence.UNKNOWN
        owner = connection.owner if connection is not None else None
        view: dict[str, Any] = {
            "id": node.id,
            "name": node.name,
            "node_type": node.node_type.value,
            "status": node.status.value,
            "approved": node.approved,
            "approved_at": _iso(node.approved_at),
            # Issue 21 §6: no administrator approved it (pending, or admitted by open or
            # token registration without --require-approval), and registered recently.
            "unapproved": node.approved_at is None,
            "new": _is_new(node.created_at),
            "labels": dict(node.labels),
            "capacity": {name: getattr(node, name) for name in NodeCapacity.FIELDS},
            "gpu_vendor": node.gpu_vendor,
            "max_replicas_per_model": node.max_replicas_per_model,
            "last_heartbeat": _iso(node.last_heartbeat),
            "created_at": _iso(node.created_at),
            "owner": None if owner is None else {"replica": owner.owner_id,
                                                 "epoch": owner.epoch},
            "presence": presence.value,
            # No connection record at all (not a failed query): it never dialled in, or its
            # last departure outlived the departure retention.  A node that heartbeats with
            # this true is registered but not reachable (docs/routing.md).
            "never_connected": connection is None and failed is None,
            "models": models,
            "reconnect_grace_left": None,
        }
        if connection is not None and connection.grace_left is not None:
            view["reconnect_grace_left"] = round(connection.grace_left, 1)
        if failed is not None:
            view["presence_error"] = f"presence query failed ({type(failed).__name__})"
        return view

    # -- changes -------------------------------------------------------------------------------

    async def put_labels(self, request, node_id: str) -> tuple[int, dict]:
        parts = self._parts
        node_id = (await self._node(parts, node_id)).id
        body = read_json_object(request)
        reject_unknown_fields(body, ("labels",))
        if "labels" not in body:
            raise bad_request("labels is required: an object of label key -> value (it "
                              "replaces every label of the node)", field="labels")
        if not isinstance(body["labels"], dict):
            raise bad_request("labels must be an object of label key -> value", field="labels")
        try:
            labels = await parts.nodes.set_labels(node_id, body["labels"], replace=True)
        except NodeNotFound:
            raise _unknown_node(node_id) from None
        except InvalidNodeInput as e:
            raise bad_request(str(e), field=e.field) from None
        log.info("node {node}: labels replaced by an administrator ({count} labels)",
                 node=node_id, count=len(labels))
        return 200, {"id": node_id, "labels": labels}

    async def approve(self, request, node_id: str) -> tuple[int, dict]:
        parts = self._parts
        node = await self._node(parts, node_id)
        try:
            await parts.nodes.approve(node.id)
        except NodeNotFound:
            raise _unknown_node(node_id) from None
        except NotPending:
            current = await self._node(parts, node_id)
            raise conflict(f"node {printable(node_id)!r} is not pending approval (status "
                           f"{current.status.value})", code="not_pending") from None
        log.info("node {node} ({name}) approved by an administrator", node=node.id,
                 name=node.name)
        return 200, {"id": node.id, "status": (await self._node(parts, node_id)).status.value}

    async def drain(self, request, node_id: str) -> tuple[int, dict]:
        parts = self._parts
        node = await self._node(parts, node_id)
        try:
            changed = await parts.nodes.drain(node.id)
        except NodeNotFound:
            raise _unknown_node(node_id) from None
        current = await self._node(parts, node_id)
        if current.status is not NodeStatus.DRAINING:
            raise conflict(f"node {printable(node_id)!r} cannot drain: it is not approved "
                           f"(status {current.status.value}); approve it first",
                           code="not_approved")
        if changed:
            log.info("node {node} ({name}) draining (administrator)", node=node.id,
                     name=node.name)
        return 200, {"id": node.id, "status": current.status.value}

    async def resume(self, request, node_id: str) -> tuple[int, dict]:
        parts = self._parts
        node = await self._node(parts, node_id)
        if node.status is not NodeStatus.DRAINING:
            raise conflict(f"node {printable(node_id)!r} is not draining (status "
                           f"{node.status.value})", code="not_draining")
        try:
            await parts.nodes.mark_healthy(node.id)
        except NodeNotFound:
            raise _unknown_node(node_id) from None
        log.info("node {node} ({name}) resumed (administrator)", node=node.id, name=node.name)
        return 200, {"id": node.id, "status": (await self._node(parts, node_id)).status.value}

    # -- questions for the worker itself ---------------------------------------------------------

    async def worker_status(self, request, node_id: str) -> tuple[int, dict]:
        return 200, await self._ask_worker(node_id, "node.status", {})

    async def worker_backends(self, request, node_id: str) -> tuple[int, dict]:
        answer = await self._ask_worker(node_id, "backend.list", {})
        if self._backends is not None:  # LocalAI's list: the backends installed there
            answer["installed"] = await self._backends.installed(
                await self._node(self._parts, node_id))
        return 200, answer

    def _node_backends(self):
        if self._backends is None:
            raise APIError(503, "backend installs are not available on this replica",
                           "service_unavailable")
        return self._backends

    async def install_backend(self, request, node_id: str) -> tuple[int, dict]:
        backends = self._node_backends()
        return await backends.install(request, await self._node(self._parts, node_id))

    async def delete_backend(self, request, node_id: str) -> tuple[int, dict]:
        backends = self._node_backends()
        return await backends.delete(request, await self._node(self._parts, node_id))

    async def worker_backend_logs(self, request, node_id: str, model: str) -> tuple[int, dict]:
        if not model or len(model) > 255:
            raise bad_request("model must be a name of 1 to 255 characters", field="model")
        return 200, await self._ask_worker(node_id, "backend.logs", {"model": model})

    async def unload_model(self, request, node_id: str, model: str) -> tuple[int, dict]:

        if not model or len(model) > 255:
            raise bad_request("model must be a name of 1 to 255 characters", field="model")
        body = read_json_object(request, required=False)
        reject_unknown_fields(body, ("force",))
        force = force_field(body)
        parts = self._parts
        node = await self._node(parts, node_id)
        if parts.lifecycle is None:
            raise APIError(503, "this replica cannot unload models yet (starting)",
                           "service_unavailable", code="starting",
                           headers={"Retry-After": "5"})
        result = await parts.lifecycle.unload(model, node.id, force=force)
        return answer_results([result])

    async def _ask_worker(self, node_id: str, verb: str, body: dict) -> dict:
        parts = self._parts
        node = await self._node(parts, node_id)
        if parts.control is None:
            raise APIError(503, "this replica cannot call workers yet (starting)",
                           "service_unavailable", code="starting",
                           headers={"Retry-After": "5"})
        try:
            answer = await parts.control.call(node.id, verb, body, timeout=WORKER_CALL_TIMEOUT)
        except errors.ClusterError as e:
            raise worker_call_error(e) from None
        return {"id": node.id, "answer": answer}

    async def delete_node(self, request, node_id: str) -> tuple[int, dict]:
        parts = self._parts
        node_id = (await self._node(parts, node_id)).id
        try:
            await parts.nodes.delete_node(node_id)
        except (NodeNotFound, InvalidNodeInput):
            raise _unknown_node(node_id) from None
        log.info("node {node} deleted by an administrator", node=node_id)
        await call_hook("on_deleted", parts.on_deleted, node_id)
        return 200, {"id": node_id, "deleted": True}


class InstancesResource(AdminResource):
    """``/api/cluster/instances``: the live replicas, as the database clock sees them."""

    def __init__(self, parts: ClusterParts, guard: APIKeyGuard):
        super().__init__(guard)
        self._parts = parts

    def routes(self):
        return (Route("GET", (), self.list_instances),)

    async def list_instances(self, request) -> tuple[int, dict]:
        parts = self._parts
        instances = await live_instances(parts.db)
        return 200, {"instances": [
            {"id": i.id, "version": i.version, "advertised_addr": i.advertised_addr,
             "last_seen": _iso(i.last_seen), "registered_at": _iso(i.registered_at),
             "self": i.id == parts.instance_id}
            for i in instances]}


#: The cold loads in progress anywhere (one ``model_load_jobs`` row per model being loaded).
_LOADS_SQL = (
    "SELECT model_name, node_id, phase, owner_instance_id, started_at,"
    " EXTRACT(EPOCH FROM now() - started_at)::float,"
    " EXTRACT(EPOCH FROM now() - last_progress_at)::float"
    " FROM model_load_jobs ORDER BY started_at, model_name"
)


class LoadsResource(AdminResource):
    """``/api/cluster/loads``: the cold loads in progress across the cluster (the load lock's
    rows): model, node, phase (``choosing``, ``starting``, ``staging``, ``loading``), the
    replica driving it, and seconds since it started and since its last progress."""

    def __init__(self, parts: ClusterParts, guard: APIKeyGuard):
        super().__init__(guard)
        self._parts = parts

    def routes(self):
        return (Route("GET", (), self.list_loads),)
    async def list_loads(self, request) -> tuple[int, dict]:
        rows = await self._parts.db.runQuery(_LOADS_SQL)
        downloads = self._parts.downloads() if self._parts.downloads is not None else []
        return 200, {"loads": [
            {"model": model, "node_id": node_id or None, "phase": phase, "replica": owner,
             "started_at": _iso(started), "seconds": round(age, 1),
             "seconds_since_progress": round(quiet, 1),
             "staging": self._staging(model, owner, phase)}
            for model, node_id, phase, owner, started, age, quiet in rows],
            "downloads": [{**d, "replica": self._parts.instance_id} for d in downloads]}

    def _staging(self, model: str, owner: str, phase: str) -> dict | None:
        """Bytes staged so far, known to the replica driving the load (null elsewhere)."""
        parts = self._parts
        if phase != "staging" or owner != parts.instance_id or parts.staging is None:
            return None
        return parts.staging(model)
