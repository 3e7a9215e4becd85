"""The frames of a ``call`` tunnel stream: one backend call without gRPC or HTTP/2 on the wire.

A frontend opens a ``call`` stream (``tunnel/preamble.py``) to ``127.0.0.1:<backend port>``;
right behind the stream's request frame (not waiting for the worker's ``ok``) it writes a
request frame, and the worker, which holds a gRPC channel to that backend already, makes the
call and writes back message frames (one for a unary call, one per item of ``PredictStream``)
and then exactly one status frame.  Later calls on the same stream (keep-alive) write their
request frame alone.  Why: a grpcio channel in
the frontend cost 350-770 us of CPU per unary call before any byte left (issue 25 §2), and its
HTTP/2 had to be spliced onto a tunnel stream anyway.

Every frame is ``kind`` (1 byte) + ``length`` (4 bytes, big-endian) + ``length`` bytes:

- ``REQUEST`` (frontend -> worker): method-name length (1 byte), the method name (one of the
  ``backend.Backend`` service's methods, :data:`METHODS`), the timeout in milliseconds (4 bytes;
  0: none stated), then the serialized protobuf request;
- ``MESSAGE`` (worker -> frontend): one serialized protobuf response;
- ``STATUS`` (worker -> frontend): the gRPC status code (1 byte, 0-16) and its details (UTF-8,
  at most :data:`MAX_DETAILS_BYTES`), as the backend answered them;
- ``REFUSED`` (worker -> frontend, instead of any answer): the backend on the port went away
  while the stream was idle, nothing ran; the details (UTF-8, at most
  :data:`MAX_DETAILS_BYTES`) say why, and the worker closes the stream.

Keep-alive: the stream carries one call after another, each a request frame answered by message
frames and one status frame; the next request is written only after the status.

The protobuf bytes are never parsed on the worker: it passes them to the backend as they came.

Pure: no I/O, no reactor.  Bounds: a frame's payload is at most the 50 MiB message cap of
``grpcoptions.py`` plus the request header; a decoder refuses a longer length, an unknown kind or
a kind its side never receives as soon as the 5-byte header is there (:class:`CallProtocolError`),
and never holds more than one frame plus what followed it in the same read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from localai_tw import errors
from localai_tw.backends import backend_pb2
from localai_tw.backends.grpcoptions import MAX_MESSAGE_BYTES

REQUEST = 1
MESSAGE = 2
STATUS = 3
REFUSED = 4
KIND_NAMES = {REQUEST: "request", MESSAGE: "message", STATUS: "status", REFUSED: "refused"}

_HEADER = struct.Struct(">BI")
HEADER_SIZE = _HEADER.size
_TIMEOUT = struct.Struct(">I")

#: Longest method name (the service's own are far shorter).
MAX_METHOD_BYTES = 64
#: Largest timeout a request states: one day, in milliseconds.
MAX_TIMEOUT_MS = 24 * 60 * 60 * 1000
#: Longest status details carried (longer ones are cut, on a character boundary).
MAX_DETAILS_BYTES = 4096
#: Largest payload of any frame: one message at the cap plus the request header.
MAX_PAYLOAD = MAX_MESSAGE_BYTES + 1 + MAX_METHOD_BYTES + _TIMEOUT.size
#: gRPC status codes are 0 (OK) to 16 (UNAUTHENTICATED).
MAX_STATUS_CODE = 16
OK = 0


class CallProtocolError(errors.TunnelProtocolError):
    """A ``call`` stream frame that breaks this protocol (oversize, unknown kind, garbage)."""


@dataclass(frozen=True)
class Method:
    """One method of ``backend.Backend``: its gRPC path and message classes."""

    name: str
    path: str
    request_type: type
    response_type: type
    server_streaming: bool


def _methods() -> dict[str, Method]:
    service = backend_pb2.DESCRIPTOR.services_by_name["Backend"]
    table = {}
    for method in service.methods:
        if method.client_streaming:
            continue  # nothing of ours sends a stream; such a method is not offered
        table[method.name] = Method(
            method.name, f"/{service.full_name}/{method.name}",
            getattr(backend_pb2, method.input_type.name),
            getattr(backend_pb2, method.output_type.name), method.server_streaming)
    return table


#: The methods a ``call`` stream may name, from the service descriptor.
METHODS: dict[str, Method] = _methods()


@dataclass(frozen=True)
class CallRequest:
    method: Method
    timeout_ms: int  # 0: none stated
    body: bytes


@dataclass(frozen=True)
class CallStatus:
    code: int
    details: str

    @property
    def ok(self) -> bool:
        return self.code == OK


# -- encoding ---------------------------------------------------------------------------------


def _frame(kind: int, payload: bytes) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"a {KIND_NAMES[kind]} frame of {len(payload)} bytes exceeds "
                         f"{MAX_PAYLOAD}")
    return _HEADER.pack(kind, len(payload)) + payload


def encode_request(method: str, timeout_ms: int, body: bytes) -> bytes:
    """The request frame.  Raises ``ValueError`` for an unknown method, a timeout outside
    0..one day or a body over the message cap (the caller's bug, or a message too large)."""
    if method not in METHODS:
        raise ValueError(f"{method!r} is not a method of backend.Backend")
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms < 0:
        raise ValueError(f"timeout must be non-negative milliseconds: {timeout_ms!r}")
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a {method} request of {len(body)} bytes exceeds the message cap of "
                         f"{MAX_MESSAGE_BYTES} bytes")
    name = method.encode("ascii")
    return _frame(REQUEST, bytes((len(name),)) + name
                  + _TIMEOUT.pack(min(timeout_ms, MAX_TIMEOUT_MS)) + body)


def encode_message(body: bytes) -> bytes:
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {len(body)} bytes exceeds the cap of "
                         f"{MAX_MESSAGE_BYTES} bytes")
    return _frame(MESSAGE, body)


def encode_status(code: int, details: str = "") -> bytes:
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= MAX_STATUS_CODE:
        raise ValueError(f"{code!r} is not a gRPC status code")
    text = (details or "").encode("utf-8", "replace")[:MAX_DETAILS_BYTES]
    text = text.decode("utf-8", "ignore").encode("utf-8")  # no character cut in half
    return _frame(STATUS, bytes((code,)) + text)


def encode_refused(details: str) -> bytes:
    text = (details or "").encode("utf-8", "replace")[:MAX_DETAILS_BYTES]
    return _frame(REFUSED, text.decode("utf-8", "ignore").encode("utf-8"))


# -- decoding ---------------------------------------------------------------------------------


def parse_request(payload: bytes) -> CallRequest:
    if len(payload) < 1:
        raise CallProtocolError("call request is empty")
    size = payload[0]
    if not 1 <= size <= MAX_METHOD_BYTES or len(payload) < 1 + size + _TIMEOUT.size:
        raise CallProtocolError(f"call request header is malformed ({len(payload)} bytes, "
                                f"method name of {size})")
    raw_name = payload[1:1 + size]
    name = raw_name.decode("ascii", "replace")
    method = METHODS.get(name)
    if method is None:
        raise CallProtocolError(f"call request names no method of backend.Backend: "
                                f"{raw_name[:64]!r}")
    (timeout_ms,) = _TIMEOUT.unpack_from(payload, 1 + size)
    if timeout_ms > MAX_TIMEOUT_MS:
        raise CallProtocolError(f"call request timeout {timeout_ms} ms exceeds one day")
    body = payload[1 + size + _TIMEOUT.size:]
    if len(body) > MAX_MESSAGE_BYTES:
        raise CallProtocolError(f"call request body of {len(body)} bytes exceeds the cap")
    return CallRequest(method, timeout_ms, body)


def parse_status(payload: bytes) -> CallStatus:
    if not payload:
        raise CallProtocolError("call status frame is empty")
    code = payload[0]
    if code > MAX_STATUS_CODE:
        raise CallProtocolError(f"call status {code} is not a gRPC status code")
    details = payload[1:]
    if len(details) > MAX_DETAILS_BYTES:
        raise CallProtocolError(f"call status details of {len(details)} bytes exceed "
                                f"{MAX_DETAILS_BYTES}")
    return CallStatus(code, details.decode("utf-8", "replace"))


def parse_refused(payload: bytes) -> str:
    if len(payload) > MAX_DETAILS_BYTES:
        raise CallProtocolError(f"call refusal of {len(payload)} bytes exceeds "
                                f"{MAX_DETAILS_BYTES}")
    return payload.decode("utf-8", "replace")


class FrameDecoder:
    """Frames from a byte stream fed in arbitrary pieces, one at a time (``next_frame``), so a
    reader that must wait (a slow consumer) simply stops asking and pauses its transport.

    :param kinds: the kinds this side may receive; any other is a protocol error.
    """

    def __init__(self, kinds: frozenset[int] | set[int], max_payload: int = MAX_PAYLOAD):
        self._kinds = frozenset(kinds)
        self._max = max_payload
        self._buffer = bytearray()
        self._need: tuple[int, int] | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> None:
        self._buffer += data
        self._check_header()

    def _check_header(self) -> None:
        if self._need is not None or len(self._buffer) < HEADER_SIZE:
            return
        kind, length = _HEADER.unpack_from(self._buffer)
        if kind not in self._kinds:
            name = KIND_NAMES.get(kind)
            raise CallProtocolError(f"unexpected call frame kind {name or kind!r}"
                                    + (" on this side" if name else ""))
        if length > self._max:
            raise CallProtocolError(f"call frame announces {length} bytes, more than the "
                                    f"limit of {self._max}")
        self._need = (kind, length)

    def next_frame(self) -> tuple[int, bytes] | None:
        """The next whole frame as ``(kind, payload)``, or None until more bytes arrive."""
        if self._need is None:
            return None
        kind, length = self._need
        end = HEADER_SIZE + length
        if len(self._buffer) < end:
            return None
        payload = bytes(self._buffer[HEADER_SIZE:end])
        del self._buffer[:end]
        self._need = None
        self._check_header()
        return kind, payload

    def eof(self) -> str | None:
        """Why ending the stream now cuts a frame, or None when it ends between frames."""
        if not self._buffer:
            return None
        if self._need is None:
            return f"the stream ended inside a call frame header ({len(self._buffer)} bytes)"
        return (f"the stream ended inside a {KIND_NAMES[self._need[0]]} frame "
                f"({len(self._buffer) - HEADER_SIZE} of {self._need[1]} bytes)")
