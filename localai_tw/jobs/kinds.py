"""The seam of job kinds: :class:`IJobKind`, what a kind is given when it runs
(:class:`JobRun`), the bounds every job obeys, and how kinds are found.

A job kind is used in two places: the frontend calls :meth:`IJobKind.validate` when a job is
submitted (``POST /api/jobs``: an unknown kind or a bad input is a 4xx before anything is
queued), and an ``agent`` worker calls :meth:`IJobKind.run` when a claimed job is sent to it
(control verb ``job.run``).  Kinds are ``twisted.plugin`` plugins, found like the backend
factories: module-level instances providing :class:`IJobKind` in ``localai_tw.plugins`` (the
built-ins, ``localai_tw/plugins/localai_builtin_jobs.py``) or ``twisted.plugins``.

Delivery is at-least-once: a job may run again after the replica driving it died, and
``JobRun.rerun`` says so; a kind whose effects must not repeat checks it.

What this module must never do: import a kind's heavy dependencies (the frontend only
validates), or let a broken plugin hide the others.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from twisted.internet import defer
from twisted.logger import Logger
from twisted.plugin import IPlugin
from zope.interface import Attribute

log = Logger()

#: Largest job input, as compact JSON.
MAX_INPUT_BYTES = 1024 * 1024
#: Largest job result, as compact JSON (checked by the worker before it answers, and again by
#: the frontend before it stores).
MAX_RESULT_BYTES = 4 * 1024 * 1024
#: Largest error text kept for a failed job.
MAX_ERROR_CHARS = 4096
#: Largest single progress event, as compact JSON; a larger one is replaced by a stub.
MAX_EVENT_BYTES = 4096
#: Progress events stored per job; later ones are counted, not stored.
MAX_EVENTS_PER_JOB = 256

_KIND_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,31}$")


class InvalidJobInput(ValueError):
    """The input of a job is not what its kind accepts.  ``field`` names the JSON path at
    fault (``input.messages``) when there is one; the message says what to send instead."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class JobFailed(Exception):
    """Raised by a kind: the job ran and failed for the reason given (the job's answer)."""


class UnknownJobKind(LookupError):
    """No plugin provides this kind."""


class IJobKind(IPlugin):
    """One kind of job.  Extends ``IPlugin`` so ``@implementer(IJobKind)`` makes a plugin."""

    name = Attribute("str: the kind as submitted, 1-32 characters of [a-z0-9_.-]")
    description = Attribute("str: one line for GET /api/jobs/kinds")

    def validate(input):
        """Return the input to store (normalised), or raise :class:`InvalidJobInput`.
        Runs on the frontend; must be cheap and must not do I/O."""

    def run(job):
        """Run the job (a :class:`JobRun`) on an agent worker.  Returns the JSON result (a
        value, Deferred or coroutine); raises :class:`JobFailed` (or any exception) when the
        job failed.  Cancellation arrives as a cancelled Deferred: let ``CancelledError``
        propagate."""


@dataclass
class JobRun:
    """What a kind gets when its job runs on an agent worker.

    :param progress: ``progress(event)`` records a progress event (a JSON object) and returns
        a Deferred that fires when the frontend reads again (await it to honour backpressure).
    :param api: the cluster's own OpenAI-compatible API (a :class:`~.api.ClusterAPI`).
    :param rerun: True when an earlier dispatch of this job reached a worker (the replica
        driving it died, or the link broke): effects of that run may already exist.
    """

    job_id: str
    kind: str
    input: Any
    rerun: bool
    progress: Callable[[dict], defer.Deferred]
    api: Any
    attempt: int = 0


def encoded_size(value: Any) -> int:
    """Bytes of ``value`` as compact ASCII JSON (what is stored and sent)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False))


def check_kind_name(name: Any) -> str:
    if not isinstance(name, str) or not _KIND_NAME.match(name):
        raise InvalidJobInput("kind must be 1-32 characters of [a-z0-9_.-]; GET /api/jobs/kinds "
                              "lists the kinds this cluster runs", field="kind")
    return name


class JobKinds:
    """Kinds by name, from plugins (:meth:`discover`) or a list (tests, embedding)."""

    def __init__(self, kinds: Iterable = ()):
        self._by_name: dict[str, Any] = {}
        for kind in kinds:
            self.add(kind)

    @classmethod
    def discover(cls, packages: Iterable | None = None) -> "JobKinds":
        from twisted.plugin import getPlugins

        if packages is None:
            import twisted.plugins

            import localai_tw.plugins

            packages = [localai_tw.plugins, twisted.plugins]
        registry = cls()
        for package in packages:
            try:
                found = list(getPlugins(IJobKind, package))
            except Exception:
                log.failure("listing job kind plugins in {package} failed",
                            package=getattr(package, "__name__", package))
                continue
            for kind in found:
                registry.add(kind)
        return registry

    def add(self, kind) -> None:
        name = getattr(kind, "name", None)
        if not isinstance(name, str) or not _KIND_NAME.match(name):
            log.warn("job kind plugin {kind!r} has no usable name; skipped", kind=kind)
            return
        if name in self._by_name and self._by_name[name] is not kind:
            log.info("job kind {name}: a later plugin overrides an earlier one", name=name)
        self._by_name[name] = kind

    def get(self, name: str):
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownJobKind(name) from None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def describe(self) -> list[dict]:
        return [{"kind": name, "description": str(getattr(self._by_name[name], "description",
                                                          ""))}
                for name in self.names()]

    def validate(self, name: Any, input: Any) -> tuple[str, Any]:
        """``(kind, normalised input)`` or :class:`InvalidJobInput` / :class:`UnknownJobKind`."""
        name = check_kind_name(name)
        kind = self.get(name)
        if encoded_size(input) > MAX_INPUT_BYTES:
            raise InvalidJobInput(f"input is larger than {MAX_INPUT_BYTES} bytes as JSON; "
                                  "split the work into several jobs", field="input")
        normalised = kind.validate(input)
        if encoded_size(normalised) > MAX_INPUT_BYTES:
            raise InvalidJobInput(f"input is larger than {MAX_INPUT_BYTES} bytes as JSON",
                                  field="input")
        return name, normalised


def bounded_event(event: Any) -> dict:
    """A progress event as stored: a JSON object of at most :data:`MAX_EVENT_BYTES`."""
    if not isinstance(event, dict):
        event = {"value": event}
    try:
        size = encoded_size(event)
    except (TypeError, ValueError):
        return {"event": "unrecordable", "note": "the progress event was not JSON"}
    if size > MAX_EVENT_BYTES:
        return {"event": str(event.get("event", "progress"))[:64], "truncated": True,
                "bytes": size}
    return event
