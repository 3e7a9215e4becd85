"""The pinning API: ``/api/nodes/scheduling`` (behind ``--api-key``), and the small resource
that mounts it beside the nodes admin API.

=============================================  ===============================================
route                                          answer
=============================================  ===============================================
POST /api/nodes/scheduling                     body ``{"model_name", "node_selector": {k: v},
                                               "min_replicas"?, "max_replicas"?}``; upserts
                                               the model's ``model_scheduling_configs`` row;
                                               answers the row
GET /api/nodes/scheduling                      ``{"configs": [row, ...]}`` ordered by model
GET /api/nodes/scheduling/{model_name}         the row, or 404
DELETE /api/nodes/scheduling/{model_name}      ``{"deleted": true}``, or 404
=============================================  ===============================================

A row is ``{"model_name", "node_selector", "min_replicas", "max_replicas", "updated_at"}``.  The
selector applies to the next placement (cold load); models already loaded elsewhere stay until
unloaded or reaped.  ``min_replicas`` and ``max_replicas`` are acted on by
``frontend/inference/replicas.py`` (a floor kept loaded; a busy model's further replicas, up to the
maximum; 0 or 1 = one replica).  This module only reads and writes ``model_scheduling_configs``; it must
never touch ``node_models`` or a worker.
"""

from __future__ import annotations

import re

from twisted.web.resource import Resource

from localai_tw.frontend.api.kit import (

    AdminResource,

    APIKeyGuard,

    ClusterParts,

    printable,

    read_json_object,

    reject_unknown_fields,

    Route,

)

from localai_tw.web.errors import bad_request, not_found

_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
MAX_SELECTOR_PAIRS = 32
_COLUMNS = "model_name, node_selector, min_replicas, max_replicas, updated_at"


def _row(r) -> dict:
    return {"model_name": r[0], "node_selector": r[1], "min_replicas": r[2],
            "max_replicas": r[3], "updated_at": r[4].isoformat() if r[4] else None}


def _model_name(raw, field="model_name") -> str:
    if not isinstance(raw, str) or not raw or len(raw) > 255:
        raise bad_request(f"{field} must be a non-empty string of at most 255 characters",
                          field=field)
    return raw


class SchedulingResource(AdminResource):
    """``/api/nodes/scheduling``.  :param parts: the replica's ``ClusterParts``."""

    def __init__(self, parts: ClusterParts, guard: APIKeyGuard):
        super().__init__(guard)
        self._parts = parts

    def routes(self):
        return (
            Route("GET", (), self.list_configs),
            Route("POST", (), self.upsert),
            Route("GET", ("{model_name}",), self.get_config),
            Route("DELETE", ("{model_name}",), self.delete_config),
        )

    async def list_configs(self, request):
        db = self._parts.db
        rows = await db.runQuery(f"SELECT {_COLUMNS} FROM model_scheduling_configs"
                                 " ORDER BY model_name")
        return 200, {"configs": [_row(r) for r in rows]}

    async def get_config(self, request, model_name):
        db = self._parts.db
        rows = await db.runQuery(f"SELECT {_COLUMNS} FROM model_scheduling_configs"
                                 " WHERE model_name = %s", (model_name,))
        if not rows:
            raise not_found(f"no scheduling config for model {printable(model_name)!r}")
        return 200, _row(rows[0])

    async def delete_config(self, request, model_name):
        db = self._parts.db
        rows = await db.runQuery("DELETE FROM model_scheduling_configs WHERE model_name = %s"
                                 " RETURNING model_name", (model_name,))
        if not rows:
            raise not_found(f"no scheduling config for model {printable(model_name)!r}")
        self._changed(model_name)
        return 200, {"deleted": True, "model_name": model_name}

    def _changed(self, model_name: str) -> None:
        if self._parts.on_scheduling_changed is not None:
            self._parts.on_scheduling_changed(model_name)

    async def upsert(self, request):
        import json

        db = self._parts.db
        body = read_json_object(request)
        reject_unknown_fields(body, ("model_name", "node_selector", "min_replicas",
                                     "max_replicas"))
        name = _model_name(body.get("model_name"))
        selector = body.get("node_selector", {})
        if not isinstance(selector, dict) or len(selector) > MAX_SELECTOR_PAIRS:
            raise bad_request(f"node_selector must be an object of at most "
                              f"{MAX_SELECTOR_PAIRS} label: value pairs", field="node_selector")
        for key, value in selector.items():
            if not _LABEL_KEY_RE.match(key):
                raise bad_request(f"node_selector key {printable(key)!r} is not a label key",
                                  field=f"node_selector.{printable(key)}")
            if not isinstance(value, str) or len(value) > 255:
                raise bad_request("node_selector values must be strings (at most 255)",
                                  field=f"node_selector.{printable(key)}")
        bounds = {}
        for field in ("min_replicas", "max_replicas"):
            value = body.get(field, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1000:
                raise bad_request(f"{field} must be an integer between 0 and 1000", field=field)
            bounds[field] = value
        if bounds["max_replicas"] and bounds["min_replicas"] > bounds["max_replicas"]:
            raise bad_request("min_replicas must not exceed max_replicas (when max_replicas is set)",
                              field="min_replicas")
        rows = await db.runQuery(
            "INSERT INTO model_scheduling_configs (model_name, node_selector, min_replicas,"
            " max_replicas) VALUES (%s, %s::jsonb, %s, %s)"
            " ON CONFLICT (model_name) DO UPDATE SET node_selector = EXCLUDED.node_selector,"
            " min_replicas = EXCLUDED.min_replicas, max_replicas = EXCLUDED.max_replicas,"
            f" updated_at = now() RETURNING {_COLUMNS}",
            (name, json.dumps(selector), bounds["min_replicas"], bounds["max_replicas"]))
        self._changed(name)
        return 200, _row(rows[0])


class NodesWithScheduling(Resource):
    """``/api/nodes``: ``scheduling`` goes to :class:`SchedulingResource`, everything else to
    the nodes admin resource (a leaf), with the path segment given back."""

    def __init__(self, nodes_resource: Resource, scheduling: Resource):
        super().__init__()
        self._nodes = nodes_resource
        self._scheduling = scheduling

    def getChildWithDefault(self, path, request):
        if path == b"scheduling":
            return self._scheduling
        # Undo the traversal step: the nodes resource is a leaf that routes on postpath.
        request.postpath.insert(0, request.prepath.pop())
        return self._nodes

    def render(self, request):
        return self._nodes.render(request)
