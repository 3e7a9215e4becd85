"""The worker's registration client: ``POST /api/node/register`` and the node heartbeat.

A worker registers with the registration token and its node key (which proves, when the name
already exists, that this worker is that node) and receives its node id, its status
(``healthy`` or ``pending``) and a per-node tunnel credential; every registration rotates that
credential, so the dial loop reads it afresh on every dial.  The heartbeat
(``POST /api/node/{id}/heartbeat``) keeps the node's row fresh; a 404 means the frontend no
longer knows the node (:class:`NodeUnknown`) and the caller must register again.

Each failure keeps the HTTP status it came with and says what the operator can do about it: a
401 names the registration token, a 400 names the field the frontend rejected, a 5xx or a
transport failure says the frontend is not usable right now.  Only :class:`RegistrationClient`
talks HTTP; retry and scheduling belong to the caller (``worker/service.py``).

What this module must never do:

- log or put into an exception the registration token, the node key or the tunnel credential
  (a :class:`Registration` hides its credential from ``repr``);
- follow a redirect: the bearer token would travel to wherever the redirect points;
- read an unbounded response body (:data:`MAX_RESPONSE_BYTES`), or wait longer than
  :data:`REQUEST_TIMEOUT_SECONDS` for a whole exchange, body included;
- block the reactor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import quote, urlsplit, urlunsplit

from treq.client import HTTPClient
from twisted.internet import defer
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from localai_tw import logsafe
from localai_tw.web.readers import ResponseTooLarge, read_bounded

log = Logger()

#: Seconds one register or heartbeat exchange may take, response body included.
REQUEST_TIMEOUT_SECONDS = 10.0
#: Largest response body read from the frontend.  A registration reply is a few hundred bytes.
MAX_RESPONSE_BYTES = 64 * 1024
#: Longest node id accepted from the frontend; it goes into URLs and logs.
MAX_NODE_ID_LENGTH = 255
#: Longest tunnel credential accepted from the frontend (they are about 26 to 64 characters).
MAX_CREDENTIAL_LENGTH = 4096

REGISTER_PATH = "/api/node/register"
HEARTBEAT_PATH = "/api/node/{node_id}/heartbeat"

_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]*")
_STATUS = re.compile(r"[a-z][a-z_\-]{0,31}")

#: ``capacity_provider()`` returns the capacity fields to report (``total_ram``,
#: ``available_vram`` ...): a mapping of names to ints, or None when nothing is known.
CapacityProvider = Callable[[], "Mapping[str, int] | None"]


# -- results and errors ---------------------------------------------------------------------


@dataclass(frozen=True)
class Registration:
    """What a registration returned.  ``tunnel_token`` is a secret: it is left out of ``repr``
    so a logged Registration never carries it."""

    node_id: str
    status: str
    tunnel_token: str = field(repr=False)


class RegistrationError(Exception):
    """A register or heartbeat exchange failed.  ``status`` is the HTTP status of the
    frontend's answer, or None when none was read (connection refused, timeout, bad body).
    ``hint`` says what to do about it.  Neither ever quotes a secret."""

    #: Whether trying again later can help without the operator changing anything.
    transient = True
    #: Seconds the frontend asked the caller to wait (``Retry-After``), when it did.
    retry_after: float | None = None

    def __init__(self, status: int | None, message: str, hint: str = ""):
        self.status = status
        self.message = message
        self.hint = hint
        text = f"{message} (HTTP {status})" if status is not None else message
        super().__init__(f"{text}: {hint}" if hint else text)


class FrontendUnavailable(RegistrationError):
    """No usable answer: the frontend is down, unreachable, slow, or failed (5xx).  Retry."""


class RegistrationRejected(RegistrationError):
    """The frontend refused the request (401 wrong token, 403, 400 invalid field, ...):
    retrying changes nothing until the operator (or the frontend's configuration) does."""

    transient = False

    def __init__(self, status: int | None, message: str, hint: str = "", field: str | None = None):
        self.field = field
        super().__init__(status, message, hint)


class NodeUnknown(RegistrationError):
    """The heartbeat got 404: the frontend has no row for this node id any more (deleted by an
    admin, or a fresh database).  Register again."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        super().__init__(404, f"the frontend does not know node {node_id}",
                         "registering again")


class ProtocolMismatch(RegistrationError):
    """The frontend answered 2xx with a body this client cannot use: a version mismatch."""

    transient = False


# -- URLs -------------------------------------------------------------------------------------


def http_base_url(register_to: str) -> str:
    """The frontend's HTTP base URL from ``--register-to``: ``ws`` becomes ``http`` and ``wss``
    ``https``; the path is kept as a prefix (without a trailing slash), query and fragment
    dropped."""
    parts = urlsplit(register_to.strip())
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme.lower(), parts.scheme.lower())
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) or ws(s) URL with a host: {register_to!r}")
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


class _PlainHTTPProbe(Protocol):
    """Sends one ``HEAD`` in clear and notes whether the answer starts like HTTP."""

    def __init__(self, answered: defer.Deferred):
        self._answered = answered
        self._buffer = b""

    def connectionMade(self):
        self.transport.write(b"HEAD / HTTP/1.0\r\n\r\n")

    def dataReceived(self, data: bytes):
        self._buffer += data
        if len(self._buffer) >= 5 or not b"HTTP/".startswith(self._buffer):
            self._settle(self._buffer.startswith(b"HTTP/"))
            self.transport.loseConnection()

    def connectionLost(self, reason=None):
        self._settle(self._buffer.startswith(b"HTTP/"))

    def _settle(self, plain: bool) -> None:
        if not self._answered.called:
            self._answered.callback(plain)


async def answers_plain_http(reactor, host: str, port: int, timeout: float = 3.0) -> bool:
    """Whether ``host:port`` answers an HTTP request sent in clear (at most ``timeout``
    seconds): told apart from a TLS port after a TLS exchange with it failed."""
    answered: defer.Deferred = defer.Deferred()
    endpoint = HostnameEndpoint(reactor, host, port, timeout=timeout)
    factory = Factory.forProtocol(lambda: _PlainHTTPProbe(answered))
    factory.noisy = False
    try:
        protocol = await endpoint.connect(factory)
    except Exception:
        return False
    answered.addTimeout(timeout, reactor)
    try:
        return await answered
    except defer.TimeoutError:
        return False
    finally:
        if protocol.transport is not None:
            protocol.transport.loseConnection()


# -- bounded response bodies ------------------------------------------------------------------


@implementer(IBodyProducer)
class _BytesBody:
    """A request body already in memory (a few hundred bytes of JSON), written at once: no
    cooperator task for something this small."""

    def __init__(self, body: bytes):
        self._body = bytes(body)
        self.length = len(self._body)

    def startProducing(self, consumer) -> defer.Deferred:
        consumer.write(self._body)
        return defer.succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def _error_of(body: bytes) -> tuple[str, str | None]:
    """(message, field) from ``{"error": {"message", "field"}}`` (or a text body), bounded and
    printable; a body that says nothing usable gives ``("", None)``."""
    message, field_name = "", None
    try:
        decoded = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
        if isinstance(error, dict):
            message = error.get("message") if isinstance(error.get("message"), str) else ""
            field_name = error.get("field") if isinstance(error.get("field"), str) else None
        elif isinstance(error, str):
            message = error
        elif isinstance(decoded.get("message"), str):
            message = decoded["message"]
    elif decoded is None:
        message = body.decode("utf-8", "replace")
    message = logsafe.printable(message, replacement=" ").strip()[:256]
    if field_name is not None:
        field_name = "".join(c for c in field_name if c.isprintable())[:64] or None
    return message, field_name


def _retry_after(response) -> float | None:
    """The seconds of a ``Retry-After: <seconds>`` header (at most an hour), else None."""
    values = response.headers.getRawHeaders(b"retry-after") or []
    try:
        seconds = float(values[0]) if values else None
    except ValueError:
        return None
    return None if seconds is None or not 0 <= seconds <= 3600 else seconds


#: Where the registration token came from, named in a 401's hint (see ``token_option``).
TOKEN_OPTION = "--registration-token (LOCALAI_REGISTRATION_TOKEN)"


def token_option(sources: Mapping[str, str], token_file: Any = None) -> str:
    """The option an operator must fix when the token is refused: the file when the token was
    read from ``--registration-token-file``, else ``--registration-token``."""
    if sources.get("registration-token") == "file":
        named = f" {token_file}" if token_file else ""
        return f"the token in --registration-token-file{named} (LOCALAI_REGISTRATION_TOKEN_FILE)"
    return TOKEN_OPTION


def _failure_for_status(status: int, body: bytes, what: str,
                        retry_after: float | None = None,
                        token_hint: str = TOKEN_OPTION) -> RegistrationError:
    """The error for a non-2xx answer to ``what``, with a hint per status."""
    message, field_name = _error_of(body)
    detail = f"{what} refused" + (f": {message}" if message else "")
    if status == 429:
        error = FrontendUnavailable(
            status, detail, "the frontend limits registrations (its --registration-limit) "
            "and requests with a wrong registration token per address; retrying when it says")
        error.retry_after = retry_after
        return error
    if status == 401:
        return RegistrationRejected(
            status, detail,
            f"check {token_hint}: it must equal the frontend's registration token")
    if status == 403:
        return RegistrationRejected(
            status, detail, "the frontend does not allow this node to register")
    if status == 409:
        return RegistrationRejected(
            status, detail,
            "--node-name is taken by another node (a different node key): give this worker "
            "another --node-name, or give it back that node's data directory, or have an "
            "administrator remove the node (DELETE /api/nodes/<id>); retrying")
    if status == 400:
        named = f"field {field_name!r}" if field_name else "the request"
        return RegistrationRejected(
            status, detail,
            f"the frontend rejected {named}; check the matching option "
            "(--node-name, --node-type, --label)", field=field_name)
    if status == 404:
        return RegistrationRejected(
            status, detail,
            "the frontend has no node registration API at this URL: check --register-to "
            "(and that the frontend runs in distributed mode)")
    if status == 503:
        return FrontendUnavailable(
            status, detail, "the frontend is not ready (or not in distributed mode); retrying")
    if 500 <= status <= 599:
        return FrontendUnavailable(status, detail, "the frontend failed; retrying")
    return RegistrationRejected(status, detail, "unexpected answer from the frontend")


def _decode_object(body: bytes, what: str, status: int) -> dict:
    try:
        decoded = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolMismatch(status, f"{what}: the answer is not JSON",
                               "is --register-to a localai-tw frontend?") from None
    if not isinstance(decoded, dict):
        raise ProtocolMismatch(status, f"{what}: the answer is not a JSON object",
                               "is --register-to a localai-tw frontend?")
    return decoded


def parse_registration(body: bytes, status: int = 201) -> Registration:
    """The :class:`Registration` of a 2xx register answer; :class:`ProtocolMismatch` when a
    field is missing or malformed (never quoting the credential)."""
    decoded = _decode_object(body, "registration", status)
    node_id = decoded.get("id")
    if not isinstance(node_id, str) or len(node_id) > MAX_NODE_ID_LENGTH or not _NODE_ID.fullmatch(
            node_id):
        raise ProtocolMismatch(status, "registration: the answer has no usable node id")
    node_status = decoded.get("status")
    if not isinstance(node_status, str) or not _STATUS.fullmatch(node_status):
        raise ProtocolMismatch(status, "registration: the answer has no usable status")
    token = decoded.get("tunnel_token", "")
    if token is None:
        token = ""
    if (not isinstance(token, str) or len(token) > MAX_CREDENTIAL_LENGTH
            or not all(0x21 <= ord(c) <= 0x7E for c in token)):
        raise ProtocolMismatch(status, "registration: the tunnel credential is malformed")
    return Registration(node_id, node_status, token)


def parse_heartbeat(body: bytes, status: int = 200) -> str:
    """The node status of a 2xx heartbeat answer (``""`` when the frontend sent none)."""
    if not body.strip():
        return ""
    decoded = _decode_object(body, "heartbeat", status)
    node_status = decoded.get("status", "")
    if not isinstance(node_status, str) or (node_status and not _STATUS.fullmatch(node_status)):
        raise ProtocolMismatch(status, "heartbeat: the answer has no usable status")
    return node_status


# -- the client ---------------------------------------------------------------------------------


class RegistrationClient:
    """Registers this worker with a frontend and heartbeats it.

    ``base_url`` is ``--register-to`` (``http``/``https``, or ``ws``/``wss`` mapped to them;
    a path is kept as a prefix).  ``registration_token`` may be None or empty when the frontend
    does not check one (no ``Authorization`` header is sent then).  ``node_key`` is this
    node's key (``nodekey.py``), sent with every registration.  ``capacity_provider()`` is
    read on every request.  Call :meth:`close` when done: it drops the kept-alive connections.
    """

    def __init__(
        self,
        reactor,
        base_url: str,
        registration_token: str | None,
        node_name: str,
        node_type: str,
        labels: Mapping[str, str] | None = None,
        capacity_provider: CapacityProvider | None = None,
        *,
        max_replicas_per_model: int = 1,
        timeout: float = REQUEST_TIMEOUT_SECONDS,
        agent=None,
        node_key: str = "",
        token_hint: str = TOKEN_OPTION,
    ):
        self._reactor = reactor
        self.base_url = http_base_url(base_url)
        self._token = registration_token or ""
        self._node_key = node_key
        #: The option named when the frontend refuses the token (:func:`token_option`).
        self.token_hint = token_hint
        self.node_name = node_name
        self.node_type = node_type
        self.labels = dict(labels or {})
        self._capacity_provider = capacity_provider or (lambda: None)
        self.max_replicas_per_model = max_replicas_per_model
        self.timeout = timeout
        self._pool = None
        if agent is None:
            self._pool = HTTPConnectionPool(reactor, persistent=True)
            self._pool.maxPersistentPerHost = 1
            agent = Agent(reactor, connectTimeout=timeout, pool=self._pool)
        self._http = HTTPClient(agent, data_to_body_producer=_BytesBody)

    def __repr__(self) -> str:
        return f"<RegistrationClient {self.node_name} -> {self.base_url}>"

    def _headers(self) -> dict[bytes, list[bytes]]:
        headers = {b"Accept": [b"application/json"]}
        if self._token:
            headers[b"Authorization"] = [b"Bearer " + self._token.encode("utf-8")]
        return headers

    def current_capacity(self) -> dict[str, int]:
        """The capacity to report now (the provider's, read afresh)."""
        return self._capacity()

    def _capacity(self) -> dict[str, int]:
        try:
            capacity = self._capacity_provider() or {}
        except Exception:
            log.failure("the capacity provider failed; reporting no capacity")
            return {}
        return {str(k): int(v) for k, v in capacity.items()
                if isinstance(v, int) and not isinstance(v, bool)}

    def registration_body(self) -> dict[str, Any]:
        """The JSON body of ``POST /api/node/register``.  It holds the node key: never log it."""
        key = {"node_key": self._node_key} if self._node_key else {}
        return {
            "name": self.node_name,
            **key,
            "node_type": self.node_type,
            "labels": dict(self.labels),
            "capacity": self._capacity(),
            "max_replicas_per_model": self.max_replicas_per_model,
        }

    async def _post(self, url: str, body: dict, what: str) -> tuple[int, bytes, float | None]:
        try:
            response = await self._http.post(
                url, json=body, headers=self._headers(), allow_redirects=False,
                unbuffered=True, reactor=self._reactor)
            data = await read_bounded(response, MAX_RESPONSE_BYTES)
        except ResponseTooLarge as e:
            raise ProtocolMismatch(None, f"{what}: {e}", "is --register-to a localai-tw "
                                                          "frontend?") from None
        except Exception as e:
            if _was_cancelled(e):
                # Our timeout cancelled the exchange: addTimeout turns this into its timeout.
                raise defer.CancelledError() from None
            raise FrontendUnavailable(
                None, f"{what}: cannot reach {self.base_url}: {_describe(e)}",
                "is the frontend up? retrying") from None
        return response.code, data, _retry_after(response)

    def _exchange(self, url: str, body: dict, what: str) -> defer.Deferred:
        d = defer.ensureDeferred(self._post(url, body, what))
        return d.addTimeout(self.timeout, self._reactor)

    def register(self) -> defer.Deferred:
        """Register (or re-register) this node.  Fires with a :class:`Registration`; fails with
        a :class:`RegistrationError` keeping the HTTP status."""
        url = self.base_url + REGISTER_PATH

        def answered(result):
            status, body, retry_after = result
            if not 200 <= status <= 299:
                raise _failure_for_status(status, body, "registration", retry_after,
                                          self.token_hint)
            return parse_registration(body, status)

        return self._exchange(url, self.registration_body(), "registration").addCallback(
            answered).addErrback(self._timeout_as_unavailable, "registration")

    def heartbeat(self, node_id: str, tunnel_token: str = "",
                  capacity: Mapping[str, int] | None = None) -> defer.Deferred:
        """Heartbeat ``node_id``, proving it with ``tunnel_token`` (the node's credential from
        its registration; the shared token alone does not make a worker that node).  Fires
        with the node status the frontend reports (may be ``""``); fails with
        :class:`NodeUnknown` on 404 (unknown node or a stale credential: register again), else
        a :class:`RegistrationError`.  ``capacity``: what to report (None: read it now)."""
        url = self.base_url + HEARTBEAT_PATH.format(node_id=quote(node_id, safe=""))

        def answered(result):
            status, body, retry_after = result
            if status == 404:
                raise NodeUnknown(node_id)
            if not 200 <= status <= 299:
                raise _failure_for_status(status, body, "heartbeat", retry_after,
                                          self.token_hint)
            return parse_heartbeat(body, status)

        body = {"tunnel_token": tunnel_token,
                "capacity": dict(capacity) if capacity is not None else self._capacity()}
        return self._exchange(url, body, "heartbeat").addCallback(
            answered).addErrback(self._timeout_as_unavailable, "heartbeat")

    def _timeout_as_unavailable(self, failure: Failure, what: str):
        failure.trap(defer.TimeoutError, defer.CancelledError, FrontendUnavailable)
        parts = urlsplit(self.base_url)
        if failure.check(FrontendUnavailable) and (
                parts.scheme != "https" or failure.value.status is not None):
            return failure
        if parts.scheme != "https":
            raise FrontendUnavailable(
                None, f"{what}: no answer within {self.timeout:g}s from {self.base_url}",
                "is the frontend up? retrying")
        # A TLS handshake against a plain-HTTP listener hangs (the server waits for a request
        # line that never comes) or fails with an opaque TLS error; ask the port in clear once,
        # so the message says what is wrong instead of "is the frontend up?".
        return defer.ensureDeferred(self._tls_against_plain(failure, what, parts))

    async def _tls_against_plain(self, failure: Failure, what: str, parts) -> None:
        port = parts.port or 443
        if await answers_plain_http(self._reactor, parts.hostname, port):
            raise FrontendUnavailable(
                None, f"{what}: TLS failed against a plain-HTTP port: {parts.hostname}:{port} "
                f"answers HTTP in clear, not TLS",
                "use http:// in --register-to, or give the frontend an ssl: listener "
                "(--listen ssl:...); retrying")
        if failure.check(FrontendUnavailable):
            failure.raiseException()
        raise FrontendUnavailable(
            None, f"{what}: no answer within {self.timeout:g}s from {self.base_url}",
            "is the frontend up? retrying")

    def close(self) -> defer.Deferred:
        """Drop kept-alive connections to the frontend."""
        if self._pool is None:
            return defer.succeed(None)
        return self._pool.closeCachedConnections()


def _was_cancelled(error: BaseException) -> bool:
    """Whether ``error`` is a cancellation, possibly wrapped by the HTTP client."""
    if isinstance(error, defer.CancelledError):
        return True
    reasons = getattr(error, "reasons", None)  # ResponseNeverReceived & co.
    return bool(reasons) and all(
        isinstance(r, Failure) and r.check(defer.CancelledError) for r in reasons)


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text[:256]
