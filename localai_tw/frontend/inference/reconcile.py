"""A worker whose tunnel comes back: its backend processes and the cluster's rows made to agree.

A worker that was away (frozen, partitioned, its tunnel broken) without registering again
keeps its backend processes, their ports and their memory.  Meanwhile the cluster may have
given up on it: ``offline`` deleted its ``node_models`` rows, an operator unloaded a model, a
row was reaped.  Nobody could tell the worker, and nothing told the cluster what the worker
still ran: the node looked empty and was scheduled onto while its old processes lived on.

So every time a tunnel attaches at this replica (:meth:`BackendReconciler.node_returned`,
wired to the ``TunnelRegistry``), and when the health monitor promotes an offline node whose
tunnel never left (its ``on_back``), this replica asks the worker what it runs
(``backend.list``: model, process key, address, state, pid) and applies **one rule**, per
process and per row:

==================================================  ========================================
what the worker reports / what the database holds   what happens
==================================================  ========================================
a process whose model has a cold load in progress   nothing (the load owns it and its row)
(a ``model_load_jobs`` row)
a process a row of this node names (same model,     **adopted**: kept, the row kept; calls go
same address, any state)                            on as before
any other process                                   **stopped** (``backend.stop``, graceful:
                                                    the worker's own stop, its port freed)
a ``loaded`` row no live process of the worker      **deleted** (the worker's answer: nothing
serves (same model and address)                     serves it), and the placement caches told
==================================================  ========================================

The rule is documented for operators in ``docs/cluster-state.md`` (a returning worker) and
``docs/operators.md`` (the failure table).  A process is never adopted by writing a row: a row
is written by a cold load, which knows the model's config, its staged files and its identity;
a process nobody placed is not trusted to match them, and the next request loads the model
again the ordinary way.  After the pass, the cluster's view of the node is what the worker
runs.

A pass that cannot read the worker's list (the tunnel left again, an old worker, the database
down) changes nothing and is logged; the next attach tries again.  One pass per node at a time
(an attach while one runs is skipped: the running one reads a list as fresh).

What this module must never do: stop a process of a load in progress, or one a row names;
delete a row other than a ``loaded`` one the worker's list contradicts; write a row; block the
attach (it runs beside it, never awaited by the tunnel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from twisted.internet import defer
from twisted.logger import Logger

from localai_tw import errors
from localai_tw.logsafe import untrusted

log = Logger()

#: Seconds ``backend.list`` and each ``backend.stop`` may take.
LIST_TIMEOUT = 30.0
STOP_TIMEOUT = 60.0
#: Processes read from one list at most (a worker runs a few; a bigger answer is refused).
MAX_PROCESSES = 1024


@dataclass
class ReconcileReport:
    """What one pass found and did (process keys and row models), for logs and tests."""

    node_id: str
    adopted: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    left_to_loads: list[str] = field(default_factory=list)
    rows_deleted: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    error: str | None = None


class ReconcileRefused(Exception):
    """The worker's list could not be used (malformed, too long)."""


def _processes(reply) -> list[dict]:
    backends = (reply or {}).get("backends") if isinstance(reply, dict) else None
    if not isinstance(backends, list):
        raise ReconcileRefused("backend.list answered no list of backends")
    if len(backends) > MAX_PROCESSES:
        raise ReconcileRefused(f"backend.list answered {len(backends)} backends "
                               f"(at most {MAX_PROCESSES} are read)")
    found = []
    for entry in backends:
        if not isinstance(entry, dict):
            continue
        model, key, address = entry.get("model"), entry.get("process_key"), entry.get("address")
        if isinstance(model, str) and model and isinstance(key, str) and key:
            found.append({"model": model, "process_key": key,
                          "address": address if isinstance(address, str) else ""})
    return found


class BackendReconciler:
    """Runs the rule of the module docstring when a worker's tunnel attaches here.

    :param db: the replica's ``Database``.
    :param control: the ``ControlClient`` (``backend.list``, ``backend.stop``).
    :param clients: the ``BackendClients``: a stopped or deleted placement's channel closes.
    :param on_changed: ``on_changed(model_name)`` after a row was deleted (placement caches).
    """

    def __init__(self, db, control, clients=None,
                 on_changed: Callable[[str], object] | None = None):
        self._db = db
        self._control = control
        self._clients = clients
        self._on_changed = on_changed
        self._running: set[str] = set()
        #: the report of the last pass per node (bounded by the nodes that attached here)
        self.last: dict[str, ReconcileReport] = {}

    def node_returned(self, node_id: str) -> defer.Deferred:
        """``node_id`` is back (its tunnel attached here, or the health monitor found it back
        after offline): one pass, unless one runs.  Never fails."""
        if node_id in self._running:
            return defer.succeed(None)
        self._running.add(node_id)

        def done(result):
            self._running.discard(node_id)
            return result

        return defer.ensureDeferred(self.reconcile(node_id)).addBoth(done)

    async def reconcile(self, node_id: str) -> ReconcileReport:
        report = ReconcileReport(node_id)
        try:
            await self._pass(node_id, report)
        except errors.VerbNotServed:
            report.error = "the worker runs no backends (backend.list is not served)"
            self.last[node_id] = report
            return report  # an agent worker: nothing to reconcile
        except Exception as e:
            report.error = f"{type(e).__name__}: {e}"
            log.warn("reconciling node {node} on its return: nothing changed "
                     "({err})", node=node_id, err=report.error)
        self.last[node_id] = report
        if report.stopped or report.rows_deleted or report.failed:
            log.info("node {node} reconciled on its return: adopted {adopted}, "
                     "stopped {stopped}, rows deleted {rows}{failed}", node=node_id,
                     adopted=", ".join(report.adopted) or "none",
                     stopped=", ".join(report.stopped) or "none",
                     rows=", ".join(report.rows_deleted) or "none",
                     failed=f", stop failed for {', '.join(report.failed)}"
                     if report.failed else "")
        return report

    async def _pass(self, node_id: str, report: ReconcileReport) -> None:
        processes = _processes(await self._control.call(node_id, "backend.list", {},
                                                        timeout=LIST_TIMEOUT))
        rows = await self._db.runQuery(
            "SELECT model_name, address, state FROM node_models WHERE node_id = %s", (node_id,))
        loading = {r[0] for r in await self._db.runQuery(
            "SELECT model_name FROM model_load_jobs")}
        named = {(model, address) for model, address, _state in rows}
        serving = {(p["model"], p["address"]) for p in processes}

        for process in processes:
            model, key = process["model"], process["process_key"]
            if model in loading:
                report.left_to_loads.append(key)
            elif (model, process["address"]) in named:
                report.adopted.append(key)
            else:
                await self._stop(node_id, process, report)

        for model, address, state in rows:
            if state != "loaded" or model in loading or (model, address) in serving:
                continue
            deleted = await self._db.runQuery(
                "DELETE FROM node_models WHERE node_id = %s AND model_name = %s"
                " AND address = %s AND state = 'loaded' RETURNING id",
                (node_id, model, address))
            if deleted:
                report.rows_deleted.append(model)
                log.info("node {node}: row of model {model} ({address}) deleted: the worker "
                         "runs no backend for it", node=node_id, model=model, address=address)
                await self._forget(node_id, address)
                if self._on_changed is not None:
                    self._on_changed(model)

    async def _stop(self, node_id: str, process: dict, report: ReconcileReport) -> None:
        key = process["process_key"]
        try:
            reply = await self._control.call(
                node_id, "backend.stop", {"process_key": key, "absent_ok": True},
                timeout=STOP_TIMEOUT)
        except Exception as e:
            report.failed.append(key)
            log.warn("node {node}: stopping backend {key} that no placement names failed "
                     "({err})", node=node_id, key=untrusted(key), err=e)
            return
        if isinstance(reply, dict) and reply.get("success"):
            report.stopped.append(key)
            log.info("node {node}: stopped backend {key} (model {model}, {address}): no "
                     "placement names it", node=node_id, key=untrusted(key),
                     model=untrusted(process["model"]), address=untrusted(process["address"]))
            await self._forget(node_id, process["address"])
        else:
            report.failed.append(key)
            error = reply.get("error") if isinstance(reply, dict) else reply
            log.warn("node {node}: the worker refused to stop backend {key}: {err}",
                     node=node_id, key=untrusted(key), err=untrusted(str(error)))

    async def _forget(self, node_id: str, address: str) -> None:
        if self._clients is None:
            return
        try:
            port = int(address.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return
        client = self._clients.open_clients().get((node_id, port))
        if client is None or client.in_flight:
            return  # a call in flight ends on its own; the sweep closes the rest
        await self._clients.drop(node_id, port)
