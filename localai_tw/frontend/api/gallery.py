"""LocalAI's gallery routes under ``/models`` (``gallery.py`` does the work):
``GET /models/available``, ``GET /models/galleries``, ``POST /models/apply``,
``GET /models/jobs``, ``GET /models/jobs/{id}``, ``POST /models/delete/{name}``.

They are admin routes (LocalAI puts them behind its admin middleware): the admin API key, as
``/api/nodes``; with no ``--api-key`` they are disabled. ``/models`` itself and
``/models/capabilities`` stay LocalAI's unprefixed OpenAI aliases (:class:`ModelsRoot`).

An install names an entry of a configured gallery (``id``: ``gallery@name`` or ``name``); a
``url``, ``files`` or ``config_url`` in the request is refused, so an API caller never makes a
replica fetch a URL of its choosing.  ``overrides`` are restricted to harmless keys
(``gallery/overrides.py``), and a ``name`` that is installed already is refused unless the
request says ``"replace": true``.
"""

from __future__ import annotations

from twisted.web.resource import Resource

from localai_tw.frontend.gallery.installs import GalleryBusy, GalleryExists, GalleryJobs

from localai_tw.frontend.gallery.index import GalleryError, is_file_name
from localai_tw.frontend.gallery.overrides import RefusedOverride, check_request_overrides
from localai_tw.frontend.api.kit import (
    AdminResource,
    APIKeyGuard,
    read_json_object,
    reject_unknown_fields,
    Route,
)
from localai_tw.web.errors import APIError, bad_request, not_found

#: The first segments under /models that are the gallery's.
GALLERY_SEGMENTS = frozenset({b"available", b"galleries", b"apply", b"jobs", b"delete"})


class GalleryResource(AdminResource):
    def __init__(self, gallery: GalleryJobs, guard: APIKeyGuard):
        super().__init__(guard)
        self._gallery = gallery

    def routes(self):
        return (Route("GET", ("available",), self.available),
                Route("GET", ("galleries",), self.galleries),
                Route("POST", ("apply",), self.apply),
                Route("GET", ("jobs",), self.jobs),
                Route("GET", ("jobs", "{job_id}"), self.job),
                Route("POST", ("delete", "{name}"), self.delete))

    async def available(self, request):
        try:
            entries = await self._gallery.available()
        except GalleryError as e:
            raise APIError(502, f"a gallery index cannot be read: {e}", "gallery_unavailable")
        return 200, [e.metadata(self._gallery.installed(e.name)) for e in entries]

    async def galleries(self, request):
        return 200, [{"name": g.name, "url": g.url} for g in self._gallery.galleries]

    async def apply(self, request):
        body = read_json_object(request)
        for refused in ("url", "files", "config_url", "config_file"):
            if refused in body:
                raise bad_request(f"{refused!r} is not accepted: install an entry of a "
                                  "configured gallery by its id (--galleries)", field=refused)
        reject_unknown_fields(body, ("id", "name", "overrides", "variant", "replace"))
        wanted = body.get("id")
        if not isinstance(wanted, str) or not wanted or len(wanted) > 512:
            raise bad_request("'id' must name a gallery entry (gallery@name or name; GET "
                              "/models/available lists them)", field="id")
        name = body.get("name")
        if name is not None and not is_file_name(name):
            raise bad_request("'name' must be a model name usable as a file name (no '/', "
                              "'\\\\', leading '.', at most 200 characters)", field="name")
        if body.get("variant"):
            raise bad_request("'variant' is not supported: the entry itself is installed "
                              "(LocalAI's variants are not resolved here)", field="variant")
        replace = body.get("replace", False)
        if not isinstance(replace, bool):
            raise bad_request("'replace' must be true or false", field="replace")
        try:
            overrides = check_request_overrides(body.get("overrides") or {})
        except RefusedOverride as e:
            raise bad_request(str(e), field=e.field)
        try:
            job_id = await self._gallery.apply(wanted, name, overrides, replace=replace)
        except GalleryExists as e:
            raise APIError(409, str(e), "model_exists")
        except GalleryBusy as e:
            raise APIError(503, str(e), "gallery_busy", headers={"Retry-After": "30"})
        except GalleryError as e:
            if str(e).startswith("no gallery entry") and "no gallery is" in str(e):
                raise APIError(409, str(e), "no_gallery")
            if str(e).startswith("no gallery entry"):
                raise not_found(str(e))
            raise APIError(502, f"a gallery index cannot be read: {e}", "gallery_unavailable")
        return 200, _accepted(request, job_id)

    async def delete(self, request, name: str):
        if not is_file_name(name):
            raise bad_request("the model name must be usable as a file name")
        try:
            return 200, _accepted(request, await self._gallery.delete(name))
        except GalleryBusy as e:
            raise APIError(503, str(e), "gallery_busy", headers={"Retry-After": "30"})

    async def jobs(self, request):
        return 200, {job_id: dict(s, source="broadcast")
                     for job_id, s in self._gallery.snapshots.items()
                     if "backend" not in s}  # (a backend's jobs: /backends/jobs)

    async def job(self, request, job_id: str):
        status = await self._gallery.status(job_id)
        if status is None or "backend" in status:
            raise not_found(f"no gallery job {job_id[:64]!r} is known to this replica (a job "
                            "appears on every replica when it is admitted; one admitted while "
                            "this replica was not listening appears when it starts)")
        return 200, status


def _accepted(request, job_id: str) -> dict:
    """LocalAI's ``GalleryResponse``: ``uuid`` and the ``status`` URL."""
    host = (request.getHeader(b"host") or b"").decode("latin-1")[:256]
    scheme = "https" if request.isSecure() else "http"
    base = f"{scheme}://{host}/" if host else "/"
    return {"uuid": job_id, "status": f"{base}models/jobs/{job_id}"}


class ModelsRoot(Resource):
    """``/models``: the gallery's segments go to :class:`GalleryResource`; the rest
    (``/models``, ``/models/capabilities``) to the OpenAI API's unprefixed aliases."""

    isLeaf = True

    def __init__(self, gallery: Resource | None, unprefixed: Resource):
        super().__init__()
        self._gallery = gallery
        self._unprefixed = unprefixed

    def render(self, request):
        if self._gallery is not None and request.postpath \
                and request.postpath[0] in GALLERY_SEGMENTS:
            return self._gallery.render(request)
        return self._unprefixed.render(request)
