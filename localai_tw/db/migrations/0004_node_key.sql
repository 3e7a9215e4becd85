-- node identity: a worker proves it is the node a name belongs to (docs/cluster-state.md).
--
-- A worker keeps a random per-node key in its data directory and presents it at every
-- registration; the frontend keeps only its sha256 hex.  Re-registering an existing name needs
-- the same key, so the shared registration token alone can no longer take a node over.  Rows
-- registered before this column existed have '' and are claimed by the first registration that
-- presents a key (the upgrade path); the key is never replaced once set.
ALTER TABLE backend_nodes ADD COLUMN node_key_hash varchar(64) NOT NULL DEFAULT '';
