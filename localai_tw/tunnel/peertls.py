"""TLS on peer links: which scheme a replica publishes, and how a dialler checks the peer.

A replica whose ``--listen`` is an ``ssl:`` endpoint cannot be reached over plain ``ws://``, so
it publishes its advertised address as ``wss://host:port``; a plain address (``host:port``, as
every replica published before) still means ``ws://``.  The dialler checks the peer's
certificate against the CA named by ``--peer-ca-file`` (else the system trust store) and the
host name or IP address of the advertised address, and never falls back to plain text.

When a certificate does not verify, the TLS layer only says "connection lost"; the
:class:`VerifyingCreator` remembers *why* (the X.509 verify result, or a name mismatch) so the
pool can log it instead of a bare handshake failure.
"""

from __future__ import annotations

from OpenSSL import SSL
from service_identity import CertificateError, VerificationError
from service_identity.cryptography import verify_certificate_hostname, \
    verify_certificate_ip_address
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
from twisted.internet.ssl import Certificate, optionsForClientTLS, platformTrust
from twisted.python import usage
from zope.interface import implementer

#: The scheme prefix of an advertised address whose replica speaks TLS.
TLS_PREFIX = "wss://"
#: Bound on a CA file (its first PEM certificate is the CA): a certificate, not an arbitrary file.
_MAX_CA_BYTES = 1024 * 1024

# The X.509 verify results an operator meets (OpenSSL's x509_vfy.h); others show their number.
_VERIFY_RESULTS = {
    2: "the issuer certificate is not in the trusted CA",
    9: "the certificate is not yet valid",
    10: "the certificate has expired",
    18: "a self-signed certificate not in the trusted CA",
    19: "a self-signed certificate in the chain not in the trusted CA",
    20: "not signed by the trusted CA (unable to get the local issuer certificate)",
    21: "unable to verify the first certificate",
    62: "the host name does not match the certificate",
    64: "the IP address does not match the certificate",
}


def listener_speaks_tls(description: str | None) -> bool:
    """Whether a server endpoint description (``--listen``) is a TLS listener (``ssl:``)."""
    return (description or "").strip().split(":", 1)[0].lower() == "ssl"


def published_address(address: str, listen: str | None) -> str:
    """The address to publish: ``wss://`` + ``address`` when ``listen`` is TLS, else as is."""
    return TLS_PREFIX + address if address and listener_speaks_tls(listen) else address


def split_published(published: str) -> tuple[bool, str]:
    """``(tls, host:port)`` of a published address.

    :raises ValueError: another scheme (a newer replica's, or a hand-edited row).
    """
    if published.startswith(TLS_PREFIX):
        return True, published[len(TLS_PREFIX):]
    if "://" in published:
        raise ValueError(f"unknown scheme in advertised address {published!r}")
    return False, published


def load_ca_file(path: str) -> Certificate:
    """The first PEM certificate in ``path`` (blocking: read once at startup).

    :raises ValueError: unreadable, too large, or no PEM certificate in it.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_CA_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > _MAX_CA_BYTES:
        raise ValueError(f"{path} is larger than 1 MiB; it should hold the CA certificate")
    try:
        return Certificate.loadPEM(data)
    except Exception:
        raise ValueError(f"{path} holds no PEM certificate") from None


def parse_ca_file(raw: str, option: str) -> str:
    """``--peer-ca-file``: a path holding a PEM certificate (checked now, loaded at wiring)."""
    from localai_tw.config import parse_path

    path = parse_path(raw, option)
    try:
        load_ca_file(path)
    except ValueError as e:
        raise usage.UsageError(f"{option}: {e}") from None
    return path


def describe_verify_result(code: int) -> str:
    return _VERIFY_RESULTS.get(code, f"X.509 verify result {code}")


@implementer(IOpenSSLClientConnectionCreator)
class VerifyingCreator:
    """Client TLS for one dial: Twisted's options (trust root, SNI for host names), with a
    verify callback of our own that checks the chain *and* the peer's name (as Twisted's does)
    and remembers why a certificate was refused, which the TLS layer would otherwise lose."""

    def __init__(self, host: str, trust_root):
        self._inner = optionsForClientTLS(host, trustRoot=trust_root)
        self._host = host
        self._host_is_ip = isIPAddress(host) or isIPv6Address(host)
        #: Why the peer's certificate was refused; None while it was not.
        self.refused: str | None = None

    def clientConnectionForTLS(self, tlsProtocol) -> SSL.Connection:
        connection = self._inner.clientConnectionForTLS(tlsProtocol)
        connection.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, self._verify)
        return connection

    def _verify(self, connection, certificate, error: int, depth: int, ok: int) -> bool:
        # Nothing may raise out of an OpenSSL callback: it would be lost, not reported.
        try:
            if not ok:
                self.refused = self.refused or describe_verify_result(error)
                return False
            if depth != 0:
                return True  # only the leaf names the peer
            leaf = certificate.to_cryptography()
            if self._host_is_ip:
                verify_certificate_ip_address(leaf, self._host)
            else:
                verify_certificate_hostname(leaf, self._host)
            return True
        except (VerificationError, CertificateError):
            self.refused = f"the certificate does not name {self._host}"
        except Exception as e:
            self.refused = f"the certificate could not be checked ({type(e).__name__})"
        return False


class PeerTrust:
    """What peer certificates are checked against: a CA file, else the system trust store."""

    def __init__(self, ca_file: str | None = None):
        self.ca_file = ca_file
        self._root = load_ca_file(ca_file) if ca_file else platformTrust()

    @property
    def source(self) -> str:
        return f"the CA in {self.ca_file}" if self.ca_file else "the system trust store"

    def creator(self, host: str) -> VerifyingCreator:
        return VerifyingCreator(host, self._root)
