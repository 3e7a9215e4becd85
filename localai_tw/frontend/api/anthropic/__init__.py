"""Anthropic's Messages API (``POST /v1/messages`` and ``/messages``, and their
``/count_tokens``) of every frontend replica, for the ``anthropic`` SDKs and the tools built
on them (for users: ``docs/anthropic-api.md``).  One module a concern: ``errors``
(Anthropic's error shape, the key check reading ``x-api-key`` or ``Authorization``),
``messages`` (requests translated into the shared chat turn's OpenAI shape, answers
translated back), ``resource`` (the HTTP side and the SSE events).

What this package must never do: keep a chat pipeline of its own (generation is the shared
turn's, ``frontend/api/openai/turn.py``), or answer anything in the OpenAI error shape.  This
file only hands on the names the route table imports.
"""

from localai_tw.frontend.api.anthropic.errors import check_api_key, early_error

__all__ = ["check_api_key", "early_error"]
