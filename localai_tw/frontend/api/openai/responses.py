"""The response side shared by the endpoint families: one HTTP request's lifetime
(:class:`Exchange`: the client leaving cancels the router calls, JSON answers, the
``X-LocalAI-Node`` header by node name through :class:`NodeNames`), token usage, and
``finish_reason``.

What this module must never do: write after the client left or after the answer finished, keep
a router call running once its client is gone, or block the reactor on a node-name lookup.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw import metrics
from localai_tw.backends import backend_pb2

from localai_tw.frontend.inference.interfaces import Served
from localai_tw.web.json import JSON_HEADERS

log = Logger()

#: The header naming the node(s) that served the request, by node name.
NODE_HEADER = b"X-LocalAI-Node"


class NodeNames:
    """Node id -> node name for the ``X-LocalAI-Node`` header.

    ``lookup(node_id)`` (a name, None, or a Deferred of either) is asked once per id and its
    answer kept: a node keeps its name for as long as its id exists.  A failed lookup is not
    kept (the next request asks again); meanwhile the header falls back to the id.
    """

    #: Most ids remembered; the memory is dropped whole beyond it (ids are few in practice).
    MAX_NAMES = 4096

    def __init__(self, lookup: Callable[[str], Any]):
        self._lookup = lookup
        self._names: dict[str, str] = {}

    def known(self, node_id: str) -> str | None:
        return self._names.get(node_id)

    async def learn(self, node_id: str) -> None:
        if node_id in self._names:
            return
        try:
            name = await defer.maybeDeferred(self._lookup, node_id)
        except Exception as e:
            log.warn("looking up the name of node {node} failed: {err}", node=node_id, err=e)
            return
        if name:
            if len(self._names) >= self.MAX_NAMES:
                self._names.clear()
            self._names[node_id] = str(name)


class Exchange:
    """One HTTP request's lifetime: whether the client left, and the router calls to cancel
    when it does."""

    def __init__(self, request, names: NodeNames | None = None,
                 record: metrics.RequestRecord | None = None):
        self.request = request
        self.record = record or metrics.DISCARD.request(())
        self.gone = False
        self.nodes: list[str] = []
        self.names = names
        self._asked: set[str] = set()
        self._calls: set[defer.Deferred] = set()
        self._on_gone: list[Callable[[], None]] = []
        request.notifyFinish().addBoth(self._finished)

    def _finished(self, result) -> None:
        self.record.finished(metrics.CLIENT_GONE if isinstance(result, Failure)
                             else self.request.code, self.nodes)
        if not isinstance(result, Failure):
            return None
        self.gone = True
        for d in list(self._calls):
            d.cancel()
        for hook in self._on_gone:
            hook()
        return None

    def when_gone(self, hook: Callable[[], None]) -> None:
        self._on_gone.append(hook)

    async def call(self, d: defer.Deferred):
        """Await a router Deferred; cancelled if the client leaves meanwhile."""
        self._calls.add(d)
        if self.gone:
            d.cancel()
        try:
            result = await d
        finally:
            self._calls.discard(d)
        if isinstance(result, Served) and result.served_by:
            self.served_by(result.served_by)
            await self.name_nodes()
        return result

    def served_by(self, node: str | None) -> None:
        if node and node not in self.nodes:
            self.nodes.append(node)

    def named(self) -> bool:
        """Whether every serving node's name was looked up (found or not)."""
        return self.names is None or all(node in self._asked for node in self.nodes)

    async def name_nodes(self) -> None:
        """Look up the names of the serving nodes not looked up yet (before the headers)."""
        if self.names is None:
            return
        for node in list(self.nodes):
            if node not in self._asked:
                await self.names.learn(node)
                self._asked.add(node)

    def node_header(self) -> bytes | None:
        """The serving nodes by name (an id only where no name could be looked up)."""
        if not self.nodes:
            return None
        known = self.names.known if self.names is not None else (lambda _: None)
        return ", ".join(known(node) or node for node in self.nodes).encode("ascii", "replace")

    def send_json(self, status: int, body: dict, headers: Mapping[str, str] | None = None,
                  usage: dict | None = None):
        """``usage``: the token counts for the metrics in OpenAI's chat shape, when the
        body's ``usage`` has another shape (the Responses API's)."""
        request = self.request
        if self.gone or request.finished or request.channel is None:
            return
        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        self.record.usage(usage if usage is not None else body.get("usage"))
        request.setResponseCode(status)
        for name, value in JSON_HEADERS:
            request.setHeader(name, value)
        for name, value in (headers or {}).items():
            request.setHeader(name.encode("ascii"), value.encode("ascii"))
        node = self.node_header()
        if node is not None:
            request.setHeader(NODE_HEADER, node)
        request.setHeader(b"content-length", b"%d" % len(payload))
        request.write(payload)
        request.finish()


    def send_bytes(self, status: int, payload: bytes, content_type: str,
                   headers: Mapping[str, str] | None = None) -> None:
        """A whole non-JSON answer (audio, text) with its length and the node header."""
        request = self.request
        if self.gone or request.finished or request.channel is None:
            return
        request.setResponseCode(status)
        request.setHeader(b"content-type", content_type.encode("ascii"))
        request.setHeader(b"x-content-type-options", b"nosniff")
        for name, value in (headers or {}).items():
            request.setHeader(name.encode("ascii"), value.encode("ascii"))
        node = self.node_header()
        if node is not None:
            request.setHeader(NODE_HEADER, node)
        request.setHeader(b"content-length", b"%d" % len(payload))
        request.write(payload)
        request.finish()

    def send_text(self, status: int, text: str, media_type: str = "text/plain") -> None:
        self.send_bytes(status, text.encode("utf-8"), f"{media_type}; charset=utf-8")


class Usage:
    """Token counts of a call: the last non-zero values a backend reported."""

    def __init__(self):
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def update(self, reply: backend_pb2.Reply) -> None:
        if reply.tokens:
            self.completion_tokens = reply.tokens
        if reply.prompt_tokens:
            self.prompt_tokens = reply.prompt_tokens

    def add(self, other: "Usage") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def reply_usage(reply: backend_pb2.Reply) -> Usage:
    usage = Usage()
    usage.update(reply)
    return usage


def finish_reason(reply: backend_pb2.Reply, max_tokens: int) -> str:
    """``length`` when the completion used the whole token budget, else ``stop``."""
    return "length" if max_tokens > 0 and reply.tokens >= max_tokens else "stop"


def path_text(request) -> str:
    return (request.path or b"").decode("utf-8", "replace")
