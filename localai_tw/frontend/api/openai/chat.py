"""``POST /v1/chat/completions``: the conversation is rendered by
:mod:`localai_tw.localai.templates` (or sent as ``Messages`` with ``UseTokenizerTemplate``);
``stream: false`` is one ``Predict`` per choice, ``stream: true`` one ``PredictStream`` written
as ``chat.completion.chunk`` events (the first carries ``role: assistant``, the last
``finish_reason``, then ``[DONE]``).  Tools, ``response_format`` and ``logprobs`` are checked
and turned into ``PredictOptions`` by :mod:`.constraints`; tool calls are read out of the
answer (:mod:`localai_tw.localai.toolcalls`) into ``tool_calls``, or, streamed, sent as
``tool_calls`` deltas once the held-back text is parsed; a call of the no-action function
(``tool_choice: auto`` under a grammar) is an answer in words: its ``message`` is the content.

What this module must never do: fetch a URL a message names (images are ``data:`` URLs only),
evaluate anything from a template or a message, or call the router for a model whose config
rules chat out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import OpenAIError, invalid
from localai_tw.frontend.api.openai.requests import MAX_CHOICES, read_body, usage_requested
from localai_tw.frontend.api.openai.responses import Exchange, Usage
from localai_tw.frontend.api.openai.turn import (
    Answer,
    ToolCall,
    TurnEvents,
    complete_turn,
    prepare_turn,
    stream_turn,
)


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/chat/completions``."""
    body = read_body(request)
    turn = await prepare_turn(context, body, exchange)
    stream = bool(body.boolean("stream"))
    n = body.integer("n", 1, MAX_CHOICES) or 1
    if stream and n != 1:
        raise invalid("streaming answers one choice; set 'n' to 1", "n",
                      code="invalid_value")
    include_usage = usage_requested(body, stream)
    completion_id, created = context.ids("chatcmpl")
    if stream:
        await stream_turn(context, exchange, turn, _ChatEvents(completion_id, created, turn.name),
                          include_usage=include_usage)
        return
    choices, usage = [], Usage()
    for index, seed in enumerate(turn.sampling.seeds(n)):
        # n distinct samples, not n copies of one
        said = await complete_turn(context, exchange, turn, seed=seed)
        usage.add(said.usage)
        choices.append(_choice(index, said, turn.plan.logprobs))
    exchange.send_json(200, {"id": completion_id, "object": "chat.completion",
                             "created": created, "model": turn.name, "choices": choices,
                             "usage": usage.body()})


def _choice(index: int, said: Answer, logprobs_asked: bool) -> dict:
    """One non-streamed choice in OpenAI's shape."""
    message: dict[str, Any] = {"role": "assistant", "content": said.content}
    if said.calls:
        message["tool_calls"] = [c.body() for c in said.calls]
    logprobs = {"content": said.logprobs or [], "refusal": None} if logprobs_asked else None
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": said.finish_reason}


@dataclass
class _ChatEvents(TurnEvents):
    """``chat.completion.chunk`` events: the first carries ``role: assistant``; calls are
    sent as ``tool_calls`` deltas (the name first, then the arguments); log probabilities ride
    on the chunk of the text they belong to."""

    id: str
    created: int
    model: str

    def _chunk(self, choices: list, **more) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices, **more}

    def _delta(self, delta: dict, logprobs: list | None = None,
               reason: str | None = None) -> dict:
        return self._chunk([{"index": 0, "delta": delta,
                             "logprobs": None if logprobs is None else
                             {"content": logprobs, "refusal": None},
                             "finish_reason": reason}])

    def start(self) -> list:
        return [self._delta({"role": "assistant", "content": ""})]

    def text(self, delta: str, logprobs: list | None) -> list:
        return [self._delta({"content": delta}, logprobs)]

    def calls(self, calls: tuple[ToolCall, ...]) -> list:
        out = []
        for index, call in enumerate(calls):
            out.append(self._delta({"tool_calls": [{
                "index": index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}]}))
            out.append(self._delta({"tool_calls": [{
                "index": index, "function": {"arguments": call.arguments}}]}))
        return out

    def end(self, reason: str, logprobs: list | None) -> list:
        return [self._delta({}, logprobs, reason)]

    def done(self, usage: dict | None) -> list:
        return ([self._chunk([], usage=usage)] if usage is not None else []) + ["[DONE]"]

    def failed(self, error: OpenAIError) -> list:
        return [error.body()]
