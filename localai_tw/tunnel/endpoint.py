"""Addressing a worker like any other network peer: an endpoint, an HTTP client, a control client.

- :class:`WorkerStreamEndpoint` is an ``IStreamClientEndpoint`` whose ``connect`` opens a tunnel
  stream (tag, target) through the :class:`~localai_tw.tunnel.route.WorkerDialer`, so anything
  built on endpoints (treq, the gRPC bridge, tests) reaches a worker the same way.
- :class:`WorkerHTTPClient` is a treq ``HTTPClient`` over ``Agent.usingEndpointFactory``: the URL
  host ``<node id>.worker.invalid`` names the worker (``.invalid`` can never resolve, so nothing
  is ever dialled by name) and every connection is an ``http`` stream.  Connections are pooled per
  node, and :meth:`WorkerHTTPClient.forget` drops one node's pool (call it on departure).
- :class:`ControlClient` calls control verbs (``POST /v1/control/<verb with dots as slashes>``)
  and maps the worker's status contract onto the conditions of ``localai_tw.errors``:

  ============================  =============================================================
  200 + ``error``               ``ControlVerbFailed`` (the worker's answer)
  200                           the reply object
  204                           None
  404                           ``VerbNotServed`` (an answer: an older worker, never absence)
  503                           ``WorkerBusy`` (present; the work did not start)
  500                           ``WorkerAnswer`` (the verb could not be served)
  400, 405, 413, 401, 403       ``TunnelProtocolError`` (a frontend bug or a configuration
                                problem, never evidence about the worker)
  anything else                 ``TunnelProtocolError``
  dial failures                 unchanged (each already one condition)
  a broken exchange             ``TransportFailure`` (nothing learned)
  ============================  =============================================================

  Streaming verbs (``application/x-ndjson``) deliver ``{"progress": ...}`` lines to a callback
  and return the final ``{"reply": ...}``; a body that ends without a reply line is a
  ``TransportFailure``.

What this module must never do: resolve or dial a worker host name; read an unbounded reply;
turn a dial failure or a broken exchange into a worker's answer; log the control token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from twisted.internet import defer, error as net_error
from twisted.internet.interfaces import IAddress, IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import _newclient
from twisted.web.client import URI, Agent, HTTPConnectionPool, PotentialDataLoss
from twisted.web.iweb import IAgent, IAgentEndpointFactory
import treq
from treq.client import HTTPClient
from zope.interface import implementer

from localai_tw import errors, staging_client
from localai_tw.tunnel import preamble
from localai_tw.web.readers import ResponseTooLarge, read_bounded

log = Logger()

WORKER_HOST_SUFFIX = ".worker.invalid"
CONTROL_PATH_PREFIX = "/v1/control/"
#: Largest unary reply, and largest NDJSON line, read from a worker.
MAX_REPLY_BYTES = 8 * 1024 * 1024
#: Persistent connections (streams) kept per worker.
PERSISTENT_PER_NODE = 4
_JSON = b"application/json"
_NDJSON = b"application/x-ndjson"


def worker_host(node_id: str) -> str:
    """The synthetic host name of a worker."""
    if not node_id or not all(c.isalnum() or c in "-_" for c in node_id) or len(node_id) > 63:
        raise ValueError(f"node id {node_id!r} cannot be a host label")
    return node_id + WORKER_HOST_SUFFIX


def worker_url(node_id: str, path: str = "/") -> str:
    """``http://<node>.worker.invalid<path>``."""
    if not path.startswith("/"):
        path = "/" + path
    return f"http://{worker_host(node_id)}{path}"


def node_of_host(host: bytes | str) -> str:
    """The node id named by a ``<node>.worker.invalid`` host; ValueError otherwise."""
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not host.endswith(WORKER_HOST_SUFFIX):
        raise ValueError(f"{host!r} is not a worker host (<node>{WORKER_HOST_SUFFIX})")
    node_id = host[: -len(WORKER_HOST_SUFFIX)]
    worker_host(node_id)  # validates
    return node_id


# -- the endpoint --------------------------------------------------------------------------------


@implementer(IAddress)
@dataclass(frozen=True)
class WorkerStreamAddress:
    """The remote address of a tunnel stream: which worker, which tag and target."""

    node_id: str
    tag: str
    target: str


@implementer(IStreamClientEndpoint)
class WorkerStreamEndpoint:
    """``connect`` opens a ``tag`` stream to ``node_id`` through ``dialer`` and fires with the
    factory's protocol after the worker's ``ok``; failures are the dialer's conditions.

    :param deadline: absolute deadline on the dialer's reactor clock, or None.
    """

    def __init__(self, dialer, node_id: str, tag: str, target: str = "",
                 deadline: float | None = None):
        self._dialer = dialer
        self.node_id = node_id
        self.tag = tag
        self.target = target
        self.deadline = deadline

    def connect(self, protocolFactory) -> defer.Deferred:
        address = WorkerStreamAddress(self.node_id, self.tag, self.target)
        try:
            protocol = protocolFactory.buildProtocol(address)
        except Exception:
            return defer.fail()
        if protocol is None:
            return defer.fail(net_error.ConnectionRefusedError("the factory built no protocol"))
        return self._dialer.open(self.node_id, self.tag, self.target, protocol, self.deadline)


@implementer(IAgentEndpointFactory)
class _WorkerEndpointFactory:
    def __init__(self, dialer):
        self._dialer = dialer

    def endpointForURI(self, uri: URI) -> WorkerStreamEndpoint:
        if uri.scheme != b"http":
            raise ValueError("worker URLs are http:// (the tunnel is the secure part)")
        return WorkerStreamEndpoint(self._dialer, node_of_host(uri.host), preamble.TAG_HTTP)


# -- the HTTP client ------------------------------------------------------------------------------


@implementer(IAgent)
class WorkerAgent:
    """An ``IAgent`` that routes each request to the per-node ``Agent`` of its URL's node."""

    def __init__(self, dialer, reactor, persistent_per_node: int = PERSISTENT_PER_NODE):
        self._dialer = dialer
        self._reactor = reactor
        self._persistent = persistent_per_node
        self._factory = _WorkerEndpointFactory(dialer)
        self._agents: dict[str, tuple[Agent, HTTPConnectionPool]] = {}

    def request(self, method, uri, headers=None, bodyProducer=None):
        try:
            node_id = node_of_host(URI.fromBytes(uri).host)
        except ValueError:
            return defer.fail()
        agent = self._agent_for(node_id)
        return agent.request(method, uri, headers, bodyProducer)

    def _agent_for(self, node_id: str) -> Agent:
        entry = self._agents.get(node_id)
        if entry is None:
            pool = HTTPConnectionPool(self._reactor, persistent=True)
            pool.maxPersistentPerHost = self._persistent
            pool.retryAutomatically = False  # a replayed POST could run a verb twice
            entry = self._agents[node_id] = (
                Agent.usingEndpointFactory(self._reactor, self._factory, pool=pool), pool)
        return entry[0]

    def nodes(self) -> list[str]:
        return sorted(self._agents)

    def forget(self, node_id: str) -> defer.Deferred:
        entry = self._agents.pop(node_id, None)
        if entry is None:
            return defer.succeed(None)
        return entry[1].closeCachedConnections()

    def close(self) -> defer.Deferred:
        pools = [pool for _, pool in self._agents.values()]
        self._agents.clear()
        return defer.DeferredList([p.closeCachedConnections() for p in pools],
                                  consumeErrors=True)


class WorkerHTTPClient(HTTPClient):
    """treq's ``HTTPClient`` whose URLs name workers: ``worker_url(node, "/v1/...")``.

    :param dialer: the ``WorkerDialer`` opening ``http`` streams.
    """

    def __init__(self, dialer, reactor=None, persistent_per_node: int = PERSISTENT_PER_NODE):
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        self.worker_agent = WorkerAgent(dialer, reactor, persistent_per_node)
        super().__init__(self.worker_agent)

    def forget(self, node_id: str) -> defer.Deferred:
        """Close and drop ``node_id``'s pooled connections (the worker departed)."""
        return self.worker_agent.forget(node_id)

    def close(self) -> defer.Deferred:
        return self.worker_agent.close()


# -- failures of an HTTP exchange -------------------------------------------------------------------

_BROKEN_EXCHANGE = (
    _newclient.ResponseFailed, _newclient.RequestTransmissionFailed,
    _newclient.RequestGenerationFailed, net_error.ConnectionLost, net_error.ConnectionDone,
    PotentialDataLoss,
)


def _as_transport_failure(failure: Failure, what: str):
    """A broken HTTP exchange is a ``TransportFailure``; conditions pass through unchanged."""
    if failure.check(errors.ClusterError, defer.CancelledError):
        return failure
    if failure.check(*_BROKEN_EXCHANGE):
        reasons = getattr(failure.value, "reasons", None) or [failure]
        detail = "; ".join(r.getErrorMessage() for r in reasons if isinstance(r, Failure))
        return Failure(errors.TransportFailure(f"{what}: the exchange broke ({detail})"))
    return failure


def with_deadline(reactor, d: defer.Deferred, timeout: float | None, what: str) -> defer.Deferred:
    """Cancel ``d`` after ``timeout`` seconds and report that as ``CallerDeadlineExceeded``; map
    a broken exchange to ``TransportFailure``."""
    deadline = None if timeout is None else reactor.seconds() + timeout
    timer = reactor.callLater(max(timeout, 0), d.cancel) if timeout is not None else None

    def finished(result):
        if timer is not None and timer.active():
            timer.cancel()
        if isinstance(result, Failure):
            if deadline is not None and reactor.seconds() >= deadline and not result.check(
                    errors.RoutingFact, errors.WorkerAnswer, errors.TunnelProtocolError,
                    errors.AbsentWithinGrace, errors.PeerRejected, errors.PoolClosed):
                return Failure(errors.CallerDeadlineExceeded(what))
            return _as_transport_failure(result, what)
        return result

    return d.addBoth(finished)


def _collect(response, collect: Callable[[bytes], None], finished: defer.Deferred) -> None:
    """Deliver the body to ``collect``; ``finished`` fires at its normal end, fails with what
    ``collect`` raised or with the broken body."""
    treq.collect(response, collect).chainDeferred(finished)


# -- the control client -----------------------------------------------------------------------------


def control_path(verb: str) -> str:
    """``/v1/control/`` + the verb with dots replaced by slashes."""
    if not verb or any(not (c.isalnum() or c in "._-") for c in verb):
        raise ValueError(f"not a control verb name: {verb!r}")
    return CONTROL_PATH_PREFIX + verb.replace(".", "/")


class ControlClient:
    """Calls worker control verbs through a :class:`WorkerHTTPClient`.

    :param token: one bearer token for every worker ('' = none sent; test harnesses).
    :param token_for: ``token_for(node_id)`` -> (awaitable of) that node's control token, read
        for every call; the frontend passes ``NodeRegistry.control_token`` so that a call
        carries the node's own token and never the shared registration token.
    """

    def __init__(self, http_client: WorkerHTTPClient, token: str = "", reactor=None, *,
                 token_for: Callable[[str], Any] | None = None):
        self._http = http_client
        self._token = token
        self._token_for = token_for
        self._reactor = reactor or getattr(http_client, "reactor", None)
        if self._reactor is None:
            from twisted.internet import reactor as _reactor
            self._reactor = _reactor

    def call(self, node_id: str, verb: str, body: dict | None = None,
             timeout: float | None = None,
             on_progress: Callable[[Any], Any] | None = None) -> defer.Deferred:
        """Run ``verb`` on ``node_id`` with the JSON object ``body``; fires with the reply dict
        (None for 204).  See the module docstring for the failure mapping."""
        what = f"control verb {verb} on worker {node_id}"
        calling = defer.ensureDeferred(self._call(node_id, verb, body or {}, on_progress, what))
        return with_deadline(self._reactor, calling, timeout, what)

    async def _call(self, node_id, verb, body, on_progress, what):
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        token = self._token
        if self._token_for is not None:
            token = await defer.maybeDeferred(self._token_for, node_id)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        response = await self._http.post(worker_url(node_id, control_path(verb)),
                                         data=json.dumps(body).encode("utf-8"), headers=headers)
        code = response.code
        content_type = (response.headers.getRawHeaders(b"content-type") or [b""])[0]
        if code == 200 and content_type.split(b";")[0].strip().lower() == _NDJSON:
            return await self._streamed(node_id, verb, response, on_progress, what)
        try:
            raw = await read_bounded(response, MAX_REPLY_BYTES)
        except ResponseTooLarge:
            raise errors.TunnelProtocolError(
                f"{what}: reply larger than {MAX_REPLY_BYTES} bytes") from None
        if code == 200:
            reply = self._decode(raw, what)
            if not isinstance(reply, dict):
                raise errors.TunnelProtocolError(f"{what}: the reply is not a JSON object")
            return self._checked(node_id, verb, reply)
        if code == 204:
            return None
        detail = _problem_of(raw)
        if code == 404:
            raise errors.VerbNotServed(node_id, verb)
        if code == 503:
            raise errors.WorkerBusy(node_id, detail or "the worker has no free slot")
        if code == 500:
            raise errors.WorkerAnswer(node_id, f"control verb {verb} could not be served: "
                                               f"{detail}")
        if code in (401, 403):
            raise errors.TunnelProtocolError(
                f"{what}: the worker refused our control credential ({code}); the worker's "
                "node key must be the one it registered with (an older worker version expects "
                "another credential: upgrade it)")
        raise errors.TunnelProtocolError(f"{what}: answered {code} ({detail}); a frontend bug, "
                                         "not evidence about the worker")

    @staticmethod
    def _decode(raw: bytes, what: str):
        try:
            return json.loads(raw)
        except ValueError:
            raise errors.TunnelProtocolError(f"{what}: the reply is not JSON") from None

    @staticmethod
    def _checked(node_id: str, verb: str, reply: dict):
        failure = reply.get("error")
        if failure:
            raise errors.ControlVerbFailed(node_id, verb, str(failure))
        return reply

    async def _streamed(self, node_id, verb, response, on_progress, what):
        buffered = bytearray()
        final: list[Any] = []

        def line(raw: bytes) -> None:
            if not raw.strip():
                return
            if final:
                raise errors.TunnelProtocolError(f"{what}: a line after the reply line")
            obj = self._decode(bytes(raw), what)
            if not isinstance(obj, dict):
                raise errors.TunnelProtocolError(f"{what}: an NDJSON line is not an object")
            if "reply" in obj:
                final.append(obj["reply"])
            elif "progress" in obj:
                if on_progress is not None:
                    on_progress(obj["progress"])
            else:
                raise errors.TunnelProtocolError(f"{what}: an NDJSON line is neither progress "
                                                 "nor reply")

        def collect(data: bytes) -> None:
            buffered.extend(data)
            while True:
                cut = buffered.find(b"\n")
                if cut < 0:
                    break
                raw = bytes(buffered[:cut])
                del buffered[: cut + 1]
                line(raw)
            if len(buffered) > MAX_REPLY_BYTES:
                raise errors.TunnelProtocolError(f"{what}: an NDJSON line over {MAX_REPLY_BYTES} "
                                                 "bytes")

        finished: defer.Deferred = defer.Deferred()
        _collect(response, collect, finished)
        await finished
        if buffered.strip():
            line(bytes(buffered))
        if not final:
            raise errors.TransportFailure(f"{what}: the progress stream ended without a reply "
                                          "line (the link broke; nothing is known about the work)")
        reply = final[0]
        if isinstance(reply, dict):
            return self._checked(node_id, verb, reply)
        return reply


def _problem_of(raw: bytes) -> str:
    try:
        decoded = json.loads(raw)
        if isinstance(decoded, dict):
            for key in ("problem", "busy", "error", "message"):
                if decoded.get(key):
                    return str(decoded[key])[:512]
    except ValueError:
        pass
    return raw[:512].decode("utf-8", "replace")


# -- file upload ------------------------------------------------------------------------------------


def upload_file(http_client: WorkerHTTPClient, node_id: str, key: str, path: str,
                token: str = "", progress_cb: Callable[[int, int], Any] | None = None,
                timeout: float | None = None,
                known: tuple[int, str] | None = None) -> defer.Deferred:
    """Stage the local file ``path`` on ``node_id`` under ``key`` (``PUT /v1/files/{key}``,
    streamed from disk, skipped when the worker already holds the same digest).

    Fires with a ``staging_client.StagedFile``.  The worker's refusals are its answers
    (``WorkerAnswer``/``WorkerBusy``); dial failures pass through; a broken exchange is a
    ``TransportFailure``.  ``known``: the file's (size, sha256) when the caller already
    hashed it (see ``staging_client.upload_file``).
    """
    what = f"uploading {key} to worker {node_id}"
    uploading = staging_client.upload_file(http_client, worker_url(node_id, "/"), key, path, progress_cb,
                                           node_id=node_id, token=token or None,
                                           reactor=http_client.reactor, known=known)
    return with_deadline(http_client.reactor, uploading, timeout, what)
