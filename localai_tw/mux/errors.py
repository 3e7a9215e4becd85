"""Errors of the yamux layer.

These are the ``reason`` values a stream's protocol sees in ``connectionLost`` and the
exceptions session calls raise.  Splice classifies endings by these types, so each ending has
exactly one type: never reuse one for another ending.
"""

from twisted.internet.error import ConnectionDone, ConnectionLost


class MuxError(Exception):
    """Base of yamux errors."""


class FrameError(MuxError):
    """A frame could not be decoded (bad version, unknown type, length above the limit)."""


class ProtocolError(MuxError):
    """The peer broke the protocol; the session ends with GoAway(protocol error)."""


class StreamsExhausted(MuxError):
    """No stream id of this session's parity is left."""


class SessionNotOpen(MuxError):
    """A stream cannot be opened: the session is closed, closing, or received GoAway."""


class TooManyStreams(MuxError):
    """The configured maximum of concurrent streams is reached."""


# -- endings seen in connectionLost ---------------------------------------------------------


class StreamClosed(ConnectionDone):
    """Normal ending: FIN went both ways, or our side closed the stream."""


class StreamReset(ConnectionLost):
    """The stream was reset.  ``remote`` is True when the peer sent RST, False when we did."""

    def __init__(self, remote: bool, detail: str = ""):
        self.remote = remote
        who = "remote" if remote else "local"
        super().__init__(f"stream reset by {who} side" + (f": {detail}" if detail else ""))


class SessionEnded(ConnectionDone):
    """Normal end of the whole session: a local close, the peer's normal GoAway, or a clean EOF
    of the carrying transport."""


class SessionFailed(ConnectionLost):
    """The session died with a cause: a transport error, a protocol error (ours or the peer's),
    or a GoAway with an error code.  ``cause`` says which."""

    def __init__(self, cause: str):
        self.cause = cause
        super().__init__(f"session failed: {cause}")


class KeepaliveTimeout(SessionFailed):
    """No ping reply arrived within the keepalive timeout; the session was ended."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        super().__init__(f"no ping reply within {timeout:g}s")
