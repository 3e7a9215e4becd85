"""Shared pieces of the frontend's HTTP side: a bounded listener, bounded bodies, JSON errors,
API-key auth.

- :class:`FrontendSite` / :class:`FrontendRequest`: a request with a body is decided when its
  headers end: the *header guard* of its path (authentication), its size cap (64 KiB unless a
  path prefix was given more; ``413``), the listener's budget of body bytes in flight
  (``503``).  A refusal is answered at once and the connection closed, before a body byte is
  read; an accepted body is still capped *while it arrives*.  Nothing beyond a cap is ever
  buffered, in memory or on disk.  (``twisted.web`` would otherwise read any body into a
  temporary file before the resource sees the request.)
- :class:`FrontendChannel`: total deadlines for a request's head and body (``408``), where
  ``twisted.web`` only has an idle timer that every byte restarts; and a cap on a listener's
  concurrent connections, beyond which a small reserve serves only the load balancer's probes.
  Defaults: :data:`MAX_CONNECTIONS`, :data:`PROBE_RESERVE`, :data:`MAX_BODY_BYTES_IN_FLIGHT`,
  :data:`HEADERS_DEADLINE_SECONDS`,
  :data:`BODY_DEADLINE_SECONDS` (``docs/operators.md``, "Limits").
- :class:`APIError` and :func:`error_body`: every refusal is ``{"error": {"message", "type",
  "code"?, "field"?}}`` with a message naming the cause; ``field`` names the offending input.
- :class:`JSONResource`: a leaf resource whose routes are ``async def`` handlers returning
  ``(status, dict)``; unknown paths are 404, wrong methods 405 (with ``Allow``), unexpected
  exceptions 500 with a generic message (the detail goes to the log), a database that is down
  503.
- :class:`APIKeyGuard`: ``Authorization: Bearer <key>`` checked in constant time against every
  configured key.  **No key configured means the guarded API refuses everything** (401, with a
  message saying to set ``--api-key``): the admin API can approve, drain and delete workers,
  and an open admin API by accident is worse than a closed one by accident.
- :func:`read_json_object`: the body as a JSON object, or a 400 that says what is wrong with it.
- :class:`JSONDirectory` / :class:`NotFoundResource`: path prefixes whose unknown children (and
  every path nothing serves) answer a JSON 404, never ``twisted.web``'s HTML page.

This module must never buffer an unbounded body, never read a body byte of a request it
refused, never let a client hold a connection by trickling bytes, never echo a credential
(errors name the *kind* of credential, never its value), never compare a secret with ``==``,
and never put a traceback or an internal exception text into a response.
"""

from __future__ import annotations

import hmac  # noqa: F401  (the tests spy on hmac.compare_digest through this module)
import json
import socket
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, Sequence

from twisted.internet import defer
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.http import HTTPChannel, unquote
from twisted.web.resource import Resource

from localai_tw import errors
from localai_tw.db.pool import DatabaseUnavailable, PoolClosed
from localai_tw.logs import RateLimitedLog
from localai_tw.tunnel.sockets import set_no_delay
from localai_tw.web import auth
from localai_tw.web.bodies import (
    CappedBody,
    SpooledCappedBody,
    answer_early,
    pending_request_line,
)
from localai_tw.web.json import JSON_HEADERS  # noqa: F401  (the OpenAI API imports it here)
from localai_tw.web.json import COMPACT, json_body, write_json
from localai_tw.web.ratelimit import SourceRateLimit

if TYPE_CHECKING:  # the parts' types only: web.py serves them, it never builds them
    from localai_tw.cluster.nodes import NodeRegistry
    from localai_tw.cluster.ownership import OwnershipFence
    from localai_tw.db.pool import Database
    from localai_tw.tunnel.endpoint import ControlClient

log = Logger()

#: Body cap of the register, heartbeat and admin APIs (and of any path without its own cap).
MAX_BODY_BYTES = 64 * 1024
#: Most connections one listener holds at once that are not authorized tunnels or peer links;
#: beyond it a connection may only use the probe reserve.
MAX_CONNECTIONS = 1024
#: Connections a listener serves beyond :data:`MAX_CONNECTIONS` for the load balancer's probes
#: only (one ``GET``/``HEAD`` of :data:`PROBE_PATHS` without a body each), and connections
#: beyond it that wait for their first line (a newer one closes the oldest); anything else
#: beyond the cap is answered 503 at once (:class:`FrontendSite`).
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
#: Seconds a client has to send a whole request head (request line and headers).
HEADERS_DEADLINE_SECONDS = 30.0
#: Seconds a client has to send a whole request body, counted from the end of its head.
BODY_DEADLINE_SECONDS = 120.0
#: Longest path segment (node id) echoed back in an error message.
_ECHO_MAX = 64

# -- errors --------------------------------------------------------------------------------


class APIError(Exception):
    """A refusal to answer with ``status`` and a JSON error body.

    :param type_: a stable machine-readable kind (``invalid_request``, ``unauthorized``, ...).
    :param field: the request field at fault, when there is one.
    :param code: an optional finer machine-readable code.
    """

    def __init__(self, status: int, message: str, type_: str, *, field: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.field = field
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.type, field=self.field, code=self.code)


def error_body(message: str, type_: str, *, field: str | None = None,
               code: str | None = None) -> dict:
    error: dict[str, Any] = {"message": message, "type": type_}
    if code is not None:
        error["code"] = code
    if field is not None:
        error["field"] = field
    return {"error": error}


def bad_request(message: str, field: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request", field=field)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "unauthorized", headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str) -> APIError:
    return APIError(404, message, "not_found")


def conflict(message: str, code: str | None = None) -> APIError:
    return APIError(409, message, "conflict", code=code)


def not_ready(message: str) -> APIError:
    return APIError(503, message, "not_ready", headers={"Retry-After": "5"})


#: This replica's own database is away (or its pool closed while stopping).  Not one of the four
#: conditions: it says nothing about any worker.  Answered 503 with ``Retry-After``, so a client
#: retries later or on another replica; the cause is logged once per outage by the pool.
DATABASE_DOWN = (DatabaseUnavailable, PoolClosed)


def database_unavailable() -> APIError:
    """The answer to a request that needed the database while it was away.  The pool's message
    (server address, user) stays in the log: a client learns only the cause."""
    return APIError(503, "this replica's database is unavailable right now; try again in a few "
                    "seconds", "service_unavailable", code="database_unavailable",
                    headers={"Retry-After": "5"})


def worker_call_error(error: errors.ClusterError) -> APIError:
    """The admin API's answer for a failed call to a worker; one status per condition, so an
    operator never reads a peer failure or a reconnecting tunnel as the worker's verdict."""
    message = str(error)
    if isinstance(error, errors.RoutingFact):
        return APIError(503, message, "service_unavailable", code=error.condition)
    if isinstance(error, errors.AbsentWithinGrace):
        return APIError(503, message, "service_unavailable", code=error.condition,
                        headers={"Retry-After": "5"})
    if isinstance(error, errors.PeerUnreachable):
        return APIError(503, message + "; retry", "service_unavailable", code=error.condition,
                        headers={"Retry-After": "2"})
    if isinstance(error, errors.WorkerAnswer):
        return APIError(502, message, "worker_error", code=error.condition)
    if isinstance(error, errors.CallerDeadlineExceeded):
        return APIError(504, message, "timeout", code=error.condition)
    return APIError(502, message, "upstream_error", code=error.condition)


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than the limit of {limit} bytes",
                    "request_too_large")


def printable(text: str, limit: int = _ECHO_MAX) -> str:
    """``text`` made safe to echo in an error or a log: printable characters only, bounded."""
    cleaned = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return cleaned + ("..." if len(text) > limit else "")


# -- bounded request bodies ------------------------------------------------------------------


def _segments_of(target: bytes) -> tuple[bytes, ...]:
    """The path segments of ``target`` exactly as ``twisted.web`` will route them
    (``Request.process``: query dropped, split on ``/``, each segment percent-decoded), so a
    header guard cannot be sidestepped by spelling ``/v1`` as ``/%761``."""
    path = target.split(b"?", 1)[0]
    return tuple(unquote(segment) for segment in path[1:].split(b"/"))


def bodies_busy() -> APIError:
    return APIError(503, "this replica is receiving too many request bodies at once; try again "
                    "in a few seconds", "service_unavailable", code="too_many_bodies_in_flight",
                    headers={"Retry-After": "5"})


def _as_early_answer(refusal: Exception):
    """``refusal`` if it can be written as an answer (``status``, ``body()``, ``headers``:
    :class:`APIError` and the OpenAI API's errors), else a 500 (the cause goes to the log)."""
    status = getattr(refusal, "status", None)
    if isinstance(status, int) and callable(getattr(refusal, "body", None)):
        return refusal
    log.failure("a check before the request body failed; answering 500", Failure(refusal))
    return APIError(500, "internal error; see the frontend log", "internal_error")


class FrontendRequest(server.Request):
    """A request decided when its headers end (see :class:`FrontendSite`), whose body is then
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
        site = site if isinstance(site, FrontendSite) else None
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
                site.guard_before_body(self, target)
            if length is not None and length > limit:
                raise too_large(limit)
            if site is not None:
                release = site.reserve_body_bytes(limit if length is None else length)
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
        if isinstance(site, FrontendSite):
            answer = site.shape_early_answer(getattr(self, "_early_target", None), answer)
        if self.channel is not None:
            answer_early(self.channel, answer.status, answer.body(), answer.headers)


def too_many_connections(limit: int) -> APIError:
    """The answer to a request other than a probe on a connection beyond the cap."""
    return APIError(503, f"this replica already holds its cap of {limit} connections that are "
                    "not authorized tunnels; only /healthz and /readyz are served beyond it; "
                    "try again in a few seconds", "service_unavailable",
                    code="too_many_connections", headers={"Retry-After": "2"})


def is_probe_request_line(line: bytes) -> bool:
    """Whether ``line`` (a request line) asks ``GET`` or ``HEAD`` of one of
    :data:`PROBE_PATHS`, spelled exactly (no query, no percent-encoding: anything else is not
    a probe, which fails closed)."""
    parts = line.split(b" ")
    return (len(parts) == 3 and parts[0] in (b"GET", b"HEAD") and parts[1] in PROBE_PATHS
            and parts[2] in (b"HTTP/1.1", b"HTTP/1.0"))


def request_timeout(what: str, seconds: float) -> APIError:
    return APIError(408, f"the request {what} did not arrive within {seconds:g} seconds",
                    "request_timeout", code="request_timeout")


class FrontendChannel(HTTPChannel):
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
    #: True when the listener accepted this connection beyond its cap, for a probe (or not
    #: known yet): one request, which must be a probe (:func:`is_probe_request_line`) without
    #: a body.
    on_probe_reserve = False
    _first_line_seen = False

    def connectionMade(self):
        super().connectionMade()
        self._start_deadline("head")

    def lineReceived(self, line):
        if self.on_probe_reserve and not self._first_line_seen:
            self._first_line_seen = True
            site = getattr(self, "site", None)
            probe = is_probe_request_line(line)
            if isinstance(site, FrontendSite):
                probe = site.first_line_arrived(self.transport, probe)
            if not probe:
                self.refuse_beyond_the_cap(line)
                return
        super().lineReceived(line)

    def refuse_beyond_the_cap(self, line: bytes | None) -> None:
        """Answer 503 ``too_many_connections`` before the rest of the request (no request is
        created, no header parsed), and ignore whatever follows while the connection closes."""
        self._cancel_deadline()
        site = getattr(self, "site", None)
        limit = getattr(site, "max_connections", MAX_CONNECTIONS)
        answer: Any = too_many_connections(limit)
        self._first_line_seen = True
        parts = (line or b"").split(b" ")
        if isinstance(site, FrontendSite):
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
        if self._between_requests:  # the first byte of the next request
            self._between_requests = False
            self._start_deadline("head")
        super().dataReceived(data)

    def allHeadersReceived(self):
        self._cancel_deadline()
        super().allHeadersReceived()
        request = self.requests[-1] if self.requests else None
        if self.length != 0 and request is not None and not request.answered_before_body:
            self._start_deadline("body")  # cancelled in allContentReceived

    def allContentReceived(self):
        self._cancel_deadline()
        super().allContentReceived()

    def requestDone(self, request):
        self._between_requests = True  # before the channel replays pipelined bytes
        super().requestDone(request)

    def connectionLost(self, reason):
        self._cancel_deadline()
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
            self._deadline = self.callLater(seconds, self._deadline_passed, what, seconds)

    def _cancel_deadline(self) -> None:
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _deadline_passed(self, what: str, seconds: float) -> None:
        self._deadline = None
        if self.transport is None:
            return  # the connection was handed over (a WebSocket) or is gone
        site = getattr(self, "site", None)
        if isinstance(site, FrontendSite):
            site.late_requests.note(what=what, seconds=seconds)
        answer = request_timeout(what, seconds)
        request = self.requests[-1] if self.requests else None
        if isinstance(request, FrontendRequest) and what == "body":
            request.answer_before_body(answer)
        else:
            if isinstance(request, FrontendRequest):
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
    counted (see :class:`FrontendSite`).
    """

    #: What the site counts it as: ``"open"`` (nobody vouched for it yet), ``"undecided"``
    #: (beyond the cap, its first line not arrived yet), ``"reserve"`` (a probe, on the probe
    #: reserve), ``"refusing"`` (beyond the cap, being answered 503), ``"held"`` (an
    #: authorized tunnel or peer link), or None (not counted: closed at accept or evicted).
    kind: str | None = "open"
    #: Accepted beyond the cap: :meth:`makeConnection` decides its kind.
    over_cap = False
    #: The node whose heartbeats this connection carries, once it counts as held for them.
    heartbeat_node: str | None = None

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


#: ``--access-log``: which requests get an access line (:meth:`FrontendSite.log`).
ACCESS_LOG_CHOICES = ("all", "errors", "off")


def _client_host(request) -> str:
    """The address a request came from, the key of per-source log limits."""
    address = request.getClientAddress()
    return str(getattr(address, "host", address))


class FrontendSite(server.Site):
    """The frontend's ``Site``: requests are :class:`FrontendRequest`, connections
    :class:`FrontendChannel`, and the listener serving it is bounded:

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
      lengths, reserved when the headers end and released when the request ends); a request
      that would pass it is answered 503 with ``Retry-After`` before its body is read;
    - a request with a body is first put to the *header guard* of its path: authentication is
      decided when the headers end, and a refused request never has a byte of its body read;
    - deadlines for each request's head and body (:class:`FrontendChannel`).

    Refusals are logged at most once a minute per kind, with a count.  Access lines of
    requests answered with a 4xx status are rate-limited per client address
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

    requestFactory = FrontendRequest
    protocol = FrontendChannel

    def __init__(self, resource, *, body_limits: Mapping[bytes, int] | None = None,
                 default_limit: int = MAX_BODY_BYTES,
                 spool_prefixes: Iterable[bytes] = (),
                 header_guards: Mapping[bytes, Callable[[Any], None]] | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 probe_reserve: int = PROBE_RESERVE,
                 max_refusing_connections: int = MAX_REFUSING_CONNECTIONS,
                 probe_reserve_headers_deadline: float = PROBE_RESERVE_HEADERS_DEADLINE_SECONDS,
                 max_body_bytes_in_flight: int = MAX_BODY_BYTES_IN_FLIGHT,
                 headers_deadline: float | None = HEADERS_DEADLINE_SECONDS,
                 body_deadline: float | None = BODY_DEADLINE_SECONDS,
                 access_log: str = "all", **kwargs):
        super().__init__(resource, **kwargs)
        if access_log not in ACCESS_LOG_CHOICES:
            raise ValueError(f"access_log must be one of {ACCESS_LOG_CHOICES}: {access_log!r}")
        #: ``all``, ``errors`` (status >= 400 only) or ``off`` (``--access-log``).
        self.access_log = access_log
        self.header_guards: list[tuple[tuple[bytes, ...], Callable[[Any], None]]] = []
        self.early_answer_shapes: list[tuple[tuple[bytes, ...], Callable[[Any], Any]]] = []
        for prefix, guard in (header_guards or {}).items():
            self.add_header_guard(prefix, guard)
        self.max_connections = max_connections
        #: Connections not (yet) vouched for: HTTP requests, dials still being authorized.
        self.open_connections = 0
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
        #: node id -> the connection that carries its heartbeats, counted as held
        #: (:meth:`heartbeat_answered`).
        self.heartbeat_connections: dict[str, _ListenerConnection] = {}
        self.max_body_bytes_in_flight = max_body_bytes_in_flight
        self.body_bytes_in_flight = 0
        self.headers_deadline = headers_deadline
        self.body_deadline = body_deadline
        self.refused_connections = EventsPerInterval(
            self.reactor, "refused {count} connection(s) since the last such line: this "
            "listener already holds {limit} (the connection cap) and its probe reserve is full")
        self.evicted_connections = EventsPerInterval(
            self.reactor, "closed {count} connection(s) since the last such line that were "
            "accepted beyond the connection cap and had not sent a request line while "
            "{limit} newer ones waited")
        self.refused_on_reserve = EventsPerInterval(
            self.reactor, "answered 503 to {count} request(s) other than /healthz and /readyz "
            "since the last such line: this listener holds {limit} connections (the connection "
            "cap); beyond it only the probes are served")
        self.refused_bodies = EventsPerInterval(
            self.reactor, "answered 503 to {count} request(s) since the last such line: "
            "{limit} bytes of request bodies were already in flight")
        self.late_requests = EventsPerInterval(
            self.reactor, "closed {count} connection(s) since the last such line whose request "
            "{what} took longer than {seconds:g} s to arrive")
        self.refused_access = RateLimitedLog(
            "answered {count} requests from {source} with a 4xx status in the last "
            "{seconds:g} s ({suppressed} of them not logged one by one)", clock=self.reactor)
        self.default_limit = default_limit
        self.spool_prefixes = tuple(spool_prefixes)
        self.body_limits = sorted((body_limits or {}).items(), key=lambda kv: len(kv[0]),
                                  reverse=True)

    def log(self, request) -> None:
        """The access log, without the lines nobody reads: the load balancer's ``/healthz``
        and ``/readyz`` probes (a 503 there is the normal "not ready yet" answer; the replica
        logs why itself) and successful worker heartbeats (one per worker every 10 s).  Every
        API request, and any heartbeat that failed, is still logged, but refused ones (4xx)
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
        if path.startswith(b"/api/node/") and path.endswith(b"/heartbeat") and code < 400:
            return
        if 400 <= code < 500 and not self.refused_access.allow(_client_host(request)):
            return
        super().log(request)

    def stopFactory(self) -> None:
        self.refused_access.flush()
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

    # -- listener bounds --------------------------------------------------------------------

    def reserve_body_bytes(self, size: int) -> Callable[[], None]:
        """Count ``size`` body bytes as in flight; the returned callable (idempotent) gives
        them back.  :raises APIError: 503 when they would pass ``max_body_bytes_in_flight``."""
        if self.body_bytes_in_flight + size > self.max_body_bytes_in_flight:
            self.refused_bodies.note(limit=self.max_body_bytes_in_flight)
            raise bodies_busy()
        self.body_bytes_in_flight += size
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self.body_bytes_in_flight -= size

        return release

    def buildProtocol(self, addr):
        connection = _ListenerConnection(self, super().buildProtocol(addr))
        if self.open_connections >= self.max_connections:
            connection.over_cap = True  # decided when its socket is known (makeConnection)
        return connection

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

    def heartbeat_answered(self, request, node_id: str) -> None:
        """A known node's heartbeat, authenticated with the registration token, was answered
        on ``request``'s connection: that connection (a worker keeps it alive between beats)
        leaves the cap like a tunnel, one per node.  Without this a fleet of more than
        ``max_connections`` workers would hold the whole cap with its heartbeat connections,
        and every API client would be refused."""
        connection = _listener_connection_of(request)
        if connection is None or connection.kind != "open":
            return
        current = self.heartbeat_connections.get(node_id)
        if current is not None and current is not connection and current.kind == "held":
            return  # the node's heartbeats already hold a connection: this one stays counted
        self.heartbeat_connections[node_id] = connection
        connection.heartbeat_node = node_id
        connection.authorized()

    def unregisterProtocol(self, connection) -> None:
        self._count(connection, -1)
        node_id = getattr(connection, "heartbeat_node", None)
        if node_id is not None and self.heartbeat_connections.get(node_id) is connection:
            del self.heartbeat_connections[node_id]
        if getattr(connection, "kind", None) == "undecided":
            try:
                self.undecided.remove(connection)
            except ValueError:
                pass

    def _count(self, connection, change: int) -> None:
        kind = getattr(connection, "kind", "open")
        if kind == "open":
            self.open_connections += change
        elif kind == "reserve":
            self.reserve_connections += change
        elif kind == "refusing":
            self.refusing_connections += change
        elif kind == "undecided":
            self.undecided_connections += change
        elif kind == "held":
            self.held_connections += change


def read_json_object(request, *, required: bool = True) -> dict:
    """The request body as a JSON object.

    :param required: False lets an empty body stand for ``{}``.
    :raises APIError: 413 over the cap (a backstop: ``FrontendRequest`` refuses earlier), 415
        for a non-JSON content type (a missing one is accepted), 400 for a body that is not
        UTF-8 JSON or not an object.
    """
    content_type = request.getHeader(b"content-type")
    if content_type is not None:  # absent is fine: the body is read as JSON (as LocalAI does)
        media = content_type.split(b";", 1)[0].strip().lower()
        if media not in (b"application/json", b""):
            sent = printable(media.decode("latin-1"))
            raise APIError(415, f"Content-Type {sent!r} is not accepted: the body must be JSON "
                           "sent as Content-Type: application/json, or with no Content-Type "
                           "(curl -d needs -H 'Content-Type: application/json')",
                           "unsupported_media_type", code="unsupported_media_type")
    content = request.content
    if content is None:
        raw = b""
    else:
        limit = getattr(content, "limit", MAX_BODY_BYTES)
        content.seek(0, 0)
        raw = content.read(limit + 1)
        if len(raw) > limit:
            raise too_large(limit)
    if not raw.strip():
        if required:
            raise bad_request("the request body is empty; a JSON object is expected")
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8") from None
    try:
        decoded = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:
        detail = f": {e.msg} at character {e.pos}" if isinstance(e, json.JSONDecodeError) else ""
        raise bad_request(f"the request body is not valid JSON{detail}") from None
    if not isinstance(decoded, dict):
        raise bad_request("the request body must be a JSON object")
    unsafe = _first_unsafe_string(decoded, "")
    if unsafe is not None:
        where, what = unsafe
        raise bad_request(f"{where or 'a field name'} contains {what}, which no backend, "
                          f"gRPC message or database row can carry", field=where or None)
    return decoded


def _first_unsafe_string(value: Any, path: str) -> tuple[str, str] | None:
    """The JSON path of the first key or string holding a NUL or a lone surrogate, and which.

    JSON may spell both (``"\\u0000"``, ``"\\ud800"``); neither survives the trip on: protobuf
    strings must be valid UTF-8 and PostgreSQL text refuses NUL, so they are refused here, at
    the door, instead of failing deep inside with a 500.  Nesting is already bounded by the
    JSON decoder's recursion limit (a deeper body is a 400 above).
    """
    if isinstance(value, str):
        if "\x00" in value:
            return path, "a NUL character (\\u0000)"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, "a lone surrogate (an unpaired \\ud800-\\udfff escape)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = _first_unsafe_string(key, path) or _first_unsafe_string(item, where)
            if found is not None:
                return printable(found[0]), found[1]
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _first_unsafe_string(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def reject_unknown_fields(body: Mapping[str, Any], allowed: Iterable[str],
                          prefix: str = "") -> None:
    """A 400 naming the first field of ``body`` that is not in ``allowed``."""
    allowed = set(allowed)
    for key in body:
        if key not in allowed:
            named = f"{prefix}{printable(str(key))}"
            raise bad_request(f"unknown field {named!r}; expected one of "
                              f"{', '.join(sorted(allowed))}", field=named)


# -- credentials ---------------------------------------------------------------------------------


def bearer_token(request) -> str | None:
    """The credential of ``Authorization: Bearer <credential>`` as text, or None: absent,
    repeated, another scheme, empty (:func:`localai_tw.web.auth.bearer_credential`, the rule
    of every HTTP surface), or not ASCII."""
    credential = auth.bearer_credential(request)
    if credential is None:
        return None
    try:
        return credential.decode("ascii")
    except UnicodeDecodeError:
        return None


class APIKeyGuard:
    """Checks ``Authorization: Bearer <key>`` against the configured API keys.

    The presented key is hashed and compared with the digest of *every* configured key, without
    stopping at a match, so timing says neither which key matched nor how long keys are.  With
    no key configured every request is refused (see the module docstring).
    """

    def __init__(self, keys: Sequence[str] | None, *, what: str = "the admin API"):
        self._digests = [auth.digest(k) for k in (keys or ()) if k]
        self._what = what
        if not self._digests:
            log.warn("no --api-key configured: {what} refuses every request until one is set",
                     what=what)

    @property
    def configured(self) -> bool:
        return bool(self._digests)

    def check(self, request) -> None:
        """:raises APIError: 401 when no key is configured, or the key is missing or wrong."""
        if not self._digests:
            raise unauthorized(f"{self._what} is disabled because no API key is configured; "
                               "start the frontend with --api-key-file (or env LOCALAI_API_KEY)")
        presented = bearer_token(request)
        if presented is None:
            raise unauthorized(f"{self._what} requires one Authorization: Bearer <API key> "
                               "header")
        if not auth.matches_any(presented, self._digests):
            raise unauthorized("the API key is not valid")


# -- JSON resources ---------------------------------------------------------------------------------

Handler = Callable[..., Awaitable[tuple[int, dict]]]


@dataclass(frozen=True)
class Route:
    """``method`` on ``pattern`` (path segments; ``{name}`` matches one segment and is passed
    to the handler as a keyword argument)."""

    method: str
    pattern: tuple[str, ...]
    handler: Handler

    def match(self, segments: Sequence[str]) -> dict[str, str] | None:
        if len(segments) != len(self.pattern):
            return None
        captured = {}
        for part, segment in zip(self.pattern, segments):
            if part.startswith("{") and part.endswith("}"):
                if not segment:
                    return None
                captured[part[1:-1]] = segment
            elif part != segment:
                return None
        return captured


class JSONResource(Resource):
    """A leaf resource answering JSON from ``async def`` handlers.

    Subclasses define ``routes()`` returning :class:`Route` objects, each handler being
    ``async def handler(request, **captured) -> (status, dict)``; raising :class:`APIError`
    answers that error.  ``guard(request)`` (optional) runs before routing.
    """

    isLeaf = True

    def routes(self) -> Sequence[Route]:
        raise NotImplementedError

    def guard(self, request) -> None:
        """Raise :class:`APIError` to refuse before any route runs (authentication)."""

    def render(self, request):
        answering = defer.ensureDeferred(self._answer(request))
        answering.addErrback(lambda f: log.failure("answering {path} failed", f,
                                                   path=printable(_path_text(request))))
        return server.NOT_DONE_YET

    async def _answer(self, request) -> None:
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        try:
            status, body = await self._dispatch(request)
            headers: dict[str, str] = {}
        except APIError as e:
            status, body, headers = e.status, e.body(), e.headers
        except DATABASE_DOWN:
            answer = database_unavailable()
            status, body, headers = answer.status, answer.body(), answer.headers
        except Exception:
            log.failure("{method} {path} failed", Failure(),
                        method=request.method.decode("ascii", "replace"),
                        path=printable(_path_text(request)))
            status, headers = 500, {}
            body = error_body("internal error; see the frontend log", "internal_error")
        if gone:
            return  # the client left; nothing to answer
        write_json(request, status, body, headers, separators=COMPACT)

    async def _dispatch(self, request) -> tuple[int, dict]:
        self.guard(request)
        segments = _segments(request)
        if segments is None:
            raise not_found("no such resource")
        method = request.method.decode("ascii", "replace").upper()
        allowed = []
        for route in self.routes():
            captured = route.match(segments)
            if captured is None:
                continue
            if route.method == method:
                return await route.handler(request, **captured)
            allowed.append(route.method)
        if allowed:
            raise APIError(405, f"method {printable(method, 16)} not allowed here; use "
                           f"{' or '.join(sorted(set(allowed)))}", "method_not_allowed",
                           headers={"Allow": ", ".join(sorted(set(allowed)))})
        raise not_found("no such resource")


class AdminResource(JSONResource):
    """A :class:`JSONResource` behind the admin API key: every request passes ``guard`` (an
    :class:`APIKeyGuard`) before any route runs."""

    def __init__(self, guard: APIKeyGuard):
        super().__init__()
        self._guard = guard

    def guard(self, request) -> None:
        self._guard.check(request)


def _segments(request) -> list[str] | None:
    """The path below this resource as text segments (a trailing slash ignored), or None when a
    segment is not UTF-8."""
    raw = list(request.postpath)
    if raw and raw[-1] == b"":
        raw.pop()
    try:
        return [segment.decode("utf-8") for segment in raw]
    except UnicodeDecodeError:
        return None


def _path_text(request) -> str:
    return (request.path or b"").decode("utf-8", "replace")


def render_error(request, error: APIError) -> bytes:
    """Set ``error``'s status and headers on ``request`` and return its JSON body (for the
    synchronous ``render`` of plain resources)."""
    return json_body(request, error.status, error.body(), error.headers)


class NotFoundResource(Resource):
    """What answers a path nothing serves: a JSON 404 in the project's error shape, for every
    method (never ``twisted.web``'s HTML "No Such Resource" page)."""

    isLeaf = True

    def render(self, request):
        return render_error(request, not_found(
            f"no such resource: {printable(_path_text(request), 128)}; the OpenAI API is "
            "under /v1, the admin API under /api/nodes (GET / lists the entry points)"))


class JSONDirectory(Resource):
    """A path prefix holding child resources (``/``, ``/api``, ``/api/cluster``) whose unknown
    children, and the prefix itself, answer :class:`NotFoundResource`'s JSON 404.

    :param index: when given, ``GET``/``HEAD`` of the prefix itself answer 200 with it (the
        root says where the APIs are).
    """

    def __init__(self, index: Mapping[str, Any] | None = None):
        super().__init__()
        self.index = dict(index) if index is not None else None

    def getChild(self, path, request):
        if path == b"" and not request.postpath:
            return self  # the prefix itself, with a trailing slash ("/" for the root)
        return NotFoundResource()

    def render(self, request):
        if self.index is None:
            return NotFoundResource().render(request)
        if request.method not in (b"GET", b"HEAD"):
            return render_error(request, APIError(
                405, f"method {printable(request.method.decode('ascii', 'replace'), 16)} not "
                "allowed here; use GET", "method_not_allowed", headers={"Allow": "GET, HEAD"}))
        return json_body(request, 200, self.index)


@dataclass
class ClusterParts:
    """What the admin and worker APIs work with (built from the wired replica).

    :param db: the started ``Database``.
    :param nodes: the ``NodeRegistry``.
    :param fence: the ``OwnershipFence`` (owner and presence of a node's tunnel).
    :param instance_id: this replica's id.
    :param reconnect_grace: seconds before a departed tunnel counts as gone.
    :param on_registered: called with a node id after each (re-)registration, before the
        answer: the credential changed, so a tunnel held with the old one must go.
    :param on_deleted: called with a node id after an admin deleted the node.
    :param control: the ``ControlClient`` that calls a worker's control verbs through the
        tunnel (locally held or relayed); None where no worker is reached (API tests).
    :param lifecycle: the ``ModelLifecycle`` (unload; this replica's in-flight counts); None
        where no worker is reached.
    :param registration_limit: registrations per source address (``--registration-limit``);
        None: unlimited.
    :param downloads: this replica's model downloads in progress (``downloads.py``
        ``ModelDownloads.in_progress``); None where there are none.
    :param on_scheduling_changed: called with a model name after its scheduling row was
        written or deleted (the placement caches drop the model).
    """

    db: Database
    nodes: NodeRegistry
    fence: OwnershipFence
    instance_id: str
    reconnect_grace: float | None = None
    on_registered: Callable[[str], object] | None = None
    on_deleted: Callable[[str], object] | None = None
    control: ControlClient | None = None
    lifecycle: Any = None
    registration_limit: SourceRateLimit | None = None
    downloads: Callable[[], list] | None = None
    on_scheduling_changed: Callable[[str], object] | None = None
    #: model name -> the bytes this replica's cold load of it staged so far, or None.
    staging: Callable[[str], dict | None] | None = None


async def call_hook(what: str, hook: Callable[[str], Any] | None, node_id: str) -> None:
    """Run a lifecycle hook for ``node_id``; a failure is logged and never reaches the caller
    (the API call it follows has already happened)."""
    if hook is None:
        return
    try:
        result = hook(node_id)
        if isinstance(result, defer.Deferred) or hasattr(result, "__await__"):
            await result
    except Exception:
        log.failure("{what} hook failed for node {node}", Failure(), what=what, node=node_id)
