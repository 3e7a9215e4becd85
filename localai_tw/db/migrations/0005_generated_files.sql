-- generated files served by every replica (docs/openai-api.md, "Images"): an image answered as
-- a URL is kept here so that whichever replica the load balancer picks can serve it.  Bounded by
-- the store (frontend/api/generated.py): each row expires, and the newest rows within a total size
-- are kept; nothing else reads or writes this table.
CREATE TABLE generated_files (
    name         varchar(64)  PRIMARY KEY,   -- <32 hex>.<ext>, random: the URL's capability
    content_type varchar(64)  NOT NULL,
    size         integer      NOT NULL CHECK (size >= 0),
    data         bytea        NOT NULL,
    created_at   timestamptz  NOT NULL DEFAULT now(),
    expires_at   timestamptz  NOT NULL
);
CREATE INDEX generated_files_expires_at ON generated_files (expires_at);
CREATE INDEX generated_files_created_at ON generated_files (created_at);
