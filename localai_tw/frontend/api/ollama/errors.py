"""Ollama's error shape, ``{"error": "<text>"}`` with the HTTP status, for every failure of
the Ollama API: refusals of its own fields, the OpenAI side's errors (the turn, the router's
failures through :func:`~localai_tw.frontend.api.openai.errors.error_for`), the key check and
the listener's refusals before a body is read.

What this module must never do: put a traceback, a credential or a node or replica id in an
answer (the OpenAI side's messages are already free of them and are passed on as they are).
"""

from __future__ import annotations

from typing import Mapping

from localai_tw.frontend.api.openai.errors import OpenAIError, early_error, error_for
from localai_tw.frontend.api.openai.resource import check_api_key


class OllamaError(Exception):
    """An answer with ``status`` and Ollama's error body (``status``, ``body()``,
    ``headers``: the protocol ``BoundedSite.add_early_answer_shape`` reads)."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": self.message}


def from_openai(error: OpenAIError) -> OllamaError:
    """An OpenAI-shaped error in Ollama's shape (same status, message and headers); a
    missing model reads as Ollama says it."""
    message = error.message
    if error.code == "model_not_found" and error.status == 404:
        message = f"model not found: {message}"
    return OllamaError(error.status, message, error.headers)


def ollama_error(error: BaseException) -> OllamaError:
    """Any failure of an Ollama request, as its answer."""
    if isinstance(error, OllamaError):
        return error
    return from_openai(error_for(error))


def early_ollama_error(refusal) -> OllamaError:
    """The listener's refusals before the body (413, 503, 401) in Ollama's shape."""
    if isinstance(refusal, OllamaError):
        return refusal
    return from_openai(early_error(refusal))


def check_key(api_keys, request) -> None:
    """The inference API key (``Authorization: Bearer``), as ``/v1`` checks it (open when no
    key is configured).  :raises OllamaError: 401."""
    try:
        check_api_key(api_keys, request)
    except OpenAIError as e:
        raise from_openai(e) from None
