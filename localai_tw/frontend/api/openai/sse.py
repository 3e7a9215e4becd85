"""Streamed answers: :class:`SSEStream` (a ``text/event-stream`` response that follows the
transport's pace; :class:`NDJSONStream` is its newline-delimited JSON twin, for Ollama's
clients) and :func:`stream_reply`, which runs one ``PredictStream`` into either for every
streamed endpoint (their event shapes are :class:`Chunks`).

Backpressure: the stream writes through the shared
:class:`~localai_tw.web.streaming.PacedWriter` (the request's push producer), and while the
HTTP transport is paused each ``on_reply`` returns a Deferred that fires only when it resumes,
so the router stops pulling replies from the backend; it fails when the client leaves, which
cancels the backend call.  Only complete UTF-8 characters are sent (a character split across
replies waits for its last byte).  A stream that waits for a cold load
longer than ``LOADING_NOTICE_INTERVAL`` starts then and carries ``: loading model <name> (<n>
s)`` comments until the first reply (``(<n> s; downloading <file> <x>/<y> MiB at <r> MiB/s)``
while the replica downloads the model's files).

What this module must never do: buffer replies while the client cannot take them, keep the
backend call running after the client left, or send ``[DONE]`` after a failure.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer, task
from twisted.internet.error import ConnectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.backends import backend_pb2

from localai_tw.web.streaming import PacedWriter
from localai_tw.frontend.api.kit import printable
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import OpenAIError, detail, error_for
from localai_tw.frontend.api.openai.requests import Sampling
from localai_tw.frontend.api.openai.responses import (
    NODE_HEADER,
    Exchange,
    Usage,
    finish_reason,
    path_text,
)

log = Logger()

#: Seconds between ``: loading model ...`` SSE comments while a stream waits for a cold load
#: (the first after this long, so a quick load answers as if nothing had waited).
LOADING_NOTICE_INTERVAL = 3.0


@dataclass(frozen=True)
class SSEEvent:
    """A named server-sent event (``event: <name>`` then ``data: <JSON>``), as Anthropic's
    stream is written; a plain dict payload is a ``data:`` line alone."""

    name: str
    data: Any


def _json(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class SSEStream:
    """A ``text/event-stream`` response that follows the transport's pace: SSE framing over
    the shared :class:`~localai_tw.web.streaming.PacedWriter`.

    While the HTTP transport is paused, :meth:`send` returns a Deferred that fires when it
    resumes and fails when the client leaves, which the router awaits before pulling the next
    backend reply (and which cancels the backend call when it fails).
    """

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self.request = exchange.request
        self.writer = PacedWriter(self.request, "stream of " + printable(
            path_text(self.request)))

    @property
    def started(self) -> bool:
        return self.writer.started

    @property
    def gone(self) -> bool:
        """Whether the client left (learnt from the request or from the transport)."""
        return self.exchange.gone or self.writer.gone

    #: The response's content type.
    content_type = b"text/event-stream; charset=utf-8"

    def start(self, node: str | None) -> None:
        if self.writer.started:
            return
        self.exchange.served_by(node)
        request = self.request
        request.setResponseCode(200)
        request.setHeader(b"content-type", self.content_type)
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        request.setHeader(b"x-content-type-options", b"nosniff")
        header = self.exchange.node_header()
        if header is not None:
            request.setHeader(NODE_HEADER, header)
        self.writer.start()

    def comment(self, text: str) -> None:
        """Write an SSE comment line (``: text``), which clients ignore: a sign of life while
        nothing else can be sent.  Starts the stream (status 200) if it has not started."""
        if self.gone or self.writer.finished:
            return
        self.start(None)
        _unawaited(self.writer.write(b": " + " ".join(text.split()).encode("utf-8") + b"\n\n"))

    def send(self, payload: Any) -> defer.Deferred | None:
        """Write one event (``payload`` as JSON, an :class:`SSEEvent`, or a literal string
        such as ``[DONE]``).  Returns a Deferred while the transport is paused (failed once
        the client left), else None."""
        if self.exchange.gone:
            return defer.fail(ConnectionDone("the client disconnected"))
        return self.writer.write(self.frame(payload))

    def frame(self, payload: Any) -> bytes:
        if isinstance(payload, SSEEvent):
            return (b"event: " + payload.name.encode("ascii") + b"\ndata: " +
                    _json(payload.data) + b"\n\n")
        data = payload.encode("utf-8") if isinstance(payload, str) else _json(payload)
        return b"data: " + data + b"\n\n"

    def close(self) -> None:
        self.writer.finish()


class NDJSONStream(SSEStream):
    """Newline-delimited JSON (``application/x-ndjson``), one object per line, as Ollama
    streams.  It has no comment syntax, so the cold-load notices are not sent."""

    content_type = b"application/x-ndjson"

    def comment(self, text: str) -> None:
        return None

    def frame(self, payload: Any) -> bytes:
        if isinstance(payload, SSEEvent):
            payload = payload.data
        return _json(payload) + b"\n"


def _unawaited(waiting: defer.Deferred | None) -> None:
    """A write whose pace is not followed (a comment, the last few small events): a pause is
    not awaited and a departed client is handled by the exchange."""
    if waiting is not None:
        waiting.addErrback(lambda _: None)


class Chunks:
    """The event payloads of one streamed answer.  :meth:`pieces` and :meth:`closing` are what
    :func:`stream_reply` calls; by default one ``delta`` per piece of text and one ``finish``,
    and endpoints that hold text back (tool calls) or carry log probabilities override them."""

    def first(self) -> list:
        """The events that open the stream, sent when the first reply arrives."""
        raise NotImplementedError

    def pieces(self, text: str, reply: backend_pb2.Reply) -> list:
        """The events for one backend reply's complete text (possibly empty)."""
        return [self.delta(text)] if text else []

    async def closing(self, reason: str) -> list:
        """The events that end the answer (``reason``: its finish reason).  May raise an
        ``OpenAIError`` (an answer outside the requested format): sent as an error event.
        A coroutine: checking a big answer may wait for the answer-checks thread."""
        return [self.finish(reason)]

    def delta(self, text: str) -> dict:
        raise NotImplementedError

    def finish(self, reason: str) -> dict:
        raise NotImplementedError

    def usage(self, usage: dict) -> dict:
        raise NotImplementedError

    def done(self, usage: dict | None) -> list:
        """The events after the finish: the usage when asked (``usage`` is None when not),
        then ``[DONE]``."""
        return ([self.usage(usage)] if usage is not None else []) + ["[DONE]"]

    def failed(self, error: OpenAIError) -> list:
        """The events that report a failure after the stream started: OpenAI's ``error``
        event, which its clients raise on."""
        return [error.body()]


class AlreadyAnswered(Exception):
    """The failure was already written into a started stream."""


async def stream_reply(context: Context, exchange: Exchange, name: str,
                       options: backend_pb2.PredictOptions, sampling: Sampling,
                       include_usage: bool, chunks: Chunks,
                       framing: type[SSEStream] = SSEStream) -> None:
    """Answer with one ``PredictStream`` of model ``name`` as events shaped by ``chunks``
    and framed by ``framing``: the first chunk, one per complete piece of text, the finish,
    then :meth:`Chunks.done` (the usage when asked, ``[DONE]``).  :raises: the failure to
    answer as JSON while the stream has not started."""
    router = context.router
    stream = framing(exchange)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    usage = Usage()
    last = backend_pb2.Reply()
    begun: list[bool] = []
    clock = context.clock()
    notices = task.LoopingCall(lambda: None)
    notices.clock = clock

    def on_loading(model_name: str) -> None:
        """A cold load: a comment every few seconds until the first reply, so the client
        (and any proxy) is not left in silence for the whole load."""
        started = clock.seconds()
        detail = getattr(router, "loading_detail", None)

        def notice() -> None:
            extra = detail(model_name) if detail is not None else None
            stream.comment(f"loading model {model_name} ({clock.seconds() - started:.0f} s"
                           f"{'; ' + extra if extra else ''})")

        notices.f = notice
        if not notices.running and not begun and not exchange.gone:
            notices.start(LOADING_NOTICE_INTERVAL, now=False)

    def quiet() -> None:
        if notices.running:
            notices.stop()

    def emit(payload) -> None:
        """Send without waiting (the last few small events); a pause is not awaited and
        a departed client is already handled by the exchange."""
        _unawaited(stream.send(payload))

    def on_start(node_id=None) -> None:
        quiet()
        if begun or exchange.gone:
            return
        exchange.served_by(node_id)
        if not exchange.named():
            return  # the first reply starts the stream, once the node's name is known
        begun.append(True)
        stream.start(node_id)
        for payload in chunks.first():
            emit(payload)

    def on_reply(reply: backend_pb2.Reply):
        if stream.gone:
            return defer.fail(ConnectionDone("the client disconnected"))
        if not begun and not exchange.named():
            return defer.ensureDeferred(exchange.name_nodes()).addCallback(
                lambda _: on_reply(reply))
        on_start(None)
        exchange.record.replied()
        usage.update(reply)
        last.tokens = max(last.tokens, reply.tokens)
        text = decoder.decode(reply.message)
        payloads = chunks.pieces(text, reply)
        if not payloads:
            return None  # nothing complete yet, or held back: nothing to send
        for payload in payloads[:-1]:
            _unawaited(stream.send(payload))
        return stream.send(payloads[-1])  # the last one's pace is followed

    try:
        served = await exchange.call(router.predict_stream(
            name, options, on_reply, context.deadline(), on_start=on_start,
            on_loading=on_loading))
    except defer.CancelledError:
        if stream.gone:
            stream.close()
            return
        raise _stream_failed(stream, chunks, OpenAIError(
            500, "the stream was cancelled", "server_error", code="cancelled"))
    except Exception as e:
        if stream.gone:
            stream.close()
            return
        raise _stream_failed(stream, chunks, e)
    finally:
        quiet()
    on_start(served.served_by if served is not None else None)
    tail = decoder.decode(b"", final=True)
    try:
        for payload in chunks.pieces(tail, backend_pb2.Reply()) if tail else ():
            emit(payload)
        for payload in await chunks.closing(finish_reason(last, sampling.max_tokens)):
            emit(payload)
    except OpenAIError as e:
        raise _stream_failed(stream, chunks, e)
    exchange.record.usage(usage.body())
    for payload in chunks.done(usage.body() if include_usage else None):
        emit(payload)
    stream.close()


def _stream_failed(stream: SSEStream, chunks: Chunks, error: BaseException) -> BaseException:
    """Before the stream started: the error to answer as JSON.  After: it is sent as the
    events of :meth:`Chunks.failed` (never followed by the end events), and logged."""
    if not stream.started:
        return error
    stream.exchange.record.failed(error)
    answer = error_for(error)
    log.info("stream of {path} failed after it started: {status} {code}: {message}",
             path=printable(path_text(stream.request)), status=answer.status,
             code=answer.code, message=detail(error))
    if answer.code == "internal_error":
        log.failure("stream failure", Failure(error))
    for payload in chunks.failed(answer):
        _unawaited(stream.send(payload))
    stream.close()
    return AlreadyAnswered()
