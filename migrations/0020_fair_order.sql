-- Fair share between tenants (issue #32), second part: the lease order
-- (docs/design.md, "Fair share: the lease order").
--
-- Plain pending jobs by kind, then tenant (NULL: the default tenant, last),
-- then the lease order within a tenant. While fair share is on, the lease reads
-- each chosen tenant's next jobs of a kind with one descent, and finds the
-- tenants with work with a loose scan: one descent per (kind, tenant) with
-- jobs pending. Never history: done, dead and leased rows have no entry.
CREATE INDEX jobs_fair_idx ON gpuq.jobs (kind, tenant, (-priority), id) WHERE status = 'pending' AND shape IS NULL;
-- The same for placed jobs, by kind and shape first.
CREATE INDEX jobs_fair_placed_idx ON gpuq.jobs (kind, shape, tenant, (-priority), id)
    WHERE status = 'pending' AND shape IS NOT NULL;
-- These two serve every read of pending jobs by tenant: the tenant index of
-- 0019 goes. Left, the planner could read a tenant's next jobs from it
-- (every pending job of the tenant, then a sort): O(its backlog) a lease, as
-- it did at 1,000,000 done rows in `gpuq bench lease-history`.
DROP INDEX gpuq.jobs_tenant_pending_idx;

-- How many attempts a tenant's usage came from (decayed like it): usage ÷
-- attempts is what the tenant's next job is expected to charge. And the usage
-- it counts as having at least (decayed like it): a tenant that comes back
-- from idle is lifted to the least busy tenant's, so it cannot bank credit.
ALTER TABLE gpuq.tenant_usage ADD COLUMN attempts float8 NOT NULL DEFAULT 0;
ALTER TABLE gpuq.tenant_usage ADD COLUMN usage_floor float8 NOT NULL DEFAULT 0;

-- Every (kind, tenant) with plain jobs pending (tenant NULL: the default
-- tenant), by a loose scan of jobs_fair_idx: a descent per kind, then one
-- per tenant of each kind. O(pairs with work), never history.
CREATE FUNCTION gpuq.tenants_waiting() RETURNS TABLE (kind text, tenant text)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE kinds AS (
        (SELECT j.kind FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NULL ORDER BY j.kind LIMIT 1)
        UNION ALL
        SELECT n.kind FROM kinds k CROSS JOIN LATERAL (
            SELECT j.kind FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NULL AND j.kind > k.kind
            ORDER BY j.kind LIMIT 1) AS n
    ), named AS (
        SELECT k.kind, f.tenant FROM kinds k CROSS JOIN LATERAL (
            SELECT j.tenant FROM gpuq.jobs j
            WHERE j.status = 'pending' AND j.shape IS NULL AND j.kind = k.kind AND j.tenant IS NOT NULL
            ORDER BY j.tenant LIMIT 1) AS f
        UNION ALL
        SELECT t.kind, n.tenant FROM named t CROSS JOIN LATERAL (
            SELECT j.tenant FROM gpuq.jobs j
            WHERE j.status = 'pending' AND j.shape IS NULL AND j.kind = t.kind AND j.tenant > t.tenant
            ORDER BY j.tenant LIMIT 1) AS n
    )
    SELECT kind, tenant FROM named
    UNION ALL
    SELECT k.kind, NULL FROM kinds k
    WHERE EXISTS (SELECT 1 FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NULL AND j.kind = k.kind
                  AND j.tenant IS NULL)
$$;

-- What an attempt charges when its run time is known (the agent told when its
-- handler started: a prefetched job's wait in the agent is not run time),
-- else since its lease; times its GPUs, shared by the jobs of its batch.
CREATE FUNCTION gpuq.gpu_seconds(started timestamptz, ended timestamptz, gpus int, batch_size int, ran float8)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN ran IS NULL THEN gpuq.gpu_seconds(started, ended, gpus, batch_size)
                ELSE greatest(0, ran) * greatest(gpus, 1) / greatest(coalesce(batch_size, 1), 1) END
$$;

-- Every (kind, shape, tenant) with placed jobs pending (tenant NULL: the
-- default tenant), by a loose scan of jobs_fair_placed_idx for each shape ever
-- enqueued (gpuq.shapes: a few rows). O(shapes + triples with work).
CREATE FUNCTION gpuq.tenants_waiting_placed() RETURNS TABLE (kind text, shape text, tenant text)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE named AS (
        SELECT s.kind, s.shape, f.tenant FROM gpuq.shapes s CROSS JOIN LATERAL (
            SELECT j.tenant FROM gpuq.jobs j
            WHERE j.status = 'pending' AND j.shape IS NOT NULL AND j.kind = s.kind AND j.shape = s.shape
              AND j.tenant IS NOT NULL
            ORDER BY j.tenant LIMIT 1) AS f
        UNION ALL
        SELECT t.kind, t.shape, n.tenant FROM named t CROSS JOIN LATERAL (
            SELECT j.tenant FROM gpuq.jobs j
            WHERE j.status = 'pending' AND j.shape IS NOT NULL AND j.kind = t.kind AND j.shape = t.shape
              AND j.tenant > t.tenant
            ORDER BY j.tenant LIMIT 1) AS n
    )
    SELECT kind, shape, tenant FROM named
    UNION ALL
    SELECT s.kind, s.shape, NULL FROM gpuq.shapes s
    WHERE EXISTS (SELECT 1 FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NOT NULL AND j.kind = s.kind
                  AND j.shape = s.shape AND j.tenant IS NULL)
$$;
