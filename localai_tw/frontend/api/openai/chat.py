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

from dataclasses import dataclass, field
from typing import Any

from localai_tw.backends import backend_pb2

from localai_tw.localai.usecases import CHAT
from localai_tw.localai.templates import ChatMessage, render_chat, tool_calls_json
from localai_tw.localai.toolcalls import (
    FunctionConfig,
    Parsed,
    ToolCallStream,
    calls_from_deltas,
    clean_content,
    cut_no_action_message,
    parse_tool_calls,
    split_no_action,
)
from localai_tw.frontend.api.kit import printable
from localai_tw.frontend.api.openai.constraints import (
    MAX_TOOLS,
    Plan,
    check_calls,
    check_output,
    invalid_output,
    logprobs_content,
    plan_chat,
    planned,
)
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import invalid
from localai_tw.frontend.api.openai.requests import (
    MAX_CHOICES,
    MAX_MESSAGES,
    Fields,
    merge_sampling,
    read_body,
    refuse_unhonoured,
    resolve_model,
    usage_requested,
)
from localai_tw.frontend.api.openai.responses import Exchange, Usage, finish_reason, reply_usage
from localai_tw.frontend.api.openai.sse import Chunks, stream_reply


#: The message roles OpenAI's chat API accepts (``function`` is its legacy spelling of
#: ``tool``); any other is refused rather than rendered into a prompt with no prefix.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/chat/completions``."""
    router = context.router
    body = read_body(request)
    name, model = resolve_model(router, body, CHAT)
    exchange.record.model = name  # a configured name: a bounded label
    refuse_unhonoured(body, name, chat=True)
    messages, images = parse_messages(body.raw("messages"))
    plan = await planned(plan_chat, body, name, model)
    stream = bool(body.boolean("stream"))
    n = body.integer("n", 1, MAX_CHOICES) or 1
    if stream and n != 1:
        raise invalid("streaming answers one choice; set 'n' to 1", "n",
                      code="invalid_value")
    include_usage = usage_requested(body, stream)
    sampling = merge_sampling(model.parameters, body, model.predict)
    extra: dict[str, Any] = dict(plan.options)
    if images:
        extra["Images"] = images
    shown = list(plan.tools.tools) if plan.tools is not None else None
    rendered = render_chat(model.templates, messages, shown, grammar=bool(plan.grammar))
    if rendered.use_tokenizer_template:
        extra["UseTokenizerTemplate"] = True
        extra["Messages"] = [backend_pb2.Message(
            role=m.role, content=m.content, name=m.name, tool_call_id=m.tool_call_id,
            tool_calls=m.tool_calls, reasoning_content=m.reasoning_content)
            for m in rendered.messages]
    options = sampling.options(Prompt=rendered.prompt, **extra)
    completion_id, created = context.ids("chatcmpl")
    if stream:
        await stream_reply(context, exchange, name, options, sampling, include_usage,
                           _ChatChunks(completion_id, created, name, plan, model.functions))
        return
    choices, usage = [], Usage()
    for index, seed in enumerate(sampling.seeds(n)):
        choice = backend_pb2.PredictOptions()
        choice.CopyFrom(options)
        choice.Seed = seed  # n distinct samples, not n copies of one
        served = await exchange.call(router.predict(name, choice, context.deadline()))
        exchange.served_by(served.served_by)
        reply = served.value
        usage.add(reply_usage(reply))
        choices.append(await _choice(index, reply, plan, model.functions, name,
                                     finish_reason(reply, sampling.max_tokens)))
    exchange.send_json(200, {"id": completion_id, "object": "chat.completion",
                             "created": created, "model": name, "choices": choices,
                             "usage": usage.body()})


async def _choice(index: int, reply: backend_pb2.Reply, plan: Plan, functions: FunctionConfig,
                  name: str, reason: str) -> dict:
    """One non-streamed choice: content or tool calls, log probabilities, finish reason."""
    text = reply.message.decode("utf-8", "replace")
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if plan.tools is not None:
        parsed = parse_tool_calls(text, functions, plan.tools.names)
        parsed_by_backend = calls_from_deltas(reply.chat_deltas, plan.tools.names)
        if parsed_by_backend:  # the backend parsed the calls itself: its calls win
            content = "".join(d.content for d in reply.chat_deltas).strip()
            if not content and parsed.calls:
                content = parsed.content  # else the text is the calls' markup
            parsed = Parsed(content, tuple(parsed_by_backend))
        calls, said = split_no_action(parsed.calls, plan.tools.no_action)
        if said is not None:  # the model chose the no-action function: an answer in words
            message["content"] = said
        elif calls:
            await check_calls(plan, name, calls)
            message = {"role": "assistant", "content": parsed.content or None,
                       "tool_calls": [c.body() for c in calls]}
            reason = "tool_calls"
        elif plan.tools.choice in ("required", "function") and reason != "length":
            raise invalid_output(name, "a tool call was required and the answer holds none")
        else:
            cut = cut_no_action_message(text, functions, plan.tools.no_action) \
                if plan.tools.no_action and reason == "length" else None
            message["content"] = cut if cut is not None else clean_content(text, functions)
    else:
        await check_output(plan, name, text, reason)
    logprobs = None
    if plan.logprobs:
        logprobs = {"content": logprobs_content(reply.logprobs), "refusal": None}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def parse_messages(raw: Any) -> tuple[list[ChatMessage], list[str]]:
    """The chat messages and the base64 images they carry (``data:`` URLs only; this frontend
    never fetches a URL).  :raises OpenAIError: 400 naming the offending field."""
    if not isinstance(raw, list):
        raise invalid("'messages' must be a list of message objects", "messages",
                      code="invalid_type")
    if not raw:
        raise invalid("'messages' must hold at least one message", "messages",
                      code="invalid_value")
    if len(raw) > MAX_MESSAGES:
        raise invalid(f"at most {MAX_MESSAGES} messages are accepted", "messages",
                      code="invalid_value")
    messages, images = [], []
    for index, item in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise invalid(f"{where!r} must be an object", where, code="invalid_type")
        fields = Fields(item, prefix=f"{where}.")
        role = fields.string("role", required=True, nonempty=True)
        if role not in ROLES:
            raise invalid(f"'{where}.role' {printable(role)!r} is not a role; the roles are "
                          f"{', '.join(ROLES)}", f"{where}.role", code="invalid_value")
        content = _message_content(item.get("content"), f"{where}.content", images)
        tool_calls = item.get("tool_calls")
        if tool_calls is not None and (
                not isinstance(tool_calls, list) or len(tool_calls) > MAX_TOOLS or
                not all(isinstance(c, dict) for c in tool_calls)):
            raise invalid(f"'{where}.tool_calls' must be a list of at most {MAX_TOOLS} tool "
                          "call objects", f"{where}.tool_calls", code="invalid_type")
        messages.append(ChatMessage(
            role=role, content=content, name=fields.string("name") or "",
            tool_call_id=fields.string("tool_call_id") or "",
            tool_calls=tool_calls_json(tool_calls),
            reasoning_content=fields.string("reasoning_content") or ""))
    return messages, images


def _message_content(content: Any, param: str, images: list[str]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param!r} must be a string or a list of content parts", param,
                      code="invalid_type")
    texts = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise invalid(f"{where!r} must be an object", where, code="invalid_type")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"'{where}.text' must be a string", f"{where}.text",
                              code="invalid_type")
            texts.append(text)
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url.startswith("data:") or \
                    ";base64," not in url[:256]:
                raise invalid(f"'{where}.image_url.url' must be a data: URL with base64 "
                              "content (this server fetches no URLs)",
                              f"{where}.image_url.url", code="invalid_value")
            images.append(url.split(";base64,", 1)[1])
        else:
            raise invalid(f"'{where}.type' {printable(str(kind))!r} is not supported "
                          "(text, image_url)", f"{where}.type", code="invalid_value")
    return "".join(texts)


@dataclass
class _ChatChunks(Chunks):
    """Chat chunks; with tools, text that may be a tool call is held back
    (:class:`~localai_tw.localai.toolcalls.ToolCallStream`) and the calls found are sent at
    the end as ``tool_calls`` deltas (the name first, then the arguments); log probabilities
    ride on the chunk of the text they belong to (or the next one sent)."""

    id: str
    created: int
    model: str
    plan: Plan = field(default_factory=Plan)
    functions: FunctionConfig = field(default_factory=FunctionConfig)

    def __post_init__(self):
        tools = self.plan.tools
        self.tool_stream = ToolCallStream(self.functions, tools.names) \
            if tools is not None else None
        self.pending_logprobs: list = []
        self.deltas: list = []  # Reply.chat_deltas (calls a backend parsed itself)
        self.text = ""  # the whole answer, for the JSON check at the end

    def _chunk(self, choices: list, **more) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices, **more}

    def first(self) -> dict:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def _logprobs(self) -> dict | None:
        if not self.plan.logprobs:
            return None
        entries, self.pending_logprobs = self.pending_logprobs, []
        return {"content": entries, "refusal": None}

    def delta(self, text: str) -> dict:
        return self._chunk([{"index": 0, "delta": {"content": text},
                             "logprobs": self._logprobs(), "finish_reason": None}])

    def pieces(self, text: str, reply: backend_pb2.Reply) -> list:
        if self.plan.logprobs:
            self.pending_logprobs.extend(logprobs_content(reply.logprobs))
        if self.tool_stream is not None and reply.chat_deltas:
            self.deltas.extend(reply.chat_deltas)
        self.text += text
        if self.tool_stream is not None:
            text = self.tool_stream.feed(text)
        return [self.delta(text)] if text else []

    async def closing(self, reason: str) -> list:
        out = []
        if self.tool_stream is not None:
            rest, calls = self.tool_stream.end()
            by_backend = calls_from_deltas(self.deltas, self.plan.tools.names)
            if by_backend:  # the backend parsed the calls itself: its calls win
                rest = rest if calls else ""  # unparsed held text is the calls' markup
                calls = tuple(by_backend)
            no_action = self.plan.tools.no_action
            calls, said = split_no_action(calls, no_action)
            if said is None and not calls and no_action and reason == "length":
                said = cut_no_action_message(rest, self.functions, no_action)
            if said is not None:  # the no-action function: its message is the content
                rest = said
            if rest:
                out.append(self.delta(rest))
            if calls:
                await check_calls(self.plan, self.model, calls)
                reason = "tool_calls"
                for index, call in enumerate(calls):
                    out.append(self._chunk([{"index": 0, "delta": {"tool_calls": [{
                        "index": index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}]},
                        "logprobs": None, "finish_reason": None}]))
                    out.append(self._chunk([{"index": 0, "delta": {"tool_calls": [{
                        "index": index, "function": {"arguments": call.arguments}}]},
                        "logprobs": None, "finish_reason": None}]))
            elif self.plan.tools.choice in ("required", "function") and reason != "length":
                raise invalid_output(self.model, "a tool call was required and the answer "
                                     "holds none")
        else:
            await check_output(self.plan, self.model, self.text, reason)
        out.append(self._chunk([{"index": 0, "delta": {}, "logprobs": self._logprobs()
                                 if self.pending_logprobs else None,
                                 "finish_reason": reason}]))
        return out

    def finish(self, reason: str) -> dict:
        return self._chunk([{"index": 0, "delta": {}, "logprobs": None,
                             "finish_reason": reason}])

    def usage(self, usage: dict) -> dict:
        return self._chunk([], usage=usage)
