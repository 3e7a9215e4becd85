"""Worker control verbs over a :class:`~localai_tw.backends.process.BackendSupervisor`:
``backend.start``, ``backend.stop``, ``backend.list``, ``backend.logs``, ``backend.token`` and
``backend.exit``
(``POST /v1/control/backend/<verb>``).

Replies (all 200: the worker's answer, evidence for the frontend):

- ``backend.start`` ``{backend, model, options?, replica?, load?}`` ->
  ``{success, address, process_key, token, error}``; ``address`` is ``127.0.0.1:<port>`` (the
  frontend uses the port for its ``grpc`` tunnel streams), ``token`` the backend process's own
  gRPC bearer token (minted by the supervisor for this process; the frontend sends it in the
  gRPC calls it makes through the tunnel); ``load`` (ModelOptions fields by their proto
  names, e.g. ``{"Model": "m", "ModelFile": "/models/m"}``) makes the worker call LoadModel
  before answering;
- ``backend.stop`` ``{model | process_key, force?, if_idle?, absent_ok?}`` -> ``{success, error,
  process_key, state, exit_code, exit_signal}``; with ``if_idle`` the backend is first asked
  its own ``Status``: ``BUSY`` (a request in flight, from any replica), or no answer within
  :data:`STATUS_TIMEOUT` (a backend that cannot answer is not known to be idle), is answered
  ``{success: false, busy: true, error: ""}`` and nothing is stopped; a backend that does not
  implement ``Status`` counts as idle (it cannot tell).  With ``absent_ok`` a model with no
  process is answered ``{success: true, state: "absent"}`` (it is not running: the unload the
  frontend asked for holds), not as an error;
- ``backend.list`` ``{include_ended?}`` -> ``{backends: [{model, backend, process_key, address,
  state, pid, started_at, health_misses, ...}]}``;
- ``backend.logs`` ``{model | process_key, tail?}`` -> ``{lines, process_key, state}``, or
  ``{lines: [], error}`` for a name with no process;
- ``backend.token`` ``{port}`` -> ``{token, error}``: the gRPC token of the live backend on
  that port (a replica that did not start it asks before its first call), or ``token: ""``
  with the reason.  Only over the control channel, whose per-node token protects it;
- ``backend.exit`` ``{port}`` -> how the backend on that port ended, asked by a frontend whose
  call to it failed: ``{crashed, state, model, backend, process_key, pid, exit_code,
  exit_signal, signal, description, output, fallback, node_name}`` (``output``: its last
  lines, bounded; ``fallback``: what its next start changes, or ""), or ``{crashed: false,
  state: "absent"}`` when no process had that port.  A process not reaped yet is given
  :data:`EXIT_WAIT` seconds when it is exiting (a zombie), :data:`ALIVE_WAIT` when it looks
  alive (its sockets close a moment before it becomes a zombie), then answered
  ``{crashed: false, state: "ready"}`` if it still runs.

A malformed request is a 400 (never evidence): checked by the verb schema before the handler
runs.  ``backend.start`` and ``backend.stop`` are not cancelled when the caller goes away: a
start in progress finishes (the next start finds the backend ready) and a stop always
completes.

It lives in ``worker/`` because it composes the backend layer with the worker's control plane;
``localai_tw.backends`` itself knows nothing of the worker.  It must never answer a failure to
start or stop as anything but ``success: false`` with the reason.
"""

from __future__ import annotations

from typing import Any

import grpc
from twisted.internet import defer

from localai_tw.backends import backend_pb2
from localai_tw.backends.process import BackendSupervisor
from localai_tw.backends.record import BackendStartError, BackendStopError, NoSuchBackend
from localai_tw.worker.control import BadVerbRequest, VerbRequestSchema

#: Largest ``tail`` a logs request may ask for (the ring holds at most this many lines anyway).
MAX_LOG_TAIL = 5000
#: Seconds ``backend.stop`` with ``if_idle`` waits for the backend's ``Status``.
STATUS_TIMEOUT = 5.0
#: Seconds ``backend.exit`` waits for a process that is exiting (a zombie, or gone from
#: ``/proc``) to be reaped, and for one that still looks alive (its sockets close a moment before
#: the kernel makes it a zombie; a backend that answered an error and lives on costs this much).
EXIT_WAIT = 2.0
ALIVE_WAIT = 0.25


def _exiting(pid: int | None) -> bool:
    """Whether ``pid`` is a zombie or gone (``/proc/<pid>/stat``'s state, after the command
    name in parentheses); False when unknown (no pid, no ``/proc``)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    state = stat.rpartition(b")")[2].split()[:1]
    return state in ([b"Z"], [b"X"], [b"x"])


async def _busy(supervisor: BackendSupervisor, name: str) -> bool:
    """True when the live backend ``name`` is running a request (its ``Status`` says BUSY) or
    does not answer ``Status`` in time; False when it is idle, not ready yet, or cannot tell
    (``UNIMPLEMENTED``)."""
    try:
        client = supervisor.client(name)
    except NoSuchBackend:
        return False  # not running (or no address yet): nothing in flight on it
    try:
        reply = await client.call("Status", backend_pb2.HealthMessage(), STATUS_TIMEOUT)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        return code != grpc.StatusCode.UNIMPLEMENTED
    except Exception:
        return True
    return reply.state == backend_pb2.StatusResponse.BUSY


def _name_of(body: dict, bad_request) -> str:
    name = body.get("process_key") or body.get("model")
    if not name:
        raise bad_request("give model or process_key")
    return name


def backend_verb_handlers(supervisor: BackendSupervisor, bad_request=ValueError,
                          node_name: str = ""):
    """The handlers as plain functions ``handler(body) -> Deferred/dict``."""

    async def start(body: dict) -> dict:
        replica = body.get("replica", 0)
        if replica < 0:
            raise bad_request("replica must be >= 0")
        try:
            record = await supervisor.start(body["backend"], body["model"],
                                            body.get("options") or {}, replica=replica,
                                            load=body.get("load"))
        except BackendStartError as e:
            key = e.record.key if e.record is not None else f"{body['model']}#{replica}"
            return {"success": False, "address": "", "process_key": key, "error": str(e)}
        return {"success": True, "address": record.address, "process_key": record.key,
                "token": record.grpc_token or "", "error": "",
                "note": record.note or ""}

    async def stop(body: dict) -> dict:
        name = _name_of(body, bad_request)
        if body.get("if_idle") and await _busy(supervisor, name):
            return {"success": False, "busy": True, "error": "", "process_key": name}
        try:
            record = await supervisor.stop(name, force=bool(body.get("force", False)))
        except NoSuchBackend as e:
            if body.get("absent_ok"):
                return {"success": True, "error": "", "process_key": name, "state": "absent"}
            return {"success": False, "error": str(e), "process_key": name}
        except BackendStopError as e:
            return {"success": False, "error": str(e), "process_key": name}
        return {"success": True, "error": "", "process_key": record.key,
                "state": record.state, "exit_code": record.exit_code,
                "exit_signal": record.exit_signal}

    def list_(body: dict) -> dict:
        return {"backends": supervisor.list(include_ended=bool(body.get("include_ended")))}

    def logs(body: dict) -> dict:
        name = _name_of(body, bad_request)
        tail = body.get("tail")
        if tail is not None and not (0 <= tail <= MAX_LOG_TAIL):
            raise bad_request(f"tail must be between 0 and {MAX_LOG_TAIL}")
        try:
            record = supervisor.find(name)
        except NoSuchBackend as e:
            return {"lines": [], "error": str(e)}
        return {"lines": record.output.lines(tail), "process_key": record.key,
                "state": record.state, "dropped_lines": record.output.dropped_lines}

    def token(body: dict) -> dict:
        port = body["port"]
        if not 0 < port < 65536:
            raise bad_request("port must be a TCP port number")
        found = supervisor.token_for_port(port)
        if found is None:
            return {"token": "", "error": f"no backend is running on port {port}"}
        return {"token": found, "error": ""}

    async def exit_(body: dict) -> dict:
        port = body["port"]
        if not 0 < port < 65536:
            raise bad_request("port must be between 1 and 65535")
        record = supervisor.find_by_port(port)
        if record is None:
            return {"crashed": False, "state": "absent", "node_name": node_name}
        if not record.ended:
            ended = record.when_ended()
            ended.addTimeout(EXIT_WAIT if _exiting(record.pid) else ALIVE_WAIT,
                             supervisor._reactor)
            try:
                await ended
            except defer.TimeoutError:
                pass
        return {**record.crash_report(), "node_name": node_name}

    return {"backend.start": start, "backend.stop": stop, "backend.list": list_,
            "backend.logs": logs, "backend.token": token, "backend.exit": exit_}


def register_backend_verbs(verbs: Any, supervisor: BackendSupervisor,
                           node_name: str = "") -> list:
    """Register ``backend.start/stop/list/logs/token/exit`` on a worker's
    :class:`~localai_tw.worker.control.ControlVerbs`.  Returns the registered verbs."""
    handlers = backend_verb_handlers(supervisor, BadVerbRequest, node_name)
    name_fields = {"model": str, "process_key": str}
    schemas = {
        "backend.start": VerbRequestSchema(
            {"backend": str, "model": str, "options": dict, "replica": int, "load": dict},
            frozenset({"backend", "model"})),
        "backend.stop": VerbRequestSchema({**name_fields, "force": bool, "if_idle": bool,
                                           "absent_ok": bool}),
        "backend.list": VerbRequestSchema({"include_ended": bool}),
        "backend.logs": VerbRequestSchema({**name_fields, "tail": int}),
        "backend.token": VerbRequestSchema({"port": int}, frozenset({"port"})),
        "backend.exit": VerbRequestSchema({"port": int}, frozenset({"port"})),
    }
    keep_going = {"backend.start", "backend.stop"}
    return [
        verbs.register(name, handler, schema=schemas[name],
                       cancel_on_disconnect=name not in keep_going)
        for name, handler in handlers.items()
    ]
