"""The yamux frame codec: the 12-byte header, the four frame types and an incremental decoder.

This module is pure: it turns bytes into ``Frame`` values and back.  It never does I/O, never
keeps state about streams, and never reads a payload after a frame that has none (window
update, ping and go-away frames are header only; their length field is a number).  The decoder
bounds what it buffers: at most one header plus one Data payload of ``max_payload`` bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from localai_tw.mux.errors import FrameError

HEADER = struct.Struct(">BBHII")
HEADER_SIZE = HEADER.size  # 12

VERSION = 0

TYPE_DATA = 0
TYPE_WINDOW_UPDATE = 1
TYPE_PING = 2
TYPE_GO_AWAY = 3
TYPE_NAMES = {
    TYPE_DATA: "data",
    TYPE_WINDOW_UPDATE: "window-update",
    TYPE_PING: "ping",
    TYPE_GO_AWAY: "go-away",
}

FLAG_SYN = 0x1
FLAG_ACK = 0x2
FLAG_FIN = 0x4
FLAG_RST = 0x8

GOAWAY_NORMAL = 0
GOAWAY_PROTOCOL_ERROR = 1
GOAWAY_INTERNAL_ERROR = 2

# Both windows of every stream start here, without any handshake.
INITIAL_WINDOW = 256 * 1024

MAX_UINT16 = 0xFFFF
MAX_UINT32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Frame:
    """One yamux frame.

    ``length`` is the payload size for Data frames and a plain number for the others (window
    increment, ping opaque value, go-away code).  Only Data frames carry ``payload``.
    """

    type: int
    flags: int
    stream_id: int
    length: int
    payload: bytes = b""

    # -- constructors: they keep ``length`` and ``payload`` consistent ----------------------

    @classmethod
    def data(cls, stream_id: int, payload: bytes = b"", flags: int = 0) -> "Frame":
        return cls(TYPE_DATA, flags, stream_id, len(payload), bytes(payload))

    @classmethod
    def window_update(cls, stream_id: int, delta: int = 0, flags: int = 0) -> "Frame":
        return cls(TYPE_WINDOW_UPDATE, flags, stream_id, delta)

    @classmethod
    def ping(cls, opaque: int, ack: bool = False) -> "Frame":
        return cls(TYPE_PING, FLAG_ACK if ack else FLAG_SYN, 0, opaque)

    @classmethod
    def go_away(cls, code: int = GOAWAY_NORMAL) -> "Frame":
        return cls(TYPE_GO_AWAY, 0, 0, code)

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)

    def __repr__(self) -> str:
        names = [n for f, n in ((FLAG_SYN, "SYN"), (FLAG_ACK, "ACK"), (FLAG_FIN, "FIN"),
                                (FLAG_RST, "RST")) if self.flags & f]
        kind = TYPE_NAMES.get(self.type, f"type{self.type}")
        return (f"<Frame {kind} id={self.stream_id} flags={'|'.join(names) or '-'} "
                f"length={self.length}>")


def encode(frame: Frame) -> bytes:
    """Serialise ``frame``; refuses frames the decoder (or a Go peer) would reject."""
    if frame.type not in TYPE_NAMES:
        raise ValueError(f"unknown frame type {frame.type}")
    if not 0 <= frame.flags <= MAX_UINT16:
        raise ValueError(f"flags out of range: {frame.flags}")
    if not 0 <= frame.stream_id <= MAX_UINT32:
        raise ValueError(f"stream id out of range: {frame.stream_id}")
    if not 0 <= frame.length <= MAX_UINT32:
        raise ValueError(f"length out of range: {frame.length}")
    if frame.type == TYPE_DATA:
        if frame.length != len(frame.payload):
            raise ValueError("a Data frame's length must equal its payload size")
    elif frame.payload:
        raise ValueError("only Data frames carry a payload")
    header = HEADER.pack(VERSION, frame.type, frame.flags, frame.stream_id, frame.length)
    return header + frame.payload if frame.payload else header


class FrameDecoder:
    """Incremental decoder: feed it bytes cut anywhere, get whole frames back.

    A Data frame whose length exceeds ``max_payload`` is refused as soon as its header is seen,
    so a hostile length never makes us buffer.  After a ``FrameError`` the byte stream has no
    trustworthy frame boundary left, so the decoder refuses all further input.
    """

    def __init__(self, max_payload: int = INITIAL_WINDOW):
        if max_payload < 0:
            raise ValueError("max_payload must not be negative")
        self.max_payload = max_payload
        self._buffer = bytearray()
        self._failed: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        """Decode every whole frame in what was held plus ``data``; hold the incomplete tail."""
        return [Frame(*fields) for fields in self.decode(data)]

    def decode(self, data: bytes) -> list[tuple[int, int, int, int, bytes]]:
        """``feed`` without the ``Frame`` objects: ``(type, flags, stream_id, length, payload)``
        tuples, checked exactly as ``feed`` checks them (the session's hot path).

        Each payload is copied once, out of the read it came in: a read is parsed where it
        lies.  Only a frame cut by the end of a read is held, and the next read gives it just
        the bytes it lacks, so the rest of that read is parsed in place too."""
        if self._failed is not None:
            raise self._failed
        frames: list[tuple[int, int, int, int, bytes]] = []
        held = self._buffer
        try:
            with memoryview(data) as view:
                end = len(view)
                pos = 0
                if held:
                    pos = self._complete(held, view)
                    if pos < 0:
                        return frames  # the held frame still lacks bytes: all of them taken
                    with memoryview(held) as hview:
                        self._parse(hview, 0, len(hview), frames.append)
                    del held[:]
                pos = self._parse(view, pos, end, frames.append)
                if pos < end:
                    held += view[pos:]  # the start of a frame cut by the end of this read
        except FrameError as e:
            self._failed = e
            self._buffer = bytearray()
            raise
        return frames

    def _complete(self, held: bytearray, view: memoryview) -> int:
        """Move into ``held`` the bytes of ``view`` that its frame lacks.  Returns where the rest
        of ``view`` starts, or -1 if the frame is still incomplete (all of ``view`` taken)."""
        pos = 0
        end = len(view)
        if len(held) < HEADER_SIZE:
            pos = min(HEADER_SIZE - len(held), end)
            held += view[:pos]
            if len(held) < HEADER_SIZE:
                return -1
        version, ftype, _, _, length = HEADER.unpack_from(held)
        if version != VERSION or ftype != TYPE_DATA or length > self.max_payload:
            return pos  # header only, or refused by _parse
        take = HEADER_SIZE + length - len(held)
        if take > end - pos:
            held += view[pos:]
            return -1
        held += view[pos:pos + take]
        return pos + take

    def _parse(self, view: memoryview, pos: int, end: int, append) -> int:
        """Append every whole frame of ``view[pos:end]``; return where the incomplete tail
        starts."""
        unpack_from = HEADER.unpack_from
        max_payload = self.max_payload
        while end - pos >= HEADER_SIZE:
            version, ftype, flags, stream_id, length = unpack_from(view, pos)
            if version != VERSION:
                raise FrameError(f"unsupported yamux version {version}")
            if ftype != TYPE_DATA:
                if ftype not in TYPE_NAMES:
                    raise FrameError(f"unknown frame type {ftype}")
                append((ftype, flags, stream_id, length, b""))
                pos += HEADER_SIZE
                continue
            if length > max_payload:
                raise FrameError(
                    f"data frame of {length} bytes exceeds the limit of {max_payload}")
            start = pos + HEADER_SIZE
            if end - start < length:
                break  # wait for the rest of the payload
            pos = start + length
            append((TYPE_DATA, flags, stream_id, length, view[start:pos].tobytes()))
        return pos
