"""Ollama's request fields, checked and translated into the OpenAI chat-completions-shaped body
the shared turn (``frontend/api/openai/turn.py``) runs: ``/api/chat`` and ``/api/generate``
bodies, ``options`` (what maps onto a chat field is passed on, the rest is refused by name),
``format`` (``json`` or a JSON schema: structured output), ``images`` (base64, as ``data:``
URLs), tool calls both ways, ``keep_alive`` (checked, documented as not acted on) and the
``name:tag`` model names Ollama clients send (``:latest`` is the plain name).

The table of fields is ``docs/ollama-api.md``; each field here is honoured or refused there.

What this module must never do: accept a field it does not honour without saying so in
``docs/ollama-api.md``, pass an Ollama ``template`` on (templates come from the model config,
never from a request), decode an image beyond checking it is base64, or accept an unbounded
list from a request.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from localai_tw.frontend.api.kit import printable
from localai_tw.frontend.api.openai.requests import INT32_MAX, MAX_STOP

#: Most images in one message (or one ``/api/generate`` request).
MAX_IMAGES = 16
#: Most messages and tools, as the OpenAI side bounds them (checked again there).
MAX_MESSAGES = 4096
#: The tag Ollama clients add to a name that has none.
LATEST = ":latest"


class Refused(ValueError):
    """A 400 in Ollama's error shape: ``message`` names the field."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def _field(name: str) -> str:
    return printable(name, 80)


# -- model names -------------------------------------------------------------------------------


def model_name(raw: Any, known) -> str:
    """The configured model an Ollama ``model`` names: ``name:latest`` is ``name`` (unless a
    config is called ``name:latest`` itself); any other tag must be part of a config's name.
    ``known(name) -> bool``.  :raises Refused: missing or not a string (400)."""
    if not isinstance(raw, str) or not raw:
        raise Refused("'model' is required (a string naming a configured model)")
    if known(raw):
        return raw
    if raw.endswith(LATEST) and known(raw[:-len(LATEST)]):
        return raw[:-len(LATEST)]
    return raw  # unknown: the turn answers 404 with the name as sent


def display_name(name: str) -> str:
    """A configured name as Ollama clients list it: ``name:latest`` when it has no tag."""
    return name if ":" in name else name + LATEST


# -- options -----------------------------------------------------------------------------------

#: ``options`` keys passed on: Ollama's name -> the OpenAI chat field.
MAPPED_OPTIONS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "num_predict": "max_tokens",
}

#: ``options`` keys the OpenAI body has no field for, set on the backend's ``PredictOptions``
#: as LocalAI sets them: Ollama's name -> (field, lowest, highest, integer).
PREDICT_OPTIONS = {
    "repeat_penalty": ("Penalty", 0.0, 100.0, False),
    "repeat_last_n": ("Repeat", 0, INT32_MAX, True),
    "typical_p": ("TypicalP", 0.0, 1.0, False),
    "mirostat": ("Mirostat", 0, 2, True),
    "mirostat_tau": ("MirostatTAU", 0.0, 100.0, False),
    "mirostat_eta": ("MirostatETA", 0.0, 1.0, False),
}

#: ``options`` keys refused, with why.
REFUSED_OPTIONS = {
    "tfs_z": "tail-free sampling is gone from llama.cpp",
    "penalize_newline": "llama.cpp no longer has it",
    "num_keep": "this server does not keep tokens across a context shift",
}
#: Load-time options: the model config decides them, never a request.
LOAD_OPTIONS = frozenset({
    "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
    "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread",
})


def _number(options: Mapping[str, Any], key: str) -> float | int:
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(f"'options.{key}' must be a number")
    return value


def _integer(options: Mapping[str, Any], key: str) -> int:
    value = _number(options, key)
    if isinstance(value, float):
        if not value.is_integer():
            raise Refused(f"'options.{key}' must be an integer")
        value = int(value)
    return value


def map_options(raw: Any, into: dict[str, Any], predict: dict[str, Any]) -> int | None:
    """``options`` onto the OpenAI-shaped ``into`` (ranges are checked there, named as the
    OpenAI field; types here, named as the option) and ``predict`` (``PredictOptions`` fields,
    checked here); returns ``num_ctx`` (checked against the model by the caller).
    :raises Refused: an option this server does not honour, by name and why."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise Refused("'options' must be an object")
    for key in raw:
        if not isinstance(key, str):
            raise Refused("'options' keys must be strings")
        if raw[key] is None:
            continue
        if key in REFUSED_OPTIONS:
            raise Refused(f"'options.{key}' is not supported: {REFUSED_OPTIONS[key]}; send the "
                          "request without it")
        if key in LOAD_OPTIONS:
            raise Refused(f"'options.{key}' is a load-time setting: the model config decides "
                          "it; send the request without it")
        if key not in MAPPED_OPTIONS and key not in PREDICT_OPTIONS and key != "num_ctx":
            raise Refused(f"'options.{_field(key)}' is not an option this server knows")
    for key, target in MAPPED_OPTIONS.items():
        if raw.get(key) is None:
            continue
        if key == "stop":
            stop = raw[key]
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or \
                    len(stop) > MAX_STOP:
                raise Refused(f"'options.stop' must be a list of at most {MAX_STOP} strings")
            into["stop"] = stop
        elif key == "num_predict":
            count = _integer(raw, key)
            if count < -2 or count > INT32_MAX:
                raise Refused(f"'options.num_predict' must be between -2 and {INT32_MAX}")
            if count > 0:  # 0, -1 (no limit) and -2 (fill the context): until the model stops
                into["max_tokens"] = count
        elif key in ("top_k", "seed"):
            into[target] = _integer(raw, key)
        else:
            into[target] = _number(raw, key)
    for key, (target, low, high, integral) in PREDICT_OPTIONS.items():
        if raw.get(key) is None:
            continue
        value = _integer(raw, key) if integral else float(_number(raw, key))
        if not low <= value <= high:
            raise Refused(f"'options.{key}' must be between {low} and {high}")
        predict[target] = value
    if raw.get("num_ctx") is None:
        return None
    num_ctx = _integer(raw, "num_ctx")
    if num_ctx < 1:
        raise Refused("'options.num_ctx' must be a positive integer")
    return num_ctx


# -- keep_alive, format, think -----------------------------------------------------------------

_DURATION = re.compile(r"^-?(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+$|^-?\d+(?:\.\d+)?$")


def check_keep_alive(raw: Any) -> None:
    """``keep_alive``: a number of seconds or a Go duration (``5m``, ``1h30m``, ``-1``, ``0``).
    Checked, not acted on: the replica's idle watchdog and eviction decide when a model is
    unloaded (``docs/ollama-api.md``).  :raises Refused: not a duration."""
    if raw is None:
        return
    if isinstance(raw, bool):
        raise Refused("'keep_alive' must be a duration (\"5m\") or a number of seconds")
    if isinstance(raw, (int, float)):
        return
    if not isinstance(raw, str) or len(raw) > 64 or not _DURATION.match(raw):
        raise Refused("'keep_alive' must be a duration (\"5m\", \"1h\", \"0\", \"-1\") or a "
                      "number of seconds")


def map_format(raw: Any, into: dict[str, Any]) -> None:
    """``format``: ``json`` is a JSON object answer, an object is a JSON schema the answer
    follows (the grammar the turn builds), ``""`` is none."""
    if raw is None or raw == "":
        return
    if raw == "json":
        into["response_format"] = {"type": "json_object"}
    elif isinstance(raw, dict):
        into["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "format", "schema": raw,
                                                   "strict": True}}
    else:
        raise Refused("'format' must be \"json\" or a JSON schema object")


def check_think(raw: Any) -> None:
    """``think``: false (or absent) is what this server does; a thinking answer is refused."""
    if raw is None or raw is False:
        return
    raise Refused("'think' is not supported: this server answers without a separate thinking "
                  "output; send think: false or leave it out")


def check_logprobs(body: Mapping[str, Any]) -> None:
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise Refused("'logprobs' and 'top_logprobs' are not supported on the Ollama API "
                      "here; use /v1/chat/completions for log probabilities")


# -- images ------------------------------------------------------------------------------------

_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"RIFF", "image/webp"))


def image_url(raw: Any, where: str) -> str:
    """One Ollama image (base64 text) as a ``data:`` URL.  :raises Refused: not base64."""
    if not isinstance(raw, str) or not raw:
        raise Refused(f"'{where}' must be a base64-encoded image")
    try:
        head = base64.b64decode(raw[:16], validate=True)
        base64.b64decode(raw, validate=True)  # C speed; the body is capped
    except (binascii.Error, ValueError):
        raise Refused(f"'{where}' must be a base64-encoded image (this server fetches no "
                      "URLs and reads no paths)") from None
    media = next((m for magic, m in _MAGIC if head.startswith(magic)),
                 "application/octet-stream")
    return f"data:{media};base64,{raw}"


def _images(raw: Any, where: str) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_IMAGES:
        raise Refused(f"'{where}' must be a list of at most {MAX_IMAGES} base64 images")
    return [{"type": "image_url", "image_url": {"url": image_url(item, f"{where}[{i}]")}}
            for i, item in enumerate(raw)]


def _content(text: str, images: list[dict]) -> str | list:
    if not images:
        return text
    return ([{"type": "text", "text": text}] if text else []) + images


# -- messages and tools ------------------------------------------------------------------------

ROLES = ("system", "user", "assistant", "tool")


def _tool_calls(raw: Any, where: str) -> list[dict]:
    """Ollama's ``tool_calls`` (arguments as an object) in OpenAI's shape (as JSON text)."""
    if not isinstance(raw, list) or len(raw) > 128:
        raise Refused(f"'{where}' must be a list of tool calls")
    calls = []
    for index, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise Refused(f"'{where}[{index}].function.name' must be a string")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise Refused(f"'{where}[{index}].function.arguments' must be an object")
        call_id = call.get("id")
        calls.append({"id": call_id if isinstance(call_id, str) and call_id
                      else f"call_{index}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments)}})
    return calls


def chat_messages(raw: Any) -> list[dict]:
    """``/api/chat`` ``messages`` as OpenAI chat messages."""
    if not isinstance(raw, list):
        raise Refused("'messages' must be a list of message objects")
    if len(raw) > MAX_MESSAGES:
        raise Refused(f"at most {MAX_MESSAGES} messages are accepted")
    out = []
    for index, item in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise Refused(f"'{where}' must be an object")
        role = item.get("role")
        if role not in ROLES:
            raise Refused(f"'{where}.role' must be one of {', '.join(ROLES)}")
        text = item.get("content")
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise Refused(f"'{where}.content' must be a string")
        message: dict[str, Any] = {"role": role,
                                   "content": _content(text, _images(item.get("images"),
                                                                     f"{where}.images"))}
        if item.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(item["tool_calls"], f"{where}.tool_calls")
        for source, target in (("tool_name", "name"), ("tool_call_id", "tool_call_id"),
                               ("thinking", "reasoning_content")):
            value = item.get(source)
            if value is None:
                continue
            if not isinstance(value, str):
                raise Refused(f"'{where}.{source}' must be a string")
            message[target] = value
        out.append(message)
    return out


# -- whole requests ----------------------------------------------------------------------------

#: Fields every generating request may carry and this module reads.
_COMMON = frozenset({"model", "options", "format", "stream", "keep_alive", "think",
                     "logprobs", "top_logprobs"})
CHAT_FIELDS = _COMMON | {"messages", "tools"}
GENERATE_FIELDS = _COMMON | {"prompt", "suffix", "images", "system", "template", "raw",
                             "context"}


def _unknown(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for key in body:
        if key not in known:
            raise Refused(f"'{_field(str(key))}' is not a field of this endpoint")


@dataclass
class Translated:
    """A generating request in the turn's terms: the OpenAI-shaped ``body``, ``stream``,
    the ``PredictOptions`` fields set beyond it, and ``num_ctx`` when asked."""

    body: dict
    stream: bool = True
    predict: dict = field(default_factory=dict)
    num_ctx: int | None = None


def _common(body: Mapping[str, Any], out: Translated) -> None:
    """The fields /api/chat and /api/generate share."""
    into = out.body
    stream = body.get("stream")
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise Refused("'stream' must be true or false")
    out.stream = stream
    check_keep_alive(body.get("keep_alive"))
    check_think(body.get("think"))
    check_logprobs(body)
    out.num_ctx = map_options(body.get("options"), into, out.predict)
    map_format(body.get("format"), into)


def chat_request(body: Mapping[str, Any], name: str) -> Translated:
    """An ``/api/chat`` body in the turn's terms."""
    _unknown(body, CHAT_FIELDS)
    translated = Translated({"model": name})
    _common(body, translated)
    out = translated.body
    out["messages"] = chat_messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise Refused("'tools' must be a list of tool objects")
        if tools:
            out["tools"] = tools  # the same shape as OpenAI's; checked by the turn
    return translated


def generate_request(body: Mapping[str, Any], name: str) -> Translated:
    """An ``/api/generate`` body in the turn's terms: ``system`` (or the model config's
    system prompt) and one user message with the prompt and its images."""
    _unknown(body, GENERATE_FIELDS)
    translated = Translated({"model": name})
    _common(body, translated)
    out = translated.body
    if body.get("template") not in (None, ""):
        raise Refused("'template' is not supported: prompt templates come from the model "
                      "config")
    if body.get("raw") not in (None, False):
        raise Refused("'raw' is not supported on /api/generate here; use /v1/completions "
                      "for a prompt sent without a template")
    if body.get("suffix") not in (None, ""):
        raise Refused("'suffix' is not supported: this server does not insert text")
    if body.get("context") not in (None, []):
        raise Refused("'context' is not supported (deprecated in Ollama); send the "
                      "conversation to /api/chat instead")
    prompt = body.get("prompt")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise Refused("'prompt' must be a string")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise Refused("'system' must be a string")
    messages: list[dict] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": _content(prompt, _images(body.get("images"),
                                                                          "images"))})
    out["messages"] = messages
    return translated


def is_empty_generate(body: Mapping[str, Any]) -> bool:
    """``/api/generate`` with no prompt and no images: Ollama's "load the model" request."""
    return not body.get("prompt") and not body.get("images")


def tool_calls_out(calls) -> list[dict]:
    """The turn's tool calls (arguments as JSON text) in Ollama's shape (an object)."""
    out = []
    for index, call in enumerate(calls):
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # the turn checks calls; a backend may not
            arguments = {"arguments": call.arguments}
        out.append({"id": call.id, "function": {"index": index, "name": call.name,
                                                "arguments": arguments}})
    return out
