"""A frontend replica whose PostgreSQL goes away and comes back (issue 9 §7).

The outage is real and confined to the test's own database: new connections to it are refused
(``ALTER DATABASE ... ALLOW_CONNECTIONS false``) and the replica's open ones are ended with
``pg_terminate_backend``.  The machine's PostgreSQL server keeps running.
"""

from __future__ import annotations

import gc
import time
import uuid

import psycopg2
import pytest
import pytest_twisted
import treq
from twisted.internet import defer, reactor
from twisted.logger import formatEvent, globalLogPublisher
from twisted.web.client import HTTPConnectionPool

from localai_tw.db.pool import CHECKOUT_TIMEOUT_SECONDS

from .inference_harness import ADMIN, TOKEN
from .support import eventually

#: Slack on top of the pool's checkout deadline for one answer (a loaded 2-core machine).
SLACK_SECONDS = 3.0
MODEL = ("name: outage-chat\nbackend: echo\nparameters:\n  model: outage.bin\n"
         "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n")
CHAT = {"model": "outage-chat", "messages": [{"role": "user", "content": "hi"}]}


class CapturedLog:
    """Every log event of this process while the test runs, as text (tracebacks included)."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, event):
        text = formatEvent(event) or ""
        failure = event.get("log_failure")
        if failure is not None:
            text += "\n" + failure.getTraceback()
        self.lines.append(text)

    def count(self, fragment: str) -> int:
        return sum(fragment in line for line in self.lines)

    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def captured():
    observer = CapturedLog()
    globalLogPublisher.addObserver(observer)
    yield observer
    globalLogPublisher.removeObserver(observer)


@pytest.fixture
def cluster(cluster, pg_dsn):
    """The shared cluster, with connections to the test's database allowed again before it
    closes, whatever the test left."""
    try:
        yield cluster
    finally:
        set_allow_connections(pg_dsn, True)


def set_allow_connections(dsn: str, allowed: bool) -> None:
    """Refuse (or allow again) new connections to the test's database, ending the open ones."""
    params = psycopg2.extensions.parse_dsn(dsn)
    name = params["dbname"]
    admin = psycopg2.connect(psycopg2.extensions.make_dsn(dsn, dbname="postgres"))
    try:
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')
            if not allowed:
                cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE datname = %s AND pid <> pg_backend_pid()", (name,))
    finally:
        admin.close()


class Client:
    def __init__(self, base: str):
        self.base = base
        self.pool = HTTPConnectionPool(reactor, persistent=False)

    async def call(self, method: str, path: str, body=None, token: str = ADMIN,
                   timeout: float = 30.0):
        """(status, headers, json body, seconds taken)."""
        started = time.monotonic()
        kwargs = {"json": body} if body is not None else {}
        response = await treq.request(method, self.base + path, pool=self.pool, reactor=reactor,
                                      headers={"Authorization": f"Bearer {token}"},
                                      **kwargs).addTimeout(timeout, reactor)
        payload = await treq.json_content(response)
        return response.code, response.headers, payload, time.monotonic() - started


def requests_needing_the_database(client: Client):
    calls = [client.call("POST", "/v1/chat/completions", CHAT) for _ in range(6)] + [
        client.call("GET", "/api/nodes"),
        client.call("POST", f"/api/node/{uuid.uuid4()}/heartbeat",
                    {"tunnel_token": "t" * 32}, token=TOKEN),
    ]
    return [defer.ensureDeferred(call) for call in calls]


@pytest_twisted.ensureDeferred
async def test_database_outage_is_a_bounded_503_logged_once_then_recovers(
        cluster, pg_dsn, captured):
    cluster.write_model("outage.yaml", MODEL)
    frontend = await cluster.frontend("replica-db")
    client = Client(cluster.base_url(frontend))
    status, _, body, _ = await client.call("POST", "/v1/chat/completions", CHAT)
    assert status == 503 and body["error"]["code"] == "no_node_available"  # database fine

    set_allow_connections(pg_dsn, False)
    # Twice: the first round finds the dead connections, the second waits on a pool whose
    # every reconnect is refused.
    for _ in range(2):
        answers = await defer.gatherResults(requests_needing_the_database(client))
        for status, headers, body, seconds in answers:
            assert status == 503, body
            assert headers.getRawHeaders(b"retry-after") == [b"5"]
            assert "database" in body["error"]["message"]
            assert seconds < CHECKOUT_TIMEOUT_SECONDS + SLACK_SECONDS
        chat_error = answers[0][2]["error"]
        assert chat_error["code"] == "database_unavailable"
        assert chat_error["type"] == "service_unavailable"

    set_allow_connections(pg_dsn, True)

    async def recovered():
        status, _, _, _ = await client.call("GET", "/api/nodes")
        return status == 200

    await eventually(recovered, timeout=30, what="the admin API answers again")
    status, _, body, _ = await client.call("POST", "/v1/chat/completions", CHAT)
    assert status == 503 and body["error"]["code"] == "no_node_available"

    gc.collect()  # an unhandled failed Deferred is only reported when collected
    log = captured.text()
    assert "Traceback" not in log and "Unhandled" not in log, log
    assert captured.count("database unavailable:") == 1, log
    assert captured.count("database available again") == 1, log


@pytest_twisted.ensureDeferred
async def test_a_replica_re_joins_as_soon_as_its_database_is_back(db, pg_dsn):
    """Issue 26 §5: after an outage another replica may have swept this replica's row; it used
    to stay out of the cluster (its peer links refused) until its next heartbeat.  The pool's
    restore now makes it heartbeat at once.  Its own loop is set to an hour here, so only the
    restore can bring the row back.  (Remove the on_restored registration: red.)"""
    from localai_tw.cluster.membership import InstanceIdentity, MembershipService

    identity = InstanceIdentity("rejoining", "0.1.0", "", "secret-rejoining")
    membership = MembershipService(db, identity, reactor=reactor, heartbeat_interval=3600)
    membership.startService()
    try:
        await membership.whenRegistered()
        await db.runOperation("DELETE FROM instances WHERE id = 'rejoining'")  # swept
        set_allow_connections(pg_dsn, False)
        try:
            await eventually(lambda: db.outage is not None, what="the pool sees the outage")
        finally:
            set_allow_connections(pg_dsn, True)

        async def back():
            try:
                rows = await db.runQuery("SELECT id FROM instances WHERE id = 'rejoining'")
            except Exception:
                return False
            return bool(rows)
        await eventually(back, timeout=20, what="the row written again after the restore")
    finally:
        await membership.stopService()
