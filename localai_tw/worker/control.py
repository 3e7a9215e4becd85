"""The worker's control plane: verbs served over HTTP under ``/v1/control/``.

A frontend calls a verb with ``POST /v1/control/<verb with dots replaced by slashes>`` and a
JSON object body.  The status of the reply is the contract the frontend classifies by (see
``docs/control-plane.md``): 200 is the worker's answer (an ``error`` field included), 204 a
verb with no reply, 400 a request the worker could not decode (never evidence), 404 a verb this
worker version does not serve (an answer, never absence), 405 a method other than POST, 413 a
body over the cap, 503 no free slot (the work did not start), 500 a verb that could not be
served.  Streaming verbs answer ``application/x-ndjson``: ``{"progress": ...}`` lines, then
exactly one final ``{"reply": ...}`` line.

Verbs are registered in a :class:`ControlVerbs` registry; this module ships only
``node.status`` and knows nothing of backends or agents.  ``/healthz`` and ``/readyz`` live
here too and need no credentials.

What this module must never do:

- answer a verb to an unauthorized caller: with a token configured every verb needs
  ``Authorization: Bearer <token>`` (compared in constant time); with none configured only a
  local caller (a tunnel stream, loopback, a Unix socket) is served;
- read an unbounded body: bodies are capped at :data:`MAX_REQUEST_BYTES` while they arrive;
- echo a request back except the first 128 bytes of an unknown path (printable ASCII only);
- let a failure of one verb look like absence: every reply that reaches the frontend is a
  status from the contract, and a streaming reply ends with its reply line or not at all
  (the link broke).
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import json
import re
from typing import Any, Awaitable, Callable, Iterable, Mapping, Union

import attr
from twisted.internet import defer
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import resource, server
from zope.interface import Attribute, Interface, implementer

from localai_tw.worker.capacity import host_facts
from localai_tw.worker.httpserve import (
    AnswerBeforeBody,
    BoundedMemoryBody,
    TunnelStreamAddress,
    WorkerSite,
    failure_summary,
    too_large_body,
)

log = Logger()

#: Where the control plane is mounted, and the prefix every verb path starts with.
CONTROL_PREFIX = b"/v1/control/"
#: Largest control request body, in bytes.  One byte more answers 413.
MAX_REQUEST_BYTES = 8 * 1024 * 1024
#: How much of an unknown path a 404 echoes back.
MAX_ECHOED_PATH_BYTES = 128
#: Bytes of NDJSON a streaming verb may write while the peer is not reading before the stream
#: is dropped (the frontend reads progress promptly; a stuck reader must not grow memory).
MAX_UNREAD_STREAM_BYTES = 4 * 1024 * 1024
#: The default detail of a 503 busy answer.
NO_FREE_SLOT = "the worker has no free slot for this run"

JSON_TYPE = b"application/json"
NDJSON_TYPE = b"application/x-ndjson"

_VERB_SEGMENT = r"[a-z0-9][a-z0-9_-]*"
_VERB_NAME = re.compile(rf"^{_VERB_SEGMENT}(?:\.{_VERB_SEGMENT})*$")
_MAX_VERB_NAME = 128


# -- what a verb may raise ------------------------------------------------------------------------


class BadVerbRequest(Exception):
    """Raised by a verb (or its schema) when the request is malformed: answered 400, which the
    frontend never takes as evidence.  The message names the problem, never a secret."""


class NoFreeSlot(Exception):
    """Raised by a verb that cannot start the work now: answered 503 busy.  The frontend may
    offer the work to another worker."""

    def __init__(self, detail: str = NO_FREE_SLOT):
        self.detail = detail
        super().__init__(detail)


# -- request schemas -----------------------------------------------------------------------------

FieldType = Union[type, tuple]


@attr.s(frozen=True, auto_attribs=True)
class VerbRequestSchema:
    """The JSON fields a verb reads, with their types.  Unknown fields are allowed (a newer
    frontend may send more); a listed field of the wrong type, or a required field missing, is
    a 400.  ``int`` never accepts a boolean; ``float`` accepts an integer."""

    fields: Mapping[str, FieldType] = attr.Factory(dict)
    required: frozenset = frozenset()

    def check(self, body: dict) -> None:
        for name in sorted(self.required):
            if name not in body:
                raise BadVerbRequest(f"field {name!r} is required")
        for name, expected in self.fields.items():
            if name in body and not _has_type(body[name], expected):
                raise BadVerbRequest(
                    f"field {name!r} must be {_type_names(expected)}, "
                    f"got {_json_type_name(body[name])}"
                )


def _has_type(value: Any, expected: FieldType) -> bool:
    types = expected if isinstance(expected, tuple) else (expected,)
    for kind in types:
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if kind in (str, bool, dict, list) and isinstance(value, kind):
            return True
        if kind is type(None) and value is None:
            return True
    return False


_JSON_NAMES = {str: "string", bool: "boolean", int: "integer", float: "number",
               dict: "object", list: "array", type(None): "null"}


def _type_names(expected: FieldType) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(_JSON_NAMES.get(kind, kind.__name__) for kind in types)


def _json_type_name(value: Any) -> str:
    for kind in (bool, int, float, str, dict, list, type(None)):
        if isinstance(value, kind):
            return _JSON_NAMES[kind]
    return type(value).__name__


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def decode_request_object(raw: bytes) -> dict:
    """Decode a control request body into a dict, or raise :class:`BadVerbRequest` naming the
    problem.  An empty body is the empty object (verbs without arguments may send nothing)."""
    if not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadVerbRequest(f"request body is not UTF-8 (byte {e.start})") from None
    try:
        decoded = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise BadVerbRequest("request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN, over-long integers
        raise BadVerbRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(decoded, dict):
        raise BadVerbRequest(
            f"request body must be a JSON object, got {_json_type_name(decoded)}"
        )
    return decoded


# -- the verb registry ---------------------------------------------------------------------------


class IControlVerb(Interface):
    """One verb of the control plane."""

    name = Attribute("str: dotted verb name, e.g. 'backend.install'")
    streaming = Attribute("bool: whether the reply is NDJSON progress lines and a reply line")
    cancel_on_disconnect = Attribute(
        "bool: whether the handler's Deferred is cancelled when the caller goes away"
    )
    schema = Attribute("VerbRequestSchema or None: the fields checked before the handler runs")

    def run(body: dict, progress: Callable[[Any], defer.Deferred] | None):
        """Serve one call.  Returns the reply (a dict, or ``None`` for 204) directly, as a
        Deferred, or as a coroutine.  ``progress`` is given to streaming verbs only: it writes
        one ``{"progress": value}`` line and returns a Deferred that fires when the caller is
        reading again (awaiting it is how a verb honours backpressure)."""


#: A unary handler: ``handler(body) -> dict | None`` (or a Deferred/coroutine of it).
UnaryHandler = Callable[[dict], Union[dict, None, defer.Deferred, Awaitable]]
#: A streaming handler: ``handler(body, progress) -> dict | None`` (or Deferred/coroutine).
StreamingHandler = Callable[[dict, Callable[[Any], defer.Deferred]], Any]


@implementer(IControlVerb)
@attr.s(frozen=True, auto_attribs=True)
class RegisteredVerb:
    name: str
    handler: Callable[..., Any]
    streaming: bool = False
    cancel_on_disconnect: bool = True
    schema: VerbRequestSchema | None = None

    def run(self, body, progress):
        if self.streaming:
            return self.handler(body, progress)
        return self.handler(body)


def canonical_verb_name(name: str) -> str:
    """``backend/start`` and ``backend.start`` name the same verb; the dotted form is canonical.
    Raises ``ValueError`` for anything that cannot be a verb path."""
    dotted = name.strip("/").replace("/", ".")
    if len(dotted) > _MAX_VERB_NAME or not _VERB_NAME.match(dotted):
        raise ValueError(f"not a control verb name: {name!r}")
    return dotted


def path_of(verb: str) -> bytes:
    """The HTTP path of a verb: ``/v1/control/`` + the verb with dots replaced by slashes."""
    return CONTROL_PREFIX + canonical_verb_name(verb).replace(".", "/").encode("ascii")


class ControlVerbs:
    """The verbs this worker serves.  Later code registers its own (``backend.start``,
    ``backend.stop``, ``backend.list``, ``agent.cancel`` ...); an unregistered verb answers 404,
    which the frontend reads as "this worker version does not serve it"."""

    def __init__(self):
        self._verbs: dict[str, IControlVerb] = {}

    def register(
        self,
        name: str,
        handler: Callable[..., Any],
        streaming: bool = False,
        *,
        schema: VerbRequestSchema | None = None,
        cancel_on_disconnect: bool = True,
    ) -> IControlVerb:
        """Serve ``name`` with ``handler``.  ``cancel_on_disconnect=False`` is for verbs that
        must finish even when the caller leaves (an acknowledged stop)."""
        verb = RegisteredVerb(
            canonical_verb_name(name), handler, streaming, cancel_on_disconnect, schema
        )
        return self.add(verb)

    def add(self, verb: IControlVerb) -> IControlVerb:
        name = canonical_verb_name(verb.name)
        if name in self._verbs:
            raise ValueError(f"control verb {name} is already registered")
        self._verbs[name] = verb
        return verb

    def unregister(self, name: str) -> None:
        self._verbs.pop(canonical_verb_name(name), None)

    def lookup(self, name: str) -> IControlVerb | None:
        return self._verbs.get(name)

    def names(self) -> list[str]:
        return sorted(self._verbs)


# -- authorization ----------------------------------------------------------------------------


def is_local_caller(address: object) -> bool:
    """True for a tunnel stream, a Unix socket, a loopback IP, or any peer that is not a TCP/IP
    address at all; false for every other IP address (and for an unparsable IP host)."""
    if isinstance(address, TunnelStreamAddress):
        return True
    if isinstance(address, (IPv4Address, IPv6Address)):
        host = address.host.split("%", 1)[0]
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)
    if isinstance(address, UNIXAddress):
        return True
    return True


@attr.s(frozen=True, auto_attribs=True)
class Refusal:
    code: int
    problem: str
    headers: tuple = ()

    def as_answer(self) -> AnswerBeforeBody:
        return AnswerBeforeBody(self.code, {"problem": self.problem}, headers=self.headers)


class ControlAuth:
    """Who may call control verbs and file routes.

    With a token: ``Authorization: Bearer <token>``, compared with ``hmac.compare_digest``.
    Without one: only a local caller (:func:`is_local_caller`); a tunnel stream is local,
    because the frontend that opened it already proved the tunnel credential.  Unlike the Go
    baseline, an empty token never makes the routes fail open to remote callers.
    """

    _BEARER = b"bearer "

    def __init__(self, token: str | bytes | None):
        if isinstance(token, str):
            token = token.encode("utf-8")
        self._token = token or None

    @property
    def token_configured(self) -> bool:
        return self._token is not None

    def refusal_for(self, request) -> Refusal | None:
        """``None`` when the caller may proceed, else the refusal to answer."""
        if self._token is None:
            if is_local_caller(request.getClientAddress()):
                return None
            return Refusal(
                403, "no control token is configured: only local callers are served"
            )
        challenge = ((b"WWW-Authenticate", b"Bearer"),)
        values = request.requestHeaders.getRawHeaders(b"authorization") or []
        if len(values) != 1:
            return Refusal(401, "a bearer token is required", challenge)
        value = values[0]
        if value[: len(self._BEARER)].lower() != self._BEARER:
            return Refusal(401, "a bearer token is required", challenge)
        presented = value[len(self._BEARER):].strip()
        if not hmac.compare_digest(presented, self._token):
            return Refusal(401, "the bearer token is not valid", challenge)
        return None


# -- writing replies ------------------------------------------------------------------------------


def write_json(request, code: int, body: Any, headers: Iterable[tuple[bytes, bytes]] = ()):
    """Finish ``request`` with a JSON body (unless the caller already left)."""
    if request.finished or getattr(request, "_disconnected", False):
        return
    payload = json.dumps(body).encode("utf-8")
    request.setResponseCode(code)
    request.setHeader(b"content-type", JSON_TYPE)
    request.setHeader(b"x-content-type-options", b"nosniff")
    request.setHeader(b"content-length", b"%d" % len(payload))
    for name, value in headers:
        request.setHeader(name, value)
    if request.method != b"HEAD":
        request.write(payload)
    request.finish()


def write_no_content(request):
    if request.finished or getattr(request, "_disconnected", False):
        return
    request.setResponseCode(204)
    request.finish()


def write_problem(request, code: int, problem: str, headers=()):
    write_json(request, code, {"problem": problem}, headers)


def _printable_echo(raw: bytes, limit: int = MAX_ECHOED_PATH_BYTES) -> str:
    clipped = raw[:limit]
    return "".join(chr(b) if 0x21 <= b <= 0x7E else "?" for b in clipped)


def write_unknown_control_path(request):
    """404 under the prefix: the worker does not serve this verb."""
    if request.finished or getattr(request, "_disconnected", False):
        return
    payload = ("unknown worker control path " + _printable_echo(request.path)).encode("ascii")
    request.setResponseCode(404)
    request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    request.setHeader(b"x-content-type-options", b"nosniff")
    request.setHeader(b"content-length", b"%d" % len(payload))
    if request.method != b"HEAD":
        request.write(payload)
    request.finish()


def _as_deferred(result: Any) -> defer.Deferred:
    if isinstance(result, defer.Deferred):
        return result
    if inspect.iscoroutine(result):
        return defer.Deferred.fromCoroutine(result)
    if inspect.isawaitable(result):
        return defer.ensureDeferred(result)
    return defer.succeed(result)


@implementer(IPushProducer)
class NDJSONReplyStream:
    """The body of a streaming verb's reply: progress lines, then exactly one reply line.

    The status line and headers go out with the first line, so a verb that fails before its
    first progress still gets a plain status (400, 503, 500).  Registered as the request's
    producer, it learns when the caller stops reading: :meth:`progress` then returns a
    Deferred that fires on resume, and writing more than :data:`MAX_UNREAD_STREAM_BYTES` while
    paused drops the connection.
    """

    def __init__(self, request, verb: str, max_unread_bytes: int = MAX_UNREAD_STREAM_BYTES):
        self.request = request
        self.verb = verb
        self.max_unread_bytes = max_unread_bytes
        self.started = False
        self.replied = False
        self.paused = False
        self.unread_bytes = 0
        self._resumed_waiters: list[defer.Deferred] = []

    def _gone(self) -> bool:
        return self.request.finished or getattr(self.request, "_disconnected", False)

    def _start(self):
        self.started = True
        request = self.request
        request.setResponseCode(200)
        request.setHeader(b"content-type", NDJSON_TYPE)
        request.setHeader(b"x-content-type-options", b"nosniff")
        request.setHeader(b"cache-control", b"no-store")
        request.registerProducer(self, True)

    def _write_line(self, obj: dict) -> None:
        line = json.dumps(obj).encode("utf-8") + b"\n"  # TypeError for a non-JSON value
        if self._gone():
            return
        if not self.started:
            self._start()
        self.request.write(line)
        if self.paused:
            self.unread_bytes += len(line)
            if self.unread_bytes > self.max_unread_bytes:
                log.warn(
                    "control verb {verb}: caller stopped reading; dropping the stream",
                    verb=self.verb,
                )
                transport = self.request.channel.transport if self.request.channel else None
                if transport is not None:
                    abort = getattr(transport, "abortConnection", transport.loseConnection)
                    abort()

    def progress(self, value: Any) -> defer.Deferred:
        if self.replied:
            raise RuntimeError("progress after the reply line")
        self._write_line({"progress": value})
        if self.paused and not self._gone():
            waiter = defer.Deferred()
            self._resumed_waiters.append(waiter)
            return waiter
        return defer.succeed(None)

    def reply(self, value: Any) -> None:
        if self.replied:
            raise RuntimeError("a streaming verb replies exactly once")
        self._write_line({"reply": {} if value is None else value})
        self.replied = True
        self._finish()

    def _finish(self):
        self._release_waiters()
        if self._gone():
            return
        if self.started:
            self.request.unregisterProducer()
        self.request.finish()

    def _release_waiters(self):
        waiters, self._resumed_waiters = self._resumed_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    # IPushProducer: the request's channel tells us when the caller stops and starts reading.
    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False
        self.unread_bytes = 0
        self._release_waiters()

    def stopProducing(self):
        self.paused = False
        self._release_waiters()


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
        if "." in name or not name or len(name) > _MAX_VERB_NAME:
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
        progress = stream.progress if stream is not None else None
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
        if failure.check(defer.CancelledError) and getattr(request, "_disconnected", False):
            return  # the caller left and the verb was cancelled: nobody to answer
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


# -- the built-in verb ----------------------------------------------------------------------------

#: Lists the backends running now: ``[{"model_id": ..., "address": ...}, ...]`` (or a Deferred).
RunningBackends = Callable[[], Any]


def node_status_verb(
    node_name: str, node_type: str, running_backends: RunningBackends, clock: IReactorTime,
    host: Callable[[], dict] = host_facts,
) -> UnaryHandler:
    """The handler of ``node.status``: who this worker is, what it runs, and its CPU count and
    load (``host()``)."""
    started_at = clock.seconds()

    async def node_status(body: dict) -> dict:
        backends = await _as_deferred(running_backends())
        return {
            "node_name": node_name,
            "node_type": node_type,
            "uptime_seconds": round(max(0.0, clock.seconds() - started_at), 3),
            "backends_running": list(backends),
            "host": host(),
        }

    return node_status


def register_node_status(
    verbs: ControlVerbs,
    node_name: str,
    node_type: str,
    running_backends: RunningBackends,
    clock: IReactorTime,
    host: Callable[[], dict] = host_facts,
) -> IControlVerb:
    return verbs.register(
        "node.status", node_status_verb(node_name, node_type, running_backends, clock, host)
    )


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
