"""``GET /api/traces``: the recent OpenAI API requests of this replica, newest first.

A :class:`TraceRing` listens to the replica's metrics (``ReplicaMetrics.listeners``), so every
request the metrics count is traced from the same record, with no hook in the serving code.
The ring is a ``deque`` of at most :data:`CAPACITY` small dicts (bounded memory whatever the
traffic).  ``hops`` is the time in each hop the request passed (``metrics.Hops``: ``queue``,
``placement``, ``cold_load`` with its phases ``starting``/``staging``/``loading``, ``tunnel``,
``backend``, and ``first_token`` within ``backend``), filled by the serving code on the same
record.  A trace holds what was asked of whom and how it went, never what was said: no
prompt, no answer, no error message (a message can echo the client's input), only the
condition of a failure.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Iterable

from localai_tw import errors
from localai_tw.metrics import RequestRecord, condition_label

from localai_tw.frontend.api.kit import AdminResource, APIKeyGuard, Route

from localai_tw.web.errors import bad_request

#: How many requests a replica remembers (the oldest is dropped first): about 1 KB each as
#: measured with tracemalloc (1.4 KB for a cold load's trace with every hop).
CAPACITY = 1000
#: ``?limit=`` when none is given.
DEFAULT_LIMIT = 100
#: The longest condition name kept (a foreign error's code is bounded too).
_CONDITION_MAX = 64


def _condition(cause: BaseException | None) -> str | None:
    """The stable name of why a request failed: a cluster condition (``localai_tw/errors.py``)
    or the OpenAI error code of a refused request (``model_not_found``)."""
    if cause is None:
        return None
    if isinstance(cause, errors.ClusterError):
        return condition_label(cause)
    for attribute in ("code", "type"):
        name = getattr(cause, attribute, None)
        if isinstance(name, str) and name:
            return name[:_CONDITION_MAX]
    return "unclassified"


class TraceRing:
    """The last :data:`CAPACITY` finished requests (``capacity`` for tests)."""

    def __init__(self, capacity: int = CAPACITY, clock=time.time):
        self._ring: collections.deque[dict] = collections.deque(maxlen=capacity)
        self._ids = itertools.count(1)
        self._clock = clock

    def watch(self, metrics) -> None:
        """Trace every request ``metrics`` (a ``ReplicaMetrics``) records."""
        metrics.listeners.append(self.add)

    def add(self, record: RequestRecord, status: str, nodes: Iterable[str], path: str,
            ended: float) -> None:
        total = max(0.0, ended - record.started)
        first = (round(record.first_reply - record.started, 4)
                 if record.first_reply is not None else None)
        self._ring.append({
            "id": next(self._ids),
            "time": round(self._clock() - total, 3),  # arrival, seconds since the epoch
            "endpoint": record.endpoint,
            "model": record.model,
            "nodes": list(nodes),
            "path": path,
            "status": status,
            "condition": _condition(record.cause),
            "seconds": round(total, 4),
            "first_token_seconds": first,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "hops": record.hops.as_dict(),
        })

    def recent(self, limit: int = DEFAULT_LIMIT) -> list[dict]:
        """At most ``limit`` traces, newest first."""
        return list(itertools.islice(reversed(self._ring), max(0, limit)))


class TracesResource(AdminResource):
    """``/api/traces?limit=N`` (admin, ``--api-key``): ``{"traces": [...], "capacity": N}``,
    newest first; ``limit`` from 1 to the capacity (default :data:`DEFAULT_LIMIT`)."""

    def __init__(self, ring: TraceRing, guard: APIKeyGuard):
        super().__init__(guard)
        self._ring = ring

    def routes(self):
        return (Route("GET", (), self.list_traces),)

    async def list_traces(self, request) -> tuple[int, dict]:
        capacity = self._ring._ring.maxlen
        values = request.args.get(b"limit") or [str(DEFAULT_LIMIT).encode()]
        try:
            if len(values) > 1:
                raise ValueError
            limit = int(values[0].decode("ascii"))
            if not 1 <= limit <= capacity:
                raise ValueError
        except (ValueError, UnicodeDecodeError):
            raise bad_request(f"limit must be one integer from 1 to {capacity}",
                              field="limit") from None
        return 200, {"traces": self._ring.recent(limit), "capacity": capacity}
