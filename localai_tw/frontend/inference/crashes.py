"""Telling a backend crash from a broken call: after a call to a backend failed the way a dying
process makes it fail, ask the worker how that process is (control verb ``backend.exit``).

When a backend process dies during a call (SIGSEGV in llama.cpp, SIGKILL by the OOM killer, an
``exit(1)``), the frontend sees only what gRPC makes of the closed connection: ``UNAVAILABLE``
("Socket closed"), ``INTERNAL``/``UNKNOWN`` ("Stream removed"), or the tunnel stream reset under
the copy (a ``TransportFailure``).  None of these says "crashed", and a route failure looks the
same.  The worker's supervisor does know (it reaps the process and keeps its exit status and last
output lines), so :class:`CrashProbe` asks it, through the same tunnel or relay as any control
call.  Only the worker's answer ``crashed: true`` turns the failure into
:class:`~localai_tw.errors.BackendCrashed` (the worker's own answer, ARCHITECTURE §5); any other
answer, or no answer, leaves the original failure as it was.

What this module must never do: call a failure a crash without the worker saying so; let a
probe that hangs hold the request (bounded by :data:`PROBE_TIMEOUT`); pass the worker's words
on unbounded (lines and characters are capped here too, whatever the worker sent).
"""

from __future__ import annotations

from twisted.logger import Logger

from localai_tw import errors
from localai_tw.logsafe import untrusted

log = Logger()

#: gRPC status names a call gets when the backend process goes away under it.
CRASH_SHAPED_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "CANCELLED"})
#: Seconds the whole ``backend.exit`` question may take (the worker waits at most 2 s itself).
PROBE_TIMEOUT = 5.0
#: What is kept of the worker's answer.
MAX_LINES, MAX_LINE_CHARS, MAX_FIELD_CHARS = 10, 300, 200


def crash_shaped(error: BaseException) -> bool:
    """Whether ``error`` is what a call sees when its backend process dies."""
    if isinstance(error, errors.BackendCrashed):
        return False
    if isinstance(error, errors.BackendAnswer):
        return error.code in CRASH_SHAPED_CODES
    return isinstance(error, errors.TransportFailure)


def _text(value, limit: int = MAX_FIELD_CHARS) -> str:
    return value[:limit] if isinstance(value, str) else ""


class CrashProbe:
    """Asks a worker whether the backend of a failed call crashed (module docstring)."""

    def __init__(self, control, timeout: float = PROBE_TIMEOUT):
        self._control = control
        self.timeout = timeout

    async def explain(self, placement) -> errors.BackendCrashed | None:
        """The crash of ``placement``'s backend as the worker tells it, or None."""
        try:
            port = int(placement.address.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return None
        try:
            reply = await self._control.call(placement.node_id, "backend.exit",
                                             {"port": port}, timeout=self.timeout)
        except Exception as e:  # no answer: nothing is known, the call's failure stands
            log.info("could not ask node {node} how the backend of {model} ended: {err}",
                     node=placement.node_id, model=placement.model_name, err=e)
            return None
        if not isinstance(reply, dict) or reply.get("crashed") is not True:
            return None
        if reply.get("model") != placement.model_name:
            return None  # another model's process: not this call's backend
        output = reply.get("output")
        lines = [_text(line, MAX_LINE_CHARS) for line in output[-MAX_LINES:]] \
            if isinstance(output, list) else []
        exit_code = reply.get("exit_code")
        crash = errors.BackendCrashed(
            placement.node_id, placement.model_name,
            _text(reply.get("description")) or "exited", lines,
            node_name=_text(reply.get("node_name")), fallback=_text(reply.get("fallback"), 500),
            signal=_text(reply.get("signal")) or None,
            exit_code=exit_code if isinstance(exit_code, int) and
            not isinstance(exit_code, bool) else None)
        log.warn("model {model} on node {node}: the backend {how} during a call"
                 "{fallback}", model=placement.model_name, node=placement.node_id,
                 how=untrusted(crash.description),
                 fallback=f"; {untrusted(crash.fallback, 500)}" if crash.fallback else "")
        return crash
