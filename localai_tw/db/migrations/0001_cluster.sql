-- Cluster state: replicas (instances), workers (backend_nodes, node_labels), tunnel ownership
-- (node_connections + the epoch sequence), and the tables later layers fill (node_models,
-- model_scheduling_configs).  See docs/cluster-state.md for why each column exists.
--
-- Every timestamp here is written by PostgreSQL (now()), never by a replica: replicas' clocks
-- disagree, the database's clock is the one all of them share.

-- One row per running frontend replica.  Live = last_seen within the liveness window.
CREATE TABLE instances (
    id              varchar(36)  PRIMARY KEY,
    version         varchar(255) NOT NULL DEFAULT '',
    -- host:port other replicas dial for the peer link; '' = not published
    advertised_addr varchar(255) NOT NULL DEFAULT '',
    -- sha256 hex of the replica's own peer secret; the plaintext never leaves the process
    peer_token_hash varchar(64)  NOT NULL DEFAULT '',
    last_seen       timestamptz  NOT NULL DEFAULT now(),
    registered_at   timestamptz  NOT NULL DEFAULT now()
);
CREATE INDEX instances_last_seen_idx ON instances (last_seen);

-- One row per worker, keyed by an id that survives re-registration under the same name.
CREATE TABLE backend_nodes (
    id                     varchar(36)  PRIMARY KEY,
    name                   varchar(255) NOT NULL UNIQUE,
    node_type              varchar(16)  NOT NULL DEFAULT 'backend'
        CHECK (node_type IN ('backend', 'agent')),
    status                 varchar(16)  NOT NULL DEFAULT 'registering'
        CHECK (status IN ('healthy', 'unhealthy', 'offline', 'draining', 'pending',
                          'registering')),
    -- Approval outlives status changes: offline -> re-register restores healthy only if true.
    approved               boolean      NOT NULL DEFAULT false,
    -- sha256 hex of the registration token the worker presented ('' when none)
    token_hash             varchar(64)  NOT NULL DEFAULT '',
    -- sha256 hex of the per-node tunnel credential minted at the last registration
    tunnel_token_hash      varchar(64)  NOT NULL DEFAULT '',
    total_vram             bigint       NOT NULL DEFAULT 0 CHECK (total_vram >= 0),
    available_vram         bigint       NOT NULL DEFAULT 0 CHECK (available_vram >= 0),
    total_ram              bigint       NOT NULL DEFAULT 0 CHECK (total_ram >= 0),
    available_ram          bigint       NOT NULL DEFAULT 0 CHECK (available_ram >= 0),
    total_disk             bigint       NOT NULL DEFAULT 0 CHECK (total_disk >= 0),
    available_disk         bigint       NOT NULL DEFAULT 0 CHECK (available_disk >= 0),
    gpu_vendor             varchar(64)  NOT NULL DEFAULT '',
    max_replicas_per_model integer      NOT NULL DEFAULT 1 CHECK (max_replicas_per_model >= 1),
    last_heartbeat         timestamptz,
    created_at             timestamptz  NOT NULL DEFAULT now(),
    updated_at             timestamptz  NOT NULL DEFAULT now()
);
CREATE INDEX backend_nodes_status_idx ON backend_nodes (status);
CREATE INDEX backend_nodes_last_heartbeat_idx ON backend_nodes (last_heartbeat);

CREATE TABLE node_labels (
    node_id varchar(36)  NOT NULL REFERENCES backend_nodes (id) ON DELETE CASCADE,
    key     varchar(128) NOT NULL,
    value   varchar(255) NOT NULL DEFAULT '',
    PRIMARY KEY (node_id, key)
);
CREATE INDEX node_labels_key_value_idx ON node_labels (key, value);

-- Which replica holds a worker's tunnel.  owner_instance_id = '' means held by nobody (the row
-- then records a departure at disconnected_at); it is never NULL.  No foreign key to
-- backend_nodes: ownership is about a connection, and a departure must be able to outlive a
-- concurrent node deletion long enough to be read as such.
CREATE TABLE node_connections (
    node_id           varchar(36) PRIMARY KEY,
    owner_instance_id varchar(36) NOT NULL,
    -- fence token from node_connection_epochs; unique, NOT ordered: compare with = only
    epoch             bigint      NOT NULL,
    connected_at      timestamptz NOT NULL,
    disconnected_at   timestamptz
);
CREATE INDEX node_connections_owner_idx ON node_connections (owner_instance_id);
CREATE INDEX node_connections_disconnected_idx ON node_connections (disconnected_at);

-- Deliberately a free-standing sequence drawn explicitly by the claim statement, not a column
-- default and not a per-row counter: rows are purged, and a per-row counter would restart and
-- hand a new holder an epoch a stale holder still remembers.
CREATE SEQUENCE IF NOT EXISTS node_connection_epochs AS bigint;

-- Which model replicas a worker serves.  Filled by the scheduler layer; the node registry
-- deletes a node's rows on re-registration and when it marks the node offline.
CREATE TABLE node_models (
    id            varchar(36)  PRIMARY KEY DEFAULT gen_random_uuid()::text,
    node_id       varchar(36)  NOT NULL REFERENCES backend_nodes (id) ON DELETE CASCADE,
    model_name    varchar(255) NOT NULL,
    replica_index integer      NOT NULL DEFAULT 0 CHECK (replica_index >= 0),
    -- worker-local address (only the port matters to a frontend)
    address       varchar(255) NOT NULL DEFAULT '',
    state         varchar(16)  NOT NULL DEFAULT 'staging'
        CHECK (state IN ('staging', 'loading', 'loaded', 'unloading', 'idle')),
    in_flight     integer      NOT NULL DEFAULT 0 CHECK (in_flight >= 0),
    last_used     timestamptz,
    -- id of the frontend replica driving a load ('' when none)
    loading_by    varchar(36)  NOT NULL DEFAULT '',
    backend_type  varchar(128) NOT NULL DEFAULT '',
    created_at    timestamptz  NOT NULL DEFAULT now(),
    updated_at    timestamptz  NOT NULL DEFAULT now(),
    UNIQUE (node_id, model_name, replica_index)
);
CREATE INDEX node_models_model_name_idx ON node_models (model_name);

-- Per-model placement rules (label selector, replica bounds).  Filled by the scheduler layer.
CREATE TABLE model_scheduling_configs (
    model_name    varchar(255) PRIMARY KEY,
    node_selector jsonb        NOT NULL DEFAULT '{}'::jsonb
        CHECK (jsonb_typeof(node_selector) = 'object'),
    min_replicas  integer      NOT NULL DEFAULT 0 CHECK (min_replicas >= 0),
    max_replicas  integer      NOT NULL DEFAULT 0 CHECK (max_replicas >= 0),
    created_at    timestamptz  NOT NULL DEFAULT now(),
    updated_at    timestamptz  NOT NULL DEFAULT now()
);
