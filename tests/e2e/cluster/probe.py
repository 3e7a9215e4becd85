"""Test-only instrumentation of a real ``twistd localai-frontend``: a probe route.

The admin API has no route that reaches a worker (there is no ``GET /api/nodes/{id}/backends``
yet, ref §7), so nothing from outside a replica can make it call a control verb or stage a file
on a worker.  The cluster harness therefore starts each frontend as

    python -c "<load this file as a module>; p.install(); \\
               from twisted.scripts.twistd import run; run()" -n --pidfile= localai-frontend ...

i.e. the real ``twistd`` runner, the real plugin, options and service tree, plus ONE extra
resource mounted at ``/e2e-probe`` (behind the replica's own ``--api-key`` guard).  The probe calls
only public library objects of *this* replica (``Replica.worker_http``, which rides its
``WorkerDialer``), so a probe request exercises exactly the path a real caller in the replica
would: the local tunnel when the replica holds it, otherwise the relay through the owner's peer
link.  Nothing in the library is patched except ``FrontendService._build_root``, wrapped to add
the child.

Routes (all answer 200 with JSON; a failure is data, not an HTTP error, so the test sees the
exact condition the library raised):

``POST /e2e-probe/control/{node}/{verb}``  body = the verb's JSON request
    -> ``{"replica", "held_here_before", "held_here_after", "reply"}`` or ``{..., "error":
    {"type", "condition", "message"}}``
``POST /e2e-probe/upload/{node}``  body ``{"key", "path"}`` (a file on this machine)
    -> ``{"replica", "held_here_before", "held_here_after", "staged": {"key", "size", "sha256",
    "skipped", "local_path"}}`` or ``{..., "error": {...}}``
"""

from __future__ import annotations

PROBE_PATH = b"e2e-probe"
TIMEOUT = 60.0


def _error(e: BaseException) -> dict:
    return {"type": type(e).__name__,
            "condition": getattr(e, "condition", "none"),
            "message": str(e)}


def _resource(frontend, replica):
    from localai_tw.frontend.api.kit import JSONResource, read_json_object, Route
    from localai_tw.tunnel.endpoint import upload_file

    class ProbeResource(JSONResource):
        def guard(self, request) -> None:
            frontend.api_keys.check(request)

        def routes(self):
            return (Route("POST", ("control", "{node}", "{verb}"), self.control),
                    Route("POST", ("upload", "{node}"), self.upload))

        def _base(self, node: str) -> dict:
            return {"replica": frontend.instance_id,
                    "held_here_before": replica.tunnels.holds(node)}

        async def control(self, request, node: str, verb: str):
            body = read_json_object(request)
            answer = self._base(node)
            if "error" in answer:
                return 200, answer
            try:
                # the replica's own control client: each node's control token, as in production
                answer["reply"] = await replica.control.call(node, verb, body, timeout=TIMEOUT)
            except Exception as e:  # every outcome is data for the test
                answer["error"] = _error(e)
            answer["held_here_after"] = replica.tunnels.holds(node)
            return 200, answer

        async def upload(self, request, node: str):
            body = read_json_object(request)
            answer = self._base(node)
            if "error" in answer:
                return 200, answer
            try:
                token = await replica.nodes.control_token(node)
                staged = await upload_file(replica.worker_http, node, body["key"], body["path"],
                                           token=token, timeout=TIMEOUT)
                answer["staged"] = {"key": staged.key, "size": staged.size,
                                    "sha256": staged.sha256, "skipped": staged.skipped,
                                    "local_path": staged.local_path}
            except Exception as e:
                answer["error"] = _error(e)
            answer["held_here_after"] = replica.tunnels.holds(node)
            return 200, answer

    return ProbeResource()


def install() -> None:
    """Wrap ``FrontendService._build_root`` so every replica built in this process mounts the
    probe.  Call before ``twistd`` runs."""
    from localai_tw.frontend.service import FrontendService

    original = FrontendService._build_root
    if getattr(original, "_e2e_probe", False):
        return

    def build_root(self, replica):
        root = original(self, replica)
        root.putChild(PROBE_PATH, _resource(self, replica))
        return root

    build_root._e2e_probe = True
    FrontendService._build_root = build_root
