-- node identity: a worker proves it is the node a name belongs to (docs/cluster-state.md).
--
-- A worker keeps a random per-node key in its data directory and presents it at every
-- registration; the frontend keeps only its sha256 hex.  Re-registering an existing name needs
-- the same key, so the shared registration token alone can no longer take a node over.  Rows
-- registered before this column existed have '' and are claimed by the first registration that
-- presents a key (the upgrade path); the key is never replaced once set.
ALTER TABLE backend_nodes ADD COLUMN node_key_hash varchar(64) NOT NULL DEFAULT '';

-- token_hash recorded an unsalted sha256 of the registration token, the same in every row: a
-- database reader could test guesses of the shared token offline, once for all rows.  It now
-- holds a salted scrypt record (longer than 64 characters); the old digests are dropped (nothing
-- reads them; the next registration of each node writes a new record).
ALTER TABLE backend_nodes ALTER COLUMN token_hash TYPE varchar(255);
UPDATE backend_nodes SET token_hash = '';
