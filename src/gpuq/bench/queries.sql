-- The benches' own SQL, by name (same format as src/gpuq/sql/queries.sql).
-- None of it runs in gpuq serve: these fill tables, watch progress, and judge.

-- name: server_settings
-- The PostgreSQL settings every bench reports with its figures.
SELECT name, setting, unit FROM pg_settings WHERE name = ANY($1::text[]);

-- name: data_directory
-- Where the server keeps postmaster.pid (to find its pid when it runs here).
SELECT setting FROM pg_settings WHERE name = 'data_directory';

-- name: drop_schema
-- Drop the gpuq schema and every job in it (a bench starts from nothing).
DROP SCHEMA IF EXISTS gpuq CASCADE;

-- name: insert_pending
-- $2 pending jobs of kind $1 in one statement.
INSERT INTO gpuq.jobs (kind, payload)
SELECT $1, jsonb_build_object('i', g) FROM generate_series(1, $2::int) AS g;

-- name: insert_pending_tenants
-- $2 pending jobs of kind $1 in one statement, of $3 tenants in turn (t0, t1, ...).
INSERT INTO gpuq.jobs (kind, payload, tenant)
SELECT $1, jsonb_build_object('i', g), 't' || (g % $3) FROM generate_series(1, $2::int) AS g;

-- name: insert_done
-- Finished rows $1..$2 as the queue leaves them (md5 stands in for a lease token: far cheaper than gen_random_uuid()).
INSERT INTO gpuq.jobs (kind, payload, status, attempts, started_at, finished_at,
                       leased_by, lease_token, result)
SELECT 'train', jsonb_build_object('i', g), 'done', 1, now(), now(),
       'bench#1', md5(g::text)::uuid, '{"ok": true}'::jsonb
FROM generate_series($1::bigint, $2::bigint) AS g;

-- name: insert_sequence
-- Jobs of kind $1 numbered $2.. ($4 of them) with $3 attempts each, preemptible if $5 (1 s of grace, preempted up to 1000 times): the chaos producer.
INSERT INTO gpuq.jobs (kind, payload, max_attempts, preemptible, grace_seconds, max_preemptions)
SELECT $1, jsonb_build_object('seq', g), $3, $5, 1, 1000 FROM generate_series($2::bigint, $2::bigint + $4 - 1) AS g;

-- name: preempt_some
-- Chaos with preemption: ask up to $1 running jobs, picked at random, to yield (gpuq.preempt); the ids asked.
SELECT id FROM gpuq.preempt(ARRAY(SELECT id FROM gpuq.jobs WHERE status = 'leased' ORDER BY random() LIMIT $1));

-- name: count_all
-- Every job (a bench's table holds only its own).
SELECT count(*) FROM gpuq.jobs;

-- name: count_done
-- Jobs done.
SELECT count(*) FROM gpuq.jobs WHERE status = 'done';

-- name: count_live
-- Jobs pending, leased or scheduled, each state from its partial index.
SELECT (SELECT count(*) FROM gpuq.jobs WHERE status = 'pending' AND shape IS NULL)
     + (SELECT count(*) FROM gpuq.jobs WHERE status = 'pending' AND shape IS NOT NULL)
     + (SELECT count(*) FROM gpuq.jobs WHERE status = 'leased')
     + (SELECT count(*) FROM gpuq.jobs WHERE status = 'scheduled');

-- name: live_by_state
-- Live jobs by state.
SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'leased') AS leased,
       count(*) FILTER (WHERE status = 'scheduled') AS scheduled
FROM gpuq.jobs WHERE status IN ('pending', 'leased', 'scheduled');

-- name: any_live
-- Whether any job is live: polled while agents work, so it must cost next to nothing.
SELECT EXISTS (SELECT 1 FROM gpuq.jobs WHERE status = 'pending' AND shape IS NULL)
    OR EXISTS (SELECT 1 FROM gpuq.jobs WHERE status = 'pending' AND shape IS NOT NULL)
    OR EXISTS (SELECT 1 FROM gpuq.jobs WHERE status = 'leased')
    OR EXISTS (SELECT 1 FROM gpuq.jobs WHERE status = 'scheduled');

-- name: end_to_end
-- First insert to last result committed, by the database's own clocks, and who did the work.
SELECT extract(epoch FROM max(finished_at) - min(created_at))::float8 AS seconds,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       count(DISTINCT split_part(leased_by, '#', 1)) AS agents_used
FROM gpuq.jobs;

-- name: latencies
-- The insert-to-handler latencies the latency handler stored, warm-up excluded.
SELECT (result->>'lat_ms')::float8 AS ms FROM gpuq.jobs
WHERE status = 'done' AND NOT coalesce((payload->>'warmup')::bool, false);

-- name: vacuum_jobs
-- Fresh statistics and visibility map before measuring.
VACUUM (ANALYZE) gpuq.jobs;

-- name: trigger_off
-- Every wake-up trigger off: a bulk load of history need not test them row by row.
ALTER TABLE gpuq.jobs DISABLE TRIGGER USER;

-- name: trigger_on
-- The wake-up triggers back on.
ALTER TABLE gpuq.jobs ENABLE TRIGGER USER;

-- name: naive_drop
-- Drop the naive design's copy.
DROP SCHEMA IF EXISTS gpuq_naive CASCADE;

-- name: naive_create
-- The naive design on the same rows in the same order: primary key, one status index, the CHECKs (NOT VALID: already checked).
CREATE SCHEMA gpuq_naive;
CREATE TABLE gpuq_naive.jobs AS SELECT * FROM gpuq.jobs;
ALTER TABLE gpuq_naive.jobs ADD PRIMARY KEY (id);
CREATE INDEX jobs_status_idx ON gpuq_naive.jobs (status);
DO $$
DECLARE c record;
BEGIN
    FOR c IN SELECT conname, pg_get_constraintdef(oid) AS def FROM pg_constraint
             WHERE conrelid = 'gpuq.jobs'::regclass AND contype = 'c'
    LOOP
        EXECUTE format('ALTER TABLE gpuq_naive.jobs ADD CONSTRAINT %I %s NOT VALID', c.conname, c.def);
    END LOOP;
END
$$;

-- name: vacuum_naive
-- Fresh statistics for the naive copy.
VACUUM (ANALYZE) gpuq_naive.jobs;

-- name: naive_lease
-- The naive lease: ORDER BY id over a plain status index, FOR UPDATE SKIP LOCKED.
WITH picked AS (
    SELECT id FROM gpuq_naive.jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE gpuq_naive.jobs j
SET status = 'leased', attempts = j.attempts + 1, lease_token = gen_random_uuid(),
    leased_by = $2, lease_expires_at = now() + make_interval(secs => $3), started_at = now()
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.kind, j.payload, j.attempts, j.max_attempts, j.lease_token, j.priority;

-- name: planner_defaults
-- The naive design runs with PostgreSQL's own planner settings, not gpuq's guards.
SET LOCAL enable_bitmapscan = on; SET LOCAL enable_seqscan = on; SET LOCAL plan_cache_mode = auto;

-- name: pin_pk_walk
-- The naive plan: no sort possible, so ORDER BY id walks the primary key.
SET LOCAL enable_sort = off;

-- name: witness_install
-- Chaos: a trigger records every UPDATE that leaves a job done (the transition, and any rewrite of a done row).
DROP SCHEMA IF EXISTS gpuq_chaos CASCADE;
CREATE SCHEMA gpuq_chaos;
CREATE TABLE gpuq_chaos.completions (
    job_id      bigint NOT NULL,
    old_status  text NOT NULL,
    lease_token uuid,
    result      jsonb,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION gpuq_chaos.record_completion() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO gpuq_chaos.completions (job_id, old_status, lease_token, result)
    VALUES (NEW.id, OLD.status::text, OLD.lease_token, NEW.result);
    RETURN NULL;
END
$$;
CREATE TRIGGER chaos_completions AFTER UPDATE ON gpuq.jobs
    FOR EACH ROW WHEN (NEW.status = 'done')
    EXECUTE FUNCTION gpuq_chaos.record_completion();

-- name: witness_uninstall
-- Chaos: stop recording (the witness table stays for the verdict).
DROP TRIGGER IF EXISTS chaos_completions ON gpuq.jobs;

-- name: witness_verdict
-- Chaos: jobs completed twice; done jobs whose result is not from the lease that completed them, or never seen done.
SELECT
    (SELECT count(*) FROM (SELECT job_id FROM gpuq_chaos.completions
                           GROUP BY job_id HAVING count(*) > 1) d) AS double_completed,
    (SELECT count(*) FROM gpuq.jobs j JOIN gpuq_chaos.completions c ON c.job_id = j.id
     WHERE j.status = 'done'
       AND (j.result->>'token' IS DISTINCT FROM c.lease_token::text
            OR c.result->>'token' IS DISTINCT FROM c.lease_token::text))
  + (SELECT count(*) FROM gpuq.jobs j WHERE j.status = 'done' AND NOT EXISTS
       (SELECT 1 FROM gpuq_chaos.completions c WHERE c.job_id = j.id)) AS wrong_result;

-- name: totals
-- Jobs inserted, done, dead, the most attempts any job took, the done jobs whose last attempt ran in a batch of more than one, and the preemptions counted.
SELECT count(*) AS inserted,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       coalesce(max(attempts), 0) AS max_attempts_seen,
       count(*) FILTER (WHERE status = 'done' AND batch_size > 1) AS done_in_batches,
       coalesce(sum(preemptions), 0)::int8 AS preemptions
FROM gpuq.jobs;

-- name: chaos_winners
-- Chaos: the lease that completed each job.
SELECT job_id, lease_token::text AS token FROM gpuq_chaos.completions;

-- name: chaos_dead_reasons
-- Chaos: why jobs went dead.
SELECT last_error, count(*) FROM gpuq.jobs WHERE status = 'dead' GROUP BY 1;

-- name: fuzz_victims
-- Fuzz: jobs the fuzzer must not be able to touch.
INSERT INTO gpuq.jobs (kind) SELECT 'victim' FROM generate_series(1, 30);

-- name: fuzz_snapshot
-- Fuzz: every field a forged frame could change.
SELECT id, status::text, attempts, lease_token, leased_by, result::text, last_error, lease_expires_at
FROM gpuq.jobs ORDER BY id;

-- name: fuzz_insert_one
-- Fuzz: one job for the healthy agent afterwards.
INSERT INTO gpuq.jobs (kind) VALUES ('healthy') RETURNING id;

-- name: fuzz_delete
-- Fuzz: remove that job again, so the snapshot comparison stays exact.
DELETE FROM gpuq.jobs WHERE id = $1;

-- name: pgqueuer_empty
-- pgqueuer: its queue table is empty (completion deletes the row and logs it in one statement).
SELECT NOT EXISTS (SELECT 1 FROM pgqueuer);

-- name: pgqueuer_end_to_end
-- pgqueuer: first queued to last successful, from its log table's timestamps.
SELECT extract(epoch FROM max(created) FILTER (WHERE status = 'successful')
                         - min(created) FILTER (WHERE status = 'queued'))::float8 AS seconds,
       count(*) FILTER (WHERE status = 'successful') AS done
FROM pgqueuer_log;

-- name: snapshot_begin
-- Open a REPEATABLE READ transaction: what a report, pg_dump or a forgotten psql session holds.
BEGIN ISOLATION LEVEL REPEATABLE READ;

-- name: snapshot_take
-- Take the snapshot (the first query of the transaction fixes it); from now on VACUUM keeps every row version it can see.
SELECT count(*) FROM gpuq.jobs WHERE false;

-- name: snapshot_end
-- Let the snapshot go.
ROLLBACK;

-- name: tail_rates
-- Jobs/s of the first and the last 20 % of the jobs, by the database's clocks.
WITH t AS (
    SELECT min(created_at) AS t0, max(finished_at) AS t100,
           percentile_disc(0.2) WITHIN GROUP (ORDER BY finished_at) AS t20,
           percentile_disc(0.8) WITHIN GROUP (ORDER BY finished_at) AS t80,
           count(*) AS n
    FROM gpuq.jobs WHERE status = 'done'
)
SELECT 0.2 * n / nullif(extract(epoch FROM t20 - t0), 0) AS first_jobs_per_s,
       0.2 * n / nullif(extract(epoch FROM t100 - t80), 0) AS last_jobs_per_s
FROM t;

-- name: insert_one
-- One job of kind $1: what a single-row producer commits.
INSERT INTO gpuq.jobs (kind) VALUES ($1);

-- name: failover_replication
-- Failover: the primary's standbys, streaming or not, synchronous or not.
SELECT state, sync_state FROM pg_stat_replication;

-- name: failover_fence
-- Failover, read-only fence: every new transaction of the old primary is read-only (applied by a reload).
ALTER SYSTEM SET default_transaction_read_only = on;

-- name: failover_reload
-- Failover: apply postgresql.auto.conf.
SELECT pg_reload_conf();

-- name: failover_terminate
-- Failover, read-only fence: end every client session (they reconnect and meet the fence).
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE backend_type = 'client backend' AND pid <> pg_backend_pid();

-- name: failover_leased
-- Failover: the jobs in flight, as the standby about to be promoted knows them.
SELECT id FROM gpuq.jobs WHERE status = 'leased';

-- name: failover_rows
-- Failover: every job of kind $1 as the new primary has it, for the verdict.
SELECT id, payload::text AS payload, status::text AS status, attempts, result::text AS result,
       extract(epoch FROM finished_at)::float8 AS finished
FROM gpuq.jobs WHERE kind = $1;
