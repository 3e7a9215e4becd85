"""Every Prometheus metric of a frontend replica and of a worker, defined in one place
(``docs/metrics.md``).

One :class:`ReplicaMetrics` per replica, each with its own ``CollectorRegistry`` (never
``prometheus_client``'s global one), so several replicas in one process (the tests) never share
a counter.  The serving code reports through one-line calls into this module
(:meth:`ReplicaMetrics.request`, :meth:`RequestRecord.finished`, :meth:`ReplicaMetrics.cold_load`);
:data:`DISCARD` takes the same calls where nothing is exposed (unit tests, tools).  Gauges of
state the replica already holds (tunnels, open streams) are read when scraped by a custom
collector, so nothing is counted on the per-frame path.  A worker's are a
:class:`WorkerMetrics`, served as its control verb ``node.metrics``.

Label values are bounded: ``endpoint`` is one of a fixed set, ``model`` is a name the replica
has a config for (an unknown name is recorded as ``""``), ``status`` an HTTP code, ``path`` one
of ``owner``/``relay``/``none``, ``condition`` a name from :mod:`localai_tw.errors`.

This module must never import anything of ours but the base modules, block, or raise into the
code that reports to it.
"""

from __future__ import annotations

import contextvars
import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from localai_tw import errors

#: Content type of :func:`exposition` (Prometheus text format 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_LATEST

#: ``endpoint`` label values: the OpenAI API's routes (anything else is ``other``).
ENDPOINTS = {
    (b"chat", b"completions"): "chat",
    (b"completions",): "completions",
    (b"embeddings",): "embeddings",
    (b"models",): "models",
    (b"models", b"capabilities"): "capabilities",
    (b"tokenize",): "tokenize",
    (b"detokenize",): "detokenize",
    (b"rerank",): "rerank",
    (b"audio", b"speech"): "speech",
    (b"tts",): "speech",  # LocalAI's /tts (mounted at the root; the same endpoint)
    (b"audio", b"transcriptions"): "transcriptions",
    (b"images", b"generations"): "images",
    # Ollama's API (/api/<name>; frontend/api/ollama)
    **{(b"ollama", name): "ollama_" + name.decode() for name in (
        b"chat", b"generate", b"embed", b"embeddings", b"show", b"tags", b"ps", b"version")},
    (b"messages",): "messages",  # the Anthropic Messages API (/v1/messages and /messages)
    (b"responses",): "responses",  # the Responses API (/v1/responses and /responses)
}

#: A client that left before its answer was complete (nginx's code for it).
CLIENT_GONE = "499"

#: Latency buckets (seconds): from a cached short answer to a long generation.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Cold-load buckets (seconds): a small model in a second up to a large one in minutes.
LOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)


def endpoint_of(postpath: Iterable[bytes]) -> str:
    """The bounded ``endpoint`` label of an OpenAI API path below ``/v1``."""
    segments = [s for s in postpath if s]
    if tuple(segments) in ENDPOINTS:
        return ENDPOINTS[tuple(segments)]
    if len(segments) >= 2 and segments[0] == b"models":
        return "model"
    if len(segments) >= 2 and segments[0] == b"responses":
        return "response"  # /v1/responses/{id}[/cancel|/input_items]
    return ENDPOINTS.get(tuple(segments), "other")


def condition_label(error: BaseException) -> str:
    """The ``condition`` label of an error: one of the four conditions of
    :mod:`localai_tw.errors` (a subclass counts as its condition: ``peer-rejected`` is
    ``peer-unreachable``), else the error's own stable name (``caller-deadline``,
    ``transport-failure``, ``protocol-error``), ``unclassified`` for foreign exceptions."""
    for condition in errors.CONDITIONS:
        if isinstance(error, condition):
            return condition.condition
    return errors.condition_of(error)


#: The hops of a request, in the order it passes them: they do not overlap, so their sum is at
#: most the request's total (``docs/operators.md``, "Traces").
HOPS = ("queue", "placement", "cold_load", "tunnel", "backend")
#: The phases of a cold load (within ``cold_load``), as the load lock records them.
LOAD_PHASES = ("starting", "staging", "loading")


class Hops:
    """Seconds one request spent in each hop (:data:`HOPS`, the phases of a cold load it drove,
    and ``first_token``: from the start of the backend call to its first reply, within
    ``backend``).  One small object per request, filled by the serving code through
    :func:`current_hops`; a hop never passed stays None.  Durations from ``clock``
    (monotonic; a ``task.Clock``'s ``seconds`` in tests).  Nothing of what was said is kept."""

    __slots__ = HOPS + LOAD_PHASES + ("first_token", "clock", "_phase", "_phase_at",
                                      "locked_at", "backend_at", "_bridge", "_dials")
    _MARKS = ("_phase", "_phase_at", "locked_at", "backend_at", "_bridge", "_dials")

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        for name in HOPS + LOAD_PHASES + ("first_token",) + self._MARKS:
            setattr(self, name, None)

    def now(self) -> float:
        return self.clock()

    def add(self, hop: str, since: float) -> float:
        """Count the time from ``since`` (a :meth:`now`) to now in ``hop``; returns now."""
        now = self.clock()
        setattr(self, hop, (getattr(self, hop) or 0.0) + max(0.0, now - since))
        return now

    def phase(self, name: str | None) -> None:
        """A cold load's phase ``name`` begins (None: the load ended); the one before ends."""
        now = self.clock()
        if self._phase is not None:
            self.add(self._phase, self._phase_at)
        self._phase, self._phase_at = name, now

    def locked(self) -> None:
        """The load lock is this request's: the wait (``queue``) ends, its load begins."""
        self.locked_at = self.clock()

    def loaded(self, since: float) -> None:
        """``LoadLock.load`` returned (or failed): the time since ``since`` was the wait for
        the lock (``queue``), then, if this request took it, the load it drove
        (``cold_load``, with its last phase closed)."""
        locked, self.locked_at = self.locked_at, None
        if locked is None:
            self.add("queue", since)  # another replica or request loaded it, or it failed
            return
        self.queue = (self.queue or 0.0) + max(0.0, locked - since)
        self.phase(None)
        self.add("cold_load", locked)

    def calling(self, bridge=None) -> "Hops":
        """``with hops.calling(bridge):`` around the backend call: its time is ``backend``,
        less the time ``bridge`` (a ``GrpcBridge``, or a ``TunnelBackendClient``, which opens a
        stream for every call) took to open a tunnel stream when the call had to open one (``tunnel``: through the relay when another replica holds the
        worker's tunnel)."""
        self._bridge = bridge
        self._dials = getattr(bridge, "dials_ok", None)
        self.backend_at = self.clock()
        return self

    def __enter__(self) -> "Hops":
        return self

    def __exit__(self, *exc) -> None:
        elapsed = max(0.0, self.clock() - self.backend_at)
        bridge, dials = self._bridge, self._dials
        self._bridge = self._dials = None
        dialled = getattr(bridge, "last_dial_seconds", None)
        if dials is not None and dialled is not None and bridge.dials_ok > dials:
            opened = min(elapsed, max(0.0, dialled))
            self.tunnel = (self.tunnel or 0.0) + opened
            elapsed -= opened
            if self.first_token is not None:  # within ``backend``: the stream opened first
                self.first_token = max(0.0, self.first_token - opened)
        self.backend = (self.backend or 0.0) + elapsed

    def as_dict(self) -> dict[str, float]:
        """The hops passed, in seconds (4 decimals)."""
        out = {}
        for name in HOPS + LOAD_PHASES + ("first_token",):
            value = getattr(self, name)
            if value is not None:
                out[name] = round(value, 4)
        return out


class _NoHops(Hops):
    """Where no request is traced (a cold load started by a tool, a unit test): keeps nothing."""

    __slots__ = ()

    def add(self, hop: str, since: float) -> float:
        return self.clock()

    def phase(self, name: str | None) -> None:
        return None

    def locked(self) -> None:
        return None

    def loaded(self, since: float) -> None:
        return None

    def calling(self, bridge=None) -> "Hops":
        return self

    def __exit__(self, *exc) -> None:
        return None


_NO_HOPS = _NoHops()
_current_hops: contextvars.ContextVar[Hops] = contextvars.ContextVar("localai_tw_hops",
                                                                     default=_NO_HOPS)


def trace_hops(hops: Hops) -> None:
    """Make ``hops`` the current request's (``OpenAIResource`` at the start of each request:
    each request runs in its own coroutine, so its own copy of the context, and the router
    calls it starts inherit it)."""
    _current_hops.set(hops)


def current_hops() -> Hops:
    """The hops of the request being served here (a sink that keeps nothing outside one)."""
    return _current_hops.get()


class RequestRecord:
    """What one OpenAI API request reports while it runs; :meth:`finished` records it once.
    The serving code sets ``model`` once the name resolves to a config and calls
    :meth:`replied` on the first backend reply of a stream (time to first token)."""

    __slots__ = ("_metrics", "endpoint", "model", "started", "first_reply", "prompt_tokens",
                 "completion_tokens", "cause", "_done", "hops")

    def __init__(self, metrics: "ReplicaMetrics | None", endpoint: str):
        self._metrics = metrics
        self.endpoint = endpoint
        self.model = ""
        self.started = time.monotonic()
        self.first_reply: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cause: BaseException | None = None
        self._done = False
        #: Time in each hop (traces only; the metrics do not read it).
        self.hops = Hops()

    def replied(self) -> None:
        if self.first_reply is None:
            self.first_reply = time.monotonic()

    def usage(self, usage: dict | None) -> None:
        """Take the token counts of an OpenAI ``usage`` object, or an Anthropic one
        (``input_tokens``, ``output_tokens``); the last one wins."""
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens")
                                     or usage.get("input_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens")
                                         or usage.get("output_tokens") or 0)

    def failed(self, cause: BaseException | None) -> None:
        self.cause = cause

    def finished(self, status: int | str, nodes: Iterable[str] = ()) -> None:
        """The answer is complete (``status``) or the client left (:data:`CLIENT_GONE`);
        ``nodes`` are the workers that served it."""
        if self._done or self._metrics is None:
            return
        self._done = True
        try:
            self._metrics._record(self, str(status), list(nodes))
        except Exception:  # a metric must never break an answer
            pass


class _TunnelCollector:
    """Gauges of the tunnels this replica holds, read from its ``TunnelRegistry`` when
    scraped (in the reactor thread: see :func:`exposition`)."""

    def __init__(self, tunnels, peer_links: Iterable = ()):
        self._tunnels = tunnels
        self._peer_links = list(peer_links)

    def collect(self):
        held = GaugeMetricFamily("localai_tunnels_held",
                                 "Worker tunnels this replica holds now.")
        streams = GaugeMetricFamily("localai_tunnel_streams_open",
                                    "Streams open on the worker tunnels held here.")
        moved = CounterMetricFamily(
            "localai_tunnel_bytes", "Wire bytes through the worker tunnels this replica held "
            "(yamux headers included; in: from workers, out: to workers).",
            labels=["direction"])
        nodes = self._tunnels.held_nodes()
        count = 0
        for node in nodes:
            session = self._tunnels.session_for(node)
            count += session.streamCount if session is not None else 0
        received, sent = self._tunnels.bytes.totals()
        held.add_metric([], len(nodes))
        streams.add_metric([], count)
        moved.add_metric(["in"], received)
        moved.add_metric(["out"], sent)
        relayed = CounterMetricFamily(
            "localai_relay_bytes", "Wire bytes on the peer links of this replica, both the "
            "ones it dialled and the ones it accepted (relayed requests and their answers, "
            "pings; in: from other replicas, out: to them).", labels=["direction"])
        received = sent = 0
        for links in self._peer_links:
            more_in, more_out = links.bytes.totals()
            received, sent = received + more_in, sent + more_out
        relayed.add_metric(["in"], received)
        relayed.add_metric(["out"], sent)
        yield held
        yield streams
        yield moved
        yield relayed

    def describe(self):
        return []  # unchecked names: collect() reads live state, not at registration


class _BackendCallCollector:
    """Gauges of this replica's backend calls, read from its ``BackendClients`` when scraped:
    the ``call`` streams pooled idle (``tunnelcalls.py`` bounds them per node and per client)
    and the calls in flight."""

    def __init__(self, clients):
        self._clients = clients

    def collect(self):
        idle = GaugeMetricFamily("localai_backend_call_streams_idle",
                                 "Tunnel call streams pooled idle, ready for the next call.")
        idle.add_metric([], sum(self._clients.idle_by_node.values()))
        in_flight = GaugeMetricFamily("localai_backend_calls_in_flight",
                                      "Backend calls (unary and streams) not finished yet.")
        in_flight.add_metric([], sum(getattr(client, "in_flight", 0)
                                     for client in self._clients.open_clients().values()))
        yield idle
        yield in_flight

    def describe(self):
        return []


class _NodeCollector:
    """Node counts from the last health pass this replica ran (``HealthMonitor.last_report``):
    no query per scrape.  Only one replica runs each pass, so a replica exposes them only while
    its last pass is recent (one of its last three ticks); aggregate across replicas with
    ``max``."""

    #: A pass older than this many ticks (health intervals) is not shown.
    RECENT_TICKS = 3

    def __init__(self, health):
        self._health = health

    def collect(self):
        health = self._health
        report = health.last_report
        if report is None or report.list_error is not None:
            return
        if health.ticks - health.last_report_tick >= self.RECENT_TICKS:
            return
        statuses = GaugeMetricFamily(
            "localai_nodes", "Workers by status after the last health pass this replica ran.",
            labels=["status"])
        for status, count in sorted(report.statuses.items()):
            statuses.add_metric([status], count)
        presence = GaugeMetricFamily(
            "localai_node_presence", "Workers by tunnel presence as the last health pass "
            "this replica ran read it (draining and offline workers are not read).",
            labels=["presence"])
        for seen, count in sorted(report.presence.items()):
            presence.add_metric([seen], count)
        yield statuses
        yield presence

    def describe(self):
        return []


class _BusCollector:
    """The counters a ``PgBus`` and ``ClaimConsumer`` keep anyway (``published``,
    ``spilled``, ``dropped``, ``reconnects``; ``stats``, ``inFlight``), read when scraped."""

    def __init__(self, bus=None, consumers: Iterable = ()):
        self._bus = bus
        self._consumers = list(consumers)

    def collect(self):
        bus = self._bus
        if bus is not None:
            published = CounterMetricFamily(
                "localai_bus_messages_published", "Broadcasts this replica published "
                "(PostgreSQL took them), by how: inline in the NOTIFY or spilled to a row.",
                labels=["how"])
            published.add_metric(["inline"], bus.published - bus.spilled)
            published.add_metric(["spilled"], bus.spilled)
            dropped = CounterMetricFamily(
                "localai_bus_messages_dropped", "Broadcasts this replica received but dropped, "
                "by stage (inbound, decode, resolve, subscriber).", labels=["stage"])
            for stage, count in sorted(bus.dropped.items()):
                dropped.add_metric([stage], count)
            reconnects = CounterMetricFamily(
                "localai_bus_reconnects", "Times the bus's LISTEN connection was re-made.")
            reconnects.add_metric([], bus.reconnects)
            yield published
            yield dropped
            yield reconnects
        if not self._consumers:
            return
        claims = CounterMetricFamily(
            "localai_claims", "Work claims this replica's consumers handled, by outcome "
            "(claimed; then completed, released: backed off after a transport failure or "
            "cancelled, failed, kept, lost, exhausted).", labels=["outcome"])
        for outcome in ("claimed", "completed", "released", "failed", "kept", "lost",
                        "exhausted"):
            claims.add_metric([outcome], sum(c.stats.get(outcome, 0) for c in self._consumers))
        in_flight = GaugeMetricFamily("localai_claims_in_flight",
                                      "Claims this replica's consumers hold now.")
        in_flight.add_metric([], sum(c.inFlight for c in self._consumers))
        yield claims
        yield in_flight

    def describe(self):
        return []


class _JobsCollector:
    """The jobs queue as a replica last read it (``frontend/jobs/stats.py`` reads it every 15 s;
    a scrape makes no query): nothing before the first read."""

    def __init__(self, read: Callable[[], dict | None]):
        self._read = read

    def collect(self):
        snapshot = self._read()
        if not snapshot:
            return
        jobs = GaugeMetricFamily(
            "localai_jobs", "Jobs not finished yet, by state (queued, running), as last read "
            "from the database.", labels=["state"])
        for state, count in sorted(snapshot.get("jobs", {}).items()):
            jobs.add_metric([state], count)
        claims = GaugeMetricFamily(
            "localai_job_claims", "The claim queue of jobs, by status: ready (claimable now), "
            "backing_off (released after a failure that said nothing about the job, waiting "
            "for its database-clock backoff), held (claimed by a replica).", labels=["status"])
        for status, count in sorted(snapshot.get("claims", {}).items()):
            claims.add_metric([status], count)
        yield jobs
        yield claims

    def describe(self):
        return []


class ReplicaMetrics:
    """The metrics of one frontend replica, in their own registry (a new one by default).
    Request paths are ``owner`` until :meth:`watch_tunnels` says which tunnels are held."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        #: ``labels()`` children of the per-request metrics (:meth:`_child`).
        self._children: dict = {}
        self._path_of: Callable[[str], str] = lambda node: "owner"
        #: Called with every finished request as ``(record, status, nodes, path, ended)``
        #: (``ended``: ``time.monotonic()``), after the metrics: the trace ring
        #: (``frontend/api/traces.py``).  A listener that raises is ignored.
        self.listeners: list[Callable[[RequestRecord, str, list[str], str, float], None]] = []
        r = self.registry
        self.requests = Counter(
            "localai_requests", "OpenAI API requests answered, by endpoint, model, HTTP "
            "status (499: the client left) and path (owner: through a tunnel held here, relay: "
            "through the replica holding it, none: no worker served it).",
            ["endpoint", "model", "status", "path"], registry=r)
        self.latency = Histogram(
            "localai_request_duration_seconds", "Time from a request's arrival to the end of "
            "its answer.", ["endpoint", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram(
            "localai_time_to_first_token_seconds", "Streams: time from a request's arrival to "
            "the first backend reply.", ["endpoint", "model"], buckets=LATENCY_BUCKETS,
            registry=r)
        self.tokens = Counter(
            "localai_tokens", "Tokens of answered requests as the backend reported them "
            "(in: prompt, out: completion).", ["model", "direction"], registry=r)
        self.errors = Counter(
            "localai_errors", "OpenAI API requests that failed on a cluster error, by the "
            "condition of the error (localai_tw/errors.py).", ["endpoint", "condition"],
            registry=r)
        self.cold_loads = Counter(
            "localai_cold_loads", "Cold loads of a model on a worker started by this replica, "
            "by outcome (ok, failed).", ["model", "outcome"], registry=r)
        self.cold_load_duration = Histogram(
            "localai_cold_load_duration_seconds", "How long cold loads took (both outcomes).",
            ["model"], buckets=LOAD_BUCKETS, registry=r)
        self.unloads = Counter(
            "localai_model_unloads", "Unloads of a model on a worker asked by this replica, by "
            "reason (admin, eviction, idle-watchdog, busy-watchdog) and outcome (stopped, busy, "
            "loading, not-loaded, not-delivered, worker-failed).",
            ["model", "reason", "outcome"], registry=r)
        self.last_used_writes = Counter(
            "localai_last_used_writes", "Statements this replica wrote to record when models "
            "were last used (one per flush, at most one a second).", registry=r)
        self.prefix_routes = Counter(
            "localai_prefix_routes", "Requests to a model with several loaded replicas routed "
            "by the prefix cache, by outcome (warm: to the replica holding the longest prefix, "
            "cold: no useful match, forced-away: the warm replica was too busy, so another one "
            "served; a scale-up signal).", ["model", "outcome"], registry=r)

    # -- what the serving code calls ---------------------------------------------------------

    def request(self, postpath: Iterable[bytes]) -> RequestRecord:
        """A record for an OpenAI API request to ``/v1/<postpath>``."""
        return RequestRecord(self, endpoint_of(postpath))

    def cold_load(self, model: str, seconds: float, ok: bool) -> None:
        self.cold_loads.labels(model, "ok" if ok else "failed").inc()
        self.cold_load_duration.labels(model).observe(max(0.0, seconds))

    def unload(self, model: str, reason: str, outcome: str) -> None:
        self.unloads.labels(model, reason, outcome).inc()

    def last_used_write(self) -> None:
        self.last_used_writes.inc()

    def prefix_routed(self, model: str, outcome: str) -> None:
        self.prefix_routes.labels(model, outcome).inc()

    def watch_tunnels(self, tunnels, peer_links: Iterable = ()) -> None:
        """Expose the gauges and byte counts of ``tunnels`` (a ``TunnelRegistry``) and of
        ``peer_links`` (objects with a ``bytes`` tally: the accepted links and the peer pool),
        and label request paths by whether ``tunnels`` holds the serving node."""
        self._path_of = lambda node: "owner" if tunnels.holds(node) else "relay"
        self.registry.register(_TunnelCollector(tunnels, peer_links))

    def watch_backend_calls(self, clients) -> None:
        """Expose the idle pooled ``call`` streams and the calls in flight of ``clients`` (the
        replica's ``BackendClients``)."""
        self.registry.register(_BackendCallCollector(clients))

    def watch_bus(self, bus=None, consumers: Iterable = ()) -> None:
        """Expose the counters of ``bus`` (a ``PgBus``) and of ``consumers``
        (each a ``ClaimConsumer``): every replica's bus and jobs consumer."""
        self.registry.register(_BusCollector(bus, consumers))

    def watch_jobs(self, read: Callable[[], dict | None]) -> None:
        """Expose the jobs queue: ``read()`` answers the last snapshot
        ``{"jobs": {state: n}, "claims": {status: n}}`` (or None before the first)."""
        self.registry.register(_JobsCollector(read))

    def watch_health(self, health) -> None:
        """Expose node counts from ``health`` (a ``HealthMonitor``)."""
        self.registry.register(_NodeCollector(health))

    # -- recording ---------------------------------------------------------------------------

    def _child(self, metric, *labels: str):
        """``metric.labels(*labels)``, kept per (metric, labels): ``labels()`` costs a lock
        and several checks per call, and every request records four or five.  The labels are
        bounded (endpoints, configured model names, statuses), so is this cache, as
        ``prometheus_client``'s own children are."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _record(self, record: RequestRecord, status: str, nodes: list[str]) -> None:
        now = time.monotonic()
        endpoint, model = record.endpoint, record.model
        path = self._path_of(nodes[-1]) if nodes else "none"
        child = self._child
        child(self.requests, endpoint, model, status, path).inc()
        child(self.latency, endpoint, model).observe(now - record.started)
        if record.first_reply is not None:
            child(self.first_token, endpoint, model).observe(
                record.first_reply - record.started)
        if record.prompt_tokens:
            child(self.tokens, model, "in").inc(record.prompt_tokens)
        if record.completion_tokens:
            child(self.tokens, model, "out").inc(record.completion_tokens)
        if isinstance(record.cause, errors.ClusterError):  # not a refused request (OpenAIError)
            self.errors.labels(endpoint, condition_label(record.cause)).inc()
        for listener in self.listeners:
            try:
                listener(record, status, nodes, path, now)
            except Exception:  # a trace must never break an answer nor the other listeners
                pass


class _Discard(ReplicaMetrics):
    """Takes every report and keeps nothing (where no registry is exposed)."""

    def __init__(self):
        super().__init__(CollectorRegistry())

    def request(self, postpath: Iterable[bytes]) -> RequestRecord:
        return RequestRecord(None, endpoint_of(postpath))

    def cold_load(self, model: str, seconds: float, ok: bool) -> None:
        return None

    def unload(self, model: str, reason: str, outcome: str) -> None:
        return None

    def last_used_write(self) -> None:
        return None

    def prefix_routed(self, model: str, outcome: str) -> None:
        return None


#: The metrics of code that exposes none.
DISCARD = _Discard()


class _WorkerCollector:
    """A worker's tunnel, read from its ``TunnelDialer`` (``session``, ``isConnected``) and
    its registrar (``heartbeat_failures``, ``stamp_notices``) when scraped.  A tunnel session
    is counted from the first scrape that sees it and kept once it ends (``ByteTally``-like),
    so the byte counter only misses sessions that came and went between two scrapes."""

    def __init__(self, dialer, registrar):
        self._dialer = dialer
        self._registrar = registrar
        self._seen: dict[int, tuple[object, list[int]]] = {}
        self._ended = [0, 0]

    def _bytes(self) -> tuple[int, int]:
        session = getattr(self._dialer, "session", None)
        if session is not None and id(session) not in self._seen:
            for old, last in self._seen.values():  # a new session: the old ones ended
                self._ended[0] += getattr(old, "bytesReceived", last[0])
                self._ended[1] += getattr(old, "bytesSent", last[1])
            self._seen = {id(session): (session, [0, 0])}
        received, sent = self._ended
        for live, last in self._seen.values():
            last[:] = [getattr(live, "bytesReceived", 0), getattr(live, "bytesSent", 0)]
            received, sent = received + last[0], sent + last[1]
        return received, sent

    def collect(self):
        session = getattr(self._dialer, "session", None)
        connected = GaugeMetricFamily("localai_worker_tunnel_connected",
                                      "1 while this worker's tunnel to a replica is open.")
        connected.add_metric([], 1 if self._dialer.isConnected else 0)
        streams = GaugeMetricFamily("localai_worker_tunnel_streams_open",
                                    "Streams open on this worker's tunnel.")
        streams.add_metric([], session.streamCount if session is not None else 0)
        moved = CounterMetricFamily(
            "localai_worker_tunnel_bytes", "Wire bytes through this worker's tunnels (in: from "
            "the frontend, out: to it).", labels=["direction"])
        received, sent = self._bytes()
        moved.add_metric(["in"], received)
        moved.add_metric(["out"], sent)
        failures = GaugeMetricFamily("localai_worker_heartbeat_failures",
                                     "Heartbeats that failed in a row (0 after a success).")
        failures.add_metric([], getattr(self._registrar, "heartbeat_failures", 0))
        notices = CounterMetricFamily(
            "localai_worker_stamp_notices", "Notices from the tunnel's replica that it stamped "
            "this worker's heartbeat (each puts the HTTP heartbeat's refresh off).")
        notices.add_metric([], getattr(self._registrar, "stamp_notices", 0))
        yield connected
        yield streams
        yield moved
        yield failures
        yield notices

    def describe(self):
        return []


class WorkerMetrics:
    """The metrics of one worker, in their own registry.  The worker serves them as the
    control verb ``node.metrics`` (:meth:`control_verb`); the frontend exposes them at
    ``/api/nodes/{id}/metrics``."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()

    def watch_worker(self, dialer, registrar) -> None:
        self.registry.register(_WorkerCollector(dialer, registrar))

    def control_verb(self) -> Callable[[dict], "object"]:
        """The handler of ``node.metrics``: the exposition as text in a JSON answer."""
        async def node_metrics(body: dict) -> dict:
            return {"content_type": CONTENT_TYPE,
                    "exposition": exposition(self.registry).decode("utf-8")}

        return node_metrics


class _Gathered:
    """A one-shot collector of families already built (:func:`gathered_exposition`)."""

    def __init__(self, families):
        self._families = families

    def collect(self):
        return iter(self._families)


def gathered_exposition(answers: Iterable[tuple[str, str | None]]) -> bytes:
    """One exposition of several workers' (``(node_id, exposition or None)``): every sample
    gains a ``node`` label, and ``localai_worker_scrape_ok{node}`` says whose answer was read
    (0: the call failed or the answer did not parse)."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}
    scraped = GaugeMetricFamily("localai_worker_scrape_ok", "1 when this worker's metrics "
                                "were read through its tunnel for this scrape.",
                                labels=["node"])
    for node, text in answers:
        ok = 0
        if text is not None:
            try:
                families = list(text_string_to_metric_families(text))
            except Exception:
                families = None
            if families is not None:
                ok = 1
                for family in families:
                    into = merged.setdefault(family.name, Metric(
                        family.name, family.documentation, family.type))
                    for sample in family.samples:
                        into.add_sample(sample.name, {**sample.labels, "node": node},
                                        sample.value, sample.timestamp)
        scraped.add_metric([node], ok)
    registry = CollectorRegistry()
    registry.register(_Gathered([*merged.values(), scraped]))
    return generate_latest(registry)


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format.  Called in the reactor thread on purpose:
    ``prometheus_client.twisted.MetricsResource`` would collect in the reactor's thread pool,
    where the collectors would read the reactor's state (the tunnel table) from another
    thread.  Collecting is a few microseconds per metric, so it does not hold the reactor."""
    return generate_latest(registry)
