"""``POST /v1/messages`` (and ``/messages``): Anthropic's Messages API over the shared chat
turn, and ``POST /v1/messages/count_tokens`` (the same turn prepared, then tokenized by the
model's backend instead of run).  :class:`MessagesResource` checks the key (``x-api-key`` or
``Authorization``), reads the body, has :func:`~.messages.to_openai` translate it, runs the turn
(``frontend/api/openai/turn.py``: ``prepare_turn``, then ``complete_turn`` or
``stream_turn``) and answers Anthropic's message, its SSE events (:class:`MessageEvents`), or
its error shape.

What this module must never do: render a prompt, call the router or read a backend reply
itself (that is the turn's, as for ``/v1/chat/completions``), answer before the key is
checked, or answer a failure in any shape but Anthropic's.
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource

from localai_tw.backends import backend_pb2
from localai_tw.frontend.api.jsonbody import prepare_json_body
from localai_tw.frontend.api.kit import APIKeyGuard, printable
from localai_tw.frontend.api.anthropic.errors import (
    AnthropicError,
    check_api_key,
    failure,
    from_openai,
)
from localai_tw.frontend.api.anthropic.messages import (
    message_body,
    message_id,
    stop_reason,
    to_openai,
    tool_use_id,
    usage_body,
)
from localai_tw.frontend.api.openai.errors import OpenAIError, detail
from localai_tw.frontend.api.openai.requests import Fields, read_body
from localai_tw.frontend.api.openai.responses import Exchange, path_text
from localai_tw.frontend.api.openai.sse import AlreadyAnswered
from localai_tw.frontend.api.openai.turn import (
    SSEEvent,
    SSEStream,
    TurnEvents,
    complete_turn,
    prepare_turn,
    stream_turn,
)

log = Logger()

#: The metrics' endpoint label of these paths.
SEGMENTS = [b"messages"]


class MessagesResource(Resource):
    """``/v1/messages`` and ``/messages`` (module docstring).

    :param openai: the ``/v1`` resource, whose context (router, deadlines) and exchanges
        (metrics, node names) this API shares.
    :param api_keys: the frontend's key guard (inference and admin keys, as on ``/v1``).
    """

    isLeaf = True

    def __init__(self, openai, api_keys: APIKeyGuard | None):
        super().__init__()
        self._openai = openai
        self._api_keys = api_keys

    def guard(self, request) -> None:
        """The listener's header guard of these paths (raises :class:`AnthropicError`)."""
        check_api_key(self._api_keys, request)

    def render(self, request):
        answering = defer.ensureDeferred(self._serve(request))
        answering.addErrback(lambda f: log.failure("answering {path} failed", f,
                                                   path=printable(path_text(request))))
        return server.NOT_DONE_YET

    async def _serve(self, request) -> None:
        exchange: Exchange = self._openai.exchange(request, SEGMENTS)
        try:
            self.guard(request)
            rest = [s for s in request.postpath if s]
            if rest not in ([], [b"count_tokens"]):
                raise AnthropicError(404, f"unknown endpoint {printable(path_text(request))} "
                                     "(this server serves POST /v1/messages and POST "
                                     "/v1/messages/count_tokens)", "not_found_error")
            if request.method.upper() != b"POST":
                raise AnthropicError(405, "use POST on this endpoint", "invalid_request_error",
                                     headers={"Allow": "POST"})
            if rest:
                await self._count(request, exchange)
            else:
                await self._answer(request, exchange)
        except AlreadyAnswered:
            return
        except defer.CancelledError:
            if exchange.gone:
                return
            self._answer_error(exchange, AnthropicError(500, "the request was cancelled"), None)
        except Exception as e:
            self._answer_error(exchange, failure(e), e)

    async def _answer(self, request, exchange: Exchange) -> None:
        context = self._openai.context
        await prepare_json_body(request, context.reactor)  # a big body: decoded off the reactor
        asked = to_openai(read_body(request).data)
        turn = await prepare_turn(context, Fields(asked.openai), exchange)
        if asked.stream:
            await stream_turn(context, exchange, turn,
                              MessageEvents(turn.name, asked.stop_sequences),
                              framing=SSEStream, include_usage=True)
            return
        result = await complete_turn(context, exchange, turn)
        exchange.send_json(200, message_body(turn.name, result, asked.stop_sequences))

    async def _count(self, request, exchange: Exchange) -> None:
        """``count_tokens``: the turn prepared exactly as :meth:`_answer` prepares it (the
        same template path, tools shown the same way), then the model's backend asked to
        tokenize those very options (``TokenizeString``) through the router, as a generation
        would be routed.  Nothing is generated; the count is the worker's answer."""
        context = self._openai.context
        await prepare_json_body(request, context.reactor)
        asked = to_openai(read_body(request).data, counting=True)
        turn = await prepare_turn(context, Fields(asked.openai), exchange)
        options = backend_pb2.PredictOptions()
        options.CopyFrom(turn.options)
        options.TokenizeAsEvaluated = True  # the prompt as Predict evaluates it (BOS too)
        served = await exchange.call(context.router.tokenize(turn.name, options,
                                                             context.deadline()))
        exchange.served_by(served.served_by)
        answer = served.value
        exchange.send_json(200, {"input_tokens": len(answer.tokens) or int(answer.length)})

    def _answer_error(self, exchange: Exchange, answer: AnthropicError,
                      cause: BaseException | None) -> None:
        request = exchange.request
        exchange.record.failed(cause)
        if cause is not None and not isinstance(cause, (OpenAIError, AnthropicError)):
            if answer.status == 500 and answer.type == "api_error":
                log.failure("{method} {path} failed", Failure(cause),
                            method=request.method.decode("ascii", "replace"),
                            path=printable(path_text(request)))
            else:
                log.info("{method} {path}: {status} {type}: {message}",
                         method=request.method.decode("ascii", "replace"),
                         path=printable(path_text(request)), status=answer.status,
                         type=answer.type, message=detail(cause))
        exchange.send_json(answer.status, answer.body(), answer.headers)


class MessageEvents(TurnEvents):
    """Anthropic's SSE events for one streamed turn (the turn's ``TurnEvents``).

    ``message_start`` and a ``ping`` open the stream; text opens a text block at its first
    delta (the turn holds back text that may be a tool call, so a block is never opened for
    a call's markup); each tool call is a ``tool_use`` block with its arguments as one
    ``input_json_delta``; the end closes the open block (an answer with no block gets an
    empty text block, as the non-streamed answer does) and sends ``message_delta`` (stop
    reason, usage) and ``message_stop``.  A failure after the start is an ``error`` event.
    """

    def __init__(self, model: str, stop_sequences: tuple[str, ...] = ()):
        self.model = model
        self.stop_sequences = stop_sequences
        self.index = -1  # the index of the last block opened
        self.open_text = False
        self.stopping_word = ""
        self.stop_reason = "end_turn"
        self.stop_sequence: str | None = None

    def _block_start(self, block: dict) -> SSEEvent:
        self.index += 1
        return SSEEvent("content_block_start", {"type": "content_block_start",
                                                "index": self.index, "content_block": block})

    def _block_stop(self) -> SSEEvent:
        return SSEEvent("content_block_stop", {"type": "content_block_stop",
                                               "index": self.index})

    def start(self) -> list:
        return [SSEEvent("message_start", {"type": "message_start", "message": {
                    "id": message_id(), "type": "message", "role": "assistant",
                    "model": self.model, "content": [], "stop_reason": None,
                    "stop_sequence": None, "usage": usage_body(0, 0)}}),
                SSEEvent("ping", {"type": "ping"})]

    def text(self, delta: str, logprobs: list | None = None) -> list:
        if not delta:
            return []
        out = []
        if not self.open_text:
            out.append(self._block_start({"type": "text", "text": ""}))
            self.open_text = True
        out.append(SSEEvent("content_block_delta", {
            "type": "content_block_delta", "index": self.index,
            "delta": {"type": "text_delta", "text": delta}}))
        return out

    def _close_text(self) -> list:
        if not self.open_text:
            return []
        self.open_text = False
        return [self._block_stop()]

    def calls(self, calls) -> list:
        out = self._close_text()
        for call in calls:
            out.append(self._block_start({"type": "tool_use", "id": tool_use_id(call.id),
                                          "name": call.name, "input": {}}))
            out.append(SSEEvent("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments or "{}"}}))
            out.append(self._block_stop())
        return out

    def stopped_on(self, word: str) -> None:
        self.stopping_word = word

    def end(self, reason: str, logprobs: list | None = None) -> list:
        self.stop_reason, self.stop_sequence = stop_reason(reason, self.stopping_word,
                                                           self.stop_sequences)
        out = self._close_text()
        if self.index < 0:  # nothing was said: one empty text block, as non-streamed
            out += [self._block_start({"type": "text", "text": ""}), self._block_stop()]
        return out

    def done(self, usage: dict | None) -> list:
        usage = usage or {}
        return [SSEEvent("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason,
                              "stop_sequence": self.stop_sequence},
                    "usage": usage_body(int(usage.get("prompt_tokens") or 0),
                                        int(usage.get("completion_tokens") or 0))}),
                SSEEvent("message_stop", {"type": "message_stop"})]

    def failed(self, error: OpenAIError) -> list:
        return [SSEEvent("error", from_openai(error).body())]
