-- Preemption (issue #33): jobs that may be asked to yield, and go back to
-- pending without counting the attempt (docs/design.md, "Preemption").
--
--   preemptible      may be asked to yield (false: runs to its end, as before)
--   grace_seconds    how long it has, once asked, before its agent stops it
--   max_preemptions  how many times it may be preempted; then it runs to its end
--   preemptions      how many times it was (counted as it goes back to pending)
--   preempt_at       when it was last asked to yield, while it runs (NULL: not)
--
-- Constant defaults: adding the columns rewrites nothing. No CHECK here: the
-- lease and the outcome update every row, and PostgreSQL evaluates every
-- CHECK on every UPDATE (see 0014); the placement trigger checks the values
-- of a preemptible job, the only one that uses them.
ALTER TABLE gpuq.jobs
    ADD COLUMN preemptible boolean NOT NULL DEFAULT false,
    ADD COLUMN grace_seconds float8 NOT NULL DEFAULT 30,
    ADD COLUMN max_preemptions integer NOT NULL DEFAULT 10,
    ADD COLUMN preemptions integer NOT NULL DEFAULT 0,
    ADD COLUMN preempt_at timestamptz;

-- A preemptible job is a placed job: its own shape, so that only agents that
-- speak protocol 9 (and can yield) are given it. A job that is not
-- preemptible keeps the shape (and the md5) it had before.
ALTER TABLE gpuq.shapes ADD COLUMN preemptible boolean NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION gpuq.set_shape() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    sorted text[];
    computed text;
BEGIN
    IF NEW.gpus NOT BETWEEN 0 AND 64 THEN
        PERFORM gpuq.placement_violation('jobs_gpus_check', format('gpus must be 0 to 64, not %s', NEW.gpus));
    END IF;
    IF NEW.gpu_memory_mb IS NOT NULL AND NOT (NEW.gpu_memory_mb > 0 AND NEW.gpus > 0) THEN
        PERFORM gpuq.placement_violation('jobs_gpu_memory_check',
            format('gpu_memory_mb must be positive, with gpus > 0 (got %s MiB, %s GPUs)', NEW.gpu_memory_mb, NEW.gpus));
    END IF;
    IF NOT (NEW.labels = '{}' OR coalesce(gpuq.valid_labels(NEW.labels), false)) THEN
        PERFORM gpuq.placement_violation('jobs_labels_check', format(
            'labels must be at most 16 of [A-Za-z0-9_.:/=@+-]{1,128}, not %s', NEW.labels));
    END IF;
    IF NEW.model IS NOT NULL AND NOT (length(NEW.model) BETWEEN 1 AND 256 AND NEW.model ~ '^[A-Za-z0-9_.:/=@+-]+$') THEN
        PERFORM gpuq.placement_violation('jobs_model_check',
            format('model must be 1 to 256 of [A-Za-z0-9_.:/=@+-], not %L', NEW.model));
    END IF;
    IF NEW.concurrency_key IS NOT NULL AND length(NEW.concurrency_key) NOT BETWEEN 1 AND 256 THEN
        PERFORM gpuq.placement_violation('jobs_concurrency_key_check',
            format('concurrency_key must be 1 to 256 characters, not %L', NEW.concurrency_key));
    END IF;
    IF NEW.preemptible AND NOT (NEW.grace_seconds > 0 AND NEW.grace_seconds <= 86400) THEN
        PERFORM gpuq.placement_violation('jobs_grace_seconds_check',
            format('grace_seconds must be above 0 and at most 86400, not %s', NEW.grace_seconds));
    END IF;
    IF NEW.preemptible AND NEW.max_preemptions < 0 THEN
        PERFORM gpuq.placement_violation('jobs_max_preemptions_check',
            format('max_preemptions must not be negative, not %s', NEW.max_preemptions));
    END IF;
    IF NOT (NEW.gpus = 0 AND NEW.gpu_memory_mb IS NULL AND NEW.labels = '{}' AND NEW.model IS NULL
            AND NEW.concurrency_key IS NULL AND NOT NEW.preemptible) THEN
        sorted := ARRAY(SELECT DISTINCT l FROM unnest(NEW.labels) AS l ORDER BY l);
        -- concat_ws skips the NULL of a job that is not preemptible: its md5 is 0014's.
        computed := md5(concat_ws('/', NEW.gpus, NEW.gpu_memory_mb, array_to_string(sorted, ','), NEW.model,
                                  NEW.concurrency_key IS NOT NULL,
                                  CASE WHEN NEW.preemptible THEN 'preemptible' END));
    END IF;  -- else a plain job (or an update took its requirements away): no shape
    -- Set by hand (an insert's OLD is NULL), not a value an update left stale.
    IF NEW.shape IS DISTINCT FROM computed AND NEW.shape IS DISTINCT FROM OLD.shape THEN
        PERFORM gpuq.placement_violation('jobs_shape_check', 'shape is set by gpuq from the requirements');
    END IF;
    NEW.shape := computed;
    IF computed IS NOT NULL THEN
        INSERT INTO gpuq.shapes (kind, shape, gpus, gpu_memory_mb, labels, model, keyed, preemptible)
        VALUES (NEW.kind, computed, NEW.gpus, NEW.gpu_memory_mb, sorted, NEW.model, NEW.concurrency_key IS NOT NULL,
                NEW.preemptible)
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER jobs_set_shape ON gpuq.jobs;
DROP TRIGGER jobs_reset_shape ON gpuq.jobs;
CREATE TRIGGER jobs_set_shape
    BEFORE INSERT ON gpuq.jobs
    FOR EACH ROW
    WHEN (NEW.gpus <> 0 OR NEW.gpu_memory_mb IS NOT NULL OR NEW.labels <> '{}' OR NEW.model IS NOT NULL
          OR NEW.concurrency_key IS NOT NULL OR NEW.shape IS NOT NULL OR NEW.preemptible)
    EXECUTE FUNCTION gpuq.set_shape();
CREATE TRIGGER jobs_reset_shape
    BEFORE UPDATE OF kind, gpus, gpu_memory_mb, labels, model, concurrency_key, shape, preemptible, grace_seconds,
                     max_preemptions ON gpuq.jobs
    FOR EACH ROW EXECUTE FUNCTION gpuq.set_shape();

-- Preempt from plain SQL: SELECT * FROM gpuq.preempt(ARRAY[41, 42]);
-- Of the given jobs, those running (leased), preemptible, with preemptions
-- left and not already asked within their grace time are asked to yield:
-- preempt_at is set, and the dispatchers are told ('preempt:GRACE:ID,...' on
-- gpuq_jobs, one notification per grace time and 300 ids) so that the one
-- holding each job sends 'preempt' to its agent. Nothing else changes: the
-- job runs on until its agent reports it (preempted: back to pending, the
-- attempt not counted; or its real outcome, if it finished first).
-- Returns each job asked and its grace time.
CREATE FUNCTION gpuq.preempt(ids bigint[]) RETURNS TABLE (id bigint, grace_seconds float8)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    asked bigint[];
    got bigint[] := '{}';
    graces float8[] := '{}';
BEGIN
    FOR r IN
        WITH live AS (
            SELECT j.id FROM gpuq.jobs j
            WHERE j.id = ANY(ids) AND j.status = 'leased' AND j.preemptible
              AND j.preemptions < j.max_preemptions
              AND (j.preempt_at IS NULL OR j.preempt_at <= now() - make_interval(secs => j.grace_seconds))
            FOR UPDATE
        )
        UPDATE gpuq.jobs j SET preempt_at = now()
        FROM live WHERE j.id = live.id
        RETURNING j.id AS job_id, j.grace_seconds AS grace
    LOOP
        id := r.job_id;
        grace_seconds := r.grace;
        RETURN NEXT;
        got := got || r.job_id;
        graces := graces || r.grace;
    END LOOP;
    FOR r IN
        SELECT u.grace, array_agg(u.job_id ORDER BY u.job_id) AS jobs
        FROM unnest(got, graces) AS u(job_id, grace) GROUP BY u.grace
    LOOP
        asked := r.jobs;
        WHILE cardinality(asked) > 0 LOOP
            PERFORM pg_notify('gpuq_jobs', 'preempt:' || r.grace || ':' || array_to_string(asked[1:300], ','));
            asked := asked[301:];
        END LOOP;
    END LOOP;
END
$$;
