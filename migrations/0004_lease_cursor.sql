-- The insert trigger's NOTIFY names each kind with the highest priority it
-- inserted ("kind@priority", comma-separated; '*' past NOTIFY's limit), so a
-- dispatcher whose lease cursor has passed that priority knows to start that
-- kind from the top again (docs/design.md, "Lease cursors"). Still one NOTIFY
-- per statement, only for pending rows.
CREATE OR REPLACE FUNCTION gpuq.notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    kinds text;
BEGIN
    SELECT string_agg(kind || '@' || top, ',') INTO kinds
    FROM (SELECT kind, max(priority) AS top FROM inserted WHERE status = 'pending' GROUP BY kind) AS k;
    IF kinds IS NOT NULL THEN
        PERFORM pg_notify('gpuq_jobs', CASE WHEN length(kinds) > 7000 THEN '*' ELSE kinds END);
    END IF;
    RETURN NULL;
END
$$;

-- The pending index in the lease's order as one ascending key, (kind,
-- -priority, id), so a lease can start just past where the previous one ended
-- with a row comparison, (kind, -priority, id) > (kind, rank, id), instead of
-- walking the entries earlier leases left dead at the front (which an old
-- snapshot keeps alive). The index holds only pending rows, so the rebuild
-- reads the table once and writes a small index; writers wait for it.
DROP INDEX gpuq.jobs_pending_idx;
CREATE INDEX jobs_pending_idx ON gpuq.jobs (kind, (-priority), id) WHERE status = 'pending';
