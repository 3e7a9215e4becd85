"""The web UI: static files served at ``/dashboard/`` (and the operators' dashboard at ``/``
for a browser), shipped in the package, nothing built at install time (``docs/operators.md``,
"Dashboard"): the operators' dashboard (``index.html``, ``app.js``), the users' chat page
(``chat.html``, ``chat.js``) and gallery page (``gallery.html``, ``gallery.js``), and the key
handling the two share (``key.js``).

The pages hold no secret and read nothing on the server side: they call the admin API
(``/api/nodes``, ``/api/cluster/instances``, ``/api/cluster/loads``, the gallery's ``/models``
routes) and the OpenAI API (``/v1/...``) from the browser with the API key the user types, so
those routes keep enforcing the key exactly as for any other client.  This module only serves files and decides, from ``Accept``, whether ``GET /`` is
a browser (the page) or an API client (the JSON index).  It must never put a secret or any
server-side state into what it serves, and never list a directory.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from twisted.web.static import File

from localai_tw.frontend.api.kit import JSONDirectory, NotFoundResource

#: The page's files (package data: setup.py and MANIFEST.in list them).
STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")

#: Sent with every file: the page loads only its own scripts and styles and talks only to its
#: own origin, and no other site may frame it (approve and drain buttons).
_SECURITY_HEADERS = {
    b"Content-Security-Policy": b"default-src 'self'; img-src 'self' data:; "
                                b"frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    b"X-Frame-Options": b"DENY",
    b"X-Content-Type-Options": b"nosniff",
    b"Referrer-Policy": b"no-referrer",
    b"Cache-Control": b"no-cache",
}


def _secure(request) -> None:
    for name, value in _SECURITY_HEADERS.items():
        request.setHeader(name, value)


class DashboardFiles(File):
    """The static files, with the security headers; a directory is never listed and a missing
    file is the JSON 404 every other path answers."""

    childNotFound = NotFoundResource()

    def render(self, request):
        _secure(request)
        return super().render(request)

    def directoryListing(self):
        return NotFoundResource()


def dashboard_files() -> DashboardFiles:
    return DashboardFiles(STATIC_DIR, defaultType="application/octet-stream")


def _accept_quality(accept: str) -> dict[str, float]:
    """``Accept``'s media ranges and their ``q`` (malformed parts are skipped)."""
    qualities: dict[str, float] = {}
    for part in accept.split(",")[:64]:
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        if not media:
            continue
        q = 1.0
        for param in fields[1:]:
            if param.lower().startswith("q="):
                try:
                    q = min(max(float(param[2:]), 0.0), 1.0)
                except ValueError:
                    q = 0.0
        qualities[media] = max(q, qualities.get(media, 0.0))
    return qualities


def prefers_html(accept: bytes | None) -> bool:
    """True when the client names ``text/html`` explicitly and likes it at least as much as
    JSON: a browser.  ``*/*`` alone (curl, API libraries) or no header keeps the JSON index."""
    if not accept:
        return False
    q = _accept_quality(accept.decode("latin-1")[:4096])
    html = q.get("text/html", 0.0)
    return html > 0 and html >= q.get("application/json", 0.0)


class RootWithDashboard(JSONDirectory):
    """``/``: the dashboard's page for a browser, the JSON index for everyone else."""

    def __init__(self, index: Mapping[str, Any]):
        super().__init__(index=index)
        self._files = dashboard_files()

    def render(self, request):
        request.setHeader(b"Vary", b"Accept")
        if request.method in (b"GET", b"HEAD") and prefers_html(request.getHeader(b"accept")):
            return self._files.getChild(b"index.html", request).render(request)
        return super().render(request)
