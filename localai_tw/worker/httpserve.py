"""The worker's HTTP server without a listener: a ``twisted.web`` site fed by tunnel streams.

A worker binds nothing but loopback, and its control plane binds nothing at all.  The frontend
opens a yamux stream with the preamble ``http``; once the worker has consumed that preamble and
answered ``ok``, the rest of the stream is plain HTTP/1.1, and :func:`serve_http_on_transport`
hands it to a :class:`WorkerSite` exactly as a listening port would hand it an accepted socket.
Reaching the control plane therefore requires a tunnel credential (the frontend holds the only
session), and there is no port to scan, firewall or forget to firewall.

This module also owns the one place where a request body is read: :class:`WorkerRequest` asks
the site's *body policies* (one per path prefix) where the body of each request goes, at the
moment the headers are complete and before any body byte is read.  A policy may answer right
away (:class:`AnswerBeforeBody`) instead of reading the body: refusals (too large, not
authorized, outside the allowed directories) and cheap answers (an upload already present).

What this module must never do:

- buffer a request body without a bound: every request gets a sink with a cap, and a request
  whose route has no policy gets the small default cap;
- process a request it already answered before the body: the early answer is the only answer;
- keep reading from a peer it refused for size or authorization: it stops reading and closes;
- open a listening socket.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import attr
from twisted.internet.interfaces import IAddress, IProtocol, ITransport
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import IResource
from zope.interface import Attribute, Interface, implementer

from localai_tw.web.bodies import CappedBody, answer_early, pending_request_line

#: Body cap for any route without a body policy (``/healthz``, ``/readyz``, unknown paths).
DEFAULT_BODY_LIMIT = 64 * 1024

#: Seconds a connection may sit idle between requests (and while headers trickle in).  A tunnel
#: stream is cheap to reopen; a stuck one must not hold a protocol instance forever.
IDLE_TIMEOUT_SECONDS = 300


# -- where a tunnel stream comes from -------------------------------------------------------


@implementer(IAddress)
@attr.s(frozen=True, slots=True, auto_attribs=True)
class TunnelStreamAddress:
    """The peer of an HTTP exchange that arrived over a tunnel stream.

    A stream is opened by the frontend holding this worker's tunnel, which already proved the
    per-node credential; for the control plane it counts as a *local* caller, like loopback.
    ``carrier`` is whatever address the stream transport itself reported (for logs only).
    """

    carrier: object = None


class _TunnelStreamHTTP(ProtocolWrapper):
    """Carries one HTTP channel over a stream and reports the stream's origin as its peer.

    The stream transport's own ``getPeer`` may be anything (the WebSocket's TCP peer, a yamux
    stream id); naming the tunnel here keeps the "local caller" rule independent of how the
    stream transport is written.
    """

    def getPeer(self):
        return TunnelStreamAddress(carrier=self.transport.getPeer())


def serve_http_on_transport(
    site: "server.Site", transport: ITransport, leftover: bytes = b""
) -> IProtocol:
    """Serve HTTP from ``site`` over an already-connected ``transport`` (no listener involved).

    ``transport`` is a stream whose preamble was consumed; ``leftover`` holds any bytes that
    arrived with or after the preamble and already belong to HTTP (often the start of the
    first request).  The returned protocol must receive every later ``dataReceived`` and the
    final ``connectionLost`` of the stream: set it as the stream's protocol, or forward to it.
    The peer seen by the site is a :class:`TunnelStreamAddress`.
    """
    wrapping_factory = WrappingFactory(site)
    channel = site.buildProtocol(TunnelStreamAddress(carrier=transport.getPeer()))
    if channel is None:
        raise RuntimeError("the site refused to build a protocol for a tunnel stream")
    stream_http = _TunnelStreamHTTP(wrapping_factory, channel)
    stream_http.makeConnection(transport)
    if leftover:
        stream_http.dataReceived(leftover)
    return stream_http


# -- request bodies ---------------------------------------------------------------------------


class AnswerBeforeBody(Exception):
    """Raised by a body policy or a body sink: answer the request now, before (the rest of) its
    body is read.

    ``stop_reading`` (refusals): stop reading from the peer and close once the answer is
    written.  Otherwise (cheap answers such as "already present"): the announced body is read
    and dropped so the peer can finish sending, then the connection is closed.
    """

    def __init__(
        self,
        code: int,
        body: dict,
        *,
        stop_reading: bool = True,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ):
        self.code = code
        self.body = body
        self.stop_reading = stop_reading
        self.headers = tuple(headers)
        super().__init__(f"{code} {body}")


class IRequestBodySink(Interface):
    """Where the bytes of one request body go.  Also the request's ``content`` attribute, so it
    offers the small file-like surface ``twisted.web`` uses (``tell``, ``seek``, ``close``)."""

    def write(data: bytes) -> None:
        """Take the next body chunk.  May raise :class:`AnswerBeforeBody`."""

    def tell() -> int:
        """Bytes taken so far."""

    def seek(offset: int, whence: int = 0) -> int:
        """Reposition for reading (memory sinks) or do nothing (streaming sinks)."""

    def close() -> None:
        """Release resources.  Idempotent; called when the request ends or the peer leaves."""


class IRequestBodyPolicy(Interface):
    """Chooses the sink for the bodies of requests under one path prefix."""

    prefix = Attribute("bytes: the raw path prefix this policy governs, e.g. b'/v1/files/'")

    def sink_for(request: "WorkerRequest", method: bytes, path: bytes, length: int | None):
        """Return an :class:`IRequestBodySink` for this request, or raise
        :class:`AnswerBeforeBody`.  ``length`` is the announced Content-Length, ``None`` for a
        chunked body.  Called once the headers are complete, before any body byte."""


@implementer(IRequestBodySink)
class BoundedMemoryBody(CappedBody):
    """A request body held in memory up to ``limit`` bytes; one byte more answers 413."""

    def over_limit(self) -> Exception:
        return AnswerBeforeBody(413, too_large_body(self.limit))


@implementer(IRequestBodySink)
class DiscardedBody:
    """Counts and drops body bytes (after an early answer)."""

    def __init__(self):
        self.received = 0

    def write(self, data: bytes) -> None:
        self.received += len(data)

    def tell(self) -> int:
        return self.received

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0

    def read(self, size: int = -1) -> bytes:
        return b""

    def close(self) -> None:
        pass


def too_large_body(limit: int) -> dict:
    return {"problem": f"request body larger than the limit of {limit} bytes"}


@implementer(IRequestBodyPolicy)
@attr.s(frozen=True, auto_attribs=True)
class BoundedMemoryBodyPolicy:
    """Bodies under ``prefix`` are held in memory up to ``limit`` bytes; an announced length
    above it is refused with 413 before one byte is read."""

    prefix: bytes
    limit: int

    def sink_for(self, request, method, path, length):
        if length is not None and length > self.limit:
            raise AnswerBeforeBody(413, too_large_body(self.limit))
        return BoundedMemoryBody(self.limit)


class WorkerRequest(server.Request):
    """A request whose body goes where the site's body policy says, never unbounded.

    Form bodies are never parsed into ``args`` (nothing here takes forms, and the parser would
    read a whole multipart body into memory).
    """

    #: The early answer already written for this request, if any.
    answered_before_body: AnswerBeforeBody | None = None
    #: Whether the connection was already closed because of that answer.
    _closed_after_answer = False

    def __init__(self, channel, *args, **kwargs):
        kwargs["parsePOSTFormSubmission"] = False
        super().__init__(channel, *args, **kwargs)

    def gotLength(self, length):
        site = getattr(self.channel, "site", None)
        line = pending_request_line(self.channel)
        policy = None
        if line is not None and isinstance(site, WorkerSite):
            policy = site.body_policy_for(line[1])
        if policy is None:
            policy = BoundedMemoryBodyPolicy(b"", DEFAULT_BODY_LIMIT)
        method, target = line if line is not None else (b"", b"")
        path = target.split(b"?", 1)[0]
        try:
            self.content = policy.sink_for(self, method, path, length)
        except AnswerBeforeBody as answer:
            self.content = DiscardedBody()
            self._answer_before_body(answer)

    def handleContentChunk(self, data):
        if self.answered_before_body is not None:
            self.content.write(data)
            return
        try:
            self.content.write(data)
        except AnswerBeforeBody as answer:
            self.content.close()
            self.content = DiscardedBody()
            self._answer_before_body(answer)

    def requestReceived(self, command, path, version):
        if self.answered_before_body is not None:
            # Already answered; the body (if any) was dropped.  Nothing may be processed.
            channel = self.channel
            if channel is not None and not self._closed_after_answer:
                self._closed_after_answer = True
                channel.loseConnection()
            return
        super().requestReceived(command, path, version)

    def _answer_before_body(self, answer: AnswerBeforeBody) -> None:
        self.answered_before_body = answer
        # The channel sends "100 Continue" right after gotLength when the client asked for it;
        # after a final answer that would be a second, bogus response.
        self.requestHeaders.removeHeader(b"expect")
        channel = self.channel
        if channel is None:
            return
        answer_early(channel, answer.code, answer.body, answer.headers,
                     stop_reading=answer.stop_reading)
        if answer.stop_reading:
            self._closed_after_answer = True


class WorkerSite(server.Site):
    """A ``Site`` whose requests are :class:`WorkerRequest` and whose bodies follow
    ``body_policies`` (longest matching raw path prefix wins)."""

    noisy = False  # no "Starting/Stopping factory" line per use

    requestFactory = WorkerRequest

    def __init__(
        self,
        resource: IResource,
        body_policies: Sequence[IRequestBodyPolicy] = (),
        *,
        idle_timeout: float = IDLE_TIMEOUT_SECONDS,
        **kwargs,
    ):
        super().__init__(resource, timeout=idle_timeout, **kwargs)
        self.body_policies = sorted(body_policies, key=lambda p: len(p.prefix), reverse=True)

    def body_policy_for(self, target: bytes) -> IRequestBodyPolicy | None:
        path = target.split(b"?", 1)[0]
        for policy in self.body_policies:
            if path.startswith(policy.prefix):
                return policy
        return None


def failure_summary(failure: Failure) -> str:
    """One line naming an unexpected failure, for a reply body (never a traceback)."""
    return f"{failure.type.__name__}: {failure.getErrorMessage()}"[:512]
