"""PortAllocator as pure logic: an injected bind probe and a task.Clock, no sockets."""

from __future__ import annotations

import errno

import pytest
from twisted.internet import task

from localai_tw.backends import ports
from localai_tw.backends.ports import NoFreePort, PortAllocator


class FakeBinds:
    """A bind probe: ports in ``taken`` fail with EADDRINUSE; every probe is recorded."""

    def __init__(self, taken=()):
        self.taken = set(taken)
        self.probed: list[tuple[str, int]] = []

    def __call__(self, host, port):
        self.probed.append((host, port))
        if port in self.taken:
            raise OSError(errno.EADDRINUSE, "Address already in use")


def allocator(first=40000, last=40004, taken=(), tmp_path=None, **kw):
    binds = FakeBinds(taken)
    clock = task.Clock()
    kw.setdefault("ephemeral_range_file", "/nonexistent")
    return PortAllocator(first, last, clock=clock, bind_probe=binds, **kw), binds, clock


def test_probes_the_exact_address_before_handing_out():
    alloc, binds, _ = allocator(taken={40000})
    port = alloc.allocate("m#0")
    assert port == 40001
    assert binds.probed == [("127.0.0.1", 40000), ("127.0.0.1", 40001)]
    assert alloc.holder(40001) == "m#0"


def test_a_held_port_is_never_handed_out_twice():
    alloc, _, _ = allocator()
    got = [alloc.allocate(f"m#{i}") for i in range(5)]
    assert sorted(got) == list(range(40000, 40005))
    with pytest.raises(NoFreePort) as e:
        alloc.allocate("m#5")
    assert e.value.held == 5 and e.value.skipped == 5


def test_unbindable_port_is_quarantined_for_sixty_seconds():
    alloc, binds, clock = allocator(taken={40000})
    assert alloc.allocate("a") == 40001
    alloc.release(40001)
    binds.taken.clear()
    binds.probed.clear()
    # 40000 is skipped without a probe while its quarantine lasts.
    assert alloc.allocate("b") == 40002
    assert ("127.0.0.1", 40000) not in binds.probed
    assert alloc.quarantined()[40000][1] == "unbindable"
    clock.advance(60)
    assert 40000 not in alloc.quarantined()
    got = {alloc.allocate(k) for k in "cde"}
    assert 40000 in got


def test_released_port_waits_fifteen_seconds_and_returns_to_its_key():
    alloc, _, clock = allocator(first=40000, last=40001)
    assert alloc.allocate("m#0") == 40000
    alloc.release(40000)
    assert alloc.quarantined() == {40000: (15.0, "released")}
    # Inside the quarantine the key gets another port, never the released one.
    assert alloc.allocate("m#0") == 40001
    alloc.release(40001)
    clock.advance(15)
    # Both out of quarantine: the key's previous port (its last one, 40001) comes back first.
    assert alloc.allocate("m#0") == 40001
    assert alloc.allocate("other") == 40000


def test_release_of_a_port_not_held_is_a_noop():
    alloc, _, _ = allocator()
    alloc.release(40003)
    assert alloc.quarantined() == {}


def test_exhaustion_message_counts_each_reason():
    alloc, binds, clock = allocator(first=40000, last=40005, taken={40002})
    a = alloc.allocate("a")  # 40000
    b = alloc.allocate("b")  # 40001
    assert alloc.allocate("c") == 40003  # 40002 failed its probe: quarantined, unbindable
    assert alloc.allocate("d") == 40004
    alloc.release(a)
    alloc.release(b)
    binds.taken.add(40005)  # some other program takes 40005 now
    with pytest.raises(NoFreePort) as e:
        alloc.allocate("e")
    err = e.value
    assert (err.held, err.in_use, err.quarantined_released, err.quarantined_unbindable) == \
        (2, 1, 2, 1)
    text = str(err)
    assert "no free gRPC port in 40000-40005 on 127.0.0.1" in text
    assert "skipped 6 candidates" in text
    assert "2 held by backends of this worker" in text
    assert "1 in use by another program" in text and "EADDRINUSE" in text
    assert "3 quarantined (2 recently released, 1 recently unbindable)" in text


def test_ports_rotate_instead_of_reusing_the_lowest():
    alloc, _, clock = allocator()
    first = alloc.allocate("a")
    alloc.release(first)
    clock.advance(100)
    assert alloc.allocate("b") == first + 1


def test_affinity_expires():
    alloc, _, clock = allocator(first=40000, last=40002)
    alloc.allocate("x")  # 40000
    alloc.allocate("y")  # 40001
    alloc.release(40000)
    clock.advance(301)
    # x's old port is no longer affine: the cursor order decides (40002 next).
    assert alloc.allocate("x") == 40002


def test_bad_range_is_refused():
    with pytest.raises(ValueError):
        PortAllocator(5, 4)
    with pytest.raises(ValueError):
        PortAllocator(0, 10)


def test_default_range_is_below_the_default_ephemeral_range(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ports.default_port_range(str(f)) == (30000, 30999)


def test_default_range_moves_out_of_a_wider_ephemeral_range(tmp_path):
    f = tmp_path / "range"
    f.write_text("20000 60999\n")
    assert ports.default_port_range(str(f)) == (19000, 19999)
    f.write_text("1024 60000\n")
    assert ports.default_port_range(str(f)) == (60001, 61000)
    alloc = PortAllocator.with_default_range(ephemeral_range_file=str(f),
                                             bind_probe=FakeBinds())
    assert (alloc.first, alloc.last) == (60001, 61000)
    assert alloc.ephemeral_overlap is None


def test_overlap_with_the_ephemeral_range_is_reported(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768 60999\n")
    alloc = PortAllocator(32000, 33000, ephemeral_range_file=str(f), bind_probe=FakeBinds())
    assert alloc.ephemeral_overlap == (32768, 60999)
    assert PortAllocator(30000, 30999, ephemeral_range_file=str(f)).ephemeral_overlap is None


def test_unreadable_ephemeral_file_means_the_fixed_default():
    assert ports.read_ephemeral_range("/nonexistent") is None
    assert ports.default_port_range("/nonexistent") == (30000, 30999)
