"""The control plane's dispatch: the resource under ``/v1/control/`` that authorizes, finds the
verb, decodes and checks the body and runs the verb; the body policy that refuses before a body
byte; and the whole worker site."""

from __future__ import annotations

import json
from typing import Iterable, Mapping

from twisted.internet import defer
from twisted.internet.error import ConnectionClosed
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import resource, server

from localai_tw.worker.control.auth import ControlAuth
from localai_tw.worker.control.probes import LivenessResource, ReadinessCheck, ReadinessResource
from localai_tw.worker.control.replies import (
    NDJSONReplyStream,
    write_json,
    write_no_content,
    write_problem,
    write_unknown_control_path,
)
from localai_tw.worker.control.verbs import (
    CONTROL_PREFIX,
    MAX_VERB_NAME,
    BadVerbRequest,
    ControlVerbs,
    IControlVerb,
    NoFreeSlot,
    canonical_verb_name,
    decode_request_object,
)
from localai_tw.worker.httpserve import (
    AnswerBeforeBody,
    BoundedMemoryBody,
    WorkerSite,
    failure_summary,
    too_large_body,
)

log = Logger()

#: Largest control request body, in bytes.  One byte more answers 413.
MAX_REQUEST_BYTES = 8 * 1024 * 1024


# -- the resources ----------------------------------------------------------------------------


class ControlPlaneResource(resource.Resource):
    """Mounted at ``/v1/control``: every path below it is a verb path."""

    isLeaf = True

    def __init__(self, verbs: ControlVerbs, auth: ControlAuth):
        super().__init__()
        self.verbs = verbs
        self.auth = auth

    def render(self, request):
        refusal = self.auth.refusal_for(request)
        if refusal is not None:
            write_problem(request, refusal.code, refusal.problem, refusal.headers)
            return server.NOT_DONE_YET
        verb = self._verb_of(request)
        if verb is None:
            write_unknown_control_path(request)
            return server.NOT_DONE_YET
        if request.method != b"POST":
            write_problem(
                request, 405, "control verbs are called with POST", ((b"allow", b"POST"),)
            )
            return server.NOT_DONE_YET
        content = request.content
        if not isinstance(content, BoundedMemoryBody):
            # The body did not go through the control body policy (e.g. an encoded prefix):
            # refuse rather than trust a sink of unknown size.
            write_problem(request, 400, "request body was not read under the control prefix")
            return server.NOT_DONE_YET
        try:
            body = decode_request_object(content.getvalue())
            if verb.schema is not None:
                verb.schema.check(body)
        except BadVerbRequest as e:
            write_problem(request, 400, str(e))
            return server.NOT_DONE_YET
        self._call(request, verb, body)
        return server.NOT_DONE_YET

    def _verb_of(self, request) -> IControlVerb | None:
        path = request.path
        if not path.startswith(CONTROL_PREFIX):
            return None
        rest = path[len(CONTROL_PREFIX):]
        try:
            name = rest.decode("ascii")
        except UnicodeDecodeError:
            return None
        if "." in name or not name or len(name) > MAX_VERB_NAME:
            return None
        try:
            name = canonical_verb_name(name)
        except ValueError:
            return None
        if name.replace(".", "/") != rest.decode("ascii"):
            return None  # a leading/trailing or doubled slash is not a verb path
        return self.verbs.lookup(name)

    def _call(self, request, verb: IControlVerb, body: dict) -> None:
        stream = NDJSONReplyStream(request, verb.name) if verb.streaming else None
        progress = None
        if stream is not None:
            progress = (stream.progress if verb.cancel_on_disconnect
                        else _regardless_of_the_caller(stream.progress))
        # maybeDeferred takes a plain value, a Deferred or a coroutine; cancelling ``running``
        # cancels the handler's own Deferred (or the one its coroutine awaits).
        running = defer.maybeDeferred(verb.run, body, progress)

        def caller_left(reason: Failure):
            if verb.cancel_on_disconnect and not running.called:
                running.cancel()

        request.notifyFinish().addErrback(caller_left)
        running.addCallbacks(
            lambda reply: self._answered(request, verb, stream, reply),
            lambda failure: self._failed(request, verb, stream, failure),
        )
        running.addErrback(
            lambda f: log.failure("control verb {verb}: writing the reply failed", f,
                                  verb=verb.name)
        )

    def _answered(self, request, verb, stream, reply):
        if stream is not None:
            try:
                stream.reply(reply)
            except TypeError as e:
                stream.reply({"error": f"the reply of {verb.name} is not JSON: {e}"})
            return
        if reply is None:
            write_no_content(request)
            return
        try:
            json.dumps(reply)
        except (TypeError, ValueError) as e:
            write_problem(request, 500, f"the reply of {verb.name} is not JSON: {e}")
            return
        write_json(request, 200, reply)

    def _failed(self, request, verb, stream, failure: Failure):
        if failure.check(defer.CancelledError, ConnectionClosed) and (
                getattr(request, "_disconnected", False) or (stream is not None and stream.gone)):
            return  # the caller left and the verb was cancelled or told so: nobody to answer
        if stream is not None and stream.started:
            # The status line is out; the failure becomes the worker's answer in the reply line.
            if failure.check(NoFreeSlot):
                stream.reply({"error": failure.value.detail})
            else:
                if not failure.check(BadVerbRequest):
                    log.failure("control verb {verb} failed", failure, verb=verb.name)
                stream.reply({"error": failure_summary(failure)})
            return
        if failure.check(BadVerbRequest):
            write_problem(request, 400, str(failure.value))
        elif failure.check(NoFreeSlot):
            write_json(request, 503, {"busy": failure.value.detail})
        else:
            log.failure("control verb {verb} failed", failure, verb=verb.name)
            write_problem(
                request, 500,
                f"control verb {verb.name} could not be served: {failure_summary(failure)}",
            )


def _regardless_of_the_caller(progress):
    """``progress`` for a verb that must finish even when the caller leaves: its wait is
    released, not failed, by the caller's departure (the lines go nowhere)."""

    def progress_going_on(value):
        return progress(value).addErrback(lambda failure: failure.trap(ConnectionClosed) and None)

    return progress_going_on


class ControlBodyPolicy:
    """Bodies under ``/v1/control/``: refused before one byte is read when the caller is not
    authorized or announces more than the cap, else held in memory up to the cap."""

    prefix = CONTROL_PREFIX

    def __init__(self, auth: ControlAuth, limit: int = MAX_REQUEST_BYTES):
        self.auth = auth
        self.limit = limit

    def sink_for(self, request, method, path, length):
        if length != 0:
            refusal = self.auth.refusal_for(request)
            if refusal is not None:
                raise refusal.as_answer()
        if length is not None and length > self.limit:
            raise AnswerBeforeBody(413, too_large_body(self.limit))
        return BoundedMemoryBody(self.limit)


# -- the worker's site ----------------------------------------------------------------------------


def build_worker_site(
    verbs: ControlVerbs,
    auth: ControlAuth,
    readiness: ReadinessCheck,
    *,
    v1_children: Mapping[bytes, resource.Resource] | None = None,
    body_policies: Iterable = (),
) -> WorkerSite:
    """The whole worker HTTP tree: ``/healthz``, ``/readyz``, ``/v1/control/...`` and any other
    ``/v1/<name>`` resources (file staging adds ``files`` and ``files-progress``) together with
    their body policies.  Serve it with :func:`~localai_tw.worker.httpserve.serve_http_on_transport`.
    """
    root = resource.Resource()
    root.putChild(b"healthz", LivenessResource())
    root.putChild(b"readyz", ReadinessResource(readiness))
    v1 = resource.Resource()
    root.putChild(b"v1", v1)
    v1.putChild(b"control", ControlPlaneResource(verbs, auth))
    for name, child in (v1_children or {}).items():
        v1.putChild(name, child)
    return WorkerSite(root, [ControlBodyPolicy(auth), *body_policies])
