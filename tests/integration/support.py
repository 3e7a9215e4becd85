"""Waiting in integration tests, on the real reactor: one way to poll for a condition and one way
to bound a Deferred, so that a test fails with a message instead of hanging, and every suite
waits the same way (``docs/testing.md``)."""

from __future__ import annotations

import inspect

from twisted.internet import defer, reactor, task


def sleep(seconds: float) -> defer.Deferred:
    """Let the reactor run for ``seconds``."""
    return task.deferLater(reactor, seconds, lambda: None)


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.02,
                     what: str = "condition"):
    """Poll ``predicate()`` (it may return an awaitable) until it is truthy, and return that value.

    The deadline is on the reactor's clock.  The predicate is asked once more when the deadline
    has passed, so a slow last poll never fails a condition that did become true in time.
    """
    deadline = reactor.seconds() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if reactor.seconds() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await sleep(interval)


def within(d, seconds: float = 20.0) -> defer.Deferred:
    """``d`` (a Deferred or a coroutine) failing with ``defer.TimeoutError`` after ``seconds``."""
    return defer.ensureDeferred(d).addTimeout(seconds, reactor)


def backend_channel(record):
    """A grpcio channel to a supervised backend (``record``: a ``BackendProcess``) that
    presents the process's own gRPC token on every call, as the replicas do (each backend
    process has one: ``backends/process.py``)."""
    import grpc

    class Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
        def _with_token(self, details):
            return details._replace(metadata=list(details.metadata or ())
                                    + [("authorization", f"Bearer {record.grpc_token}")])

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._with_token(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._with_token(details), request)

    channel = grpc.insecure_channel(record.address)
    return grpc.intercept_channel(channel, Bearer()) if record.grpc_token else channel


async def failure_of(d) -> BaseException:
    """The exception ``d`` fails with (within 20 s); an ``AssertionError`` if it succeeds."""
    try:
        await within(d)
    except Exception as e:  # noqa: BLE001 - the point is to inspect it
        return e
    raise AssertionError("expected a failure")


def process_environ(pid: int) -> dict[str, str]:
    """The environment of process ``pid`` as the kernel holds it (``/proc/<pid>/environ``)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [p.partition(b"=") for p in f.read().split(b"\0") if p]
    return {k.decode(): v.decode(errors="replace") for k, _, v in pairs}
