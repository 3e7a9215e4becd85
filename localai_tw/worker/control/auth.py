"""Who may call control verbs and file routes: a bearer token (the one rule of
:mod:`localai_tw.web.auth`) when one is configured, else local callers only."""

from __future__ import annotations

import hmac
import ipaddress

import attr
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress

from localai_tw.web import auth
from localai_tw.worker.httpserve import AnswerBeforeBody, TunnelStreamAddress


# -- authorization ----------------------------------------------------------------------------


def is_local_caller(address: object) -> bool:
    """True for a tunnel stream, a Unix socket, a loopback IP, or any peer that is not a TCP/IP
    address at all; false for every other IP address (and for an unparsable IP host)."""
    if isinstance(address, TunnelStreamAddress):
        return True
    if isinstance(address, (IPv4Address, IPv6Address)):
        host = address.host.split("%", 1)[0]
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)
    if isinstance(address, UNIXAddress):
        return True
    return True


@attr.s(frozen=True, auto_attribs=True)
class Refusal:
    code: int
    problem: str
    headers: tuple = ()

    def as_answer(self) -> AnswerBeforeBody:
        return AnswerBeforeBody(self.code, {"problem": self.problem}, headers=self.headers)


class ControlAuth:
    """Who may call control verbs and file routes.

    With a token: one ``Authorization: Bearer <token>`` header
    (:func:`localai_tw.web.auth.bearer_credential`), compared with ``hmac.compare_digest``.
    Without one: only a local caller (:func:`is_local_caller`); a tunnel stream is local,
    because the frontend that opened it already proved the tunnel credential.  Unlike the Go
    baseline, an empty token never makes the routes fail open to remote callers.
    """

    def __init__(self, token: str | bytes | None):
        if isinstance(token, str):
            token = token.encode("utf-8")
        self._token = token or None

    @property
    def token_configured(self) -> bool:
        return self._token is not None

    def refusal_for(self, request) -> Refusal | None:
        """``None`` when the caller may proceed, else the refusal to answer."""
        if self._token is None:
            if is_local_caller(request.getClientAddress()):
                return None
            return Refusal(
                403, "no control token is configured: only local callers are served"
            )
        challenge = ((b"WWW-Authenticate", b"Bearer"),)
        presented = auth.bearer_credential(request)
        if presented is None:
            return Refusal(401, "a bearer token is required", challenge)
        if not hmac.compare_digest(presented, self._token):
            return Refusal(401, "the bearer token is not valid", challenge)
        return None
