"""Benchmark of the frontend's own CPU per ``/v1`` request: twisted.web, the listener's guard
and caps, the OpenAI layer and the metrics, with the backend answered in-process.

Usage:  python benchmarks/bench_http_path.py [--requests 3000] [--concurrency 1,16]
                                             [--rounds 2] [--access-log all|errors|off]
                                             [--access-writer batched|event]
                                             [--profile PATH] [--json PATH]

The server runs in this process on its reactor (the main thread): a ``BoundedSite`` with the
policies of the real route table (``apply_policies``: the API-key guard decided when the
headers end, the ``/v1`` body caps, the early answer shapes), ``/v1`` and its unprefixed
aliases mounted as ``Wiring`` mounts them (``OpenAIResource`` with a real ``ReplicaMetrics``
and an API key), and the access log as ``--access-log`` says, to the file a plugin's
``twistd`` logs to: the log observer it uses (a text file observer behind the
``--log-level`` filter, ``localai_tw/logs.py``) and, as the frontend does under twistd, the
access lines written to that file directly in batches (``web/accesslog.py``;
``--access-writer event`` sends each line as a log event instead, as before it; a tree
without the batched writer always does).  **The backend is a stub**: a
router that answers ``predict`` / ``predict_stream`` at once with a fixed ``Reply`` (the
placement, the database and the backend client are not in the figure; they belong to
``bench_inference.py``).  So the figure is what the frontend spends between the socket and
the router's call, and back.

Load comes from a separate process (this script with ``--client``): ``C`` threads, each with
its own keep-alive ``http.client`` connection over loopback.  Each measurement sends a warm-up
(not recorded), then the coordinator snapshots this process's CPU time (``time.process_time``;
the coordinator thread only waits), then the client sends its requests.  Four request kinds:
``completions`` and ``chat`` (``/v1/completions``, ``/v1/chat/completions``), each
non-streaming and streaming (``-stream``: three pieces then ``[DONE]``).  The rounds
interleave the kinds so drifting load hits all alike.

To compare with another tree (``main``), run the same command with ``PYTHONPATH`` set to an
export of it (``git archive main | tar -x -C /tmp/base``) alternately with this tree; the
script prints which ``localai_tw`` it imported.

``--profile PATH`` profiles the reactor thread by its CPU time (``cProfile.Profile(
time.thread_time)``) over the measured parts and writes ``PATH`` (pstats); do not quote the
timings of a profiled run.  A script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import http.client
import json
import os
import subprocess
import sys
import threading
import time

API_KEY = "sk-bench"
MODEL = "bench"

KINDS = {
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "PROMPT", "max_tokens": 4}),
    "completions-stream": ("/v1/completions", {"model": MODEL, "prompt": "PROMPT",
                                               "max_tokens": 4, "stream": True}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "PROMPT"}]}),
    "chat-stream": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "stream": True,
                                             "messages": [{"role": "user",
                                                           "content": "PROMPT"}]}),
}


# -- the load process ---------------------------------------------------------------------


def client_main(port: int, kind: str, concurrency: int, warmup: int, count: int) -> None:
    path, body = KINDS[kind]
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    go = threading.Event()
    errors = []

    def one(conn):
        conn.request("POST", path, payload, headers)
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            errors.append((response.status, data[:200]))

    def worker(n_warm, n):
        conn = http.client.HTTPConnection("127.0.0.1", port)
        for _ in range(n_warm):
            one(conn)
        ready.release()
        go.wait()
        for _ in range(n):
            one(conn)
        conn.close()

    ready = threading.Semaphore(0)
    share = [count // concurrency + (1 if i < count % concurrency else 0)
             for i in range(concurrency)]
    threads = [threading.Thread(target=worker, args=(max(1, warmup // concurrency), s))
               for s in share]
    for t in threads:
        t.start()
    for _ in threads:
        ready.acquire()
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    go.set()
    for t in threads:
        t.join()
    print(json.dumps({"wall": time.monotonic() - started, "errors": len(errors),
                      "first_error": repr(errors[0]) if errors else None}), flush=True)


# -- the server -----------------------------------------------------------------------------


def build_site(access_log: str):
    """The site as ``FrontendService`` builds it, over a stub router."""
    from twisted.internet import defer, reactor
    from twisted.web.resource import Resource
    from zope.interface import implementer

    from localai_tw.backends import backend_pb2
    from localai_tw.frontend.api.openai import OpenAIResource
    from localai_tw.frontend.api.routes import apply_policies
    from localai_tw.frontend.inference.interfaces import IInferenceRouter, Served
    from localai_tw.localai.model_config import parse_model_config
    from localai_tw.metrics import ReplicaMetrics
    from localai_tw.frontend.api.kit import APIKeyGuard
    from localai_tw.web.listener import BoundedSite

    config = parse_model_config({"name": MODEL, "backend": "echo"}, f"{MODEL}.yaml")
    reply = backend_pb2.Reply(message=b"one two three four", tokens=4, prompt_tokens=1)
    pieces = [backend_pb2.Reply(message=m, tokens=i + 1, prompt_tokens=1)
              for i, m in enumerate((b"one", b" two", b" three"))]

    @implementer(IInferenceRouter)
    class StubRouter:
        """Answers at once: the backend, the placement and the database are not measured."""

        models_dir = "/nonexistent"

        def models(self):
            return [config]

        def model(self, name):
            return config if name == MODEL else None

        def predict(self, name, options, deadline=None):
            return defer.succeed(Served(reply, "node-a"))

        def predict_stream(self, name, options, on_reply, deadline=None, on_start=None,
                           on_loading=None):
            if on_start is not None:
                on_start("node-a")
            for piece in pieces:
                on_reply(piece)  # a loopback socket takes it all: no backpressure wait
            return defer.succeed(Served(None, "node-a"))

    api_keys = APIKeyGuard([API_KEY])
    metrics = ReplicaMetrics()
    openai = OpenAIResource(StubRouter(), api_keys=api_keys, reactor=reactor,
                            metrics=metrics)
    root = Resource()
    root.putChild(b"v1", openai)
    site = BoundedSite(root, access_log=access_log)
    apply_policies(site, api_keys)
    return site


def coordinate(args, port: int, profiler, results: dict) -> None:
    """In a thread: run every (round, concurrency, kind), snapshot CPU around each."""
    from twisted.internet import reactor

    kinds = args.kinds.split(",")
    for _ in range(args.rounds):
        for c in [int(x) for x in args.concurrency.split(",")]:
            for kind in kinds:
                per_round = args.requests // args.rounds
                client = subprocess.Popen(
                    [sys.executable, __file__, "--client", str(port), kind, str(c),
                     str(args.warmup), str(per_round)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                try:
                    assert client.stdout.readline().strip() == "ready"
                    if profiler is not None:
                        reactor.callFromThread(profiler.enable)
                    before = time.process_time()
                    client.stdin.write("go\n")
                    client.stdin.flush()
                    outcome = json.loads(client.stdout.readline())
                    after = time.process_time()
                    if profiler is not None:
                        reactor.callFromThread(profiler.disable)
                finally:
                    client.wait(timeout=60)
                cpu = after - before
                slot = results.setdefault((c, kind), {"cpu": 0.0, "wall": 0.0, "n": 0,
                                                      "errors": 0})
                slot["cpu"] += cpu
                slot["wall"] += outcome["wall"]
                slot["n"] += per_round
                slot["errors"] += outcome["errors"]
                if outcome["errors"]:
                    print("errors:", kind, outcome["first_error"], file=sys.stderr)
    reactor.callFromThread(reactor.stop)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        port, kind, c, warmup, count = sys.argv[2:7]
        client_main(int(port), kind, int(c), int(warmup), int(count))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000,
                        help="requests per (concurrency, kind), split over the rounds")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--access-log", default="all", choices=("all", "errors", "off"))
    parser.add_argument("--access-writer", default="batched", choices=("batched", "event"),
                        help="access lines written to the log file in batches (as the "
                        "frontend under twistd) or each as a log event")
    parser.add_argument("--log-file", default="/tmp/bench_http_path.log",
                        help="where the server's log (and access log) lines go")
    parser.add_argument("--profile", metavar="PATH", help="write a reactor-thread CPU profile")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON too")
    args = parser.parse_args()

    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, textFileLogObserver
    import localai_tw

    # As a twistd plugin does (localai_tw/logs.py): a text observer on a file behind the
    # --log-level filter; the access log's lines go there.
    from localai_tw.logs import DEFAULT_LEVEL, level_filter
    log_file = open(args.log_file, "a", encoding="utf-8")
    globalLogBeginner.beginLoggingTo([level_filter(textFileLogObserver(log_file),
                                                   DEFAULT_LEVEL)],
                                     redirectStandardIO=False)
    site = build_site(args.access_log)
    if args.access_writer == "batched" and hasattr(site, "write_access_lines_to"):
        from localai_tw.logs import TextLines
        site.write_access_lines_to(TextLines(log_file))
    batched = hasattr(site, "write_access_lines_to")
    print(f"access lines: {args.access_writer if batched else 'event'}")
    port = reactor.listenTCP(0, site, interface="127.0.0.1").getHost().port
    profiler = cProfile.Profile(time.thread_time) if args.profile else None
    results: dict = {}
    reactor.callWhenRunning(lambda: threading.Thread(
        target=coordinate, args=(args, port, profiler, results), daemon=True).start())
    reactor.run()

    print(f"localai_tw: {os.path.dirname(localai_tw.__file__)}")
    print(f"load average: {' '.join('%.2f' % x for x in os.getloadavg())}")
    print(f"{'kind':<20} {'c':>3} {'req/s':>8} {'CPU us/req':>11} {'errors':>7}")
    table = []
    for (c, kind), slot in sorted(results.items()):
        row = {"kind": kind, "c": c, "rps": slot["n"] / slot["wall"],
               "cpu_us": 1e6 * slot["cpu"] / slot["n"], "errors": slot["errors"]}
        table.append(row)
        print(f"{kind:<20} {c:>3} {row['rps']:>8.0f} {row['cpu_us']:>11.0f} {row['errors']:>7}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"load": os.getloadavg(), "rows": table}, out, indent=1)
    if profiler is not None:
        profiler.dump_stats(args.profile)
        print(f"profile: {args.profile}")


if __name__ == "__main__":
    main()
