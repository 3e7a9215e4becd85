-- inference: model_load_jobs, the cross-replica load lock of the inference core
-- (localai_tw/frontend/scheduler.py; docs/inference.md).
--
-- One row per model whose cold load is in progress somewhere.  A replica owns the load while
-- its row names it (owner_instance_id + its own attempt token) AND it keeps last_progress_at
-- fresh.  Another replica may take the row over only when the owner is not a live replica or
-- last_progress_at is older than the takeover age; both compared with the database clock.
-- The row is deleted when the load ends (loaded or failed).
CREATE TABLE model_load_jobs (
    model_name        varchar(255) PRIMARY KEY,
    owner_instance_id varchar(36)  NOT NULL,
    -- one value per load attempt: a replica loading the same model twice at once still
    -- serialises, and a late release of a taken-over attempt deletes nothing
    attempt           varchar(36)  NOT NULL,
    node_id           varchar(36)  NOT NULL DEFAULT '',
    phase             varchar(16)  NOT NULL DEFAULT 'choosing'
        CHECK (phase IN ('choosing', 'starting', 'staging', 'loading')),
    started_at        timestamptz  NOT NULL DEFAULT now(),
    last_progress_at  timestamptz  NOT NULL DEFAULT now()
);
CREATE INDEX model_load_jobs_progress_idx ON model_load_jobs (last_progress_at);

-- ModelOptions.Model as the backend loaded it (the worker-side path of the staged model file,
-- or the identifier).  Every inference call sends it as ModelIdentity, so a replica that did
-- not drive the load still names the model exactly as the backend recorded it.
ALTER TABLE node_models ADD COLUMN loaded_model varchar(1024) NOT NULL DEFAULT '';
