"""Every use localai-tw makes of Autobahn's private or undocumented internals, in one place.

The WebSocket carrier (``tunnel/websocket.py``) and its binary frame codec
(``tunnel/wsframes.py``) otherwise use Autobahn's documented API only: the Twisted factories and
protocols, ``setProtocolOptions``, ``sendMessage``, ``sendClose``, ``onOpen``, ``onMessage``,
``onPing`` and ``onClose``.  Everything below is not part of that API, so a new Autobahn may
rename or change it without notice.  Each entry has a test of its own in
``tests/unit/test_autobahn_compat.py``, named after it, that checks the name is there and still
behaves as relied on here: an Autobahn that changed it fails that test by name, not an
integration test at random.  The same file checks that no other module of ours spells these
internals.

Proved with Autobahn 26.10.2 and 26.11.1 (that test file, the WebSocket, tunnel and worker
tunnel integration tests and the Go interop test passed with each); ``setup.py`` allows
``>=26.10.2,<26.12`` for that reason.  Before widening the range, run those against the new
version.

The private uses, and why each is needed:

1. ``state_constants``: ``WebSocketProtocol.STATE_OPEN``, ``STATE_CONNECTING``,
   ``STATE_PROXY_CONNECTING``, ``SEND_STATE_GROUND`` and the protocol's ``state`` and
   ``send_state``.  The codec builds and parses frames itself only while the connection is
   open and Autobahn is not in the middle of sending a message; it attributes wire octets to
   the same counters Autobahn would.
2. ``parse``: ``WebSocketProtocol._dataReceived``, Autobahn's ``dataReceived`` without the
   debug line it formats on every read even with debug logging off (15-20 % of a side's CPU).
3. ``receive_buffer``: the parser's buffer ``data`` and ``consumeData()``.  Bytes Autobahn
   already holds (the start of a frame that came with the handshake) are taken over by the
   codec; what the codec hands back (a control frame, a fragment, a violation) is put there
   and parsed by Autobahn.
4. ``receive_position``: ``current_frame`` and ``inside_message``: the codec parses only at a
   message boundary, never inside a frame or fragmented message Autobahn started.
5. ``features``: ``_perMessageCompress``, ``logFrames``, ``logOctets``, ``trackedTimings``,
   ``autoPingTimeoutCall`` and ``send_queue``: any of these in use means Autobahn must handle
   the frame (compression, frame logging, timings, a pending auto-ping, queued sync writes).
6. ``options``: the attributes ``setProtocolOptions`` sets on the protocol
   (``maskServerFrames``, ``maskClientFrames``, ``applyMask``, ``requireMaskedClientFrames``,
   ``maxFramePayloadSize``, ``maxMessagePayloadSize``) and ``factory.isServer``: the codec masks,
   expects masks and enforces the bounds exactly as Autobahn was configured to.
7. ``traffic_stats``: ``trafficStats`` and its counters, kept as Autobahn would keep them for
   the frames the codec handles (tests and operators read them).
8. ``send_data_hook``: ``sendData``, the one method every frame Autobahn sends itself (pong,
   close) goes through.  The codec overrides it to flush the carrier's held writes first, so
   a close or pong never overtakes data, and to skip the per-write debug line.
9. ``refusal_status``: ``failHandshake`` called on the client for a refused opening handshake,
   with ``http_status_line`` already set: how the client keeps the HTTP status (401, 403).
10. ``drop``: ``dropConnection(abort=True)``, not in ``IWebSocketChannel``: drop TCP at once.
11. ``c_masker``: the ``_nvx_xormasker`` C extension Autobahn ships (``nvx_xormask_new``,
    ``_set_impl``, ``_process``, ``_free``), called without Autobahn's per-call wrapper object;
    absent on a build without it (``C_MASKER`` is then False and the slower ``py_mask`` is
    used; its test fails to say so).
12. ``py_mask``: ``autobahn.websocket.xormasker.create_xor_masker``, Autobahn's own masker,
    for masking without the C extension.
13. ``forget_handshake``: the attributes the server's opening handshake leaves on the protocol
    (``http_headers``, ``http_request_data``, ``http_response_data``, ``http_request_params``
    and the request line's parts), read only until ``onOpen``.  The carrier drops them once
    open: about 2 KiB per idle tunnel, for the tunnel's whole life.

What this module must never do: hold state of its own or decide anything about the tunnel; it
only names Autobahn's internals.
"""

from __future__ import annotations

from autobahn.websocket.protocol import WebSocketProtocol
from autobahn.websocket.xormasker import create_xor_masker

try:  # Autobahn's NVX C extension, optional in Autobahn's own build
    from _nvx_xormasker import ffi as _nvx_ffi, lib as _nvx_lib
except ImportError:  # pragma: no cover - Autobahn without its C extension
    _nvx_ffi = _nvx_lib = None

# 1. state_constants ---------------------------------------------------------------------------

STATE_OPEN = WebSocketProtocol.STATE_OPEN
STATE_CONNECTING = WebSocketProtocol.STATE_CONNECTING
STATE_PROXY_CONNECTING = WebSocketProtocol.STATE_PROXY_CONNECTING
SEND_STATE_GROUND = WebSocketProtocol.SEND_STATE_GROUND


def is_open(ws) -> bool:
    """The opening handshake is done and no close was sent or received."""
    return ws.state == STATE_OPEN


# 2. parse -------------------------------------------------------------------------------------


def parse(ws, data: bytes) -> None:
    """Autobahn's own handling of received ``data``, without its per-read debug line."""
    ws._dataReceived(data)


# 3. receive_buffer ----------------------------------------------------------------------------


def take_received(ws) -> bytes:
    """The received bytes Autobahn's parser holds and has not parsed; it holds none after."""
    data, ws.data = ws.data, b""
    return data


def give_received(ws, data: bytes) -> None:
    """Make ``data`` what Autobahn's parser holds, to be parsed with the next read."""
    ws.data = data


def consume_received(ws) -> None:
    """Have Autobahn parse what its parser holds now."""
    ws.consumeData()


# 4. receive_position and 5. features: one call per read and per message, as the checks are
# on the codec's hot path -----------------------------------------------------------------------


def receive_ready(ws) -> bool:
    """A plain binary frame may be parsed outside Autobahn now: open (1), Autobahn's parser
    neither inside a frame nor inside a fragmented message (4), no compression, frame or octet
    logging, timings or auto-ping waiting for its pong (5)."""
    return (ws.state == STATE_OPEN and ws.current_frame is None and not ws.inside_message
            and ws._perMessageCompress is None and not ws.logFrames and not ws.logOctets
            and not ws.trackedTimings and not ws.autoPingTimeoutCall)


def send_ready(ws, masked: bool) -> bool:
    """A plain binary frame (``masked`` or not) may be built and written outside Autobahn now,
    the connection being open: no compression, frame or octet logging, timings (5), writes
    queued by Autobahn (5), masking switched off by the ``applyMask`` test option (6), nor a
    message of Autobahn's own being sent (1)."""
    return not (ws._perMessageCompress is not None or ws.send_queue or ws.logFrames
                or ws.logOctets or ws.trackedTimings or (masked and not ws.applyMask)
                or ws.send_state != SEND_STATE_GROUND)


def writes_itself(ws) -> bool:
    """Autobahn's own ``sendData`` must do this write: it holds queued writes (sync or chopped
    sends) or logs every octet (5)."""
    return bool(ws.send_queue or ws.logOctets)


# 6. options -----------------------------------------------------------------------------------


def send_masked(ws) -> bool:
    """This side masks the frames it sends (the client, by default)."""
    return bool(ws.maskServerFrames if ws.factory.isServer else ws.maskClientFrames)


def receive_rules(ws) -> tuple[bool | None, int, int]:
    """(whether received frames must be masked, largest frame payload, largest message
    payload; 0 is unbounded).  The first is None in a configuration where Autobahn must decide
    every frame (a server not requiring masks, or not applying them)."""
    masked = bool(ws.factory.isServer)
    if masked and not (ws.requireMaskedClientFrames and ws.applyMask):
        masked = None
    return masked, ws.maxFramePayloadSize, ws.maxMessagePayloadSize


# 7. traffic_stats -----------------------------------------------------------------------------


def count_wire_in(ws, n: int) -> None:
    """``n`` octets read off the wire while open, as Autobahn's ``_dataReceived`` counts them."""
    ws.trafficStats.incomingOctetsWireLevel += n


def count_wire_out(ws, n: int) -> None:
    """``n`` octets written to the wire, as Autobahn's ``sendData`` counts them."""
    if ws.state == STATE_OPEN:
        ws.trafficStats.outgoingOctetsWireLevel += n
    elif ws.state == STATE_CONNECTING or ws.state == STATE_PROXY_CONNECTING:
        ws.trafficStats.preopenOutgoingOctetsWireLevel += n


def count_message_in(ws, length: int) -> None:
    """One received single-frame, uncompressed message of ``length`` payload bytes."""
    stats = ws.trafficStats
    stats.incomingWebSocketFrames += 1
    stats.incomingWebSocketMessages += 1
    stats.incomingOctetsWebSocketLevel += length
    stats.incomingOctetsAppLevel += length


def count_message_out(ws, size: int, wire: int) -> None:
    """One sent single-frame, uncompressed message of ``size`` payload bytes, ``wire`` bytes
    with its header."""
    stats = ws.trafficStats
    stats.outgoingWebSocketMessages += 1
    stats.outgoingWebSocketFrames += 1
    stats.outgoingOctetsAppLevel += size
    stats.outgoingOctetsWebSocketLevel += size
    stats.outgoingOctetsWireLevel += wire


# 8. send_data_hook: the override itself lives in wsframes.FastBinaryFrames.sendData; its test
# checks that Autobahn's own frames (pong, close) go through ``sendData``.

# 9. refusal_status ----------------------------------------------------------------------------


def refusal_status(ws) -> int | None:
    """In the client's ``failHandshake``: the HTTP status of a refusal (not 101), else None."""
    fields = (getattr(ws, "http_status_line", "") or "").split()
    if len(fields) >= 2 and fields[1].isdigit() and fields[1] != "101":
        return int(fields[1])
    return None


# 10. drop -------------------------------------------------------------------------------------


def drop(ws) -> None:
    """Drop the TCP connection now, without a closing handshake."""
    ws.dropConnection(abort=True)


# 11. c_masker ---------------------------------------------------------------------------------

#: Whether Autobahn's C masker is there.
C_MASKER = _nvx_lib is not None


def c_mask_in_place(buf: bytearray, start: int, n: int, key: bytes) -> None:
    """XOR ``buf[start:start + n]`` with ``key`` in place, in C (only when ``C_MASKER``)."""
    masker = _nvx_lib.nvx_xormask_new(_nvx_ffi.new("uint8_t[4]", key))  # copies the key
    try:
        _nvx_lib.nvx_xormask_set_impl(masker, 2)  # SSE2, as Autobahn's own masker does
        with _nvx_ffi.from_buffer("uint8_t[]", buf, require_writable=True) as data:
            _nvx_lib.nvx_xormask_process(masker, data + start, n)
    finally:
        _nvx_lib.nvx_xormask_free(masker)


# 12. py_mask ----------------------------------------------------------------------------------


def py_mask(key: bytes, data: bytes) -> bytes:
    """``data`` XORed with ``key`` from offset 0, by Autobahn's own masker."""
    return create_xor_masker(key, len(data)).process(data)


# 13. forget_handshake -------------------------------------------------------------------------

#: What a server's opening handshake leaves on the protocol; Autobahn reads none of it after
#: ``onOpen``.
HANDSHAKE_LEFTOVERS = ("http_headers", "http_request_data", "http_response_data",
                       "http_request_params", "http_request_uri", "http_request_path",
                       "http_request_host", "http_status_line")


def forget_handshake(ws) -> None:
    """In the server's ``onOpen``: drop what the opening handshake left (set to None)."""
    for name in HANDSHAKE_LEFTOVERS:
        if name in ws.__dict__:
            setattr(ws, name, None)
