"""What every endpoint family reads of the replica it answers for: the router, the deadline
of a new call, the clock, and the ids and ``created`` stamps of answers.

What this module must never do: hold anything of one request (that is the ``Exchange``), or
reach past ``IInferenceRouter`` into the scheduler, bridges or database.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from localai_tw.frontend.inference.interfaces import IInferenceRouter


@dataclass(frozen=True)
class Context:
    """The replica's side of every ``/v1`` answer (built once by ``OpenAIResource``).

    :param router: the replica's ``IInferenceRouter``.
    :param deadline_seconds: per-request deadline handed to the router (None: its default).
    :param reactor: the clock for deadlines and loading notices (None: the global reactor).
    :param now: wall-clock seconds for ``created`` stamps.
    :param generated: the shared store of generated files (``frontend/api/generated.py``), or
        None (images are then answered as ``b64_json`` only).
    :param responses: the Responses API's store and background runs
        (``responses_api.ResponsesParts``), or None (nothing is stored: only ``store: false``
        requests are answered).
    """

    router: IInferenceRouter
    deadline_seconds: float | None = None
    reactor: Any = None
    now: Callable[[], float] = field(default=time.time)
    generated: Any = None
    responses: Any = None

    def clock(self):
        reactor = self.reactor
        if reactor is None:
            from twisted.internet import reactor
        return reactor

    def deadline(self) -> float | None:
        """The deadline of a router call started now."""
        if self.deadline_seconds is None:
            return None
        return self.clock().seconds() + self.deadline_seconds

    def ids(self, prefix: str) -> tuple[str, int]:
        """A fresh answer id (``chatcmpl-...``) and its ``created`` stamp."""
        return f"{prefix}-{uuid.uuid4().hex}", int(self.now())
