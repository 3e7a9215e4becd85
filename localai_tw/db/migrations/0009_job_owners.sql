-- jobs.owner: the sha256 (hex) of the API key that submitted the job, never the key; an
-- inference key sees and cancels only its own jobs, an admin key all (issue 21 §3).  '' for jobs
-- submitted before keys had scopes (only admin keys see them).
ALTER TABLE jobs ADD COLUMN owner varchar(64) NOT NULL DEFAULT '';
-- The per-key count of open jobs (queued or running) at submit; a key's own page.
CREATE INDEX jobs_owner_state_idx ON jobs (owner, state);
CREATE INDEX jobs_owner_created_idx ON jobs (owner, created_at DESC, id DESC);
