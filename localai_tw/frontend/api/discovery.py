"""What monitoring and user interfaces ask a LocalAI server first, in LocalAI's shapes
(``core/http/routes/localai.go``, ``core/http/endpoints/localai/system.go``):

=================================  ==========================================================
route                              answer
=================================  ==========================================================
GET /version                       ``{"version"}``: anyone (the one public route here;
                                   LocalAI's own is behind its key)
GET /.well-known/localai.json      ``{"version", "endpoints", "endpoint_groups",
                                   "capabilities"}``: the routes *this* server answers, in
                                   LocalAI's keys (:data:`ENDPOINT_GROUPS`); a key as for
                                   ``/v1`` (open when no key is configured)
GET /api/features                  LocalAI's feature flags, each as this server has it; a
                                   key as for ``/v1``
GET /system                        ``{"backends", "loaded_models": [{"id", "backend"}],
                                   "nodes": [{"id", "name", "node_type", "status",
                                   "backends", "models": [{"id", "backend", "state",
                                   "replica_index"}]}]}``: names the nodes, so the admin
                                   key
=================================  ==========================================================

Why here: LocalAI's web UI, its CLI and monitoring probes call these before anything else, and
a server that answers them 404 looks broken to them.  ``/system``'s ``nodes`` is an addition:
LocalAI answers for one process, a cluster has backends and models per node.

What this module must never do: list a route the server does not answer (a unit test walks
:data:`ENDPOINT_GROUPS` against the route tables), claim a feature it does not have, call a
worker (``/system`` reads the database only, two statements whatever the cluster's size), or
show credential material.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet import threads

from localai_tw.frontend.api.kit import (
    AdminResource,
    APIKeyGuard,
    ClusterParts,
    JSONResource,
    Route,
)
from localai_tw.frontend.api.openai import OpenAIError, check_api_key
from localai_tw.web.errors import APIError

#: ``/.well-known/localai.json``'s ``endpoint_groups``: LocalAI's group and entry names, only
#: the entries this server answers (``:name`` is a path parameter, as LocalAI writes it).
ENDPOINT_GROUPS: dict[str, dict[str, str]] = {
    "openai_compatible": {
        "models": "/v1/models",
        "model": "/v1/models/:id",
        "models_capabilities": "/v1/models/capabilities",
        "chat_completions": "/v1/chat/completions",
        "completions": "/v1/completions",
        "embeddings": "/v1/embeddings",
        "speech": "/v1/audio/speech",
        "transcription": "/v1/audio/transcriptions",
        "image_generation": "/v1/images/generations",
        "rerank": "/v1/rerank",
    },
    "model_management": {
        "list_gallery": "/models/available",
        "galleries": "/models/galleries",
        "install": "/models/apply",
        "jobs": "/models/jobs",
        "job": "/models/jobs/:uuid",
        "delete": "/models/delete/:name",
    },
    "ai_functions": {
        "tts": "/tts",
        "tokenize": "/v1/tokenize",
        "detokenize": "/v1/detokenize",
    },
    "monitoring": {
        "metrics": "/metrics",
        "backend_shutdown": "/backend/shutdown",
        "backend_load": "/backend/load",
        "system": "/system",
        "version": "/version",
        "features": "/api/features",
        "traces": "/api/traces",
        "nodes": "/api/nodes",
        "node_backends": "/api/nodes/:id/backends",
        "node_backend_logs_model": "/api/nodes/:id/backend-logs/:modelId",
        "healthz": "/healthz",
        "readyz": "/readyz",
    },
    "ui": {
        "dashboard": "/dashboard/",
        "chat": "/dashboard/chat.html",
        "gallery": "/dashboard/gallery.html",
    },
}

#: LocalAI's flat ``endpoints`` (kept there for older clients): the same, fewer.
ENDPOINTS: dict[str, str] = {
    name: ENDPOINT_GROUPS[group][name] for group, name in (
        ("openai_compatible", "models"), ("openai_compatible", "models_capabilities"),
        ("openai_compatible", "chat_completions"), ("openai_compatible", "completions"),
        ("openai_compatible", "embeddings"), ("ai_functions", "tts"),
        ("openai_compatible", "transcription"), ("openai_compatible", "image_generation"))}

#: ``capabilities`` of the discovery document: LocalAI's keys, this server's answers.
CAPABILITIES: dict[str, bool] = {
    "config_metadata": False, "config_patch": False, "vram_estimate": False, "mcp": False,
    "agents": False, "p2p": False, "tracing": True, "voice_profiles": False,
}

#: ``/api/features``: LocalAI's flags.  ``distributed`` is always true (a replica is part of a
#: cluster); LocalAI's agent pool, MCP, fine-tuning, quantization and assistant are not here.
FEATURES: dict[str, bool] = {
    "agents": False, "mcp": False, "fine_tuning": False, "quantization": False,
    "distributed": True, "localai_assistant": False,
}


class InferenceKeyResource(JSONResource):
    """A :class:`JSONResource` with ``/v1``'s key rule: open while no key is configured, else
    any key (inference or admin)."""

    def __init__(self, api_keys: APIKeyGuard | None):
        super().__init__()
        self._api_keys = api_keys

    def guard(self, request) -> None:
        try:
            check_api_key(self._api_keys, request)
        except OpenAIError as e:
            raise APIError(e.status, e.message, "authentication_error", code=e.code,
                           headers=e.headers) from None


class VersionResource(JSONResource):
    """``GET /version``: ``{"version"}`` and nothing else."""

    def __init__(self, version: str):
        super().__init__()
        self._version = version

    def routes(self):
        return (Route("GET", (), self.version), Route("HEAD", (), self.version))

    async def version(self, request):
        return 200, {"version": self._version}


class WellKnownResource(InferenceKeyResource):
    """``GET /.well-known/localai.json``."""

    def __init__(self, version: str, api_keys: APIKeyGuard | None):
        super().__init__(api_keys)
        self._version = version

    def routes(self):
        return (Route("GET", (), self.document), Route("HEAD", (), self.document))

    async def document(self, request):
        return 200, {"version": self._version, "endpoints": dict(ENDPOINTS),
                     "endpoint_groups": {g: dict(e) for g, e in ENDPOINT_GROUPS.items()},
                     "capabilities": dict(CAPABILITIES)}


class FeaturesResource(InferenceKeyResource):
    """``GET /api/features``."""

    def routes(self):
        return (Route("GET", (), self.features), Route("HEAD", (), self.features))

    async def features(self, request):
        return 200, dict(FEATURES)


_SYSTEM_MODELS_SQL = (
    "SELECT node_id, model_name, replica_index, state, backend_type FROM node_models"
    " ORDER BY model_name, replica_index"
)

#: Nodes listed by ``/system`` at most (``/api/nodes`` pages through more).
SYSTEM_MAX_NODES = 1000


def installed_backends() -> list[str]:
    """The backend names of this installation's plugins (the built-ins and any operator
    plugin), as a worker of the same installation resolves them."""
    from localai_tw.backends.interfaces import BackendFactories
    return BackendFactories.discover().names()


class SystemResource(AdminResource):
    """``GET /system``: LocalAI's ``{"backends", "loaded_models"}`` for the cluster, and per
    node its backends running and its models (admin key: it names the nodes).

    ``backends`` are the backends this replica's installation provides (a worker's
    ``--backends-path`` directories are the worker's own and are not listed), with every
    backend a node runs now; ``loaded_models`` are the models in state ``loaded`` on some node,
    once each, with the backend serving them.
    """

    def __init__(self, parts: ClusterParts, guard: APIKeyGuard,
                 backends: Callable[[], list[str]] = installed_backends):
        super().__init__(guard)
        self._parts = parts
        self._backends = backends
        self._known: list[str] | None = None

    def routes(self):
        return (Route("GET", (), self.system), Route("HEAD", (), self.system))

    async def system(self, request):
        if self._known is None:  # plugin discovery reads files: once, off the reactor
            self._known = list(await threads.deferToThread(self._backends))
        parts = self._parts
        nodes = await parts.nodes.list_nodes(limit=SYSTEM_MAX_NODES)
        rows = await parts.db.runQuery(_SYSTEM_MODELS_SQL)
        per_node: dict[str, list[dict[str, Any]]] = {}
        loaded: dict[str, str] = {}
        running: set[str] = set()
        for node_id, model, replica_index, state, backend in rows:
            per_node.setdefault(node_id, []).append({
                "id": model, "backend": backend or "", "state": state,
                "replica_index": replica_index})
            if backend:
                running.add(backend)
            if state == "loaded":
                loaded.setdefault(model, backend or "")
        views = []
        for node in nodes:
            models = per_node.get(node.id, [])
            views.append({
                "id": node.id, "name": node.name, "node_type": node.node_type.value,
                "status": node.status.value,
                "backends": sorted({m["backend"] for m in models if m["backend"]}),
                "models": models})
        return 200, {"backends": sorted(set(self._known) | running),
                     "loaded_models": [{"id": m, "backend": b} for m, b in
                                       sorted(loaded.items())],
                     "nodes": views}
