"""Which destinations the frontend's fetches refuse by default, and that the endpoint connects
only to an address that passed (``frontend/inference/fetchpolicy.py``; a resolver that answers what a
hostile DNS server could, a memory reactor that records connection attempts)."""

from __future__ import annotations

import pytest
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IHostnameResolver
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.web.client import URI
from twisted.web.error import SchemeNotSupported
from zope.interface import implementer

from localai_tw.frontend.inference.fetchpolicy import (
    DestinationRefused,
    FetchEndpointFactory,
    refused_because,
)


@pytest.mark.parametrize("address, why", [
    ("127.0.0.1", "loopback"), ("127.5.6.7", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("fc00::1", "private"), ("fd12:3456::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("100.64.0.1", "CGNAT"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"),
    ("2002:7f00:1::1", "loopback"),  # 6to4 around 127.0.0.1
    ("fe80::1%eth0", "link-local"),
])
def test_non_public_destinations_are_refused_naming_why(address, why):
    assert refused_because(address).startswith(why)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700::1111",
                                     "::ffff:8.8.8.8"])
def test_public_destinations_pass(address):
    assert refused_because(address) is None


# -- the endpoint: resolved, checked, and connected to an address that passed ---------------

@implementer(IHostnameResolver)
class FixedResolver:
    """Answers every name with ``addresses`` (what a hostile DNS server could answer)."""

    def __init__(self, addresses):
        self.addresses = addresses
        self.asked = []

    def resolveHostName(self, receiver, hostName, portNumber=0, addressTypes=None,
                        transportSemantics="TCP"):
        self.asked.append(hostName)
        receiver.resolutionBegan(None)
        for host in self.addresses:
            kind = IPv6Address if ":" in host else IPv4Address
            receiver.addressResolved(kind("TCP", host, portNumber))
        receiver.resolutionComplete()


def _reactor(addresses):
    reactor = MemoryReactorClock()
    reactor.installNameResolver(FixedResolver(addresses))
    return reactor


def test_only_the_public_address_of_a_mixed_answer_is_connected():
    """A name that resolves to loopback and metadata addresses as well as a public one: the
    connection attempt goes to the public address only (HostnameEndpoint connects to the
    addresses it was handed; nothing resolves the name again)."""
    reactor = _reactor(["127.0.0.1", "169.254.169.254", "93.184.216.34", "::1"])
    factory = FetchEndpointFactory(reactor, allow_private=False, connect_timeout=5)
    endpoint = factory.endpointForURI(URI.fromBytes(b"http://mirror.example/x"))
    endpoint.connect(Factory.forProtocol(Protocol))
    reactor.advance(1)
    assert [(host, port) for host, port, *_ in reactor.tcpClients] == [("93.184.216.34", 80)]


def test_a_name_with_no_public_address_is_refused_without_a_connection():
    reactor = _reactor(["127.0.0.1", "10.0.0.5", "fd00::1"])
    factory = FetchEndpointFactory(reactor, allow_private=False, connect_timeout=5)
    endpoint = factory.endpointForURI(URI.fromBytes(b"http://internal.example:8080/x"))
    failures = []
    endpoint.connect(Factory.forProtocol(Protocol)).addErrback(failures.append)
    reactor.advance(1)
    assert reactor.tcpClients == []
    [failure] = failures
    assert failure.check(DestinationRefused)
    assert "127.0.0.1 is loopback" in str(failure.value) and "10.0.0.5 is private" in str(
        failure.value)


def test_the_operators_option_connects_to_private_addresses():
    reactor = _reactor(["10.0.0.5"])
    factory = FetchEndpointFactory(reactor, allow_private=True, connect_timeout=5)
    factory.endpointForURI(URI.fromBytes(b"http://mirror.lan/x")).connect(
        Factory.forProtocol(Protocol))
    reactor.advance(1)
    assert [host for host, *_ in reactor.tcpClients] == ["10.0.0.5"]


def test_other_schemes_are_not_fetched():
    factory = FetchEndpointFactory(_reactor([]), allow_private=False, connect_timeout=5)
    with pytest.raises(SchemeNotSupported):
        factory.endpointForURI(URI.fromBytes(b"ftp://example.org/x"))
