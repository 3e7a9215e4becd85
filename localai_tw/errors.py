"""The four conditions, and the only place they are defined.

Every failure on the path from a replica to a worker is exactly one of:

1. a **routing fact** (``RoutingFact``): this replica has no route to the worker now
   (``WorkerUnroutable``), or the worker departed longer ago than the reconnect grace
   (``WorkerGone``).  May be acted on: skip the node, status-only demotion, and on
   ``WorkerGone`` the departure notifier.
2. **absent within grace** (``AbsentWithinGrace``): the tunnel is reconnecting, presence is
   unknown, or the presence query failed.  Nobody may act on it.
3. an **unreachable peer** (``PeerUnreachable`` and its subclass ``PeerRejected``): a
   replica-to-replica link problem.  Retry only; never a statement about a worker.
4. the **worker's own answer** (``WorkerAnswer``): a preamble refusal with evidence, a
   control-plane reply, a gRPC result.  The only evidence that may reap a ``node_models``
   row or evict a model.

The classes deliberately share no base class below ``ClusterError``, so an ``except`` for one
condition can never catch another.  A caller's own expired deadline is ``CallerDeadlineExceeded``
and belongs to none of the four.  Modules raise these; they never invent parallel hierarchies.
"""

from __future__ import annotations


class ClusterError(Exception):
    """Base of every error this module defines.  Never caught as such to decide an action."""

    #: Whether a component may change cluster state (reap rows, evict, demote) on this error.
    actionable = False
    #: Short stable name of the condition, for logs, metrics and JSON error bodies.
    condition = "unclassified"


# -- 1. routing facts -----------------------------------------------------------------------


class RoutingFact(ClusterError):
    """This replica has no route to the worker, as a fact (not a guess)."""

    actionable = True
    condition = "routing-fact"

    def __init__(self, node_id: str, message: str, cause: BaseException | None = None):
        self.node_id = node_id
        self.cause = cause
        super().__init__(f"no route to worker {node_id}: {message}")


class WorkerUnroutable(RoutingFact):
    """No route now: not held here, no live owner, relay refused, or the owner's session would
    not carry a stream.  The cause is kept for the message only; callers must not branch on it."""


class WorkerGone(RoutingFact):
    """The worker departed longer ago than the reconnect grace (presence ``gone``)."""

    def __init__(self, node_id: str, grace_seconds: float):
        self.grace_seconds = grace_seconds
        super().__init__(node_id, f"departed more than {grace_seconds:g}s ago (gone)")


# -- 2. absent within the grace --------------------------------------------------------------


class AbsentWithinGrace(ClusterError):
    """The worker's connection is absent, but within the reconnect grace or not known.
    Nobody acts on this: the node stays schedulable and healthy."""

    actionable = False
    condition = "absent-within-grace"

    def __init__(self, node_id: str, presence: str, cause: BaseException | None = None):
        self.node_id = node_id
        self.presence = presence
        self.cause = cause
        detail = f" ({cause})" if cause is not None else ""
        super().__init__(
            f"worker {node_id} is not connected right now (presence {presence}){detail}; "
            "it may reconnect within the grace"
        )


# -- 3. unreachable peer replica ---------------------------------------------------------------


class PeerUnreachable(ClusterError):
    """A replica-to-replica link could not carry the request.  Retry only."""

    actionable = False
    condition = "peer-unreachable"

    def __init__(self, peer_id: str, message: str, cause: BaseException | None = None):
        self.peer_id = peer_id
        self.cause = cause
        super().__init__(f"peer replica {peer_id} unreachable: {message}")


class PeerRejected(PeerUnreachable):
    """The peer is up but refused our credentials: a version or configuration problem."""

    condition = "peer-rejected"


class PoolClosed(PeerUnreachable):
    """This process is shutting down its peer pool; nothing is said about the peer."""

    condition = "peer-pool-closed"

    def __init__(self):
        super().__init__("*", "the peer pool of this replica is closed (shutting down)")


# -- 4. the worker's own answer ------------------------------------------------------------------


class WorkerAnswer(ClusterError):
    """The worker itself answered with a failure.  Evidence about the worker or its backend."""

    actionable = True
    condition = "worker-answer"

    def __init__(self, node_id: str, message: str):
        self.node_id = node_id
        super().__init__(f"worker {node_id} answered: {message}")


class StreamRefused(WorkerAnswer):
    """The worker refused a tunnel stream with an evidence code (``unknown-tag``,
    ``unavailable``, ``bad-request``).  ``not-served`` is *not* this: it is a routing fact."""

    def __init__(self, node_id: str, code: str, text: str):
        self.code = code
        self.text = text
        super().__init__(node_id, f"stream refused ({code}): {text}")


class ControlVerbFailed(WorkerAnswer):
    """A control verb ran and the worker's reply carries an error (HTTP 200 with ``error``)."""

    def __init__(self, node_id: str, verb: str, error: str):
        self.verb = verb
        self.error = error
        super().__init__(node_id, f"control verb {verb} failed: {error}")


class VerbNotServed(WorkerAnswer):
    """The worker answered 404 under ``/v1/control/``: its version does not serve the verb.
    An answer (the worker is present), never absence."""

    def __init__(self, node_id: str, verb: str):
        self.verb = verb
        super().__init__(node_id, f"control verb {verb} is not served by this worker version")


class WorkerBusy(WorkerAnswer):
    """The worker answered 503 busy: present, and the work did not start."""

    def __init__(self, node_id: str, detail: str = "the worker has no free slot"):
        super().__init__(node_id, detail)


class BackendAnswer(WorkerAnswer):
    """A gRPC call reached the backend through a working route and the backend answered with a
    failure status."""

    def __init__(self, node_id: str, code: str, details: str):
        self.code = code
        self.details = details
        super().__init__(node_id, f"backend answered {code}: {details}")


class BackendCrashed(WorkerAnswer):
    """The worker said the backend process serving a call ended by itself during it (a signal
    or an exit code nobody asked for): its answer to ``backend.exit``, asked after the call
    failed.  Never inferred from a broken stream alone (that stays a ``TransportFailure``)."""

    def __init__(self, node_id: str, model: str, description: str, output: list[str],
                 node_name: str = "", fallback: str = "", signal: str | None = None,
                 exit_code: int | None = None):
        self.model = model
        self.description = description
        self.output = list(output)
        self.node_name = node_name
        self.fallback = fallback
        self.signal = signal
        self.exit_code = exit_code
        super().__init__(node_id, f"the backend of model {model} {description} during the call")


# -- outside the four ----------------------------------------------------------------------------


class CallerDeadlineExceeded(ClusterError):
    """The caller's own deadline ran out.  Blamed on the caller; never evidence."""

    actionable = False
    condition = "caller-deadline"

    def __init__(self, what: str):
        super().__init__(f"deadline exceeded by the caller while {what}")


class TunnelProtocolError(ClusterError):
    """A peer's reply broke the stream protocol (unknown refusal code, malformed frame).
    Not evidence: a newer or broken peer, not a statement about the target."""

    condition = "protocol-error"


class TransportFailure(ClusterError):
    """A stream or link broke after it was established (reset under a live copy, keepalive
    timeout).  Nothing was learned about the work."""

    condition = "transport-failure"


CONDITIONS = (RoutingFact, AbsentWithinGrace, PeerUnreachable, WorkerAnswer)


def condition_of(error: BaseException) -> str:
    """The stable condition name of ``error`` (``unclassified`` for foreign exceptions)."""
    if isinstance(error, ClusterError):
        return error.condition
    return "unclassified"


def may_act_on(error: BaseException) -> bool:
    """True only for routing facts and worker answers: the two conditions that may change
    cluster state.  Everything else, including foreign exceptions, is false."""
    return isinstance(error, (RoutingFact, WorkerAnswer))
