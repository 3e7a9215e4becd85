"""Which ``Host`` a request to an API open without a key may name: the defence against DNS
rebinding.

A web page the local user opens can make the browser send requests to the frontend on
loopback; the browser refuses to let the page read the answers of another origin, unless the
page's own host name is made to resolve to 127.0.0.1 (DNS rebinding), in which case the
request carries the page's host name in ``Host``.  So, while no API key is configured, a
request whose ``Host`` is a *name* the operator did not allow is refused.  IP literals are
allowed (rebinding needs a name), as are ``localhost``, the ``--advertise-address`` host and
every ``--allowed-host``.  With a key configured the check is off: a page cannot present the
key.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable

from localai_tw.web.errors import APIError

#: Names always allowed.
LOOPBACK_NAMES = ("localhost", "localhost.")


def host_name(header: bytes) -> str:
    """The host of a ``Host`` header value, lower case, without its port (``[::1]:80`` ->
    ``::1``)."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    if text.count(":") == 1:
        return text.split(":", 1)[0]
    return text


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


class HostCheck:
    """``check(request)`` raises a 403 when ``Host`` names a host not allowed (module
    docstring); a request without ``Host`` (HTTP/1.0) passes: a browser always sends one."""

    def __init__(self, names: Iterable[str] = ()):
        self.names = frozenset({*LOOPBACK_NAMES, *(n.strip().lower().rstrip(".") for n in names
                                                  if n and n.strip())})

    def allows(self, header: bytes | None) -> bool:
        if header is None:
            return True
        host = host_name(header)
        return _is_ip(host) or host in self.names or host.rstrip(".") in self.names

    def check(self, request) -> None:
        header = request.getHeader(b"host")
        if not self.allows(header):
            shown = "".join(c if c.isprintable() else "?"
                            for c in host_name(header or b"")[:64])
            raise APIError(
                403, f"Host {shown!r} is not one this frontend answers to while its API is "
                "open (no API key): use its address or localhost, or start it with "
                f"--allowed-host {shown} (or configure --api-key)", "forbidden",
                code="host_not_allowed")
