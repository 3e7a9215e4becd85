"""``POST /v1/completions``: each prompt through the model's ``completion`` template, one
``Predict`` per prompt and choice (``n``, each with its own seed); streaming (``text_completion`` events) allows exactly one prompt.

What this module must never do: accept token-id prompts (they are refused, not guessed at),
evaluate anything from a template or a prompt, or call the router for a model whose config
rules completions out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from localai_tw.localai.usecases import COMPLETION
from localai_tw.localai.templates import render_completion
from localai_tw.frontend.api.openai.constraints import (
    Plan,
    check_output,
    legacy_logprobs,
    logprobs_content,
    plan_completion,
    planned,
)
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import invalid
from localai_tw.frontend.api.openai.requests import (
    MAX_CHOICES,
    MAX_PROMPTS,
    merge_sampling,
    read_body,
    refuse_unhonoured,
    resolve_model,
    usage_requested,
)
from localai_tw.frontend.api.openai.responses import Exchange, Usage, finish_reason, reply_usage
from localai_tw.frontend.api.openai.sse import Chunks, stream_reply


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/completions``."""
    router = context.router
    body = read_body(request)
    name, model = resolve_model(router, body, COMPLETION)
    exchange.record.model = name  # a configured name: a bounded label
    refuse_unhonoured(body, name, chat=False)
    prompts = _prompts(body.raw("prompt"))
    stream = bool(body.boolean("stream"))
    echo = bool(body.boolean("echo"))
    if stream and len(prompts) != 1:
        raise invalid("streaming answers exactly one prompt", "prompt",
                      code="invalid_value")
    n = body.integer("n", 1, MAX_CHOICES) or 1
    if stream and n != 1:
        raise invalid("streaming answers one choice; set 'n' to 1", "n",
                      code="invalid_value")
    if len(prompts) * n > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} choices are answered (prompts times 'n')", "n",
                      code="invalid_value")
    plan = await planned(plan_completion, body, name, model, echo=echo)
    include_usage = usage_requested(body, stream)
    sampling = merge_sampling(model.parameters, body, model.predict)
    completion_id, created = context.ids("cmpl")
    if stream:
        options = sampling.options(Prompt=render_completion(model.templates, prompts[0]),
                                   **plan.options)
        await stream_reply(context, exchange, name, options, sampling, include_usage,
                           _CompletionChunks(completion_id, created, name,
                                             prompts[0] if echo else "", plan))
        return
    choices, usage = [], Usage()
    for prompt in prompts:  # OpenAI's order: the n choices of each prompt in turn
        rendered = render_completion(model.templates, prompt)
        for seed in sampling.seeds(n):
            options = sampling.options(Prompt=rendered, Seed=seed, **plan.options)
            served = await exchange.call(router.predict(name, options, context.deadline()))
            exchange.served_by(served.served_by)
            reply = served.value
            usage.add(reply_usage(reply))
            text = reply.message.decode("utf-8", "replace")
            reason = finish_reason(reply, sampling.max_tokens)
            await check_output(plan, name, text, reason)
            logprobs = legacy_logprobs(logprobs_content(reply.logprobs)) \
                if plan.logprobs else None
            choices.append({"index": len(choices), "text": (prompt + text) if echo else text,
                            "logprobs": logprobs, "finish_reason": reason})
    exchange.send_json(200, {"id": completion_id, "object": "text_completion",
                             "created": created, "model": name, "choices": choices,
                             "usage": usage.body()})


def _prompts(raw: Any) -> list[str]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        if len(raw) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts are accepted", "prompt",
                          code="invalid_value")
        return list(raw)
    if raw is None:
        raise invalid("you must provide 'prompt'", "prompt", code="missing_required_parameter")
    if isinstance(raw, list) and raw and all(isinstance(p, (int, list)) and
                                             not isinstance(p, bool) for p in raw):
        raise invalid("token-id prompts are not supported; send text", "prompt",
                      code="unsupported_parameter")
    raise invalid("'prompt' must be a string or a non-empty list of strings", "prompt",
                  code="invalid_type")


@dataclass
class _CompletionChunks(Chunks):
    id: str
    created: int
    model: str
    echo: str = ""
    plan: Plan = field(default_factory=Plan)

    def __post_init__(self):
        self.text = ""
        self.offset = 0

    def pieces(self, text: str, reply) -> list:
        self.text += text
        if not self.plan.logprobs:
            return [self.delta(text)] if text else []
        entries = logprobs_content(reply.logprobs)
        if not text and not entries:
            return []
        chunk = self.delta(text)
        chunk["choices"][0]["logprobs"] = legacy_logprobs(entries, self.offset)
        self.offset += sum(len(e["token"]) for e in entries)
        return [chunk]

    async def closing(self, reason: str) -> list:
        await check_output(self.plan, self.model, self.text, reason)
        return [self.finish(reason)]

    def _chunk(self, choices: list, **more) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **more}

    def first(self) -> list:
        return [self.delta(self.echo)] if self.echo else []

    def delta(self, text: str) -> dict:
        return self._chunk([{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": None}])

    def finish(self, reason: str) -> dict:
        return self._chunk([{"index": 0, "text": "", "logprobs": None,
                             "finish_reason": reason}])

    def usage(self, usage: dict) -> dict:
        return self._chunk([], usage=usage)
