"""Anthropic's error shape (``{"type": "error", "error": {"type", "message"}}``) for
``/v1/messages``: :class:`AnthropicError`, the translation of every OpenAI-shaped failure the
shared chat turn reports (:func:`from_openai`), the listener's early answers on these paths
(:func:`early_error`), and the API-key check that reads ``x-api-key`` as well as
``Authorization: Bearer`` (:func:`check_api_key`).

What this module must never do: compare a key other than through ``APIKeyGuard`` (its
constant-time check over digests), accept a request that names two credentials, or put a
traceback, a credential or a node id in a message (the messages it translates were already
made public by ``openai/errors.py``).
"""

from __future__ import annotations

from typing import Mapping

from localai_tw.frontend.api.kit import APIKeyGuard, bearer_token
from localai_tw.frontend.api.openai.errors import OpenAIError, error_for
from localai_tw.web import auth

#: Anthropic's error ``type`` for an HTTP status (its documented pairs; 503 is this server's
#: "try again shortly", which Anthropic spells ``overloaded_error``).
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
         501: "api_error", 502: "api_error", 503: "overloaded_error", 504: "timeout_error",
         529: "overloaded_error"}


def error_type(status: int) -> str:
    if status in TYPES:
        return TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


class AnthropicError(Exception):
    """An answer with ``status`` and Anthropic's error body; ``headers`` (``Retry-After``,
    ``X-Should-Retry``, ``WWW-Authenticate``) go with it."""

    def __init__(self, status: int, message: str, type_: str | None = None, *,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or error_type(status)
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def invalid(message: str) -> AnthropicError:
    return AnthropicError(400, message, "invalid_request_error")


def from_openai(error: OpenAIError) -> AnthropicError:
    """The same refusal in Anthropic's shape: the status, message and headers are kept; the
    OpenAI ``param`` is named in the message when the message does not name it already."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return AnthropicError(error.status, message, headers=error.headers)


def failure(error: BaseException) -> AnthropicError:
    """Any failure of a request on these paths as Anthropic's error (``openai/errors.py``'s
    table decides the status: one table for every protocol)."""
    if isinstance(error, AnthropicError):
        return error
    return from_openai(error_for(error))


def early_error(refusal) -> AnthropicError:
    """A refusal the listener answers before the body (413, 503, 408, the key check's 401)
    in Anthropic's shape (``BoundedSite.add_early_answer_shape``)."""
    if isinstance(refusal, AnthropicError):
        return refusal
    if isinstance(refusal, OpenAIError):
        return from_openai(refusal)
    status = int(refusal.status)
    return AnthropicError(status, str(getattr(refusal, "message", "")) or "refused",
                          headers=getattr(refusal, "headers", None))


def _unauthorized(message: str) -> AnthropicError:
    return AnthropicError(401, message, "authentication_error",
                          headers={"WWW-Authenticate": "Bearer"})


def presented_key(request) -> str | None:
    """The key of ``x-api-key`` (Anthropic's header) or of ``Authorization: Bearer`` (the
    project's rule, ``web/auth.py``), or None when neither holds one.

    :raises AnthropicError: 401 when both headers are sent, or ``x-api-key`` is repeated: one
        request must not be readable as two credentials."""
    values = request.requestHeaders.getRawHeaders(b"x-api-key") or []
    if values and auth.authorization_headers(request):
        raise _unauthorized("send the API key in one header: x-api-key or Authorization: "
                            "Bearer, not both")
    if not values:
        return bearer_token(request)
    if len(values) != 1:
        raise _unauthorized("send one x-api-key header")
    try:
        key = values[0].strip().decode("ascii")
    except UnicodeDecodeError:
        return None
    return key or None


def check_api_key(api_keys: APIKeyGuard | None, request) -> None:
    """The key check of ``/v1/messages`` (and the listener's header guard of its paths): an
    inference or an admin key, as on ``/v1``; open when no key is configured, as ``/v1`` is.

    :raises AnthropicError: 401 ``authentication_error``."""
    if api_keys is None or not api_keys.configured:
        presented_key(request)  # two credentials are refused even on an open API
        return
    presented = presented_key(request)
    if presented is None:
        raise _unauthorized("this API requires an API key: x-api-key: <key> or "
                            "Authorization: Bearer <key>")
    if not api_keys.admits(presented):
        raise _unauthorized("the API key is not valid")
