"""The OpenAI Responses API (docs/responses-api.md): ``POST /v1/responses`` (and
``/responses``), ``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``,
``POST /v1/responses/{id}/cancel`` and ``DELETE /v1/responses/{id}``.

A request is read by :mod:`.response_input` into a chat-completions request, which the shared
turn (:mod:`.turn`) checks, plans and runs exactly as ``/v1/chat/completions`` would (templates,
tools and ``tool_choice``, grammars, JSON output); the answer is written back as a ``response``
object, or, streamed, as the typed event sequence (``response.created``, ...,
``response.completed``, each with its ``sequence_number``) by :class:`ResponseEvents`.

Stored responses (``store``, the default) are rows of ``responses`` (:mod:`.response_store`),
so any replica answers ``GET`` and continues a conversation by ``previous_response_id``; a
stored streamed response is written before its ``response.completed`` event, so a client that
saw it can continue at once on any replica.  ``background: true`` answers ``queued`` at once;
the response is written with a claim on the cluster's claim queue, which any replica's consumer
takes (:func:`run_claimed`), and which moves on to another replica if the one running it stops;
a cancel through any replica marks the row and reaches the run over the bus.  Every row belongs
to the key that created it.

What this module must never do: run a turn any other way than through :mod:`.turn`, read or
change a response of another key, or answer a field it did not honour as if it had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw.web import auth

from localai_tw.frontend.api.kit import bearer_token

from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import OpenAIError, error_for, invalid
from localai_tw.frontend.api.openai.requests import Fields, read_body
from localai_tw.frontend.api.openai.response_input import (
    ResponseRequest,
    continue_from,
    new_id,
    read_request,
    response_id as response_id_of,
)
from localai_tw.frontend.api.openai.response_store import (
    MAX_CONVERSATION_BYTES,
    BackgroundRuns,
    ResponseStore,
    TooManyBackground,
)
from localai_tw.frontend.api.openai.responses import Exchange
from localai_tw.frontend.api.openai.sse import SSEEvent, SSEStream
from localai_tw.frontend.api.openai.turn import (
    Answer,
    ToolCall,
    TurnEvents,
    complete_turn,
    prepare_turn,
    stream_turn,
)

log = Logger()

#: ``GET /v1/responses/{id}/input_items``: page size bounds.
DEFAULT_PAGE = 20
MAX_PAGE = 100


@dataclass
class ReplicaResponses:
    """A replica's side of the Responses API (built by the composition root): the store,
    the background runs here, and the claim consumer that runs them (a service)."""

    store: ResponseStore
    runs: BackgroundRuns
    consumer: Any = None


@dataclass
class ResponsesParts:
    """What the Responses API needs beyond the router: the store, this replica's background
    runs, and who is asking (``owner(request)``: the key's sha256 in hex, '' with no key
    configured)."""

    store: ResponseStore
    runs: BackgroundRuns
    owner: Callable[[Any], str]

    @classmethod
    def of(cls, replica: ReplicaResponses | None, api_keys) -> "ResponsesParts | None":
        if replica is None:
            return None

        def owner(request) -> str:
            if api_keys is None or not api_keys.configured:
                return ""
            presented = bearer_token(request)
            return auth.digest(presented).hex() if presented else ""

        return cls(replica.store, replica.runs, owner)


def _parts(context: Context) -> ResponsesParts | None:
    return context.responses


def _stored(context: Context, param: str) -> ResponsesParts:
    parts = _parts(context)
    if parts is None:
        raise invalid(f"{param!r} needs stored responses, and this server stores none; send "
                      "store: false", param, code="unsupported_parameter")
    return parts


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"no response with id {response_id[:64]!r} found",
                       "invalid_request_error", param="response_id", code="not_found")


# -- the response object -------------------------------------------------------------------------


def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_body(response_id: str, created: int, model: str, request: ResponseRequest,
                  status: str) -> dict:
    return {"id": response_id, "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": None, "model": model, "output": [],
            "usage": None, **request.echo}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(call: ToolCall, item_id: str, arguments: str | None = None,
              status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments}


def assistant_message(text: str | None, calls) -> dict:
    """The conversation's record of an answer (chat shape), for the next turn."""
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [call.body() for call in calls]
    elif message["content"] is None:
        message["content"] = ""
    return message


def finished(body: dict, output: list, reason: str, chat_usage: dict | None) -> dict:
    out = dict(body, output=output, usage=_usage(chat_usage))
    if reason == "length":
        out.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    else:
        out["status"] = "completed"
    return out


def failed_body(body: dict, error: OpenAIError) -> dict:
    return dict(body, status="failed", error={"code": error.code or error.type,
                                              "message": error.message})


def answer_output(answer: Answer) -> list:
    output = []
    if answer.content or not answer.calls:
        output.append(message_item(new_id("msg"), answer.content or ""))
    output.extend(call_item(call, new_id("fc")) for call in answer.calls)
    return output


# -- POST /v1/responses --------------------------------------------------------------------------


async def answer_create(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/responses``."""
    body = read_body(request)
    ask = read_request(body)
    parts = _parts(context)
    if ask.store:
        parts = _stored(context, "store")
    owner = parts.owner(request) if parts is not None else ""
    conversation: list = []
    if ask.previous_response_id is not None:
        parts = _stored(context, "previous_response_id")
        previous = await parts.store.get(ask.previous_response_id, owner)
        if previous is None:
            raise OpenAIError(404, f"no response with id {ask.previous_response_id!r} found",
                              "invalid_request_error", param="previous_response_id",
                              code="previous_response_not_found")
        if previous.running:
            raise invalid(f"response {ask.previous_response_id!r} is still "
                          f"{previous.status}: continue it once it finished",
                          "previous_response_id", code="invalid_value")
        if previous.conversation_bytes > MAX_CONVERSATION_BYTES:
            raise invalid(f"the conversation of {ask.previous_response_id!r} is too long to "
                          f"continue here (over {MAX_CONVERSATION_BYTES // (1024 * 1024)} MiB): "
                          "start a new one", "previous_response_id",
                          code="context_length_exceeded")
        conversation = list(previous.conversation)
        continue_from(ask, conversation)
    turn = await prepare_turn(context, Fields(ask.chat), exchange)
    response_id, created = new_id("resp"), int(context.now())
    base = response_body(response_id, created, turn.name, ask, "in_progress")
    record = _Record(parts, owner, response_id, turn.name, ask, conversation)
    if ask.background:
        await _background(context, exchange, turn, record, base)
        return
    if ask.stream:
        events = ResponseEvents(base, record)
        await stream_turn(context, exchange, turn, events,
                          framing=lambda exchange: _ResponseStream(exchange, events))
        return
    answer = await complete_turn(context, exchange, turn)
    chat_usage = answer.usage.body()
    final = finished(base, answer_output(answer), answer.finish_reason, chat_usage)
    await record.save(final, assistant_message(answer.content, answer.calls))
    exchange.send_json(200, final, usage=chat_usage)


@dataclass
class _Record:
    """Where a response is stored (``parts`` None or ``store: false``: nowhere)."""

    parts: ResponsesParts | None
    owner: str
    response_id: str
    model: str
    ask: ResponseRequest
    conversation: list

    @property
    def stored(self) -> bool:
        return self.parts is not None and self.ask.store

    def _conversation(self, reply: dict | None) -> list:
        return self.conversation + self.ask.messages + ([reply] if reply else [])

    async def begin(self, body: dict) -> None:
        await self.parts.store.begin(self.response_id, self.owner, self.model,
                                     self.ask.previous_response_id, body,
                                     self.ask.input_items, self._conversation(None),
                                     self.ask.chat)

    async def save(self, body: dict, reply: dict | None) -> None:
        """Store a finished foreground response (when it is to be stored)."""
        if self.stored:
            await self.parts.store.insert(
                self.response_id, self.owner, self.model, self.ask.previous_response_id, body,
                self.ask.input_items, self._conversation(reply))


async def _background(context: Context, exchange: Exchange, turn, record: _Record,
                      base: dict) -> None:
    """Record the response and its claim; any replica's consumer runs it
    (:func:`run_claimed`).  The turn was prepared here only to refuse a bad request now."""
    if not record.parts.store.runs_background:
        raise invalid("this server runs no background responses", "background",
                      code="unsupported_parameter")
    queued = dict(base, status="queued")
    try:
        await record.begin(queued)
    except TooManyBackground:
        raise OpenAIError(429, "this key has too many queued or running background responses; "
                          "wait for one to finish or cancel one", "rate_limit_exceeded",
                          code="too_many_background_responses") from None
    exchange.send_json(200, queued)


class _NoClient:
    """The request of a background run: no client waits on it."""

    def notifyFinish(self) -> defer.Deferred:
        return defer.Deferred()


async def run_claimed(store: ResponseStore, runs: BackgroundRuns, context: Context,
                      claim) -> None:
    """The claim consumer's handler: run one background response on this replica.

    Returns (the claim is completed) when the response finished, failed, was cancelled or is
    gone; raises ``CancelledError`` when this replica stops or lost the claim, so the claim
    moves on and another replica runs the response again."""
    response_id = claim.payload.decode("ascii", "replace")
    row = await store.for_run(response_id)
    if row is None or not row.running or row.chat_request is None:
        return
    await runs.ready()
    base = dict(row.body, status="in_progress")
    if not await store.started(response_id, base):
        return
    exchange = Exchange(_NoClient())

    async def work() -> Answer:
        turn = await prepare_turn(context, Fields(row.chat_request), exchange)
        return await complete_turn(context, exchange, turn)

    try:
        answer = await runs.run(response_id, work)
    except defer.CancelledError:
        if runs.was_cancelled(response_id):
            runs.forget(response_id)
            return  # the row says cancelled already
        raise
    except Exception as e:
        error = error_for(e)
        if error.code == "internal_error":
            log.failure("background response {id} failed", Failure(e), id=response_id)
        await store.finish(response_id, failed_body(base, error), None)
        return
    final = finished(base, answer_output(answer), answer.finish_reason, answer.usage.body())
    await store.finish(response_id, final, list(row.conversation) + [
        assistant_message(answer.content, answer.calls)])


# -- the stream ----------------------------------------------------------------------------------


class ResponseEvents(TurnEvents):
    """One streamed turn as the Responses API's typed events (each an ``event: <type>`` SSE
    event whose data carries ``type`` and ``sequence_number``).  The final event
    (``response.completed``, or ``response.incomplete``) is held until the response is stored
    (:class:`_ResponseStream`)."""

    def __init__(self, base: dict, record: _Record):
        self.base = base
        self.record = record
        self.sequence = 0
        self.output: list = []
        self.message: dict | None = None  # the open message item
        self.text_so_far = ""
        self.calls_made: tuple = ()
        self.reason = "stop"
        #: The stored final response and its events, once :meth:`done` ran.
        self.closing: defer.Deferred | None = None
        self.last: list = []

    def _event(self, kind: str, **data) -> SSEEvent:
        event = SSEEvent(kind, {"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        return event

    def _snapshot(self, status: str) -> dict:
        return dict(self.base, status=status, output=list(self.output))

    def start(self) -> list:
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def _open_message(self) -> list:
        item = message_item(new_id("msg"), "", status="in_progress")
        part = item["content"][0]
        item["content"] = []
        self.message = item
        index = len(self.output)
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item["id"],
                            output_index=index, content_index=0, part=part)]

    def _close_message(self) -> list:
        item, self.message = self.message, None
        if item is None:
            return []
        index = self.output.index(item)
        done = message_item(item["id"], self.text_so_far)
        self.output[index] = done
        part = done["content"][0]
        return [self._event("response.output_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=self.text_so_far,
                            logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=done)]

    def text(self, delta: str, logprobs: list | None) -> list:
        out = self._open_message() if self.message is None else []
        self.text_so_far += delta
        out.append(self._event("response.output_text.delta", item_id=self.message["id"],
                               output_index=self.output.index(self.message),
                               content_index=0, delta=delta, logprobs=[]))
        return out

    def calls(self, calls: tuple[ToolCall, ...]) -> list:
        out = self._close_message()
        self.calls_made = tuple(calls)
        for call in calls:
            item_id = new_id("fc")
            index = len(self.output)
            self.output.append(call_item(call, item_id, "", status="in_progress"))
            out.append(self._event("response.output_item.added", output_index=index,
                                   item=call_item(call, item_id, "", status="in_progress")))
            out.append(self._event("response.function_call_arguments.delta", item_id=item_id,
                                   output_index=index, delta=call.arguments))
            out.append(self._event("response.function_call_arguments.done", item_id=item_id,
                                   output_index=index, arguments=call.arguments))
            done = call_item(call, item_id)
            self.output[index] = done
            out.append(self._event("response.output_item.done", output_index=index,
                                   item=done))
        return out

    def end(self, reason: str, logprobs: list | None) -> list:
        self.reason = reason
        if self.message is None and not self.output:
            out = self._open_message()  # an empty answer is still one message
            return out + self._close_message()
        return self._close_message()

    def done(self, usage: dict | None) -> list:
        final = finished(self.base, list(self.output), self.reason, usage)
        kind = "response.incomplete" if final["status"] == "incomplete" \
            else "response.completed"
        self.last = [self._event(kind, response=final)]
        self.closing = defer.ensureDeferred(self.record.save(
            final, assistant_message(self.text_so_far or None, self.calls_made)))
        return []

    def failed(self, error: OpenAIError) -> list:
        body = failed_body(self._snapshot("failed"), error)
        if self.record.stored:
            self.closing = defer.ensureDeferred(self.record.save(body, None))
        return [self._event("error", code=error.code, message=error.message,
                            param=error.param),
                self._event("response.failed", response=body)]


class _ResponseStream(SSEStream):
    """The SSE stream of one response: closing waits for the response to be stored, then
    sends the final event (so a client that saw ``response.completed`` finds the response on
    any replica)."""

    def __init__(self, exchange: Exchange, events: ResponseEvents):
        super().__init__(exchange)
        self.events = events

    def close(self) -> None:
        closing = self.events.closing
        if closing is None:
            super().close()
            return

        def send_last(_):
            for payload in self.events.last:
                if not self.gone:
                    self.send(payload)
            super(_ResponseStream, self).close()

        def not_stored(failure):
            log.failure("storing response {id} failed", failure,
                        id=self.events.record.response_id)
            error = error_for(failure.value)
            if not self.gone:
                self.send(self.events._event("error", code=error.code, message=error.message,
                                             param=None))
            super(_ResponseStream, self).close()

        closing.addCallbacks(send_last, not_stored)


# -- GET, DELETE, cancel, input items --------------------------------------------------------------


def _query(request, allowed: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for raw, values in (request.args or {}).items():
        name = raw.decode("utf-8", "replace")[:64]
        if name not in allowed:
            raise invalid(f"query parameter {name!r} is not supported here", name,
                          code="unsupported_parameter")
        if len(values) != 1:
            raise invalid(f"query parameter {name!r} is given more than once", name,
                          code="invalid_value")
        try:
            out[name] = values[0].decode("utf-8")
        except UnicodeDecodeError:
            raise invalid(f"query parameter {name!r} is not UTF-8", name,
                          code="invalid_value") from None
    return out


def _method_not_allowed(allowed: str) -> OpenAIError:
    return OpenAIError(405, f"use {allowed} on this endpoint", "invalid_request_error",
                       code="method_not_allowed", headers={"Allow": allowed})


async def answer_item(context: Context, request, exchange: Exchange,
                      segments: list[bytes]) -> None:
    """``/v1/responses/{id}`` (GET, DELETE), ``/{id}/cancel`` (POST) and
    ``/{id}/input_items`` (GET)."""
    try:
        response_id = response_id_of(segments[0].decode("ascii"), "response_id")
    except (UnicodeDecodeError, OpenAIError):
        raise _not_found(segments[0].decode("utf-8", "replace")) from None
    tail = segments[1:]
    method = request.method.upper()
    if tail == [] and method in (b"GET", b"HEAD", b"DELETE"):
        handler = _retrieve if method != b"DELETE" else _delete
    elif tail == []:
        raise _method_not_allowed("GET, DELETE")
    elif tail == [b"cancel"]:
        if method != b"POST":
            raise _method_not_allowed("POST")
        handler = _cancel
    elif tail == [b"input_items"]:
        if method not in (b"GET", b"HEAD"):
            raise _method_not_allowed("GET")
        handler = _input_items
    else:
        raise OpenAIError(404, "unknown endpoint", "invalid_request_error", code="unknown_url")
    parts = _parts(context)
    if parts is None:
        raise _not_found(response_id)  # nothing is stored here
    await handler(parts, request, exchange, response_id)


async def _retrieve(parts: ResponsesParts, request, exchange: Exchange, response_id: str):
    query = _query(request, ("stream", "include"))
    if query.get("stream") not in (None, "false"):
        raise invalid("streaming a stored response again is not supported here", "stream",
                      code="unsupported_parameter")
    if query.get("include"):
        raise invalid("'include' is not supported here", "include",
                      code="unsupported_parameter")
    row = await _read(parts, request, response_id)
    exchange.send_json(200, row.body, usage={})


async def _read(parts: ResponsesParts, request, response_id: str):
    row = await parts.store.get(response_id, parts.owner(request))
    if row is None:
        raise _not_found(response_id)
    return row


async def _delete(parts: ResponsesParts, request, exchange: Exchange, response_id: str):
    _query(request, ())
    owner = parts.owner(request)
    row = await parts.store.get(response_id, owner)
    if row is None or not await parts.store.delete(response_id, owner):
        raise _not_found(response_id)
    if row.running:
        await parts.runs.cancel(response_id)
    exchange.send_json(200, {"id": response_id, "object": "response", "deleted": True})


async def _cancel(parts: ResponsesParts, request, exchange: Exchange, response_id: str):
    _query(request, ())
    row = await parts.store.cancel(response_id, parts.owner(request))
    if row is None:
        raise _not_found(response_id)
    if not row.background:
        raise invalid("only a background response can be cancelled", "response_id",
                      code="invalid_value")
    if row.status == "cancelled":
        await parts.runs.cancel(response_id)
    exchange.send_json(200, row.body, usage={})


async def _input_items(parts: ResponsesParts, request, exchange: Exchange, response_id: str):
    query = _query(request, ("limit", "order", "after", "include"))
    if query.get("include"):
        raise invalid("'include' is not supported here", "include",
                      code="unsupported_parameter")
    try:
        limit = int(query.get("limit", DEFAULT_PAGE))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise invalid(f"'limit' must be an integer between 1 and {MAX_PAGE}", "limit",
                      code="invalid_value")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'", "order", code="invalid_value")
    row = await _read(parts, request, response_id)
    items = list(row.input_items)
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise invalid(f"'after' {after[:64]!r} is not an item of this response", "after",
                          code="invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    exchange.send_json(200, {"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": len(items) > limit}, usage={})

