"""ThreadedFileWriter: bytes reach the file and the hash in order, never on the reactor thread,
one batch at a time, with the producer paused while the disk is behind and a failed write
reported once."""

from __future__ import annotations

import errno
import hashlib
import os

from twisted.python.failure import Failure

from localai_tw.threadwriter import ThreadedFileWriter


class Reactor:
    def callFromThread(self, f, *args, **kwargs):
        f(*args, **kwargs)


class ManualPool:
    """A thread pool whose jobs run only when the test says so (and records that they ran
    there, not inside ``write``)."""

    def __init__(self):
        self.jobs = []

    def callInThreadWithCallback(self, on_result, f, *args, **kwargs):
        self.jobs.append((on_result, f, args, kwargs))

    def run_one(self):
        on_result, f, args, kwargs = self.jobs.pop(0)
        try:
            result = f(*args, **kwargs)
        except BaseException:
            on_result(False, Failure())
        else:
            on_result(True, result)


class Producer:
    def __init__(self):
        self.events = []

    def pauseProducing(self):
        self.events.append("pause")

    def resumeProducing(self):
        self.events.append("resume")


def _writer(tmp_path, **kwargs):
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    pool = ManualPool()
    hasher = hashlib.sha256()
    return ThreadedFileWriter(Reactor(), fd, hasher, pool=pool, **kwargs), pool, hasher, fd


def test_nothing_is_written_on_the_calling_thread_and_bytes_arrive_in_order(tmp_path):
    writer, pool, hasher, fd = _writer(tmp_path)
    writer.write(b"one ")
    assert (tmp_path / "out").read_bytes() == b""  # only handed to the pool
    writer.write(b"two ")
    writer.write(b"three")
    assert len(pool.jobs) == 1  # one batch in flight per file, the rest waits for it
    done = []
    writer.drained().addCallback(done.append)
    pool.run_one()
    assert not done and len(pool.jobs) == 1  # "two three" is the next batch
    pool.run_one()
    assert done == [None] and not pool.jobs
    os.close(fd)
    assert (tmp_path / "out").read_bytes() == b"one two three"
    assert hasher.hexdigest() == hashlib.sha256(b"one two three").hexdigest()
    assert writer.pending == 0 and writer.written == 13


def test_the_producer_is_paused_while_the_disk_is_behind_and_resumed_below_low_water(tmp_path):
    producer = Producer()
    writer, pool, _, fd = _writer(tmp_path, high_water=10, low_water=4)
    writer.producer = producer
    writer.write(b"x" * 6)
    assert producer.events == []
    writer.write(b"y" * 6)  # 12 bytes wait > 10
    assert producer.events == ["pause"]
    writer.write(b"z" * 3)  # paused once only
    assert producer.events == ["pause"]
    pool.run_one()  # the first 6 are written; 9 still wait (> 4): still paused
    assert producer.events == ["pause"]
    pool.run_one()  # everything written
    assert producer.events == ["pause", "resume"]
    os.close(fd)


def test_a_failed_write_is_reported_once_and_later_bytes_are_dropped(tmp_path):
    errors = []
    read_only = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT)
    pool = ManualPool()
    writer = ThreadedFileWriter(Reactor(), read_only, hashlib.sha256(), pool=pool,
                                on_error=errors.append)
    writer.write(b"abc")
    pool.run_one()
    assert len(errors) == 1 and errors[0].errno == errno.EBADF
    writer.write(b"more")
    assert not pool.jobs  # dropped: the transfer is being stopped
    failed = []
    writer.drained().addErrback(failed.append)
    assert failed and failed[0].value is errors[0]
    os.close(read_only)


def test_drained_fires_at_once_when_nothing_waits(tmp_path):
    writer, _, _, fd = _writer(tmp_path)
    done = []
    writer.drained().addCallback(done.append)
    assert done == [None]
    os.close(fd)
