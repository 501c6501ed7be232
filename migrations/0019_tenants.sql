-- Fair share between tenants (issue #32), first part: tenants, weights, and
-- usage in GPU-seconds (docs/design.md, "Fair share").
--
-- A job's tenant: NULL is the default tenant, shown and addressed as
-- 'default' (a job may also name it). Adding a nullable column without a
-- default rewrites nothing, and NOT VALID skips a scan of the rows that exist
-- (all NULL); new rows are checked. The rule is the kind's (gpuq.kinds).
ALTER TABLE gpuq.jobs ADD COLUMN tenant text;
ALTER TABLE gpuq.jobs ADD CONSTRAINT jobs_tenant_check
    CHECK (tenant ~ '^[A-Za-z0-9_.:/-]+$' AND length(tenant) <= 128) NOT VALID;

-- Pending jobs of named tenants, by tenant: the backlog per tenant is a few
-- index probes. Jobs without a tenant have no entry and pay nothing for it.
CREATE INDEX jobs_tenant_pending_idx ON gpuq.jobs (tenant) WHERE status = 'pending' AND tenant IS NOT NULL;

-- The weights. Fair share is on while this table has a row (for now it is
-- only reported: usage is charged and shown; the lease order comes next). A
-- tenant without a row weighs 1.
CREATE TABLE gpuq.tenants (
    name       text PRIMARY KEY CONSTRAINT tenants_name_check CHECK (name ~ '^[A-Za-z0-9_.:/-]+$' AND length(name) <= 128),
    weight     float8 NOT NULL CONSTRAINT tenants_weight_check CHECK (weight > 0 AND weight <= 1000000),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Each tenant's GPU-seconds, decayed, as of usage_at ('default' for jobs
-- without a tenant). Written only while fair share is on, by the statements
-- that end attempts (one upsert per statement, not per job).
CREATE TABLE gpuq.tenant_usage (
    tenant   text PRIMARY KEY,
    usage    float8 NOT NULL DEFAULT 0,
    usage_at timestamptz NOT NULL DEFAULT now()
);

-- One row: how fast usage is forgotten, the same for every server.
CREATE TABLE gpuq.fair_share_settings (
    id                boolean PRIMARY KEY DEFAULT true CONSTRAINT fair_share_settings_one_row CHECK (id),
    half_life_seconds float8 NOT NULL DEFAULT 3600
        CONSTRAINT fair_share_half_life_check CHECK (half_life_seconds >= 1 AND half_life_seconds <= 1000000000)
);
INSERT INTO gpuq.fair_share_settings DEFAULT VALUES;

-- What an attempt charges: its run time times its GPUs (1 slot for a CPU
-- job), shared by the jobs of its batch (a batch runs in one slot).
CREATE FUNCTION gpuq.gpu_seconds(started timestamptz, ended timestamptz, gpus int, batch_size int)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(greatest(0, extract(epoch FROM ended - started))::float8, 0)
           * greatest(gpus, 1) / greatest(coalesce(batch_size, 1), 1)
$$;

-- The half-life in force (the settings row, or its default should it be gone).
CREATE FUNCTION gpuq.half_life() RETURNS float8 LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT half_life_seconds FROM gpuq.fair_share_settings), 3600)
$$;

-- Usage as of usage_at, decayed to now: halved every half_life seconds.
-- Snapped to 0 past 60 half-lives or below a nanosecond, so the product never
-- underflows (an error here would refuse the outcome that charges it). One
-- expression: the planner inlines it; statements pass (SELECT gpuq.half_life()),
-- read once.
CREATE FUNCTION gpuq.decayed(usage float8, usage_at timestamptz, half_life float8)
RETURNS float8 LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN usage < 1e-9 OR greatest(0, extract(epoch FROM now() - usage_at))::float8 / half_life > 60
                THEN 0::float8
                ELSE usage * power(2::float8, -greatest(0, extract(epoch FROM now() - usage_at))::float8 / half_life)
           END
$$;
