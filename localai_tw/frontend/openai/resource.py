"""``/v1`` as one Twisted resource: :class:`OpenAIResource` checks the API key, routes each
path and method to its endpoint family (``chat``, ``completions``, ``embeddings``,
``models``, ``tokenize``, ``rerank``, ``speech``, ``transcription``, ``images``; LocalAI's
``/tts`` is the same class mounted at the root with :data:`TTS_ROUTES`), and turns whatever a
family raises into an OpenAI-shaped answer.

Authentication: ``Authorization: Bearer <key>`` checked by the frontend's
:class:`~localai_tw.frontend.web.APIKeyGuard` (constant time) **only when a key is
configured**; without one this API is open, as LocalAI's is (unlike the admin API, which is then
closed).  The check is :meth:`OpenAIResource.guard`, which ``FrontendSite`` runs when the
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

from ..interfaces import IInferenceRouter
from ..web import APIError, APIKeyGuard, bearer_token, printable
from . import (
    chat,
    completions,
    embeddings,
    images,
    models,
    rerank,
    speech,
    tokenize,
    transcription,
)
from .context import Context
from .errors import OpenAIError, detail, error_for
from .responses import Exchange, NodeNames, path_text
from .sse import AlreadyAnswered

log = Logger()

#: Path segments under ``/v1`` -> (the method allowed, the family's answer).
ROUTES = {
    (b"chat", b"completions"): (b"POST", chat.answer),
    (b"completions",): (b"POST", completions.answer),
    (b"embeddings",): (b"POST", embeddings.answer),
    (b"models",): (b"GET", models.answer_list),
    (b"tokenize",): (b"POST", tokenize.answer),
    (b"rerank",): (b"POST", rerank.answer),
    (b"audio", b"speech"): (b"POST", speech.answer),
    (b"audio", b"transcriptions"): (b"POST", transcription.answer),
    (b"images", b"generations"): (b"POST", images.answer),
}
#: LocalAI's ``/tts``, mounted at the root: ``OpenAIResource(..., mount=(b"tts",))``.
TTS_ROUTES = {(b"tts",): (b"POST", speech.answer)}


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
        api_keys.check(request)
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
    :param node_names: ``node_id -> name`` (or a Deferred of it) for the ``X-LocalAI-Node``
        header; without it the header names nodes by id.
    """

    isLeaf = True

    def __init__(self, router: IInferenceRouter, *, api_keys: APIKeyGuard | None = None,
                 deadline_seconds: float | None = None, reactor=None,
                 now: Callable[[], float] = time.time,
                 node_names: Callable[[str], Any] | None = None,
                 metrics: replica_metrics.ReplicaMetrics = replica_metrics.DISCARD,
                 generated=None, routes=None, mount: tuple[bytes, ...] = ()):
        super().__init__()
        self._metrics = metrics
        self._routes = ROUTES if routes is None else routes
        self._mount = tuple(mount)
        self._context = Context(router, deadline_seconds, reactor, now, generated)
        self._names = NodeNames(node_names) if node_names is not None else None
        self._api_keys = api_keys

    def render(self, request):
        answering = defer.ensureDeferred(self._serve(request))
        answering.addErrback(lambda f: log.failure("answering {path} failed", f,
                                                   path=printable(path_text(request))))
        return server.NOT_DONE_YET

    async def _serve(self, request) -> None:
        exchange = Exchange(request, self._names,
                            self._metrics.request([*self._mount, *request.postpath]))
        try:
            await self._dispatch(request, exchange)
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
        """The API-key check, from the headers alone: ``FrontendSite`` runs it when the headers
        of a request with a body end, so a refused client never has a body byte read."""
        check_api_key(self._api_keys, request)

    def router(self) -> IInferenceRouter:
        return self._context.router

    async def _dispatch(self, request, exchange: Exchange) -> None:
        self.guard(request)
        segments = [*self._mount, *request.postpath]
        if segments and segments[-1] == b"":
            segments.pop()
        method = request.method.upper()
        key = tuple(segments)
        if key in self._routes:
            allowed, answer = self._routes[key]
            args = ()
        elif not self._mount and len(segments) >= 2 and segments[0] == b"models":
            allowed, answer = b"GET", models.answer_one
            try:
                args = (b"/".join(segments[1:]).decode("utf-8"),)
            except UnicodeDecodeError:
                raise OpenAIError(404, "no such model", "invalid_request_error",
                                  param="model", code="model_not_found") from None
        else:
            raise OpenAIError(404, f"unknown endpoint {printable(path_text(request))}",
                              "invalid_request_error", code="unknown_url")
        if method != allowed and not (allowed == b"GET" and method == b"HEAD"):
            raise OpenAIError(405, f"use {allowed.decode()} on this endpoint",
                              "invalid_request_error", code="method_not_allowed",
                              headers={"Allow": allowed.decode()})
        await answer(self._context, request, exchange, *args)
