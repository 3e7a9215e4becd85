"""``POST /v1/embeddings``: one ``Embedding`` call per input item (text or token ids);
``encoding_format`` ``float`` or ``base64`` (little-endian float32); usage counted by the
backend, else by the model's ``TokenizeString``.

Token ids (``input`` as a list of ints, or a list of such lists: what LangChain's default
``OpenAIEmbeddings`` sends) go in ``PredictOptions.EmbeddingTokens``, as LocalAI sends them, to
any backend; a backend that takes text only refuses them (its ``INVALID_ARGUMENT``: 400),
fails on them (``UNKNOWN``: LocalAI's transformers embeds an empty text) or ignores them and
embeds nothing, so the answer must show the ids were evaluated
(``EmbeddingResult.prompt_tokens`` > 0); the last two are a 400 naming ``input`` and the fix.

What this module must never do: answer a per-token or empty embedding as if it were a pooled
vector, answer a vector of ignored token ids, or accept more than ``MAX_EMBEDDING_INPUTS``
items.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Callable, Sequence

from twisted.logger import Logger

from localai_tw.backends import backend_pb2
from localai_tw.errors import BackendAnswer, ClusterError

from localai_tw.localai.usecases import EMBEDDINGS
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import (
    NO_RETRY,
    OpenAIError,
    detail,
    invalid,
    public_text,
)
from localai_tw.frontend.api.openai.requests import (
    INT32_MAX,
    MAX_EMBEDDING_INPUTS,
    Fields,
    merge_sampling,
    read_body,
    resolve_model,
)
from localai_tw.frontend.api.openai.responses import Exchange

log = Logger()


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/embeddings``."""
    router = context.router
    body = read_body(request)
    name, model = resolve_model(router, body, EMBEDDINGS)
    exchange.record.model = name  # a configured name: a bounded label
    inputs = _embedding_inputs(body.raw("input"))
    encoding = body.string("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid("'encoding_format' must be float or base64", "encoding_format",
                      code="invalid_value")
    if body.has("dimensions"):
        raise invalid("'dimensions' is not supported: the model decides the vector size",
                      "dimensions", code="unsupported_parameter")
    vectors, prompt_tokens = await embed_items(context, exchange, name, model, inputs)
    data = [{"object": "embedding", "index": index,
             "embedding": _encode_vector(vector, encoding)}
            for index, vector in enumerate(vectors)]
    exchange.send_json(200, {"object": "list", "data": data, "model": name,
                             "usage": {"prompt_tokens": prompt_tokens,
                                       "total_tokens": prompt_tokens}})


async def embed_items(context: Context, exchange: Exchange, name: str, model,
                      inputs: Sequence[str | list[int]]) -> tuple[list[list[float]], int]:
    """One pooled vector per input item (one ``Embedding`` call each) and the prompt tokens
    they took: what ``/v1/embeddings`` and Ollama's ``/api/embed`` both answer from."""
    router = context.router
    sampling = merge_sampling(model.parameters, Fields({}), model.predict)
    vectors, prompt_tokens = [], 0
    tokenizer = _Tokenizer(router, exchange, name, context.deadline)
    for item in inputs:
        if isinstance(item, str):
            options = sampling.options(Embeddings=item)
        else:
            options = sampling.options(EmbeddingTokens=item)
        try:
            served = await exchange.call(router.embed(name, options, context.deadline()))
        except BackendAnswer as e:
            if isinstance(item, str) or e.code != "UNKNOWN":
                raise
            raise _text_only(name, f"; it failed on them: {public_text(e.details)}") from e
        exchange.served_by(served.served_by)
        result = served.value
        if not isinstance(item, str) and result.prompt_tokens <= 0:
            raise _text_only(name, ": it did not evaluate them")
        vectors.append(_pooled_vector(result))
        prompt_tokens += result.prompt_tokens if result.prompt_tokens > 0 else \
            await tokenizer.count(item)
    return vectors, prompt_tokens


class _Tokenizer:
    """Counts the tokens of an embeddings input whose backend reported none in
    ``EmbeddingResult.prompt_tokens`` (docs/openai-api.md, *Usage*): token ids count
    themselves; text is counted by the model's ``TokenizeString``.  A backend that cannot
    tokenize either is asked once per request, and its inputs count 0 (logged)."""

    def __init__(self, router, exchange: Exchange, name: str,
                 deadline: Callable[[], float | None]):
        self._router = router
        self._exchange = exchange
        self._name = name
        self._deadline = deadline
        self._unable = False

    async def count(self, item: str | list[int]) -> int:
        if not isinstance(item, str):
            return len(item)
        if self._unable:
            return 0
        options = backend_pb2.PredictOptions(Prompt=item)
        try:
            served = await self._exchange.call(
                self._router.tokenize(self._name, options, self._deadline()))
        except ClusterError as e:
            self._unable = True
            log.info("embeddings usage of model {model}: the backend reports no token count "
                     "and TokenizeString failed ({err}); its text inputs count 0 tokens",
                     model=self._name, err=detail(e))
            return 0
        return max(0, served.value.length or len(served.value.tokens))


def _text_only(name: str, why: str) -> OpenAIError:
    """The 400 for token ids a model's backend cannot embed (module docstring)."""
    return invalid(f"model {name!r}'s backend takes text only, not the token ids of 'input'"
                   f"{why} (LocalAI's Python backends read text); send text instead "
                   f"(LangChain: OpenAIEmbeddings(..., check_embedding_ctx_length=False))",
                   "input", code="unsupported_parameter")


def _token_ids(raw: Any, param: str) -> list[int]:
    if not raw or not all(isinstance(t, int) and not isinstance(t, bool) and
                          0 <= t <= INT32_MAX for t in raw):
        raise invalid(f"{param!r} must be a non-empty list of token ids (integers >= 0)",
                      param, code="invalid_value")
    return list(raw)


def _embedding_inputs(raw: Any) -> list[str | list[int]]:
    """Text items and token-id items of ``input``, one backend call each."""
    if raw is None:
        raise invalid("you must provide 'input'", "input", code="missing_required_parameter")
    if isinstance(raw, str):
        items: list = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in raw):
        items = [_token_ids(raw, "input")]
    elif isinstance(raw, list) and raw:
        if len(raw) > MAX_EMBEDDING_INPUTS:
            raise invalid(f"at most {MAX_EMBEDDING_INPUTS} inputs are accepted", "input",
                          code="invalid_value")
        items = []
        for index, item in enumerate(raw):
            if isinstance(item, str):
                items.append(item)
            elif isinstance(item, list):
                items.append(_token_ids(item, f"input[{index}]"))
            else:
                raise invalid(f"'input[{index}]' must be a string or a list of token ids",
                              f"input[{index}]", code="invalid_type")
    else:
        raise invalid("'input' must be a string, a list of strings, or token ids", "input",
                      code="invalid_type")
    for index, item in enumerate(items):
        if isinstance(item, str) and not item:
            raise invalid("an embedding input must not be empty", f"input[{index}]"
                          if isinstance(raw, list) else "input", code="invalid_value")
    return items


def _pooled_vector(result: backend_pb2.EmbeddingResult) -> list[float]:
    if result.layout == backend_pb2.EMBEDDING_LAYOUT_PER_TOKEN or result.tokens > 1:
        raise OpenAIError(500, "the backend answered per-token embeddings; this frontend "
                          "serves pooled vectors only (configure the model to pool)",
                          "server_error", code="unsupported_embedding_layout",
                          headers=NO_RETRY)
    vector = list(result.embeddings)
    if not vector:
        raise OpenAIError(500, "the backend answered an empty embedding", "server_error",
                          code="empty_embedding", headers=NO_RETRY)
    return vector


def _encode_vector(vector: Sequence[float], encoding: str):
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
