"""The lifecycle routes: LocalAI's ``POST /backend/shutdown`` and ``POST /backend/load``
(behind ``--api-key``, as LocalAI puts them behind its admin middleware), and the answer of the
per-node ``POST /api/nodes/{id}/models/{model}/unload`` (routed by ``api/nodes.py``).

=============================  ==================================================================
route                          answer
=============================  ==================================================================
POST /backend/shutdown         body ``{"model": name, "force"?: bool}``: unloads the model on
                               every node that holds it (:meth:`ModelLifecycle.unload`);
                               ``200 {"message": "model stopped", "nodes": [result, ...]}``
                               when every node stopped it, 404 when no node holds it
POST /backend/load             body ``{"model": name}``: loads it now if it is loaded nowhere
                               (the cold load a request would make); ``200 {"loaded": [name],
                               "message": "model loaded", "node_id"}``
=============================  ==================================================================

A ``result`` is ``{"model", "node_id", "outcome", "detail"?, "condition"?}``.  One status per
outcome, so an operator never reads an absent worker as a failed one: ``busy`` and ``loading``
409 (code ``model_busy`` / ``model_loading``: wait, or ``force``), ``not-delivered`` 503 with
the condition as the code (``absent-within-grace`` with ``Retry-After``: the worker is
reconnecting and nothing changed), ``worker-failed`` 502 (the worker's own answer),
``not-loaded`` 404.  When several nodes answer differently the status is the first non-stopped
outcome's, and ``nodes`` lists each.

This module only maps HTTP to :mod:`.lifecycle`; it must never change a row itself.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger

from localai_tw import errors

from localai_tw.frontend.inference.interfaces import ModelLoadFailed, NoNodeAvailable
from localai_tw.frontend.inference.lifecycle import (
    BUSY,
    LOADING,
    NOT_DELIVERED,
    NOT_LOADED,
    WORKER_FAILED,
    UnloadResult,
)
from localai_tw.frontend.api.kit import (
    AdminResource,
    APIKeyGuard,
    printable,
    read_json_object,
    reject_unknown_fields,
    Route,
    worker_call_error,
)
from localai_tw.web.errors import APIError, bad_request, hide_host_paths

log = Logger()


class UnloadRefused(APIError):
    """An :class:`APIError` whose body also lists each node's result."""

    def __init__(self, base: APIError, results: list[UnloadResult]):
        super().__init__(base.status, base.message, base.type, code=base.code,
                         headers=base.headers)
        self.results = results

    def body(self) -> dict:
        return {**super().body(), "nodes": [r.view() for r in self.results]}


def refusal_of(result: UnloadResult) -> APIError:
    """The HTTP refusal of one result that is not ``stopped``."""
    what = f"model {printable(result.model)!r} on node {result.node_id}"
    if result.outcome == NOT_LOADED:
        return APIError(404, f"{what}: not loaded there", "not_found", code="model_not_loaded")
    if result.outcome == BUSY:
        return APIError(409, f"{what} has requests in flight: {result.detail}", "conflict",
                        code="model_busy")
    if result.outcome == LOADING:
        return APIError(409, f"{what}: {result.detail}", "conflict", code="model_loading",
                        headers={"Retry-After": "5"})
    if result.outcome in (NOT_DELIVERED, WORKER_FAILED) and result.error is not None:
        answer = worker_call_error(result.error)
        if result.outcome == NOT_DELIVERED:
            answer = APIError(answer.status, f"unload not delivered, nothing changed: "
                              f"{answer.message}", answer.type, code=answer.code,
                              headers=answer.headers)
        return answer
    return APIError(502, f"{what}: {result.detail}", "worker_error", code=result.outcome)


def answer_results(results: list[UnloadResult]) -> tuple[int, dict[str, Any]]:
    """``(200, body)`` when every result is ``stopped``; raises the first refusal otherwise."""
    for result in results:
        if not result.stopped:
            raise UnloadRefused(refusal_of(result), results)
    return 200, {"message": "model stopped", "nodes": [r.view() for r in results]}


def force_field(body: dict) -> bool:
    force = body.get("force", False)
    if not isinstance(force, bool):
        raise bad_request("force must be true or false", field="force")
    return force


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > 255:
        raise bad_request("model is required: the name of a model (1 to 255 characters)",
                          field="model")
    return model


class BackendResource(AdminResource):
    """``/backend``: LocalAI's shutdown and load routes (module docstring).

    :param inference: the replica's ``InferenceRouter`` (its ``lifecycle`` and ``loads``).
    """

    def __init__(self, inference, guard: APIKeyGuard):
        super().__init__(guard)
        self._inference = inference

    def routes(self):
        return (Route("POST", ("shutdown",), self.shutdown),
                Route("POST", ("load",), self.load))

    async def shutdown(self, request) -> tuple[int, dict]:
        body = read_json_object(request)
        reject_unknown_fields(body, ("model", "force"))
        model, force = _model(body), force_field(body)
        results = await self._inference.lifecycle.unload_everywhere(model, force=force)
        if not results:
            raise APIError(404, f"model {printable(model)!r} is not loaded on any worker node",
                           "not_found", code="model_not_loaded")
        return answer_results(results)

    async def load(self, request) -> tuple[int, dict]:
        body = read_json_object(request)
        reject_unknown_fields(body, ("model",))
        model = _model(body)
        config = self._inference.model(model)
        if config is None:
            raise APIError(404, f"model {printable(model)!r} is not configured (no YAML file "
                           "in the models directory names it; GET /v1/models lists the "
                           "configured models)", "not_found",
                           code="model_not_found")
        try:
            placement = await self._inference.loads.load(config)
        except ModelLoadFailed as e:
            raise APIError(500, f"failed to load model: {hide_host_paths(str(e))}",
                           "load_failed", code="model_load_failed") from None
        except NoNodeAvailable as e:
            raise APIError(503, str(e), "service_unavailable", code="no_node",
                           headers={"Retry-After": "5"}) from None
        except errors.ClusterError as e:
            raise worker_call_error(e) from None
        return 200, {"loaded": [model], "message": "model loaded",
                     "node_id": placement.node_id}
