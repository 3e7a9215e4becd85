"""What anonymous clients cost a frontend: N connections that send a big body with a wrong key.

Usage:  python benchmarks/bench_http_bounds.py [--dsn DSN] [--clients 40] [--mib 8]
                                               [--code DIR]

A ``FrontendService`` (API key set) runs in this process on a scratch database (``--dsn`` or
LOCALAI_TEST_DSN names a maintenance database where it may CREATE DATABASE; the scratch one is
dropped at the end).  A child process opens ``--clients`` connections to it at once, each
sending ``POST /v1/chat/completions`` with a wrong API key, ``Content-Length`` of ``--mib``
MiB and then that many bytes of body, and reports the status each got.  This process samples
its own resident memory (psutil) before, during (peak), once every client has its answer, and
two seconds after the clients closed.  ``--code DIR`` imports ``localai_tw`` from another
checkout (an older commit, for a before/after figure).  A script, not a test: it prints a
markdown table and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid

ATTACKER = r"""
import socket, sys, threading
port, clients, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: frontend\r\nAuthorization: Bearer sk-wrong"
        "\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size).encode()
body = b" " * size
statuses, socks = [None] * clients, []

def attack(i):
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(20)
    socks.append(s)
    try:
        s.sendall(head)
        s.sendall(body)
    except OSError:
        pass  # refused early: the server stopped reading
    try:
        statuses[i] = s.recv(64).split(b" ")[1].decode()
    except (OSError, IndexError):
        statuses[i] = "reset"

threads = [threading.Thread(target=attack, args=(i,)) for i in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
print(" ".join(statuses), flush=True)
sys.stdin.read()  # hold the connections until told to go
for s in socks: s.close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("LOCALAI_TEST_DSN"))
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--code", default=os.path.join(os.path.dirname(
        os.path.abspath(__file__)), ".."))
    args = parser.parse_args()
    if not args.dsn:
        parser.error("give --dsn or set LOCALAI_TEST_DSN")
    sys.path.insert(0, os.path.abspath(args.code))
    from twisted.internet import task

    task.react(lambda reactor: _run(reactor, args))


def _admin(dsn: str, sql: str) -> None:
    import psycopg2

    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
    finally:
        conn.close()


def _run(reactor, args):
    from twisted.internet import defer

    return defer.ensureDeferred(_measure(reactor, args))


async def _measure(reactor, args) -> None:
    import psutil
    from twisted.internet import task, threads

    from localai_tw.db.pool import dsn_with
    from localai_tw.frontend.service import FrontendService

    name = "ltw_bench_" + uuid.uuid4().hex[:12]
    _admin(args.dsn, f'CREATE DATABASE "{name}"')
    service = FrontendService({
        "listen": "tcp:0:interface=127.0.0.1", "database-url": dsn_with(args.dsn, dbname=name),
        "data-dir": None, "instance-id": "bench", "advertise-address": None,
        "single-host": True, "registration-token": "t", "api-key": ["sk-right"],
        "reconnect-grace": 90.0, "require-approval": False}, reactor=reactor)
    me = psutil.Process()
    try:
        service.startService()
        await service.whenReady().addTimeout(60, reactor)
        await task.deferLater(reactor, 1, lambda: None)
        before = me.memory_info().rss
        peak = [before]
        sampler = task.LoopingCall(lambda: peak.append(me.memory_info().rss))
        sampler.start(0.05)
        child = subprocess.Popen(
            [sys.executable, "-c", ATTACKER, str(service.listener.tcp_port()),
             str(args.clients), str(args.mib << 20)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        statuses = (await threads.deferToThread(child.stdout.readline)).split()
        answered = me.memory_info().rss
        in_flight = getattr(service.site, "body_bytes_in_flight", None)
        child.stdin.close()
        await threads.deferToThread(child.wait)
        await task.deferLater(reactor, 2, lambda: None)
        after = me.memory_info().rss
        sampler.stop()
    finally:
        await service.stopService()
        _admin(args.dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    mib = 1 << 20
    counts = {status: statuses.count(status) for status in sorted(set(statuses))}
    print(f"{args.clients} clients, each a {args.mib} MiB body with a wrong API key "
          f"(code: {os.path.abspath(args.code)})\n")
    print("| moment | RSS (MiB) | growth (MiB) |")
    print("|---|---|---|")
    for label, rss in (("before", before), ("peak", max(peak)),
                       ("every client answered", answered),
                       ("2 s after the clients closed", after)):
        print(f"| {label} | {rss / mib:.0f} | {(rss - before) / mib:+.0f} |")
    print(f"\nanswers: {json.dumps(counts)}; body bytes reserved once answered: {in_flight}")


if __name__ == "__main__":
    main()
