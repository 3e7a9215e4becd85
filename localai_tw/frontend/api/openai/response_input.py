"""A Responses API request (``POST /v1/responses``) read, validated and turned into the
chat-completions request the shared turn runs (``turn.py``): input items into chat messages,
``instructions`` into a system message, function tools and ``tool_choice`` into chat's shapes,
``text.format`` into ``response_format``, ``max_output_tokens`` into ``max_tokens``.

Every top-level field is either honoured, accepted as a label that is echoed (``metadata``,
``user``, ``safety_identifier``, ``prompt_cache_key``), or refused with a 400 naming it
(``unsupported_parameter`` for what this server cannot do, ``unknown_parameter`` for a field
the API does not have): a request is never answered as if a field it set were absent.  The
list is docs/responses-api.md.

What this module must never do: fetch a URL an item names (images are ``data:`` URLs, checked
by the chat pipeline), accept an unbounded list or map, or answer a malformed field with
anything but a 400 that names it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from localai_tw.frontend.api.openai.errors import invalid
from localai_tw.frontend.api.openai.requests import MAX_MESSAGES, Fields

#: Most input items in one request.
MAX_INPUT_ITEMS = MAX_MESSAGES
#: Most content parts in one message item.
MAX_PARTS = 256
#: ``metadata``: as OpenAI bounds it.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: Longest response id a client may name (``resp_`` and 32 hex digits here).
MAX_ID_CHARS = 64

HONOURED = ("model", "input", "instructions", "previous_response_id", "tools", "tool_choice",
            "parallel_tool_calls", "text", "temperature", "top_p", "max_output_tokens",
            "stream", "store", "background")
#: Accepted and echoed; they change nothing in the answer.
LABELS = ("metadata", "user", "safety_identifier", "prompt_cache_key")
#: Fields of the API this server refuses when they ask for something (each with why).
REFUSED = {
    "reasoning": "this server does not run reasoning models with a reasoning budget",
    "include": "this server adds nothing to an output beyond its text and calls",
    "prompt": "this server has no stored prompts",
    "conversation": "this server continues conversations by previous_response_id only",
    "top_logprobs": "this server does not answer log probabilities on this API",
    "max_tool_calls": "this server does not cap built-in tool calls (it has none)",
    "truncation": "this server never drops input items to fit the context ('disabled' only)",
    "service_tier": "this server has one tier ('auto' or 'default' only)",
    "stream_options": "this server does not obfuscate stream events",
}

_ROLES = ("user", "system", "developer", "assistant")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass
class ResponseRequest:
    """A validated request: the chat request to run and what the answer echoes."""

    model: str
    chat: dict
    #: This request's own input items, as ``input_items`` lists them (ids given).
    input_items: list
    #: The chat messages this request adds to the conversation (instructions excluded).
    messages: list
    previous_response_id: str | None
    stream: bool
    store: bool
    background: bool
    #: The request's fields as the response object echoes them.
    echo: dict = field(default_factory=dict)


def _refused(name: str, why: str):
    return invalid(f"{name!r} is not supported here: {why}; send the request without it",
                   name, code="unsupported_parameter")


def _check_fields(body: Fields) -> None:
    known = set(HONOURED) | set(LABELS) | set(REFUSED)
    for name in body.data:
        if name not in known:
            raise invalid(f"unknown parameter {name[:64]!r}", name[:64], code="unknown_parameter")
    reasoning = body.raw("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict)
                                  or any(v is not None for v in reasoning.values())):
        raise _refused("reasoning", REFUSED["reasoning"])
    include = body.raw("include")
    if include is not None and include != []:
        raise _refused("include", REFUSED["include"])
    for name in ("prompt", "conversation", "max_tool_calls"):
        if body.has(name):
            raise _refused(name, REFUSED[name])
    if body.raw("top_logprobs") not in (None, 0):
        raise _refused("top_logprobs", REFUSED["top_logprobs"])
    if body.raw("truncation") not in (None, "disabled"):
        raise _refused("truncation", REFUSED["truncation"])
    if body.raw("service_tier") not in (None, "auto", "default"):
        raise _refused("service_tier", REFUSED["service_tier"])
    options = body.raw("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
            raise _refused("stream_options", REFUSED["stream_options"])
        if options.get("include_obfuscation"):
            raise _refused("stream_options.include_obfuscation", REFUSED["stream_options"])


def _metadata(body: Fields) -> dict:
    value = body.mapping("metadata")
    if value is None:
        return {}
    if len(value) > MAX_METADATA_KEYS:
        raise invalid(f"'metadata' has at most {MAX_METADATA_KEYS} keys", "metadata",
                      code="invalid_value")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(item, str) \
                or len(item) > MAX_METADATA_VALUE_CHARS:
            raise invalid(f"'metadata' keys are strings of at most {MAX_METADATA_KEY_CHARS} "
                          f"characters, values of at most {MAX_METADATA_VALUE_CHARS}",
                          "metadata", code="invalid_value")
    return dict(value)


def response_id(value: Any, param: str) -> str:
    """A response id a client names (404-free syntax check: a 400 naming ``param``)."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS \
            or not value.isascii() or not value.replace("_", "").replace("-", "").isalnum():
        raise invalid(f"{param!r} must be a response id (resp_...)", param,
                      code="invalid_value")
    return value


# -- tools ---------------------------------------------------------------------------------------


def _tools(value: Any) -> list | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("'tools' must be a list", "tools", code="invalid_type")
    chat = []
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(f"{param!r} must be an object", param, code="invalid_type")
        kind = tool.get("type")
        if kind != "function":
            raise invalid(f"{param}.type {str(kind)[:40]!r} is not supported here: this "
                          "server runs function tools only", f"{param}.type",
                          code="unsupported_parameter")
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            name = sorted(unknown)[0][:64]
            raise invalid(f"unknown parameter {param}.{name}", f"{param}.{name}",
                          code="unknown_parameter")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" \
            and set(value) <= {"type", "name"}:
        if not isinstance(value.get("name"), str):
            raise invalid("'tool_choice.name' must be a string", "tool_choice.name",
                          code="invalid_type")
        return {"type": "function", "function": {"name": value["name"]}}
    raise invalid("'tool_choice' must be 'auto', 'none', 'required' or "
                  "{'type': 'function', 'name': ...} here (this server runs function tools "
                  "only)", "tool_choice", code="unsupported_parameter")


def _text_format(body: Fields) -> tuple[dict | None, dict]:
    """(chat ``response_format`` or None, the ``text`` the response echoes)."""
    text = body.mapping("text")
    if text is None:
        return None, {"format": {"type": "text"}}
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        name = sorted(unknown)[0][:64]
        raise invalid(f"unknown parameter text.{name}", f"text.{name}", code="unknown_parameter")
    if text.get("verbosity") not in (None, "medium"):
        raise _refused("text.verbosity", "this server does not steer the length of an answer")
    fmt = Fields(text, "text.").mapping("format")
    if fmt is None or fmt.get("type") == "text":
        return None, {"format": {"type": "text"}}
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}, {"format": {"type": "json_object"}}
    if kind != "json_schema":
        raise invalid("'text.format.type' must be 'text', 'json_object' or 'json_schema'",
                      "text.format.type", code="invalid_value")
    unknown = set(fmt) - {"type", "name", "schema", "strict", "description"}
    if unknown:
        name = sorted(unknown)[0][:64]
        raise invalid(f"unknown parameter text.format.{name}", f"text.format.{name}",
                      code="unknown_parameter")
    fields = Fields(fmt, "text.format.")
    name = fields.string("name", required=True, nonempty=True)
    schema = fields.mapping("schema")
    if schema is None:
        raise invalid("you must provide 'text.format.schema'", "text.format.schema",
                      code="missing_required_parameter")
    spec: dict[str, Any] = {"name": name, "schema": schema}
    if fields.boolean("strict") is not None:
        spec["strict"] = fmt["strict"]
    if fields.string("description") is not None:
        spec["description"] = fmt["description"]
    return {"type": "json_schema", "json_schema": spec}, {"format": {"type": "json_schema",
                                                                     **spec}}


# -- input items ---------------------------------------------------------------------------------


def _parts(content: Any, role: str, param: str) -> tuple[Any, list]:
    """(chat content, the item's parts as listed): a string stays a string."""
    text_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return content, [{"type": text_type, "text": content}]
    if not isinstance(content, list):
        raise invalid(f"{param!r} must be a string or a list of content parts", param,
                      code="invalid_type")
    if len(content) > MAX_PARTS:
        raise invalid(f"{param!r} has more than {MAX_PARTS} parts", param, code="invalid_value")
    chat: list = []
    listed: list = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise invalid(f"{where!r} must be an object", where, code="invalid_type")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "refusal"):
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise invalid(f"'{where}.{key}' must be a string", f"{where}.{key}",
                              code="invalid_type")
            chat.append({"type": "text", "text": text})
            listed.append({"type": kind, key: text} if kind != "output_text"
                          else {"type": kind, "text": text, "annotations": []})
        elif kind == "input_image" and role != "assistant":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise invalid(f"'{where}.image_url' must be a data: URL here (file ids are not "
                              "supported)", f"{where}.image_url", code="unsupported_parameter")
            detail = part.get("detail") or "auto"
            chat.append({"type": "image_url", "image_url": {"url": url, "detail": detail}})
            listed.append({"type": kind, "image_url": url, "detail": detail})
        else:
            raise invalid(f"'{where}.type' {str(kind)[:40]!r} is not supported here (text, and "
                          "images as data: URLs in user messages)", f"{where}.type",
                          code="unsupported_parameter")
    if all(p["type"] == "text" for p in chat):
        return "".join(p["text"] for p in chat), listed
    return chat, listed


def _call_arguments(item: dict, param: str) -> tuple[str, str, str]:
    fields = Fields(item, f"{param}.")
    return (fields.string("call_id", required=True, nonempty=True),
            fields.string("name", required=True, nonempty=True),
            fields.string("arguments", required=True))


def input_messages(value: Any) -> tuple[list, list]:
    """(chat messages, listed items) of a request's ``input``."""
    if isinstance(value, str):
        item = {"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_text", "text": value}]}
        return [{"role": "user", "content": value}], [item]
    if not isinstance(value, list):
        raise invalid("'input' must be a string or a list of items", "input",
                      code="invalid_type")
    if not value:
        raise invalid("'input' must not be empty", "input", code="invalid_value")
    if len(value) > MAX_INPUT_ITEMS:
        raise invalid(f"'input' has more than {MAX_INPUT_ITEMS} items", "input",
                      code="invalid_value")
    messages: list = []
    listed: list = []
    for index, item in enumerate(value):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid(f"{param!r} must be an object", param, code="invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid(f"'{param}.role' must be one of {', '.join(_ROLES)}",
                              f"{param}.role", code="invalid_value")
            content, parts = _parts(item.get("content"), role, f"{param}.content")
            messages.append({"role": role, "content": content})
            listed.append({"id": item.get("id") or new_id("msg"), "type": "message",
                           "role": role, "status": "completed", "content": parts})
        elif kind == "function_call":
            call_id, name, arguments = _call_arguments(item, param)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" \
                    and isinstance(last.get("content"), (str, type(None))):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            listed.append({"id": item.get("id") or new_id("fc"), "type": "function_call",
                           "call_id": call_id, "name": name, "arguments": arguments,
                           "status": "completed"})
        elif kind == "function_call_output":
            fields = Fields(item, f"{param}.")
            call_id = fields.string("call_id", required=True, nonempty=True)
            output = item.get("output")
            if isinstance(output, list):
                output, _ = _parts(output, "tool", f"{param}.output")
            if not isinstance(output, str):
                raise invalid(f"'{param}.output' must be a string", f"{param}.output",
                              code="invalid_type")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            listed.append({"id": item.get("id") or new_id("fco"),
                           "type": "function_call_output", "call_id": call_id,
                           "output": output, "status": "completed"})
        else:
            raise invalid(f"'{param}.type' {str(kind)[:40]!r} is not supported here (message, "
                          "function_call and function_call_output items)", f"{param}.type",
                          code="unsupported_parameter")
    return messages, listed


# -- the whole request ---------------------------------------------------------------------------


def read_request(body: Fields) -> ResponseRequest:
    """Validate ``body`` (without the previous conversation: :func:`chat_request` adds it)."""
    _check_fields(body)
    model = body.string("model", required=True, nonempty=True)
    if not body.has("input"):
        raise invalid("you must provide 'input'", "input", code="missing_required_parameter")
    messages, listed = input_messages(body.raw("input"))
    instructions = body.string("instructions")
    previous = body.raw("previous_response_id")
    if previous is not None:
        previous = response_id(previous, "previous_response_id")
    stream = bool(body.boolean("stream"))
    store = body.boolean("store")
    store = True if store is None else store
    background = bool(body.boolean("background"))
    if background and not store:
        raise invalid("a background response must be stored: send store: true (or leave it "
                      "out)", "background", code="invalid_value")
    if background and stream:
        raise _refused("stream", "a background response is not streamed here; poll "
                       "GET /v1/responses/{id}")
    tools = _tools(body.raw("tools"))
    tool_choice = _tool_choice(body.raw("tool_choice"))
    parallel = body.boolean("parallel_tool_calls")
    response_format, text = _text_format(body)
    temperature = body.number("temperature", 0.0, 2.0)
    top_p = body.number("top_p", 0.0, 1.0)
    max_output = body.integer("max_output_tokens", 1, 2**31 - 1)
    for label in ("user", "safety_identifier", "prompt_cache_key"):
        body.string(label)
    metadata = _metadata(body)
    given = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel,
             "response_format": response_format, "temperature": temperature, "top_p": top_p,
             "max_tokens": max_output}
    chat: dict[str, Any] = {"model": model,
                            **{key: value for key, value in given.items() if value is not None}}
    echo = {
        "instructions": instructions, "max_output_tokens": max_output,
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": previous, "reasoning": {"effort": None, "summary": None},
        "store": store, "background": background, "temperature": temperature,
        "top_p": top_p, "text": text,
        "tool_choice": body.raw("tool_choice") if tool_choice is not None else "auto",
        "tools": body.raw("tools") or [], "truncation": "disabled", "metadata": metadata,
        "user": body.raw("user"), "service_tier": "default",
    }
    chat_request = ResponseRequest(model=model, chat=chat, input_items=listed,
                                   messages=messages, previous_response_id=previous,
                                   stream=stream, store=store, background=background,
                                   echo=echo)
    chat_request.chat["messages"] = ([{"role": "system", "content": instructions}]
                                     if instructions else []) + messages
    return chat_request


def continue_from(request: ResponseRequest, conversation: list) -> None:
    """Put the previous response's conversation before this request's messages (its
    instructions do not carry over, as OpenAI's do not)."""
    total = len(conversation) + len(request.messages)
    if total > MAX_MESSAGES:
        raise invalid(f"the conversation would have {total} messages, more than "
                      f"{MAX_MESSAGES}: start a new one", "previous_response_id",
                      code="context_length_exceeded")
    instructions = request.echo.get("instructions")
    request.chat["messages"] = ([{"role": "system", "content": instructions}]
                                if instructions else []) + list(conversation) + request.messages
