"""Every route of a frontend replica in one table: where it is mounted, what answers it, which
credential its header guard checks, its body cap, whether its body goes to a temporary file,
and the shape of an answer given before its body.

The listener's policies (:func:`apply_policies`) and the resource tree (:func:`build_root`)
are both derived from :data:`ROUTES`, the way ``api/openai/resource.py`` derives its mounts
from its own ``ROUTES``: a path is described once, so a resource can never be mounted without
the guard and cap its path needs.  docs/operators.md ("Limits") and docs/security.md (the
credentials table) describe the same rows for operators.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from twisted.web.resource import Resource

from localai_tw import __version__

from localai_tw.frontend.api import anthropic
from localai_tw.frontend.api.anthropic.resource import MessagesResource
from localai_tw.frontend.api.backends import BackendGalleryResource, NodeBackends
from localai_tw.frontend.api.dashboard import RootWithDashboard, dashboard_files
from localai_tw.frontend.api.discovery import (
    FeaturesResource,
    SystemResource,
    VersionResource,
    WellKnownResource,
)
from localai_tw.frontend.api.gallery import GalleryResource, ModelsRoot
from localai_tw.frontend.api.generated import GeneratedFiles, GeneratedFilesResource
from localai_tw.frontend.api.jobs import MAX_JOB_BODY_BYTES, JobsResource
from localai_tw.frontend.api.kit import APIKeyGuard, JSONDirectory
from localai_tw.frontend.api.lifecycle import BackendResource
from localai_tw.frontend.api.metrics import MetricsResource, NodeMetricsRouting
from localai_tw.frontend.api.nodes import InstancesResource, LoadsResource, NodesAdminResource
from localai_tw.frontend.api.ollama import OllamaAPI, check_ollama_key, early_ollama_error
from localai_tw.frontend.api.openai import (
    OPENAI_MAX_BODY_BYTES,
    OpenAIResource,
    check_api_key,
    early_error,
    unprefixed_aliases,
    unprefixed_roots,
)
from localai_tw.frontend.api.openai.responses_api import ResponsesParts
from localai_tw.frontend.api.openai.transcription import TRANSCRIPTION_MAX_UPLOAD_BYTES
from localai_tw.frontend.api.scheduling import NodesWithScheduling, SchedulingResource
from localai_tw.frontend.api.traces import TraceRing, TracesResource
from localai_tw.frontend.api.workers import WorkerRegistrationResource
from localai_tw.tunnel.connect import connect_resource
from localai_tw.web.listener import BoundedSite

#: Header guards, by the credential they check.
OPENAI_KEY = "api key (OpenAI error shape)"
#: ``x-api-key`` or ``Authorization: Bearer``, any scope, refused in Anthropic's error shape.
ANTHROPIC_KEY = "api key (Anthropic error shape)"
ADMIN_KEY = "api key"
#: An inference or an admin key (jobs: the resource then scopes what a key sees).
ANY_KEY = "api key (any scope)"
#: The OpenAI API's key rule (open when no key is configured), in Ollama's error shape.
OLLAMA_KEY = "api key (Ollama error shape)"
REGISTRATION = "registration token"


@dataclass(frozen=True)
class Mount:
    """One row of :data:`ROUTES`.

    :param path: the raw path prefix (whole segments for guards and mounts; for caps, as
        :class:`~localai_tw.web.listener.BoundedSite` ``body_limits`` reads a prefix).
    :param build: ``build(wiring) -> Resource | None`` for the resource mounted at ``path``;
        None for a row that only sets a policy below another row's resource.
    :param guard: the credential the listener checks when the headers end (:data:`OPENAI_KEY`,
        :data:`ANTHROPIC_KEY`, :data:`ADMIN_KEY`, :data:`ANY_KEY`, :data:`REGISTRATION`), or
        None (the resource decides alone).
    :param body_cap: bytes; None: the listener's default (64 KiB).
    :param cap_of: take the body cap that this other path has (an unprefixed alias's twin).
    :param spool: the body (an upload) goes to a temporary file, still capped.
    """

    path: bytes
    build: Callable[["Wiring"], Resource | None] | None = None
    guard: str | None = None
    body_cap: int | None = None
    cap_of: bytes | None = None
    spool: bool = False


def _openai_rows() -> list[Mount]:
    rows = [Mount(b"/v1", lambda w: w.openai, guard=OPENAI_KEY),
            Mount(b"/v1/", body_cap=OPENAI_MAX_BODY_BYTES),
            Mount(b"/v1/audio/transcriptions", body_cap=TRANSCRIPTION_MAX_UPLOAD_BYTES,
                  spool=True)]
    # LocalAI's paths without /v1: mounted at each first segment, capped as their twin.
    for root in unprefixed_roots():
        build = (lambda w: w.models_root) if root == b"models" else (lambda w: w.unprefixed)
        rows.append(Mount(b"/" + root, build, guard=OPENAI_KEY))
    for alias, twin in unprefixed_aliases():
        rows.append(Mount(alias, cap_of=twin, spool=alias == b"/audio/transcriptions"))
    return rows


#: The replica's routes.  Order is mount order; a parent is mounted before its children.
ROUTES: tuple[Mount, ...] = (
    Mount(b"/dashboard", lambda w: dashboard_files()),
    Mount(b"/healthz", lambda w: w.probes[b"healthz"]),
    Mount(b"/readyz", lambda w: w.probes[b"readyz"]),
    Mount(b"/version", lambda w: VersionResource(w.version)),
    Mount(b"/.well-known", lambda w: JSONDirectory()),
    Mount(b"/.well-known/localai.json", lambda w: WellKnownResource(w.version, w.api_keys),
          guard=OPENAI_KEY),
    Mount(b"/system", lambda w: SystemResource(w.parts, w.api_keys), guard=ADMIN_KEY),
    *_openai_rows(),
    # Anthropic's Messages API: under /v1 (OpenAIResource hands its mounted children their
    # paths) and at the root, as LocalAI serves it.  The same leaf serves .../count_tokens,
    # under the same key guard and body cap (both are decided by path prefix).
    Mount(b"/v1/messages", lambda w: w.anthropic, guard=ANTHROPIC_KEY,
          body_cap=OPENAI_MAX_BODY_BYTES),
    Mount(b"/messages", lambda w: w.anthropic, guard=ANTHROPIC_KEY, cap_of=b"/v1/messages"),
    Mount(b"/backend", lambda w: BackendResource(w.replica.inference, w.api_keys),
          guard=ADMIN_KEY),
    Mount(b"/backends", lambda w: BackendGalleryResource(w.replica.gallery, w.api_keys)
          if w.replica.gallery is not None else None, guard=ADMIN_KEY),
    Mount(b"/generated-images", lambda w: GeneratedFilesResource(w.generated)),
    Mount(b"/metrics", lambda w: MetricsResource(w.replica.metrics, w.api_keys,
                                                 w.replica.tunnels, w.replica.control),
          guard=ADMIN_KEY),
    Mount(b"/api", lambda w: JSONDirectory()),
    Mount(b"/api/node", lambda w: w.registration, guard=REGISTRATION),
    # Ollama's API (docs/ollama-api.md): the inference key, Ollama's error shape
    Mount(b"/api/chat", lambda w: w.ollama.endpoint(b"chat"), guard=OLLAMA_KEY,
          body_cap=OPENAI_MAX_BODY_BYTES),
    Mount(b"/api/generate", lambda w: w.ollama.endpoint(b"generate"), guard=OLLAMA_KEY,
          body_cap=OPENAI_MAX_BODY_BYTES),
    Mount(b"/api/embed", lambda w: w.ollama.endpoint(b"embed"), guard=OLLAMA_KEY,
          body_cap=OPENAI_MAX_BODY_BYTES),
    Mount(b"/api/embeddings", lambda w: w.ollama.endpoint(b"embeddings"), guard=OLLAMA_KEY,
          body_cap=OPENAI_MAX_BODY_BYTES),
    Mount(b"/api/show", lambda w: w.ollama.endpoint(b"show"), guard=OLLAMA_KEY),
    Mount(b"/api/tags", lambda w: w.ollama.endpoint(b"tags"), guard=OLLAMA_KEY),
    Mount(b"/api/ps", lambda w: w.ollama.endpoint(b"ps"), guard=OLLAMA_KEY),
    Mount(b"/api/version", lambda w: w.ollama.endpoint(b"version"), guard=OLLAMA_KEY),
    Mount(b"/api/features", lambda w: FeaturesResource(w.api_keys), guard=OPENAI_KEY),
    Mount(b"/api/traces", lambda w: TracesResource(w.traces, w.api_keys), guard=ADMIN_KEY),
    Mount(b"/api/nodes", lambda w: NodeMetricsRouting(
        NodesWithScheduling(NodesAdminResource(w.parts, w.api_keys,
                                               NodeBackends(w.replica.gallery)),
                            SchedulingResource(w.parts, w.api_keys)), w.parts, w.api_keys),
          guard=ADMIN_KEY),
    Mount(b"/api/jobs", lambda w: JobsResource(w.replica.jobs.store, w.replica.jobs.kinds,
                                               w.replica.jobs.fanout, w.api_keys),
          guard=ANY_KEY, body_cap=MAX_JOB_BODY_BYTES),
    Mount(b"/api/cluster", lambda w: JSONDirectory()),
    Mount(b"/api/cluster/instances", lambda w: InstancesResource(w.parts, w.api_keys),
          guard=ADMIN_KEY),
    Mount(b"/api/cluster/loads", lambda w: LoadsResource(w.parts, w.api_keys), guard=ADMIN_KEY),
    Mount(b"/api/cluster/connect", lambda w: connect_resource(w.replica.nodes, w.replica.tunnels,
                                                              w.reactor)),
    Mount(b"/api/cluster/peer", lambda w: w.replica.peer_links.resource()),
)


def apply_policies(site: BoundedSite, api_keys: APIKeyGuard,
                   routes: tuple[Mount, ...] = ROUTES) -> None:
    """The listener's side of the table, from the moment it listens: body caps, uploads kept
    on disk, and the API-key guards (the registration token's guard needs the node registry
    and comes with :func:`build_root`)."""
    for row in routes:
        if row.body_cap is not None:
            site.add_body_limit(row.path, row.body_cap)
        if row.spool:
            site.spool_prefixes = (*site.spool_prefixes, row.path)
    for row in routes:  # after every explicit cap: an alias takes its twin's
        if row.cap_of is not None:
            site.add_body_limit(row.path, site.body_limit_for(row.cap_of))
    for row in routes:
        if row.guard == OPENAI_KEY:
            site.add_header_guard(row.path, functools.partial(check_api_key, api_keys))
            site.add_early_answer_shape(row.path, early_error)
        elif row.guard == OLLAMA_KEY:
            site.add_header_guard(row.path, functools.partial(check_ollama_key, api_keys))
            site.add_early_answer_shape(row.path, early_ollama_error)
        elif row.guard == ANTHROPIC_KEY:
            site.add_header_guard(row.path, functools.partial(anthropic.check_api_key,
                                                              api_keys))
            site.add_early_answer_shape(row.path, anthropic.early_error)
        elif row.guard == ADMIN_KEY:
            site.add_header_guard(row.path, api_keys.check)
        elif row.guard == ANY_KEY:
            site.add_header_guard(row.path, api_keys.check_any)


#: The models loaded on some node (Ollama's ``/api/ps``).
_LOADED_SQL = "SELECT DISTINCT model_name FROM node_models WHERE state = 'loaded'"


class Wiring:
    """What the rows' builders use: the wired replica and the parts built from it once."""

    def __init__(self, replica, *, api_keys: APIKeyGuard, reactor,
                 probes: Mapping[bytes, Resource], site: BoundedSite):
        self.replica = replica
        self.api_keys = api_keys
        self.reactor = reactor
        self.probes = probes
        self.site = site

    @property
    def version(self) -> str:
        """The version this replica publishes (its membership row), else the package's."""
        identity = getattr(self.replica, "identity", None)
        return identity.version if identity is not None else __version__

    @functools.cached_property
    def parts(self):
        return self.replica.cluster_parts()

    @functools.cached_property
    def generated(self) -> GeneratedFiles:
        return GeneratedFiles(self.replica.db)

    @functools.cached_property
    def openai(self) -> OpenAIResource:
        return OpenAIResource(self.replica.inference, api_keys=self.api_keys,
                              reactor=self.reactor, node_names=self.replica.node_name,
                              metrics=self.replica.metrics, generated=self.generated,
                              responses=ResponsesParts.of(self.replica.responses,
                                                          self.api_keys))

    @functools.cached_property
    def ollama(self) -> OllamaAPI:
        """Ollama's endpoints (one row each in :data:`ROUTES`), over the same router."""
        db = self.replica.db

        async def loaded() -> list[str]:
            rows = await db.runQuery(_LOADED_SQL)
            return [name for (name,) in rows]

        return OllamaAPI(self.replica.inference, api_keys=self.api_keys, reactor=self.reactor,
                         node_names=self.replica.node_name, metrics=self.replica.metrics,
                         loaded=loaded)

    @functools.cached_property
    def anthropic(self) -> MessagesResource:
        """/v1/messages and /messages: Anthropic's Messages API over the shared chat turn."""
        return MessagesResource(self.openai, self.api_keys)

    @functools.cached_property
    def unprefixed(self) -> Resource:
        """/chat/completions, /models ... (LocalAI's aliases of the /v1 routes)."""
        return self.openai.unprefixed()

    @functools.cached_property
    def models_root(self) -> Resource:
        """/models: LocalAI's gallery routes (admin) beside the unprefixed /models."""
        gallery = self.replica.gallery
        return ModelsRoot(GalleryResource(gallery, self.api_keys) if gallery is not None
                          else None, self.unprefixed)

    @functools.cached_property
    def registration(self) -> WorkerRegistrationResource:
        return WorkerRegistrationResource(self.parts, hold_connection=self.site.hold_connection,
                                          clock=self.reactor)

    @functools.cached_property
    def traces(self) -> TraceRing:
        ring = TraceRing()  # the recent requests, from the metrics' records
        ring.watch(self.replica.metrics)
        return ring


def build_root(wiring: Wiring, index: Mapping[str, Any],
               routes: tuple[Mount, ...] = ROUTES) -> Resource:
    """The resource tree of a wired replica, from the table; and the registration token's
    header guard, checked by the node registry that exists from now on."""
    root = RootWithDashboard(index)  # the page for a browser, JSON for the rest
    mounted: dict[bytes, Resource] = {b"": root}
    for row in routes:
        if row.build is None:
            continue
        resource = row.build(wiring)
        if resource is None:
            continue
        parent, _, name = row.path.rpartition(b"/")
        mounted[parent].putChild(name, resource)
        mounted[row.path] = resource
    for row in routes:
        if row.guard == REGISTRATION:
            wiring.site.add_header_guard(row.path, wiring.registration.guard)
    return root
