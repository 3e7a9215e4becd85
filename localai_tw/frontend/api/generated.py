"""Generated files every replica serves: :class:`GeneratedFiles` (the store, in PostgreSQL) and
:class:`GeneratedFilesResource` (``GET /generated-images/<name>``, LocalAI's path).

Why PostgreSQL: an image answered as a URL is fetched later, through the load balancer, by
whichever replica it picks; the database is the only thing every replica shares (their data
directories are their own).  Bounded: a file of at most :data:`MAX_FILE_BYTES`; each expires
:data:`DEFAULT_TTL_SECONDS` after it was stored; and every store first drops expired rows, then
the oldest rows beyond :data:`DEFAULT_MAX_TOTAL_BYTES` in total (the new file included), so the
table never holds more than that.  Names are 128 random bits: the URL is the capability (no API
key is asked, as a browser or an ``<img>`` tag fetches it without one; LocalAI serves these
files without a key too).

What this module must never do: serve a name that is not exactly ``<32 hex>.<ext>``, serve an
expired row, let the table grow past its bound, or block the reactor (every query is async).
"""

from __future__ import annotations

import re
import secrets

from twisted.logger import Logger
from twisted.web import server
from twisted.web.resource import Resource

from localai_tw.frontend.api.kit import DATABASE_DOWN, write_json

log = Logger()

MAX_FILE_BYTES = 16 * 1024 * 1024
DEFAULT_TTL_SECONDS = 3600
DEFAULT_MAX_TOTAL_BYTES = 256 * 1024 * 1024
_NAME = re.compile(r"^[0-9a-f]{32}\.(png|wav)$")
_SUFFIXES = {".png": "image/png", ".wav": "audio/wav"}


class GeneratedFiles:
    """The shared, bounded, expiring store (see the module docstring)."""

    def __init__(self, db, *, ttl: int = DEFAULT_TTL_SECONDS,
                 max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES):
        self._db = db
        self.ttl = int(ttl)
        self.max_total_bytes = int(max_total_bytes)

    async def put(self, data: bytes, content_type: str, suffix: str) -> str:
        """Keep ``data``; its name (``<32 hex><suffix>``)."""
        if suffix not in _SUFFIXES or _SUFFIXES[suffix] != content_type:
            raise ValueError(f"not a generated file type: {suffix} {content_type}")
        if len(data) > min(MAX_FILE_BYTES, self.max_total_bytes):
            raise ValueError(f"a generated file is at most {MAX_FILE_BYTES} bytes")
        name = secrets.token_hex(16) + suffix

        async def store(cursor):
            await cursor.execute("DELETE FROM generated_files WHERE expires_at <= now()")
            # The newest rows whose running total leaves room for this one stay.
            await cursor.execute(
                "DELETE FROM generated_files WHERE name IN (SELECT name FROM (SELECT name,"
                " sum(size) OVER (ORDER BY created_at DESC, name) AS running"
                " FROM generated_files) kept WHERE running > %s)",
                (self.max_total_bytes - len(data),))
            await cursor.execute(
                "INSERT INTO generated_files (name, content_type, size, data, expires_at)"
                " VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s))",
                (name, content_type, len(data), data, self.ttl))

        await self._db.runInteraction(store)
        return name

    async def get(self, name: str) -> tuple[str, bytes, float] | None:
        """``(content_type, data, seconds left)`` of a live file, or None."""
        if not _NAME.match(name):
            return None
        rows = await self._db.runQuery(
            "SELECT content_type, data, extract(epoch FROM expires_at - now())"
            " FROM generated_files WHERE name = %s AND expires_at > now()", (name,))
        if not rows:
            return None
        content_type, data, left = rows[0]
        return content_type, bytes(data), float(left)


class GeneratedFilesResource(Resource):
    """``GET /generated-images/<name>``: a file of the store, or a JSON 404."""

    isLeaf = True

    def __init__(self, store: GeneratedFiles):
        super().__init__()
        self._store = store

    def render(self, request):
        if request.method not in (b"GET", b"HEAD"):
            request.setHeader(b"allow", b"GET, HEAD")
            write_json(request, 405, {"error": {"message": "use GET", "type":
                                                "invalid_request_error"}})
            return server.NOT_DONE_YET
        segments = [s for s in request.postpath if s]
        name = segments[0].decode("ascii", "replace") if len(segments) == 1 else ""
        d = self._store.get(name) if _NAME.match(name) else None
        if d is None:
            self._missing(request)
            return server.NOT_DONE_YET
        from twisted.internet import defer

        defer.ensureDeferred(d).addCallbacks(
            lambda found: self._answer(request, found),
            lambda failure: self._failed(request, failure))
        return server.NOT_DONE_YET

    def _missing(self, request) -> None:
        write_json(request, 404, {"error": {
            "message": "no such generated file (it may have expired: generated files are kept "
                       f"for {self._store.ttl} s)", "type": "invalid_request_error",
            "code": "not_found"}})

    def _answer(self, request, found) -> None:
        if request.finished or request.channel is None:
            return
        if found is None:
            self._missing(request)
            return
        content_type, data, left = found
        request.setResponseCode(200)
        request.setHeader(b"content-type", content_type.encode("ascii"))
        request.setHeader(b"x-content-type-options", b"nosniff")
        request.setHeader(b"cache-control", b"private, max-age=%d" % max(int(left), 0))
        request.setHeader(b"content-length", b"%d" % len(data))
        if request.method != b"HEAD":
            request.write(data)
        request.finish()

    def _failed(self, request, failure) -> None:
        if request.finished or request.channel is None:
            return
        if failure.check(*DATABASE_DOWN):
            write_json(request, 503, {"error": {"message": "this replica's database is "
                                                "unavailable right now; try again",
                                                "type": "service_unavailable"}})
            return
        log.failure("serving a generated file failed", failure)
        write_json(request, 500, {"error": {"message": "internal error; see the frontend log",
                                            "type": "internal_error"}})
