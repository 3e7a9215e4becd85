"""One ``FrontendService`` built from options as ``twistd localai-frontend`` builds it: its
options with the test's database, the registration token and admin key they carry, and a
small HTTP client for its APIs (``test_frontend_service.py``, ``test_frontend_bounds.py``,
``test_peer_tls.py``)."""

from __future__ import annotations

import json

import treq
from twisted.internet import reactor
from twisted.web.client import HTTPConnectionPool


TOKEN = "service-registration-token"


ADMIN = "sk-service-admin"


def options(pg_dsn, **overrides):
    base = {"listen": "tcp:0:interface=127.0.0.1", "database-url": pg_dsn, "data-dir": None,
            "instance-id": "replica-a", "advertise-address": None, "single-host": True,
            "registration-token": TOKEN, "api-key": [ADMIN], "reconnect-grace": 90.0,
            "require-approval": False}
    base.update(overrides)
    return base


class Client:
    def __init__(self, base):
        self.base = base
        self.pool = HTTPConnectionPool(reactor, persistent=False)

    async def call(self, method, path, body=None, token=None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        kwargs = {"json": body} if body is not None else {}
        response = await treq.request(method, self.base + path, headers=headers, pool=self.pool,
                                      reactor=reactor, **kwargs).addTimeout(10, reactor)
        content = await treq.content(response)
        return response.code, (json.loads(content) if content.startswith((b"{", b"[")) else
                               content)
