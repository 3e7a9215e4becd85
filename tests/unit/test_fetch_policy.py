"""Which destinations the frontend's fetches refuse by default (``frontend/fetchpolicy.py``)."""

from __future__ import annotations

import pytest

from localai_tw.frontend.fetchpolicy import refused_because


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
