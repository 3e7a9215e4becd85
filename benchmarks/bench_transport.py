"""Benchmark of the transport core: raw Twisted TCP, yamux over TCP, yamux over WebSocket, and
the same yamux over WebSocket in Go (hashicorp/yamux on gorilla/websocket) side by side.

Usage:  python benchmarks/bench_transport.py [--mib 256] [--mem-mib 64] [--rounds 2000]
                                             [--transports tcp,yamux,ws] [--json PATH]
                                             [--profile DIR] [--bulk-budget KiB]
                                             [--auto-window KiB] [--go-ws-buffer BYTES]

One run measures, on 127.0.0.1, for each transport:

- bulk throughput, 1 stream and 8 concurrent streams, in each direction ("up" is the dialling
  process to the listening one, "down" the reverse), in MB/s (10**6 bytes per second).  The
  8-stream runs move the same total as the 1-stream runs, split evenly; the figure is the total
  divided by the time until the last stream finished.  In the deployment the worker dials, so
  "up" is worker -> frontend (responses) and "down" is frontend -> worker (requests, staging);
- the round trip of 1 byte over one stream (``--rounds`` echoes, the first ``--warmup`` dropped),
  p50 and p99;
- the peak RSS of both processes, at two sizes (``--mem-mib`` and ``--mib``): it must depend on
  windows and stream counts, never on the bytes moved.

Every figure is also printed as a ratio to raw Twisted TCP, the baseline.  "yamux" runs a
``localai_tw.mux.Session`` on each end of one TCP connection; "ws" runs the same sessions over
``localai_tw.tunnel.websocket`` (Autobahn, binary messages, bearer token checked), so every
stream of a test shares one carrier, as in the deployment.  Session settings are the defaults
(256 KiB windows, 64 KiB frames) unless ``--window`` says otherwise.

Process layout: this script is a coordinator.  For each (transport, size) it starts the
listening side (``--role server``) and then the dialling side (``--role client``) as two fresh
subprocesses of itself, so each uses its own core as a real frontend and worker would, and so
each peak RSS belongs to one transport and one size.  The server exits when its stdin closes
(the coordinator closing it, or dying) and is always reaped.  Senders are streaming producers
registered on their transport: they write 64 KiB at a time and stop when paused, so the
windows and the TCP buffers do the flow control; the script counts the pauses to show it.

Go side by side (issue 25 §3): ``--transports tcp,ws,go-ws`` adds Go's yamux over WebSocket
(``benchmarks/gotransport/main.go``: hashicorp/yamux on gorilla/websocket, one binary message per
carrier write, the same command protocol, bearer token and 256 KiB window; yamux's and gorilla's
defaults otherwise) in the same interleaved repetitions, and prints a table of Python yamux/WS
against Go with the ratio Python/Go.  The mixed pairs ``go-ws-server`` (Go listener, Python
dialler) and ``go-ws-client`` (Python listener, Go dialler) tell which side limits a direction.
The Go program is built offline in GOPATH mode from Debian's packages (as ``tests/interop``
builds its Go peer) and cached under ``benchmarks/gotransport/bin/``; without Go or those
packages the script says how to install them (``bash .ci/install-interop-deps``) and runs the
other transports.

This is a script, not a test: it asserts nothing, but prints whether the targets of
``docs/benchmarks.md`` are met.  ``--profile DIR`` runs both sides under cProfile and writes
``DIR/<transport>-<mib>-<role>.prof`` (profiling slows everything; do not quote those figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TRANSPORTS = ("tcp", "yamux", "ws", "go-ws", "go-ws-server", "go-ws-client")
LABELS = {"tcp": "raw TCP", "yamux": "yamux/TCP", "ws": "yamux/WS", "go-ws": "Go yamux/WS",
          "go-ws-server": "Go listener + Py dialler", "go-ws-client": "Py listener + Go dialler"}
#: which program plays (listener, dialler) for each transport; a Python side of a Go transport
#: runs the "ws" code, so the mixed pairs also prove the two speak the same wire
SIDES = {"tcp": ("py", "py"), "yamux": ("py", "py"), "ws": ("py", "py"),
         "go-ws": ("go", "go"), "go-ws-server": ("go", "py"), "go-ws-client": ("py", "go")}
PY_TRANSPORTS = ("tcp", "yamux", "ws")
HERE = os.path.dirname(os.path.abspath(__file__))
GO_DIR = os.path.join(HERE, "gotransport")
GO_SRC = os.path.join(GO_DIR, "main.go")
GO_BIN_DIR = os.path.join(GO_DIR, "bin")
GOPATH = os.environ.get("LOCALAI_INTEROP_GOPATH", "/usr/share/gocode")
GO_LIBRARIES = {"yamux": ("github.com/hashicorp/yamux", "golang-github-hashicorp-yamux-dev"),
                "gorilla": ("github.com/gorilla/websocket",
                            "golang-github-gorilla-websocket-dev")}
GO_INSTALL_HINT = ("install them with `bash .ci/install-interop-deps` (as root: golang-go, "
                   "golang-github-hashicorp-yamux-dev, golang-github-gorilla-websocket-dev)")
CHUNK = 64 * 1024
STREAMS = (1, 8)
ALL_TESTS = "up-1,up-8,down-1,down-8,rtt"
TOKEN = "bench-transport-token"
WS_PATH = b"tunnel"
TEST_TIMEOUT = 300.0

# A command opens every connection or stream: one op byte and a 64-bit byte count.
COMMAND = struct.Struct(">cQ")
OP_UPLOAD = b"U"    # the dialler sends n bytes; the listener answers ACK once it has them all
OP_DOWNLOAD = b"D"  # the listener sends n bytes
OP_ECHO = b"E"      # the listener echoes every byte
ACK = b"K"


def peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def current_rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


# -- the protocol pieces both sides share ------------------------------------------------------


def _protocols():
    """Import Twisted lazily: the coordinator never runs a reactor."""
    from twisted.internet import defer
    from twisted.internet.interfaces import IPushProducer
    from twisted.internet.protocol import Protocol
    from zope.interface import implementer

    payload = os.urandom(CHUNK)

    @implementer(IPushProducer)
    class Sender:
        """Writes ``total`` bytes in CHUNK writes while its transport lets it; a streaming
        producer, so a full buffer or a closed window pauses it and a drain resumes it."""

        def __init__(self, transport, total: int, done: defer.Deferred | None = None):
            self.transport = transport
            self.remaining = total
            self.done = done
            self.paused = False
            self.pauses = 0
            self._running = False

        def start(self) -> None:
            self.transport.registerProducer(self, True)
            self.resumeProducing()

        def pauseProducing(self) -> None:
            if not self.paused:
                self.pauses += 1
            self.paused = True

        def resumeProducing(self) -> None:
            self.paused = False
            if self._running:
                return  # resumed from inside our own write: the loop below goes on
            self._running = True
            try:
                while not self.paused and self.remaining > 0:
                    n = min(CHUNK, self.remaining)
                    self.remaining -= n
                    self.transport.write(payload if n == CHUNK else payload[:n])
            finally:
                self._running = False
            if self.remaining == 0 and self.transport is not None:
                transport, self.transport = self.transport, None
                transport.unregisterProducer()
                if self.done is not None:
                    done, self.done = self.done, None
                    done.callback(self.pauses)

        def stopProducing(self) -> None:
            self.remaining = 0
            if self.done is not None:
                done, self.done = self.done, None
                done.errback(RuntimeError("the transport stopped the sender"))

    class ServerSide(Protocol):
        """The listening end of one connection or stream: obeys the command it opens with."""

        def connectionMade(self):
            self._head = b""
            self._op = None
            self._left = 0

        def dataReceived(self, data):
            if self._op is None:
                self._head += data
                if len(self._head) < COMMAND.size:
                    return
                op, n = COMMAND.unpack_from(self._head)
                data = self._head[COMMAND.size:]
                self._head = b""
                self._op, self._left = op, n
                if op == OP_DOWNLOAD:
                    sender = Sender(self.transport, n)
                    sender.start()
                    self._sender = sender
                    return
            if self.stats is not None:
                self.stats["bytes_received"] += len(data)
            if self._op == OP_UPLOAD:
                self._left -= len(data)
                if self._left == 0:
                    self.transport.write(ACK)
                elif self._left < 0:
                    raise ValueError("more bytes than announced")
            elif self._op == OP_ECHO:
                if data:
                    self.transport.write(data)

        def connectionLost(self, reason=None):
            sender = getattr(self, "_sender", None)
            if sender is not None and self.stats is not None:
                self.stats["server_pauses"] += sender.pauses

    ServerSide.stats = None

    class ClientSide(Protocol):
        """The dialling end: runs one upload, download or echo test."""

        def __init__(self):
            self.connected_d = defer.Deferred()
            self.lost_d = defer.Deferred()
            self._done = None
            self._mode = None

        def connectionMade(self):
            self.connected_d.callback(self)

        def upload(self, n: int) -> defer.Deferred:
            self._mode, self._done = "upload", defer.Deferred()
            self.transport.write(COMMAND.pack(OP_UPLOAD, n))
            self.sender = Sender(self.transport, n)
            self.sender.start()
            return self._done

        def download(self, n: int) -> defer.Deferred:
            self._mode, self._done, self._left = "download", defer.Deferred(), n
            self.transport.write(COMMAND.pack(OP_DOWNLOAD, n))
            return self._done

        def echo(self, rounds: int) -> defer.Deferred:
            self._mode, self._done = "echo", defer.Deferred()
            self._rounds, self._samples = rounds, []
            self.transport.write(COMMAND.pack(OP_ECHO, 0))
            self._sent_at = time.perf_counter()
            self.transport.write(b"x")
            return self._done

        def dataReceived(self, data):
            if self._mode == "upload":
                if data == ACK:
                    self._finish(self.sender.pauses)
            elif self._mode == "download":
                self._left -= len(data)
                if self._left <= 0:
                    self._finish(None)
            elif self._mode == "echo":
                now = time.perf_counter()
                self._samples.append(now - self._sent_at)
                if len(self._samples) >= self._rounds:
                    self._finish(self._samples)
                    return
                self._sent_at = time.perf_counter()
                self.transport.write(b"x")

        def _finish(self, result):
            done, self._done, self._mode = self._done, None, None
            if done is not None:
                done.callback(result)

        def connectionLost(self, reason=None):
            if self._done is not None:
                done, self._done = self._done, None
                done.errback(reason)
            if not self.lost_d.called:
                self.lost_d.callback(None)

    return Sender, ServerSide, ClientSide


def _session_config(args):
    from localai_tw.mux.session import SessionConfig

    config = SessionConfig(max_window=args.window * 1024,
                           bulk_in_flight=getattr(args, "bulk_budget", 0) * 1024,
                           auto_window=getattr(args, "auto_window", 0) * 1024)
    if args.frame:
        config.max_frame_size = args.frame
    return config


def _profiled(args, tag: str, run):
    if not args.profile:
        return run()
    import cProfile

    os.makedirs(args.profile, exist_ok=True)
    # CPU time, not wall time: on a shared machine the wall clock of a blocking poll also
    # counts the time we waited for a core, which says nothing about our code.
    profiler = cProfile.Profile(time.process_time)
    try:
        return profiler.runcall(run)
    finally:
        profiler.dump_stats(os.path.join(args.profile, f"{tag}.prof"))


# -- the listening side ------------------------------------------------------------------------


def run_server(args) -> None:
    from twisted.internet import reactor, stdio
    from twisted.internet.protocol import Factory, Protocol

    _, ServerSide, _ = _protocols()
    stats = {"server_pauses": 0, "bytes_received": 0}
    ServerSide.stats = stats

    if args.transport == "tcp":
        factory = Factory.forProtocol(ServerSide)
    elif args.transport == "yamux":
        from localai_tw.mux.session import Session

        config = _session_config(args)
        factory = Factory()
        factory.buildProtocol = lambda addr: Session(
            client=False, config=config, acceptor=lambda stream: ServerSide(), reactor=reactor)
    else:
        from twisted.web.resource import Resource
        from twisted.web.server import Site

        from localai_tw.mux.session import Session
        from localai_tw.tunnel.websocket import BearerTokenAuthorizer, TunnelWebSocketResource

        config = _session_config(args)
        root = Resource()
        root.putChild(WS_PATH, TunnelWebSocketResource(
            lambda request, authorization: Session(
                client=False, config=config, acceptor=lambda stream: ServerSide(),
                reactor=reactor),
            BearerTokenAuthorizer(TOKEN)))
        factory = Site(root)
        factory.log = lambda request: None  # no access log lines on stdout

    port = reactor.listenTCP(0, factory, interface="127.0.0.1")

    class Control(Protocol):
        """stdin: EOF (the coordinator closed it, or died) stops the server."""

        def connectionLost(self, reason=None):
            if reactor.running:
                reactor.stop()

    def ready():
        print(json.dumps({"port": port.getHost().port, "pid": os.getpid(),
                          "rss_ready_kib": current_rss_kib()}), flush=True)

    stdio.StandardIO(Control(), stdout=os.dup(1))
    reactor.callWhenRunning(ready)
    _profiled(args, f"{args.transport}-{args.mib}-server", reactor.run)
    stats.update(peak_rss_kib=peak_rss_kib())
    print(json.dumps(stats), flush=True)


# -- the dialling side -------------------------------------------------------------------------


def run_client(args) -> None:
    from twisted.internet import task

    _profiled(args, f"{args.transport}-{args.mib}-client",
              lambda: task.react(lambda reactor: _client_main(reactor, args)))


def _client_main(reactor, args):
    from twisted.internet import defer

    return defer.ensureDeferred(_client(reactor, args))


async def _client(reactor, args) -> None:
    import psutil
    from twisted.internet import defer, endpoints

    _, _, ClientSide = _protocols()
    server = psutil.Process(args.server_pid)
    endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", args.port)
    session = None

    if args.transport == "yamux":
        from localai_tw.mux.session import Session

        session = Session(client=True, config=_session_config(args), reactor=reactor)
        await endpoints.connectProtocol(endpoint, session)
    elif args.transport == "ws":
        from localai_tw.mux.session import Session
        from localai_tw.tunnel.websocket import connectWebSocket

        config = _session_config(args)
        session = await connectWebSocket(
            reactor, f"ws://127.0.0.1:{args.port}/{WS_PATH.decode()}",
            lambda: Session(client=True, config=config, reactor=reactor),
            headers={"Authorization": f"Bearer {TOKEN}"})

    async def connect():
        if session is None:
            return await endpoints.connectProtocol(endpoint, ClientSide())
        protocol = ClientSide()
        session.openStream(protocol)
        return await protocol.connected_d

    def bounded(d):
        return d.addTimeout(TEST_TIMEOUT, reactor)

    async def measure(name, run):
        """Open the connections, then time ``run`` alone; CPU of both processes alongside."""
        print(f"#   {LABELS[args.transport]}: {name}", file=sys.stderr, flush=True)
        protocols = await run.connect()
        cpu_server = sum(server.cpu_times()[:2])
        cpu_client = time.process_time()
        started = time.perf_counter()
        results = await bounded(defer.gatherResults([run.start(p) for p in protocols],
                                                    consumeErrors=True))
        elapsed = time.perf_counter() - started
        row = {"test": name, "seconds": elapsed,
               "cpu_client": (time.process_time() - cpu_client) / elapsed,
               "cpu_server": (sum(server.cpu_times()[:2]) - cpu_server) / elapsed,
               "rss_client_kib": current_rss_kib(),
               "rss_server_kib": server.memory_info().rss // 1024}
        row.update(run.summarise(results, elapsed))
        for p in protocols:
            p.transport.loseConnection()
        await bounded(defer.gatherResults([p.lost_d for p in protocols]))
        return row

    class Bulk:
        def __init__(self, direction, streams, total):
            self.direction, self.streams, self.total = direction, streams, total

        async def connect(self):
            return [await connect() for _ in range(self.streams)]

        def start(self, protocol):
            each = self.total // self.streams
            return protocol.upload(each) if self.direction == "up" else protocol.download(each)

        def summarise(self, results, elapsed):
            moved = self.total // self.streams * self.streams
            row = {"mb_per_s": moved / elapsed / 1e6, "bytes": moved}
            if self.direction == "up":
                row["sender_pauses"] = sum(results)
            return row

    class Echo:
        async def connect(self):
            return [await connect()]

        def start(self, protocol):
            return protocol.echo(args.rounds)

        def summarise(self, results, elapsed):
            samples = sorted(results[0][args.warmup:])
            return {"rtt_p50_us": percentile(samples, 50) * 1e6,
                    "rtt_p99_us": percentile(samples, 99) * 1e6,
                    "rounds": len(samples), "rounds_total": len(results[0])}

    total = args.mib * 1024 * 1024
    rows = {"rss_ready_kib": current_rss_kib(), "tests": []}
    wanted = args.tests.split(",")
    for direction in ("up", "down"):
        for streams in STREAMS:
            if f"{direction}-{streams}" in wanted:
                rows["tests"].append(await measure(f"{direction}-{streams}",
                                                   Bulk(direction, streams, total)))
    if "rtt" in wanted:
        rows["tests"].append(await measure("rtt", Echo()))
    if session is not None:
        session.loseConnection()
    rows["peak_rss_kib"] = peak_rss_kib()
    print(json.dumps(rows), flush=True)


def percentile(ordered: list[float], p: float) -> float:
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


# -- the coordinator ---------------------------------------------------------------------------


def _child_argv(args, role: str, transport: str, mib: int, extra=()) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--transport", transport,
            "--mib", str(mib), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
            "--window", str(args.window), "--frame", str(args.frame), "--tests", args.tests,
            "--bulk-budget", str(args.bulk_budget), "--auto-window", str(args.auto_window),
            *extra]
    if args.profile:
        argv += ["--profile", args.profile]
    return argv


def _go_argv(args, role: str, mib: int, extra=()) -> list[str]:
    return [args.go_binary, "-role", role, "-token", TOKEN, "-path", WS_PATH.decode(),
            "-window", str(args.window), "-ws-buffer", str(args.go_ws_buffer), *extra]


def _server_argv(args, transport: str, mib: int) -> list[str]:
    if SIDES[transport][0] == "go":
        return _go_argv(args, "server", mib)
    return _child_argv(args, "server", transport if transport in PY_TRANSPORTS else "ws", mib)


def _client_argv(args, transport: str, mib: int, port: int, pid: int) -> list[str]:
    if SIDES[transport][1] == "go":
        return _go_argv(args, "client", mib, (
            "-port", str(port), "-server-pid", str(pid), "-mib", str(mib),
            "-rounds", str(args.rounds), "-warmup", str(args.warmup), "-tests", args.tests))
    return _child_argv(args, "client", transport if transport in PY_TRANSPORTS else "ws", mib,
                       ("--port", str(port), "--server-pid", str(pid)))


def run_pair(args, transport: str, mib: int) -> dict:
    """One listening and one dialling process for ``transport`` moving ``mib`` MiB per test;
    both are reaped (killed if need be) before this returns, and their pids recorded."""
    server = subprocess.Popen(_server_argv(args, transport, mib),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client = None
    try:
        hello = json.loads(server.stdout.readline() or "null")
        if not hello:
            raise RuntimeError(f"the {transport} server did not start")
        client = subprocess.Popen(_client_argv(args, transport, mib, hello["port"], hello["pid"]),
                                  stdout=subprocess.PIPE, text=True)
        out, _ = client.communicate(timeout=TEST_TIMEOUT * 6)
        if client.returncode != 0:
            raise RuntimeError(f"the {transport} client failed (exit {client.returncode})")
        result = json.loads(out.strip().splitlines()[-1])
        server.stdin.close()
        tail = server.stdout.read()
        server.wait(timeout=30)
        server_stats = json.loads(tail.strip().splitlines()[-1])
    finally:
        for process in (client, server):
            if process is not None:
                if process.poll() is None:
                    process.kill()
                process.wait()
    result["client_pid"] = client.pid
    result["server"] = {"rss_ready_kib": hello["rss_ready_kib"], "pid": server.pid,
                        **server_stats}
    return result


def build_go(cache_dir: str = GO_BIN_DIR) -> tuple[str | None, str | None]:
    """Build ``gotransport/main.go`` offline in GOPATH mode against Debian's Go sources, as
    tests/interop builds its Go peer; cached by a hash of the Go version and every source.
    Returns (binary, None) or (None, why not), never raises for a missing toolchain."""
    import hashlib
    import shutil
    import tempfile

    if shutil.which("go") is None:
        return None, "`go` is not on PATH"
    sources = []
    for package, _deb in GO_LIBRARIES.values():
        folder = os.path.join(GOPATH, "src", package)
        found = sorted(f for f in (os.listdir(folder) if os.path.isdir(folder) else ())
                       if f.endswith(".go"))
        if not found:
            return None, f"the Go sources of {package} are missing ({folder})"
        sources += [os.path.join(folder, f) for f in found]
    env = dict(os.environ, GO111MODULE="off", GOPATH=GOPATH, GOFLAGS="", GOPROXY="off",
               GOTOOLCHAIN="local", GOCACHE=os.path.join(cache_dir, ".gocache"),
               CGO_ENABLED="0")
    try:
        version = subprocess.run(["go", "version"], env=env, capture_output=True, text=True,
                                 timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"`go version` failed: {e}"
    if version.returncode != 0:
        return None, f"`go version` failed: {version.stderr.strip()}"
    digest = hashlib.sha256(version.stdout.encode())
    for path in [GO_SRC, *sources]:
        with open(path, "rb") as f:
            digest.update(path.encode() + b"\0" + f.read())
    target = os.path.join(cache_dir, f"gotransport-{digest.hexdigest()[:16]}")
    if os.access(target, os.X_OK):
        return target, None
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gotransport-build-") as tmp:
        out = os.path.join(tmp, "gotransport")
        try:
            build = subprocess.run(["go", "build", "-o", out, GO_SRC], cwd=GO_DIR, env=env,
                                   capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"`go build` failed: {e}"
        if build.returncode != 0:
            return None, f"`go build` failed:\n{(build.stdout + build.stderr)[-2000:]}"
        partial = f"{target}.{os.getpid()}"
        shutil.copy2(out, partial)
        os.replace(partial, target)  # atomic: a concurrent run never sees half a binary
    for stale in os.listdir(cache_dir):  # one binary per source version, not one per edit
        if stale.startswith("gotransport-") and stale != os.path.basename(target):
            try:
                os.remove(os.path.join(cache_dir, stale))
            except OSError:
                pass
    return target, None


def go_versions() -> dict:
    versions = {"go": "?"}
    try:
        versions["go"] = subprocess.run(["go", "version"], capture_output=True, text=True,
                                        timeout=60).stdout.split()[2]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    for name, (_package, deb) in GO_LIBRARIES.items():
        try:
            versions[name] = subprocess.run(
                ["dpkg-query", "-W", "-f=${Version}", deb], capture_output=True, text=True,
                timeout=30).stdout.strip() or "?"
        except (OSError, subprocess.SubprocessError):
            versions[name] = "?"
    return versions


def machine() -> dict:
    import twisted

    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import autobahn
        autobahn_version = autobahn.__version__
    except ImportError:
        autobahn_version = "-"
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "twisted": twisted.__version__, "autobahn": autobahn_version,
            "kernel": platform.release()}


def coordinate(args) -> dict:
    transports = [t for t in args.transports.split(",") if t]
    if transports[0] != "tcp" and "tcp" in transports:
        transports.remove("tcp")
        transports.insert(0, "tcp")
    go_wanted = [t for t in transports if SIDES[t] != ("py", "py")]
    go = None
    if go_wanted:
        args.go_binary, why = build_go()
        if args.go_binary is None:
            print(f"# skipping {', '.join(go_wanted)}: the Go side cannot be built: {why}\n"
                  f"# {GO_INSTALL_HINT}", file=sys.stderr, flush=True)
            transports = [t for t in transports if t not in go_wanted]
            if not transports:
                raise SystemExit("bench_transport.py: no transport left to run")
        else:
            go = go_versions()
    sizes = sorted({args.mem_mib, args.mib}) if args.mem_mib else [args.mib]
    from localai_tw.mux.session import SessionConfig

    args.frame = args.frame or SessionConfig().max_frame_size
    report = {"machine": machine(), "argv": sys.argv[1:], "mib": args.mib, "sizes": sizes,
              "window_kib": args.window, "frame": args.frame, "repeat": args.repeat,
              "go": go, "go_ws_buffer": args.go_ws_buffer,
              "loadavg_before": _loadavg(), "runs": {}}
    # Repetitions are interleaved, so a burst of load from elsewhere hits every transport
    # alike rather than all the repetitions of one.
    for repetition in range(args.repeat):
        for mib in sizes:
            for transport in transports:
                print(f"# {LABELS[transport]}, {mib} MiB per test, run {repetition + 1}"
                      f"/{args.repeat} ...", file=sys.stderr, flush=True)
                started = time.perf_counter()
                report["runs"].setdefault(f"{transport}-{mib}", []).append(
                    run_pair(args, transport, mib))
                print(f"#   {time.perf_counter() - started:.1f} s", file=sys.stderr,
                      flush=True)
    report["loadavg_after"] = _loadavg()
    return report


def _loadavg() -> str:
    """Load average, and the share of the last minute some task waited for a CPU (PSI): the
    figures are only comparable between runs on a quiet machine."""
    text = "?"
    try:
        with open("/proc/loadavg") as f:
            text = " ".join(f.read().split()[:3])
        with open("/proc/pressure/cpu") as f:
            some = dict(kv.split("=") for kv in f.readline().split()[1:])
        text += f", cpu pressure {some['avg60']}%"
    except (OSError, KeyError, ValueError):
        pass
    return text


# -- the report --------------------------------------------------------------------------------


def _tests(report, transport, mib):
    """Per test, the best of the repetitions: highest MB/s, lowest RTT p50 (load from other
    processes on the machine only ever makes a figure worse)."""
    runs = report["runs"].get(f"{transport}-{mib}")
    if not runs:
        return None
    best = {}
    for run in runs:
        for t in run["tests"]:
            held = best.get(t["test"])
            if held is None or ("mb_per_s" in t and t["mb_per_s"] > held["mb_per_s"]) or (
                    "rtt_p50_us" in t and t["rtt_p50_us"] < held["rtt_p50_us"]):
                best[t["test"]] = t
    return best


def _peak(report, transport, mib, role) -> float:
    """Largest peak RSS (MiB) of ``role`` over the repetitions."""
    return max((run if role == "dialler" else run["server"])["peak_rss_kib"]
               for run in report["runs"][f"{transport}-{mib}"]) / 1024


def _ready(report, transport, mib, role) -> float:
    return min((run if role == "dialler" else run["server"])["rss_ready_kib"]
               for run in report["runs"][f"{transport}-{mib}"]) / 1024


def render(report) -> str:
    m = report["machine"]
    mib, sizes = report["mib"], report["sizes"]
    present = [t for t in TRANSPORTS if f"{t}-{mib}" in report["runs"]]
    lines = [f"Machine: {m['cpus']} CPUs, {m['cpu_model']}, Linux {m['kernel']}, "
             f"Python {m['python']}, Twisted {m['twisted']}, Autobahn {m['autobahn']}",
             f"Bytes per bulk test: {mib} MiB (8 streams: {mib / 8:g} MiB each); "
             f"yamux max window {report['window_kib']} KiB, max frame "
             f"{report['frame']} bytes; MB = 10**6 bytes; "
             f"best of {report['repeat']} interleaved run(s) per figure; load average "
             f"{report['loadavg_before']} before, {report['loadavg_after']} after.", ""]

    base = _tests(report, "tcp", mib)
    head = "| metric |"
    rule = "|---|"
    for t in present:
        head += f" {LABELS[t]} |"
        rule += "---:|"
        if t != "tcp" and base:
            head += " vs TCP |"
            rule += "---:|"
    lines += [head, rule]

    def row(label, key, test, fmt, lower_is_better=False):
        cells = f"| {label} |"
        for t in present:
            value = _tests(report, t, mib)[test][key]
            cells += f" {fmt.format(value)} |"
            if t != "tcp" and base:
                ratio = value / base[test][key]
                cells += f" {ratio:.2f}x |"
        lines.append(cells)

    for direction, name in (("up", "up (dialler -> listener)"),
                            ("down", "down (listener -> dialler)")):
        for streams in STREAMS:
            row(f"{name}, {streams} stream{'s' if streams > 1 else ''}, MB/s", "mb_per_s",
                f"{direction}-{streams}", "{:.0f}")
    row("1-byte RTT p50, us", "rtt_p50_us", "rtt", "{:.0f}")
    row("1-byte RTT p99, us", "rtt_p99_us", "rtt", "{:.0f}")

    lines += ["", "CPU cost, dialler / listener: ns of CPU (user + system) per byte moved, "
              "or us per round trip; in brackets the share of the wall time each process was "
              "on a core.  Unlike MB/s, these barely move with load from other processes; "
              "'ceiling' is 1000 / the larger ns/B, the MB/s if each side had a core to itself "
              "and nothing else limited it:", "",
              "| test |" + "".join(f" {LABELS[t]} |" for t in present)
              + "".join(f" ceiling {LABELS[t]} |" for t in present),
              "|---|" + "---:|" * (2 * len(present))]
    for test in [f"{d}-{s}" for d in ("up", "down") for s in STREAMS] + ["rtt"]:
        cells, ceilings = f"| {test} |", ""
        for t in present:
            r = _tests(report, t, mib)[test]
            cpu_d, cpu_l = r["cpu_client"] * r["seconds"], r["cpu_server"] * r["seconds"]
            if test == "rtt":
                n = r["rounds_total"] / 1e6
                cells += f" {cpu_d / n:.0f} / {cpu_l / n:.0f} us"
                ceilings += " - |"
            else:
                n = r["bytes"] / 1e9
                cells += f" {cpu_d / n:.2f} / {cpu_l / n:.2f}"
                ceilings += f" {1e3 / max(cpu_d / n, cpu_l / n):.0f} |"
            cells += f" ({r['cpu_client']:.2f} / {r['cpu_server']:.2f}) |"
        lines.append(cells + ceilings)

    lines += ["", "Peak RSS (MiB) of each process by bytes moved per test "
              "(ready = after setup, before any traffic):", "",
              "| transport | process | ready |" + "".join(f" peak, {s} MiB |" for s in sizes)
              + (" growth |" if len(sizes) > 1 else ""),
              "|---|---|---:|" + "---:|" * len(sizes) + ("---:|" if len(sizes) > 1 else "")]
    for t in present:
        for role in ("dialler", "listener"):
            peaks = [_peak(report, t, s, role) for s in sizes]
            cells = f"| {LABELS[t]} | {role} | {_ready(report, t, mib, role):.1f} |" + "".join(
                f" {p:.1f} |" for p in peaks)
            if len(sizes) > 1:
                cells += f" {peaks[-1] - peaks[0]:+.1f} |"
            lines.append(cells)

    pauses = []
    for t in [t for t in present if t in PY_TRANSPORTS]:
        tests = _tests(report, t, mib)
        server = report["runs"][f"{t}-{mib}"][-1]["server"]
        pauses.append(f"{LABELS[t]}: dialler sender paused {tests['up-1']['sender_pauses']} + "
                      f"{tests['up-8']['sender_pauses']} times, listener senders "
                      f"{server['server_pauses']} times")
    if pauses:
        lines += ["", "Flow control exercised: " + "; ".join(pauses) + "."]
    lines += render_against_go(report)

    if base and "ws" in present:
        ws = _tests(report, "ws", mib)
        lines += ["", "Targets:"]
        for direction in ("up", "down"):
            worst = min(ws[f"{direction}-{s}"]["mb_per_s"] / base[f"{direction}-{s}"]["mb_per_s"]
                        for s in STREAMS)
            lines.append(f"- yamux/WS {direction} >= 40% of raw TCP: worst {worst:.0%} "
                         f"-> {'met' if worst >= 0.40 else 'MISSED'}")
        ratio = ws["rtt"]["rtt_p50_us"] / base["rtt"]["rtt_p50_us"]
        lines.append(f"- yamux/WS RTT p50 <= 3x raw TCP: {ratio:.2f}x "
                     f"-> {'met' if ratio <= 3 else 'MISSED'}")
        if len(sizes) > 1:
            growth = max(_peak(report, t, sizes[-1], role) - _peak(report, t, sizes[0], role)
                         for t in present for role in ("dialler", "listener"))
            lines.append(f"- peak RSS independent of bytes moved ({sizes[0]} vs {sizes[-1]} "
                         f"MiB): largest growth {growth:+.1f} MiB "
                         f"-> {'met' if growth < 8 else 'MISSED'}")
    return "\n".join(lines)


def render_against_go(report) -> list[str]:
    """The side-by-side table of issue 25 §3: Python yamux/WS against Go yamux/WS (and the
    mixed pairs, when run), ratio Python/Go; empty unless both ws and go-ws ran."""
    mib = report["mib"]
    py, go = _tests(report, "ws", mib), _tests(report, "go-ws", mib)
    if not (py and go):
        return []
    mixed = [t for t in ("go-ws-server", "go-ws-client") if _tests(report, t, mib)]
    versions = report.get("go") or {}
    lines = ["", f"Against Go (issue 25 §3): Go {versions.get('go', '?')}, hashicorp/yamux "
             f"{versions.get('yamux', '?')}, gorilla/websocket {versions.get('gorilla', '?')} "
             f"(buffers {report.get('go_ws_buffer') or 4096} bytes; LocalAI's tunnel: 65536). Ratio Python/Go: "
             "MB/s Python / MB/s Go, and for the RTT p50 Go's / Python's, so in every row "
             "above 1 means Python is faster, 1 is parity, the goal is >= 0.6.", "",
             "| metric | Python yamux/WS | Go yamux/WS | Python/Go |"
             + "".join(f" {LABELS[t]} |" for t in mixed),
             "|---|---:|---:|---:|" + "---:|" * len(mixed)]
    worst = None
    for direction, name in (("up", "up (worker -> frontend)"),
                            ("down", "down (frontend -> worker)")):
        for streams in STREAMS:
            test = f"{direction}-{streams}"
            ratio = py[test]["mb_per_s"] / go[test]["mb_per_s"]
            worst = ratio if worst is None else min(worst, ratio)
            lines.append(f"| {name}, {streams} stream{'s' if streams > 1 else ''}, MB/s | "
                         f"{py[test]['mb_per_s']:.0f} | {go[test]['mb_per_s']:.0f} | "
                         f"{ratio:.2f}x |" + "".join(
                             f" {_tests(report, t, mib)[test]['mb_per_s']:.0f} |"
                             for t in mixed))
    ratio = go["rtt"]["rtt_p50_us"] / py["rtt"]["rtt_p50_us"]
    worst = min(worst, ratio)
    lines.append(f"| 1-byte RTT p50, us (ratio Go/Python) | {py['rtt']['rtt_p50_us']:.0f} | "
                 f"{go['rtt']['rtt_p50_us']:.0f} | {ratio:.2f}x |" + "".join(
                     f" {_tests(report, t, mib)['rtt']['rtt_p50_us']:.0f} |" for t in mixed))
    lines += ["", "CPU ns per byte moved (us per round trip for rtt), dialler / listener:", "",
              "| test | Python yamux/WS | Go yamux/WS | Python/Go dialler | Python/Go listener |"
              + "".join(f" {LABELS[t]} |" for t in mixed),
              "|---|---:|---:|---:|---:|" + "---:|" * len(mixed)]

    def cost(r, test):
        n = r["rounds_total"] / 1e6 if test == "rtt" else r["bytes"] / 1e9
        return r["cpu_client"] * r["seconds"] / n, r["cpu_server"] * r["seconds"] / n

    for test in [f"{d}-{s}" for d in ("up", "down") for s in STREAMS] + ["rtt"]:
        fmt = "{:.0f}" if test == "rtt" else "{:.2f}"
        (pd, pl), (gd, gl) = cost(py[test], test), cost(go[test], test)
        def ratio(a, b):  # CPU times come in clock ticks: a short run may show none
            return f"{a / b:.1f}x" if b else "-"

        cells = (f"| {test} | {fmt.format(pd)} / {fmt.format(pl)} | {fmt.format(gd)} / "
                 f"{fmt.format(gl)} | {ratio(pd, gd)} | {ratio(pl, gl)} |")
        for t in mixed:
            md, ml = cost(_tests(report, t, mib)[test], test)
            cells += f" {fmt.format(md)} / {fmt.format(ml)} |"
        lines.append(cells)
    lines += ["", f"- Python yamux/WS >= 0.6x Go on every row: worst {worst:.2f}x "
              f"-> {'met' if worst >= 0.6 else 'MISSED'}"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per bulk test")
    parser.add_argument("--mem-mib", type=int, default=64,
                        help="second, smaller size run to compare peak RSS (0: skip)")
    parser.add_argument("--rounds", type=int, default=2000, help="1-byte echoes")
    parser.add_argument("--warmup", type=int, default=200, help="echoes dropped first")
    parser.add_argument("--window", type=int, default=256, help="yamux max window, KiB")
    parser.add_argument("--frame", type=int, default=0,
                        help="yamux max frame size, bytes (0: the library default)")
    parser.add_argument("--bulk-budget", type=int, default=0,
                        help="yamux bulk bytes in flight per session, KiB (0: no limit)")
    parser.add_argument("--auto-window", type=int, default=0,
                        help="yamux receive-window auto-tuning ceiling per stream, KiB (0: off)")
    parser.add_argument("--transports", default="tcp,yamux,ws",
                        help="comma-separated, from: " + ",".join(TRANSPORTS)
                        + " (go-ws: Go on both sides; go-ws-server: Go listener, Python "
                        "dialler; go-ws-client: Python listener, Go dialler)")
    parser.add_argument("--go-ws-buffer", type=int, default=65536,
                        help="gorilla/websocket read and write buffer of the Go side, bytes "
                        "(default 65536, what LocalAI's tunnel sets; 0: gorilla's own 4096)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="interleaved runs; each figure is the best of them")
    parser.add_argument("--tests", default=ALL_TESTS,
                        help="subset to run (for profiling; the report needs them all)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--profile", metavar="DIR", help="cProfile both sides into DIR")
    parser.add_argument("--role", choices=("server", "client"), help=argparse.SUPPRESS)
    parser.add_argument("--transport", choices=TRANSPORTS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup >= args.rounds:
        parser.error("--warmup must be below --rounds")
    unknown = [t for t in args.transports.split(",") if t and t not in TRANSPORTS]
    if unknown or not args.transports.strip(","):
        parser.error(f"--transports: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {','.join(TRANSPORTS)}")

    if args.role == "server":
        run_server(args)
        return
    if args.role == "client":
        run_client(args)
        return
    report = coordinate(args)
    if args.tests == ALL_TESTS:
        print(render(report))
    else:  # a partial run (profiling): the raw rows
        for key, runs in report["runs"].items():
            for run in runs:
                for t in run["tests"]:
                    print(key, json.dumps(t))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
