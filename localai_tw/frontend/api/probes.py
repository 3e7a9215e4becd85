"""The replica's probes and its starting gate: ``/healthz``, ``/readyz``, and a 503 elsewhere
until the replica is built.

The listener opens at once (a load balancer sees ``/healthz`` answer while the database starts);
:class:`StartingGate` is its root.  Until :meth:`StartingGate.open` hands it the replica's
resource tree, it answers only the probes and the index; elsewhere the listener's header guards still
refuse a missing API key (401), and everything else is 503 ``Retry-After: 5``: OpenAI-shaped under ``/v1`` (``service_unavailable``, code ``starting``), the project's
``not_ready`` shape elsewhere.  This module holds no replica state: ``/readyz`` asks an object
with ``readiness()`` and ``database`` (the ``FrontendService``, or a ``DatabaseService`` alone).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from twisted.internet import defer
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from localai_tw.frontend.api.kit import JSONDirectory, render_error

from localai_tw.web.errors import not_ready

#: ``/readyz``'s ``state`` while a started replica's database is away.
DATABASE_UNAVAILABLE = "database_unavailable"


class LivenessResource(Resource):
    """``/healthz``: 200 ``ok`` while the process serves HTTP at all."""

    isLeaf = True

    def render_GET(self, request) -> bytes:
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        return b"ok"


class ReadinessResource(Resource):
    """``/readyz``: 200 when ``checked`` is ready and its database answers: it answered one of
    the pool's statements within ``probe_timeout``, or else it answers ``SELECT 1`` within
    ``probe_timeout``; else 503.

    The body is JSON: ``{"ready": true}`` or ``{"ready": false, "reason": "...", "state":
    "..."}`` (``state`` when ``state`` is given: the replica's startup state, or
    ``database_unavailable`` when the database is what fails; ``reason`` a sentence), with
    ``"listener": {"saturated": true, ...}`` while the listener's connection cap is full (the
    status stays as it is: see :meth:`_answer`).  The probe
    query is bounded by ``probe_timeout`` so a hung pool shows as not ready instead of hanging
    the load balancer's check.
    """

    isLeaf = True

    def __init__(self, checked: Any, reactor: Any = None, probe_timeout: float = 2.0,
                 state: Callable[[], str] | None = None):
        super().__init__()
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        self._checked = checked
        self._reactor = reactor
        self._probe_timeout = probe_timeout
        self._state = state

    def render_GET(self, request):
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"cache-control", b"no-store")
        ready, reason = self._checked.readiness()
        database = self._checked.database
        if not ready or database is None:
            return self._answer(request, False, reason)
        outage = getattr(database, "outage", None)
        if isinstance(outage, str):
            # The pool knows the database is away: say so at once, in words, instead of a probe
            # that would wait ``probe_timeout`` for a connection that is being re-established.
            return self._answer(request, False, f"the database is unavailable ({outage}); "
                                "this replica is reconnecting", DATABASE_UNAVAILABLE)
        answered_within = getattr(database, "answered_within", None)
        if answered_within is not None and answered_within(self._probe_timeout):
            # The pool's own traffic proves the database answers: no probe statement, which
            # would queue behind a busy pool (thousands of workers reconnecting at once) and
            # turn a replica that is serving into a 503 for the load balancer.
            return self._answer(request, True, "ready")

        client_gone: list[bool] = []
        probe: defer.Deferred | None = None

        def gone(_):
            client_gone.append(True)
            if probe is not None:
                probe.cancel()

        # Registered before the probe, which may answer (and finish the request) at once.
        request.notifyFinish().addErrback(gone)
        probe = database.runQuery("SELECT 1")
        probe.addTimeout(self._probe_timeout, self._reactor)
        probe.addCallbacks(
            lambda _: self._finish(request, client_gone, True, "ready"),
            lambda f: self._finish(request, client_gone, False, self._probe_failed(f),
                                   DATABASE_UNAVAILABLE),
        )
        return NOT_DONE_YET

    def _probe_failed(self, failure) -> str:
        """The reason, in words, for a probe statement that failed (never a repr: a timeout's
        message is ``(2.0, 'Deferred')``)."""
        if failure.check(defer.TimeoutError, defer.CancelledError):
            return (f"the database did not answer SELECT 1 within {self._probe_timeout:g} s "
                    "(unreachable, or every connection is being re-established)")
        return f"the database query failed: {failure.getErrorMessage()}"

    def _answer(self, request, ready: bool, reason: str, state: str | None = None) -> bytes:
        request.setResponseCode(200 if ready else 503)
        body: dict[str, Any] = {"ready": True} if ready else {"ready": False, "reason": reason}
        if not ready and self._state is not None:
            # A replica that started (state "ready") but whose database is away is not "ready":
            # the state says what it waits for.
            body["state"] = state or self._state()
        site = getattr(request, "site", None)
        if getattr(site, "saturated", False):
            # Said, not acted on: a replica whose connection cap is full still serves its
            # tunnels, held connections and the requests in progress, and each source gets
            # its share of the cap again as connections close; pulling it from the balancer
            # would let one flooding address take replicas out one after the other.
            body["listener"] = {"saturated": True, "open_connections": site.open_connections,
                                "max_connections": site.max_connections}
        return json.dumps(body).encode()

    def _finish(self, request, client_gone: list[bool], ready: bool, reason: str,
                state: str | None = None) -> None:
        if client_gone:
            return
        request.write(self._answer(request, ready, reason, state))
        request.finish()


class _OpenAIStarting:
    """The OpenAI-shaped 503 (as ``openai/errors.py`` spells errors; not imported here so the
    plugin's option parsing stays free of the protobuf modules)."""

    status = 503
    headers = {"Retry-After": "5"}

    def __init__(self, stopping: bool = False):
        self._stopping = stopping

    def body(self) -> dict:
        if self._stopping:
            return {"error": {"message": "this frontend replica is stopping; send the request "
                              "to another replica or try again", "type": "service_unavailable",
                              "param": None, "code": "stopping"}}
        return {"error": {"message": "the inference router is not available yet: the frontend "
                          "is starting; try again", "type": "service_unavailable",
                          "param": None, "code": "starting"}}


class _Starting(Resource):
    """Everything but the probes while the replica starts: the listener's header guards (a
    missing API key is still a 401), then 503 with ``Retry-After``."""

    isLeaf = True

    def __init__(self, openai: bool, gate: "StartingGate | None" = None):
        super().__init__()
        self._openai = openai
        self._gate = gate

    def render(self, request):
        # The listener's header guards (API keys) decide first, as the APIs themselves would.
        guard = getattr(getattr(request, "site", None), "guard_before_body", None)
        if guard is not None:
            try:
                guard(request, request.uri)
            except Exception as refusal:
                if not callable(getattr(refusal, "body", None)):
                    raise
                return render_error(request, refusal)
        stopping = self._gate is not None and self._gate.stopping
        if self._openai:
            error: Any = _OpenAIStarting(stopping)
        elif stopping:
            error = not_ready("this frontend replica is stopping; use another replica or try "
                              "again")
        else:
            error = not_ready("the frontend is starting (the database is not ready yet, or "
                              "this replica is joining the cluster); try again")
        return render_error(request, error)


class StartingGate(Resource):
    """The listener's root: the probes and 503 until :meth:`open`, then the replica's tree."""

    def __init__(self, probes: dict[bytes, Resource], index: dict[str, Any]):
        super().__init__()
        self._starting = JSONDirectory(index=index)
        for name, probe in probes.items():
            self._starting.putChild(name, probe)
        self._starting_api = _Starting(openai=False, gate=self)
        self._starting_v1 = _Starting(openai=True, gate=self)
        #: The replica's resource tree, once open.
        self.tree: Resource = self._starting
        #: True once :meth:`close` ran: the 503s say "stopping", not "starting".
        self.stopping = False

    @property
    def is_open(self) -> bool:
        return self.tree is not self._starting

    def open(self, tree: Resource) -> None:
        """Serve ``tree`` from now on (it must mount the probes itself)."""
        self.tree = tree
        self.stopping = False

    def close(self) -> None:
        """Back to the probes and 503 (the replica is stopping)."""
        self.tree = self._starting
        self.stopping = True

    def getChildWithDefault(self, path, request):
        if self.is_open or path in self._starting.children or \
                (path == b"" and not request.postpath):
            return self.tree.getChildWithDefault(path, request)
        return self._starting_v1 if path == b"v1" else self._starting_api

    def render(self, request):
        return self.tree.render(request)
