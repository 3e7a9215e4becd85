"""Issue 21 §2: where a replica's fetches may connect (``frontend/inference/fetchpolicy.py``), played as
the attack against a real replica through ``POST /models/apply``: gallery entries whose files,
config URL or index point at a loopback HTTP server the test starts, at a host name that
resolves to 127.0.0.1 (``localhost``), or at an allowed-looking host that redirects to
loopback.  By default each is refused before any byte reaches the loopback server, with one
error text whatever the cause (the reason only in the operator's log); with the operator's
``--allow-private-downloads`` the same install succeeds.

Red without the policy (``FetchEndpointFactory`` connecting everywhere): every install reached
the loopback server and was done (commit message)."""

from __future__ import annotations

import socket

import pytest
import pytest_twisted
import yaml
from twisted.internet import reactor
from twisted.logger import globalLogPublisher
from twisted.web import resource, server

from localai_tw.frontend.inference import fetchpolicy

from .inference_harness import sha256_hex
from .support import eventually
from .harness_gallery import SMALL, _done, call, entry, job, model_files
from .harness_downloads import FileServer

UNIFORM = "failed; the frontend's log says why"


class Redirector(resource.Resource):
    """Every GET answers 302 to ``target``."""

    isLeaf = True

    def __init__(self, target: bytes):
        super().__init__()
        self.target = target
        self.gets = 0

    def render_GET(self, request):
        self.gets += 1
        request.redirect(self.target)
        return b""


@pytest.fixture
def files():
    site = server.Site(FileServer())
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    served = site.resource
    served.port = port.getHost().port
    served.base = f"http://127.0.0.1:{served.port}"
    yield served
    if not served.release.called:
        served.release.callback(None)
    port.stopListening()


@pytest.fixture
def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def logged():
    lines: list[str] = []

    def observe(event):
        from twisted.logger import formatEvent
        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)


async def install(cluster, frontend, name: str) -> dict:
    status, applied = await call(cluster, frontend, "POST", "/models/apply", {"id": name})
    assert status == 200, applied
    _, done = await eventually(lambda: _done(job(cluster, frontend, applied["uuid"])),
                               timeout=60, what=f"{name} finished")
    return done


@pytest_twisted.ensureDeferred
async def test_request_caused_fetches_never_reach_loopback_unless_the_operator_allows(
        cluster, files, closed_port, logged, tmp_path, monkeypatch):
    files.files["a.bin"] = SMALL
    digest = sha256_hex(SMALL)
    files.files["entry.yaml"] = yaml.safe_dump({
        "config_file": "backend: echo\nparameters:\n  model: viaurl/a.bin\n",
        "files": [{"filename": "viaurl/a.bin", "uri": f"{files.base}/files/a.bin",
                   "sha256": digest}]}).encode()
    files.files["index.yaml"] = yaml.safe_dump([
        entry("web", [("web/a.bin", f"{files.base}/files/a.bin", None)])]).encode()
    # An "allowed-looking" host: 127.0.0.2, which this test declares public, redirects to
    # the loopback server at 127.0.0.1 (the policy must check the second hop too).
    redirector = Redirector(f"{files.base}/files/a.bin".encode())
    redirect_port = reactor.listenTCP(0, server.Site(redirector), interface="127.0.0.2")
    real = fetchpolicy.refused_because
    monkeypatch.setattr(fetchpolicy, "refused_because",
                        lambda a: None if a == "127.0.0.2" else real(a))
    try:
        redirecting = f"http://127.0.0.2:{redirect_port.getHost().port}/a.bin"
        entries = [
            entry("open", [("open/a.bin", f"{files.base}/files/a.bin", digest)]),
            # closed and gone name bytes no other entry has: the models directory's content
            # store (one copy per digest) cannot stand in for their fetch
            entry("closed", [("closed/a.bin", f"http://127.0.0.1:{closed_port}/a.bin",
                              sha256_hex(b"closed"))]),
            entry("named", [("named/a.bin",
                             f"http://localhost:{files.port}/files/a.bin", digest)]),
            entry("redirected", [("redirected/a.bin", redirecting, digest)]),
            {"name": "viaurl", "url": f"{files.base}/files/entry.yaml"},
            entry("gone", [("gone/a.bin", f"{files.base}/files/gone.bin",
                            sha256_hex(b"gone"))]),
        ]
        index = tmp_path / "index.yaml"
        index.write_text(yaml.safe_dump(entries))
        a = await cluster.frontend("replica-a", galleries=[f"test=file://{index}"],
                                   **{"allow-private-downloads": False})
        await eventually(lambda: a.replica.gallery._subscription is not None, timeout=20,
                         what="listening")

        errors = {}
        for name in ("open", "closed", "named", "redirected", "viaurl"):
            done = await install(cluster, a, name)
            assert done["state"] == "failed", (name, done)
            errors[name] = done["error"]
        assert files.gets == [], "a request reached the loopback server"
        assert redirector.gets == 1  # the first hop was allowed, the redirect's was not
        assert model_files(cluster.models_dir) == []
        # One text whatever happened (open port, closed port, a name, a redirect): only the
        # URL the entry names differs, and it says nothing of the cause.
        for name, url in (("open", f"{files.base}/files/a.bin"),
                          ("closed", f"http://127.0.0.1:{closed_port}/a.bin"),
                          ("named", f"http://localhost:{files.port}/files/a.bin"),
                          ("redirected", redirecting)):
            assert errors[name] == (f"model {name}: downloading {name}/a.bin from {url} "
                                    f"{UNIFORM}"), errors[name]
        assert errors["viaurl"] == (f"{files.base}/files/entry.yaml cannot be fetched; the "
                                    "frontend's log says why"), errors["viaurl"]
        text = "\n".join(logged)
        assert "127.0.0.1 is loopback" in text and "--allow-private-downloads" in text

        # an index over http:// at loopback: a 502 with the same kind of text
        web = await cluster.frontend("replica-web",
                                     galleries=[f"web={files.base}/files/index.yaml"],
                                     **{"allow-private-downloads": False})
        status, body = await call(cluster, web, "GET", "/models/available")
        assert status == 502 and "the frontend's log says why" in body["error"]["message"]
        assert files.gets == []

        # The operator's option: the same entries install from the loopback server, and an
        # open port that answers 404 reads like the closed one.
        b = await cluster.frontend("replica-b", galleries=[f"test=file://{index}"],
                                   **{"allow-private-downloads": True})
        await eventually(lambda: b.replica.gallery._subscription is not None, timeout=20,
                         what="listening")
        for name in ("open", "named", "redirected", "viaurl"):
            done = await install(cluster, b, name)
            assert done["state"] == "done", (name, done)
        closed = await install(cluster, b, "closed")
        assert closed["state"] == "failed" and closed["error"].endswith(UNIFORM), closed
        gone = await install(cluster, b, "gone")
        assert gone["state"] == "failed" and gone["error"] == (
            f"model gone: downloading gone/a.bin from {files.base}/files/gone.bin {UNIFORM}")
    finally:
        await redirect_port.stopListening()


@pytest_twisted.ensureDeferred
async def test_an_install_reads_no_local_file_unless_the_operator_allows(cluster, tmp_path):
    """An entry's ``file://`` file, a ``file://`` in its config's ``download_files`` (fetched
    at a cold load) or a ``file://`` entry ``url`` fails the install naming the option, and
    nothing is read or written; with ``--allow-private-downloads`` the same local file
    installs.
    Red without ``GalleryJobs._refuse_local``: the "files" install was done, the local file
    copied into the models directory."""
    secret = tmp_path / "secret.key"
    secret.write_bytes(b"not for the models directory\n")
    config = tmp_path / "entry.yaml"
    config.write_text(yaml.safe_dump({"config_file": "backend: echo\n"}))
    index = tmp_path / "index.yaml"
    index.write_text(yaml.safe_dump([
        entry("files", [("files/a.bin", f"file://{secret}", None)]),
        {"name": "config", "config_file": "backend: echo\ndownload_files:\n"
                                           f"  - {{filename: c.bin, uri: 'file://{secret}'}}\n"},
        {"name": "viaurl", "url": f"file://{config}"},
    ]))
    a = await cluster.frontend("replica-a", galleries=[f"test=file://{index}"],
                               **{"allow-private-downloads": False})
    await eventually(lambda: a.replica.gallery._subscription is not None, timeout=20,
                     what="listening")
    for name in ("files", "config", "viaurl"):
        done = await install(cluster, a, name)
        assert done["state"] == "failed", (name, done)
        assert "reads no file:// source" in done["error"], done
        assert "--allow-private-downloads" in done["error"]
    assert model_files(cluster.models_dir) == []

    b = await cluster.frontend("replica-b", galleries=[f"test=file://{index}"],
                               **{"allow-private-downloads": True})
    await eventually(lambda: b.replica.gallery._subscription is not None, timeout=20,
                     what="listening")
    done = await install(cluster, b, "files")
    assert done["state"] == "done", done
