-- responses: what POST /v1/responses answered and what a later request needs to continue it
-- (previous_response_id) on any replica (docs/responses-api.md).  owner is the sha256 (hex) of
-- the API key that created the response, never the key ('' while no key is configured): a key
-- reads, lists, cancels and deletes only its own responses.
--
-- Bounded: rows older than the retention (localai_tw/frontend/api/openai/response_store.py)
-- are deleted, a batch at a time, whenever a response is created; a response's conversation
-- is bounded by the request body cap and the message cap of the chat API.
--
-- Every timestamp is written by PostgreSQL (now()), never by a replica.

CREATE TABLE responses (
    id                   varchar(64)  PRIMARY KEY,
    owner                varchar(64)  NOT NULL,
    model                text         NOT NULL,
    status               varchar(16)  NOT NULL
        CHECK (status IN ('queued', 'in_progress', 'completed', 'incomplete', 'failed',
                          'cancelled')),
    previous_response_id varchar(64)  NULL,
    -- A background response is driven by a work_claims row (kind 'response', payload the
    -- response id) that any live replica claims; a claim of a replica that stops being live
    -- is reaped and the response runs again elsewhere.
    background           boolean      NOT NULL DEFAULT false,
    -- The replica running it now ('' when none), for diagnostics.
    instance_id          text         NOT NULL DEFAULT '',
    -- The chat request a background run prepares (NULL for a foreground response).
    chat_request         jsonb        NULL,
    -- The response object as the API answers it (status, output, usage ...).
    body                 jsonb        NOT NULL,
    -- This response's own input items, as GET /v1/responses/{id}/input_items lists them.
    input_items          jsonb        NOT NULL,
    -- The chat-shaped messages of the whole conversation up to and including this response's
    -- output (instructions excluded: they do not carry over), so a continuation is one read.
    conversation         jsonb        NOT NULL,
    created_at           timestamptz  NOT NULL DEFAULT now(),
    updated_at           timestamptz  NOT NULL DEFAULT now()
);
CREATE INDEX responses_created_idx ON responses (created_at);
CREATE INDEX responses_owner_idx ON responses (owner, created_at DESC);
