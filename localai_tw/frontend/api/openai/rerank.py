"""``POST /v1/rerank``: LocalAI's Jina shape, ``{"model", "query", "documents", "top_n"}`` ->
``{"model", "results": [{"index", "document": {"text"}, "relevance_score"}], "usage"}``, best
first; one ``Rerank`` call on the model's backend, routed like every other call.

Any model may be asked, as in LocalAI (``localai.usecases`` lists, never refuses): a backend
without ``Rerank`` answers ``UNIMPLEMENTED`` (501); the shipped ``bert-numpy`` backend reranks
by bi-encoder cosine similarity (its module docstring).

What this module must never do: accept more than ``MAX_RERANK_DOCUMENTS`` documents, or
answer an index the request did not have.
"""

from __future__ import annotations

from typing import Any

from localai_tw.backends import backend_pb2

from localai_tw.localai.usecases import RERANK
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import NO_RETRY, OpenAIError, invalid
from localai_tw.frontend.api.openai.requests import INT32_MAX, read_body, resolve_model
from localai_tw.frontend.api.openai.responses import Exchange

#: Documents one request may rank.
MAX_RERANK_DOCUMENTS = 1024


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/rerank``."""
    router = context.router
    body = read_body(request)
    name, _ = resolve_model(router, body, RERANK)
    exchange.record.model = name  # a configured name: a bounded label
    query = body.string("query", required=True, nonempty=True)
    documents = _documents(body.raw("documents"))
    top_n = body.integer("top_n", 1, INT32_MAX)
    top_n = len(documents) if top_n is None else min(top_n, len(documents))
    ask = backend_pb2.RerankRequest(query=query, documents=documents, top_n=top_n)
    served = await exchange.call(router.rerank(name, ask, context.deadline()))
    exchange.served_by(served.served_by)
    result = served.value
    results = []
    for item in list(result.results)[:top_n]:
        if not 0 <= item.index < len(documents):
            raise OpenAIError(500, f"the backend ranked document {item.index}, which the "
                              "request did not have", "server_error",
                              code="bad_backend_answer", headers=NO_RETRY)
        results.append({"index": item.index, "document": {"text": documents[item.index]},
                        "relevance_score": item.relevance_score})
    exchange.send_json(200, {"model": name, "results": results, "usage": {
        "total_tokens": result.usage.total_tokens,
        "prompt_tokens": result.usage.prompt_tokens}})


def _documents(raw: Any) -> list[str]:
    if raw is None:
        raise invalid("you must provide 'documents'", "documents",
                      code="missing_required_parameter")
    if not isinstance(raw, list) or not raw:
        raise invalid("'documents' must be a non-empty list of strings", "documents",
                      code="invalid_type")
    if len(raw) > MAX_RERANK_DOCUMENTS:
        raise invalid(f"at most {MAX_RERANK_DOCUMENTS} documents are accepted", "documents",
                      code="invalid_value")
    for index, item in enumerate(raw):
        if not isinstance(item, str) or not item:
            raise invalid(f"'documents[{index}]' must be a non-empty string",
                          f"documents[{index}]", code="invalid_value")
    return list(raw)
