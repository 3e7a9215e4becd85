"""A grpcio channel's completions on one kept thread (``backends/grpcthread.py``), against a
real in-process grpcio server: no thread started per call, a closed channel ends the thread
quietly through ``close_channel`` (cancelling what was in flight, and never while the thread
waits on the queue grpcio frees: that was a segmentation fault), streams still complete, and a
grpcio without the internals, or a channel already busy, is left to grpcio's own
behaviour."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from localai_tw.backends import grpcthread

SERVICE = "localai.test.Echo"


@pytest.fixture
def server():
    gate = threading.Event()

    def echo(request, context):
        return request

    def held(request, context):
        gate.wait(10)
        return request

    def until_cancelled(request, context):
        for _ in range(500):
            if not context.is_active():
                break
            time.sleep(0.01)
        return request

    def items(request, context):
        for i in range(3):
            yield request + str(i).encode()

    handlers = grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Held": grpc.unary_unary_rpc_method_handler(held),
        "UntilCancelled": grpc.unary_unary_rpc_method_handler(until_cancelled),
        "Items": grpc.unary_stream_rpc_method_handler(items),
    })
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    srv.add_generic_rpc_handlers((handlers,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", gate
    gate.set()
    srv.stop(None)


@pytest.fixture
def thread_errors():
    """What reached ``threading.excepthook`` meanwhile (grpcio's own loop dies with a
    TypeError at a closed channel's shutdown event; the kept one must not)."""
    seen, previous = [], threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)
    yield seen
    threading.excepthook = previous


def _threads_of_calls(channel, n: int) -> list[threading.Thread]:
    """The distinct threads that completed ``n`` sequential unary calls (their done callbacks;
    the Thread objects, held, since a finished thread's ident is reused)."""
    call = channel.unary_unary(f"/{SERVICE}/Echo")
    threads: list[threading.Thread] = []
    for i in range(n):
        done = threading.Event()
        future = call.future(b"ping %d" % i, timeout=10)

        def completed(_, done=done):
            here = threading.current_thread()
            if all(here is not t for t in threads):
                threads.append(here)
            done.set()

        future.add_done_callback(completed)
        assert done.wait(10)
        assert future.result() == b"ping %d" % i
    return threads


def _kept_thread(channel) -> threading.Thread:
    return getattr(channel._call_state, grpcthread._KEPT)


def test_sequential_calls_complete_on_the_one_kept_thread(server):
    address, _ = server
    with grpc.insecure_channel(address) as plain:
        # the premise: grpcio alone starts a thread per call when none is in flight
        assert len(_threads_of_calls(plain, 5)) > 1
    channel = grpc.insecure_channel(address)
    try:
        assert grpcthread.keep_completion_thread(channel) is True
        assert grpcthread.keep_completion_thread(channel) is True  # once per channel
        threads = _threads_of_calls(channel, 20)
        assert threads == [_kept_thread(channel)]
        assert channel._call_state.managed_calls == 1  # this module's share, nothing else
    finally:
        grpcthread.close_channel(channel)


def _keep_then_close(address: str, before_close=lambda channel: None):
    """A kept channel, ``before_close(channel)`` on it, closed by ``close_channel``; the thread
    must be gone after.  Answers what ``before_close`` answered."""
    channel = grpc.insecure_channel(address)
    assert grpcthread.keep_completion_thread(channel)
    made = before_close(channel)
    thread = _kept_thread(channel)
    grpcthread.close_channel(channel)
    thread.join(10)
    assert not thread.is_alive()
    return made


def test_close_ends_the_thread_quietly(server, thread_errors):
    address, _ = server
    _keep_then_close(address, lambda channel: _threads_of_calls(channel, 2))
    assert thread_errors == []


def test_closing_idle_kept_channels_again_and_again(server, thread_errors):
    """An idle thread waits on the queue that grpcio's close shuts down and frees: each close
    ends it quietly (woken by the call whose deadline has passed)."""
    address, _ = server
    for i in range(200):
        _keep_then_close(address, (lambda channel: _threads_of_calls(channel, 1)) if i % 2
                         else (lambda channel: None))
    assert thread_errors == []


def test_close_cancels_a_call_in_flight_and_ends_the_thread(server, thread_errors):
    address, _ = server
    future = _keep_then_close(address, lambda channel: channel.unary_unary(
        f"/{SERVICE}/Held").future(b"x", timeout=30))
    with pytest.raises(grpc.RpcError) as caught:
        future.result(timeout=10)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert thread_errors == []


def test_closing_with_a_call_in_flight_again_and_again(server, thread_errors):
    """The last event of a call that close cancels lets close free the queue: a thread that
    went back to wait on it read a freed queue (a segmentation fault within a few rounds)."""
    address, _ = server
    for _ in range(300):
        future = _keep_then_close(address, lambda channel: channel.unary_unary(
            f"/{SERVICE}/UntilCancelled").future(b"x", timeout=30))
        with pytest.raises(grpc.RpcError):
            future.result(timeout=10)
    assert thread_errors == []


def test_server_streams_complete_on_the_kept_thread(server):
    address, _ = server
    channel = grpc.insecure_channel(address)
    try:
        assert grpcthread.keep_completion_thread(channel)
        for _ in range(3):
            got = list(channel.unary_stream(f"/{SERVICE}/Items")(b"item ", timeout=10))
            assert got == [b"item 0", b"item 1", b"item 2"]
        assert channel._call_state.managed_calls == 1
    finally:
        grpcthread.close_channel(channel)


def test_a_channel_with_a_call_in_flight_is_left_to_grpcio(server, thread_errors):
    address, gate = server
    channel = grpc.insecure_channel(address)
    try:
        future = channel.unary_unary(f"/{SERVICE}/Held").future(b"x", timeout=30)
        assert grpcthread.keep_completion_thread(channel) is False
        gate.set()
        assert future.result(timeout=10) == b"x"
        assert getattr(channel._call_state, grpcthread._KEPT, None) is None
        assert len(_threads_of_calls(channel, 3)) >= 1  # grpcio's own threads still serve
    finally:
        grpcthread.close_channel(channel)
    assert thread_errors == []


def test_without_the_internals_nothing_is_done():
    class NotAGrpcioChannel:
        pass

    assert grpcthread.keep_completion_thread(NotAGrpcioChannel()) is False
    odd = NotAGrpcioChannel()
    odd._call_state = NotAGrpcioChannel()  # no lock, no count
    assert grpcthread.keep_completion_thread(odd) is False


def test_the_pinned_grpcio_has_the_internals(server):
    """When this fails after a grpcio upgrade, backends/grpcthread.py no longer applies: read
    its INTERNALS against the new grpcio before changing the pin."""
    address, _ = server
    channel = grpc.insecure_channel(address)
    try:
        assert grpcthread._cygrpc() is not None
        assert grpcthread._call_state(channel) is not None
        assert grpcthread.keep_completion_thread(channel) is True
    finally:
        grpcthread.close_channel(channel)
