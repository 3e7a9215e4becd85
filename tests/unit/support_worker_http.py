"""Raw HTTP against a worker site over in-memory transports, and the staging tests' pieces.

The control-plane, file-staging and scratch tests all speak HTTP/1.1 bytes to a site built by
``build_worker_site`` on a ``StringTransport`` (directly, or as a tunnel stream whose preamble
was consumed) and parse the answer; the staging and scratch tests share a thread pool that runs
work at once (their ``roots`` fixture is in ``conftest.py``).
"""

from __future__ import annotations

import hashlib
import json

from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from localai_tw.worker.httpserve import serve_http_on_transport


LOOPBACK = IPv4Address("TCP", "127.0.0.1", 40000)
REMOTE = IPv4Address("TCP", "192.0.2.7", 40000)


def parse_response(raw: bytes):
    """(code, headers {lower name: [values]}, body) of the first HTTP/1.1 response in ``raw``."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response head in {raw[:200]!r}"
    lines = head.split(b"\r\n")
    code = int(lines[0].split(b" ", 2)[1])
    headers: dict[bytes, list[bytes]] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    if b"content-length" in headers:
        body = rest[: int(headers[b"content-length"][0])]
    elif headers.get(b"transfer-encoding") == [b"chunked"]:
        body = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2:]
    else:
        body = rest
    return code, headers, body


def http_request(method: str, path: str, body: bytes | None = b"", headers=()) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: worker.invalid"]
    lines += [f"{k}: {v}" for k, v in headers]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def connect(site, peer=LOOPBACK, leftover=b"", over_tunnel=False):
    """A site protocol on a StringTransport: directly (peer as given) or as a tunnel stream."""
    transport = StringTransport(peerAddress=peer)
    if over_tunnel:
        protocol = serve_http_on_transport(site, transport, leftover)
    else:
        protocol = site.buildProtocol(peer)
        protocol.makeConnection(transport)
        if leftover:
            protocol.dataReceived(leftover)
    return transport, protocol


def exchange(site, raw: bytes, peer=LOOPBACK, over_tunnel=False):
    transport, protocol = connect(site, peer, over_tunnel=over_tunnel)
    protocol.dataReceived(raw)
    return parse_response(transport.value()), transport, protocol


def post(site, verb_path: str, payload=b"{}", headers=(), peer=LOOPBACK):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    (code, hdrs, body), transport, _ = exchange(
        site, http_request("POST", verb_path, body, headers), peer
    )
    return code, hdrs, body


class SynchronousThreads:
    """A reactor stand-in whose thread pool runs work at once, so tests stay deterministic."""

    def getThreadPool(self):
        return self

    def callInThreadWithCallback(self, on_result, f, *args, **kwargs):
        try:
            result = f(*args, **kwargs)
        except BaseException:
            on_result(False, Failure())
        else:
            on_result(True, result)

    def callFromThread(self, f, *args, **kwargs):
        f(*args, **kwargs)


def put_head(key: str, size: int, digest: str | None, extra=()) -> bytes:
    lines = [f"PUT /v1/files/{key} HTTP/1.1", "Host: w", f"Content-Length: {size}"]
    if digest is not None:
        lines.append(f"X-Content-SHA256: {digest}")
    lines += [f"{k}: {v}" for k, v in extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
