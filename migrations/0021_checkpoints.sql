-- Checkpoints (issue #33): the last checkpoint a running job's handler stored
-- with job.checkpoint(data), for the next attempt to resume from
-- (job.resume_from). The dispatcher writes it fenced by the lease token, as it
-- writes progress; no statement that moves a job between states touches these
-- columns, so a checkpoint survives a retry, a reclaimed lease, a disconnected
-- agent and a release back to pending (`gpuq retry --fresh` drops it).
--
-- checkpoint: the handler's JSON as given (never null once written: the agent
-- library refuses a null checkpoint); checkpoint_at: when it was stored;
-- checkpoint_attempt: the attempt that stored it. Nullable columns without a
-- default rewrite nothing, and they are not indexed, so a write is a HOT
-- update of the row, like progress. Nothing but the lease statements (their
-- RETURNING), `gpuq show` and /ui/jobs/ID reads them.
--
-- The size limit is the protocol's (8192 bytes of compact JSON, refused by
-- the agent library and by the server's parser), as for progress: no CHECK,
-- which every update of every row (a lease, a heartbeat) would evaluate.
ALTER TABLE gpuq.jobs ADD COLUMN checkpoint jsonb;
ALTER TABLE gpuq.jobs ADD COLUMN checkpoint_at timestamptz;
ALTER TABLE gpuq.jobs ADD COLUMN checkpoint_attempt integer;
