-- jobs: what a user submitted with POST /api/jobs, and everything any replica needs to answer
-- for it (docs/jobs.md).  The claim that drives a job is a work_claims row (kind 'job', payload
-- the job id, migration 0002); this table is the job's record and outlives the claim.
--
-- Every timestamp is written by PostgreSQL (now()), never by a replica.

CREATE TABLE jobs (
    id               varchar(36)  PRIMARY KEY,
    kind             varchar(32)  NOT NULL,
    input            jsonb        NOT NULL,
    state            varchar(16)  NOT NULL DEFAULT 'queued'
        CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    -- Times a worker said it started the job ("started" progress line).  A dispatch with
    -- runs > 0 is a re-run, and the job kind is told so.
    runs             integer      NOT NULL DEFAULT 0 CHECK (runs >= 0),
    -- Set by POST /api/jobs/{id}/cancel; a job with it set is never started again.
    cancel_requested boolean      NOT NULL DEFAULT false,
    result           jsonb        NULL,
    error            text         NULL,
    -- Progress events stored (job_events) and those dropped past the per-job cap.
    events_stored    integer      NOT NULL DEFAULT 0,
    events_dropped   integer      NOT NULL DEFAULT 0,
    created_at       timestamptz  NOT NULL DEFAULT now(),
    started_at       timestamptz  NULL,
    finished_at      timestamptz  NULL,
    updated_at       timestamptz  NOT NULL DEFAULT now(),
    -- A finished job has its finishing time; an unfinished one has none.
    CONSTRAINT jobs_finished_consistent CHECK (
        (state IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL))
);
-- GET /api/jobs?state=... pages newest first.
CREATE INDEX jobs_state_created_idx ON jobs (state, created_at DESC, id DESC);
CREATE INDEX jobs_created_idx ON jobs (created_at DESC, id DESC);

-- Progress events of a job, in order (seq from 1).  Bounded per job by the writer
-- (localai_tw/frontend/jobs/store.py); deleted with the job.
CREATE TABLE job_events (
    job_id  varchar(36)  NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    seq     integer      NOT NULL,
    at      timestamptz  NOT NULL DEFAULT now(),
    event   jsonb        NOT NULL,
    PRIMARY KEY (job_id, seq)
);
