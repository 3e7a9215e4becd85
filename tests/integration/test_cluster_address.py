"""Advertised peer address: discovery through the route to the database, and validation.

Discovery opens a real UDP socket (no packet is sent), so it lives with the integration tests.
"""

import socket

import pytest
import pytest_twisted

from localai_tw.cluster.membership import (
    AdvertiseAddressError,
    check_advertised_address,
    database_host_port,
    discover_advertised_address,
    discover_advertised_address_async,
)


def _routable_source() -> str | None:
    """The local address toward a documentation address, if this machine has any route."""
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect(("192.0.2.1", 5432))
            ip = s.getsockname()[0]
        finally:
            s.close()
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


@pytest.mark.parametrize("dsn, expected", [
    ("postgresql://u@db.example:6543/x", ("db.example", 6543)),
    ("postgresql://u@10.0.0.5/x", ("10.0.0.5", 5432)),
    ("postgresql://u@[fd00::5]:7000/x", ("fd00::5", 7000)),
    ("host=db1,db2 port=5433,5434 dbname=x", ("db1", 5433)),
    ("host=db hostaddr=10.9.9.9 dbname=x", ("10.9.9.9", 5432)),
])
def test_database_host_port_from_url_and_key_value(dsn, expected):
    assert database_host_port(dsn) == expected


@pytest.mark.parametrize("dsn", [
    "dbname=x",
    "host=/var/run/postgresql dbname=x",
    "postgresql:///x?host=/tmp",
    "not a dsn at all ===",
])
def test_unix_socket_or_hostless_dsn_is_refused(dsn):
    with pytest.raises(AdvertiseAddressError, match="--advertise-address"):
        database_host_port(dsn)


def test_bad_database_port_is_refused():
    with pytest.raises(AdvertiseAddressError, match="1..65535"):
        database_host_port("host=db port=70000")


def test_loopback_discovery_is_refused_naming_the_flag():
    with pytest.raises(AdvertiseAddressError, match="--advertise-address") as info:
        discover_advertised_address("postgresql://postgres@127.0.0.1:5432/postgres", 8080)
    assert "loopback" in str(info.value)


def test_single_host_mode_accepts_loopback():
    got = discover_advertised_address("postgresql://postgres@127.0.0.1:5432/postgres", 8080,
                                      single_host=True)
    assert got == "127.0.0.1:8080"


def test_ipv6_loopback_discovery_is_refused():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        discover_advertised_address("host=::1 port=5432", 8080)
    except AdvertiseAddressError as e:
        assert "--advertise-address" in str(e)
    else:
        pytest.fail("::1 was accepted")


def test_discovery_reads_the_routable_source_address():
    source = _routable_source()
    if source is None:
        pytest.skip("this machine has no route beyond loopback")
    assert discover_advertised_address("host=192.0.2.1 port=5432", 9000) == f"{source}:9000"


@pytest.mark.parametrize("port", [0, 65536, -1, "http"])
def test_discovery_refuses_a_bad_api_port(port):
    with pytest.raises(AdvertiseAddressError, match="port"):
        discover_advertised_address("host=127.0.0.1", port, single_host=True)


@pytest_twisted.ensureDeferred
async def test_async_discovery_runs_off_the_reactor_thread():
    got = await discover_advertised_address_async("host=127.0.0.1 port=5432", 8080,
                                                  single_host=True)
    assert got == "127.0.0.1:8080"


@pytest.mark.parametrize("addr, expected", [
    ("10.0.0.7:8080", "10.0.0.7:8080"),
    (" frontend-a.internal:443 ", "frontend-a.internal:443"),
    ("[fd00::7]:8080", "[fd00::7]:8080"),
])
def test_configured_address_accepted(addr, expected):
    assert check_advertised_address(addr) == expected


@pytest.mark.parametrize("addr, fragment", [
    ("", "empty"),
    ("10.0.0.7", "host:port"),
    (":8080", "missing host"),
    ("10.0.0.7:0", "1..65535"),
    ("10.0.0.7:65536", "1..65535"),
    ("10.0.0.7:http", "not a number"),
    ("fd00::7:8080", "host:port"),
    ("[fd00::7]8080", "[ipv6]:port"),
    ("bad_host!:80", "host name"),
    ("127.0.0.1:8080", "loopback"),
    ("localhost:8080", "loopback"),
    ("[::1]:8080", "loopback"),
    ("169.254.1.2:8080", "link-local"),
    ("[fe80::1]:8080", "link-local"),
    ("[fe80::1%eth0]:8080", "link-local"),
    ("0.0.0.0:8080", "unspecified"),
])
def test_configured_address_refused(addr, fragment):
    with pytest.raises(AdvertiseAddressError) as info:
        check_advertised_address(addr)
    assert fragment in str(info.value)


@pytest.mark.parametrize("addr", ["127.0.0.1:8080", "localhost:8080", "[::1]:8080",
                                  "[fe80::1%eth0]:8080"])
def test_single_host_mode_accepts_local_configured_addresses(addr):
    assert check_advertised_address(addr, single_host=True)


def test_unspecified_is_refused_even_in_single_host_mode():
    with pytest.raises(AdvertiseAddressError, match="unspecified"):
        check_advertised_address("0.0.0.0:8080", single_host=True)
