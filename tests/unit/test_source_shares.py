"""The pure rules behind issue 21 §4 and §7: what counts as one source, which ``Host`` an open
API answers, how an error text loses a disk's paths."""

from __future__ import annotations

import pytest
from twisted.internet.address import IPv4Address, IPv6Address

from localai_tw.web.errors import hide_host_paths
from localai_tw.web.hosts import HostCheck
from localai_tw.web.listener import source_key, unsafe_target


def test_an_ipv6_client_is_counted_by_its_64():
    a = source_key(IPv6Address("TCP", "2001:db8:1:2:aaaa::1", 1))
    b = source_key(IPv6Address("TCP", "2001:db8:1:2:ffff::9", 2))
    assert a == b == "2001:db8:1:2::/64"
    assert source_key(IPv6Address("TCP", "2001:db8:1:3::1", 1)) != a
    assert source_key(IPv6Address("TCP", "::ffff:192.0.2.7", 1)) == "192.0.2.7"
    assert source_key(IPv4Address("TCP", "192.0.2.7", 1)) == "192.0.2.7"


@pytest.mark.parametrize("host, allowed", [
    (b"127.0.0.1:8080", True), (b"[::1]:8080", True), (b"localhost", True),
    (b"LOCALHOST:80", True), (b"192.168.1.5", True), (b"llm.internal:8080", True),
    (b"attacker.example", False), (b"localhost.attacker.example", False),
    (b"127.0.0.1.nip.io", False), (None, True),
])
def test_an_open_api_answers_ip_literals_and_named_hosts_only(host, allowed):
    assert HostCheck(["llm.internal"]).allows(host) is allowed


@pytest.mark.parametrize("target, refused", [
    (b"/dashboard/%00", True), (b"/api/nodes/%ff", True), (b"/x?id=%00", True),
    (b"/x?%00=1", True), (b"/v1/models/caf%C3%A9", False), (b"/x?q=a+b%20c", False),
    (b"/api/nodes/scheduling", False),
])
def test_nul_and_non_utf8_targets_are_refused(target, refused):
    assert (unsafe_target(target) is not None) is refused


def test_error_texts_lose_the_disks_paths_but_not_urls():
    assert hide_host_paths("model file /srv/llm/models/x.gguf does not exist") == \
        "model file x.gguf does not exist"
    assert hide_host_paths("not installed in /opt/venv/bin/python3: pip") == \
        "not installed in python3: pip"
    kept = "fetch https://huggingface.co/org/repo/x.gguf failed; file:///etc/passwd"
    assert hide_host_paths(kept) == kept
