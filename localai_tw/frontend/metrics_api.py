"""``GET /metrics``: the replica's Prometheus metrics (``docs/metrics.md``), behind the admin
API's key.

The metrics name models, nodes' paths and error rates: operational data of the same kind as
the admin API, so they follow its rule (``Authorization: Bearer <--api-key>``; with no key
configured ``/metrics`` is closed like ``/api/nodes``).  Prometheus sends the key with
``authorization: {credentials: ...}`` in its scrape config (``docs/prometheus.yml``).

This module must never expose another registry than the replica's, nor collect outside the
reactor thread (:func:`localai_tw.metrics.exposition` says why).
"""

from __future__ import annotations

from twisted.web.resource import Resource

from localai_tw.metrics import CONTENT_TYPE, ReplicaMetrics, exposition

from .web import APIError, APIKeyGuard, render_error


class MetricsResource(Resource):
    """The exposition of ``metrics.registry`` to GET and HEAD, after ``api_keys.check``."""

    isLeaf = True

    def __init__(self, metrics: ReplicaMetrics, api_keys: APIKeyGuard):
        super().__init__()
        self._metrics = metrics
        self._api_keys = api_keys

    def render(self, request) -> bytes:
        try:
            self._api_keys.check(request)
        except APIError as e:
            return render_error(request, e)
        if request.method not in (b"GET", b"HEAD"):
            return render_error(request, APIError(405, "use GET on /metrics", "method_not_allowed",
                                                  headers={"Allow": "GET, HEAD"}))
        body = exposition(self._metrics.registry)
        request.setHeader(b"content-type", CONTENT_TYPE.encode("ascii"))
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"content-length", b"%d" % len(body))
        return b"" if request.method == b"HEAD" else body
