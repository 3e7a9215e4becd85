"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``,
``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``) so Ollama's clients and Open WebUI
work unchanged against a replica (issue 24 §3; for users: ``docs/ollama-api.md``).  One module
a concern: ``resource`` (key check, routing, errors answered), ``translate`` (Ollama's fields
into the OpenAI-shaped body of the shared turn), ``chat`` (chat and generate, NDJSON),
``embed``, ``models`` (tags, show, ps, version), ``errors`` (Ollama's error shape).

What this package must never do: copy the chat pipeline of ``frontend/api/openai`` (a chat is
the shared turn of ``openai/turn.py``), accept a field it neither honours nor refuses, or
reach past ``IInferenceRouter`` into the scheduler, bridges or database.  This file only hands
on the names ``frontend/api/routes.py`` imports.
"""

from localai_tw.frontend.api.ollama.errors import OllamaError, check_key as check_ollama_key, early_ollama_error
from localai_tw.frontend.api.ollama.resource import ENDPOINTS, OllamaAPI

__all__ = ["ENDPOINTS", "OllamaAPI", "OllamaError", "check_ollama_key", "early_ollama_error"]
