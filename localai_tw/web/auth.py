"""The one bearer rule of every HTTP surface (frontend APIs, tunnel and peer dials, the worker's
control plane and file routes), and the constant-time check of a presented secret.

A repeated ``Authorization`` header is refused, not resolved: proxies and servers disagree on
which copy wins, so honouring either would let one request be read two ways.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Iterable


def authorization_headers(request) -> list[bytes]:
    """Every ``Authorization`` header value of ``request`` (a refusal message may say
    "repeated" rather than "missing")."""
    return request.requestHeaders.getRawHeaders(b"authorization") or []


def bearer_credential(request) -> bytes | None:
    """The credential of the one ``Authorization: Bearer <credential>`` header, or None:
    absent, repeated, another scheme (matched case-insensitively), or empty."""
    values = authorization_headers(request)
    if len(values) != 1:
        return None
    scheme, _, credential = values[0].strip().partition(b" ")
    credential = credential.strip()
    if scheme.lower() != b"bearer" or not credential:
        return None
    return credential


def digest(secret: str | bytes) -> bytes:
    return hashlib.sha256(secret.encode("utf-8") if isinstance(secret, str) else secret).digest()


def matches_any(presented: str | bytes, expected_digests: Iterable[bytes]) -> bool:
    """Whether ``presented`` is one of the secrets whose :func:`digest` is given, compared over
    digests with every one (no early stop), so timing says neither which matched nor how long
    the secrets are."""
    presented_digest = digest(presented)
    matched = False
    for expected in expected_digests:
        matched |= hmac.compare_digest(presented_digest, expected)
    return matched
