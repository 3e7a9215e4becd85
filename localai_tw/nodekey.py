"""A worker's node key: what proves, at re-registration, that a worker is the node its name
belongs to, and what the control token both sides use is derived from.

The worker generates the key once (256 random bits) and keeps it in ``<data-dir>/node-key``
(mode 0600); the frontend stores only its sha256 hex (``backend_nodes.node_key_hash``).  The
shared registration token says "may join this cluster"; the node key says "is this node".

The control token (``Authorization: Bearer`` on the worker's control plane and file routes) is
an HMAC of a fixed label keyed by the node key's hash: every frontend replica can compute it from
the database, the worker from its own key, and it is never the shared registration token, so a
worker does not need that token to check who calls it.

This module must never log a key or a token, and never overwrite an existing key file (a
changed key makes the node's name unusable until an administrator removes the node).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import tempfile

#: The key file's name inside the worker's data directory.
NODE_KEY_FILE = "node-key"
#: A key file larger than this is not a key file.
_MAX_KEY_FILE_BYTES = 1024
_KEY = re.compile(r"^[A-Za-z0-9_-]{32,256}$")
_CONTROL_LABEL = b"localai-tw worker control v1"


class NodeKeyError(Exception):
    """The key file exists but cannot be used; the message names the file and the fix."""


def mint_node_key() -> str:
    """A fresh node key (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def valid_node_key(key) -> bool:
    return isinstance(key, str) and bool(_KEY.match(key))


def node_key_hash(key: str) -> str:
    """The sha256 hex stored in place of the key (the key is random: no salt or stretching
    needed)."""
    return hashlib.sha256(key.encode("ascii")).hexdigest()


def control_token(key_hash: str) -> str:
    """The control plane bearer token of the node whose key hashes to ``key_hash`` ('' for a node
    without a key)."""
    if not key_hash:
        return ""
    return hmac.new(key_hash.encode("ascii"), _CONTROL_LABEL, hashlib.sha256).hexdigest()


def load_or_create_node_key(data_dir: str) -> tuple[str, bool]:
    """``(key, created)``: the key kept in ``data_dir``, generated there on first use.

    Small blocking file I/O, meant for service construction before the reactor runs.
    :raises NodeKeyError: the file is unreadable or does not hold a key.
    """
    path = os.path.join(data_dir, NODE_KEY_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        return _create(data_dir, path), True
    except OSError as e:
        raise NodeKeyError(f"cannot read the node key {path}: {e.strerror}") from None
    try:
        key = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        key = ""
    if len(raw) > _MAX_KEY_FILE_BYTES or not valid_node_key(key):
        raise NodeKeyError(
            f"{path} does not hold a node key; restore it from a backup, or remove it and have "
            "an administrator delete this node (DELETE /api/nodes/<id>) so it registers anew")
    return key, False


def _create(data_dir: str, path: str) -> str:
    key = mint_node_key()
    try:
        os.makedirs(data_dir, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".node-key-", dir=data_dir)  # mode 0600
    except OSError as e:
        raise NodeKeyError(f"cannot create the node key {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key.encode("ascii") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        # link() never replaces: a crash leaves no half-written key, and of two workers started
        # on one data directory the second reads the first one's key.
        os.link(temporary, path)
    except FileExistsError:
        return load_or_create_node_key(data_dir)[0]
    except OSError as e:
        raise NodeKeyError(f"cannot write the node key {path}: {e.strerror}") from None
    finally:
        try:
            os.unlink(temporary)
        except OSError:
            pass
    return key
