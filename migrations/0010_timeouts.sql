-- Execution timeouts (issue #15), separate from liveness: heartbeats say the
-- agent is alive, a deadline says how long one attempt may run. A job's
-- timeout_seconds (NULL: none) becomes deadline_at when it is leased; the
-- agent stops the handler at the deadline, and the server fails attempts
-- still leased past deadline + grace (the index below: only leased rows with
-- a deadline, so the sweep never reads history).
ALTER TABLE gpuq.jobs
    ADD COLUMN timeout_seconds int CHECK (timeout_seconds > 0),
    ADD COLUMN deadline_at timestamptz;
CREATE INDEX jobs_deadline_idx ON gpuq.jobs (deadline_at) WHERE status = 'leased' AND deadline_at IS NOT NULL;

-- Per-kind default timeouts (`gpuq kind-timeout KIND SECONDS`): the lease
-- reads one row per kind it leases, not per job.
CREATE TABLE gpuq.kind_timeouts (
    kind            text PRIMARY KEY,
    timeout_seconds int NOT NULL CHECK (timeout_seconds > 0)
);
