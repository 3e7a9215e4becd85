"""Anthropic Messages requests and answers, translated: :func:`to_openai` checks a
``POST /v1/messages`` body and turns it into the OpenAI chat-completions request the shared
chat turn (``frontend/api/openai/turn.py``) runs; :func:`message_body` and
:class:`MessageEvents` turn the turn's result back into Anthropic's message and its SSE event
sequence (``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``).

The turn does the rest exactly as ``/v1/chat/completions`` does (templates, tools and
``tool_choice`` under its grammar rules, sampling, stop words, tool calls read out of the
answer); this module never renders a prompt or reads a backend reply.

What this module must never do: accept a field it cannot honour (every field is either
translated or refused with a 400 naming it, docs/anthropic-api.md), fetch anything a request
names (images are base64 only), or accept an unbounded list.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from localai_tw.frontend.api.kit import printable
from localai_tw.frontend.api.anthropic.errors import invalid
from localai_tw.frontend.api.openai.constraints import MAX_TOOLS
from localai_tw.frontend.api.openai.requests import INT32_MAX, MAX_MESSAGES, MAX_STOP

#: The top-level fields of a request: each is translated or checked; any other is refused
#: (Anthropic's API refuses unknown fields too).
FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking", "service_tier",
    "cache_control", "speed",
})
#: The fields of a ``POST /v1/messages/count_tokens`` request (Anthropic's list: what shapes
#: the prompt; nothing of sampling or of the answer's length).
COUNT_FIELDS = frozenset({
    "model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control",
})
#: Fields of Anthropic's API this server cannot honour, and why (a 400 naming them).
REFUSED = {
    "container": "this server runs no code-execution containers",
    "mcp_servers": "this server connects to no MCP servers",
    "context_management": "this server edits no context",
    "output_format": "structured outputs are not translated here; use /v1/chat/completions "
                     "with response_format",
    "output_config": "output configuration is not translated here",
    "inference_geo": "this server has one location",
}
#: Anthropic's stop reasons for the turn's finish reasons.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
#: Media types of base64 images Anthropic accepts.
IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


@dataclass(frozen=True)
class MessagesRequest:
    """What the answer needs of the request beyond the OpenAI-shaped body."""

    model: str
    stream: bool
    openai: dict = field(default_factory=dict)
    stop_sequences: tuple[str, ...] = ()


def _keys(obj: dict, allowed: frozenset | set, where: str) -> None:
    """Refuse a field not in ``allowed`` (a JSON ``null`` counts as absent: clients send the
    unset fields of a block they got back, ``citations: null``, ``caller: null``)."""
    extra = sorted(k for k in obj if k not in allowed and obj[k] is not None)
    if extra:
        raise invalid(f"{where}{printable(str(extra[0]), 64)}: this field is not supported "
                      f"here (docs/anthropic-api.md lists the fields served)")


def _string(obj: dict, name: str, where: str, *, required: bool = True) -> str | None:
    value = obj.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise invalid(f"{where}{name}: must be a string" if value is not None
                      else f"{where}{name}: field required")
    return value


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name}: must be a number")
    if not low <= value <= high:
        raise invalid(f"{name}: must be between {low:g} and {high:g}")
    return value


def _integer(body: dict, name: str, low: int, high: int, *, required: bool = False) -> int | None:
    value = body.get(name)
    if value is None:
        if required:
            raise invalid(f"{name}: field required")
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name}: must be an integer")
    if not low <= value <= high:
        raise invalid(f"{name}: must be between {low} and {high}")
    return value


def to_openai(body: dict, *, counting: bool = False) -> MessagesRequest:
    """The OpenAI chat-completions request of an Anthropic Messages request, or (with
    ``counting``) of a ``count_tokens`` request: the same translation of the fields that
    shape the prompt, no ``max_tokens`` (1 is put in, which renders nothing), no sampling.

    :raises AnthropicError: 400 ``invalid_request_error`` naming the field at fault."""
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise invalid(f"{name}: not supported by this server: {why}")
    _keys(body, COUNT_FIELDS if counting else FIELDS, "")
    model = _string(body, "model", "")
    if not model:
        raise invalid("model: must not be empty")
    max_tokens = 1 if counting else _integer(body, "max_tokens", 1, INT32_MAX, required=True)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream: must be true or false")
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    openai: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    temperature = _number(body, "temperature", 0.0, 1.0)
    if temperature is not None:
        openai["temperature"] = temperature
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        openai["top_p"] = top_p
    top_k = _integer(body, "top_k", 0, INT32_MAX)
    if top_k is not None:
        openai["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("stop_sequences: must be a list of strings")
        if len(stops) > MAX_STOP:
            raise invalid(f"stop_sequences: at most {MAX_STOP} are accepted")
        if any(not s for s in stops):
            raise invalid("stop_sequences: a stop sequence must not be empty")
        if stops:
            openai["stop"] = list(stops)
    _metadata(body.get("metadata"), openai)
    _thinking(body.get("thinking"))
    _cache_control(body.get("cache_control"), "cache_control")
    speed = body.get("speed")
    if speed is not None and speed != "standard":
        raise invalid("speed: only 'standard' is served here")
    tier = body.get("service_tier")
    if tier is not None and tier not in ("auto", "standard_only"):
        raise invalid("service_tier: must be 'auto' or 'standard_only' (this server has one "
                      "tier)")
    tools = body.get("tools")
    if tools is not None:
        openai["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        _tool_choice(choice, openai)
    return MessagesRequest(model=model, stream=bool(stream), openai=openai,
                           stop_sequences=tuple(openai.get("stop", ())))


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, list):
        raise invalid("system: must be a string or a list of text blocks")
    texts = []
    for index, block in enumerate(system):
        where = f"system.{index}."
        if not isinstance(block, dict) or block.get("type") != "text":
            raise invalid(f"system.{index}: must be a text block")
        _keys(block, {"type", "text", "cache_control", "citations"}, where)
        texts.append(_string(block, "text", where))
    text = "".join(texts)
    return [{"role": "system", "content": text}] if text else []


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list):
        raise invalid("messages: must be a list of messages")
    if not raw:
        raise invalid("messages: at least one message is required")
    if len(raw) > MAX_MESSAGES:
        raise invalid(f"messages: at most {MAX_MESSAGES} messages are accepted")
    out: list[dict] = []
    tool_names: dict[str, str] = {}  # tool_use id -> name, for the tool results' messages
    for index, message in enumerate(raw):
        where = f"messages.{index}."
        if not isinstance(message, dict):
            raise invalid(f"messages.{index}: must be an object")
        _keys(message, {"role", "content"}, where)
        role = _string(message, "role", where)
        if role not in ("user", "assistant"):
            raise invalid(f"{where}role: must be 'user' or 'assistant' (the system prompt is "
                          "the top-level 'system' field)")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            if role == "user":
                out.extend(_user_blocks(content, where, tool_names))
            else:
                out.append(_assistant_blocks(content, where, tool_names))
        else:
            raise invalid(f"{where}content: must be a string or a list of content blocks")
    if raw[-1].get("role") == "assistant":
        raise invalid(f"messages.{len(raw) - 1}: a final assistant message (a prefill the "
                      "answer continues) is not supported by this server; end with a user "
                      "message")
    return out


def _text_block(block: dict, where: str) -> str:
    _keys(block, {"type", "text", "cache_control", "citations"}, where)
    return _string(block, "text", where)


def _image_part(block: dict, where: str) -> dict:
    _keys(block, {"type", "source", "cache_control"}, where)
    source = block.get("source")
    if not isinstance(source, dict):
        raise invalid(f"{where}source: field required")
    if source.get("type") != "base64":
        raise invalid(f"{where}source.type: only base64 images are supported (this server "
                      "fetches no URLs and stores no files)")
    _keys(source, {"type", "media_type", "data"}, f"{where}source.")
    media = _string(source, "media_type", f"{where}source.")
    if media not in IMAGE_TYPES:
        raise invalid(f"{where}source.media_type: must be one of "
                      f"{', '.join(sorted(IMAGE_TYPES))}")
    data = _string(source, "data", f"{where}source.")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _unsupported_block(kind: Any, where: str, role: str) -> Exception:
    return invalid(f"{where}type: {printable(str(kind), 64)!r} blocks are not supported in "
                   f"{role} messages here (docs/anthropic-api.md)")


def _user_blocks(blocks: list, where: str, tool_names: dict[str, str]) -> list[dict]:
    """A user turn: its tool results first (one OpenAI ``tool`` message each), then its text
    and images as one user message."""
    results: list[dict] = []
    parts: list[dict] = []
    for index, block in enumerate(blocks):
        at = f"{where}content.{index}."
        if not isinstance(block, dict):
            raise invalid(f"{where}content.{index}: must be a content block object")
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            results.append(_tool_result(block, at, tool_names))
        else:
            raise _unsupported_block(kind, at, "user")
    out = results
    if parts or not results:
        if all(p["type"] == "text" for p in parts):
            out.append({"role": "user", "content": "".join(p["text"] for p in parts)})
        else:
            out.append({"role": "user", "content": parts})
    return out


def _tool_result(block: dict, where: str, tool_names: dict[str, str]) -> dict:
    _keys(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, where)
    call_id = _string(block, "tool_use_id", where)
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            at = f"{where}content.{index}."
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"{at}type: a tool result holds text blocks only here")
            texts.append(_text_block(part, at))
        text = "".join(texts)
    else:
        raise invalid(f"{where}content: must be a string or a list of text blocks")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid(f"{where}is_error: must be true or false")
    if is_error:
        text = f"Error: {text}"  # the model is told the call failed, in its own words
    message = {"role": "tool", "tool_call_id": call_id, "content": text}
    if call_id in tool_names:
        message["name"] = tool_names[call_id]
    return message


def _assistant_blocks(blocks: list, where: str, tool_names: dict[str, str]) -> dict:
    texts, calls, reasoning = [], [], []
    for index, block in enumerate(blocks):
        at = f"{where}content.{index}."
        if not isinstance(block, dict):
            raise invalid(f"{where}content.{index}: must be a content block object")
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            _keys(block, {"type", "id", "name", "input", "cache_control", "caller"}, at)
            caller = block.get("caller")
            if caller is not None and caller != {"type": "direct"}:
                raise invalid(f"{at}caller: only calls made by the model itself ('direct') "
                              "are served here")
            call_id = _string(block, "id", at)
            name = _string(block, "name", at)
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise invalid(f"{at}input: must be an object")
            if len(calls) >= MAX_TOOLS:
                raise invalid(f"{where}content: at most {MAX_TOOLS} tool_use blocks a message")
            tool_names[call_id] = name
            calls.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind == "thinking":
            _keys(block, {"type", "thinking", "signature"}, at)
            reasoning.append(_string(block, "thinking", at))
        else:
            raise _unsupported_block(kind, at, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def _cache_control(value: Any, where: str) -> None:
    """``cache_control`` asks Anthropic to keep a prompt prefix; nothing is cached here
    (``usage`` reports 0 cache tokens), which changes no answer, so a well-formed one is
    accepted."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise invalid(f"{where}: must be {{\"type\": \"ephemeral\"}}")
    _keys(value, {"type", "ttl"}, f"{where}.")


def _metadata(metadata: Any, openai: dict) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise invalid("metadata: must be an object")
    _keys(metadata, {"user_id"}, "metadata.")
    user = metadata.get("user_id")
    if user is not None:
        if not isinstance(user, str) or len(user) > 256:
            raise invalid("metadata.user_id: must be a string of at most 256 characters")
        openai["metadata"] = {"user_id": user}  # PredictOptions.Metadata, as OpenAI's


def _thinking(thinking: Any) -> None:
    if thinking is None:
        return
    if not isinstance(thinking, dict):
        raise invalid("thinking: must be an object")
    if thinking.get("type") == "disabled":
        return
    raise invalid("thinking: extended thinking is not supported by this server; send "
                  "thinking: {\"type\": \"disabled\"} or leave it out")


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise invalid("tools: must be a list of tools")
    if len(tools) > MAX_TOOLS:
        raise invalid(f"tools: at most {MAX_TOOLS} tools are accepted")
    out = []
    for index, tool in enumerate(tools):
        where = f"tools.{index}."
        if not isinstance(tool, dict):
            raise invalid(f"tools.{index}: must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise invalid(f"{where}type: {printable(str(kind), 64)!r} is a tool Anthropic runs "
                          "on its servers; this server offers client tools only (type "
                          "'custom' or none)")
        _keys(tool, {"type", "name", "description", "input_schema", "cache_control"}, where)
        name = _string(tool, "name", where)
        description = _string(tool, "description", where, required=False)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"{where}input_schema: must be a JSON Schema object")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if description is not None:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, openai: dict) -> None:
    """``auto``/``any``/``tool``/``none`` as the turn's ``auto``/``required``/the function/
    ``none``, and ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``."""
    if not isinstance(choice, dict):
        raise invalid("tool_choice: must be an object with a type")
    kind = choice.get("type")
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    _keys(choice, allowed, "tool_choice.")
    if kind == "auto":
        openai["tool_choice"] = "auto"
    elif kind == "any":
        openai["tool_choice"] = "required"
    elif kind == "none":
        openai["tool_choice"] = "none"
    elif kind == "tool":
        name = _string(choice, "name", "tool_choice.")
        openai["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise invalid("tool_choice.type: must be one of auto, any, tool, none")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("tool_choice.disable_parallel_tool_use: must be true or false")
        if parallel:
            openai["parallel_tool_calls"] = False
    if "tools" not in openai and kind in ("any", "tool"):
        raise invalid(f"tool_choice.type: {kind!r} needs 'tools'")


# -- answers ----------------------------------------------------------------------------------


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """Anthropic's clients expect ``toolu_`` ids; a call id of the turn is kept inside it so
    the round trip (a ``tool_result`` naming it) stays readable in logs."""
    return call_id if call_id.startswith("toolu_") else f"toolu_{call_id}"


def _input(arguments: str) -> dict:
    """A call's arguments as the ``input`` object (the turn checked they are JSON; a
    non-object is wrapped so the block stays valid)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {"raw": arguments}
    return value if isinstance(value, dict) else {"value": value}


def usage_body(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def stop_reason(reason: str, stopping_word: str,
                stop_sequences: tuple[str, ...]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for the turn's finish ``reason`` and
    the stop string the backend says the answer ended on: ``stop_sequence`` when that string
    is one of the client's ``stop_sequences`` (a stop word of the model's config is the model
    ending its turn), a tool call first.  Only the backend's word counts: the text is never
    searched for a stop sequence (a backend that does not say reports ``end_turn``)."""
    if reason != "tool_calls" and stopping_word and stopping_word in stop_sequences:
        return "stop_sequence", stopping_word
    return STOP_REASONS.get(reason, "end_turn"), None


def message_body(model: str, result, stop_sequences: tuple[str, ...] = ()) -> dict:
    """The non-streamed answer of a turn's ``result`` (content, calls, finish reason, usage)."""
    content: list[dict] = []
    if result.content or not result.calls:
        content.append({"type": "text", "text": result.content or ""})
    for call in result.calls:
        content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                        "input": _input(call.arguments)})
    reason, sequence = stop_reason(result.finish_reason, result.stopping_word, stop_sequences)
    return {"id": message_id(), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_body(result.usage.prompt_tokens, result.usage.completion_tokens)}
