"""yamux over Twisted: a wire-compatible multiplexer (hashicorp/yamux, libp2p go-yamux).

``Session`` is the Protocol that carries streams; ``Stream`` is the transport each stream's
protocol sees.  This package knows nothing of tunnels, HTTP or the cluster above it.
"""

from localai_tw.mux.errors import (
    FrameError,
    KeepaliveTimeout,
    MuxError,
    ProtocolError,
    SessionEnded,
    SessionFailed,
    SessionNotOpen,
    StreamClosed,
    StreamReset,
    StreamsExhausted,
    TooManyStreams,
)
from localai_tw.mux.session import Session, SessionConfig, SessionState
from localai_tw.mux.stream import MuxAddress, Stream, StreamState

__all__ = [
    "FrameError", "KeepaliveTimeout", "MuxError", "ProtocolError", "SessionEnded",
    "SessionFailed", "SessionNotOpen", "StreamClosed", "StreamReset", "StreamsExhausted",
    "TooManyStreams", "Session", "SessionConfig", "SessionState", "MuxAddress", "Stream",
    "StreamState",
]
