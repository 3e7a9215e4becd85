-- gallery installs and deletes (frontend/gallery/installs.py, docs/models.md "Gallery"): a job has a row
-- from the moment it starts until it is purged (7 days after it finished); while it is queued it
-- lives only in its replica's memory and in the broadcasts (bus subject gallery.<id>).
-- One running row per model across the cluster: the partial unique index is the claim.
CREATE TABLE gallery_jobs (
    id          uuid         PRIMARY KEY,
    model       varchar(255) NOT NULL,
    deletion    boolean      NOT NULL DEFAULT false,
    state       varchar(16)  NOT NULL CHECK (state IN ('running', 'done', 'failed')),
    replica     varchar(64)  NOT NULL,   -- the instances.id running it
    status      jsonb        NOT NULL,   -- the last snapshot written (the final one once finished)
    created_at  timestamptz  NOT NULL DEFAULT now(),
    finished_at timestamptz,
    CHECK ((state = 'running') = (finished_at IS NULL))
);
CREATE UNIQUE INDEX gallery_jobs_one_running ON gallery_jobs (model) WHERE state = 'running';
CREATE INDEX gallery_jobs_finished_at ON gallery_jobs (finished_at) WHERE finished_at IS NOT NULL;
