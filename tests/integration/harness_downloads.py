"""A file server for model downloads (``download_files``, a URL ``parameters.model``), the
``files`` fixture that serves one on 127.0.0.1, and the model config that asks for one
(``test_model_downloads.py``, ``test_gallery.py``, ``test_backend_gallery.py``,
``test_webui.py``, ``test_dashboard.py``)."""

from __future__ import annotations

import pytest
from twisted.internet import defer, reactor
from twisted.web import resource, server


WEIGHTS = bytes(range(256)) * 4096  # 1 MiB


class FileServer(resource.Resource):
    """``/files/<name>`` whole; ``/held/<name>`` half, then the rest when ``release`` fires;
    ``/broken/<name>`` half, then the connection drops; ``/redirect/<name>`` -> ``/files/``."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.files: dict[str, bytes] = {}
        self.gets: list[bytes] = []
        self.release: defer.Deferred = defer.Deferred()

    def render_GET(self, request):
        self.gets.append(request.path)
        kind, name = request.postpath[0].decode(), request.postpath[-1].decode()
        if kind == "redirect":
            request.redirect(b"/files/" + name.encode())
            return b""
        data = self.files.get(name)
        if data is None:
            request.setResponseCode(404)
            return b"no such file"
        request.setHeader(b"content-length", b"%d" % len(data))
        if kind == "files":
            return data
        request.write(data[: len(data) // 2])
        if kind == "broken":
            reactor.callLater(0.05, request.channel.transport.loseConnection)
            return server.NOT_DONE_YET

        def rest(_):
            request.write(data[len(data) // 2:])
            request.finish()

        self.release.addCallback(rest)
        return server.NOT_DONE_YET


def download_model(url: str, digest: str | None, name: str = "dl",
                   filename: str = "dl/weights.bin") -> str:
    sha = f", sha256: '{digest}'" if digest else ""
    return (f"name: {name}\nbackend: echo\nparameters:\n  model: {filename}\n"
            f"options: ['echo.dim:4']\n"
            f"download_files:\n  - {{filename: {filename}, uri: '{url}'{sha}}}\n")


@pytest.fixture
def files():
    """A :class:`FileServer` on 127.0.0.1 (its ``base`` URL set), stopped after the test; a
    held answer is released first."""
    site = server.Site(FileServer())
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    served = site.resource
    served.base = f"http://127.0.0.1:{port.getHost().port}"
    yield served
    if not served.release.called:
        served.release.callback(None)
    port.stopListening()
