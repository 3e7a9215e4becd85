"""``/v1`` as one Twisted resource: :class:`OpenAIResource` checks the API key, routes each
path and method to its endpoint family (``chat``, ``completions``, ``embeddings``,
``models``, ``capabilities``, ``tokenize`` (and detokenize), ``rerank``, ``speech``,
``transcription``, ``images``, ``responses_api``), and turns whatever a family raises into an
OpenAI-shaped answer.

The routes LocalAI also serves without ``/v1`` (``/chat/completions``, ``/embeddings``,
``/models``, ``/tts`` ...) are the entries of :data:`UNPREFIXED`: :meth:`OpenAIResource.unprefixed`
is the resource the frontend mounts at each of their first segments, and
:func:`unprefixed_aliases` the paths it gives the same body cap as their ``/v1`` twins (and
:func:`api_prefixes` the same header guard).  An alias is answered by the same family, with the
same key check, bounds and metrics label as the route it names.

Authentication: ``Authorization: Bearer <key>`` checked by the frontend's
:class:`~localai_tw.frontend.api.kit.APIKeyGuard` (constant time) **only when a key is
configured**; without one this API is open, as LocalAI's is (unlike the admin API, which is then
closed).  The check is :meth:`OpenAIResource.guard`, which ``BoundedSite`` runs when the
headers of a request with a body end, so a refused client never has a body byte read.

What this module must never do: block the reactor, answer a request before its key is checked,
put a traceback or a credential in a response, or know how an endpoint builds its answer (that
is its family's module).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource

from localai_tw import metrics as replica_metrics

from localai_tw.frontend.inference.interfaces import IInferenceRouter
from localai_tw.frontend.api.jsonbody import prepare_json_body
from localai_tw.frontend.api.kit import APIKeyGuard, bearer_token, printable
from localai_tw.web.errors import APIError
from localai_tw.frontend.api.openai import (
    capabilities,
    chat,
    completions,
    embeddings,
    images,
    models,
    rerank,
    responses_api,
    speech,
    tokenize,
    transcription,
)
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import OpenAIError, detail, error_for
from localai_tw.frontend.api.openai.responses import Exchange, NodeNames, path_text
from localai_tw.frontend.api.openai.sse import AlreadyAnswered

log = Logger()

#: Path segments under ``/v1`` -> (the method allowed, the family's answer).
ROUTES = {
    (b"chat", b"completions"): (b"POST", chat.answer),
    (b"completions",): (b"POST", completions.answer),
    (b"embeddings",): (b"POST", embeddings.answer),
    (b"models",): (b"GET", models.answer_list),
    (b"models", b"capabilities"): (b"GET", capabilities.answer),
    (b"tokenize",): (b"POST", tokenize.answer),
    (b"detokenize",): (b"POST", tokenize.answer_detokenize),
    (b"rerank",): (b"POST", rerank.answer),
    (b"audio", b"speech"): (b"POST", speech.answer),
    (b"audio", b"transcriptions"): (b"POST", transcription.answer),
    (b"images", b"generations"): (b"POST", images.answer),
    (b"responses",): (b"POST", responses_api.answer_create),
}

#: Paths served without the ``/v1`` prefix, as LocalAI serves them (``core/http/routes/
#: openai.go`` and ``localai.go`` at 82c191a; ``/v1/rerank``, ``/v1/tokenize`` and
#: ``/v1/detokenize`` have no unprefixed twin there, so none here): root path segments -> the
#: ``ROUTES`` key they answer as.  An alias whose ``ROUTES`` key is not (yet) served answers
#: the same 404 as its ``/v1`` twin, so the speech, transcription and images routes are listed
#: already and work as soon as their family is in ``ROUTES``.  ``/tts`` is LocalAI's other
#: path of its ``/v1/audio/speech`` handler.  ``/models/{id}`` is not aliased: LocalAI's
#: unprefixed ``/models/...`` are its gallery's admin routes.
UNPREFIXED: dict[tuple[bytes, ...], tuple[bytes, ...]] = {
    (b"chat", b"completions"): (b"chat", b"completions"),
    (b"completions",): (b"completions",),
    (b"embeddings",): (b"embeddings",),
    (b"models",): (b"models",),
    (b"models", b"capabilities"): (b"models", b"capabilities"),
    (b"audio", b"speech"): (b"audio", b"speech"),
    (b"tts",): (b"audio", b"speech"),
    (b"audio", b"transcriptions"): (b"audio", b"transcriptions"),
    (b"images", b"generations"): (b"images", b"generations"),
    (b"responses",): (b"responses",),
}


def unprefixed_aliases() -> list[tuple[bytes, bytes]]:
    """``(alias path, /v1 path)`` of each :data:`UNPREFIXED` entry
    (``(b"/tts", b"/v1/audio/speech")`` ...): the frontend gives each alias its twin's body
    cap."""
    return sorted((b"/" + b"/".join(alias), b"/v1/" + b"/".join(route))
                  for alias, route in UNPREFIXED.items())


def unprefixed_roots() -> list[bytes]:
    """The first segments of :data:`UNPREFIXED`: where the frontend mounts
    :meth:`OpenAIResource.unprefixed`."""
    return sorted({key[0] for key in UNPREFIXED})


def api_prefixes() -> list[bytes]:
    """Every path prefix this API answers under (``/v1`` and each unprefixed root): the
    frontend gives each the API-key header guard and :func:`~.errors.early_error`'s shape."""
    return [b"/v1"] + [b"/" + root for root in unprefixed_roots()]


def _route_segments(postpath) -> list[bytes]:
    segments = list(postpath)
    if segments and segments[-1] == b"":
        segments.pop()
    return segments


def check_api_key(api_keys: APIKeyGuard | None, request) -> None:
    """The OpenAI API's key check (also the listener's header guard of ``/v1`` while the
    replica starts).  :raises OpenAIError: 401 when keys are configured and this is none."""
    if api_keys is None or not api_keys.configured:
        return  # no key configured: the OpenAI API is open (docs/openai-api.md)
    if bearer_token(request) is None:
        raise OpenAIError(401, "this API requires Authorization: Bearer <API key>",
                          "authentication_error", code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})
    try:
        api_keys.check_any(request)  # inference and admin keys alike
    except APIError:
        raise OpenAIError(401, "the API key is not valid", "authentication_error",
                          code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"}) from None


class OpenAIResource(Resource):
    """``/v1``: the OpenAI-compatible API over an ``IInferenceRouter`` (module docstring).

    :param router: the replica's ``IInferenceRouter`` (the listener's starting gate answers
        503 until the replica, and so the router, exists).
    :param api_keys: the frontend's :class:`APIKeyGuard`; checked only when it has keys.
    :param deadline_seconds: per-request deadline handed to the router (None: its default).
    :param reactor: the clock for deadlines (``seconds()``); ``now`` gives ``created`` stamps.
    :param responses: the Responses API's store and runs (``responses_api.ResponsesParts``);
        None: nothing is stored (``store: false`` only).
    :param node_names: ``node_id -> name`` (or a Deferred of it) for the ``X-LocalAI-Node``
        header; without it the header names nodes by id.
    """

    isLeaf = True

    def __init__(self, router: IInferenceRouter, *, api_keys: APIKeyGuard | None = None,
                 deadline_seconds: float | None = None, reactor=None,
                 now: Callable[[], float] = time.time,
                 node_names: Callable[[str], Any] | None = None,
                 metrics: replica_metrics.ReplicaMetrics = replica_metrics.DISCARD,
                 generated=None, responses=None):
        super().__init__()
        self._metrics = metrics
        self._context = Context(router, deadline_seconds, reactor, now, generated, responses)
        self._names = NodeNames(node_names) if node_names is not None else None
        self._api_keys = api_keys

    def render(self, request):
        child = self.children.get(request.postpath[0]) if request.postpath else None
        if child is not None:  # another protocol's route under /v1 (routes.py: /v1/messages)
            request.prepath.append(request.postpath.pop(0))
            return child.render(request)
        return self._render(request, _route_segments(request.postpath))

    @property
    def context(self) -> Context:
        """The replica's side of every answer (router, deadlines, clock), for the other
        protocols' routes that run the shared chat turn."""
        return self._context

    def exchange(self, request, segments: list[bytes]) -> Exchange:
        """A new :class:`Exchange` for ``request``, counted under ``segments``' endpoint label
        and naming its nodes as this API does."""
        exchange = Exchange(request, self._names, self._metrics.request(segments))
        replica_metrics.trace_hops(exchange.record.hops)  # this request's context only
        return exchange

    def unprefixed(self) -> Resource:
        """The resource to mount at each of :func:`unprefixed_roots`: it answers the paths of
        :data:`UNPREFIXED` as the ``/v1`` routes they name, and 404 to any other."""
        return _Unprefixed(self)

    def _render(self, request, segments: list[bytes]):
        answering = defer.ensureDeferred(self._serve(request, segments))
        answering.addErrback(lambda f: log.failure("answering {path} failed", f,
                                                   path=printable(path_text(request))))
        return server.NOT_DONE_YET

    async def _serve(self, request, segments: list[bytes] | None) -> None:
        """``segments``: the path below ``/v1``, or None for an unprefixed path that is not in
        :data:`UNPREFIXED` (a 404 after the key check, counted as ``other``)."""
        exchange = self.exchange(request, segments if segments is not None else [])
        try:
            await self._dispatch(request, exchange, segments)
        except AlreadyAnswered:
            return
        except defer.CancelledError:
            if exchange.gone:
                return
            self._answer_error(exchange, OpenAIError(
                500, "the request was cancelled", "server_error", code="cancelled"), None)
        except Exception as e:
            self._answer_error(exchange, error_for(e), e)

    def _answer_error(self, exchange: Exchange, answer: OpenAIError,
                      cause: BaseException | None) -> None:
        request = exchange.request
        exchange.record.failed(cause)
        if cause is not None and not isinstance(cause, (OpenAIError, APIError)):
            if answer.code == "internal_error":
                log.failure("{method} {path} failed", Failure(cause),
                            method=request.method.decode("ascii", "replace"),
                            path=printable(path_text(request)))
            else:
                log.info("{method} {path}: {status} {code} ({condition}): {message}",
                         method=request.method.decode("ascii", "replace"),
                         path=printable(path_text(request)), status=answer.status,
                         code=answer.code, condition=getattr(cause, "condition", "-"),
                         message=detail(cause))  # the full text, ids included
        exchange.send_json(answer.status, answer.body(), answer.headers)

    def guard(self, request) -> None:
        """The API-key check, from the headers alone: ``BoundedSite`` runs it when the headers
        of a request with a body end, so a refused client never has a body byte read."""
        check_api_key(self._api_keys, request)

    def router(self) -> IInferenceRouter:
        return self._context.router

    async def _dispatch(self, request, exchange: Exchange, segments: list[bytes] | None) -> None:
        self.guard(request)
        method = request.method.upper()
        key = tuple(segments) if segments is not None else None
        if key is None:
            raise OpenAIError(404, f"unknown endpoint {printable(path_text(request))}",
                              "invalid_request_error", code="unknown_url")
        if key in ROUTES:
            allowed, answer = ROUTES[key]
            args = ()
        elif len(segments) >= 2 and segments[0] == b"models":
            allowed, answer = b"GET", models.answer_one
            try:
                args = (b"/".join(segments[1:]).decode("utf-8"),)
            except UnicodeDecodeError:
                raise OpenAIError(404, "no such model; GET /v1/models lists the models",
                                  "invalid_request_error",
                                  param="model", code="model_not_found") from None
        elif len(segments) >= 2 and segments[0] == b"responses":
            # /responses/{id}[/cancel|/input_items]: the family checks the method
            allowed, answer = method, responses_api.answer_item
            args = (segments[1:],)
        else:
            raise OpenAIError(404, f"unknown endpoint {printable(path_text(request))}",
                              "invalid_request_error", code="unknown_url")
        if method != allowed and not (allowed == b"GET" and method == b"HEAD"):
            raise OpenAIError(405, f"use {allowed.decode()} on this endpoint",
                              "invalid_request_error", code="method_not_allowed",
                              headers={"Allow": allowed.decode()})
        if method == b"POST":  # a big JSON body is decoded off the reactor first
            await prepare_json_body(request, self._context.reactor)
        await answer(self._context, request, exchange, *args)


class _Unprefixed(Resource):
    """One first segment of :data:`UNPREFIXED` at the root (``/chat``, ``/models`` ...),
    answered by its :class:`OpenAIResource` as the ``/v1`` route the table names."""

    isLeaf = True

    def __init__(self, openai: OpenAIResource):
        super().__init__()
        self._openai = openai

    def render(self, request):
        key = tuple(request.prepath[-1:] + _route_segments(request.postpath))
        route = UNPREFIXED.get(key)
        if route is None and len(key) >= 2 and key[0] == b"responses":
            route = key  # /responses/{id}[/cancel|/input_items], as LocalAI serves them
        return self._openai._render(request, list(route) if route is not None else None)
