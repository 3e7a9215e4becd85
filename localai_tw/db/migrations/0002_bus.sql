-- bus: bus_messages (spill of LISTEN/NOTIFY envelopes too large to notify) and work_claims
-- (the SKIP LOCKED claim queue).  Owned by localai_tw/bus; see docs/bus.md.
--
-- Every timestamp here is written and compared with the database clock (now()), never a
-- replica's clock.

-- A spilled broadcast.  The NOTIFY carries only {"s": subject, "i": id}; subscribers fetch the
-- row by primary key.  Rows are purged by age (created_at) by every replica.  The reference keeps
-- an index on subject too; nothing here reads by subject, so it would only slow the insert.
CREATE TABLE bus_messages (
    id          uuid          PRIMARY KEY,
    subject     varchar(255)  NOT NULL,
    payload     bytea         NOT NULL,   -- the UTF-8 JSON text of the envelope's "d"
    created_at  timestamptz   NOT NULL DEFAULT now()
);
CREATE INDEX bus_messages_created_at_idx ON bus_messages (created_at);

-- A unit of work claimed by one frontend REPLICA at a time (claimed_by is the replica id from
-- instances, never a worker id; '' means unclaimed).
CREATE TABLE work_claims (
    id          varchar(36)   PRIMARY KEY,
    kind        varchar(32)   NOT NULL,
    payload     bytea         NOT NULL,
    claimed_by  varchar(64)   NOT NULL DEFAULT '',
    claimed_at  timestamptz   NULL,
    attempts    integer       NOT NULL DEFAULT 0,
    failures    integer       NOT NULL DEFAULT 0,
    not_before  timestamptz   NULL,
    created_at  timestamptz   NOT NULL DEFAULT now(),
    -- Held and unheld are one fact written in two columns; keep them from disagreeing.  A held
    -- row with an empty holder could never be reaped (no live instance has id '').
    CONSTRAINT work_claims_holder_consistent CHECK ((claimed_at IS NULL) = (claimed_by = ''))
);
CREATE INDEX work_claims_kind_idx ON work_claims (kind);
CREATE INDEX work_claims_claimed_by_idx ON work_claims (claimed_by);
CREATE INDEX work_claims_not_before_idx ON work_claims (not_before);
-- The claim scan walks unclaimed rows in (created_at, id) order and filters the kinds on the
-- way.  Leading with kind would not serve "kind = ANY(...)" in order: PostgreSQL would read
-- every ready row and sort it on each claim (17 ms at 4000 rows instead of 0.4 ms).
CREATE INDEX work_claims_ready_idx ON work_claims (created_at, id) WHERE claimed_at IS NULL;
-- The reap scan: held rows only (usually few).
CREATE INDEX work_claims_held_idx ON work_claims (claimed_by) WHERE claimed_at IS NOT NULL;
