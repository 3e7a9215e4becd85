"""The bounded listener of a frontend replica: a ``twisted.web`` site whose requests are decided
when their headers end, whose connections have total deadlines, and whose counts of connections
and body bytes are capped.

- :class:`BoundedSite` / :class:`BoundedRequest`: a request with a body is decided when its
  headers end: the *header guard* of its path (authentication), its size cap (64 KiB unless a
  path prefix was given more; ``413``), the listener's budget of body bytes in flight
  (``503``).  A refusal is answered at once and the connection closed, before a body byte is
  read; an accepted body is still capped *while it arrives*.  Nothing beyond a cap is ever
  buffered, in memory or on disk.  (``twisted.web`` would otherwise read any body into a
  temporary file before the resource sees the request.)
- :class:`BoundedChannel`: total deadlines for a request's head and body (``408``), where
  ``twisted.web`` only has an idle timer that every byte restarts; and a cap on a listener's
  concurrent connections, beyond which a small reserve serves only the load balancer's probes.
  Defaults: :data:`MAX_CONNECTIONS`, :data:`PROBE_RESERVE`, :data:`MAX_BODY_BYTES_IN_FLIGHT`,
  :data:`MAX_BODY_BYTES_PER_SOURCE`, :data:`NODE_BODY_RESERVE`,
  :data:`BODY_FIRST_BYTE_DEADLINE_SECONDS`,
  :data:`HEADERS_DEADLINE_SECONDS`, :data:`BODY_DEADLINE_SECONDS` (``docs/operators.md``,
  "Limits").
- :meth:`BoundedSite.hold_connection`: a connection an API vouches for (a worker's kept-alive
  heartbeat connection, one per node) leaves the cap, as authorized tunnels do.  The listener
  knows no API: the API is handed this method when the replica is built.

One module, though over 700 lines, because it is one state machine: the site's counters (open,
held, reserve, refusing, undecided connections; body bytes in flight) are changed by the
request, the channel and the connection wrapper, and each decision reads all of them.  Apart,
the counting rule would be spread over four files.

This module must never buffer an unbounded body, never read a body byte of a request it
refused, never let a client hold a connection by trickling bytes, and never put a traceback or
an internal exception text into a response.  It imports only the base and ``web``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections import deque
from typing import Any, Callable, Iterable, Mapping

from twisted.logger import Logger, LogLevel
from twisted.protocols.policies import ProtocolWrapper
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.http import HTTPChannel, combinedLogFormatter, unquote

from localai_tw.logs import RateLimitedLog
from localai_tw.web.accesslog import AccessLog, combined_line
from localai_tw.web.bodies import (
    CappedBody,
    SpooledCappedBody,
    answer_early,
    pending_request_line,
)
from localai_tw.web.errors import (
    APIError,
    bad_request,
    bodies_busy,
    error_body,
    request_timeout,
    too_large,
    too_many_connections,
    too_many_connections_from_source,
)
from localai_tw.web.json import json_body
from localai_tw.web.sockets import set_no_delay

log = Logger()

#: Body cap of the register, heartbeat and admin APIs (and of any path without its own cap).
MAX_BODY_BYTES = 64 * 1024
#: Most connections one listener holds at once that are not authorized tunnels or peer links;
#: beyond it a connection may only use the probe reserve.
MAX_CONNECTIONS = 1024
#: Most of :data:`MAX_CONNECTIONS` one source (:func:`source_key`) holds at once.  A new
#: connection from a source at its share closes that source's oldest connection still sending
#: its head (or idle between requests), or is answered 503 when all of them are busy.  Behind a
#: proxy every client shares the proxy's address: raise it there.
MAX_CONNECTIONS_PER_SOURCE = 256
#: Connections a listener serves beyond :data:`MAX_CONNECTIONS` for the load balancer's probes
#: only (one ``GET``/``HEAD`` of :data:`PROBE_PATHS` without a body each), and connections
#: beyond it that wait for their first line (a newer one closes the oldest); anything else
#: beyond the cap is answered 503 at once (:class:`BoundedSite`).
PROBE_RESERVE = 64
#: Connections beyond the cap being answered 503 ``too_many_connections`` at once (each lives
#: until its answer is written); one more is closed as soon as it is accepted.
MAX_REFUSING_CONNECTIONS = 256
#: Seconds a connection on the probe reserve has to send its request head (a load balancer's
#: probe sends it at once).
PROBE_RESERVE_HEADERS_DEADLINE_SECONDS = 5.0
#: The only paths served on the probe reserve (exact request targets, no query).
PROBE_PATHS = (b"/healthz", b"/readyz")
#: Most bytes of request bodies one listener holds at once (announced lengths); a request that
#: would pass it is answered 503 with ``Retry-After`` before its body is read.
MAX_BODY_BYTES_IN_FLIGHT = 256 * 1024 * 1024
#: Most of :data:`MAX_BODY_BYTES_IN_FLIGHT` one source (an IPv4 address, an IPv6 /64) holds
#: at once: one client announcing big bodies on many connections cannot take the whole budget.
MAX_BODY_BYTES_PER_SOURCE = 64 * 1024 * 1024
#: Bytes of :data:`MAX_BODY_BYTES_IN_FLIGHT` only the workers' API (``/api/node/``: register,
#: heartbeats, 64 KiB each) may use, so a flood of other bodies never starves a heartbeat.
NODE_BODY_RESERVE = 16 * 1024 * 1024
#: The path prefix whose bodies may use :data:`NODE_BODY_RESERVE`.
NODE_PATH_SEGMENT = b"node"
#: Seconds a client has, once its head announced a body, to send the body's first byte: a
#: reservation nobody fills is given back early (the whole body still has
#: :data:`BODY_DEADLINE_SECONDS`).
BODY_FIRST_BYTE_DEADLINE_SECONDS = 10.0
#: Seconds a client has to send a whole request head (request line and headers).
HEADERS_DEADLINE_SECONDS = 30.0
#: Seconds a client has to send a whole request body, counted from the end of its head.
BODY_DEADLINE_SECONDS = 120.0


def source_key(address) -> str:
    """The source a per-client limit counts: an IPv4 address, an IPv6 address's /64 (one host
    usually holds a whole /64, so counting single IPv6 addresses would limit nothing), the
    text of anything else (a UNIX socket: one source)."""
    host = str(getattr(address, "host", address))
    if ":" in host:
        try:
            network = ipaddress.IPv6Network(f"{host.split('%', 1)[0]}/64", strict=False)
        except ValueError:
            return host
        mapped = ipaddress.IPv6Address(host.split('%', 1)[0]).ipv4_mapped
        return str(mapped) if mapped is not None else str(network)
    return host


def _segments_of(target: bytes) -> tuple[bytes, ...]:
    """The path segments of ``target`` exactly as ``twisted.web`` will route them
    (``Request.process``: query dropped, split on ``/``, each segment percent-decoded), so a
    header guard cannot be sidestepped by spelling ``/v1`` as ``/%761``."""
    path = target.split(b"?", 1)[0]
    return tuple(unquote(segment) for segment in path[1:].split(b"/"))


def _unsafe(text: bytes) -> str | None:
    if b"\x00" in text:
        return "a NUL byte (%00)"
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes that are not UTF-8"
    return None


def unsafe_target(target: bytes) -> APIError | None:
    """A 400 naming the part of ``target`` (a request target) that holds, once
    percent-decoded, a NUL byte or bytes that are not UTF-8, or None.  No path segment or query
    parameter of any route may: file names, node ids, model names and database text all refuse
    them, further in, with a 500 and a traceback."""
    path, _, query = target.partition(b"?")
    for segment in path.split(b"/"):
        what = _unsafe(unquote(segment))
        if what is not None:
            return bad_request(f"the request path holds {what}, which no name here can "
                               "contain; percent-encode only UTF-8 text without NUL")
    for pair in query.split(b"&") if query else ():
        name, _, value = pair.partition(b"=")
        for part in (name, value):
            what = _unsafe(unquote(part.replace(b"+", b" ")))
            if what is not None:
                return bad_request(f"the query parameter {printable_name(name)!r} holds "
                                   f"{what}; percent-encode only UTF-8 text without NUL")
    return None


def printable_name(raw: bytes, limit: int = 32) -> str:
    text = unquote(raw).decode("utf-8", "replace")[:limit]
    return "".join(c if c.isprintable() and c != "\ufffd" else "?" for c in text)


def may_log_failure(request) -> bool:
    """Whether the traceback of ``request``'s failure may be logged: the first few of each
    client address per window (``BoundedSite.failure_log``, which logs a summary of the rest)."""
    limiter = getattr(getattr(request, "site", None), "failure_log", None)
    return limiter is None or limiter.allow(_client_host(request))


def _as_early_answer(refusal: Exception):
    """``refusal`` if it can be written as an answer (``status``, ``body()``, ``headers``:
    :class:`APIError` and the OpenAI API's errors), else a 500 (the cause goes to the log)."""
    status = getattr(refusal, "status", None)
    if isinstance(status, int) and callable(getattr(refusal, "body", None)):
        return refusal
    log.failure("a check before the request body failed; answering 500", Failure(refusal))
    return APIError(500, "internal error; see the frontend log", "internal_error")


class BoundedRequest(server.Request):
    """A request decided when its headers end (see :class:`BoundedSite`), whose body is then
    capped while it arrives.

    Bodies are never parsed as forms into ``args`` (no API here takes forms).
    """

    #: Set once the request was answered before its body; nothing else is processed.
    answered_before_body = False

    def __init__(self, channel, *args, **kwargs):
        kwargs["parsePOSTFormSubmission"] = False
        super().__init__(channel, *args, **kwargs)

    def gotLength(self, length):
        """The headers have ended (``length``: the announced body size, None when chunked).

        Before a body byte is read: the header guard of the path (authentication), the size cap
        (413), then the listener's budget of body bytes in flight (503).  A request without a
        body goes on to its resource, which decides as before (nothing to protect).
        """
        site = getattr(self.channel, "site", None)
        site = site if isinstance(site, BoundedSite) else None
        line = pending_request_line(self.channel)
        target = line[1] if line is not None else None
        self._early_target = target
        limit = site.body_limit_for(target) if site is not None else MAX_BODY_BYTES
        if length == 0 or site is None or not site.spools(target):
            self.content = CappedBody(limit)
        else:  # an upload: refused below before a byte is written, else kept on disk
            self.content = SpooledCappedBody(limit)
        if length == 0:
            return
        if getattr(self.channel, "on_probe_reserve", False):
            # A probe has no body: one announced on the reserve is not a probe.
            limit_of = site.max_connections if site is not None else MAX_CONNECTIONS
            self.answer_before_body(too_many_connections(limit_of))
            return
        try:
            if site is not None:
                site.check_host(self, target)
                site.guard_before_body(self, target)
            if length is not None and length > limit:
                raise too_large(limit)
            if site is not None:
                release = site.reserve_body_bytes(limit if length is None else length,
                                                  source_key(self.getClientAddress()), target)
                self.notifyFinish().addBoth(lambda _: release())
        except Exception as refusal:
            self.answer_before_body(_as_early_answer(refusal))

    def handleContentChunk(self, data):
        if self.answered_before_body:
            return
        if not self.content.accepts(len(data)):
            self.answer_before_body(too_large(self.content.limit))
            return
        self.content.write(data)

    def requestReceived(self, command, path, version):
        if self.answered_before_body:
            return  # already answered; the connection is closing
        super().requestReceived(command, path, version)

    def process(self):
        """A target with a NUL or non-UTF-8 byte in a path segment or query parameter is a 400
        (:func:`unsafe_target`), and a ``Host`` the site's :attr:`BoundedSite.host_check`
        refuses a 403, before any resource sees the request."""
        site = getattr(self.channel, "site", None)
        refusal = unsafe_target(self.uri or b"")
        if refusal is None and isinstance(site, BoundedSite):
            try:
                site.check_host(self, self.uri)
            except APIError as wrong_host:
                refusal = wrong_host
        if refusal is None:
            return super().process()
        self.site = site
        if isinstance(site, BoundedSite):
            refusal = site.shape_early_answer(self.uri, refusal)
        self.write(json_body(self, refusal.status, refusal.body(), refusal.headers))
        self.finish()

    def processingFailed(self, reason):
        """A resource failed: 500 with a generic JSON body; the traceback is logged, at most a
        burst of them per client (:func:`may_log_failure`): a client that can make a resource
        fail must not be able to fill the log."""
        if may_log_failure(self):
            log.failure("{method} {path} failed", reason,
                        method=(self.method or b"?").decode("ascii", "replace"),
                        path=printable_name((self.path or b"")[:200], 200))
        if not self.finished and self.channel is not None:
            self.write(json_body(self, 500, error_body("internal error; see the frontend log",
                                                       "internal_error")))
            self.finish()
        return reason

    def answer_before_body(self, answer) -> None:
        """Answer ``answer`` (an :class:`APIError`-like refusal) on the raw transport before the
        (rest of the) body, then stop reading and close."""
        if self.answered_before_body:
            return
        self.answered_before_body = True
        self.content.close()
        # The channel answers "Expect: 100-continue" right after gotLength; after a final
        # answer that would be a second response.
        self.requestHeaders.removeHeader(b"expect")
        site = getattr(self.channel, "site", None)
        if isinstance(site, BoundedSite):
            answer = site.shape_early_answer(getattr(self, "_early_target", None), answer)
            # Answered outside twisted.web's response machinery, which would never log it: a
            # worker with a wrong registration token must leave a line here too.
            site.log_early_answer(self, answer.status, _message_of(answer))
        if self.channel is not None:
            answer_early(self.channel, answer.status, answer.body(), answer.headers)


def is_probe_request_line(line: bytes) -> bool:
    """Whether ``line`` (a request line) asks ``GET`` or ``HEAD`` of one of
    :data:`PROBE_PATHS`, spelled exactly (no query, no percent-encoding: anything else is not
    a probe, which fails closed)."""
    parts = line.split(b" ")
    return (len(parts) == 3 and parts[0] in (b"GET", b"HEAD") and parts[1] in PROBE_PATHS
            and parts[2] in (b"HTTP/1.1", b"HTTP/1.0"))


class BoundedChannel(HTTPChannel):
    """An HTTP/1.1 connection whose request head and body each have a total deadline.

    ``twisted.web``'s own timer is an *idle* timer, restarted by every byte: a client sending
    one byte a second holds the connection (and its buffers) for ever.  Here the head of each
    request must be complete within ``site.headers_deadline`` seconds (counted from the opening
    of the connection for the first request, from its first byte for the next ones; the wait
    between requests stays under the idle timer), and its body within ``site.body_deadline``
    seconds of the head.  A late request is answered 408 and the connection closed.  The
    deadlines stop when the body is complete: answering may take as long as it takes.
    """

    _deadline = None
    _between_requests = False
    #: depth of ``dataReceived`` calls in progress; while > 0, a deadline started is only
    #: written down (``_wanted``) and armed when the read ends, if still wanted: a request that
    #: arrives whole in one read starts and stops its three deadlines without a timer
    _reading = 0
    #: the deadlines started during this read, not armed yet: {"deadline" or "first_byte":
    #: (what, seconds)}
    _wanted = None
    #: True when the listener accepted this connection beyond its cap, for a probe (or not
    #: known yet): one request, which must be a probe (:func:`is_probe_request_line`) without
    #: a body.
    on_probe_reserve = False
    _first_line_seen = False

    #: True while the connection waits for (the rest of) a request head, or idles between
    #: requests: nothing of a request is in progress, so it may be closed to make room
    #: (:meth:`BoundedSite.buildProtocol`).
    awaiting_head = True

    def connectionMade(self):
        super().connectionMade()
        self._start_deadline("head")

    def lineReceived(self, line):
        if self.on_probe_reserve and not self._first_line_seen:
            self._first_line_seen = True
            site = getattr(self, "site", None)
            probe = is_probe_request_line(line)
            if isinstance(site, BoundedSite):
                probe = site.first_line_arrived(self.transport, probe)
            if not probe:
                self.refuse_beyond_the_cap(line)
                return
        super().lineReceived(line)

    def refuse_beyond_the_cap(self, line: bytes | None, answer: Any = None) -> None:
        """Answer 503 ``too_many_connections`` (or ``answer``) before the rest of the request
        (no request is created, no header parsed), and ignore whatever follows while the
        connection closes."""
        self._cancel_deadline()
        site = getattr(self, "site", None)
        limit = getattr(site, "max_connections", MAX_CONNECTIONS)
        refused_on_reserve = answer is None
        answer = too_many_connections(limit) if answer is None else answer
        self._first_line_seen = True
        parts = (line or b"").split(b" ")
        if isinstance(site, BoundedSite):
            if refused_on_reserve:
                site.refused_on_reserve.note(limit=limit)
            if len(parts) == 3:  # the OpenAI API's paths answer in its own error shape
                answer = site.shape_early_answer(parts[1], answer)
        self.lineReceived = self.rawDataReceived = lambda _data: None  # type: ignore
        answer_early(self, answer.status, answer.body(), answer.headers)

    def checkPersistence(self, request, version):
        if self.on_probe_reserve:  # one probe per reserve connection, then its slot is free
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return super().checkPersistence(request, version)

    def dataReceived(self, data):
        self._reading += 1
        try:
            if self._between_requests:  # the first byte of the next request
                self._between_requests = False
                self._start_deadline("head")
            super().dataReceived(data)
        finally:
            self._reading -= 1
            if not self._reading and self._wanted:
                self._arm_wanted()

    def _arm_wanted(self) -> None:
        """Arm the deadlines this read started and did not stop (counted from the read's end:
        a read takes microseconds, a deadline seconds)."""
        wanted, self._wanted = self._wanted, None
        for key, (what, seconds) in wanted.items():
            self._arm(key, what, seconds)

    def _arm(self, key: str, what: str, seconds: float) -> None:
        """Set ``self._<key>`` (``_deadline`` or ``_first_byte``) to a timer of ``seconds``;
        during a read, only write it down (``_wanted``) for the read's end."""
        if self._reading:
            if self._wanted is None:
                self._wanted = {}
            self._wanted[key] = (what, seconds)
            return
        setattr(self, "_" + key, self.callLater(seconds, self._deadline_passed, what, seconds))

    def allHeadersReceived(self):
        self.awaiting_head = False
        self._cancel_deadline()
        super().allHeadersReceived()
        request = self.requests[-1] if self.requests else None
        if self.length != 0 and request is not None and not request.answered_before_body:
            self._start_deadline("body")  # cancelled in allContentReceived
            self._start_first_byte_deadline()

    def rawDataReceived(self, data):
        if data:
            self._cancel_first_byte_deadline()
        super().rawDataReceived(data)

    def allContentReceived(self):
        self._cancel_deadline()
        self._cancel_first_byte_deadline()
        super().allContentReceived()

    _first_byte = None

    def _start_first_byte_deadline(self) -> None:
        """A body's reservation (:meth:`BoundedSite.reserve_body_bytes`) is given back early
        when not one byte of the body arrives within ``site.body_first_byte_deadline``: a
        client announcing big bodies and sending nothing holds the budget for seconds, not
        for the whole body deadline."""
        seconds = getattr(getattr(self, "site", None), "body_first_byte_deadline", None)
        if seconds is not None and (self.transport is not None):
            self._arm("first_byte", "body's first byte", seconds)

    def _unwant(self, key: str) -> None:
        if self._wanted:
            self._wanted.pop(key, None)

    def _cancel_first_byte_deadline(self) -> None:
        self._unwant("first_byte")
        timer, self._first_byte = self._first_byte, None
        if timer is not None and timer.active():
            timer.cancel()

    def requestDone(self, request):
        self._between_requests = True  # before the channel replays pipelined bytes
        self.awaiting_head = True
        super().requestDone(request)

    def connectionLost(self, reason):
        self._cancel_deadline()
        self._cancel_first_byte_deadline()
        super().connectionLost(reason)

    def _start_deadline(self, what: str) -> None:
        self._cancel_deadline()
        site = getattr(self, "site", None)
        seconds = (getattr(site, "headers_deadline", HEADERS_DEADLINE_SECONDS) if what == "head"
                   else getattr(site, "body_deadline", BODY_DEADLINE_SECONDS))
        if self.on_probe_reserve and what == "head":
            reserve = getattr(site, "probe_reserve_headers_deadline",
                              PROBE_RESERVE_HEADERS_DEADLINE_SECONDS)
            seconds = reserve if seconds is None else min(seconds, reserve)
        if seconds is not None:
            self._arm("deadline", what, seconds)

    def _cancel_deadline(self) -> None:
        self._unwant("deadline")
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _deadline_passed(self, what: str, seconds: float) -> None:
        self._cancel_deadline()
        self._cancel_first_byte_deadline()
        if self.transport is None:
            return  # the connection was handed over (a WebSocket) or is gone
        site = getattr(self, "site", None)
        if isinstance(site, BoundedSite):
            site.late_requests.note(what=what, seconds=seconds)
        answer = request_timeout(what, seconds)
        request = self.requests[-1] if self.requests else None
        if isinstance(request, BoundedRequest) and what != "head":
            request.answer_before_body(answer)
        else:
            if isinstance(request, BoundedRequest):
                request.answered_before_body = True
            answer_early(self, answer.status, answer.body(), answer.headers)
        # A client that does not read even the answer is dropped (as twisted.web does after
        # its idle timeout).
        if self.abortTimeout is not None and self._abortingCall is None:
            self._abortingCall = self.callLater(self.abortTimeout, self.forceAbortClient)


#: Bytes of a connection's first line looked at (without consuming them) when it is accepted
#: beyond the cap: a probe's request line is shorter.
_PEEK_BYTES = 64


def waiting_request_line(transport) -> bytes | None:
    """The first line the client already sent on ``transport``'s socket, looked at with
    ``MSG_PEEK`` (nothing is consumed: the channel reads it as usual), or None when it cannot
    be told yet: nothing arrived, part of a short line, a TLS transport (its socket carries
    ciphertext) or one without a socket.  A first line longer than :data:`_PEEK_BYTES` is
    returned cut (it is no probe)."""
    get_handle = getattr(transport, "getHandle", None)
    try:
        handle = get_handle() if get_handle is not None else None
        if not isinstance(handle, socket.socket):
            return None
        data = handle.recv(_PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # nothing arrived yet (EAGAIN), or the socket is already gone
        return None
    end = data.find(b"\r\n")
    if end >= 0:
        return data[:end]
    return data if len(data) >= _PEEK_BYTES else None


def _listener_connection_of(request) -> "_ListenerConnection | None":
    """The counting wrapper under ``request``'s HTTP channel (over TLS, under the TLS
    protocol too), or None."""
    transport = getattr(getattr(request, "channel", None), "transport", None)
    for _ in range(3):
        if transport is None or isinstance(transport, _ListenerConnection):
            return transport
        transport = getattr(transport, "transport", None)
    return None


class _ListenerConnection(ProtocolWrapper):
    """One accepted connection, counted by its site from its opening to its closing.

    A wrapper rather than a count kept by the HTTP channel: a tunnel or peer dial that becomes
    a WebSocket replaces the channel (``tunnel.websocket`` swaps this wrapper's
    ``wrappedProtocol``), and the connection must stay counted until the socket closes.

    Every accepted socket gets ``TCP_NODELAY`` (``tunnel/sockets.py``): streamed tokens leave
    here as small writes, to API clients, to relaying replicas and, over a worker's tunnel, as
    yamux frames.

    A connection accepted beyond the cap is decided in :meth:`makeConnection`, before it is
    counted (see :class:`BoundedSite`).
    """

    #: What the site counts it as: ``"open"`` (nobody vouched for it yet), ``"undecided"``
    #: (beyond the cap, its first line not arrived yet), ``"reserve"`` (a probe, on the probe
    #: reserve), ``"refusing"`` (beyond the cap, being answered 503), ``"held"`` (an
    #: authorized tunnel or peer link), or None (not counted: closed at accept or evicted).
    kind: str | None = "open"
    #: Accepted beyond the cap: :meth:`makeConnection` decides its kind.
    over_cap = False
    #: The key an API holds this connection for (:meth:`BoundedSite.hold_connection`).
    held_for: str | None = None
    #: Its source (:func:`source_key`), set when it is built.
    source: str | None = None
    #: Its source held its share of connections, none of them awaiting a head: refused.
    source_full = False

    @property
    def held(self) -> bool:
        return self.kind == "held"

    @property
    def on_probe_reserve(self) -> bool:
        return self.kind in ("reserve", "undecided")

    def makeConnection(self, transport) -> None:
        set_no_delay(transport)
        if not self.over_cap:
            super().makeConnection(transport)
            return
        line = waiting_request_line(transport)
        if self.source_full:
            self.factory.refused_sources.note(limit=self.factory.max_connections_per_source)
            room = self.factory.refusing_connections < self.factory.max_refusing_connections
            self.kind = "refusing" if room else None
            self.wrappedProtocol.on_probe_reserve = False
            super().makeConnection(transport)
            if room:
                self.wrappedProtocol.refuse_beyond_the_cap(
                    line, too_many_connections_from_source(
                        self.factory.max_connections_per_source))
            else:
                transport.abortConnection()
            return
        action = self.factory.decide_over_cap(line)
        self.kind = None if action == "close" else action
        self.wrappedProtocol.on_probe_reserve = action in ("reserve", "undecided")
        super().makeConnection(transport)
        if action == "undecided":
            self.factory.undecided.append(self)
        if action == "close":
            transport.abortConnection()
        elif action == "refusing":
            self.wrappedProtocol.refuse_beyond_the_cap(line)

    def authorized(self) -> None:
        """``tunnel.websocket`` calls this when it upgrades the connection for a caller it
        authorized (a worker's tunnel, a peer link): from then on it counts against the
        site's held connections, not against the cap on connections nobody vouched for."""
        if self.kind != "held":
            self.factory.connection_held(self)
            self.kind = "held"


class EventsPerInterval:
    """One log line per ``interval`` seconds at most for a repeated event (the first at once,
    later ones counted into the next line), so an attack cannot flood the log."""

    def __init__(self, clock, message: str, interval: float = 60.0):
        self._clock = clock
        self._message = message
        self._interval = interval
        self._last: float | None = None
        self._count = 0

    def note(self, **fields) -> None:
        self._count += 1
        now = self._clock.seconds()
        if self._last is not None and now - self._last < self._interval:
            return
        log.warn(self._message, count=self._count, **fields)
        self._last, self._count = now, 0


#: ``--access-log``: which requests get an access line (:meth:`BoundedSite.log`).
ACCESS_LOG_CHOICES = ("all", "errors", "off")


def _message_of(answer) -> str:
    """The message of a refusal's JSON body (our own words, never the client's), or ""."""
    try:
        body = answer.body()
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    except Exception:
        return ""
    return message if isinstance(message, str) else ""


def _client_host(request) -> str:
    """The source a request came from (:func:`source_key`: an IPv6 client's /64, so a client
    cannot dodge the per-source log limits by changing addresses inside its network)."""
    return source_key(request.getClientAddress())


class BoundedSite(server.Site):
    """The frontend's ``Site``: requests are :class:`BoundedRequest`, connections
    :class:`BoundedChannel`, and the listener serving it is bounded:

    - at most ``max_connections`` connections at once that nobody vouched for (HTTP requests,
      dials being authorized).  A connection upgraded for an authorized tunnel or peer link,
      and the kept-alive connection that carries a known node's heartbeats (one per node),
      leave that count (``held_connections``): a replica holds thousands of workers;
    - beyond the cap, a connection is decided on its first line, looked at in the socket when
      it is accepted (``MSG_PEEK``, nothing consumed; :func:`waiting_request_line`), before it
      is counted: a reconnect storm that fills the cap must not make a serving replica look
      down.  A load balancer's probe (``GET``/``HEAD /healthz`` or ``/readyz``, exactly) goes
      to the *probe reserve* (``probe_reserve`` connections, ``reserve_connections``): one
      request, served if it has no body, then the connection closes.  Any other first line is
      answered 503 ``too_many_connections`` with ``Retry-After`` at once, before its headers
      are read (at most ``max_refusing_connections`` such answers being written).  A
      connection whose first line has not arrived waits for it (``undecided_connections``,
      at most ``probe_reserve``: a newer one closes the one that waited longest, since a
      probe sends its line at once and an empty connection must not crowd it out), then is
      decided the same way; its head must arrive within ``probe_reserve_headers_deadline``.
      A connection that finds its part full is closed at once.  So beyond the cap a prober
      holds at most ``2 * probe_reserve`` file descriptors and request heads (``twisted.web``
      caps a head at 16 KiB), for seconds at most, plus answers being written;
    - at most ``max_body_bytes_in_flight`` bytes of request bodies held at once (announced
      lengths, reserved when the headers end and released when the request ends, or when the
      body's first byte does not come within ``body_first_byte_deadline``), at most
      ``max_body_bytes_per_source`` of them by one source (:func:`source_key`), the last
      ``node_body_reserve`` only for ``/api/node/``; a request that would pass one of them is
      answered 503 with ``Retry-After`` before its body is read;
    - a request with a body is first put to the *header guard* of its path: authentication is
      decided when the headers end, and a refused request never has a byte of its body read;
    - deadlines for each request's head and body (:class:`BoundedChannel`).

    Refusals are logged at most once a minute per kind, with a count.  Access lines of
    requests answered with a 4xx or 5xx status are rate-limited per client address
    (:attr:`refused_access`): a prober's thousands of refused requests make a few lines and a
    summary, not a line each.  ``access_log`` (``--access-log``) narrows the access log to
    failed requests (``errors``) or turns it off (``off``).

    :param body_limits: raw path prefix -> body cap in bytes, for routes that take more than
        :data:`MAX_BODY_BYTES` (the longest matching prefix wins).  A prefix ending in ``/``
        covers what follows it; any other covers that path and the paths below it
        (``b"/completions"``: ``/completions`` and ``/completions/x``, not
        ``/completionsx``, which an unauthenticated client could otherwise use to have 8 MiB
        read on a path no header guard covers).
    :param default_limit: the cap of every other path.
    :param spool_prefixes: raw path prefixes whose bodies (uploads) are kept in a temporary
        file instead of memory, still capped by ``body_limits`` while they arrive.
    :param header_guards: path prefix (``b"/v1"``, matched by whole segments, as routed) ->
        ``guard(request)``, which sees only the headers and raises an :class:`APIError`-like
        refusal (``status``, ``body()``, ``headers``) to refuse.  The longest prefix wins.
        Resources check again when they answer: the guard only moves the refusal earlier.

    A refusal answered before the body (413, 503, a guard's) is an :class:`APIError` unless the
    path has an *early answer shape* (:meth:`add_early_answer_shape`): the OpenAI API's paths
    answer its error shape there too.
    """

    noisy = False  # no "Starting/Stopping factory" line

    requestFactory = BoundedRequest
    protocol = BoundedChannel

    def __init__(self, resource, *, body_limits: Mapping[bytes, int] | None = None,
                 default_limit: int = MAX_BODY_BYTES,
                 spool_prefixes: Iterable[bytes] = (),
                 header_guards: Mapping[bytes, Callable[[Any], None]] | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 max_connections_per_source: int = MAX_CONNECTIONS_PER_SOURCE,
                 probe_reserve: int = PROBE_RESERVE,
                 max_refusing_connections: int = MAX_REFUSING_CONNECTIONS,
                 probe_reserve_headers_deadline: float = PROBE_RESERVE_HEADERS_DEADLINE_SECONDS,
                 max_body_bytes_in_flight: int = MAX_BODY_BYTES_IN_FLIGHT,
                 max_body_bytes_per_source: int = MAX_BODY_BYTES_PER_SOURCE,
                 node_body_reserve: int = NODE_BODY_RESERVE,
                 body_first_byte_deadline: float | None = BODY_FIRST_BYTE_DEADLINE_SECONDS,
                 headers_deadline: float | None = HEADERS_DEADLINE_SECONDS,
                 body_deadline: float | None = BODY_DEADLINE_SECONDS,
                 access_log: str = "all", host_check: Any = None,
                 quiet_on_success: Callable[[bytes], bool] | None = None, **kwargs):
        super().__init__(resource, **kwargs)
        #: Paths whose successful requests get no access line (``quiet_on_success(path)``:
        #: the replica's worker heartbeats, one per worker every 10 s).
        self.quiet_on_success = quiet_on_success
        if access_log not in ACCESS_LOG_CHOICES:
            raise ValueError(f"access_log must be one of {ACCESS_LOG_CHOICES}: {access_log!r}")
        #: ``all``, ``errors`` (status >= 400 only) or ``off`` (``--access-log``).
        self.access_log = access_log
        #: Access lines written in batches straight to the text log (:meth:`write_access_lines_to`),
        #: or None: each line through ``twisted.web``'s log file (a log event).
        self.access_lines: AccessLog | None = None
        #: ``web.hosts.HostCheck`` while the API is open (no key), else None.
        self.host_check = host_check
        self.header_guards: list[tuple[tuple[bytes, ...], Callable[[Any], None]]] = []
        self.early_answer_shapes: list[tuple[tuple[bytes, ...], Callable[[Any], Any]]] = []
        for prefix, guard in (header_guards or {}).items():
            self.add_header_guard(prefix, guard)
        self.max_connections = max_connections
        #: Connections not (yet) vouched for: HTTP requests, dials still being authorized.
        self.open_connections = 0
        self.max_connections_per_source = max_connections_per_source
        #: source (:func:`source_key`) -> its open connections, oldest first.
        self.open_of_source: dict[str, deque] = {}
        self.probe_reserve = probe_reserve
        self.probe_reserve_headers_deadline = probe_reserve_headers_deadline
        #: Connections accepted beyond ``max_connections``, for the probes only.
        self.reserve_connections = 0
        #: Connections accepted beyond ``max_connections`` being answered 503 (at most
        #: ``max_refusing_connections``; beyond it such a connection is closed at once).
        self.refusing_connections = 0
        self.max_refusing_connections = max_refusing_connections
        #: Connections beyond ``max_connections`` whose first line has not arrived (at most
        #: ``probe_reserve``), oldest first in :attr:`undecided`.
        self.undecided_connections = 0
        self.undecided: deque = deque()
        #: Authorized tunnels and peer links, and one kept-alive heartbeat connection per node:
        #: bounded by the process's file descriptors, not by ``max_connections`` (a replica
        #: holds thousands of workers).
        self.held_connections = 0
        #: key -> the connection an API vouched for (:meth:`hold_connection`), counted as held.
        self.held_for_key: dict[str, _ListenerConnection] = {}
        self.max_body_bytes_in_flight = max_body_bytes_in_flight
        self.body_bytes_in_flight = 0
        self.max_body_bytes_per_source = max_body_bytes_per_source
        self.node_body_reserve = node_body_reserve
        self.body_first_byte_deadline = body_first_byte_deadline
        #: source (:func:`source_key`) -> body bytes it holds in flight (only sources > 0).
        self.body_bytes_of_source: dict[str, int] = {}
        self.headers_deadline = headers_deadline
        self.body_deadline = body_deadline
        self.refused_connections = EventsPerInterval(
            self.reactor, "refused {count} connection(s) since the last such line: this "
            "listener already holds {limit} (the connection cap) and its probe reserve is full")
        self.evicted_connections = EventsPerInterval(
            self.reactor, "closed {count} connection(s) since the last such line that were "
            "accepted beyond the connection cap and had not sent a request line while "
            "{limit} newer ones waited")
        self.source_evictions = EventsPerInterval(
            self.reactor, "closed {count} connection(s) since the last such line that were "
            "sending a request head (or idle) to make room for a newer connection: their "
            "source ({source}) held the most connections, or its share of {limit}")
        self.refused_sources = EventsPerInterval(
            self.reactor, "answered 503 to {count} connection(s) since the last such line: "
            "their source already held its share of {limit} connections, all busy")
        self.refused_on_reserve = EventsPerInterval(
            self.reactor, "answered 503 to {count} request(s) other than /healthz and /readyz "
            "since the last such line: this listener holds {limit} connections (the connection "
            "cap); beyond it only the probes are served")
        self.refused_bodies = EventsPerInterval(
            self.reactor, "answered 503 to {count} request(s) since the last such line: "
            "{limit} bytes of request bodies were already in flight")
        self.refused_source_bodies = EventsPerInterval(
            self.reactor, "answered 503 to {count} request(s) since the last such line: their "
            "source already held its share of {limit} bytes of request bodies in flight")
        self.late_requests = EventsPerInterval(
            self.reactor, "closed {count} connection(s) since the last such line whose request "
            "{what} took longer than {seconds:g} s to arrive")
        self.refused_access = RateLimitedLog(
            "answered {count} requests from {source} with a 4xx or 5xx status in the last "
            "{seconds:g} s ({suppressed} of them not logged one by one)", clock=self.reactor)
        #: Tracebacks of failed requests, per client (:meth:`allow_failure_log`).
        self.failure_log = RateLimitedLog(
            "{count} requests from {source} failed with an internal error in the last "
            "{seconds:g} s ({suppressed} of their tracebacks not logged)", clock=self.reactor,
            level=LogLevel.warn)
        self.default_limit = default_limit
        self.spool_prefixes = tuple(spool_prefixes)
        self.body_limits = sorted((body_limits or {}).items(), key=lambda kv: len(kv[0]),
                                  reverse=True)

    def log(self, request) -> None:
        """The access log, without the lines nobody reads: the load balancer's ``/healthz``
        and ``/readyz`` probes (a 503 there is the normal "not ready yet" answer; the replica
        logs why itself) and the successful requests of :attr:`quiet_on_success` (the
        workers' heartbeats).  Every other request, and any of those that failed, is still
        logged, but refused and failed ones (4xx, 5xx)
        only up to a burst per client address, then summarised (:attr:`refused_access`).
        :attr:`access_log` ``errors`` keeps only the lines of requests answered >= 400;
        ``off`` keeps none (the refusal summaries of other kinds are still logged)."""
        if self.access_log == "off":
            return
        code = request.code or 200
        if code < 400 and self.access_log == "errors":
            return
        path = request.path or b""
        if path in (b"/healthz", b"/readyz"):
            return
        if code < 400 and self.quiet_on_success is not None and self.quiet_on_success(path):
            return
        if code >= 400 and not self.refused_access.allow(_client_host(request)):
            return
        formatter = self._logFormatter
        # The default format is made directly (web/accesslog.py): the same text, a fraction of
        # the cost; a formatter given to the site (tests) is used as twisted.web would.
        line = (combined_line if formatter is combinedLogFormatter else formatter)(
            self._logDateTime, request)
        if self.access_lines is not None:
            self.access_lines.add(line)
        elif self._logFile is not None:
            self._logFile.write(line + "\n")

    def write_access_lines_to(self, sink) -> None:
        """Write the access lines in batches to ``sink`` (``logs.TextLines``: the plugin's
        text log file), or each through a log event as ``twisted.web`` does (None)."""
        if self.access_lines is not None:
            self.access_lines.stop()
        self.access_lines = AccessLog(self.reactor, sink) if sink is not None else None

    def log_early_answer(self, request, status: int, why: str = "") -> None:
        """The access line of a request refused before its body was read (a wrong API key or
        registration token on a request with a body, a body too large, the body budget), which
        :meth:`log` never sees; limited per client address like every refused request."""
        if self.access_log == "off" or status < 400:
            return
        if not self.refused_access.allow(_client_host(request)):
            return
        line = pending_request_line(request.channel) if request.channel is not None else None
        method, target = line if line is not None else (b"?", b"?")
        address = request.getClientAddress()
        log.info('"{client}" "{method} {target}" {status} (refused before the body was '
                 'read{why})', client=getattr(address, "host", "-"),
                 method=printable_name(method[:16], 16),
                 target=printable_name(target.split(b"?", 1)[0][:200], 200), status=status,
                 why=f": {why[:160]}" if why else "")

    def startFactory(self) -> None:
        super().startFactory()
        if self.access_lines is not None:
            self.access_lines.start()

    def stopFactory(self) -> None:
        self.refused_access.flush()
        self.failure_log.flush()
        if self.access_lines is not None:
            self.access_lines.stop()  # nothing held back once the listener stops
        super().stopFactory()

    def add_body_limit(self, prefix: bytes, limit: int) -> None:
        """Cap the bodies under ``prefix`` at ``limit`` (as ``body_limits`` above)."""
        self.body_limits = sorted([*self.body_limits, (prefix, limit)],
                                  key=lambda kv: len(kv[0]), reverse=True)

    def spools(self, target: bytes | None) -> bool:
        """Whether the body of a request for ``target`` goes to a temporary file."""
        if target is None:
            return False
        path = target.split(b"?", 1)[0]
        return any(path == p or path.startswith(p.rstrip(b"/") + b"/")
                   for p in self.spool_prefixes)

    def body_limit_for(self, target: bytes | None) -> int:
        if target is None:
            return self.default_limit
        path = target.split(b"?", 1)[0]
        for prefix, limit in self.body_limits:
            if path == prefix or path.startswith(prefix if prefix.endswith(b"/")
                                                 else prefix + b"/"):
                return limit
        return self.default_limit

    # -- when the headers end ---------------------------------------------------------------

    def add_header_guard(self, prefix: bytes, guard: Callable[[Any], None]) -> None:
        """Guard the paths under ``prefix`` (see ``header_guards`` above)."""
        self.header_guards.append((_segments_of(prefix.rstrip(b"/")), guard))
        self.header_guards.sort(key=lambda kv: len(kv[0]), reverse=True)

    def add_early_answer_shape(self, prefix: bytes, shape: Callable[[Any], Any]) -> None:
        """Refusals answered before the body on the paths under ``prefix`` (whole segments)
        are passed through ``shape(refusal)``, which returns the refusal to answer (same
        ``status``, ``body()``, ``headers`` protocol)."""
        self.early_answer_shapes.append((_segments_of(prefix.rstrip(b"/")), shape))
        self.early_answer_shapes.sort(key=lambda kv: len(kv[0]), reverse=True)

    def shape_early_answer(self, target: bytes | None, answer):
        if target is None:
            return answer
        segments = _segments_of(target)
        for prefix, shape in self.early_answer_shapes:
            if segments[:len(prefix)] == prefix:
                try:
                    return shape(answer)
                except Exception:
                    log.failure("shaping an early answer failed; answering it unshaped")
                    return answer
        return answer

    def guard_before_body(self, request, target: bytes | None) -> None:
        """Run the header guard of ``target``'s path, if any (raises its refusal).  An unknown
        target (a Twisted that moved its internals) runs no guard: the resource still checks,
        only later, and the default body cap applies meanwhile."""
        if target is None or not self.header_guards:
            return
        segments = _segments_of(target)
        request.guarded_segments = segments  # the guard may need the path: not parsed yet
        for prefix, guard in self.header_guards:
            if segments[:len(prefix)] == prefix:
                guard(request)
                return

    def check_host(self, request, target: bytes | None) -> None:
        """:attr:`host_check` (``web/hosts.py``) for every path but the probes: raises its
        403."""
        if self.host_check is None or target is None:
            return
        if target.split(b"?", 1)[0] in PROBE_PATHS:
            return
        self.host_check.check(request)

    # -- listener bounds --------------------------------------------------------------------

    def reserve_body_bytes(self, size: int, source: str = "?",
                           target: bytes | None = None) -> Callable[[], None]:
        """Count ``size`` body bytes as in flight for ``source`` (:func:`source_key`); the
        returned callable (idempotent) gives them back.

        Fair shares: one source holds at most ``max_body_bytes_per_source``, and the last
        ``node_body_reserve`` bytes of the budget go only to the workers' API (``target``
        under ``/api/node/``), so neither one client nor a flood of clients starves the
        heartbeats.

        :raises APIError: 503 when the bytes would pass the budget or the source's share."""
        node = target is not None and _segments_of(target)[:2] == (b"api", NODE_PATH_SEGMENT)
        budget = self.max_body_bytes_in_flight - (0 if node else self.node_body_reserve)
        if self.body_bytes_in_flight + size > budget:
            self.refused_bodies.note(limit=self.max_body_bytes_in_flight)
            raise bodies_busy()
        held = self.body_bytes_of_source.get(source, 0)
        if held + size > self.max_body_bytes_per_source:
            self.refused_source_bodies.note(limit=self.max_body_bytes_per_source)
            raise bodies_busy(self.max_body_bytes_per_source)
        self.body_bytes_in_flight += size
        self.body_bytes_of_source[source] = held + size
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self.body_bytes_in_flight -= size
                left = self.body_bytes_of_source.get(source, 0) - size
                if left > 0:
                    self.body_bytes_of_source[source] = left
                else:
                    self.body_bytes_of_source.pop(source, None)

        return release

    @property
    def saturated(self) -> bool:
        """Whether the cap on connections nobody vouched for is full (``/readyz`` says so)."""
        return self.open_connections >= self.max_connections

    def buildProtocol(self, addr):
        connection = _ListenerConnection(self, super().buildProtocol(addr))
        connection.source = source = source_key(addr)
        mine = self.open_of_source.get(source, ())
        if len(mine) >= self.max_connections_per_source:
            if not self._evict_awaiting_head(source, self.max_connections_per_source):
                connection.over_cap = connection.source_full = True
                return connection
        if self.open_connections >= self.max_connections:
            # Fair share of a full cap: the source holding the most connections gives up its
            # oldest one still sending its head, if it holds more than this one's source.
            biggest = max(self.open_of_source, key=lambda s: len(self.open_of_source[s]),
                          default=None)
            if (biggest is None or len(self.open_of_source[biggest]) <= len(mine) + 1
                    or not self._evict_awaiting_head(biggest, self.max_connections)):
                connection.over_cap = True  # decided when its socket is known
        return connection

    def _evict_awaiting_head(self, source: str, limit: int) -> bool:
        """Close ``source``'s oldest open connection that awaits a request head (nothing of a
        request in progress), and stop counting it now; whether there was one."""
        for connection in self.open_of_source.get(source, ()):
            channel = connection.wrappedProtocol
            if getattr(channel, "awaiting_head", False):
                self._count(connection, -1)
                connection.kind = None
                self.source_evictions.note(source=source, limit=limit)
                if connection.transport is not None:
                    connection.transport.abortConnection()
                return True
        return False

    def decide_over_cap(self, line: bytes | None) -> str:
        """What becomes of a connection accepted beyond the cap, whose first line is ``line``
        (None: not arrived yet): ``"reserve"`` (a probe), ``"undecided"`` (decided when its
        request line arrives; when ``probe_reserve`` of them wait already, the one that waited
        longest is closed to make room: a probe sends its line at once, a client that holds an
        empty connection cannot crowd it out), ``"refusing"`` (anything else: answered 503 at
        once) or ``"close"`` (the part it would need is full)."""
        if line is None:
            while self.undecided and self.undecided_connections >= self.probe_reserve:
                self._evict(self.undecided.popleft())
            if self.undecided_connections < self.probe_reserve:
                return "undecided"
        elif is_probe_request_line(line):
            if self.reserve_connections < self.probe_reserve:
                return "reserve"
        elif self.refusing_connections < self.max_refusing_connections:
            return "refusing"
        self.refused_connections.note(limit=self.max_connections)
        return "close"

    def _evict(self, connection) -> None:
        """Close an undecided connection that waited longest, and stop counting it now."""
        if connection.kind != "undecided":
            return  # decided meanwhile
        self._count(connection, -1)
        connection.kind = None
        self.evicted_connections.note(limit=self.probe_reserve)
        if connection.transport is not None:
            connection.transport.abortConnection()

    def first_line_arrived(self, connection, probe: bool) -> bool:
        """An undecided connection's first line arrived (``probe``: it is a probe's): it moves
        to the reserve (a probe, while the reserve has room) or to the connections being
        refused.  Whether it may be served as a probe."""
        if getattr(connection, "kind", None) != "undecided":
            return probe  # decided when it was accepted
        try:
            self.undecided.remove(connection)
        except ValueError:
            pass
        self._count(connection, -1)
        served = probe and self.reserve_connections < self.probe_reserve
        connection.kind = "reserve" if served else "refusing"
        self._count(connection, +1)
        return served

    def registerProtocol(self, connection) -> None:
        self._count(connection, +1)

    def connection_held(self, connection) -> None:
        """One counted connection became an authorized tunnel or peer link."""
        self._count(connection, -1)
        self.held_connections += 1

    def hold_connection(self, request, key: str) -> None:
        """The API that answered ``request`` vouches for its connection as the one ``key``
        keeps alive (a known node's heartbeats, authenticated): it leaves the cap like a
        tunnel, one connection per key.  Without this a fleet of more than
        ``max_connections`` workers would hold the whole cap with its heartbeat connections,
        and every API client would be refused."""
        connection = _listener_connection_of(request)
        if connection is None or connection.kind != "open":
            return
        current = self.held_for_key.get(key)
        if current is not None and current is not connection and current.kind == "held":
            return  # the key already holds a connection: this one stays counted
        self.held_for_key[key] = connection
        connection.held_for = key
        connection.authorized()

    def unregisterProtocol(self, connection) -> None:
        self._count(connection, -1)
        key = getattr(connection, "held_for", None)
        if key is not None and self.held_for_key.get(key) is connection:
            del self.held_for_key[key]
        if getattr(connection, "kind", None) == "undecided":
            try:
                self.undecided.remove(connection)
            except ValueError:
                pass

    def _count(self, connection, change: int) -> None:
        kind = getattr(connection, "kind", "open")
        if kind == "open":
            self.open_connections += change
            source = getattr(connection, "source", None)
            if source is not None:
                mine = self.open_of_source.setdefault(source, deque())
                if change > 0:
                    mine.append(connection)
                else:
                    try:
                        mine.remove(connection)
                    except ValueError:
                        pass
                if not mine:
                    del self.open_of_source[source]
        elif kind == "reserve":
            self.reserve_connections += change
        elif kind == "refusing":
            self.refusing_connections += change
        elif kind == "undecided":
            self.undecided_connections += change
        elif kind == "held":
            self.held_connections += change

