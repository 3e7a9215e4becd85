"""The admin and worker APIs' kit: JSON resources and their routes, API-key auth, request
bodies read as JSON, and the parts of a replica those APIs work with.

- :class:`JSONResource`: a leaf resource whose routes are ``async def`` handlers returning
  ``(status, dict)``; unknown paths are 404, wrong methods 405 (with ``Allow``), unexpected
  exceptions 500 with a generic message (the detail goes to the log), a database that is down
  503.  Refusals are :class:`~localai_tw.web.errors.APIError`.
- :class:`APIKeyGuard`: ``Authorization: Bearer <key>`` checked in constant time against every
  configured key.  **No key configured means the guarded API refuses everything** (401, with a
  message saying to set ``--api-key``): the admin API can approve, drain and delete workers,
  and an open admin API by accident is worse than a closed one by accident.
- :func:`read_json_object`: the body as a JSON object, or a 400 that says what is wrong with it.
- :class:`JSONDirectory` / :class:`NotFoundResource`: path prefixes whose unknown children (and
  every path nothing serves) answer a JSON 404, never ``twisted.web``'s HTML page.
- :func:`worker_call_error`, :func:`database_unavailable`: one answer per condition.

The listener these resources are served by is :mod:`localai_tw.web.listener`.  This module must
never echo a credential (errors name the *kind* of credential, never its value), never compare
a secret with ``==``, and never put a traceback or an internal exception text into a response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, Sequence

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource

from localai_tw import errors, logsafe
from localai_tw.db.pool import DatabaseUnavailable, PoolClosed
from localai_tw.web import auth
from localai_tw.web.errors import (
    APIError,
    bad_request,
    error_body,
    hide_host_paths,
    not_found,
    unauthorized,
)
from localai_tw.web.json import COMPACT, json_body, write_json
from localai_tw.frontend.api.jsonbody import read_json_object  # noqa: F401 (the kit's)
from localai_tw.web.listener import may_log_failure
from localai_tw.web.ratelimit import SourceRateLimit

if TYPE_CHECKING:  # the parts' types only: the APIs serve them, they never build them
    from localai_tw.cluster.nodes import NodeRegistry
    from localai_tw.cluster.ownership import OwnershipFence
    from localai_tw.db.pool import Database
    from localai_tw.tunnel.endpoint import ControlClient

log = Logger()

#: Longest path segment (node id) echoed back in an error message.
_ECHO_MAX = 64


#: conditions: it says nothing about any worker.  Answered 503 with ``Retry-After``, so a client
#: retries later or on another replica; the cause is logged once per outage by the pool.
DATABASE_DOWN = (DatabaseUnavailable, PoolClosed)


def database_unavailable() -> APIError:
    """The answer to a request that needed the database while it was away.  The pool's message
    (server address, user) stays in the log: a client learns only the cause."""
    return APIError(503, "this replica's database is unavailable right now; try again in a few "
                    "seconds", "service_unavailable", code="database_unavailable",
                    headers={"Retry-After": "5"})


def worker_call_error(error: errors.ClusterError) -> APIError:
    """The admin API's answer for a failed call to a worker; one status per condition, so an
    operator never reads a peer failure or a reconnecting tunnel as the worker's verdict; no
    absolute path of the worker's disk."""
    message = hide_host_paths(str(error))
    if isinstance(error, errors.RoutingFact):
        return APIError(503, message, "service_unavailable", code=error.condition)
    if isinstance(error, errors.AbsentWithinGrace):
        return APIError(503, message, "service_unavailable", code=error.condition,
                        headers={"Retry-After": "5"})
    if isinstance(error, errors.PeerUnreachable):
        return APIError(503, message + "; retry", "service_unavailable", code=error.condition,
                        headers={"Retry-After": "2"})
    if isinstance(error, errors.WorkerAnswer):
        return APIError(502, message, "worker_error", code=error.condition)
    if isinstance(error, errors.CallerDeadlineExceeded):
        return APIError(504, message, "timeout", code=error.condition)
    return APIError(502, message, "upstream_error", code=error.condition)


def printable(text: str, limit: int = _ECHO_MAX) -> str:
    """``text`` made safe to echo in an error: the one rule (``logsafe.printable``), bounded to
    a path segment's length."""
    return logsafe.printable(text, limit)


# -- request bodies --------------------------------------------------------------------------


def reject_unknown_fields(body: Mapping[str, Any], allowed: Iterable[str],
                          prefix: str = "") -> None:
    """A 400 naming the first field of ``body`` that is not in ``allowed``."""
    allowed = set(allowed)
    for key in body:
        if key not in allowed:
            named = f"{prefix}{printable(str(key))}"
            raise bad_request(f"unknown field {named!r}; expected one of "
                              f"{', '.join(sorted(allowed))}", field=named)


# -- credentials ---------------------------------------------------------------------------------


def bearer_token(request) -> str | None:
    """The credential of ``Authorization: Bearer <credential>`` as text, or None: absent,
    repeated, another scheme, empty (:func:`localai_tw.web.auth.bearer_credential`, the rule
    of every HTTP surface), or not ASCII."""
    credential = auth.bearer_credential(request)
    if credential is None:
        return None
    try:
        return credential.decode("ascii")
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class Caller:
    """Who presented a valid key: ``owner`` is the key's sha256 in hex (what a job records,
    never the key), ``admin`` whether it may act on everything (an admin key, or any key when
    no admin key is configured)."""

    owner: str
    admin: bool


class APIKeyGuard:
    """Checks ``Authorization: Bearer <key>`` against the configured API keys, in two scopes.

    ``keys`` (``--api-key``) are inference keys; ``admin_keys`` (``--admin-api-key``) admin
    keys.  With no admin key configured every inference key is also an admin key (the
    single-machine default: one key works for everything).  :meth:`check_any` admits either
    scope (the OpenAI API, jobs); :meth:`check` admits the admin scope only, and answers an
    inference key 403 naming the admin key.

    The presented key is hashed and compared with the digest of *every* configured key of both
    scopes, without stopping at a match, so timing says neither which key matched nor how long
    keys are.  With no key configured every request is refused (see the module docstring).
    """

    def __init__(self, keys: Sequence[str] | None, *, admin_keys: Sequence[str] | None = None,
                 what: str = "the admin API"):
        self._digests = [auth.digest(k) for k in (keys or ()) if k]
        self._admin_digests = [auth.digest(k) for k in (admin_keys or ()) if k]
        self._what = what
        if not self.configured:
            log.warn("no --api-key configured: {what} refuses every request until one is set",
                     what=what)

    @property
    def configured(self) -> bool:
        return bool(self._digests or self._admin_digests)

    @property
    def scoped(self) -> bool:
        """Whether admin keys are configured apart from inference keys."""
        return bool(self._admin_digests)

    def _scopes(self, presented: str) -> tuple[bool, bool]:
        """(is an inference key, is an admin key): both lists compared in full."""
        inference = auth.matches_any(presented, self._digests)
        admin = auth.matches_any(presented, self._admin_digests)
        return inference, admin

    def admits(self, presented: str) -> bool:
        """Whether ``presented`` is a key of either scope, read from a header other than
        ``Authorization`` (``x-api-key`` on the Anthropic API): compared like every key, with
        every configured digest."""
        inference, admin = self._scopes(presented)
        return inference or admin

    def caller(self, request) -> Caller:
        """The caller of a request that passed :meth:`check_any`.

        :raises APIError: 401 (as :meth:`check_any`)."""
        presented = self._presented(request)
        known = getattr(request, "_localai_caller", None)
        if known is not None and known[0] is self and known[1] == presented:
            return known[2]  # the listener's header guard checked this very key already
        inference, admin = self._scopes(presented)
        if not (inference or admin):
            raise unauthorized("the API key is not valid")
        caller = Caller(auth.digest(presented).hex(), admin or not self.scoped)
        try:  # checked once per request: the header guard, then the resource again
            request._localai_caller = (self, presented, caller)
        except AttributeError:  # a request object without a __dict__ (tests' doubles)
            pass
        return caller

    def _presented(self, request) -> str:
        if not self.configured:
            raise unauthorized(f"{self._what} is disabled because no API key is configured; "
                               "start the frontend with --api-key-file (or env LOCALAI_API_KEY)")
        presented = bearer_token(request)
        if presented is None:
            raise unauthorized(f"{self._what} requires one Authorization: Bearer <API key> "
                               "header")
        return presented

    def check_any(self, request) -> None:
        """An inference or an admin key.  :raises APIError: 401 when no key is configured, or
        the key is missing or wrong."""
        self.caller(request)

    def check(self, request) -> None:
        """An admin key (any key while none is configured).

        :raises APIError: 401 when no key is configured, or the key is missing or wrong; 403
            for an inference key while admin keys are configured."""
        caller = self.caller(request)
        if not caller.admin:
            raise APIError(403, f"{self._what} needs an admin API key: this key is an inference "
                           "key (--api-key), which serves /v1 and the model endpoints only; use "
                           "a key from the frontend's --admin-api-key-file (env "
                           "LOCALAI_ADMIN_API_KEY_FILE)", "forbidden", code="admin_key_required")


# -- JSON resources ---------------------------------------------------------------------------------

Handler = Callable[..., Awaitable[tuple[int, dict]]]


@dataclass(frozen=True)
class Route:
    """``method`` on ``pattern`` (path segments; ``{name}`` matches one segment and is passed
    to the handler as a keyword argument)."""

    method: str
    pattern: tuple[str, ...]
    handler: Handler

    def match(self, segments: Sequence[str]) -> dict[str, str] | None:
        if len(segments) != len(self.pattern):
            return None
        captured = {}
        for part, segment in zip(self.pattern, segments):
            if part.startswith("{") and part.endswith("}"):
                if not segment:
                    return None
                captured[part[1:-1]] = segment
            elif part != segment:
                return None
        return captured


class JSONResource(Resource):
    """A leaf resource answering JSON from ``async def`` handlers.

    Subclasses define ``routes()`` returning :class:`Route` objects, each handler being
    ``async def handler(request, **captured) -> (status, dict)``; raising :class:`APIError`
    answers that error.  ``guard(request)`` (optional) runs before routing.
    """

    isLeaf = True

    def routes(self) -> Sequence[Route]:
        raise NotImplementedError

    def guard(self, request) -> None:
        """Raise :class:`APIError` to refuse before any route runs (authentication)."""

    def render(self, request):
        answering = defer.ensureDeferred(self._answer(request))
        answering.addErrback(lambda f: log.failure("answering {path} failed", f,
                                                   path=printable(_path_text(request))))
        return server.NOT_DONE_YET

    async def _answer(self, request) -> None:
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        try:
            status, body = await self._dispatch(request)
            headers: dict[str, str] = {}
        except APIError as e:
            status, body, headers = e.status, e.body(), e.headers
        except DATABASE_DOWN:
            answer = database_unavailable()
            status, body, headers = answer.status, answer.body(), answer.headers
        except Exception:
            if may_log_failure(request):  # a burst per client, then a summary
                log.failure("{method} {path} failed", Failure(),
                            method=request.method.decode("ascii", "replace"),
                            path=printable(_path_text(request)))
            status, headers = 500, {}
            body = error_body("internal error; see the frontend log", "internal_error")
        if gone:
            return  # the client left; nothing to answer
        write_json(request, status, body, headers, separators=COMPACT)

    async def _dispatch(self, request) -> tuple[int, dict]:
        self.guard(request)
        segments = _segments(request)
        if segments is None:
            raise not_found("no such resource")
        method = request.method.decode("ascii", "replace").upper()
        allowed = []
        for route in self.routes():
            captured = route.match(segments)
            if captured is None:
                continue
            if route.method == method:
                return await route.handler(request, **captured)
            allowed.append(route.method)
        if allowed:
            raise APIError(405, f"method {printable(method, 16)} not allowed here; use "
                           f"{' or '.join(sorted(set(allowed)))}", "method_not_allowed",
                           headers={"Allow": ", ".join(sorted(set(allowed)))})
        raise not_found("no such resource")


class AdminResource(JSONResource):
    """A :class:`JSONResource` behind the admin API key: every request passes ``guard`` (an
    :class:`APIKeyGuard`) before any route runs."""

    def __init__(self, guard: APIKeyGuard):
        super().__init__()
        self._guard = guard

    def guard(self, request) -> None:
        self._guard.check(request)


def _segments(request) -> list[str] | None:
    """The path below this resource as text segments (a trailing slash ignored), or None when a
    segment is not UTF-8."""
    raw = list(request.postpath)
    if raw and raw[-1] == b"":
        raw.pop()
    try:
        return [segment.decode("utf-8") for segment in raw]
    except UnicodeDecodeError:
        return None


def _path_text(request) -> str:
    return (request.path or b"").decode("utf-8", "replace")


def render_error(request, error: APIError) -> bytes:
    """Set ``error``'s status and headers on ``request`` and return its JSON body (for the
    synchronous ``render`` of plain resources)."""
    return json_body(request, error.status, error.body(), error.headers)


class NotFoundResource(Resource):
    """What answers a path nothing serves: a JSON 404 in the project's error shape, for every
    method (never ``twisted.web``'s HTML "No Such Resource" page)."""

    isLeaf = True

    def render(self, request):
        return render_error(request, not_found(
            f"no such resource: {printable(_path_text(request), 128)}; the OpenAI API is "
            "under /v1, the admin API under /api/nodes (GET / lists the entry points)"))


class JSONDirectory(Resource):
    """A path prefix holding child resources (``/``, ``/api``, ``/api/cluster``) whose unknown
    children, and the prefix itself, answer :class:`NotFoundResource`'s JSON 404.

    :param index: when given, ``GET``/``HEAD`` of the prefix itself answer 200 with it (the
        root says where the APIs are).
    """

    def __init__(self, index: Mapping[str, Any] | None = None):
        super().__init__()
        self.index = dict(index) if index is not None else None

    def getChild(self, path, request):
        if path == b"" and not request.postpath:
            return self  # the prefix itself, with a trailing slash ("/" for the root)
        return NotFoundResource()

    def render(self, request):
        if self.index is None:
            return NotFoundResource().render(request)
        if request.method not in (b"GET", b"HEAD"):
            return render_error(request, APIError(
                405, f"method {printable(request.method.decode('ascii', 'replace'), 16)} not "
                "allowed here; use GET", "method_not_allowed", headers={"Allow": "GET, HEAD"}))
        return json_body(request, 200, self.index)


@dataclass
class ClusterParts:
    """What the admin and worker APIs work with (built from the wired replica).

    :param db: the started ``Database``.
    :param nodes: the ``NodeRegistry``.
    :param fence: the ``OwnershipFence`` (owner and presence of a node's tunnel).
    :param instance_id: this replica's id.
    :param reconnect_grace: seconds before a departed tunnel counts as gone.
    :param on_registered: called with a node id after each (re-)registration, before the
        answer: the credential changed, so a tunnel held with the old one must go.
    :param on_deleted: called with a node id after an admin deleted the node.
    :param control: the ``ControlClient`` that calls a worker's control verbs through the
        tunnel (locally held or relayed); None where no worker is reached (API tests).
    :param lifecycle: the ``ModelLifecycle`` (unload; this replica's in-flight counts); None
        where no worker is reached.
    :param registration_limit: registrations per source address (``--registration-limit``);
        None: unlimited.
    :param downloads: this replica's model downloads in progress (``downloads.py``
        ``ModelDownloads.in_progress``); None where there are none.
    :param on_scheduling_changed: called with a model name after its scheduling row was
        written or deleted (the placement caches drop the model).
    """

    db: Database
    nodes: NodeRegistry
    fence: OwnershipFence
    instance_id: str
    reconnect_grace: float | None = None
    on_registered: Callable[[str], object] | None = None
    on_deleted: Callable[[str], object] | None = None
    control: ControlClient | None = None
    lifecycle: Any = None
    registration_limit: SourceRateLimit | None = None
    downloads: Callable[[], list] | None = None
    on_scheduling_changed: Callable[[str], object] | None = None
    #: model name -> the bytes this replica's cold load of it staged so far, or None.
    staging: Callable[[str], dict | None] | None = None


async def call_hook(what: str, hook: Callable[[str], Any] | None, node_id: str) -> None:
    """Run a lifecycle hook for ``node_id``; a failure is logged and never reaches the caller
    (the API call it follows has already happened)."""
    if hook is None:
        return
    try:
        result = hook(node_id)
        if isinstance(result, defer.Deferred) or hasattr(result, "__await__"):
            await result
    except Exception:
        log.failure("{what} hook failed for node {node}", Failure(), what=what, node=node_id)
