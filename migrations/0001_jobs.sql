-- gpuq schema: one jobs table whose hot paths only ever touch the live slice.
--
-- Every index that a hot query uses is partial over a live status, so its
-- size is bounded by the work in flight, never by the done/dead history.

CREATE SCHEMA IF NOT EXISTS gpuq;

CREATE TYPE gpuq.job_status AS ENUM ('pending', 'leased', 'scheduled', 'done', 'dead');

CREATE TABLE gpuq.jobs (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind             text NOT NULL,
    payload          jsonb NOT NULL DEFAULT '{}'::jsonb,
    priority         smallint NOT NULL DEFAULT 0,
    status           gpuq.job_status NOT NULL DEFAULT 'pending',
    attempts         integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL DEFAULT 5,
    run_at           timestamptz NOT NULL DEFAULT now(),
    lease_expires_at timestamptz,
    leased_by        text,
    lease_token      uuid,
    result           jsonb,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    finished_at      timestamptz,
    dedup_key        text,

    -- Kinds travel in NOTIFY payloads as a comma-separated list: no commas.
    CONSTRAINT jobs_kind_format CHECK (kind ~ '^[A-Za-z0-9_.:/-]{1,128}$'),
    CONSTRAINT jobs_priority_range CHECK (priority BETWEEN -32767 AND 32767),
    CONSTRAINT jobs_max_attempts_positive CHECK (max_attempts >= 1),
    CONSTRAINT jobs_attempts_range CHECK (attempts >= 0 AND attempts <= max_attempts),
    -- A leased row always carries its fencing token and expiry.
    CONSTRAINT jobs_lease_complete CHECK (
        status <> 'leased' OR (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL AND leased_by IS NOT NULL)
    )
);

-- Hot path, phase 1 of the lease: pending rows of one kind in dispatch order.
CREATE INDEX jobs_pending_idx ON gpuq.jobs (kind, priority DESC, id) WHERE status = 'pending';
-- Phase 2 of the lease, the sweeper, heartbeats and disconnects: leased rows.
CREATE INDEX jobs_leased_idx ON gpuq.jobs (lease_expires_at) WHERE status = 'leased';
-- Retries and delayed jobs waiting for their time.
CREATE INDEX jobs_scheduled_idx ON gpuq.jobs (run_at) WHERE status = 'scheduled';
-- At most one live job per dedup key; finished jobs free the key.
CREATE UNIQUE INDEX jobs_dedup_live_idx ON gpuq.jobs (dedup_key)
    WHERE dedup_key IS NOT NULL AND status IN ('pending', 'leased', 'scheduled');

-- One NOTIFY per INSERT statement (not per row: a bulk insert must not flood
-- the listener), carrying the distinct pending kinds it inserted. A payload
-- that would exceed NOTIFY's limit becomes '*' (= look at every kind).
CREATE FUNCTION gpuq.notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    kinds text;
BEGIN
    SELECT string_agg(DISTINCT kind, ',') INTO kinds FROM inserted WHERE status = 'pending';
    IF kinds IS NOT NULL THEN
        PERFORM pg_notify('gpuq_jobs', CASE WHEN length(kinds) > 7000 THEN '*' ELSE kinds END);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify_inserted
    AFTER INSERT ON gpuq.jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION gpuq.notify_inserted();
