"""``POST /v1/tokenize`` and ``POST /v1/detokenize``, in LocalAI's shapes:
``{"model", "content"}`` -> ``{"tokens": [ids]}``, one ``TokenizeString`` call, and
``{"model", "tokens": [ids]}`` -> ``{"content"}``, one ``Detokenize`` call; each routed like
every other call (a loaded replica of the model, else a cold load).

Any configured model may be asked: as in LocalAI, whether the backend can (de)tokenize is the
backend's answer (one that cannot fails with its gRPC status, mapped like every backend error:
``UNIMPLEMENTED`` is a 501, an id outside the vocabulary the backend's ``INVALID_ARGUMENT``, a
400).  ``DetokenizeRequest`` carries no ``ModelIdentity`` in LocalAI's contract, so the backend
cannot check which model it holds; the router still sends it only to a port it records as
holding this model.

What this module must never do: call the router for a model that is not configured, send a
``content`` that is not a string, or send more than ``MAX_DETOKENIZE_TOKENS`` ids or one that
is not an int32 >= 0.
"""

from __future__ import annotations

from typing import Any

from localai_tw.backends import backend_pb2

from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import error_for, invalid
from localai_tw.frontend.api.openai.requests import INT32_MAX, Fields, missing_model, read_body
from localai_tw.frontend.api.openai.responses import Exchange

#: Most token ids one ``/v1/detokenize`` request may send (a long context's worth).
MAX_DETOKENIZE_TOKENS = 262144


def _configured_model(context: Context, body: Fields, exchange: Exchange) -> str:
    router = context.router
    name = body.string("model", required=True, nonempty=True)
    if router.model(name) is None:
        raise error_for(missing_model(router, name))
    exchange.record.model = name  # a configured name: a bounded label
    return name


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/tokenize``."""
    body = read_body(request)
    name = _configured_model(context, body, exchange)
    content = body.string("content", required=True)
    options = backend_pb2.PredictOptions(Prompt=content)
    served = await exchange.call(context.router.tokenize(name, options, context.deadline()))
    exchange.served_by(served.served_by)
    exchange.send_json(200, {"tokens": list(served.value.tokens)})


async def answer_detokenize(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/detokenize``."""
    body = read_body(request)
    name = _configured_model(context, body, exchange)
    tokens = _token_ids(body.raw("tokens"))
    ask = backend_pb2.DetokenizeRequest(tokens=tokens)
    served = await exchange.call(context.router.detokenize(name, ask, context.deadline()))
    exchange.served_by(served.served_by)
    exchange.send_json(200, {"content": served.value.content})


def _token_ids(raw: Any) -> list[int]:
    if raw is None:
        raise invalid("you must provide 'tokens'", "tokens", code="missing_required_parameter")
    if not isinstance(raw, list) or not raw:
        raise invalid("'tokens' must be a non-empty list of token ids", "tokens",
                      code="invalid_type" if not isinstance(raw, list) else "invalid_value")
    if len(raw) > MAX_DETOKENIZE_TOKENS:
        raise invalid(f"at most {MAX_DETOKENIZE_TOKENS} token ids are accepted; split the "
                      "request", "tokens", code="invalid_value")
    for index, token in enumerate(raw):
        if isinstance(token, bool) or not isinstance(token, int) or \
                not 0 <= token <= INT32_MAX:
            raise invalid(f"'tokens[{index}]' must be a token id (an integer from 0 to "
                          f"{INT32_MAX})", f"tokens[{index}]", code="invalid_value")
    return list(raw)
