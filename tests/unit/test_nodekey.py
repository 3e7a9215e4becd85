"""The worker's node key file: created once (0600), read back unchanged, never overwritten."""

from __future__ import annotations

import os
import stat

import pytest

from localai_tw.nodekey import (
    NODE_KEY_FILE,
    NodeKeyError,
    control_token,
    load_or_create_node_key,
    node_key_hash,
    valid_node_key,
)


def test_the_key_is_created_once_private_and_read_back(tmp_path):
    data_dir = tmp_path / "missing" / "data"
    key, created = load_or_create_node_key(str(data_dir))
    assert created and valid_node_key(key)
    path = data_dir / NODE_KEY_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_node_key(str(data_dir)) == (key, False)
    assert [p.name for p in data_dir.iterdir()] == [NODE_KEY_FILE]  # no temporary left over


@pytest.mark.parametrize("content", [b"", b"short", b"\xff" * 40, b"k" * 2000])
def test_a_file_that_holds_no_key_is_an_error_naming_it_and_is_kept(tmp_path, content):
    (tmp_path / NODE_KEY_FILE).write_bytes(content)
    with pytest.raises(NodeKeyError) as refused:
        load_or_create_node_key(str(tmp_path))
    assert str(tmp_path / NODE_KEY_FILE) in str(refused.value)
    assert "DELETE /api/nodes/" in str(refused.value)
    assert (tmp_path / NODE_KEY_FILE).read_bytes() == content


def test_the_control_token_is_bound_to_the_key_and_is_not_the_stored_hash():
    a, b = "a" * 43, "b" * 43
    assert control_token(node_key_hash(a)) == control_token(node_key_hash(a))
    assert control_token(node_key_hash(a)) != control_token(node_key_hash(b))
    assert control_token(node_key_hash(a)) not in (a, node_key_hash(a))
    assert control_token("") == ""
