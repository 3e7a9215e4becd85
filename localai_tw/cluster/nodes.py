"""The worker registry: ``backend_nodes`` rows, their credentials, labels and status.

A worker registers by unique name and proves with its node key (``nodekey.py``) that it
is the node the name belongs to.  The same name with the same key keeps its id and its approval,
and is assumed to have restarted: its ``node_models`` rows are deleted.  The same name with a
different key, or none, is refused (:class:`NodeNameTaken`) and changes nothing: the shared
registration token admits a worker to the cluster, it never lets one node take over another's
name, credential, approval or traffic.  A name whose row has no key (registered before node keys
existed) is claimed by the first registration that presents one.  Every registration mints a
fresh per-node tunnel credential, stores only its sha256 hex and hands the plaintext back once;
the previous credential stops verifying at that moment.

Registration-token policy (``require_auth``):

- a configured token: the presented token must match it (constant time);
- an empty token with ``require_auth=False`` (the default, as in the reference): registration is
  open to anyone who can reach the endpoint, and a warning is logged at construction.  Open
  registration lets anyone add nodes (taking over an existing name still needs its node key);
  use it only where the network is trusted (single host, private lab);
- an empty token with ``require_auth=True``: construction refuses (a configuration error), so
  the frontend fails at startup instead of running open by accident.

This module must never store or log a plaintext credential, never format a value into SQL
(parameters are always bound), never compare times in Python (heartbeats are written with the
database's ``now()``), and never delete ``node_models`` rows except on the explicit lifecycle
events it names (re-registration, ``mark_offline``, node deletion).  It says nothing about
reachability: that is ``ownership``'s presence, and status changes made on it belong to the
health monitor.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import re
import secrets
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Mapping

from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from .membership import hash_secret, secret_matches_hash
from .rowlocks import locked_first
from localai_tw.nodekey import control_token, node_key_hash, valid_node_key

log = Logger()


class NodeType(str, enum.Enum):
    BACKEND = "backend"  # runs models
    AGENT = "agent"      # runs queued jobs


class NodeStatus(str, enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"      # status-only demotion; reversible
    OFFLINE = "offline"          # stale heartbeat or deregistered; node_models cleared
    DRAINING = "draining"        # takes no new work
    PENDING = "pending"          # awaiting approval
    REGISTERING = "registering"  # column default, never written by this module


class NodeRegistryError(Exception):
    """Base of this module's errors."""


class InvalidNodeInput(NodeRegistryError, ValueError):
    """A field failed validation; ``field`` names it."""

    def __init__(self, field_name: str, problem: str):
        self.field = field_name
        super().__init__(f"{field_name}: {problem}")


class NodeNotFound(NodeRegistryError):
    def __init__(self, node_id: str):
        self.node_id = node_id
        super().__init__(f"node {node_id!r} not found")


class NotPending(NodeRegistryError):
    """Approve found the node but it is not awaiting approval."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        super().__init__(f"node {node_id!r} is not pending approval")


class Unauthorized(NodeRegistryError):
    """A presented credential did not verify.  Deliberately says nothing about which part was
    wrong (unknown node, empty hash, wrong secret)."""

    def __init__(self, what: str):
        super().__init__(f"{what} is missing or invalid")


class NodeNameTaken(NodeRegistryError):
    """A registration under an existing name did not prove it is that node (no node key, or a
    different one).  Nothing was changed."""

    def __init__(self, name: str, node_id: str):
        self.name = name
        self.node_id = node_id
        super().__init__(
            # The id stays in the frontend's log: a token holder must not learn which node id
            # is behind a name (issue 21 §5).
            f"node name {name!r} is taken by another node and this worker did not present "
            "that node's key; if this is another machine, give it another --node-name; if it "
            "is that node, give it back its data directory (its node-key file), or have an "
            f"administrator remove the node named {name!r} (GET /api/nodes shows its id, "
            "DELETE /api/nodes/<id> removes it) so it registers anew")


class RegistrationTokenRequired(NodeRegistryError):
    """``require_auth`` was asked for with an empty registration token."""


# -- validation ---------------------------------------------------------------------------------

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_MAX = 253
_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$")
LABEL_KEY_MAX = 128
LABEL_VALUE_MAX = 255
LABELS_MAX = 64
GPU_VENDOR_MAX = 64
_BIGINT_MAX = 2**63 - 1
REPLICAS_MAX = 1024


def _validate_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidNodeInput("name", "is required")
    if len(name) > NAME_MAX:
        raise InvalidNodeInput("name", f"is longer than {NAME_MAX} characters")
    if not _NAME.match(name):
        raise InvalidNodeInput("name", "may contain only letters, digits, '.', '_' and '-', "
                                       "starting with a letter or digit")
    return name


def _validate_node_id(node_id) -> str:
    if not isinstance(node_id, str) or not node_id or len(node_id) > 36:
        raise InvalidNodeInput("id", "must be a node id of 1-36 characters")
    return node_id


def _validate_node_type(node_type) -> NodeType:
    try:
        return NodeType(node_type)
    except ValueError:
        raise InvalidNodeInput("node_type", f"must be one of "
                               f"{', '.join(t.value for t in NodeType)}; got {node_type!r}") from None


def _validate_label_key(key) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidNodeInput("labels", "a label key is empty")
    if len(key) > LABEL_KEY_MAX:
        raise InvalidNodeInput(f"labels.{key[:32]}", f"key longer than {LABEL_KEY_MAX} characters")
    if not _LABEL_KEY.match(key):
        raise InvalidNodeInput(f"labels.{key}", "key may contain only letters, digits, "
                               "'.', '_', '-' and '/', starting and ending alphanumeric")
    return key


def _validate_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise InvalidNodeInput("labels", "must be a mapping of key to value")
    if len(labels) > LABELS_MAX:
        raise InvalidNodeInput("labels", f"at most {LABELS_MAX} labels")
    out = {}
    for key, value in labels.items():
        _validate_label_key(key)
        if not isinstance(value, str):
            raise InvalidNodeInput(f"labels.{key}", "value must be a string")
        if len(value) > LABEL_VALUE_MAX:
            raise InvalidNodeInput(f"labels.{key}", f"value longer than {LABEL_VALUE_MAX} characters")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise InvalidNodeInput(f"labels.{key}", "value contains control characters")
        out[key] = value
    return out


def _validate_amount(field_name: str, value, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNodeInput(field_name, "must be an integer number of bytes")
    if not 0 <= value <= _BIGINT_MAX:
        raise InvalidNodeInput(field_name, "must be between 0 and 2^63-1")
    return value


@dataclass(frozen=True)
class NodeCapacity:
    """Capacity facts a worker reports, in bytes.  On heartbeat, None means "unchanged"."""

    total_vram: int | None = None
    available_vram: int | None = None
    total_ram: int | None = None
    available_ram: int | None = None
    total_disk: int | None = None
    available_disk: int | None = None

    FIELDS = ("total_vram", "available_vram", "total_ram", "available_ram", "total_disk",
              "available_disk")

    def validated(self) -> "NodeCapacity":
        for name in self.FIELDS:
            _validate_amount(name, getattr(self, name), optional=True)
        return self

    def values(self) -> list[int | None]:
        return [getattr(self, name) for name in self.FIELDS]


@dataclass(frozen=True)
class Node:
    """A worker as the rest of the code sees it.  Carries no credential material."""

    id: str
    name: str
    node_type: NodeType
    status: NodeStatus
    approved: bool
    total_vram: int
    available_vram: int
    total_ram: int
    available_ram: int
    total_disk: int
    available_disk: int
    gpu_vendor: str
    max_replicas_per_model: int
    last_heartbeat: datetime | None
    created_at: datetime
    labels: dict[str, str] = field(default_factory=dict)
    #: When an administrator approved it; None: admitted without approval (or pending).
    approved_at: datetime | None = None


@dataclass(frozen=True)
class Registration:
    """The outcome of a registration.  ``tunnel_credential`` is the only copy of the plaintext:
    return it to the worker once and drop it."""

    node: Node
    tunnel_credential: str = field(repr=False)
    created: bool = False


#: scrypt cost of the registration-token record: about 16 MiB and tens of milliseconds, paid
#: once per registration (in a thread), and per guess by anyone holding a copy of the table.
_TOKEN_SCRYPT = {"n": 2 ** 14, "r": 8, "p": 1}


def token_record(token: str, salt: bytes | None = None) -> str:
    """``scrypt$<salt>$<hash>`` (URL-safe base64) of a presented registration token: salted per
    row, so equal tokens give different records and guesses cannot be tested for all rows at
    once.  Blocking and slow on purpose: call it in a thread."""
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.scrypt(token.encode("utf-8"), salt=salt, dklen=32, **_TOKEN_SCRYPT)
    return f"scrypt${_b64(salt)}${_b64(digest)}"


#: Threads that compute scrypt records at once.  glibc keeps the 16 MiB an scrypt used in the
#: malloc arena of the thread that ran it, for reuse, after it returned: on the reactor's own
#: pool (up to 10 threads) a registration storm left about 160 MiB resident in the replica for
#: good, which the fleet benchmark counted as memory per tunnel (docs/benchmarks.md).  Two
#: threads keep 32 MiB at most and still use both cores of a small machine.
SCRYPT_THREADS = 2


class ScryptThreads:
    """The threads :func:`token_record` runs in (at most ``size``, started at first use and
    stopped with the reactor); shared by every ``NodeRegistry`` of the process."""

    def __init__(self, size: int = SCRYPT_THREADS):
        self.size = size
        self._pool: ThreadPool | None = None

    def run(self, fn, *args):
        """``fn(*args)`` in one of the threads: a Deferred of its result."""
        from twisted.internet import reactor

        if self._pool is None:
            pool = ThreadPool(0, self.size, name="localai-scrypt")
            pool.start()
            reactor.addSystemEventTrigger("during", "shutdown", self._stop, pool)
            self._pool = pool
        return threads.deferToThreadPool(reactor, self._pool, fn, *args)

    def _stop(self, pool: ThreadPool) -> None:
        if self._pool is pool:
            self._pool = None
        pool.stop()


scrypt_threads = ScryptThreads()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def token_record_matches(token: str, record: str) -> bool:
    """Whether ``record`` (from :func:`token_record`) was made from ``token``.  Blocking."""
    try:
        scheme, salt, _ = record.split("$")
        raw_salt = base64.urlsafe_b64decode(salt + "=" * (-len(salt) % 4))
    except ValueError:
        return False
    return scheme == "scrypt" and hmac.compare_digest(token_record(token, raw_salt), record)


def mint_tunnel_credential() -> str:
    """A fresh per-node tunnel credential (192 random bits, URL-safe text)."""
    return secrets.token_urlsafe(24)


# -- SQL ---------------------------------------------------------------------------------------

_NODE_COLUMNS = ("id, name, node_type, status, approved, total_vram, available_vram, total_ram,"
                 " available_ram, total_disk, available_disk, gpu_vendor,"
                 " max_replicas_per_model, last_heartbeat, created_at, approved_at")

_INSERT_NODE_SQL = (
    "INSERT INTO backend_nodes (id, name, node_type, status, approved, token_hash,"
    " tunnel_token_hash, node_key_hash, total_vram, available_vram, total_ram, available_ram,"
    " total_disk, available_disk, gpu_vendor, max_replicas_per_model, last_heartbeat,"
    " created_at, updated_at)"
    " VALUES (%(id)s, %(name)s, %(node_type)s,"
    "  CASE WHEN %(approve)s THEN 'healthy' ELSE 'pending' END, %(approve)s, %(token_hash)s,"
    "  %(tunnel_hash)s, %(key_hash)s, %(total_vram)s, %(available_vram)s, %(total_ram)s,"
    "  %(available_ram)s, %(total_disk)s, %(available_disk)s, %(gpu_vendor)s, %(max_replicas)s,"
    "  now(), now(), now())"
    " ON CONFLICT (name) DO NOTHING RETURNING id"
)

# Locks the row: the key check and the update below are one decision, so two registrations
# under one name cannot both pass a check made before the other's write.
_LOCK_NODE_BY_NAME_SQL = "SELECT id, node_key_hash FROM backend_nodes WHERE name = %s FOR UPDATE"

_REREGISTER_SQL = (
    "UPDATE backend_nodes SET"
    "  node_type = %(node_type)s,"
    # Approval, once given, survives restarts, offline and re-registration of the same node
    # (the key check before this statement is what makes it the same node).
    "  approved = approved OR %(approve)s,"
    "  status = CASE WHEN approved OR %(approve)s THEN 'healthy' ELSE 'pending' END,"
    "  token_hash = %(token_hash)s,"
    "  tunnel_token_hash = %(tunnel_hash)s,"
    # Set once (a row from before node keys is claimed), never replaced.
    "  node_key_hash = CASE WHEN node_key_hash = '' THEN %(key_hash)s ELSE node_key_hash END,"
    "  total_vram = %(total_vram)s, available_vram = %(available_vram)s,"
    "  total_ram = %(total_ram)s, available_ram = %(available_ram)s,"
    "  total_disk = %(total_disk)s, available_disk = %(available_disk)s,"
    "  gpu_vendor = %(gpu_vendor)s,"
    "  max_replicas_per_model = %(max_replicas)s,"
    "  last_heartbeat = now(), updated_at = now()"
    " WHERE id = %(existing_id)s"
)

_DELETE_NODE_MODELS_SQL = "DELETE FROM node_models WHERE node_id = %s"

_UPSERT_LABEL_SQL = (
    "INSERT INTO node_labels (node_id, key, value) VALUES (%s, %s, %s)"
    " ON CONFLICT (node_id, key) DO UPDATE SET value = EXCLUDED.value"
)

# Capacity changes only for nodes that may take work; pending and offline nodes just beat.
_CAPACITY_UNLESS_IDLE = ", ".join(
    f"{col} = CASE WHEN status IN ('pending', 'offline') THEN {col}"
    f" ELSE COALESCE(%s::bigint, {col}) END" for col in NodeCapacity.FIELDS)
_HEARTBEAT_SQL = (
    f"UPDATE backend_nodes SET last_heartbeat = now(), {_CAPACITY_UNLESS_IDLE}"
    " WHERE id = %s RETURNING status"
)

# Many nodes' heartbeats in one statement (:class:`HeartbeatBatch`): each row of the batch names
# a node, the sha256 hex of the credential it presented and its capacity; only rows whose stored
# tunnel credential hash is that hash are written and returned.
_CAPACITY_FROM_BATCH = ", ".join(
    f"{col} = CASE WHEN b.status IN ('pending', 'offline') THEN b.{col}"
    f" ELSE COALESCE(u.{col}, b.{col}) END" for col in NodeCapacity.FIELDS)
_BATCH_ROWS_LOCKED, _BATCH_ROWS_ARE_LOCKED = locked_first("SELECT id FROM u")
_HEARTBEAT_BATCH_SQL = (
    "WITH u AS (SELECT * FROM unnest(%s::text[], %s::text[], "
    + ", ".join("%s::bigint[]" for _ in NodeCapacity.FIELDS)
    + f") AS u(id, credential_hash, {', '.join(NodeCapacity.FIELDS)})), {_BATCH_ROWS_LOCKED}"
    f" UPDATE backend_nodes AS b SET last_heartbeat = now(), {_CAPACITY_FROM_BATCH}"
    f" FROM u WHERE {_BATCH_ROWS_ARE_LOCKED} AND b.id = u.id AND b.tunnel_token_hash <> ''"
    " AND lower(btrim(b.tunnel_token_hash)) = u.credential_hash"
    " RETURNING b.id, u.credential_hash, b.status"
)

#: Seconds a heartbeat waits for others to share its statement (``--heartbeat-batch``).
DEFAULT_HEARTBEAT_BATCH = 0.2
#: The longest window ``--heartbeat-batch`` accepts: a beat is written at most this late, far
#: inside the 90 s stale threshold and the worker's 10 s between beats.
MAX_HEARTBEAT_BATCH = 2.0
#: At most this many heartbeats in one statement; a full batch is written at once.
HEARTBEAT_BATCH_MAX = 1000


class HeartbeatBatch:
    """Heartbeats of many nodes written in one statement: the credential check and the write.

    One heartbeat used to cost three statements (the credential's row, its labels, the update),
    400 a second for a replica holding 4000 workers that beat every 10 s (docs/benchmarks.md,
    "An idle fleet").  :meth:`beat` queues the beat and answers when the batch it joined is
    written: the first beat of a batch starts a ``window`` timer; at its end, or when
    :data:`HEARTBEAT_BATCH_MAX` beats wait, one ``UPDATE ... FROM unnest(...)`` checks every
    presented credential against the stored hash and writes ``last_heartbeat = now()`` (the
    database's clock, as before: a beat is at most ``window`` later than its request) and the
    capacity of the nodes whose credential matched.

    The credential is compared as sha256 hex inside the statement, not in Python: a timing
    difference could at most tell a prefix of the stored digest, which does not help to find a
    credential (a preimage of a 256-bit random secret).  An unknown node and a wrong credential
    give the same answer (:class:`Unauthorized`), as :meth:`NodeRegistry.verify_tunnel_credential`
    does.  The same node and credential twice in one batch is one row (the later capacity).

    Must never answer a beat before its row is written, never write a node whose credential did
    not match, and never keep a beat past a failed statement (each waiter gets the failure).
    """

    def __init__(self, db, clock, window: float = DEFAULT_HEARTBEAT_BATCH,
                 max_batch: int = HEARTBEAT_BATCH_MAX):
        if window < 0 or max_batch < 1:
            raise ValueError("the heartbeat batch window must be >= 0 and its size >= 1")
        self._db = db
        self._clock = clock
        self.window = window
        self.max_batch = max_batch
        #: (node id, credential hash) -> [capacity values, waiters]
        self._pending: dict[tuple[str, str], list] = {}
        self._timer = None
        #: Statements written (tests and the benchmark read it).
        self.writes = 0

    def beat(self, node_id: str, credential: str,
             capacity: "NodeCapacity | None" = None) -> defer.Deferred:
        """A deferred firing with the node's :class:`NodeStatus` once its batch is written, or
        failing with :class:`Unauthorized` (unknown node, empty or wrong credential)."""
        capacity = (capacity or NodeCapacity()).validated()
        node_id = _validate_node_id(node_id)
        if not credential:
            return defer.fail(Unauthorized("tunnel credential"))
        d = defer.Deferred()
        key = (node_id, hash_secret(credential))
        entry = self._pending.get(key)
        if entry is None:
            self._pending[key] = [capacity.values(), [d]]
        else:
            entry[0] = capacity.values()
            entry[1].append(d)
        if len(self._pending) >= self.max_batch:
            self.flush()
        elif self._timer is None:
            self._timer = self._clock.callLater(self.window, self.flush)
        return d

    @property
    def waiting(self) -> int:
        """Beats queued and not yet written."""
        return sum(len(entry[1]) for entry in self._pending.values())

    def flush(self) -> defer.Deferred:
        """Write every queued beat now (one statement); fires when their waiters are answered."""
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, {}
        if not batch:
            return defer.succeed(None)
        keys = list(batch)
        columns = list(zip(*(batch[key][0] for key in keys)))
        self.writes += 1
        d = self._db.runQuery(_HEARTBEAT_BATCH_SQL,
                              ([k[0] for k in keys], [k[1] for k in keys],
                               *(list(column) for column in columns)))

        def written(rows):
            statuses = {(node_id, digest): status for node_id, digest, status in rows}
            for key in keys:
                status = statuses.get(key)
                for waiter in batch[key][1]:
                    if status is None:
                        waiter.errback(Unauthorized("tunnel credential"))
                    else:
                        waiter.callback(NodeStatus(status))

        def failed(failure):
            for key in keys:
                for waiter in batch[key][1]:
                    waiter.errback(failure)

        return d.addCallbacks(written, failed)


_LABELS_OF_SQL = "SELECT node_id, key, value FROM node_labels WHERE node_id = ANY(%s) ORDER BY key"


def _node_from_row(row, labels: dict[str, str] | None = None) -> Node:
    (nid, name, node_type, status, approved, tv, av, tr, ar, td, ad, vendor, maxr,
     beat, created, approved_at) = row
    return Node(nid, name, NodeType(node_type), NodeStatus(status), approved, tv, av, tr, ar,
                td, ad, vendor, maxr, beat, created, dict(labels or {}), approved_at)


class NodeRegistry:
    """Registration, credentials, labels and status of workers in ``backend_nodes``.

    :param db: a started ``Database``.
    :param registration_token: the deployment's shared registration token ('' = none).
    :param require_auth: refuse an empty ``registration_token`` (see the module docstring).
    :param require_approval: new nodes start ``pending`` until ``approve``.
    """

    def __init__(self, db, *, registration_token: str = "", require_auth: bool = False,
                 require_approval: bool = False,
                 on_changed: Callable[[str], Any] | None = None,
                 heartbeat_batch: HeartbeatBatch | None = None):
        if not registration_token and require_auth:
            raise RegistrationTokenRequired(
                "registration requires a token (require-auth mode) but none is configured; "
                "set --registration-token")
        if not registration_token:
            log.warn("no registration token configured: any worker that reaches this frontend "
                     "may register (and re-register an existing name)")
        self._db = db
        # Keep only the digest: compares in constant time without leaking the token's length.
        self._token_digest = (hashlib.sha256(registration_token.encode("utf-8")).digest()
                              if registration_token else b"")
        self._require_approval = require_approval
        #: ``on_changed(node_id)``: the node's status, labels or existence changed (the
        #: frontend's placement cache drops what it kept for it).  Never awaited, never fails
        #: a write.
        self.on_changed = on_changed
        #: Where :meth:`beat` queues heartbeats (None: each beat its own statements).
        self.heartbeat_batch = heartbeat_batch

    def _changed(self, node_id: str) -> None:
        if self.on_changed is None:
            return
        try:
            self.on_changed(node_id)
        except Exception:
            log.failure("on_changed of node {node} failed", node=node_id)

    # -- credentials ---------------------------------------------------------------------------

    def check_registration_token(self, presented: str | None) -> None:
        """:raises Unauthorized: the presented token does not match the configured one."""
        if not self._token_digest:
            return  # open registration (documented policy)
        digest = hashlib.sha256((presented or "").encode("utf-8")).digest()
        if not presented or not hmac.compare_digest(digest, self._token_digest):
            raise Unauthorized("registration token")

    async def verify_tunnel_credential(self, node_id: str, presented: str | None) -> Node:
        """The node whose current tunnel credential is ``presented``.

        Pending nodes verify too (the connect route answers 403 for them).  An unknown node, an
        empty credential or an empty stored hash all raise the same ``Unauthorized``.
        """
        rows = await self._db.runQuery(
            f"SELECT {_NODE_COLUMNS}, tunnel_token_hash FROM backend_nodes WHERE id = %s",
            (node_id if isinstance(node_id, str) else "",))
        stored = rows[0][-1] if rows else ""
        # Hash and compare even when nothing is stored, so timing does not reveal which case.
        matched = secret_matches_hash(presented or "", stored or "0" * 64)
        if not rows or not stored or not matched:
            raise Unauthorized("tunnel credential")
        return (await self._with_labels([_node_from_row(rows[0][:-1])]))[0]

    async def control_token(self, node_id: str) -> str:
        """The bearer token of ``node_id``'s control plane, derived from its stored node key
        hash ('' for an unknown node or one registered without a key: then none is sent)."""
        rows = await self._db.runQuery("SELECT node_key_hash FROM backend_nodes WHERE id = %s",
                                       (_validate_node_id(node_id),))
        return control_token(rows[0][0]) if rows else ""

    # -- registration ----------------------------------------------------------------------------

    async def register(self, name: str, *, node_type: str | NodeType = NodeType.BACKEND,
                       presented_token: str | None = "",
                       node_key: str | None = None,
                       capacity: NodeCapacity | None = None,
                       gpu_vendor: str = "", max_replicas_per_model: int = 1,
                       labels: Mapping[str, str] | None = None) -> Registration:
        """Register or re-register the worker called ``name``.

        Same name and the node's key (``node_key``): same id, approval kept, ``node_models``
        rows deleted, credential rotated, given labels upserted (other labels, e.g. set by an
        admin, are kept).  New name: new id, ``pending`` in approval mode, else ``healthy``;
        the hash of ``node_key`` is stored and required from then on.

        :raises Unauthorized: wrong registration token.
        :raises NodeNameTaken: the name exists and ``node_key`` is not its key (nothing changed).
        :raises InvalidNodeInput: a field failed validation (``.field`` names it).
        """
        self.check_registration_token(presented_token)
        name = _validate_name(name)
        if node_key is not None and not valid_node_key(node_key):
            raise InvalidNodeInput("node_key", "must be 32-256 characters of A-Z a-z 0-9 _ -")
        kind = _validate_node_type(node_type)
        capacity = (capacity or NodeCapacity()).validated()
        if not isinstance(gpu_vendor, str) or len(gpu_vendor) > GPU_VENDOR_MAX:
            raise InvalidNodeInput("gpu_vendor", f"must be a string of at most {GPU_VENDOR_MAX}")
        if (isinstance(max_replicas_per_model, bool) or not isinstance(max_replicas_per_model, int)
                or not 1 <= max_replicas_per_model <= REPLICAS_MAX):
            raise InvalidNodeInput("max_replicas_per_model", f"must be 1..{REPLICAS_MAX}")
        labels = _validate_labels(labels)

        credential = mint_tunnel_credential()
        params = {
            "id": str(uuid.uuid4()), "name": name, "node_type": kind.value,
            "approve": not self._require_approval,
            # Off the reactor thread: scrypt is slow by design (and 16 MiB: a bounded pool).
            "token_hash": (await scrypt_threads.run(token_record, presented_token)
                           if presented_token else ""),
            "tunnel_hash": hash_secret(credential),
            "key_hash": node_key_hash(node_key) if node_key else "",
            "gpu_vendor": gpu_vendor, "max_replicas": max_replicas_per_model,
            **{k: v or 0 for k, v in zip(NodeCapacity.FIELDS, capacity.values())},
        }

        async def register(cursor) -> tuple[str, bool]:
            while True:  # a row deleted between the conflict and the lock: insert again
                await cursor.execute(_INSERT_NODE_SQL, params)
                inserted = cursor.fetchall()
                if inserted:
                    node_id, created = inserted[0][0], True
                    break
                await cursor.execute(_LOCK_NODE_BY_NAME_SQL, (name,))
                existing = cursor.fetchall()
                if existing:
                    (node_id, stored_key_hash), created = existing[0], False
                    break
            if not created:
                if stored_key_hash and not hmac.compare_digest(
                        params["key_hash"].encode("ascii"), stored_key_hash.encode("ascii")):
                    raise NodeNameTaken(name, node_id)
                await cursor.execute(_REREGISTER_SQL, {**params, "existing_id": node_id})
                await cursor.execute(_DELETE_NODE_MODELS_SQL, (node_id,))
            for key, value in labels.items():
                await cursor.execute(_UPSERT_LABEL_SQL, (node_id, key, value))
            return node_id, created

        try:
            node_id, created = await self._db.runInteraction(register)
        except NodeNameTaken as e:
            log.warn("refused a registration under the name {name}: it belongs to node {id} "
                     "and the registering worker did not present that node's key",
                     name=name, id=e.node_id)
            raise
        node = await self.get_node(node_id)
        log.info("node {name} {how} as {id} ({status})", name=name,
                 how="registered" if created else "re-registered", id=node_id,
                 status=node.status.value)
        return Registration(node, credential, created)

    async def approve(self, node_id: str) -> None:
        """pending -> healthy.  :raises NotPending: / :raises NodeNotFound:"""
        rows = await self._db.runQuery(
            "UPDATE backend_nodes SET status = 'healthy', approved = true, approved_at = now(),"
            " updated_at = now() WHERE id = %s AND status = 'pending' RETURNING id", (_validate_node_id(node_id),))
        if not rows:
            await self._require_exists(node_id)
            raise NotPending(node_id)

    # -- heartbeat and status --------------------------------------------------------------------

    async def heartbeat(self, node_id: str, capacity: NodeCapacity | None = None) -> NodeStatus:
        """Record a heartbeat at the database's ``now()``; update capacity unless the node is
        pending or offline.  Returns the node's status.  :raises NodeNotFound:"""
        capacity = (capacity or NodeCapacity()).validated()
        rows = await self._db.runQuery(_HEARTBEAT_SQL,
                                       (*capacity.values(), _validate_node_id(node_id)))
        if not rows:
            raise NodeNotFound(node_id)
        return NodeStatus(rows[0][0])

    async def beat(self, node_id: str, credential: str,
                   capacity: NodeCapacity | None = None) -> NodeStatus:
        """A worker's heartbeat proven with its tunnel ``credential``: written through the
        :class:`HeartbeatBatch` when there is one, else checked and written on its own
        (:meth:`verify_tunnel_credential`, then :meth:`heartbeat`).

        :raises Unauthorized: unknown node, or not its current credential.
        :raises NodeNotFound: the node went away between the check and the write (unbatched).
        """
        if self.heartbeat_batch is not None:
            return await self.heartbeat_batch.beat(node_id, credential, capacity)
        await self.verify_tunnel_credential(node_id, credential)
        return await self.heartbeat(node_id, capacity)

    async def _set_status(self, node_id: str, status: NodeStatus, guard_sql: str,
                          delete_models: bool = False) -> bool:
        _validate_node_id(node_id)

        async def change(cursor) -> bool:
            await cursor.execute(
                "UPDATE backend_nodes SET status = %s, updated_at = now()"
                f" WHERE id = %s AND {guard_sql} RETURNING id", (status.value, node_id))
            changed = bool(cursor.fetchall())
            if changed and delete_models:
                await cursor.execute(_DELETE_NODE_MODELS_SQL, (node_id,))
            return changed

        changed = await self._db.runInteraction(change)
        if not changed:
            await self._require_exists(node_id)
        else:
            self._changed(node_id)
        return changed

    async def mark_offline(self, node_id: str) -> bool:
        """Stale heartbeat or deregistration: status offline and the node's ``node_models`` rows
        deleted (explicit lifecycle).  The row and its approval stay.  False if already
        offline."""
        return await self._set_status(node_id, NodeStatus.OFFLINE, "status <> 'offline'",
                                      delete_models=True)

    async def mark_unhealthy(self, node_id: str) -> bool:
        """Status-only demotion (presence gone, no route).  Rows are kept.  Pending, offline and
        draining nodes are left as they are."""
        return await self._set_status(node_id, NodeStatus.UNHEALTHY,
                                      "status IN ('healthy', 'registering')")

    async def mark_healthy(self, node_id: str) -> bool:
        """Back to healthy (recovered, or resumed after a drain).  Never promotes a node that
        was not approved."""
        return await self._set_status(node_id, NodeStatus.HEALTHY,
                                      "approved AND status <> 'healthy'")

    async def drain(self, node_id: str) -> bool:
        """Take no new work.  ``node_models`` rows are kept: in-flight work still runs and the
        worker's drain wait reads them.  Pending nodes cannot drain."""
        return await self._set_status(node_id, NodeStatus.DRAINING,
                                      "approved AND status <> 'draining'")

    # -- labels ------------------------------------------------------------------------------------

    async def set_labels(self, node_id: str, labels: Mapping[str, str], *,
                         replace: bool = False) -> dict[str, str]:
        """Upsert ``labels`` (``replace=True``: the node ends with exactly these).  Returns the
        node's labels afterwards."""
        _validate_node_id(node_id)
        labels = _validate_labels(labels)

        async def write(cursor) -> None:
            await cursor.execute("SELECT 1 FROM backend_nodes WHERE id = %s FOR UPDATE",
                                 (node_id,))
            if not cursor.fetchall():
                raise NodeNotFound(node_id)
            if replace:
                await cursor.execute("DELETE FROM node_labels WHERE node_id = %s", (node_id,))
            for key, value in labels.items():
                await cursor.execute(_UPSERT_LABEL_SQL, (node_id, key, value))

        await self._db.runInteraction(write)
        self._changed(node_id)
        return await self.get_labels(node_id)

    async def get_labels(self, node_id: str) -> dict[str, str]:
        rows = await self._db.runQuery(_LABELS_OF_SQL, ([_validate_node_id(node_id)],))
        return {key: value for _, key, value in rows}

    async def delete_label(self, node_id: str, key: str) -> bool:
        """Remove one label; False if the node had no such label."""
        rows = await self._db.runQuery(
            "DELETE FROM node_labels WHERE node_id = %s AND key = %s RETURNING key",
            (_validate_node_id(node_id), _validate_label_key(key)))
        if rows:
            self._changed(node_id)
        return bool(rows)

    # -- reads and deletion ----------------------------------------------------------------------

    async def get_node(self, node_id: str) -> Node:
        rows = await self._db.runQuery(f"SELECT {_NODE_COLUMNS} FROM backend_nodes WHERE id = %s",
                                       (_validate_node_id(node_id),))
        if not rows:
            raise NodeNotFound(node_id)
        return (await self._with_labels([_node_from_row(rows[0])]))[0]

    async def get_node_by_name(self, name: str) -> Node:
        rows = await self._db.runQuery(
            f"SELECT {_NODE_COLUMNS} FROM backend_nodes WHERE name = %s", (_validate_name(name),))
        if not rows:
            raise NodeNotFound(name)
        return (await self._with_labels([_node_from_row(rows[0])]))[0]

    async def list_nodes(self, *, status: str | NodeStatus | None = None,
                         node_type: str | NodeType | None = None,
                         after: str | None = None, limit: int | None = None) -> list[Node]:
        """Nodes (optionally one status and/or type), with labels, ordered by name; ``after``
        and ``limit`` page through them by name (names are unique), in two statements
        whatever the count."""
        status_value = NodeStatus(status).value if status is not None else None
        type_value = _validate_node_type(node_type).value if node_type is not None else None
        rows = await self._db.runQuery(
            f"SELECT {_NODE_COLUMNS} FROM backend_nodes"
            " WHERE (%s::text IS NULL OR status = %s) AND (%s::text IS NULL OR node_type = %s)"
            "  AND (%s::text IS NULL OR name > %s)"
            " ORDER BY name LIMIT %s",
            (status_value, status_value, type_value, type_value, after, after, limit))
        return await self._with_labels([_node_from_row(r) for r in rows])

    async def delete_node(self, node_id: str) -> None:
        """Delete the node, its labels and models (cascade) and its connection row.  A replica
        still holding its tunnel is fenced out on release.  :raises NodeNotFound:"""
        _validate_node_id(node_id)

        async def delete(cursor) -> bool:
            await cursor.execute("DELETE FROM backend_nodes WHERE id = %s RETURNING id",
                                 (node_id,))
            if not cursor.fetchall():
                return False
            await cursor.execute("DELETE FROM node_connections WHERE node_id = %s", (node_id,))
            return True

        if not await self._db.runInteraction(delete):
            raise NodeNotFound(node_id)
        self._changed(node_id)

    # -- helpers ---------------------------------------------------------------------------------

    async def _require_exists(self, node_id: str) -> None:
        if not await self._db.runQuery("SELECT 1 FROM backend_nodes WHERE id = %s", (node_id,)):
            raise NodeNotFound(node_id)

    async def _with_labels(self, nodes: list[Node]) -> list[Node]:
        if not nodes:
            return nodes
        rows = await self._db.runQuery(_LABELS_OF_SQL, ([n.id for n in nodes],))
        by_node: dict[str, dict[str, str]] = {}
        for node_id, key, value in rows:
            by_node.setdefault(node_id, {})[key] = value
        return [Node(**{**n.__dict__, "labels": by_node.get(n.id, {})}) for n in nodes]
