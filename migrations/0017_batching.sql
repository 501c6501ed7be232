-- Batching small jobs into one handler call (issue #31).
--
-- A kind with a row here has its jobs leased in batches for the agents that
-- take batches (protocol 7): at most max_items jobs in one call, their costs
-- summing to at most max_cost (a job whose cost alone is over it runs
-- alone), and a partial batch sent once its oldest job has waited
-- max_wait_ms since it was due (0: at once). Only jobs of the same kind,
-- placement shape and batch_key share a batch (docs/design.md, "Batching").
CREATE TABLE gpuq.batch_policies (
    kind        text PRIMARY KEY CONSTRAINT batch_policies_kind_check CHECK (kind ~ '^[A-Za-z0-9_.:/-]+$' AND length(kind) <= 128),
    max_items   int NOT NULL CONSTRAINT batch_policies_items_check CHECK (max_items BETWEEN 1 AND 4096),
    max_wait_ms int NOT NULL DEFAULT 0 CONSTRAINT batch_policies_wait_check CHECK (max_wait_ms BETWEEN 0 AND 3600000),
    max_cost    bigint CONSTRAINT batch_policies_cost_check CHECK (max_cost > 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- A job's share of a batch's max_cost (tokens, pixels: any whole number),
-- and the key that keeps unlike jobs apart (a sequence-length bucket, say).
-- Both NULL for jobs that say nothing: adding them rewrites nothing, and
-- NOT VALID skips a scan of the rows that exist (all NULL); new rows are
-- checked.
-- batch_id and batch_size: the batch its latest attempt ran in (named by
-- the id of its first job) and how many jobs it held; NULL: it ran alone.
ALTER TABLE gpuq.jobs ADD COLUMN cost bigint, ADD COLUMN batch_key text,
                      ADD COLUMN batch_id bigint, ADD COLUMN batch_size int;
ALTER TABLE gpuq.jobs ADD CONSTRAINT jobs_cost_check CHECK (cost >= 0) NOT VALID;
ALTER TABLE gpuq.jobs ADD CONSTRAINT jobs_batch_key_check CHECK (length(batch_key) BETWEEN 1 AND 200) NOT VALID;
