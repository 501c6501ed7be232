-- Progress (issue #15): the latest a running job reported with
-- job.progress(), as {fraction, message, data, attempt, at}. The dispatcher
-- writes it at most once per job per second, many jobs per statement, fenced
-- by the lease token. Not indexed, so a write is a HOT update of the row;
-- nothing but `gpuq show`, /jobs/ID and waiters reads it.
ALTER TABLE gpuq.jobs ADD COLUMN progress jsonb;
