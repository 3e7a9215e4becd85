"""Helpers for the Anthropic Messages API tests: a site mounted and guarded as the replica's
route table mounts ``/v1``, ``/v1/messages`` and ``/messages`` (the table's own rows give the
listener its guards, caps and early-answer shapes), and a reader of named SSE events.  No test
lives here."""

from __future__ import annotations

import json

from twisted.web.resource import Resource

from localai_tw.frontend.api import routes
from localai_tw.frontend.api.anthropic.resource import MessagesResource
from localai_tw.frontend.api.openai import OpenAIResource, unprefixed_roots
from localai_tw.web.listener import BoundedSite

#: The rows of routes.ROUTES this site serves.
_ROWS = (b"/v1", b"/v1/", b"/v1/messages", b"/messages")


def make_messages_site(router, api_keys=None, reactor=None) -> BoundedSite:
    root = Resource()
    openai = OpenAIResource(router, api_keys=api_keys, now=lambda: 1700000000, reactor=reactor)
    messages = MessagesResource(openai, api_keys)
    root.putChild(b"v1", openai)
    openai.putChild(b"messages", messages)
    root.putChild(b"messages", messages)
    for name in unprefixed_roots():
        root.putChild(name, openai.unprefixed())
    site = BoundedSite(root, timeout=None)
    rows = tuple(row for row in routes.ROUTES if row.path in _ROWS)
    routes.apply_policies(site, api_keys, rows)
    return site


def named_events(raw: bytes) -> list[tuple[str, dict]]:
    """``(event name, JSON data)`` of each event of an SSE body (comments left out)."""
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        out.append((name_line[len("event: "):], json.loads(data_line[len("data: "):])))
    return out


def assert_anthropic_error(response, status: int, type_: str) -> str:
    """The answer is Anthropic's error shape with ``status`` and ``type_``; returns the
    message."""
    assert response.status == status, response.raw_body
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == type_, body
    assert body["error"]["message"]
    return body["error"]["message"]
