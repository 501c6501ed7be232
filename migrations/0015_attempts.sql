-- Issue #18 (dashboard): every attempt of a job, and failed jobs found without
-- walking history.
--
-- An attempt that does not end in success is kept in gpuq.attempts by a row
-- trigger: it fires only when a leased row leaves 'leased' for anything but
-- 'done' with its attempt counted (a refunded attempt, one never started,
-- lowers attempts and is not an attempt). The successful attempt, and the one
-- running, are the job row itself (leased_by, started_at, finished_at), so
-- the hot path (lease, complete) writes nothing here: its rows only evaluate
-- the WHEN clause.
CREATE TABLE gpuq.attempts (
    job_id     bigint NOT NULL,
    attempt    integer NOT NULL,
    agent      text,
    started_at timestamptz,
    ended_at   timestamptz NOT NULL DEFAULT now(),
    -- What the job became: scheduled (a retry), pending (lease lost: its agent
    -- left or the lease expired), leased (expired and leased again at once),
    -- dead, cancelled.
    became     gpuq.job_status NOT NULL,
    error      text  -- the error this attempt ended with (none: it was lost, not failed)
);
CREATE INDEX attempts_job_idx ON gpuq.attempts (job_id, ended_at);

CREATE FUNCTION gpuq.record_attempt() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO gpuq.attempts (job_id, attempt, agent, started_at, became, error)
    VALUES (OLD.id, OLD.attempts, OLD.leased_by, OLD.started_at, NEW.status,
            CASE WHEN NEW.status IN ('pending', 'leased') THEN NULL ELSE NEW.last_error END);
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_record_attempt
    AFTER UPDATE OF status ON gpuq.jobs
    FOR EACH ROW
    WHEN (OLD.status = 'leased' AND NEW.status <> 'done' AND NEW.attempts >= OLD.attempts)
    EXECUTE FUNCTION gpuq.record_attempt();

-- Dead and cancelled jobs, newest first: the dashboard's failed list and
-- retry by filter read this, never the done rows around them.
CREATE INDEX jobs_failed_idx ON gpuq.jobs (id) WHERE status IN ('dead', 'cancelled');

-- Jobs with a concurrency key, by key, newest first: the dashboard's filter by
-- key. Plain jobs (no key) have no entry and pay nothing for it.
CREATE INDEX jobs_keyed_idx ON gpuq.jobs (concurrency_key, id) WHERE concurrency_key IS NOT NULL;
