-- A terminal state for cancelled jobs (issue #15): never retried, never
-- leased, kept as history like done and dead. (Its own migration: a new enum
-- value cannot be used in the transaction that adds it.)
ALTER TYPE gpuq.job_status ADD VALUE 'cancelled';
