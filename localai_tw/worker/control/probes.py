"""``/healthz`` and ``/readyz`` of the worker's HTTP server: no credentials."""

from __future__ import annotations

from typing import Callable, Union

from twisted.internet import defer
from twisted.logger import Logger
from twisted.web import resource, server

from localai_tw.worker.control.replies import write_json, write_problem
from localai_tw.worker.httpserve import failure_summary

log = Logger()


class LivenessResource(resource.Resource):
    """``/healthz``: the worker's HTTP server is running.  No credentials."""

    isLeaf = True

    def render(self, request):
        if request.method not in (b"GET", b"HEAD"):
            write_problem(request, 405, "use GET", ((b"allow", b"GET, HEAD"),))
            return server.NOT_DONE_YET
        write_json(request, 200, {"alive": True})
        return server.NOT_DONE_YET


#: A readiness check returns ``None`` when ready, else the reason it is not (or a Deferred).
ReadinessCheck = Callable[[], Union[str, None, defer.Deferred]]


class ReadinessResource(resource.Resource):
    """``/readyz``: 200 when ``readiness()`` says ready, 503 with its reason otherwise."""

    isLeaf = True

    def __init__(self, readiness: ReadinessCheck):
        super().__init__()
        self.readiness = readiness

    def render(self, request):
        if request.method not in (b"GET", b"HEAD"):
            write_problem(request, 405, "use GET", ((b"allow", b"GET, HEAD"),))
            return server.NOT_DONE_YET

        def answer(reason):
            if reason is None:
                write_json(request, 200, {"ready": True})
            else:
                write_json(request, 503, {"ready": False, "reason": str(reason)[:1024]})

        def failed(failure):
            log.failure("readiness check failed", failure)
            write_json(request, 503, {"ready": False,
                                      "reason": f"readiness check failed: "
                                                f"{failure_summary(failure)}"})

        defer.maybeDeferred(self.readiness).addCallbacks(answer, failed)
        return server.NOT_DONE_YET
