"""Stamp notices: the replica tells a worker, over its tunnel, that it stamped its heartbeat.

A worker whose replica stamps its heartbeat (``cluster/liveness.py``) still sent an HTTP
heartbeat every 60 s (``worker/service.py``'s ``CAPACITY_REFRESH_SECONDS``), only in case the
replica stopped stamping without ending the tunnel (its database unreachable, its instance
swept, a stamp statement stuck): about 50 requests a second for a replica holding 4000 idle
workers, a fifth of what such a replica still spent (docs/benchmarks.md, "An idle fleet").  The
replica knows which stamps were written; saying so over the tunnel costs one small data frame
and no answer.

The protocol, both ends (this module is both, like ``tunnel/keepalive.py``):

- a worker that takes notices says so on its upgrade request (:data:`STAMP_NOTICES_HEADER`);
- after a stamp pass, the replica opens one ``stamped`` stream to such a worker
  (``tunnel/preamble.py``'s request frame, answered ``ok`` once) and keeps it for the session's
  life; it writes one frame, the node's status (``healthy``, ``draining``...), for each node the
  pass wrote when the worker would otherwise go without one for more than
  :data:`NOTICE_EVERY` by the next pass, or when the node's status changed;
- the worker counts a notice as an answered heartbeat: its HTTP heartbeat then waits for a
  capacity change or ``CAPACITY_REFRESH_SECONDS`` without a heartbeat answered or a notice.

Only a written stamp is ever noticed: a stamp fenced out, a replica not live, a failed or late
pass, a replica stalled, all send nothing, and the worker's own 60 s refresh follows as before.
A replica that stops stamping at ``s`` left ``last_heartbeat = s - 11 s``; its last notice
reached the worker about ``s``, so the worker beats about ``s + 60 s``, before the 90 s stale
threshold passes at ``s + 79 s``.

What this module must never do: notice a node whose stamp was not written by the pass that
calls it; write on a stream the worker has not accepted; read anything from the worker but its one
reply (whatever follows ends the stream); let a notice stream's failure touch the session.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from localai_tw import errors
from localai_tw.tunnel import preamble
from localai_tw.tunnel.handshake import PreambleClient

log = Logger()

#: The header of a tunnel upgrade request by which a worker says it takes stamp notices.
STAMP_NOTICES_HEADER = "X-LocalAI-Stamp-Notices"
STAMP_NOTICES = "stream"

#: The longest a worker whose heartbeat this replica keeps stamping goes without a notice (plus
#: a late pass): well inside the worker's 60 s refresh, so a live replica's workers send no HTTP
#: heartbeat at idle.  With passes every 10 s a notice leaves every 40 s: a replica holding
#: 4000 workers writes about 100 a second.
NOTICE_EVERY = 50.0

#: The longest status word a notice carries (``cluster/nodes.py``'s statuses are short).
MAX_STATUS = 32


def encode_notice(status: str) -> bytes:
    """One notice frame: the node's status, a printable word."""
    if not status or len(status) > MAX_STATUS or not status.isascii() \
            or not all(0x21 <= ord(char) <= 0x7E for char in status):
        raise ValueError(f"a notice status must be a short printable word: {status[:64]!r}")
    return preamble.encode_frame(status.encode("ascii"))


def parse_notice(payload: bytes) -> str:
    """The status a notice frame carries; :class:`TunnelProtocolError` if it is not a short
    printable word."""
    if not payload or len(payload) > MAX_STATUS \
            or not all(0x21 <= byte <= 0x7E for byte in payload):
        raise errors.TunnelProtocolError(f"stamp notice {payload[:64]!r} is not a status word")
    return payload.decode("ascii")


# -- the replica's end -------------------------------------------------------------------------


class NoticePhase(enum.Enum):
    AWAITING_REPLY = "awaiting-reply"  # the request frame is sent, the worker's answer is not in
    OPEN = "open"                      # accepted: notices may be written
    CLOSED = "closed"                  # refused, failed or ended: never written again


class NoticeStream(PreambleClient):
    """The replica's end of one ``stamped`` stream.  The request and the worker's one reply go
    as on every stream the replica opens (``tunnel/handshake.py``: nothing read past the reply,
    refusals classified, a handshake backstop); after ``ok`` it only writes.  A notice asked
    for before the reply is written when ``ok`` arrives (the latest)."""

    def __init__(self, node_id: str = "-", reactor=None):
        if reactor is None:
            from twisted.internet import reactor
        super().__init__(node_id, preamble.TAG_STAMPED, "-", _AfterReply(self), reactor)
        self.phase = NoticePhase.AWAITING_REPLY
        self._pending: str | None = None
        self.whenReady().addCallbacks(self._accepted, self._refused)

    def send(self, status: str) -> bool:
        """Write (or, before the reply, hold) a notice; False when the stream is closed."""
        if self.phase is NoticePhase.OPEN:
            self.transport.write(encode_notice(status))
            return True
        if self.phase is NoticePhase.AWAITING_REPLY:
            self._pending = status
            return True
        return False

    def _accepted(self, _protocol) -> None:
        if self.phase is not NoticePhase.AWAITING_REPLY:
            return  # bytes after the reply closed it already
        self.phase = NoticePhase.OPEN
        pending, self._pending = self._pending, None
        if pending is not None:
            self.send(pending)

    def _refused(self, failure: Failure) -> None:
        self._closed(f"no stream ({failure.getErrorMessage()})")

    def _closed(self, why: str | None = None) -> None:
        if self.phase is NoticePhase.CLOSED:
            return
        self.phase = NoticePhase.CLOSED
        self._pending = None
        if why is not None:
            log.info("stamp notices to node {node}: {why}; its worker heartbeats over HTTP "
                     "instead", node=self.node_id, why=why)


class _AfterReply(Protocol):
    """A ``stamped`` stream after ``ok``: the worker writes nothing more on it."""

    def __init__(self, stream: NoticeStream):
        self._stream = stream

    def dataReceived(self, data: bytes) -> None:
        self._stream._closed("the worker wrote on its stamp notice stream")
        abort = getattr(self.transport, "abortConnection", None)
        (abort or self.transport.loseConnection)()

    def connectionLost(self, reason: Failure = None) -> None:
        self._stream._closed()


@dataclass
class _Noticed:
    session: Any
    stream: NoticeStream
    sent_at: float | None = None
    status: str | None = None


class StampNotices:
    """Sends stamp notices for the tunnels a stamp pass wrote (``TunnelLiveness``'s
    ``on_stamped``).

    :param registry: the ``TunnelRegistry`` (``session_for``, ``open_stream``).
    :param interval: seconds between stamp passes (``--tunnel-liveness``): a notice leaves at a
        pass when waiting for the next one would leave the worker more than
        :data:`NOTICE_EVERY` without one.
    :param random_fraction: a float in [0, 1) that picks a session's phase: its second notice
        comes 1 to 4 passes after its first (10 s passes), so tunnels that attached together (a
        replica's restart) do not all take their notices at the same pass ever after.
    """

    def __init__(self, registry, reactor, interval: float, every: float = NOTICE_EVERY,
                 random_fraction: Callable[[], float] = random.random):
        self._registry = registry
        self._reactor = reactor
        self._due_after = max(0.0, every - interval)
        self._interval = interval
        #: passes a session's first notice may be moved back by (its phase): 0 to 3 at 10 s
        self._phases = int(self._due_after // interval) if interval > 0 else 0
        self._random_fraction = random_fraction
        self._noticed: dict[str, _Noticed] = {}
        #: Notices written (or held for a reply), and notice streams opened (metrics, tests).
        self.sent = 0
        self.streams_opened = 0

    def stamped(self, written: Mapping[str, str]) -> None:
        """``written``: node id -> status of every node the pass just stamped."""
        now = self._reactor.seconds()
        for node_id, status in written.items():
            session = self._registry.session_for(node_id)
            if session is None or not getattr(session, "takes_stamp_notices", False):
                continue
            noticed = self._noticed.get(node_id)
            if noticed is None or noticed.session is not session \
                    or noticed.stream.phase is NoticePhase.CLOSED:
                if noticed is not None and noticed.session is session:
                    continue  # refused or failed on this session: not opened again
                noticed = self._open(node_id, session)
                if noticed is None:
                    continue
            elif noticed.sent_at is not None and now - noticed.sent_at < self._due_after \
                    and status == noticed.status:
                continue
            first = noticed.sent_at is None
            if noticed.stream.send(status):
                noticed.sent_at, noticed.status = now, status
                if first:  # its phase: the next one comes 1 to 4 passes later (10 s passes)
                    noticed.sent_at -= int(self._random_fraction() * self._phases) \
                        * self._interval
                self.sent += 1
        # Forget the tunnels that ended or were replaced: bounded by the tunnels held.
        for node_id in [node_id for node_id, noticed in self._noticed.items()
                        if self._registry.session_for(node_id) is not noticed.session]:
            del self._noticed[node_id]

    def _open(self, node_id: str, session) -> _Noticed | None:
        stream = NoticeStream(node_id, self._reactor)
        try:
            self._registry.open_stream(node_id, stream)
        except Exception as e:  # not held any more, or the session takes no new stream
            log.debug("stamp notices to node {node}: no stream ({err})", node=node_id, err=e)
            return None
        self.streams_opened += 1
        noticed = self._noticed[node_id] = _Noticed(session, stream)
        return noticed


# -- the worker's end --------------------------------------------------------------------------


class NoticeReader(Protocol):
    """The worker's end of an accepted ``stamped`` stream: every frame is a notice, handed to
    ``on_notice(status)``.  A malformed frame resets the stream (the replica's notices stop, and
    the worker's HTTP refresh takes over)."""

    def __init__(self, on_notice: Callable[[str], None]):
        self._on_notice = on_notice
        self._buffered = b""

    def dataReceived(self, data: bytes) -> None:
        buffered = self._buffered + data if self._buffered else data
        try:
            while True:
                payload, buffered = preamble.split_frame(buffered)
                if payload is None:
                    break
                self._on_notice(parse_notice(payload))
        except errors.TunnelProtocolError as e:
            log.warn("stamp notice stream reset: {err}", err=e)
            self._buffered = b""
            self.transport.abortConnection()
            return
        self._buffered = buffered

    def connectionLost(self, reason: Failure = None) -> None:
        self._buffered = b""
