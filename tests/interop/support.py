"""Helpers for the yamux interop tests: the Go peer process and the Python-side protocols.

Conventions shared with ``gopeer/main.go``:

* A stream Python opens to Go is echoed by Go only after Go read everything up to our FIN
  (Go's ``Close`` before reading would lose the reply, yamux-wire.md 7.14), so Python writes,
  half-closes (``loseWriteConnection``) and then reads the echo: ``EchoClient``.
* A stream Go opens to Python starts with a 40-byte header (8-byte big-endian payload length,
  32-byte sha256 of the payload).  Python echoes every byte as it arrives, checks the checksum,
  and closes after echoing ``40 + length`` bytes; Go reads to EOF, compares, then closes:
  ``EchoVerifier``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

from twisted.internet import defer, protocol, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.task import deferLater
from zope.interface import implementer

#: pids of Go peers that have not exited yet (the session finalizer kills leftovers)
LIVE_PIDS: set[int] = set()

MiB = 1024 * 1024
KiB = 1024


def sleep(seconds: float) -> defer.Deferred:
    return deferLater(reactor, seconds, lambda: None)


async def eventually(predicate, seconds: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` on the reactor until it is true; fail naming ``what`` after
    ``seconds`` (it is checked once more at the deadline)."""
    from twisted.internet import reactor

    deadline = reactor.seconds() + seconds
    while not predicate():
        if reactor.seconds() >= deadline:
            assert predicate(), f"timed out after {seconds}s waiting for {what}"
            return
        await sleep(interval)


async def within(d, seconds: float, what: str):
    """Await ``d`` (Deferred or coroutine) for at most ``seconds``; a clear error otherwise."""
    d = defer.ensureDeferred(d) if not isinstance(d, defer.Deferred) else d
    try:
        return await d.addTimeout(seconds, reactor)
    except defer.TimeoutError:
        raise AssertionError(f"timed out after {seconds:g}s waiting for {what}") from None


# -- the Go peer process ------------------------------------------------------------------


class GoPeerExited(AssertionError):
    pass


class GoPeer(protocol.ProcessProtocol):
    """One ``gopeer`` process: JSON events from stdout, JSON commands to stdin."""

    def __init__(self, binary: str, args: list[str]):
        self.binary = binary
        self.args = args
        self.events: list[dict] = []
        self.stderr = bytearray()
        self.port: int | None = None
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.ended = defer.Deferred()
        self._buf = b""
        self._waiters: list[tuple] = []

    def __repr__(self):
        return f"<GoPeer pid={self.pid} {' '.join(self.args)}>"

    def spawn(self) -> None:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR", "LANG")}
        env["GOTRACEBACK"] = "all"
        reactor.spawnProcess(self, self.binary, [self.binary, *self.args], env=env,
                             childFDs={0: "w", 1: "r", 2: "r"})
        self.pid = self.transport.pid
        LIVE_PIDS.add(self.pid)

    # -- ProcessProtocol ---------------------------------------------------------------

    def outReceived(self, data: bytes) -> None:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                ev = {"event": "unparsed", "line": line.decode("utf-8", "replace")}
            self.events.append(ev)
            self._check_waiters()

    def errReceived(self, data: bytes) -> None:
        self.stderr += data

    def processEnded(self, reason) -> None:
        LIVE_PIDS.discard(self.pid)
        self.exit_code = getattr(reason.value, "exitCode", None)
        self.exit_signal = getattr(reason.value, "signal", None)
        waiters, self._waiters = self._waiters, []
        for _match, d, what in waiters:
            if not d.called:
                d.errback(GoPeerExited(f"Go peer exited while waiting for {what}\n"
                                       + self.describe()))
        self.ended.callback(self.exit_code)

    # -- events ------------------------------------------------------------------------

    def _check_waiters(self) -> None:
        for entry in list(self._waiters):
            match, d, _what = entry
            ev = match()
            if ev is not None:
                self._waiters.remove(entry)
                if not d.called:
                    d.callback(ev)

    def find(self, name: str, after: int = 0, pred=None, **fields) -> list[dict]:
        out = []
        for ev in self.events[after:]:
            if ev.get("event") != name:
                continue
            if any(ev.get(k) != v for k, v in fields.items()):
                continue
            if pred is not None and not pred(ev):
                continue
            out.append(ev)
        return out

    def wait_event(self, name: str, timeout: float = 10.0, after: int = 0, pred=None,
                   count: int = 1, **fields) -> defer.Deferred:
        """Fires with the ``count``-th matching event (from index ``after``), or fails with the
        peer's recent output after ``timeout`` seconds or when the process exits."""
        what = f"{count}x event {name!r} {fields or ''}"
        state = {"pos": after, "found": 0}

        def match():  # incremental: each event is looked at once per waiter
            events = self.events
            while state["pos"] < len(events):
                ev = events[state["pos"]]
                state["pos"] += 1
                if (ev.get("event") == name
                        and all(ev.get(k) == v for k, v in fields.items())
                        and (pred is None or pred(ev))):
                    state["found"] += 1
                    if state["found"] == count:
                        return ev
            return None

        d = defer.Deferred()
        ev = match()
        if ev is not None:
            d.callback(ev)
            return d
        if self.exit_code is not None or self.exit_signal is not None:
            d.errback(GoPeerExited(f"Go peer already exited; wanted {what}\n" + self.describe()))
            return d
        entry = (match, d, what)
        self._waiters.append(entry)

        def on_timeout():
            if entry in self._waiters:
                self._waiters.remove(entry)
            if not d.called:
                d.errback(AssertionError(f"timed out after {timeout:g}s waiting for {what}\n"
                                         + self.describe()))

        call = reactor.callLater(timeout, on_timeout)
        d.addBoth(lambda r: (call.cancel() if call.active() else None, r)[1])
        return d

    def describe(self, tail: int = 25) -> str:
        lines = [f"{self!r} exit={self.exit_code} signal={self.exit_signal}",
                 f"last {tail} events:"]
        lines += ["  " + json.dumps(ev)[:400] for ev in self.events[-tail:]]
        if self.stderr:
            lines.append("stderr: " + self.stderr.decode("utf-8", "replace")[-3000:])
        return "\n".join(lines)

    # -- commands ----------------------------------------------------------------------

    def send(self, cmd: str, **fields) -> None:
        self.transport.write(json.dumps({"cmd": cmd, **fields}).encode() + b"\n")

    async def stats(self, timeout: float = 5.0) -> dict:
        mark = len(self.events)
        self.send("stats")
        return await self.wait_event("stats", timeout=timeout, after=mark)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    async def stop(self, grace: float = 3.0) -> None:
        """Reap the process: SIGCONT (it may be stopped), close stdin, SIGTERM, then SIGKILL."""
        if self.pid is None or self.ended.called:
            return
        for step in ("CONT", "TERM", "KILL"):
            try:
                if step == "TERM":
                    self.transport.closeStdin()
                self.transport.signalProcess(step)
            except Exception:  # ProcessExitedAlready and friends
                pass
            if step == "CONT":
                continue
            waiter = defer.Deferred()
            self.ended.addBoth(lambda r, w=waiter: (w.called or w.callback(None), r)[1])
            try:
                await waiter.addTimeout(grace, reactor)
                return
            except defer.TimeoutError:
                continue


# -- Python-side stream protocols -----------------------------------------------------------


@implementer(IHalfCloseableProtocol)
class EchoClient(protocol.Protocol):
    """Opened by Python against Go's echo: writes ``payload``, half-closes, reads the echo.

    ``done`` fires with ``self`` on ``connectionLost``; ``eof`` fires on ``readConnectionLost``.
    With ``autostart=False`` nothing is written on connect: the test writes ``payload``.
    """

    def __init__(self, payload: bytes, half_close: bool = True, keep: bool = False,
                 autostart: bool = True):
        self.payload = payload
        self.autostart = autostart
        self.half_close = half_close
        self.keep = keep
        self.received = 0
        self.data = bytearray()
        self._sha = hashlib.sha256()
        self.read_eof = False
        self.write_lost = False
        self.reason = None
        self.done = defer.Deferred()
        self.eof = defer.Deferred()

    def connectionMade(self):
        if not self.autostart:
            return  # the test writes ``payload`` itself
        if self.payload:
            self.transport.write(self.payload)
        if self.half_close:
            self.transport.loseWriteConnection()

    def dataReceived(self, data):
        self.received += len(data)
        self._sha.update(data)
        if self.keep:
            self.data += data

    def readConnectionLost(self):
        self.read_eof = True
        if not self.eof.called:
            self.eof.callback(self)

    def writeConnectionLost(self):
        self.write_lost = True

    def connectionLost(self, reason):
        self.reason = reason
        if not self.eof.called:
            self.eof.callback(self)
        if not self.done.called:
            self.done.callback(self)

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def echo_ok(self) -> bool:
        return (self.received == len(self.payload)
                and self.sha256 == hashlib.sha256(self.payload).hexdigest())


class EchoVerifier(protocol.Protocol):
    """Accepts a Go-opened stream: echoes as it arrives, checks header length + sha256, closes
    after echoing ``40 + length`` bytes."""

    HEADER = struct.Struct(">Q32s")

    def __init__(self, registry: list | None = None):
        self.registry = registry
        self.received = 0
        self.header = b""
        self.length: int | None = None
        self.expected: bytes | None = None
        self._sha = hashlib.sha256()
        self.checksum_ok: bool | None = None
        self.reason = None
        self.done = defer.Deferred()
        if registry is not None:
            registry.append(self)

    def dataReceived(self, data):
        self.transport.write(data)
        self.received += len(data)
        if self.length is None:
            self.header += data
            if len(self.header) < 40:
                return
            self.length, self.expected = self.HEADER.unpack(self.header[:40])
            data = self.header[40:]
        self._sha.update(data)
        if self.received >= 40 + self.length and self.checksum_ok is None:
            self.checksum_ok = (self.received == 40 + self.length
                                and self._sha.digest() == self.expected)
            self.transport.loseConnection()

    def connectionLost(self, reason):
        self.reason = reason
        if not self.done.called:
            self.done.callback(self)


class PausedSink(protocol.Protocol):
    """Accepts a stream and pauses it at once; counts what reaches the protocol."""

    def __init__(self):
        self.received = 0
        self._sha = hashlib.sha256()
        self.reason = None
        self.made = defer.Deferred()
        self.done = defer.Deferred()

    def connectionMade(self):
        self.transport.pauseProducing()
        self.made.callback(self)

    def dataReceived(self, data):
        self.received += len(data)
        self._sha.update(data)

    def connectionLost(self, reason):
        self.reason = reason
        if not self.done.called:
            self.done.callback(self)

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


# -- carrying the session -------------------------------------------------------------------


async def connect_tcp(port: int, session) -> object:
    """Connect ``session`` (a Protocol) to 127.0.0.1:port."""
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5), session)
    return session


class OneSessionFactory(protocol.Factory):
    """Listening side for one inbound connection; ``session`` fires once it is connected."""

    def __init__(self, make_session):
        self.make_session = make_session
        self.session = defer.Deferred()
        self.built = []

    def buildProtocol(self, addr):
        session = self.make_session()
        self.built.append(session)
        if not self.session.called:
            # after makeConnection, which Twisted calls right after buildProtocol returns
            reactor.callLater(0, self.session.callback, session)
        return session


def listen_tcp(make_session):
    factory = OneSessionFactory(make_session)
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")
    return port, factory
