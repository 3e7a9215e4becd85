"""Test helpers for Ollama's API: a site with the ``/api/<name>`` rows of
``frontend/api/routes.py`` (mounted, guarded and capped by the table itself) over a
``FakeRouter``.  No test lives here; the module holds shared helpers only.
"""

from __future__ import annotations

from types import SimpleNamespace

from localai_tw.frontend.api import routes
from localai_tw.frontend.api.ollama import OllamaAPI
from localai_tw.web.listener import BoundedSite

#: The Ollama rows of the route table, and ``/api`` they hang from.
OLLAMA_PATHS = tuple(b"/api/" + name for name in
                     (b"chat", b"generate", b"embed", b"embeddings", b"show", b"tags", b"ps",
                      b"version"))


def ollama_rows() -> tuple:
    return tuple(row for row in routes.ROUTES if row.path == b"/api" or
                 row.path in OLLAMA_PATHS)


def make_ollama_site(router, api_keys, loaded=None, reactor=None) -> BoundedSite:
    """Ollama's endpoints as the replica mounts them: the rows of ``routes.ROUTES``, their
    guards, caps and early answer shape, over ``router`` (``loaded``: ``/api/ps``'s read)."""
    api = OllamaAPI(router, api_keys=api_keys, now=lambda: 1700000000, reactor=reactor,
                    loaded=loaded)
    site = BoundedSite(None, timeout=None)
    wiring = SimpleNamespace(ollama=api, site=site)
    rows = ollama_rows()
    site.resource = routes.build_root(wiring, {}, rows)
    routes.apply_policies(site, api_keys, rows)
    return site
