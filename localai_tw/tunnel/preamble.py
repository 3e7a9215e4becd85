"""The frames that open a tunnel stream: the per-stream preamble and the relay preamble.

Every stream a frontend opens to a worker starts with one *request frame* naming what the stream
is for (``"<tag> <target>"``) and the worker always answers with one *reply frame* (``ok`` or
``err <code> <text>``) before the carried protocol (HTTP, gRPC, or the framed backend call of a
``call`` stream, ``backends/callframes.py``) starts.  A stream relayed through
the owning replica is preceded by a *relay request* (``"<node> <lane> <budget-ms>"``) answered by
``relay-ok`` or ``err relay-<code> <text>``.  All four share one framing: a 2-byte big-endian
length and a payload of at most 1024 bytes.

This module is a pure codec: it does no I/O, holds no timers and knows nothing of transports.
What it must never do:

- read past the end of a frame: every byte after it belongs to HTTP or gRPC, so the reader hands
  back the untouched remainder;
- buffer a body whose announced length is over the limit: the length is refused as soon as its
  two bytes are known;
- map an unknown refusal code to a nearby known one: an unknown code is a protocol error
  (:class:`~localai_tw.errors.TunnelProtocolError`), never evidence;
- accept a reply of the other vocabulary: tunnel replies and relay replies use disjoint words so
  applying the wrong reader fails loudly.

Each encoder returns one ``bytes`` object so the caller writes a frame with a single ``write``
(one yamux data frame; the WebSocket carrier may coalesce it with other writes of the same
reactor turn, which readers never rely on either way).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from localai_tw import errors

#: Largest payload of any preamble frame, in bytes.  Guards the reader's allocation.
MAX_PAYLOAD = 1024

_LENGTH = struct.Struct(">H")
HEADER_SIZE = _LENGTH.size

# -- the stream preamble vocabulary ------------------------------------------------------------

TAG_HTTP = "http"
TAG_GRPC = "grpc"
#: one backend call in frames of ``backends/callframes.py`` (the worker makes the gRPC call)
TAG_CALL = "call"
#: the replica's stamp notices (``tunnel/stampnotice.py``): one frame per notice, worker reads
TAG_STAMPED = "stamped"

ACCEPTED = "ok"

UNKNOWN_TAG = "unknown-tag"
UNAVAILABLE = "unavailable"
BAD_REQUEST = "bad-request"
NOT_SERVED = "not-served"

#: The closed vocabulary of stream refusal codes, each with whether it is evidence about the
#: worker (may reap a ``node_models`` row) or not.  One table drives writer, reader and mapping.
REFUSAL_EVIDENCE: dict[str, bool] = {
    UNKNOWN_TAG: True,
    UNAVAILABLE: True,
    BAD_REQUEST: True,
    NOT_SERVED: False,
}

# -- the relay preamble vocabulary -------------------------------------------------------------

RELAY_ACCEPTED = "relay-ok"

RELAY_NOT_OWNER = "relay-not-owner"
RELAY_UNAVAILABLE = "relay-unavailable"
RELAY_BAD_REQUEST = "relay-bad-request"

RELAY_REFUSAL_CODES = frozenset({RELAY_NOT_OWNER, RELAY_UNAVAILABLE, RELAY_BAD_REQUEST})

LANE_INFERENCE = "inference"
LANE_BULK = "bulk"
LANE_BULK_ONLY = "bulk-only"
LANES = frozenset({LANE_INFERENCE, LANE_BULK, LANE_BULK_ONLY})

#: A relay budget is clamped to one day; 0 means the caller stated none.
MAX_BUDGET_MS = 24 * 60 * 60 * 1000
_MAX_BUDGET_DIGITS = 12  # bounds int() on untrusted input; anything longer is malformed

assert not (set(REFUSAL_EVIDENCE) | {ACCEPTED}) & (RELAY_REFUSAL_CODES | {RELAY_ACCEPTED})


# -- framing -------------------------------------------------------------------------------------


def encode_frame(payload: bytes) -> bytes:
    """One frame: the 2-byte big-endian length, then ``payload`` (at most ``MAX_PAYLOAD``)."""
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"preamble payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return _LENGTH.pack(len(payload)) + payload


def split_frame(buffered: bytes) -> tuple[bytes | None, bytes]:
    """Split one frame off the front of ``buffered``.

    Returns ``(payload, remainder)`` when the whole frame is present, the remainder being every
    byte after the frame, untouched.  Returns ``(None, buffered)`` while the frame is incomplete.
    Raises :class:`TunnelProtocolError` as soon as the length is known to exceed the limit.
    """
    if len(buffered) < HEADER_SIZE:
        return None, buffered
    (length,) = _LENGTH.unpack_from(buffered)
    if length > MAX_PAYLOAD:
        raise errors.TunnelProtocolError(
            f"preamble frame announces {length} bytes, more than the limit of {MAX_PAYLOAD}"
        )
    end = HEADER_SIZE + length
    if len(buffered) < end:
        return None, buffered
    return buffered[HEADER_SIZE:end], buffered[end:]


class FrameReader:
    """Reads exactly one preamble frame from a byte stream fed in arbitrary pieces.

    ``feed`` returns ``(payload, remainder)`` once the frame is complete (``remainder`` holds the
    bytes after the frame, which the caller must pass on to whatever follows) and
    ``(None, b"")`` while it is not.  The reader buffers at most ``HEADER_SIZE + MAX_PAYLOAD``
    bytes.  After the frame was returned the reader is spent: the next frame needs a new reader.
    """

    def __init__(self) -> None:
        self._buffered = b""
        self._done = False

    @property
    def done(self) -> bool:
        """Whether the frame was returned."""
        return self._done

    @property
    def buffered_bytes(self) -> int:
        """Bytes of an incomplete frame held so far."""
        return len(self._buffered)

    def feed(self, data: bytes) -> tuple[bytes | None, bytes]:
        if self._done:
            raise RuntimeError("this FrameReader already returned its frame")
        # Never join more than the frame can hold: the rest is returned untouched below.
        buffered = self._buffered + data[: HEADER_SIZE + MAX_PAYLOAD - len(self._buffered)]
        payload, _ = split_frame(buffered)
        if payload is None:
            self._buffered = buffered
            return None, b""
        used_from_data = HEADER_SIZE + len(payload) - len(self._buffered)
        self._buffered = b""
        self._done = True
        return payload, data[used_from_data:]

    def eof(self) -> None:
        """The stream ended.  Raises :class:`TransportFailure` when no whole frame was read:
        a preamble that cannot be read is a transport failure, never a refusal."""
        if self._done:
            return
        if self._buffered:
            expected = (
                f"{HEADER_SIZE + _LENGTH.unpack_from(self._buffered)[0]}"
                if len(self._buffered) >= HEADER_SIZE
                else "at least 2"
            )
            raise errors.TransportFailure(
                f"stream ended inside a preamble frame ({len(self._buffered)} of {expected} "
                "bytes)"
            )
        raise errors.TransportFailure("stream ended before a preamble frame")


# -- payload helpers ----------------------------------------------------------------------------


def _ascii_payload(payload: bytes, what: str) -> str:
    """Printable ASCII only: the request payloads are names, addresses and numbers."""
    if not all(0x20 <= byte <= 0x7E for byte in payload):
        raise errors.TunnelProtocolError(f"{what} is not printable ASCII: {payload[:64]!r}")
    return payload.decode("ascii")


def _utf8_payload(payload: bytes, what: str) -> str:
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.TunnelProtocolError(f"{what} is not valid UTF-8: {payload[:64]!r}") from None


def _printable_word(word: str, what: str) -> str:
    if not word or not all(0x21 <= ord(char) <= 0x7E for char in word):
        raise ValueError(f"{what} must be non-empty printable ASCII without spaces: {word!r}")
    return word


def _one_line(text: str) -> str:
    """Newlines (and every other control character) become spaces: a reply is one line."""
    return "".join(" " if ord(char) < 0x20 or ord(char) == 0x7F else char for char in text)


def _refusal_payload(code: str, text: str) -> bytes:
    """``err <code> <text>`` cut to ``MAX_PAYLOAD`` bytes without splitting a UTF-8 character."""
    head = f"err {code} ".encode("ascii")
    body = _one_line(text).encode("utf-8")[: MAX_PAYLOAD - len(head)]
    # A cut inside a multi-byte character leaves an incomplete tail; "ignore" drops exactly that
    # tail, because the rest came from a ``str`` and is valid.
    body = body.decode("utf-8", "ignore").encode("utf-8")
    return head + body


def _parse_refusal(payload: str, codes, what: str) -> tuple[str, str]:
    """``err <code>[ <text>]`` -> (code, text); an unknown code is a protocol error."""
    _, _, rest = payload.partition(" ")
    code, _, text = rest.partition(" ")
    if code not in codes:
        raise errors.TunnelProtocolError(f"{what} carries an unknown refusal code {code[:64]!r}")
    return code, text


# -- the stream preamble ------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamRequest:
    """What a stream is for: ``tag`` (``http``, ``grpc``, ``call``, ...) and its ``target``."""

    tag: str
    target: str


@dataclass(frozen=True)
class StreamReply:
    """The worker's answer to a request frame.  ``code`` is None when the stream was accepted."""

    code: str | None
    text: str = ""

    @property
    def accepted(self) -> bool:
        return self.code is None

    @property
    def is_evidence(self) -> bool:
        """Whether this refusal is the worker's own statement about itself or its backend."""
        return self.code is not None and REFUSAL_EVIDENCE[self.code]

    def as_error(self, node_id: str) -> errors.ClusterError:
        """The condition this refusal is: a :class:`StreamRefused` worker answer for evidence
        codes, a :class:`WorkerUnroutable` routing fact for ``not-served`` (nothing was learned
        about the target, so it must never reap or evict)."""
        if self.code is None:
            raise ValueError("an accepted stream is not an error")
        if self.is_evidence:
            return errors.StreamRefused(node_id, self.code, self.text)
        return errors.WorkerUnroutable(
            node_id, f"the worker did not serve the stream ({self.code}): {self.text}"
        )


def encode_request(tag: str, target: str) -> bytes:
    """The request frame ``"<tag> <target>"``.  ``tag`` is non-empty without spaces."""
    _printable_word(tag, "tag")
    if not all(0x20 <= ord(char) <= 0x7E for char in target):
        raise ValueError(f"target must be printable ASCII: {target!r}")
    return encode_frame(f"{tag} {target}".encode("ascii"))


def parse_request(payload: bytes) -> StreamRequest:
    """Parse a request payload, split on the first space.  Raises :class:`TunnelProtocolError`
    for anything malformed (the worker answers that with ``bad-request``)."""
    text = _ascii_payload(payload, "stream request")
    tag, space, target = text.partition(" ")
    if not space or not tag:
        raise errors.TunnelProtocolError(f"stream request {text[:64]!r} is not '<tag> <target>'")
    return StreamRequest(tag, target)


def encode_accepted() -> bytes:
    """The reply frame ``ok``."""
    return encode_frame(ACCEPTED.encode("ascii"))


def encode_refused(code: str, text: str) -> bytes:
    """The reply frame ``err <code> <text>``; ``code`` must be in the closed vocabulary."""
    if code not in REFUSAL_EVIDENCE:
        raise ValueError(f"unknown stream refusal code {code!r}")
    return encode_frame(_refusal_payload(code, text))


def parse_reply(payload: bytes) -> StreamReply:
    """Parse a reply payload.  Anything but ``ok`` or ``err <known code> ...`` (including a
    relay reply) raises :class:`TunnelProtocolError`."""
    text = _utf8_payload(payload, "stream reply")
    if text == ACCEPTED:
        return StreamReply(None)
    if not text.startswith("err "):
        raise errors.TunnelProtocolError(f"stream reply {text[:64]!r} is neither ok nor err")
    code, detail = _parse_refusal(text, REFUSAL_EVIDENCE, "stream reply")
    return StreamReply(code, detail)


# -- the relay preamble -------------------------------------------------------------------------


@dataclass(frozen=True)
class RelayRequest:
    """Which worker a relayed stream is for, on which lane, within how many milliseconds
    (0: the caller stated no budget)."""

    node_id: str
    lane: str
    budget_ms: int


@dataclass(frozen=True)
class RelayReply:
    """The owner replica's answer to a relay request.  ``code`` is None when it will relay."""

    code: str | None
    text: str = ""

    @property
    def accepted(self) -> bool:
        return self.code is None

    def as_error(self, node_id: str) -> errors.ClusterError:
        """A relay refusal is a routing fact (no route through that peer now), never a worker's
        answer: the worker was not asked."""
        if self.code is None:
            raise ValueError("an accepted relay is not an error")
        return errors.WorkerUnroutable(node_id, f"relay refused ({self.code}): {self.text}")


def budget_ms(remaining_seconds: float | None) -> int:
    """The relay budget for a caller's remaining time: milliseconds rounded up, clamped to a day;
    0 for no deadline.  An already expired deadline is the caller's, raised as such."""
    if remaining_seconds is None:
        return 0
    if not remaining_seconds > 0:  # also catches NaN
        raise errors.CallerDeadlineExceeded("stating the budget of a relayed stream")
    if math.isinf(remaining_seconds):
        return 0
    return min(MAX_BUDGET_MS, math.ceil(remaining_seconds * 1000))


def encode_relay_request(node_id: str, lane: str, budget_ms: int) -> bytes:
    """The relay request frame ``"<node> <lane> <budget-ms>"``; the budget is clamped to a day."""
    _printable_word(node_id, "node id")
    if lane not in LANES:
        raise ValueError(f"unknown lane {lane!r}")
    if isinstance(budget_ms, bool) or not isinstance(budget_ms, int) or budget_ms < 0:
        raise ValueError(f"budget must be a non-negative integer of milliseconds: {budget_ms!r}")
    return encode_frame(f"{node_id} {lane} {min(budget_ms, MAX_BUDGET_MS)}".encode("ascii"))


def parse_relay_request(payload: bytes) -> RelayRequest:
    """Parse a relay request payload.  Raises :class:`TunnelProtocolError` when malformed (the
    owner answers that with ``relay-bad-request``)."""
    text = _ascii_payload(payload, "relay request")
    fields = text.split(" ")
    if len(fields) != 3:
        raise errors.TunnelProtocolError(
            f"relay request {text[:64]!r} is not '<node> <lane> <budget-ms>'"
        )
    node_id, lane, budget = fields
    if not node_id:
        raise errors.TunnelProtocolError("relay request names no node")
    if lane not in LANES:
        raise errors.TunnelProtocolError(f"relay request names an unknown lane {lane[:64]!r}")
    if not budget.isdigit() or len(budget) > _MAX_BUDGET_DIGITS:  # isdigit: ASCII here
        raise errors.TunnelProtocolError(f"relay budget {budget[:64]!r} is not milliseconds")
    return RelayRequest(node_id, lane, min(int(budget), MAX_BUDGET_MS))


def encode_relay_accepted() -> bytes:
    """The relay reply frame ``relay-ok``."""
    return encode_frame(RELAY_ACCEPTED.encode("ascii"))


def encode_relay_refused(code: str, text: str) -> bytes:
    """The relay reply frame ``err <relay-code> <text>``."""
    if code not in RELAY_REFUSAL_CODES:
        raise ValueError(f"unknown relay refusal code {code!r}")
    return encode_frame(_refusal_payload(code, text))


def parse_relay_reply(payload: bytes) -> RelayReply:
    """Parse a relay reply payload.  Anything but ``relay-ok`` or ``err <known relay code> ...``
    (including a stream reply such as ``ok``) raises :class:`TunnelProtocolError`."""
    text = _utf8_payload(payload, "relay reply")
    if text == RELAY_ACCEPTED:
        return RelayReply(None)
    if not text.startswith("err "):
        raise errors.TunnelProtocolError(f"relay reply {text[:64]!r} is neither relay-ok nor err")
    code, detail = _parse_refusal(text, RELAY_REFUSAL_CODES, "relay reply")
    return RelayReply(code, detail)
