-- Cancel from plain SQL, any language: SELECT * FROM gpuq.cancel(ARRAY[41, 42]);
-- Pending, scheduled and leased jobs end 'cancelled' and are not retried. A
-- leased job's lease token is cleared, so its agent's late outcome is fenced
-- out like any stale result. Returns each job cancelled and the state it left.
CREATE FUNCTION gpuq.cancel(ids bigint[]) RETURNS TABLE (id bigint, was gpuq.job_status)
LANGUAGE sql AS $$
    WITH live AS (
        SELECT j.id, j.status FROM gpuq.jobs j
        WHERE j.id = ANY(ids) AND j.status IN ('pending', 'scheduled', 'leased')
        FOR UPDATE
    )
    UPDATE gpuq.jobs j
    SET status = 'cancelled', last_error = 'cancelled', finished_at = now(),
        lease_token = NULL, lease_expires_at = NULL
    FROM live
    WHERE j.id = live.id
    RETURNING j.id, live.status
$$;
