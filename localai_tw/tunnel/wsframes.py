"""The carrier's binary frame codec: plain final binary WebSocket frames built and parsed
outside Autobahn's per-message machinery, for speed; everything else left to Autobahn.

:class:`FastBinaryFrames` is mixed into the carrier's Autobahn protocols
(``tunnel/websocket.py``).  Once the connection is open, with no compression, logging, timings
or auto-ping in play, it parses each read's plain binary frames itself and hands their payload
to the protocol's ``carrier`` as it arrives, and sends the carrier's messages as one frame
built here (masked with a fresh random key on the client, RFC 6455 5.3).  At the first frame
that is anything else (control, fragment, text, a violation, above the bound) the rest of the
read goes to Autobahn's own parser, which handles or refuses it as before.

Every use of Autobahn's internals goes through ``tunnel/autobahn_compat.py``, which lists and
tests them.

What this module must never do: accept a frame Autobahn would refuse (it hands that frame to
Autobahn); let a frame of Autobahn's own (close, pong) overtake the carrier's held writes;
collect a whole message before delivering it.
"""

from __future__ import annotations

import os
import struct

from localai_tw.tunnel import autobahn_compat as ab

# Below this many bytes the XOR through Python ints is cheaper than a C masker's setup.
_SMALL_MASK = 256


def mask_in_place(buf: bytearray, start: int, key: bytes) -> None:
    """XOR ``buf[start:]`` with the 4-byte WebSocket masking ``key`` (RFC 6455 5.3), in place."""
    n = len(buf) - start
    if n <= 0:
        return
    if n <= _SMALL_MASK or not ab.C_MASKER:
        if n > _SMALL_MASK:  # no C extension: Autobahn's own fallback
            buf[start:] = ab.py_mask(key, bytes(buf[start:]))
            return
        keys = int.from_bytes((key * (n // 4 + 1))[:n], "little")
        buf[start:] = (int.from_bytes(buf[start:], "little") ^ keys).to_bytes(n, "little")
        return
    ab.c_mask_in_place(buf, start, n, key)


B0_BINARY_FINAL = 0x82  # FIN, no RSV bits, opcode 2 (binary)
_LEN16 = struct.Struct("!BBH")
_LEN64 = struct.Struct("!BBQ")


def binary_frame_header(length: int, masked: bool) -> bytes:
    """The header of one final, uncompressed binary frame (RFC 6455 5.2), minimal length form;
    without the masking key."""
    bit = 0x80 if masked else 0
    if length <= 125:
        return bytes((B0_BINARY_FINAL, bit | length))
    if length <= 0xFFFF:
        return _LEN16.pack(B0_BINARY_FINAL, bit | 126, length)
    return _LEN64.pack(B0_BINARY_FINAL, bit | 127, length)


# -- the codec mixin ---------------------------------------------------------------------------


class FastBinaryFrames:
    """Mixed into an Autobahn WebSocket protocol (before it in the bases) whose ``carrier``
    attribute is the :class:`~localai_tw.tunnel.websocket.WebSocketCarrier` (``None`` until
    open): plain binary frames in and out without Autobahn's per-message machinery."""

    carrier = None

    # Autobahn's own dataReceived and sendData format a debug line (click.style through hltype
    # and hlval) on every read and every write, even with debug logging off: 15-20 % of each
    # side's CPU in the transport benchmark.  These two do the same work without it.

    #: The start of a binary frame whose header is not complete yet, held by the fast receive
    #: path (Autobahn's ``data`` is empty meanwhile); at most one header (14 bytes).
    _rx: bytearray | None = None
    #: Payload bytes still to come of the frame the fast path is in the middle of (its header
    #: was accepted and the payload so far delivered), its masking key (None: not masked), how
    #: far into the payload we are (the key's offset), and its length (for the statistics).
    _rx_left: int = 0
    _rx_key: bytes | None = None
    _rx_done: int = 0
    _rx_length: int = 0

    def dataReceived(self, data: bytes) -> None:
        carrier = self.carrier
        if carrier is None:
            ab.parse(self, data)
            return
        carrier._startBatch()  # what the inner protocol writes in answer goes out as one message
        try:
            if self._rx_left or self._fastReceivable():
                self._receiveFast(data)
            else:
                if self._rx:  # the fast path held the start of a frame: Autobahn takes it
                    ab.give_received(self, bytes(self._rx))
                    self._rx = None
                ab.parse(self, data)
        finally:
            carrier._endBatch()

    def _fastReceivable(self) -> bool:
        """Open, at a message boundary, nothing negotiated or logged that needs Autobahn's own
        frame handling."""
        carrier = self.carrier
        return ab.receive_ready(self) and carrier is not None and carrier.connected

    def _receiveFast(self, data: bytes) -> None:
        """Deliver the final binary frames of ``data`` straight to the carrier.

        Only a frame that Autobahn would accept as a whole binary message takes this path: FIN
        set, no RSV bits, opcode 2, masked exactly when this side requires it (the client's
        frames are, the server's are not), minimal length encoding, length within the frame and
        message bounds and non-zero.  Its payload is unmasked and delivered as it arrives: each
        read's part of it at once, at the running offset of the masking key, never collected
        into a whole message; there are no frame or message objects, no future and no log line.
        At the first frame that is anything else (a control frame, a fragment, text, a
        violation) the rest of the read goes to Autobahn's own parser, which handles or refuses
        it as before; an incomplete header is held (``_rx``) for the next read."""
        ab.count_wire_in(self, len(data))
        held = ab.take_received(self)
        if held:  # Autobahn held the start of a frame (came with the handshake)
            data = held + data
        pos = 0
        if self._rx_left:
            with memoryview(data) as view:
                pos = min(self._rx_left, len(view))
                self._fastPayload(view, 0, pos)
            if self._rx_left:
                return  # the whole read was payload of that frame
            if not self._fastReceivable():  # closing meanwhile: Autobahn takes what follows
                if self._rx:
                    ab.give_received(self, bytes(self._rx))
                    self._rx = None
                ab.parse(self, data[pos:])
                return
        rx = self._rx
        if rx:
            rx += memoryview(data)[pos:]
            buf = rx
            pos = 0
        else:
            buf = data
        carrier = self.carrier
        # masked None: an unusual configuration, Autobahn decides every frame
        masked, max_frame, max_message = ab.receive_rules(self)
        end = len(buf)
        handover = False
        with memoryview(buf) as view:
            while end - pos >= 2:
                b1 = view[pos + 1]
                if view[pos] != B0_BINARY_FINAL or masked is None or bool(b1 & 0x80) != masked:
                    handover = True
                    break
                length = b1 & 0x7F
                start = pos + 2
                if length == 126:
                    if end - start < 2:
                        break
                    length = int.from_bytes(view[start:start + 2], "big")
                    start += 2
                    if length < 126:
                        handover = True
                        break
                elif length == 127:
                    if end - start < 8:
                        break
                    length = int.from_bytes(view[start:start + 8], "big")
                    start += 8
                    if length <= 0xFFFF or length > 0x7FFFFFFFFFFFFFFF:
                        handover = True
                        break
                if (not length or (max_frame and length > max_frame)
                        or (max_message and length > max_message)):
                    handover = True
                    break
                if masked:
                    if end - start < 4:
                        break
                    self._rx_key = view[start:start + 4].tobytes()
                    start += 4
                else:
                    self._rx_key = None
                self._rx_left, self._rx_done, self._rx_length = length, 0, length
                pos = min(start + length, end)
                self._fastPayload(view, start, pos)
                if self._rx_left:
                    break  # the rest of the payload comes with the next reads
                if not ab.is_open(self) or not carrier.connected:
                    handover = True  # closing: Autobahn handles what follows
                    break
            rest = view[pos:].tobytes() if handover else None
            if not handover and pos < end and buf is not rx:
                self._rx = bytearray(view[pos:])
        if handover:
            self._rx = None
            ab.give_received(self, rest)
            if rest:
                ab.consume_received(self)
        elif buf is rx:
            if pos == end:
                self._rx = None
            else:
                del rx[:pos]
        elif pos == end:
            self._rx = None

    def _fastPayload(self, view: memoryview, start: int, stop: int) -> None:
        """Unmask ``view[start:stop]``, the next bytes of the current frame's payload, and hand
        them to the carrier (dropped once it is gone); count the frame once it is whole.

        The carrier gets a buffer no one changes afterwards: the read's own bytes (a slice
        of the immutable ``bytes`` Twisted read) or, masked, a fresh ``bytearray`` unmasked in
        place.  It turns that into ``bytes`` only for an inner protocol that reads nothing
        else (``WebSocketCarrier._messageReceived``)."""
        n = stop - start
        if n > 0:
            key = self._rx_key
            if key is None:
                # An unmasked frame (the server's, so the dialler's receive path): a slice of
                # the read itself when that is immutable bytes (the slice stays valid after
                # ``view`` is released and may be held); a copy when the view is over the held
                # start of a frame (``_rx``, a bytearray changed by later reads).  The carrier
                # makes it ``bytes`` only for an inner protocol that reads nothing else.
                if type(view.obj) is bytes:
                    payload = view[start:stop]
                else:
                    payload = view[start:stop].tobytes()
            else:
                shift = self._rx_done & 3
                if shift:
                    key = key[shift:] + key[:shift]
                payload = bytearray(view[start:stop])  # the one copy: unmasked in place
                mask_in_place(payload, 0, key)
            self._rx_left -= n
            self._rx_done += n
        if not self._rx_left:  # counted before the last bytes are handed over
            ab.count_message_in(self, self._rx_length)
        if n > 0:
            carrier = self.carrier
            if carrier is not None and carrier.connected:
                carrier._messageReceived(payload)

    def sendData(self, data: bytes, sync: bool = False, chopsize: int | None = None) -> None:
        carrier = self.carrier
        if carrier is not None and carrier._out_size:
            carrier._flushOut()  # a frame of Autobahn's own (close, pong) never overtakes data
        if sync or chopsize or ab.writes_itself(self):
            super().sendData(data, sync, chopsize)
            return
        self.transport.write(data)
        ab.count_wire_out(self, len(data))

    def _sendBinary(self, chunks: list[bytes], size: int) -> None:
        """Send ``chunks`` (``size`` bytes in all, within the message bound) as one binary
        message.  In the plain case (open, no compression, no sync queue, no frame logging)
        the frame is built here: one final binary frame, masked with a fresh random key on
        the client side (RFC 6455 5.3), two copies of the payload instead of Autobahn's five
        and none of its per-message objects.  Otherwise Autobahn's ``sendMessage`` does it."""
        if not ab.is_open(self):
            return  # closing: Autobahn would refuse it too; the peer is not reading any more
        masked = ab.send_masked(self)
        if not ab.send_ready(self, masked):
            self.sendMessage(b"".join(chunks), isBinary=True)
            return
        header = binary_frame_header(size, masked)
        if masked:
            key = os.urandom(4)
            frame = bytearray().join([header, key, *chunks])
            mask_in_place(frame, len(header) + 4, key)
            raw = bytes(frame)
        else:
            raw = b"".join([header, *chunks])
        self.transport.write(raw)
        ab.count_message_out(self, size, len(raw))
