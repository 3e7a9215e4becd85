"""Fixtures for the yamux interop suite: a Go peer built from Debian's hashicorp/yamux.

* ``gopeer_binary`` (session): builds ``tests/interop/gopeer/main.go`` once, offline, in GOPATH
  mode against ``/usr/share/gocode`` (Debian's ``golang-github-hashicorp-yamux-dev`` and
  ``golang-github-gorilla-websocket-dev``).  The binary is cached by a hash of the source, the
  Go version and the library sources under ``tests/interop/gopeer/bin/`` (gitignored).
* ``gopeer`` (function): a launcher; ``await gopeer.start(...)`` spawns the binary and returns a
  ``GoPeer`` (see ``support.py``).  Every process it started is stopped when the test ends
  (SIGCONT, close stdin, SIGTERM, then SIGKILL), and a session finalizer SIGKILLs anything
  still alive as a last resort.

When Go or the Debian Go sources are missing the tests are skipped with a reason that names
``.ci/install-interop-deps`` -- except when ``CI=true`` or ``LOCALAI_REQUIRE_INTEROP=1``: then they
FAIL, because a suite that silently skips must not report success in CI.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import defer, reactor

from tests.interop.support import LIVE_PIDS, GoPeer

HERE = Path(__file__).resolve().parent
GOPEER_DIR = HERE / "gopeer"
GOPEER_SRC = GOPEER_DIR / "main.go"
BIN_DIR = GOPEER_DIR / "bin"
DEBIAN_GOPATH = Path(os.environ.get("LOCALAI_INTEROP_GOPATH", "/usr/share/gocode"))
YAMUX_SRC = DEBIAN_GOPATH / "src/github.com/hashicorp/yamux"
GORILLA_SRC = DEBIAN_GOPATH / "src/github.com/gorilla/websocket"
INSTALL_HINT = "run `bash .ci/install-interop-deps` (as root) to install golang-go, " \
               "golang-github-hashicorp-yamux-dev and golang-github-gorilla-websocket-dev"


def interop_required() -> bool:
    return (os.environ.get("CI", "").lower() == "true"
            or os.environ.get("LOCALAI_REQUIRE_INTEROP", "") == "1")


def unavailable(reason: str):
    """Fail (CI / LOCALAI_REQUIRE_INTEROP=1) or skip: the interop peer cannot be built."""
    msg = f"yamux interop peer unavailable: {reason}; {INSTALL_HINT}"
    if interop_required():
        pytest.fail(msg + " [failing because CI=true or LOCALAI_REQUIRE_INTEROP=1]",
                    pytrace=False)
    pytest.skip(msg)


def _missing_prerequisites() -> str | None:
    go = shutil.which("go")
    if go is None:
        return "`go` is not on PATH"
    for d in (YAMUX_SRC, GORILLA_SRC):
        if not (d.is_dir() and any(d.glob("*.go"))):
            return f"Go sources missing: {d}"
    return None


def _go_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "GO111MODULE": "off",          # GOPATH mode: Debian ships sources, not modules
        "GOPATH": str(DEBIAN_GOPATH),
        "GOFLAGS": "",
        "GOPROXY": "off",              # never go to the network
        "GOTOOLCHAIN": "local",
        "GOCACHE": str(cache_dir),
        "CGO_ENABLED": "0",
    })
    return env


def _cache_key(go_version: str) -> str:
    h = hashlib.sha256()
    h.update(go_version.encode())
    h.update(GOPEER_SRC.read_bytes())
    for d in (YAMUX_SRC, GORILLA_SRC):
        for f in sorted(d.glob("*.go")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _build() -> tuple[Path | None, str | None]:
    """Returns (binary, None) or (None, why-unavailable).  A failing build of present
    sources raises: that is a bug in main.go, not a missing dependency."""
    missing = _missing_prerequisites()
    if missing:
        return None, missing
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    env = _go_env(BIN_DIR / ".gocache")
    version = subprocess.run(["go", "version"], env=env, capture_output=True, text=True,
                             timeout=60)
    if version.returncode != 0:
        return None, f"`go version` failed: {version.stderr.strip()}"
    target = BIN_DIR / f"gopeer-{_cache_key(version.stdout.strip())}"
    if target.is_file() and os.access(target, os.X_OK):
        return target, None
    with tempfile.TemporaryDirectory(prefix="gopeer-build-") as tmp:
        out = Path(tmp) / "gopeer"
        proc = subprocess.run(["go", "build", "-o", str(out), str(GOPEER_SRC)],
                              cwd=str(GOPEER_DIR), env=env, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"building {GOPEER_SRC} failed:\n{proc.stdout}{proc.stderr}")
        partial = BIN_DIR / f".{target.name}.{os.getpid()}"
        shutil.copy2(out, partial)
        os.replace(partial, target)   # atomic: parallel sessions never see half a binary
    return target, None


@pytest.fixture(scope="session")
def gopeer_binary():
    """Path of the built Go peer, or None with the reason (tests call ``unavailable``)."""
    try:
        binary, why = _build()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield (binary, why)
    # Last resort: nothing we started may outlive the session.
    for pid in list(LIVE_PIDS):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break


class GoPeerLauncher:
    def __init__(self, binary: Path | None, why: str | None = None):
        self.binary = binary
        self.why = why
        self.peers: list[GoPeer] = []

    async def start(self, *args: str, wait_listening: bool | None = None,
                    timeout: float = 10.0) -> GoPeer:
        """Spawn ``gopeer *args``.  With ``-listen`` (default 127.0.0.1:0) waits for the bound
        address (``peer.port``).  Without a peer binary this fails or skips the test (inside the
        test body, so that CI reports FAILED, not an ERROR in setup)."""
        if self.binary is None:
            unavailable(self.why)
        args = list(args)
        if "-dial" not in args and "-listen" not in args:
            args += ["-listen", "127.0.0.1:0"]
        if wait_listening is None:
            wait_listening = "-listen" in args
        peer = GoPeer(str(self.binary), args)
        self.peers.append(peer)
        peer.spawn()
        if wait_listening:
            ev = await peer.wait_event("listening", timeout=timeout)
            peer.port = int(ev["addr"].rsplit(":", 1)[1])
        return peer

    async def stop_all(self) -> None:
        for peer in self.peers:
            await peer.stop()


@pytest_twisted.async_yield_fixture
async def gopeer(gopeer_binary):
    """Launcher of Go peers for one test; every peer is reaped when the test ends."""
    binary, why = gopeer_binary
    launcher = GoPeerLauncher(binary, why)
    try:
        yield launcher
    finally:
        await launcher.stop_all()


class Pair:
    """A Python yamux ``Session`` connected to one Go peer."""

    def __init__(self, session, go, listening=None):
        self.session = session
        self.go = go
        self.listening = listening


class PairMaker:
    """Connects a Python ``Session`` to a freshly started Go peer, over TCP or WebSocket.

    ``py_client=True``: Python is the yamux client (odd ids) and dials; Go is the yamux server
    and listens.  ``py_client=False``: Python is the yamux server and listens; Go dials.
    """

    def __init__(self, launcher: GoPeerLauncher):
        self.launcher = launcher
        self.pairs: list[Pair] = []
        self.cleanups: list = []

    async def open(self, py_client: bool = True, transport: str = "tcp", go_args=(),
                   config=None, acceptor=None, token: str | None = None) -> Pair:
        from localai_tw.mux.session import Session

        from tests.interop.support import connect_tcp, listen_tcp

        go_role = "server" if py_client else "client"
        args = ["-role", go_role, "-transport", transport, *go_args]
        if token is not None:
            args += ["-token", token]

        def make_session():
            return Session(client=py_client, config=config, acceptor=acceptor)

        if transport == "tcp":
            if py_client:
                go = await self.launcher.start(*args)
                session = await connect_tcp(go.port, make_session())
                pair = Pair(session, go)
            else:
                port, factory = listen_tcp(make_session)
                self.cleanups.append(port.stopListening)
                go = await self.launcher.start(*args, "-dial", f"127.0.0.1:{port.getHost().port}")
                session = await factory.session.addTimeout(10, reactor)
                pair = Pair(session, go, port)
        elif transport == "ws":
            from tests.interop import ws_support

            pair = await ws_support.open_ws_pair(self, py_client, args, make_session, token)
        else:
            raise ValueError(transport)
        self.pairs.append(pair)
        await pair.go.wait_event("session_started")
        return pair

    async def close_all(self) -> None:
        for pair in self.pairs:
            transport = getattr(pair.session, "transport", None)
            if transport is not None and getattr(pair.session, "isOpen", False):
                try:
                    transport.abortConnection()
                except Exception:
                    pass
        for cleanup in self.cleanups:
            try:
                await defer.maybeDeferred(cleanup)
            except Exception:
                pass
        await self.launcher.stop_all()


@pytest_twisted.async_yield_fixture
async def yamux_pair(gopeer):
    """``await yamux_pair.open(...)`` -> ``Pair(session, go)``; everything torn down after."""
    maker = PairMaker(gopeer)
    try:
        yield maker
    finally:
        await maker.close_all()
