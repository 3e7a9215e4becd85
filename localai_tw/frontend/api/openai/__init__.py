"""The OpenAI-compatible API of every frontend replica: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, ``/v1/models`` and ``/v1/models/{id}``, LocalAI's
``/v1/models/capabilities``, ``/v1/tokenize``, ``/v1/detokenize`` and ``/v1/rerank`` (and the
unprefixed twins LocalAI serves, ``resource.UNPREFIXED``), turned into
calls on an :class:`~localai_tw.frontend.inference.interfaces.IInferenceRouter` the way LocalAI's
frontend does (contract sheet §3; for users: ``docs/openai-api.md``).  One module a concern:
``resource`` (key check, routing), ``chat``, ``completions``, ``embeddings``, ``models``,
``capabilities``, ``tokenize``, ``rerank`` (one endpoint family each), ``requests`` and
``responses`` (the shapes they share), ``sse`` (streamed answers), ``errors`` (failure ->
status), ``context`` (the replica's side).

What this package must never do: block the reactor, buffer a body beyond its cap, evaluate
anything from a template or a request, put a traceback or a credential in a response, keep a
backend call running after its client left, or reach past ``IInferenceRouter`` into the
scheduler, bridges or database.  This file only hands on the names that other modules and
the tests import.
"""

from localai_tw.frontend.api.openai.errors import OpenAIError, early_error, error_for
from localai_tw.frontend.api.openai.requests import OPENAI_MAX_BODY_BYTES
from localai_tw.frontend.api.openai.resource import (
    OpenAIResource,
    api_prefixes,
    check_api_key,
    unprefixed_aliases,
    unprefixed_roots,
)
from localai_tw.frontend.api.openai.sse import LOADING_NOTICE_INTERVAL

__all__ = [
    "LOADING_NOTICE_INTERVAL", "OPENAI_MAX_BODY_BYTES", "OpenAIError", "OpenAIResource",
    "api_prefixes", "check_api_key", "early_error", "error_for", "unprefixed_aliases",
    "unprefixed_roots",
]
