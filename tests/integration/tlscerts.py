"""Certificates made in the test: a CA and a server certificate it signs (for 127.0.0.1 and
localhost), written as PEM files.  Uses ``cryptography`` (installed with ``twisted[tls]``)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass
class ServerFiles:
    ca: Path     #: the CA certificate (what a client names as trusted)
    cert: Path   #: the server certificate
    key: Path    #: its private key

    def listen(self, port: int = 0) -> str:
        """A ``--listen`` for an ssl-only listener on loopback with this certificate."""
        return f"ssl:{port}:interface=127.0.0.1:privateKey={self.key}:certKey={self.cert}"


def make_ca_and_server(directory: Path, name: str = "peer",
                       names: tuple[str, ...] = ("127.0.0.1", "localhost")) -> ServerFiles:
    """A fresh CA and a server certificate it signs, valid for ``names`` (IP addresses and
    host names)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(f"{name} test CA"))
          .issuer_name(_name(f"{name} test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names = []
    for host in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder().subject_name(_name(names[0]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    files = ServerFiles(directory / f"{name}-ca.pem", directory / f"{name}-cert.pem",
                        directory / f"{name}-key.pem")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(_pem_key(key))
    files.key.chmod(0o600)
    return files
