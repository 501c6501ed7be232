-- Issue #30: the writers of gpuq.jobs (insert_horizon, arm_wakeups) cost a
-- fifth of what they did. The dispatcher asks for them up to every 10 ms while
-- jobs arrive (`Tuning.settle_seconds`), and 0005's SQL function spent most of
-- its time being planned again at every call (a SQL function that is not
-- inlined keeps its plan for one call only) and read the lock table twice.
-- PL/pgSQL keeps the plan for the session; the lock table is copied once
-- (pg_locks builds every row of it on each read). Same result as 0005's.
CREATE OR REPLACE FUNCTION gpuq.jobs_writers() RETURNS text[]
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN (
        WITH l AS MATERIALIZED (SELECT locktype, database, relation, mode, pid, transactionid FROM pg_locks)
        SELECT coalesce(array_agg(DISTINCT x.transactionid::text), '{}')
        FROM l r
        JOIN l x ON x.pid = r.pid AND x.locktype = 'transactionid'
        WHERE r.locktype = 'relation' AND r.relation = 'gpuq.jobs'::regclass
          AND r.mode = 'RowExclusiveLock' AND r.pid <> pg_backend_pid()
          AND r.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    );
END
$$;
