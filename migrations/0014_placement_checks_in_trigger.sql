-- The placement columns' rules move from CHECK constraints to the placement
-- trigger. PostgreSQL evaluates every CHECK on every UPDATE of a row, and the
-- lease and the outcome update every job twice: the six checks of 0012 cost
-- plain jobs ~8 % of the lease+complete loop (docs/benchmarks.md, issue #16).
-- The trigger runs only when a placement column is set (an insert that is
-- not plain, or an update of one of them), and raises the same errors: SQLSTATE
-- 23514 check_violation, the old constraint's name, and what is wrong.
ALTER TABLE gpuq.jobs
    DROP CONSTRAINT jobs_gpus_check,
    DROP CONSTRAINT jobs_gpu_memory_check,
    DROP CONSTRAINT jobs_labels_check,
    DROP CONSTRAINT jobs_model_check,
    DROP CONSTRAINT jobs_concurrency_key_check,
    DROP CONSTRAINT jobs_shape_check;

CREATE FUNCTION gpuq.placement_violation(rule text, message text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', MESSAGE = 'gpuq.jobs: ' || message,
        CONSTRAINT = rule, SCHEMA = 'gpuq', TABLE = 'jobs';
END
$$;

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
    IF NOT (NEW.gpus = 0 AND NEW.gpu_memory_mb IS NULL AND NEW.labels = '{}' AND NEW.model IS NULL
            AND NEW.concurrency_key IS NULL) THEN
        sorted := ARRAY(SELECT DISTINCT l FROM unnest(NEW.labels) AS l ORDER BY l);
        computed := md5(concat_ws('/', NEW.gpus, NEW.gpu_memory_mb, array_to_string(sorted, ','), NEW.model,
                               NEW.concurrency_key IS NOT NULL));
    END IF;  -- else a plain job (or an update took its requirements away): no shape
    -- Set by hand (an insert's OLD is NULL), not a value an update left stale.
    IF NEW.shape IS DISTINCT FROM computed AND NEW.shape IS DISTINCT FROM OLD.shape THEN
        PERFORM gpuq.placement_violation('jobs_shape_check', 'shape is set by gpuq from the requirements');
    END IF;
    NEW.shape := computed;
    IF computed IS NOT NULL THEN
        INSERT INTO gpuq.shapes (kind, shape, gpus, gpu_memory_mb, labels, model, keyed)
        VALUES (NEW.kind, computed, NEW.gpus, NEW.gpu_memory_mb, sorted, NEW.model, NEW.concurrency_key IS NOT NULL)
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN NEW;
END
$$;

-- An insert runs it only when it sets a placement column (a plain insert pays
-- the WHEN test alone); an update, when it names one.
DROP TRIGGER jobs_set_shape ON gpuq.jobs;
DROP TRIGGER jobs_reset_shape ON gpuq.jobs;
CREATE TRIGGER jobs_set_shape
    BEFORE INSERT ON gpuq.jobs
    FOR EACH ROW
    WHEN (NEW.gpus <> 0 OR NEW.gpu_memory_mb IS NOT NULL OR NEW.labels <> '{}' OR NEW.model IS NOT NULL
          OR NEW.concurrency_key IS NOT NULL OR NEW.shape IS NOT NULL)
    EXECUTE FUNCTION gpuq.set_shape();
CREATE TRIGGER jobs_reset_shape
    BEFORE UPDATE OF kind, gpus, gpu_memory_mb, labels, model, concurrency_key, shape ON gpuq.jobs
    FOR EACH ROW EXECUTE FUNCTION gpuq.set_shape();
