-- GPU placement (issue #16): what a job needs, as columns plain SQL can set,
-- with defaults that keep a job plain (any agent of its kind may run it):
--   gpus             devices the job takes on one agent (0: none, CPU work)
--   gpu_memory_mb    the least memory each of those devices must have
--   labels           labels the agent must have, all of them (gpu=h100)
--   model            the model it would rather find warm (a preference)
--   concurrency_key  what global limits count it under (a tenant, an API)
-- Bad values fail the INSERT, never leave a job that can never run.
CREATE FUNCTION gpuq.valid_labels(labels text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT cardinality(labels) <= 16 AND array_ndims(labels) = 1 AND array_position(labels, NULL) IS NULL
       AND coalesce(bool_and(l ~ '^[A-Za-z0-9_.:/=@+-]{1,128}$'), true)
    FROM unnest(labels) AS l
$$;

ALTER TABLE gpuq.jobs
    ADD COLUMN gpus smallint NOT NULL DEFAULT 0
        CONSTRAINT jobs_gpus_check CHECK (gpus BETWEEN 0 AND 64),
    ADD COLUMN gpu_memory_mb int
        CONSTRAINT jobs_gpu_memory_check CHECK (gpu_memory_mb IS NULL OR (gpu_memory_mb > 0 AND gpus > 0)),
    ADD COLUMN labels text[] NOT NULL DEFAULT '{}'
        CONSTRAINT jobs_labels_check CHECK (labels = '{}' OR gpuq.valid_labels(labels)),
    ADD COLUMN model text
        CONSTRAINT jobs_model_check CHECK (length(model) BETWEEN 1 AND 256 AND model ~ '^[A-Za-z0-9_.:/=@+-]+$'),
    ADD COLUMN concurrency_key text
        CONSTRAINT jobs_concurrency_key_check CHECK (length(concurrency_key) BETWEEN 1 AND 256),
    -- NULL for a plain job; else its placement class, md5 of the requirements
    -- (set by the trigger below): jobs of one kind and shape are interchangeable
    -- to the dispatcher, and gpuq.shapes says what the shape needs.
    ADD COLUMN shape text,
    ADD CONSTRAINT jobs_shape_check CHECK ((shape IS NULL) = (gpus = 0 AND gpu_memory_mb IS NULL AND labels = '{}'
                                                             AND model IS NULL AND concurrency_key IS NULL));

-- One row per kind and shape ever enqueued: how the dispatchers learn what
-- placed work exists without reading jobs (a handful of rows).
CREATE TABLE gpuq.shapes (
    kind            text NOT NULL,
    shape           text NOT NULL,
    gpus            smallint NOT NULL,
    gpu_memory_mb   int,
    labels          text[] NOT NULL,
    model           text,
    keyed           boolean NOT NULL,  -- its jobs have a concurrency key
    PRIMARY KEY (kind, shape)
);

-- Only an insert with a requirement runs this (the WHEN condition): a plain
-- insert pays one cheap test. An update of a requirement always does.
CREATE FUNCTION gpuq.set_shape() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    sorted text[] := ARRAY(SELECT DISTINCT l FROM unnest(NEW.labels) AS l ORDER BY l);
BEGIN
    IF NEW.gpus = 0 AND NEW.gpu_memory_mb IS NULL AND NEW.labels = '{}' AND NEW.model IS NULL
       AND NEW.concurrency_key IS NULL THEN
        NEW.shape := NULL;  -- an update took its requirements away
        RETURN NEW;
    END IF;
    NEW.shape := md5(concat_ws('/', NEW.gpus, NEW.gpu_memory_mb, array_to_string(sorted, ','), NEW.model,
                               NEW.concurrency_key IS NOT NULL));
    INSERT INTO gpuq.shapes (kind, shape, gpus, gpu_memory_mb, labels, model, keyed)
    VALUES (NEW.kind, NEW.shape, NEW.gpus, NEW.gpu_memory_mb, sorted, NEW.model, NEW.concurrency_key IS NOT NULL)
    ON CONFLICT DO NOTHING;
    RETURN NEW;
END
$$;

CREATE TRIGGER jobs_set_shape
    BEFORE INSERT ON gpuq.jobs
    FOR EACH ROW
    WHEN (NEW.gpus <> 0 OR NEW.gpu_memory_mb IS NOT NULL OR NEW.labels <> '{}' OR NEW.model IS NOT NULL
          OR NEW.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION gpuq.set_shape();
CREATE TRIGGER jobs_reset_shape
    BEFORE UPDATE OF kind, gpus, gpu_memory_mb, labels, model, concurrency_key ON gpuq.jobs
    FOR EACH ROW EXECUTE FUNCTION gpuq.set_shape();

-- Plain and placed pending jobs in separate indexes: a plain lease never
-- reads a placed job, however many wait for an agent that is not there, and
-- a placed lease reads only its kind and shape. Both hold pending rows only,
-- so the rebuild reads the table once; writers wait for it (as with 0004).
DROP INDEX gpuq.jobs_pending_idx;
CREATE INDEX jobs_pending_idx ON gpuq.jobs (kind, (-priority), id) WHERE status = 'pending' AND shape IS NULL;
CREATE INDEX jobs_placed_idx ON gpuq.jobs (kind, shape, priority DESC, id)
    WHERE status = 'pending' AND shape IS NOT NULL;
