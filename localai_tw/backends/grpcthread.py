"""One completion thread per grpcio channel for the channel's whole life, instead of one per
burst of calls.

grpcio's synchronous channel completes its future-mode calls (``.future()``, a server stream's
iterator) on a thread it starts when a call begins on a channel with no call in flight, and
which ends when the channel's last call ends.  A worker answering one request at a time is
always in that case: every backend call started, and tore down, a thread.  Measured
(``benchmarks/bench_grpc_calls.py``, sequential unary calls, the calling process only): 516 ->
373 us of CPU per call (docs/benchmarks.md, "The worker's backend call without a thread per
call").

grpcio has no public switch for this.  :func:`keep_completion_thread` uses three private
names of grpcio (:data:`INTERNALS`; tests/unit/test_grpcthread.py checks the pinned grpcio
has them): the channel's call state (its lock and its count of calls in flight) and the
channel's ``next_call_event``.  It adds one to the count for as long as the channel is kept, so
grpcio never starts a thread of its own, and runs the completions on a thread started here.
When anything it needs is missing, it does nothing and says so: the channel keeps grpcio's own
behaviour, slower but correct.

Closing: grpcio destroys the channel's completion queue as soon as its calls have drained, so
no thread may still be waiting on that queue then (that is a crash, not an error).  A kept
channel (:func:`open_channel` makes one) is therefore closed with :func:`close_channel`: it asks the thread to end once the
calls in flight have ended, starts one call whose deadline has already passed (its completion
is the event an idle thread is waiting for: it ends at once, failed locally or answered
UNIMPLEMENTED by the server, since no backend serves :data:`WAKE_METHOD`; nothing runs there),
and closes.  The
thread takes no event after the one that ends the last call, which is the event grpcio's close
waits for.

What this module must never do: run beside a completion thread of grpcio's (it keeps only a
channel with no call in flight); let the count reach zero while the thread runs (grpcio would
start a second one); wait on the queue of a channel being closed.
"""

from __future__ import annotations

import threading

import grpc
from twisted.logger import Logger

log = Logger()

#: The private names of grpcio this module relies on.
INTERNALS = (
    "grpc._channel.Channel._call_state (lock, managed_calls, channel)",
    "grpc._cython.cygrpc.Channel.next_call_event",
    "grpc._cython.cygrpc.CompletionType (queue_timeout, queue_shutdown)",
)

_KEPT = "_localai_completion_thread"
_ENDING = "_localai_completion_thread_ending"
#: The method of the call that wakes an idle kept thread at close: served by no backend, so
#: the call ends at once (DEADLINE_EXCEEDED locally, or the server's UNIMPLEMENTED).
WAKE_METHOD = "/localai.tw.grpcthread/Wake"


def _cygrpc():
    try:
        from grpc._cython import cygrpc
    except ImportError:  # pragma: no cover - grpcio without its Cython core
        return None
    kinds = getattr(cygrpc, "CompletionType", None)
    if kinds is None or not all(hasattr(kinds, k) for k in ("queue_timeout", "queue_shutdown")):
        return None
    return cygrpc


def _fork_support(cygrpc) -> bool:
    check = getattr(cygrpc, "is_fork_support_enabled", None)
    return bool(check()) if callable(check) else False


def _call_state(channel):
    """The channel's call state when it has everything used here, else None."""
    state = getattr(channel, "_call_state", None)
    if state is None:
        return None
    lock = getattr(state, "lock", None)
    if lock is None or not isinstance(getattr(state, "managed_calls", None), int):
        return None
    if not callable(getattr(getattr(state, "channel", None), "next_call_event", None)):
        return None
    return state


def keep_completion_thread(channel) -> bool:
    """Give ``channel`` (a ``grpc.insecure_channel``, before its first call) one completion
    thread until it is closed.  True when done (or already done); False when this grpcio does
    not have what it needs, or the channel already has calls in flight: it then keeps grpcio's
    own behaviour."""
    cygrpc = _cygrpc()
    state = _call_state(channel)
    if cygrpc is not None and _fork_support(cygrpc):
        return False  # grpcio's fork handlers know only threads of its own making
    if cygrpc is None or state is None:
        log.debug("grpcio {version}: no channel completion thread kept (its internals differ; "
                  "see localai_tw/backends/grpcthread.py); one thread per burst of calls",
                  version=_version())
        return False
    with state.lock:
        if getattr(state, _KEPT, None) is not None:
            return True
        if state.managed_calls != 0:
            return False  # grpcio's own thread is running: never a second one beside it
        state.managed_calls = 1  # this module's share, held until the channel closes
        thread = threading.Thread(target=_complete, args=(state, cygrpc),
                                  name="localai-grpc-completions", daemon=True)
        setattr(state, _KEPT, thread)
        thread.start()
    return True


def open_channel(address: str, options) -> grpc.Channel:
    """A ``grpc.insecure_channel`` to ``address`` with its completion thread kept (when this
    grpcio allows it); close it with :func:`close_channel`."""
    channel = grpc.insecure_channel(address, options=options)
    keep_completion_thread(channel)
    return channel


def _complete(state, cygrpc) -> None:
    """The completion loop: hand each event to the call it belongs to and count the calls that
    ended; stop after the last call's event once :func:`close_channel` asked (or at a shutdown
    event, which grpcio sends a thread still waiting when it closes the queue)."""
    kinds = cygrpc.CompletionType
    fork_pause = getattr(cygrpc, "block_if_fork_in_progress", None)
    while True:
        if fork_pause is not None:
            fork_pause(state)
        event = state.channel.next_call_event()
        kind = event.completion_type
        if kind == kinds.queue_timeout:
            continue
        tag = event.tag
        if kind == kinds.queue_shutdown or tag is None:
            return
        try:
            ended = tag(event)
        except Exception:
            # grpcio's own handlers catch what callbacks raise; this is grpcio failing on one
            # event.  The loop goes on: the channel's other calls still need their completions.
            log.failure("grpc completion thread: an event's handler failed")
            continue
        if ended:
            with state.lock:
                state.managed_calls -= 1
                if getattr(state, _ENDING, False) and state.managed_calls == 1:
                    # the last call has ended and the channel is closing: take no more events
                    state.managed_calls = 0
                    setattr(state, _KEPT, None)
                    return


def close_channel(channel) -> None:
    """Close ``channel`` (any grpcio channel); a kept one after its thread was asked to end
    (module docstring)."""
    state = _call_state(channel)
    thread = getattr(state, _KEPT, None) if state is not None else None
    if thread is not None:
        with state.lock:
            waking = not getattr(state, _ENDING, False)
            setattr(state, _ENDING, True)
        if waking:
            try:
                channel.unary_unary(WAKE_METHOD).future(b"", timeout=0)
            except Exception:
                # The thread is left waiting: closing now would free the queue under it.
                log.failure("grpc channel not closed: its completion thread could not be woken")
                return
    channel.close()


def _version() -> str:
    return getattr(grpc, "__version__", "?")
