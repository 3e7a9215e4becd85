"""The replica's route table (frontend/api/routes.py) decides the listener's policies: a route
mounted without a header guard is one of the few that authenticate themselves or serve anyone,
and every guarded path gets its guard and cap from the same row."""

from localai_tw.frontend.api import routes
from localai_tw.frontend.api.kit import APIKeyGuard
from localai_tw.frontend.api.openai import OPENAI_MAX_BODY_BYTES
from localai_tw.frontend.api.openai.transcription import TRANSCRIPTION_MAX_UPLOAD_BYTES
from localai_tw.web.listener import BoundedSite

#: Served to anyone, or authenticated by the resource itself (the worker's per-node credential
#: on /api/cluster/connect, the peer secret on /api/cluster/peer); docs/security.md.  /version
#: says the version and nothing else; /.well-known only holds localai.json (guarded).
UNGUARDED = {b"/dashboard", b"/healthz", b"/readyz", b"/generated-images", b"/api",
             b"/api/cluster", b"/api/cluster/connect", b"/api/cluster/peer", b"/version",
             b"/.well-known"}


def test_a_route_without_a_header_guard_is_one_of_the_known_public_ones():
    mounted_open = {row.path for row in routes.ROUTES if row.build and row.guard is None}
    assert mounted_open == UNGUARDED


def test_the_listener_takes_guards_caps_and_uploads_from_the_table():
    site = BoundedSite(None)
    routes.apply_policies(site, APIKeyGuard(["k"]))
    guarded = {b"/" + b"/".join(prefix) for prefix, _ in site.header_guards}
    assert guarded == {row.path for row in routes.ROUTES
                       if row.guard in (routes.OPENAI_KEY, routes.ADMIN_KEY, routes.ANY_KEY,
                                        routes.OLLAMA_KEY, routes.ANTHROPIC_KEY)}
    assert site.body_limit_for(b"/v1/chat/completions") == OPENAI_MAX_BODY_BYTES
    assert site.body_limit_for(b"/api/chat") == OPENAI_MAX_BODY_BYTES
    assert site.body_limit_for(b"/api/show") == site.default_limit
    assert site.body_limit_for(b"/chat/completions") == OPENAI_MAX_BODY_BYTES
    assert site.body_limit_for(b"/audio/transcriptions") == TRANSCRIPTION_MAX_UPLOAD_BYTES
    assert site.spools(b"/audio/transcriptions") and site.spools(b"/v1/audio/transcriptions")
    assert not site.spools(b"/v1/chat/completions")


def test_the_discovery_document_lists_only_routes_this_replica_mounts():
    """Every path of /.well-known/localai.json is answered here: its first segment is a row of
    the table, and a /v1 path is a route of the OpenAI API.  Red when a LocalAI route this
    server does not serve (``/v1/mcp/...``, ``/api/p2p``) is added to the document."""
    from localai_tw.frontend.api.discovery import ENDPOINT_GROUPS, ENDPOINTS
    from localai_tw.frontend.api.openai.resource import ROUTES as OPENAI_ROUTES
    from localai_tw.frontend.api.openai.resource import UNPREFIXED

    mounted = {row.path for row in routes.ROUTES if row.build}
    paths = set(ENDPOINTS.values()) | {p for g in ENDPOINT_GROUPS.values() for p in g.values()}
    for path in sorted(paths):
        segments = [s for s in path.split("/") if s]
        keys = tuple(s.encode() for s in segments)
        if segments[0] == "v1":
            rest = keys[1:]
            assert rest in OPENAI_ROUTES or (rest[0] == b"models" and len(rest) == 2), path
        elif len(keys) == 1 and keys in UNPREFIXED:
            continue
        else:
            prefixes = {b"/" + b"/".join(keys[:n]) for n in range(1, len(keys) + 1)}
            assert prefixes & (mounted - {b"/api", b"/api/cluster"}), path
