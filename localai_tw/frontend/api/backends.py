"""LocalAI's backend gallery routes (``/backends``) and the per-node backend routes under
``/api/nodes/{id}/backends`` (``docs/backends.md``, "The backend gallery"):

- ``GET /backends``: the backends each connected backend worker has installed;
- ``GET /backends/available``: the entries of the operator's ``--backend-galleries``, with
  ``installed`` (every connected backend worker has it) and ``installed_on``;
- ``GET /backends/galleries``; ``POST /backends/apply {"id", "force"?}``;
  ``GET /backends/jobs[/{id}]``; ``POST /backends/delete/{name}`` (LocalAI's shapes: ``{id,
  status_url}``);
- ``POST /api/nodes/{id}/backends/install {"backend", "force"?}`` (a job on that node: 202
  ``{jobID, statusUrl, message}``) and ``POST /api/nodes/{id}/backends/delete {"backend"}``
  (at once, the worker's answer).

Admin routes (the admin API key).  An install names an entry of a configured gallery: a
``uri``, ``name``, ``alias`` or ``backend_galleries`` in a request is refused, so an API
caller never makes a replica or a worker fetch or read what it chose.

What this module must never do: fetch, pack or unpack anything itself (the gallery's jobs and
the workers do), or answer a worker's failure as anything but the worker's words.
"""

from __future__ import annotations

from twisted.internet import defer

from localai_tw import errors
from localai_tw.frontend.api.kit import (
    AdminResource,
    APIKeyGuard,
    Route,
    read_json_object,
    reject_unknown_fields,
)
from localai_tw.frontend.gallery.backend_index import is_backend_name
from localai_tw.frontend.gallery.index import GalleryError
from localai_tw.frontend.gallery.installs import GalleryBusy, GalleryJobs
from localai_tw.web.errors import APIError, bad_request, not_found

#: Request fields LocalAI accepts that would let a caller choose what is fetched.
REFUSED_FIELDS = ("uri", "name", "alias", "backend_galleries")
LIST_TIMEOUT = 10.0


def refuse_sources(body: dict) -> None:
    for refused in REFUSED_FIELDS:
        if refused in body:
            raise bad_request(f"{refused!r} is not accepted: install an entry of a configured "
                              "backend gallery by its id (--backend-galleries)", field=refused)


def force_field(body: dict) -> bool:
    force = body.get("force", False)
    if not isinstance(force, bool):
        raise bad_request("'force' must be true or false", field="force")
    return force


def gallery_error(e: GalleryError) -> APIError:
    text = str(e)
    if "no backend gallery is configured" in text:
        return APIError(409, text, "no_gallery")
    if text.startswith("no backend gallery entry"):
        return not_found(text)
    return APIError(502, f"a backend gallery index cannot be read: {text}",
                    "gallery_unavailable")


def is_backend_job(snapshot: dict) -> bool:
    return "backend" in snapshot


class BackendGalleryResource(AdminResource):
    def __init__(self, gallery: GalleryJobs, guard: APIKeyGuard):
        super().__init__(guard)
        self._gallery = gallery
        self._backends = gallery.backends

    def routes(self):
        return (Route("GET", (), self.installed),
                Route("GET", ("available",), self.available),
                Route("GET", ("galleries",), self.galleries),
                Route("POST", ("apply",), self.apply),
                Route("GET", ("jobs",), self.jobs),
                Route("GET", ("jobs", "{job_id}"), self.job),
                Route("POST", ("delete", "{name}"), self.delete))

    async def _per_node(self) -> dict[str, list | dict]:
        nodes, _ = await self._backends.targets(None)

        async def one(node):
            try:
                return node.name, await self._backends.installed_on(node)
            except errors.ClusterError as e:
                return node.name, {"error": str(e)}

        answers = await defer.gatherResults(
            [defer.ensureDeferred(one(n)) for n in nodes], consumeErrors=True)
        return dict(answers)

    async def installed(self, request):
        return 200, await self._per_node()

    async def available(self, request):
        try:
            entries = await self._backends.available()
        except GalleryError as e:
            raise gallery_error(e)
        per_node = await self._per_node()
        answer = []
        for entry in entries:
            on = sorted(node for node, listed in per_node.items() if isinstance(listed, list)
                        and any(b.get("name") == entry.name for b in listed))
            item = entry.metadata(bool(per_node) and len(on) == len(per_node))
            item["installed_on"] = on
            answer.append(item)
        return 200, answer

    async def galleries(self, request):
        return 200, [{"name": g.name, "url": g.url} for g in self._backends.galleries]

    async def apply(self, request):
        body = read_json_object(request)
        refuse_sources(body)
        reject_unknown_fields(body, ("id", "force"))
        wanted = _entry_name(body, "id", "gallery@name or name; GET /backends/available "
                                         "lists them")
        force = force_field(body)
        try:
            job_id = await self._gallery.apply_backend(wanted, force=force)
        except GalleryBusy as e:
            raise APIError(503, str(e), "gallery_busy", headers={"Retry-After": "30"})
        except GalleryError as e:
            raise gallery_error(e)
        return 200, _accepted(request, job_id)

    async def delete(self, request, name: str):
        if not is_backend_name(name):
            raise bad_request("the backend name must be letters, digits, '.', '_' or '-'")
        try:
            return 200, _accepted(request, await self._gallery.delete_backend(name))
        except GalleryBusy as e:
            raise APIError(503, str(e), "gallery_busy", headers={"Retry-After": "30"})

    async def jobs(self, request):
        return 200, {job_id: dict(s, source="broadcast")
                     for job_id, s in self._gallery.snapshots.items() if is_backend_job(s)}

    async def job(self, request, job_id: str):
        status = await self._gallery.status(job_id)
        if status is None or not is_backend_job(status):
            raise not_found(f"no backend job {job_id[:64]!r} is known to this replica (a job "
                            "appears on every replica when it is admitted)")
        return 200, status


def _accepted(request, job_id: str) -> dict:
    """LocalAI's ``BackendResponse``: ``id`` and ``status_url``."""
    host = (request.getHeader(b"host") or b"").decode("latin-1")[:256]
    scheme = "https" if request.isSecure() else "http"
    base = f"{scheme}://{host}/" if host else "/"
    return {"id": job_id, "status_url": f"{base}backends/jobs/{job_id}"}


class NodeBackends:
    """The per-node routes' work (``NodesAdminResource`` routes them; it resolves the node)."""

    def __init__(self, gallery: GalleryJobs | None):
        self._gallery = gallery

    def _installs(self):
        if self._gallery is None or self._gallery.backends is None:
            raise APIError(503, "backend installs are not available on this replica",
                           "service_unavailable")
        return self._gallery.backends

    async def installed(self, node) -> list | dict:
        try:
            return await self._installs().installed_on(node)
        except errors.VerbNotServed:
            return {"error": "this worker's version lists no installed backends"}
        except errors.ClusterError as e:
            return {"error": str(e)}

    async def install(self, request, node) -> tuple[int, dict]:
        body = read_json_object(request)
        refuse_sources(body)
        reject_unknown_fields(body, ("backend", "force"))
        wanted = _entry_name(body, "backend", "GET /backends/available lists them")
        force = force_field(body)
        self._installs()
        try:
            job_id = await self._gallery.apply_backend(wanted, node.id, node.name, force=force)
        except GalleryBusy as e:
            raise APIError(503, str(e), "gallery_busy", headers={"Retry-After": "30"})
        except GalleryError as e:
            raise gallery_error(e)
        return 202, {"jobID": job_id, "statusUrl": f"/backends/jobs/{job_id}",
                     "message": "backend installation started"}

    async def delete(self, request, node) -> tuple[int, dict]:
        body = read_json_object(request)
        reject_unknown_fields(body, ("backend",))
        name = body.get("backend")
        if not is_backend_name(name):
            raise bad_request("'backend' must be a backend name (letters, digits, '.', '_', "
                              "'-')", field="backend")
        try:
            result = await self._installs().delete(name, node.id)
        except GalleryError as e:
            text = str(e)
            if "is not installed" in text:
                raise APIError(404, text, "not_found")
            raise APIError(409, text, "backend_not_deleted")
        return 200, {"id": node.id, "message": "backend deleted", **result}


def _entry_name(body: dict, field: str, hint: str) -> str:
    """The backend gallery entry a request's ``field`` names (a bounded, non-empty string)."""
    wanted = body.get(field)
    if not isinstance(wanted, str) or not wanted or len(wanted) > 512:
        raise bad_request(f"'{field}' must name a backend gallery entry ({hint})", field=field)
    return wanted
