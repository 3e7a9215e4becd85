"""``/api/chat`` and ``/api/generate``: the request translated (:mod:`.translate`), run as one
shared chat turn (``frontend/api/openai/turn.py``) and answered in Ollama's shape, one JSON
object (``stream: false``) or newline-delimited JSON objects (the default): ``message`` (chat)
or ``response`` (generate) pieces with ``done: false``, then a last object with ``done: true``,
``done_reason``, the token counts (``prompt_eval_count``, ``eval_count``) and the durations in
nanoseconds.  A failure after the stream started is a last line ``{"error": "..."}``, which
Ollama's clients raise.

What this module must never do: copy the turn's pipeline (templates, tools, grammars are the
turn's), write after a failure line, or answer a duration it did not measure as if it had
(``load_duration`` and ``prompt_eval_duration`` are 0: the replica does not see them apart).
"""

from __future__ import annotations

from typing import Any, Mapping

from localai_tw.frontend.api.kit import printable
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import OpenAIError, error_for
from localai_tw.frontend.api.openai.requests import Fields, missing_model
from localai_tw.frontend.api.openai.responses import Exchange
from localai_tw.frontend.api.openai.turn import (
    NDJSONStream,
    TurnEvents,
    complete_turn,
    prepare_turn,
    stream_turn,
)
from localai_tw.frontend.api.ollama.errors import from_openai
from localai_tw.frontend.api.ollama.models import iso
from localai_tw.frontend.api.ollama.translate import (
    Refused,
    chat_request,
    generate_request,
    is_empty_generate,
    model_name,
    tool_calls_out,
)

#: Ollama's ``done_reason`` for each turn finish (a tool call ends a turn as ``stop``).
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


class Timing:
    """The wall-clock side of an answer: ``created_at`` stamps and ``total_duration``."""

    def __init__(self, context: Context):
        self._context = context
        self._clock = context.clock()
        self._started = self._clock.seconds()

    def created_at(self) -> str:
        return iso(self._context.now())

    def durations(self, usage: Mapping[str, int] | None) -> dict:
        usage = usage or {}
        total = max(0, int((self._clock.seconds() - self._started) * 1e9))
        return {"total_duration": total, "load_duration": 0,
                "prompt_eval_count": int(usage.get("prompt_tokens", 0)),
                "prompt_eval_duration": 0,
                "eval_count": int(usage.get("completion_tokens", 0)),
                "eval_duration": total}


def _message(content: str, calls=()) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = tool_calls_out(calls)
    return message


class _Events(TurnEvents):
    """One streamed answer as Ollama's objects: ``chat`` shapes ``message``, else
    ``response``."""

    def __init__(self, model: str, chat: bool, timing: Timing):
        self.model = model
        self.chat = chat
        self.timing = timing
        self.reason = "stop"

    def _line(self, done: bool, text: str = "", calls=()) -> dict:
        line: dict[str, Any] = {"model": self.model, "created_at": self.timing.created_at()}
        if self.chat:
            line["message"] = _message(text, calls)
        else:
            line["response"] = text
        line["done"] = done
        return line

    def text(self, delta: str, logprobs: list | None) -> list:
        return [self._line(False, delta)]

    def calls(self, calls) -> list:
        return [self._line(False, "", calls)]

    def end(self, reason: str, logprobs: list | None) -> list:
        self.reason = DONE_REASONS.get(reason, reason)
        return []

    def done(self, usage: dict | None) -> list:
        line = self._line(True)
        line["done_reason"] = self.reason
        line.update(self.timing.durations(usage))
        return [line]

    def failed(self, error: OpenAIError) -> list:
        return [from_openai(error).body()]


async def answer_chat(context: Context, exchange: Exchange, body: Mapping[str, Any]) -> None:
    """``POST /api/chat``."""
    await _answer(context, exchange, body, chat=True)


async def answer_generate(context: Context, exchange: Exchange,
                          body: Mapping[str, Any]) -> None:
    """``POST /api/generate``."""
    await _answer(context, exchange, body, chat=False)


async def _answer(context: Context, exchange: Exchange, body: Mapping[str, Any],
                  chat: bool) -> None:
    timing = Timing(context)
    sent = body.get("model")
    router = context.router
    name = model_name(sent, lambda n: router.model(n) is not None)
    translated = (chat_request if chat else generate_request)(body, name)
    shaped = translated.body
    if (chat and not shaped["messages"]) or (not chat and is_empty_generate(body)):
        # Ollama's "load the model" request: answered at once (the model loads on the
        # first request that generates; docs/ollama-api.md)
        if router.model(name) is None:
            raise error_for(missing_model(router, name))  # the 404 any request gets
        line = _Events(sent, chat, timing)._line(True)
        line["done_reason"] = "load"
        exchange.send_json(200, line)
        return
    turn = await prepare_turn(context, Fields(shaped), exchange)
    if translated.num_ctx is not None:
        check_num_ctx(router.model(name), name, translated.num_ctx)
    for field_name, value in translated.predict.items():  # options beyond the OpenAI body
        setattr(turn.options, field_name, value)
    if translated.stream:
        await stream_turn(context, exchange, turn, _Events(sent, chat, timing),
                          framing=NDJSONStream, include_usage=True)
        return
    answer = await complete_turn(context, exchange, turn)
    usage = answer.usage.body()
    exchange.record.usage(usage)
    line: dict[str, Any] = {"model": sent, "created_at": timing.created_at()}
    if chat:
        line["message"] = _message(answer.content or "", answer.calls)
    else:
        line["response"] = answer.content or ""
    line["done"] = True
    line["done_reason"] = DONE_REASONS.get(answer.finish_reason, answer.finish_reason)
    line.update(timing.durations(usage))
    exchange.send_json(200, line)


def check_num_ctx(config: Any, name: str, num_ctx: int) -> None:
    """``options.num_ctx``: a model's context is set when it loads (its config's
    ``context_size``), never per request; a request asking for at most that much gets it, one
    asking for more (or for a model whose config sets none) is refused."""
    size = int(getattr(config, "context_size", 0) or 0)
    if not size:
        raise Refused(f"'options.num_ctx' is not supported for model {printable(name)!r}: its "
                      "context size is its backend's default (set context_size in its "
                      "config); send the request without it")
    if num_ctx > size:
        raise Refused(f"'options.num_ctx' {num_ctx} is more than model {printable(name)!r}'s "
                      f"context_size {size}, which is set when it loads; ask for at most {size}")
