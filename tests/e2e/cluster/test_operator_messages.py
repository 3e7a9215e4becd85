"""What an operator reads is true, with real processes (issue 26 §5).

Each test runs real ``twistd`` frontends and workers on the test's database and reads what an
operator reads: the processes' logs, the answers of ``/readyz`` and of the APIs.

- A new operator's mistakes: a worker whose ``--registration-token-file`` holds the wrong token
  (its message names that file; the frontend's log has a line for the 401); ``--register-to
  https://`` against the frontend's plain-HTTP port (it says TLS failed against a plain port);
  a second worker on a running worker's data directory with ``--pidfile=`` (refused, naming
  ``--data-dir``); a backend port range inside the kernel's ephemeral range (warned once); a
  404 for an unknown model (points at ``/v1/models``); and no "Starting/Stopping factory" line
  at the default level in any of those logs.
- A database outage: ``/readyz`` says ``database_unavailable`` in words (never ``"state":
  "ready"`` beside ``"ready": false``, never ``(2.0, 'Deferred')``), and the replica floor pass
  logs one warning for the whole outage, no traceback (and so do the bus's LISTEN reconnects
  and the claim consumer).
- A replica whose ``instances`` row is gone while it re-joins (as after its database
  connection was re-established and another replica swept it): its relayed requests are a
  retryable unreachable peer (HTTP 503), not ``PeerRejected`` (500 "a replica configuration
  problem"); once it is live again it relays as before.

Deliberate breaks, each red here: the old ``_failure_for_status`` hint; ``answer_before_body``
without ``log_early_answer``; ``_timeout_as_unavailable`` without the plain-HTTP check;
``_adopt_pidfile`` without ``hold_data_dir_lock``; ``factory_lifecycle_noise`` out of
``level_filter``; the port-range warning in both places; the old probe reason and state;
``outage_errors`` unset in the frontend's wiring; ``PeerPool._dial`` without ``_rejoining``.
"""

from __future__ import annotations

import json

import psycopg2

from .harness import hold_for, request, wait_for

EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        with open(EPHEMERAL) as f:
            first, last = (int(p) for p in f.read().split())
    except (OSError, ValueError):
        return None
    return first, last


def _readyz(fe) -> tuple[int, dict]:
    answer = request("GET", fe.port, "/readyz", timeout=10)
    return answer.status, answer.json()


def test_a_new_operators_mistakes_get_true_messages(make_cluster):
    cluster = make_cluster()
    f0 = cluster.start_frontend(probe=False)
    url = f"http://127.0.0.1:{f0.port}"
    wrong = cluster.workdir / "registration-token"
    wrong.write_text("not-the-frontends-token\n")
    ephemeral = _ephemeral_range()
    ports = (f"{ephemeral[0]}-{ephemeral[0] + 9}" if ephemeral else "30000-30009")

    def worker_args(name: str, register_to: str, *token: str, port_range: str | None = None):
        data_dir = cluster.workdir / f"{name}-data"
        data_dir.mkdir(exist_ok=True)
        return ["-n", "--pidfile=", "localai-worker", "--register-to", register_to, *token,
                "--node-name", name, "--data-dir", str(data_dir),
                "--backend-port-range", port_range or "29500-29509"]

    wrong_token = cluster.start_twistd("w-wrong-token", worker_args(
        "wrong-token", url, "--registration-token-file", str(wrong), port_range=ports))
    tls = cluster.start_twistd("w-tls", worker_args(
        "tls", f"https://127.0.0.1:{f0.port}", "--registration-token", cluster.token))
    good = cluster.start_worker(prefer=0)
    cluster.wait_owned(good, by=f0)

    # A second worker on the running worker's data directory, its pidfile turned off: refused.
    twin = cluster.start_twistd("w-twin", [
        "-n", "--pidfile=", "localai-worker", "--register-to", url,
        "--registration-token", cluster.token, "--node-name", good.name,
        "--data-dir", str(good.data_dir), "--backend-port-range", "29510-29519"])
    assert twin.popen.wait(timeout=60) == 1, twin.log()
    assert f"--data-dir: another localai-worker (pid {good.pid}) is running with data " \
           f"directory {good.data_dir}" in twin.log(), twin.log()
    assert good.alive()

    # The wrong token: the worker names the file it read it from; the frontend logs the 401.
    refused = wait_for(lambda: cluster.grep(wrong_token, "registration of node wrong-token "
                                            "failed"), 60, "the wrong token refused")
    assert f"check the token in --registration-token-file {wrong} " \
           "(LOCALAI_REGISTRATION_TOKEN_FILE)" in refused[0], refused[0]
    assert "check --registration-token (" not in refused[0]
    wait_for(lambda: cluster.grep(f0, '"POST /api/node/register" 401 (refused before the body '
                                      'was read: the registration token is missing or wrong'),
             30, "the frontend's line for the refused registration")

    # https:// against the plain-HTTP port.
    tls_lines = wait_for(lambda: cluster.grep(tls, "registration of node tls failed"), 60,
                         "the TLS registration's failure")
    assert f"TLS failed against a plain-HTTP port: 127.0.0.1:{f0.port} answers HTTP in clear" \
           in tls_lines[0], tls_lines[0]
    assert "is the frontend up?" not in tls_lines[0]

    # An unknown model points at /v1/models.
    answer = request("POST", f0.port, "/v1/chat/completions",
                     {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
                     headers={"Authorization": f"Bearer {cluster.api_key}"})
    assert answer.status == 404, answer.body
    assert "GET /v1/models" in answer.json()["error"]["message"], answer.body

    # Log noise: the port-range warning once; no factory lines at the default level.
    if ephemeral:
        assert len(cluster.grep(wrong_token, "overlaps the kernel's ephemeral")) == 1
    for proc in (f0, good, wrong_token, tls):
        assert not cluster.grep(proc, "Starting factory"), proc.name
        assert not cluster.grep(proc, "Stopping factory"), proc.name


def _allow_connections(dsn: str, allowed: bool) -> None:
    """Refuse (or allow again) new connections to the test's database, ending the open ones:
    an outage of this database only; the machine's server keeps running."""
    name = psycopg2.extensions.parse_dsn(dsn)["dbname"]
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


#: The replica floor pass runs every 15 s (not an option of the real binary).
FLOOR_INTERVAL = 15


def test_a_database_outage_is_said_in_words_and_warned_once(make_cluster):
    cluster = make_cluster()
    fe = cluster.start_frontend(probe=False)
    cluster.sql("SELECT 1")
    cluster._db.close()  # the test's own connection would be ended by the outage
    _allow_connections(cluster.dsn, False)
    try:
        def unavailable():
            status, body = _readyz(fe)
            return body if status == 503 else None
        wait_for(unavailable, 30, "/readyz answering 503")
        seen: list[dict] = []

        def says_so():
            status, body = _readyz(fe)
            assert status == 503, body
            assert body["state"] == "database_unavailable", body
            assert body["reason"].startswith("the database "), body
            assert "Deferred" not in body["reason"], body
            seen.append(body)
        # Long enough for the floor pass to fail at least twice.
        hold_for(says_so, 2 * FLOOR_INTERVAL + 5, interval=2)
        assert any("is unavailable" in b["reason"] for b in seen), seen
    finally:
        _allow_connections(cluster.dsn, True)
    wait_for(lambda: _readyz(fe)[0] == 200, 60, "/readyz = 200 again")
    wait_for(lambda: cluster.grep(fe, "replica floor pass runs again"), 2 * FLOOR_INTERVAL,
             "the floor pass running again")
    log = fe.log()
    assert len(cluster.grep(fe, "replica floor pass skipped: ")) == 1, log
    assert not cluster.grep(fe, "replica floor pass failed"), log
    assert "Traceback" not in log, log
    assert len(cluster.grep(fe, "database unavailable: ")) == 1, log
    assert cluster.grep(fe, "database available again"), log
    # The rest of the replica says it once per outage too, not every few seconds.
    assert len(cluster.grep(fe, "pgbus: LISTEN connection failed")) <= 1, log
    # each claim consumer (jobs, background responses) once, naming its kinds
    for repeated in ("per-tick checks failed", "claim failed"):
        lines = [line for line in cluster.grep(fe, repeated) if "claims (" in line]
        consumers = [line.split("claims (", 1)[1].split(")", 1)[0] for line in lines]
        assert len(consumers) == len(set(consumers)), (repeated, log)


def test_a_replica_re_joining_is_a_retryable_503_not_a_configuration_problem(make_cluster):
    cluster = make_cluster()
    f0 = cluster.start_frontend()
    f1 = cluster.start_frontend()
    worker = cluster.start_worker(prefer=0)
    cluster.wait_owned(worker, by=f0)
    # f1's row is swept (as the other replica does once its heartbeat is late) and held out
    # of the table until the test lets it back: f1 is re-joining for as long as that lasts.
    cluster.sql(f"""
        CREATE FUNCTION e2e_hold_out() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.id = {json.dumps(f1.instance_id).replace('"', "'")} THEN
                RETURN NULL;
            END IF;
            RETURN NEW;
        END $$""")
    cluster.sql("CREATE TRIGGER e2e_hold_out BEFORE INSERT OR UPDATE ON instances"
                " FOR EACH ROW EXECUTE FUNCTION e2e_hold_out()")
    cluster.sql("DELETE FROM instances WHERE id = %s", (f1.instance_id,))

    answer = cluster.control(f1, worker.node_id, "node.status")
    assert answer["error"]["type"] == "PeerUnreachable", answer
    assert "re-joins the cluster" in answer["error"]["message"], answer
    assert cluster.grep(f1, "while this replica re-joins the cluster"), f1.log()
    assert not cluster.grep(f1, "[localai_tw.tunnel.peer#error]"), f1.log()

    cluster.sql("DROP TRIGGER e2e_hold_out ON instances")
    wait_for(lambda: f1.instance_id in cluster.live_instances(), 30, "f1 live again")

    def relayed():
        answer = cluster.control(f1, worker.node_id, "node.status")
        return answer if "error" not in answer else None
    answer = wait_for(relayed, 30, "f1 relaying to the worker again")
    assert answer["reply"]["node_name"] == worker.name
