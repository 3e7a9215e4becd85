"""Where the frontend's own HTTP fetches may connect: model downloads (``downloads.py``) and
gallery indexes and entry configs (``gallery.py``).

A gallery install (``POST /models/apply``) makes a replica fetch URLs that a request picked, and
a download reaches whatever the replica can reach: its loopback (the embedded PostgreSQL, a
worker's backends, an admin port), the private network behind it, the cloud metadata address.
So by default every fetch refuses a destination that is not a public address (issue 21 §2):
loopback, private (RFC 1918, IPv6 ULA ``fc00::/7``), link-local (``169.254/16`` with the
metadata address, ``fe80::/10``), CGNAT (``100.64/10``), unspecified, multicast, reserved or
documentation ranges, and IPv4 addresses inside IPv6 (mapped, 6to4, Teredo) that are one of
these.  An operator with a local mirror passes ``--allow-private-downloads``.

The check is made on the addresses a connection is actually made to: the host name is resolved
with the reactor's resolver, every resolved address is checked, and only the addresses that
pass are handed to ``HostnameEndpoint``, which connects to those very addresses (no second
lookup, so no DNS-rebinding window).  Redirects go through the same endpoint factory, so every
hop is checked at its own connection.

What this module must never do: connect anywhere before the address is checked; say to an
API caller why a destination failed (callers show one message; the reason is logged here).
"""

from __future__ import annotations

import ipaddress

from twisted.internet import error
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IHostnameResolver,
    IReactorPluggableNameResolver,
    IResolutionReceiver,
)
from twisted.logger import Logger
from twisted.web.client import (
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    RedirectAgent,
)
from twisted.web.error import SchemeNotSupported
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

log = Logger()

#: Redirects one fetch follows (each hop checked at its connection).
REDIRECT_LIMIT = 5
_CGNAT = ipaddress.ip_network("100.64.0.0/10")


class DestinationRefused(error.ConnectError):
    """Every address of the host is one the policy refuses; ``refused`` says which and why
    (for the operator's log only)."""

    def __init__(self, host: str, refused: list[str]):
        super().__init__(string=f"{host}: no public address ({'; '.join(refused)[:300]}); "
                                "--allow-private-downloads permits private destinations")
        self.host = host
        self.refused = refused


def refused_because(address: str) -> str | None:
    """Why ``address`` (an IP literal) is not a public destination, or None when it is."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if inner is not None:  # the IPv4 address is where the packets go
            why = refused_because(str(inner))
            return None if why is None else f"{why} (inside {ip})"
    for test, why in ((ip.is_loopback, "loopback"), (ip.is_link_local, "link-local"),
                      (ip.is_unspecified, "unspecified"), (ip.is_multicast, "multicast"),
                      (ip in _CGNAT if ip.version == 4 else False, "CGNAT"),
                      (ip.is_private, "private"), (ip.is_reserved, "reserved")):
        if test:
            return why
    if not ip.is_global:
        return "not a public address"
    return None


@implementer(IHostnameResolver)
class PublicAddressResolver:
    """The reactor's resolver with every non-public address left out (``refused`` collects
    what was left out, and why)."""

    def __init__(self, resolver, refused: list[str]):
        self._resolver = resolver
        self.refused = refused

    def resolveHostName(self, resolutionReceiver, hostName, portNumber=0,
                        addressTypes=None, transportSemantics="TCP"):
        refused = self.refused

        @implementer(IResolutionReceiver)
        class Filter:
            @staticmethod
            def resolutionBegan(resolution):
                resolutionReceiver.resolutionBegan(resolution)

            @staticmethod
            def addressResolved(address):
                why = refused_because(getattr(address, "host", ""))
                if why is None:
                    resolutionReceiver.addressResolved(address)
                else:
                    refused.append(f"{address.host} is {why}")

            @staticmethod
            def resolutionComplete():
                resolutionReceiver.resolutionComplete()

        return self._resolver.resolveHostName(Filter(), hostName, portNumber, addressTypes,
                                              transportSemantics)


@implementer(IReactorPluggableNameResolver)
class _ReactorWithResolver:
    """``reactor`` with another ``nameResolver`` (what ``HostnameEndpoint`` resolves with);
    everything else is the reactor's."""

    def __init__(self, reactor, resolver):
        self._reactor = reactor
        self.nameResolver = resolver

    def installNameResolver(self, resolver):
        raise NotImplementedError("a fixed resolver")

    def __getattr__(self, name):
        return getattr(self._reactor, name)


class PublicEndpoint:
    """A TCP client endpoint to ``host:port`` that connects only to public addresses
    (module docstring); fails with :class:`DestinationRefused` when none is left."""

    def __init__(self, reactor, host: str, port: int, timeout: float):
        self.host = host
        self.refused: list[str] = []
        resolver = PublicAddressResolver(reactor.nameResolver, self.refused)
        self._endpoint = HostnameEndpoint(_ReactorWithResolver(reactor, resolver), host, port,
                                          timeout=timeout)

    def connect(self, protocolFactory):
        def refused(failure):
            if self.refused and failure.check(error.DNSLookupError):
                raise DestinationRefused(self.host, self.refused)
            return failure

        return self._endpoint.connect(protocolFactory).addErrback(refused)


@implementer(IAgentEndpointFactory)
class FetchEndpointFactory:
    """Endpoints for ``Agent.usingEndpointFactory``: ``http``/``https`` only; public
    destinations only unless ``allow_private``."""

    def __init__(self, reactor, *, allow_private: bool, connect_timeout: float,
                 tls_policy=None):
        self._reactor = reactor
        self.allow_private = allow_private
        self._timeout = connect_timeout
        self._tls = tls_policy or BrowserLikePolicyForHTTPS()

    def endpointForURI(self, uri):
        if uri.scheme not in (b"http", b"https"):
            raise SchemeNotSupported(f"unsupported scheme: {uri.scheme!r}")
        host = uri.host.decode("ascii", "replace")
        if self.allow_private:
            endpoint = HostnameEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        else:
            endpoint = PublicEndpoint(self._reactor, host, uri.port, self._timeout)
        if uri.scheme == b"https":
            endpoint = wrapClientTLS(self._tls.creatorForNetloc(uri.host, uri.port), endpoint)
        return endpoint


def fetch_agent(reactor, *, allow_private: bool, connect_timeout: float = 30.0):
    """The ``IAgent`` of the frontend's fetches: redirects followed (at most
    :data:`REDIRECT_LIMIT`), each connection through :class:`FetchEndpointFactory`, no
    persistent connections."""
    factory = FetchEndpointFactory(reactor, allow_private=allow_private,
                                   connect_timeout=connect_timeout)
    agent = Agent.usingEndpointFactory(reactor, factory,
                                       pool=HTTPConnectionPool(reactor, persistent=False))
    return RedirectAgent(agent, redirectLimit=REDIRECT_LIMIT)
