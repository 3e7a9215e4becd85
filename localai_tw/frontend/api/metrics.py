"""``GET /metrics``: the replica's Prometheus metrics (``docs/metrics.md``), and
``GET /api/nodes/{id}/metrics``: a worker's, asked through its tunnel; both behind the admin
API's key.

The metrics name models, nodes' paths and error rates: operational data of the same kind as
the admin API, so they follow its rule (``Authorization: Bearer <--api-key>``; with no key
configured ``/metrics`` is closed like ``/api/nodes``).  Prometheus sends the key with
``authorization: {credentials: ...}`` in its scrape config (``docs/prometheus.yml``).

This module must never expose another registry than the replica's, nor collect outside the
reactor thread (:func:`localai_tw.metrics.exposition` says why).
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from localai_tw import errors
from localai_tw.metrics import CONTENT_TYPE, ReplicaMetrics, exposition, gathered_exposition

from localai_tw.frontend.api.kit import worker_call_error
from localai_tw.frontend.api.nodes import WORKER_CALL_TIMEOUT, NodesAdminResource
from localai_tw.frontend.api.kit import APIKeyGuard, ClusterParts, render_error
from localai_tw.web.errors import APIError

log = Logger()


#: Seconds a worker has to answer ``node.metrics`` for ``/metrics/workers``.
WORKER_METRICS_TIMEOUT = 10.0
#: Largest worker exposition passed on (a worker's metrics are a few KiB).
MAX_WORKER_EXPOSITION = 4 * 1024 * 1024


class MetricsResource(Resource):
    """The exposition of ``metrics.registry`` to GET and HEAD, after ``api_keys.check``; and
    at ``/metrics/workers`` those of every worker whose tunnel ``tunnels`` holds, gathered
    through ``control`` (each sample labelled with its ``node``)."""

    isLeaf = True

    def __init__(self, metrics: ReplicaMetrics, api_keys: APIKeyGuard, tunnels=None,
                 control=None):
        super().__init__()
        self._metrics = metrics
        self._api_keys = api_keys
        self._tunnels = tunnels
        self._control = control

    def render(self, request) -> bytes:
        try:
            self._api_keys.check(request)
        except APIError as e:
            return render_error(request, e)
        if request.method not in (b"GET", b"HEAD"):
            return render_error(request, APIError(405, "use GET on /metrics",
                                                  "method_not_allowed",
                                                  headers={"Allow": "GET, HEAD"}))
        path = [s for s in request.postpath if s]
        if path == [b"workers"] and self._tunnels is not None and self._control is not None:
            gathering = defer.ensureDeferred(self._gather())
            gathering.addErrback(self._gather_failed)
            gathering.addCallback(lambda body: self._send_later(request, body))
            return NOT_DONE_YET
        if path:
            return render_error(request, APIError(404, "no such metrics (/metrics, "
                                                  "/metrics/workers)", "not_found"))
        return self._with_headers(request, exposition(self._metrics.registry))

    async def _gather(self) -> bytes:
        nodes = self._tunnels.held_nodes()
        calls = [defer.ensureDeferred(self._control.call(node, "node.metrics", {},
                                                         timeout=WORKER_METRICS_TIMEOUT))
                 for node in nodes]
        results = await defer.DeferredList(calls, consumeErrors=True)
        answers = []
        for node, (ok, answer) in zip(nodes, results):
            text = answer.get("exposition") if ok and isinstance(answer, dict) else None
            if isinstance(text, str) and len(text) > MAX_WORKER_EXPOSITION:
                text = None
            answers.append((node, text if isinstance(text, str) else None))
        return gathered_exposition(answers)

    def _gather_failed(self, failure) -> bytes:
        log.failure("gathering the metrics of the workers held here failed", failure)
        return gathered_exposition([])

    @staticmethod
    def _with_headers(request, body: bytes) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE.encode("ascii"))
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"content-length", b"%d" % len(body))
        return b"" if request.method == b"HEAD" else body

    def _send_later(self, request, body: bytes) -> None:
        if request.finished or request.channel is None:
            return  # the scraper left (its timeout is shorter than the workers' calls)
        request.write(self._with_headers(request, body))
        request.finish()


class NodeMetricsRouting(Resource):
    """``/api/nodes``: ``{id}/metrics`` to a :class:`NodeMetricsResource`, everything else to
    the nodes admin tree (``nodes``) exactly as if this resource were not there."""

    def __init__(self, nodes: Resource, parts: ClusterParts, api_keys: APIKeyGuard):
        super().__init__()
        self._nodes = nodes
        self._parts = parts
        self._api_keys = api_keys

    def getChildWithDefault(self, path, request):
        if request.postpath == [b"metrics"] and path not in (b"", b"scheduling"):
            return NodeMetricsResource(self._parts, self._api_keys,
                                       path.decode("utf-8", "replace"))
        return self._nodes.getChildWithDefault(path, request)

    def render(self, request):
        return self._nodes.render(request)


class NodeMetricsResource(Resource):
    """``GET /api/nodes/{id}/metrics``: the worker's own metrics (its ``node.metrics`` control
    verb, through its tunnel or the relay to its owner), in the Prometheus text format.  A
    failed call answers as every worker call of the admin API does (one status per
    condition)."""

    isLeaf = True

    def __init__(self, parts: ClusterParts, api_keys: APIKeyGuard, node: str):
        super().__init__()
        self._parts = parts
        self._api_keys = api_keys
        self._node = node

    def render(self, request):
        try:
            self._api_keys.check(request)
        except APIError as e:
            return render_error(request, e)
        if request.method not in (b"GET", b"HEAD"):
            return render_error(request, APIError(405, "use GET on /api/nodes/{id}/metrics",
                                                  "method_not_allowed",
                                                  headers={"Allow": "GET, HEAD"}))
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        answering = defer.ensureDeferred(self._answer(request))
        answering.addErrback(self._failed)
        answering.addCallback(lambda answer: None if gone else self._write(request, answer))
        return NOT_DONE_YET

    async def _answer(self, request) -> bytes | APIError:
        parts = self._parts
        try:
            node = await NodesAdminResource._node(parts, self._node)
        except APIError as e:
            return e
        if parts.control is None:
            return APIError(503, "this replica cannot call workers yet (starting)",
                            "service_unavailable", code="starting", headers={"Retry-After": "5"})
        try:
            answer = await parts.control.call(node.id, "node.metrics", {},
                                              timeout=WORKER_CALL_TIMEOUT)
        except errors.ClusterError as e:
            return worker_call_error(e)
        text = answer.get("exposition") if isinstance(answer, dict) else None
        if not isinstance(text, str) or len(text) > MAX_WORKER_EXPOSITION:
            return APIError(502, "the worker's metrics answer is not an exposition",
                            "upstream_error", code="bad_worker_answer")
        return text.encode("utf-8")

    def _failed(self, failure) -> APIError:
        log.failure("answering the metrics of node {node} failed", failure, node=self._node)
        return APIError(500, "internal error; see the frontend log", "server_error")

    def _write(self, request, answer: bytes | APIError) -> None:
        if isinstance(answer, APIError):
            body = render_error(request, answer)
        else:
            body = answer
            request.setHeader(b"content-type", CONTENT_TYPE.encode("ascii"))
            request.setHeader(b"cache-control", b"no-store")
            request.setHeader(b"content-length", b"%d" % len(body))
            if request.method == b"HEAD":
                body = b""
        request.write(body)
        request.finish()
