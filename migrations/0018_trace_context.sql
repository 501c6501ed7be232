-- The producer's trace (issue #34, the optional extra gpuq[otel]).
--
-- gpuq.enqueue called with a span active stores that trace's W3C context
-- with the job: traceparent, and tracestate when the trace has one. The
-- server's lease and completion spans and the agent's handler span are
-- children of it (docs/design.md, "Tracing"). Both NULL for a job enqueued
-- with no span active and for a plain INSERT: adding them rewrites nothing,
-- and NOT VALID skips a scan of the rows that exist (all NULL); new rows are
-- checked, so a traceparent is always one the server may splice into a push
-- as it is (version 00: hex and dashes).
ALTER TABLE gpuq.jobs ADD COLUMN traceparent text, ADD COLUMN tracestate text;
ALTER TABLE gpuq.jobs ADD CONSTRAINT jobs_traceparent_check
    CHECK (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$') NOT VALID;
ALTER TABLE gpuq.jobs ADD CONSTRAINT jobs_tracestate_check CHECK (length(tracestate) <= 512) NOT VALID;
