"""One chat turn, whichever protocol asked for it: OpenAI chat completions, the Responses
API, Anthropic Messages and Ollama all translate their request into an OpenAI
chat-completions-shaped body, and this module checks, plans, renders and runs it.  An adapter
gets back a protocol-neutral :class:`Answer` (non-streamed) or calls on its own
:class:`TurnEvents` (streamed), and writes them in its own shape.

So the rules of a turn are written once: messages and their ``data:`` images, templates (the
model config's, or the GGUF's through ``UseTokenizerTemplate``), ``tool_choice`` with the
no-action function, grammars and JSON output, use cases, tool calls read out of the text (held
back while streaming), and the checks of calls and structured answers.

What this module must never do: shape a payload for one protocol (that is the adapter's
:class:`TurnEvents`), fetch a URL a message names, or evaluate anything from a template or a
message.
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
    ToolCall,
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
from localai_tw.frontend.api.openai.errors import OpenAIError, invalid
from localai_tw.frontend.api.openai.requests import (
    MAX_MESSAGES,
    Fields,
    Sampling,
    merge_sampling,
    refuse_unhonoured,
    resolve_model,
)
from localai_tw.frontend.api.openai.responses import Exchange, Usage, finish_reason, reply_usage
from localai_tw.frontend.api.openai.sse import Chunks, NDJSONStream, SSEEvent, SSEStream, stream_reply

__all__ = ["Answer", "OpenAIError", "ToolCall", "Turn", "TurnEvents", "complete_turn",
           "NDJSONStream", "SSEEvent", "SSEStream", "parse_messages", "prepare_turn",
           "stream_turn"]

#: The message roles OpenAI's chat API accepts (``function`` is its legacy spelling of
#: ``tool``); any other is refused rather than rendered into a prompt with no prefix.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


@dataclass(frozen=True)
class Turn:
    """A checked and rendered turn, ready to run: the model's name and view, the plan of
    what the request asks beyond text, the backend's options and the sampling parameters."""

    name: str
    model: Any
    plan: Plan
    options: backend_pb2.PredictOptions
    sampling: Sampling

    @property
    def functions(self) -> FunctionConfig:
        return self.model.functions


@dataclass(frozen=True)
class Answer:
    """One non-streamed answer: ``content`` (None when the answer is only calls), the tool
    calls, the finish reason (``stop``, ``length`` or ``tool_calls``), the log-probability
    entries (OpenAI's ``logprobs.content`` shape, when asked), the token usage, and the stop
    string the backend says the answer ended on (``Reply.stopping_word``; "" when it ended
    otherwise or the backend does not say)."""

    content: str | None
    calls: tuple[ToolCall, ...]
    finish_reason: str
    usage: Usage
    logprobs: list | None = None
    stopping_word: str = ""


async def prepare_turn(context: Context, body: Fields, exchange: Exchange) -> Turn:
    """Check, plan and render an OpenAI chat-shaped ``body``.  ``stream``, ``n`` and
    ``stream_options`` are the caller's: this reads neither.  :raises OpenAIError:"""
    name, model = resolve_model(context.router, body, CHAT)
    exchange.record.model = name  # a configured name: a bounded label
    refuse_unhonoured(body, name, chat=True)
    messages, images = parse_messages(body.raw("messages"))
    plan = await planned(plan_chat, body, name, model)
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
    return Turn(name, model, plan, sampling.options(Prompt=rendered.prompt, **extra), sampling)


async def complete_turn(context: Context, exchange: Exchange, turn: Turn,
                        seed: int | None = None) -> Answer:
    """Run ``turn`` as one ``Predict`` (``seed`` overrides the sampling's) and read its
    answer.  :raises OpenAIError: a call or an answer outside what was asked."""
    options = turn.options
    if seed is not None:
        options = backend_pb2.PredictOptions()
        options.CopyFrom(turn.options)
        options.Seed = seed
    served = await exchange.call(context.router.predict(turn.name, options, context.deadline()))
    exchange.served_by(served.served_by)
    reply = served.value
    answer = await read_answer(turn, reply, finish_reason(reply, turn.sampling.max_tokens))
    usage = reply_usage(reply)
    logprobs = logprobs_content(reply.logprobs) if turn.plan.logprobs else None
    return Answer(answer.content, answer.calls, answer.finish_reason, usage, logprobs,
                  reply.stopping_word)


async def read_answer(turn: Turn, reply: backend_pb2.Reply, reason: str) -> Answer:
    """The content, calls and finish reason of one whole backend reply (no usage)."""
    plan, functions, name = turn.plan, turn.functions, turn.name
    text = reply.message.decode("utf-8", "replace")
    if plan.tools is None:
        await check_output(plan, name, text, reason)
        return Answer(text, (), reason, Usage())
    parsed = parse_tool_calls(text, functions, plan.tools.names)
    parsed_by_backend = calls_from_deltas(reply.chat_deltas, plan.tools.names)
    if parsed_by_backend:  # the backend parsed the calls itself: its calls win
        content = "".join(d.content for d in reply.chat_deltas).strip()
        if not content and parsed.calls:
            content = parsed.content  # else the text is the calls' markup
        parsed = Parsed(content, tuple(parsed_by_backend))
    calls, said = split_no_action(parsed.calls, plan.tools.no_action)
    if said is not None:  # the model chose the no-action function: an answer in words
        return Answer(said, (), reason, Usage())
    if calls:
        await check_calls(plan, name, calls)
        return Answer(parsed.content or None, tuple(calls), "tool_calls", Usage())
    if plan.tools.choice in ("required", "function") and reason != "length":
        raise invalid_output(name, "a tool call was required and the answer holds none")
    cut = cut_no_action_message(text, functions, plan.tools.no_action) \
        if plan.tools.no_action and reason == "length" else None
    return Answer(cut if cut is not None else clean_content(text, functions), (), reason,
                  Usage())


class TurnEvents:
    """The payloads of one streamed turn in an adapter's protocol.  Each method returns the
    payloads to write, in order: a dict (one JSON event), an
    :class:`~localai_tw.frontend.api.openai.sse.SSEEvent` (a named SSE event) or a str
    literal.  ``logprobs`` is a list of OpenAI ``logprobs.content`` entries or None."""

    def start(self) -> list:
        """The stream's first events (sent when the first reply arrives)."""
        return []

    def text(self, delta: str, logprobs: list | None) -> list:
        """A piece of the answer's text (never empty)."""
        raise NotImplementedError

    def calls(self, calls: tuple[ToolCall, ...]) -> list:
        """The tool calls, found once the whole answer was read."""
        raise NotImplementedError

    def end(self, reason: str, logprobs: list | None) -> list:
        """The finish (``stop``, ``length`` or ``tool_calls``); ``logprobs``: entries not yet
        sent with a text event."""
        raise NotImplementedError

    def stopped_on(self, word: str) -> None:
        """Told, before :meth:`end`, the stop string the backend says the answer ended on
        (``Reply.stopping_word``); not called when it names none."""

    def done(self, usage: dict | None) -> list:
        """The last events, after :meth:`end` (``usage``: OpenAI's usage body; None only
        when the caller of :func:`stream_turn` said not to include it)."""
        return []

    def failed(self, error: OpenAIError) -> list:
        """The events that report a failure after the stream started."""
        raise NotImplementedError


@dataclass
class _TurnChunks(Chunks):
    """The stream side of :func:`read_answer`: with tools, text that may be a tool call is
    held back (:class:`~localai_tw.localai.toolcalls.ToolCallStream`) and the calls found are
    handed over at the end; log probabilities ride on the text they belong to (or the next
    text sent)."""

    turn: Turn
    events: TurnEvents
    pending_logprobs: list = field(default_factory=list)
    deltas: list = field(default_factory=list)  # Reply.chat_deltas (calls a backend parsed)
    text: str = ""  # the whole answer, for the check at the end
    stopping_word: str = ""  # the backend's Reply.stopping_word, when one names it

    def __post_init__(self):
        tools = self.turn.plan.tools
        self.tool_stream = ToolCallStream(self.turn.functions, tools.names) \
            if tools is not None else None

    def _logprobs(self) -> list | None:
        if not self.turn.plan.logprobs:
            return None
        entries, self.pending_logprobs = self.pending_logprobs, []
        return entries

    def first(self) -> list:
        return self.events.start()

    def pieces(self, text: str, reply: backend_pb2.Reply) -> list:
        if self.turn.plan.logprobs:
            self.pending_logprobs.extend(logprobs_content(reply.logprobs))
        if reply.stopping_word:
            self.stopping_word = reply.stopping_word
        if self.tool_stream is not None and reply.chat_deltas:
            self.deltas.extend(reply.chat_deltas)
        self.text += text
        if self.tool_stream is not None:
            text = self.tool_stream.feed(text)
        return self.events.text(text, self._logprobs()) if text else []

    async def closing(self, reason: str) -> list:
        plan, name = self.turn.plan, self.turn.name
        out = []
        if self.tool_stream is not None:
            rest, calls = self.tool_stream.end()
            by_backend = calls_from_deltas(self.deltas, plan.tools.names)
            if by_backend:  # the backend parsed the calls itself: its calls win
                rest = rest if calls else ""  # unparsed held text is the calls' markup
                calls = tuple(by_backend)
            no_action = plan.tools.no_action
            calls, said = split_no_action(calls, no_action)
            if said is None and not calls and no_action and reason == "length":
                said = cut_no_action_message(rest, self.turn.functions, no_action)
            if said is not None:  # the no-action function: its message is the content
                rest = said
            if rest:
                out.extend(self.events.text(rest, self._logprobs()))
            if calls:
                await check_calls(plan, name, calls)
                reason = "tool_calls"
                out.extend(self.events.calls(tuple(calls)))
            elif plan.tools.choice in ("required", "function") and reason != "length":
                raise invalid_output(name, "a tool call was required and the answer "
                                     "holds none")
        else:
            await check_output(plan, name, self.text, reason)
        logprobs = self._logprobs() if self.pending_logprobs else None
        if self.stopping_word:
            self.events.stopped_on(self.stopping_word)
        out.extend(self.events.end(reason, logprobs))
        return out

    def done(self, usage: dict | None) -> list:
        return self.events.done(usage)

    def failed(self, error: OpenAIError) -> list:
        return self.events.failed(error)


async def stream_turn(context: Context, exchange: Exchange, turn: Turn, events: TurnEvents,
                      framing: type[SSEStream] = SSEStream, include_usage: bool = True) -> None:
    """Run ``turn`` as one ``PredictStream`` written as ``events`` says, framed by
    ``framing`` (:class:`~localai_tw.frontend.api.openai.sse.SSEStream` or
    :class:`~localai_tw.frontend.api.openai.sse.NDJSONStream`).  :raises OpenAIError: the
    failure to answer, while the stream has not started (the adapter answers it in its own
    error shape); after it started, the failure is written as ``events.failed`` says."""
    await stream_reply(context, exchange, turn.name, turn.options, turn.sampling,
                       include_usage, _TurnChunks(turn, events), framing=framing)


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
