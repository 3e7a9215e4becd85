"""What a replica publishes about its TLS, and ``--peer-ca-file`` checked at startup."""

from __future__ import annotations

import pytest
from twisted.python import usage

from localai_tw.frontend import tap
from localai_tw.tunnel.peertls import PeerTrust, published_address, split_published
from tests.integration.tlscerts import make_ca_and_server


@pytest.mark.parametrize("listen, published", [
    ("ssl:8443:privateKey=k.pem:certKey=c.pem", "wss://10.0.0.5:8443"),
    (" SSL:8443:privateKey=k.pem", "wss://10.0.0.5:8443"),
    ("tcp:8443:interface=0.0.0.0", "10.0.0.5:8443"),
    ("unix:/run/frontend.sock", "10.0.0.5:8443"),
])
def test_an_ssl_listener_publishes_wss_and_others_the_plain_address(listen, published):
    assert published_address("10.0.0.5:8443", listen) == published
    assert published_address("", listen) == ""  # no address stays no address


def test_published_addresses_split_into_tls_and_host_port():
    assert split_published("wss://[fd00::1]:8443") == (True, "[fd00::1]:8443")
    assert split_published("10.0.0.5:8080") == (False, "10.0.0.5:8080")  # older replicas
    with pytest.raises(ValueError, match="unknown scheme"):
        split_published("https://10.0.0.5:8443")


def parse(args):
    options = tap.Options(environ={})
    options.parseOptions(args)
    return options


def test_peer_ca_file_is_read_at_startup_and_a_bad_one_is_a_usage_error(tmp_path):
    certs = make_ca_and_server(tmp_path)
    assert parse(["--peer-ca-file", str(certs.ca)])["peer-ca-file"] == str(certs.ca)
    assert PeerTrust(str(certs.ca)).source == f"the CA in {certs.ca}"
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(usage.UsageError, match="holds no PEM certificate"):
        parse(["--peer-ca-file", str(not_pem)])
    with pytest.raises(usage.UsageError, match="cannot read"):
        parse(["--peer-ca-file", str(tmp_path / "missing.pem")])
    help_text = " ".join(str(tap.Options(environ={})).split())
    assert "LOCALAI_PEER_CA_FILE" in help_text and "the system trust store" in help_text
