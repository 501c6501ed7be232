-- Cancel from plain SQL, any language: SELECT * FROM gpuq.cancel(ARRAY[41, 42]);
-- Pending, scheduled and leased jobs end 'cancelled' and are not retried. A
-- leased job's lease token is cleared, so its agent's late outcome is fenced
-- out like any stale result, and the dispatchers are told ('cancel:ID,...' on
-- gpuq_jobs, at most 300 ids per notification) so that the one holding it
-- tells its agent to stop the handler; waiters are told on gpuq_outcomes.
-- Returns each job cancelled and the state it left.
CREATE FUNCTION gpuq.cancel(ids bigint[]) RETURNS TABLE (id bigint, was gpuq.job_status)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    running bigint[] := '{}';
    ended bigint[] := '{}';
BEGIN
    FOR r IN
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
        RETURNING j.id AS job_id, live.status AS previous
    LOOP
        id := r.job_id;
        was := r.previous;
        RETURN NEXT;
        ended := ended || r.job_id;
        IF r.previous = 'leased' THEN
            running := running || r.job_id;
        END IF;
    END LOOP;
    WHILE cardinality(running) > 0 LOOP
        PERFORM pg_notify('gpuq_jobs', 'cancel:' || array_to_string(running[1:300], ','));
        running := running[301:];
    END LOOP;
    WHILE cardinality(ended) > 0 LOOP  -- and whoever waits for them (gpuq.wait)
        PERFORM pg_notify('gpuq_outcomes', array_to_string(ended[1:300], ','));
        ended := ended[301:];
    END LOOP;
END
$$;
