"""The control verbs: what a verb may raise, the request schemas checked before a handler runs,
the registry of verbs a worker serves, the verb-to-path rule, and the built-in ``node.status``."""

from __future__ import annotations

import inspect
import json
import re
from typing import Any, Awaitable, Callable, Mapping, Union

import attr
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from zope.interface import Attribute, Interface, implementer

from localai_tw.worker.capacity import host_facts

#: Where the control plane is mounted, and the prefix every verb path starts with.
CONTROL_PREFIX = b"/v1/control/"
#: The default detail of a 503 busy answer.
NO_FREE_SLOT = "the worker has no free slot for this run"

_VERB_SEGMENT = r"[a-z0-9][a-z0-9_-]*"
_VERB_NAME = re.compile(rf"^{_VERB_SEGMENT}(?:\.{_VERB_SEGMENT})*$")
MAX_VERB_NAME = 128


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
    if len(dotted) > MAX_VERB_NAME or not _VERB_NAME.match(dotted):
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


def _as_deferred(result: Any) -> defer.Deferred:
    if isinstance(result, defer.Deferred):
        return result
    if inspect.iscoroutine(result):
        return defer.Deferred.fromCoroutine(result)
    if inspect.isawaitable(result):
        return defer.ensureDeferred(result)
    return defer.succeed(result)


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
