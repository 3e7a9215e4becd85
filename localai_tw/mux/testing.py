"""Test helpers for code built on yamux sessions: in-memory session pairs, recording protocols.

Nothing here opens a socket or reads a real clock; it is for unit tests only and must never be
imported by production code.
"""

from __future__ import annotations

from twisted.internet import task
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.testing import StringTransport
from twisted.test import iosim
from zope.interface import implementer

from localai_tw.mux.frame import Frame, FrameDecoder
from localai_tw.mux.session import Session, SessionConfig


def connectedSessions(client_acceptor=None, server_acceptor=None,
                      client_config: SessionConfig | None = None,
                      server_config: SessionConfig | None = None, clock=None):
    """A yamux client and server joined by ``iosim``: ``(client, server, pump, clock)``."""
    clock = clock if clock is not None else task.Clock()
    client, server, pump = iosim.connectedServerAndClient(
        lambda: Session(False, server_config, server_acceptor, reactor=clock),
        lambda: Session(True, client_config, client_acceptor, reactor=clock),
        clock=clock,
    )
    return client, server, pump, clock


class Recorder(Protocol):
    """Keeps what it receives and how it ended."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.reason = None
        self.made = False
        self.lost_calls = 0

    def connectionMade(self):
        self.made = True

    def dataReceived(self, data):
        self.chunks.append(data)

    def connectionLost(self, reason):
        self.lost_calls += 1
        self.reason = reason

    @property
    def received(self) -> bytes:
        return b"".join(self.chunks)


@implementer(IHalfCloseableProtocol)
class HalfCloseRecorder(Recorder):
    """A ``Recorder`` that supports half-close and notes when each direction ended."""

    def __init__(self):
        super().__init__()
        self.read_lost = False
        self.write_lost = False
        self.events: list[str] = []

    def dataReceived(self, data):
        super().dataReceived(data)
        self.events.append("data")

    def readConnectionLost(self):
        self.read_lost = True
        self.events.append("readConnectionLost")

    def writeConnectionLost(self):
        self.write_lost = True
        self.events.append("writeConnectionLost")

    def connectionLost(self, reason):
        super().connectionLost(reason)
        self.events.append("connectionLost")


class FrameTransport(StringTransport):
    """A ``StringTransport`` that can decode what the session wrote into frames."""

    def __init__(self):
        super().__init__()
        self._decoder = FrameDecoder(max_payload=2**32 - 1)

    def frames(self) -> list[Frame]:
        """The frames written since the last call."""
        data = self.value()
        self.clear()
        return self._decoder.feed(data)


class StreamingProducer:
    """A push producer that records pause/resume calls."""

    def __init__(self):
        self.paused = False
        self.stopped = False
        self.calls: list[str] = []

    def pauseProducing(self):
        self.paused = True
        self.calls.append("pause")

    def resumeProducing(self):
        self.paused = False
        self.calls.append("resume")

    def stopProducing(self):
        self.stopped = True
        self.calls.append("stop")


def countPings(session) -> list[int]:
    """A one-item list counting the pings ``session`` sends from now on (each takes a fresh
    opaque value)."""
    sent = [0]
    real = session._nextOpaque

    def counted():
        sent[0] += 1
        return real()

    session._nextOpaque = counted
    return sent


def runClock(clock, pump, seconds: float, step: float = 0.05) -> None:
    """Advance ``clock`` by ``seconds`` in ``step``s, delivering what ``pump`` holds after each."""
    for _ in range(round(seconds / step)):
        clock.advance(step)
        pump.flush()


def runUntilBothJustRead(clock, pump, one, other, step: float = 0.01) -> float:
    """Advance until a flush in which both sessions read (a ping and its answer); the time."""
    while not (one._heard_at == other._heard_at == clock.seconds()):
        clock.advance(step)
        pump.flush()
    return clock.seconds()
