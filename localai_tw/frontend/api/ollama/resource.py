"""Ollama's API as children of ``/api``: :class:`OllamaAPI` holds what every endpoint shares
(the router, the key check, the metrics, the read of loaded models) and
:meth:`OllamaAPI.endpoint` is the leaf resource ``frontend/api/routes.py`` mounts for each of
:data:`ENDPOINTS` (one row each there).  Each request: the key (also checked by the listener
before the body), the method, the JSON body, then its family (:mod:`.chat`, :mod:`.embed`,
:mod:`.models`); every failure is answered in Ollama's shape (:mod:`.errors`).

What this module must never do: answer before the key is checked, put a traceback or a
credential in an answer, or know how an endpoint builds its answer.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Iterable

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource

from localai_tw import metrics as replica_metrics

from localai_tw.frontend.api.jsonbody import prepare_json_body
from localai_tw.frontend.api.kit import APIKeyGuard, printable, read_json_object
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import OpenAIError, detail, error_for
from localai_tw.frontend.api.openai.responses import Exchange, NodeNames, path_text
from localai_tw.frontend.api.openai.sse import AlreadyAnswered
from localai_tw.frontend.api.ollama import chat, embed, models
from localai_tw.frontend.api.ollama.errors import (
    OllamaError,
    check_key,
    from_openai,
    ollama_error,
)
from localai_tw.frontend.api.ollama.translate import Refused, model_name
from localai_tw.web.errors import APIError

log = Logger()

#: ``/api/<name>`` -> the method it answers (GET also answers HEAD).
ENDPOINTS = {
    b"chat": b"POST", b"generate": b"POST", b"embed": b"POST", b"embeddings": b"POST",
    b"show": b"POST", b"tags": b"GET", b"ps": b"GET", b"version": b"GET",
}

_SHOW_FIELDS = frozenset({"model", "name", "verbose"})


class OllamaAPI:
    """The shared side of every Ollama endpoint.

    :param router: the replica's ``IInferenceRouter``.
    :param api_keys: the frontend's :class:`APIKeyGuard` (inference or admin keys; open when
        none is configured, as ``/v1``).
    :param loaded: ``loaded() -> Deferred or coroutine of model names`` loaded on some node
        (``/api/ps``); None: none known.
    """

    def __init__(self, router, *, api_keys: APIKeyGuard | None = None,
                 deadline_seconds: float | None = None, reactor=None,
                 now: Callable[[], float] = time.time,
                 node_names: Callable[[str], Any] | None = None,
                 metrics: replica_metrics.ReplicaMetrics = replica_metrics.DISCARD,
                 loaded: Callable[[], Awaitable[Iterable[str]]] | None = None):
        self.context = Context(router, deadline_seconds, reactor, now)
        self._names = NodeNames(node_names) if node_names is not None else None
        self._api_keys = api_keys
        self._metrics = metrics
        self._loaded = loaded

    def guard(self, request) -> None:
        """The key check from the headers alone (the listener's header guard)."""
        check_key(self._api_keys, request)

    def endpoint(self, name: bytes) -> Resource:
        if name not in ENDPOINTS:
            raise KeyError(name)
        return _Endpoint(self, name)

    # -- one request --------------------------------------------------------------------------

    async def serve(self, request, name: bytes) -> None:
        exchange = Exchange(request, self._names, self._metrics.request((b"ollama", name)))
        replica_metrics.trace_hops(exchange.record.hops)
        try:
            await self._dispatch(request, exchange, name)
        except AlreadyAnswered:
            return
        except defer.CancelledError:
            if exchange.gone:
                return
            self._answer_error(exchange, OllamaError(500, "the request was cancelled"), None)
        except Refused as e:
            self._answer_error(exchange, OllamaError(e.status, e.message), e)
        except (OllamaError, OpenAIError, APIError) as e:
            self._answer_error(exchange, ollama_error(e), e)
        except Exception as e:
            self._answer_failure(exchange, e)

    def _answer_failure(self, exchange: Exchange, cause: Exception) -> None:
        """A failure of the router or of this code: logged as ``/v1`` logs it (a traceback
        only for an internal error), answered in Ollama's shape."""
        request = exchange.request
        answer = error_for(cause)
        if answer.code == "internal_error":
            log.failure("{method} {path} failed", Failure(cause),
                        method=request.method.decode("ascii", "replace"),
                        path=printable(path_text(request)))
        else:
            log.info("{method} {path}: {status} {code} ({condition}): {message}",
                     method=request.method.decode("ascii", "replace"),
                     path=printable(path_text(request)), status=answer.status,
                     code=answer.code, condition=getattr(cause, "condition", "-"),
                     message=detail(cause))
        self._answer_error(exchange, from_openai(answer), cause)

    def _answer_error(self, exchange: Exchange, answer: OllamaError,
                      cause: BaseException | None) -> None:
        exchange.record.failed(cause)
        exchange.send_json(answer.status, answer.body(), answer.headers)

    async def _dispatch(self, request, exchange: Exchange, name: bytes) -> None:
        self.guard(request)
        if [s for s in request.postpath if s]:
            raise OllamaError(404, f"unknown endpoint {printable(path_text(request))}")
        method = request.method.upper()
        allowed = ENDPOINTS[name]
        if method != allowed and not (allowed == b"GET" and method == b"HEAD"):
            raise OllamaError(405, f"use {allowed.decode()} on this endpoint",
                              {"Allow": allowed.decode()})
        context = self.context
        if name == b"version":
            exchange.send_json(200, models.version())
            return
        if name == b"tags":
            exchange.send_json(200, models.tags(context.router.models()))
            return
        if name == b"ps":
            exchange.send_json(200, await self._running())
            return
        await prepare_json_body(request, context.reactor)  # a big body: off the reactor
        body = read_json_object(request)
        if name == b"chat":
            await chat.answer_chat(context, exchange, body)
        elif name == b"generate":
            await chat.answer_generate(context, exchange, body)
        elif name == b"embed":
            await embed.answer_embed(context, exchange, body)
        elif name == b"embeddings":
            await embed.answer_embeddings(context, exchange, body)
        else:  # show
            exchange.send_json(200, self._show(body))

    def _show(self, body: dict) -> dict:
        for key in body:
            if key not in _SHOW_FIELDS:
                raise Refused(f"'{str(key)[:80]}' is not a field of this endpoint")
        sent = body.get("model") if body.get("model") is not None else body.get("name")
        router = self.context.router
        name = model_name(sent, lambda n: router.model(n) is not None)
        config = router.model(name)
        if config is None:
            raise OllamaError(404, f"model {printable(name)!r} not found")
        return models.show(config)

    async def _running(self) -> dict:
        names = list(await defer.maybeDeferred(self._loaded)) \
            if self._loaded is not None else []
        configs = {str(getattr(c, "name", "")): c for c in self.context.router.models()}
        return models.running(configs, sorted(set(names)))


class _Endpoint(Resource):
    """``/api/<name>``: one endpoint of :class:`OllamaAPI`."""

    isLeaf = True

    def __init__(self, api: OllamaAPI, name: bytes):
        super().__init__()
        self._api = api
        self._name = name

    def render(self, request):
        answering = defer.ensureDeferred(self._api.serve(request, self._name))
        answering.addErrback(lambda f: log.failure("answering {path} failed", f,
                                                   path=printable(path_text(request))))
        return server.NOT_DONE_YET
