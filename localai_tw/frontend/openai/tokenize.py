"""``POST /v1/tokenize``: LocalAI's shape, ``{"model", "content"}`` -> ``{"tokens": [ids]}``,
one ``TokenizeString`` call on the model's backend, routed like every other call (a loaded
replica of the model, else a cold load).

Any configured model may be asked: as in LocalAI, whether the backend can tokenize is the
backend's answer (one that cannot fails with its gRPC status, mapped like every backend error).
``/v1/detokenize`` is not served: the backend contract this project speaks (``backend.proto``)
has no ``Detokenize`` RPC.

What this module must never do: call the router for a model that is not configured, or send a
``content`` that is not a string.
"""

from __future__ import annotations

from localai_tw.backends import backend_pb2

from .context import Context
from .errors import error_for
from .requests import missing_model, read_body
from .responses import Exchange


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/tokenize``."""
    router = context.router
    body = read_body(request)
    name = body.string("model", required=True, nonempty=True)
    if router.model(name) is None:
        raise error_for(missing_model(router, name))
    exchange.record.model = name  # a configured name: a bounded label
    content = body.string("content", required=True)
    options = backend_pb2.PredictOptions(Prompt=content)
    served = await exchange.call(router.tokenize(name, options, context.deadline()))
    exchange.served_by(served.served_by)
    exchange.send_json(200, {"tokens": list(served.value.tokens)})
