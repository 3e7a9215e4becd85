"""The paced writer under both streamed responses (localai_tw/web/streaming.py): a write waits
while the client is not reading, goes on when it reads again, and fails when the client is
gone, so the producer upstream stops.  A real ``twisted.web`` channel over a StringTransport."""

import pytest
from twisted.internet.error import ConnectionClosed, ConnectionDone, ConnectionLost
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web import resource, server

from localai_tw.web.streaming import PacedWriter


class StreamingResource(resource.Resource):
    """Answers every request with a started :class:`PacedWriter` the test writes through."""

    isLeaf = True

    def __init__(self, max_unread_bytes: int):
        super().__init__()
        self.max_unread_bytes = max_unread_bytes
        self.writers: list[PacedWriter] = []

    def render(self, request):
        writer = PacedWriter(request, "test stream", self.max_unread_bytes)
        request.setHeader(b"content-type", b"application/x-ndjson")
        self.writers.append(writer)
        return server.NOT_DONE_YET


class Connection:
    """One HTTP/1.1 client connection; ``writer`` is its response's writer."""

    def __init__(self, max_unread_bytes: int = 1000, full_before_start: bool = False):
        self.resource = StreamingResource(max_unread_bytes)
        self.channel = server.Site(self.resource).buildProtocol(None)
        self.transport = StringTransport()
        self.transport.abortConnection = lambda: self.aborted.append(True)
        self.aborted: list[bool] = []
        self.channel.makeConnection(self.transport)
        self.channel.dataReceived(b"GET /stream HTTP/1.1\r\nHost: test\r\n\r\n")
        self.writer, = self.resource.writers
        if full_before_start:
            self.pause()
        self.writer.start()

    def pause(self):
        self.transport.producer.pauseProducing()  # the send buffer is full: the client is slow

    def resume(self):
        self.transport.producer.resumeProducing()

    def leave(self):
        self.channel.connectionLost(Failure(ConnectionDone("client left")))

    def body(self) -> bytes:
        return self.transport.value().partition(b"\r\n\r\n")[2]


def failure_of(d) -> Failure:
    failures = []
    d.addErrback(failures.append)
    assert len(failures) == 1, "the Deferred has failed"
    return failures[0]


def test_a_write_waits_while_the_client_is_not_reading_and_goes_on_when_it_reads():
    c = Connection()
    assert c.writer.write(b"one\n") is None  # the client reads: write more at once
    c.pause()
    waiting = c.writer.write(b"two\n")
    assert waiting is not None and not waiting.called
    assert b"two\n" in c.body()  # written; it is the next write that has to wait
    c.resume()
    assert waiting.called and waiting.result is None
    assert c.writer.write(b"three\n") is None


def test_a_transport_full_before_the_stream_starts_makes_the_first_write_wait():
    c = Connection(full_before_start=True)
    waiting = c.writer.write(b"one\n")
    assert waiting is not None and not waiting.called
    c.resume()
    assert waiting.called


@pytest.mark.parametrize("how", ["request", "transport first"])
def test_a_waiting_writer_learns_that_the_client_left(how):
    """Released instead, the producer upstream (a backend stream, a verb) would go on for
    nobody.  A TCP transport calls ``stopProducing`` before the request hears of the loss."""
    c = Connection()
    c.pause()
    waiting = c.writer.write(b"one\n")
    if how == "transport first":
        c.transport.producer.stopProducing()
    c.leave()
    assert failure_of(waiting).check(ConnectionClosed)
    assert c.writer.gone


def test_writes_after_the_client_left_are_dropped_and_fail():
    c = Connection()
    c.writer.write(b"one\n")
    sent = c.transport.value()
    c.leave()
    later = c.writer.write(b"late\n")
    assert failure_of(later).check(ConnectionClosed)
    assert c.transport.value() == sent
    c.writer.finish()  # nothing to finish on a lost connection
    assert c.transport.value() == sent


def test_finishing_after_a_loss_not_yet_heard_of_still_fails_the_waiter():
    """The request's other listeners (the OpenAI exchange) may react to the loss, and finish
    the stream, before this writer's own notification arrives."""
    c = Connection()
    c.pause()
    waiting = c.writer.write(b"one\n")
    request = c.writer.request
    request.notifyFinish().addErrback(lambda _: c.writer.finish())
    request.notifications.insert(0, request.notifications.pop())  # that listener goes first
    c.leave()
    assert failure_of(waiting).check(ConnectionClosed)


def test_writes_that_do_not_wait_are_bounded_while_the_client_is_not_reading():
    c = Connection(max_unread_bytes=1000)
    c.pause()
    assert c.writer.write(b"x" * 5000) is not None  # one write per wait, of any size
    outcomes = [c.writer.write(b"y" * 100) for _ in range(20)]
    assert c.aborted == [True]
    assert c.transport.value().count(b"y" * 100) == 10  # 1000 bytes, not one more
    assert failure_of(outcomes[-1]).check(ConnectionLost)
    assert c.writer.gone


def test_a_writer_that_waits_each_time_is_never_dropped():
    c = Connection(max_unread_bytes=1000)
    for _ in range(20):
        c.pause()
        waiting = c.writer.write(b"z" * 900)
        c.resume()
        assert waiting.called
    assert not c.aborted


def test_finish_ends_the_response_and_releases_a_waiter():
    c = Connection()
    c.pause()
    waiting = c.writer.write(b"last\n")
    c.writer.finish()
    assert waiting.called and waiting.result is None
    request = c.writer.request
    assert request.finished and request.producer is None
    assert c.transport.value().endswith(b"0\r\n\r\n")
    assert failure_of(c.writer.write(b"after\n")).check(ConnectionDone)
