-- Every runtime statement of gpuq, by name. The schema lives in migrations/.
--
-- Format: a block starts with `-- name: NAME`, then one line of description,
-- then the statement, written out in full so it can be pasted into psql as it
-- runs. gpuq.sql loads this file once; a statement's text never changes
-- between calls (asyncpg caches prepared statements by text).
--
-- Rules (docs/design.md explains each):
-- * Hot statements reach rows only through a partial index over a live status
--   (pending, leased, scheduled): O(rows returned), whatever the history.
-- * Outcomes, heartbeats and releases by id find their rows by primary key and
--   write their status test as `status::text = 'leased'`, so the planner
--   cannot pick jobs_leased_idx (see "by-id fences" in docs/design.md).
-- * Locked rows are updated by ctid: no primary-key descent per row.

-- name: enqueue_plain
-- Insert jobs from parallel arrays, in input order (placement arrays $9-$13 NULL: none; batching arrays $14-$15 NULL: none; tenants $16 NULL: the default; preemption arrays $19-$21 NULL: none preemptible), every one with the producer's trace $17, $18 (NULL: none); returns their ids in that order.
INSERT INTO gpuq.jobs (kind, payload, priority, max_attempts, run_at, status, timeout_seconds,
                       gpus, gpu_memory_mb, labels, model, concurrency_key, cost, batch_key, tenant,
                       traceparent, tracestate, preemptible, grace_seconds, max_preemptions)
SELECT kind, payload, priority, max_attempts, run_at,
       CASE WHEN run_at > now() THEN 'scheduled'::gpuq.job_status ELSE 'pending' END, timeout_seconds,
       coalesce(gpus, 0), gpu_memory_mb, coalesce(string_to_array(labels, ','), '{}'), model, concurrency_key,
       cost, batch_key, tenant, $17::text, $18::text,
       coalesce(preemptible, false), coalesce(grace_seconds, 30), coalesce(max_preemptions, 10)
FROM (
    SELECT kind, coalesce(payload::jsonb, '{}'::jsonb) AS payload, priority, max_attempts,
           coalesce(run_at, now() + make_interval(secs => delay)) AS run_at, timeout_seconds,
           gpus, gpu_memory_mb, labels, model, concurrency_key, cost, batch_key, tenant,
           preemptible, grace_seconds, max_preemptions, ord
    FROM unnest($1::text[], $2::text[], $3::smallint[], $4::int[], $5::timestamptz[],
                $6::float8[], $7::text[], $8::int[], $9::smallint[], $10::int[], $11::text[], $12::text[],
                $13::text[], $14::bigint[], $15::text[], $16::text[], $19::bool[], $20::float8[], $21::int[])
        WITH ORDINALITY AS t(kind, payload, priority, max_attempts, run_at, delay, dedup_key, timeout_seconds,
                             gpus, gpu_memory_mb, labels, model, concurrency_key, cost, batch_key, tenant,
                             preemptible, grace_seconds, max_preemptions, ord)
) AS input
ORDER BY ord
RETURNING id;

-- name: enqueue_dedup
-- Insert jobs with distinct dedup keys (arrays as enqueue_plain's, preemption $19-$21), with the producer's trace $17, $18 (NULL: none); a key with a live job gets that job's id (NULL if it committed after our snapshot).
WITH input AS (
    SELECT kind, coalesce(payload::jsonb, '{}'::jsonb) AS payload, priority, max_attempts,
           coalesce(run_at, now() + make_interval(secs => delay)) AS run_at, dedup_key, timeout_seconds,
           gpus, gpu_memory_mb, labels, model, concurrency_key, cost, batch_key, tenant,
           preemptible, grace_seconds, max_preemptions, ord
    FROM unnest($1::text[], $2::text[], $3::smallint[], $4::int[], $5::timestamptz[],
                $6::float8[], $7::text[], $8::int[], $9::smallint[], $10::int[], $11::text[], $12::text[],
                $13::text[], $14::bigint[], $15::text[], $16::text[], $19::bool[], $20::float8[], $21::int[])
        WITH ORDINALITY AS t(kind, payload, priority, max_attempts, run_at, delay, dedup_key, timeout_seconds,
                             gpus, gpu_memory_mb, labels, model, concurrency_key, cost, batch_key, tenant,
                             preemptible, grace_seconds, max_preemptions, ord)
), ins AS (
    INSERT INTO gpuq.jobs (kind, payload, priority, max_attempts, run_at, status, dedup_key, timeout_seconds,
                           gpus, gpu_memory_mb, labels, model, concurrency_key, cost, batch_key, tenant,
                           traceparent, tracestate, preemptible, grace_seconds, max_preemptions)
    SELECT kind, payload, priority, max_attempts, run_at,
           CASE WHEN run_at > now() THEN 'scheduled'::gpuq.job_status ELSE 'pending' END, dedup_key,
           timeout_seconds, coalesce(gpus, 0), gpu_memory_mb, coalesce(string_to_array(labels, ','), '{}'),
           model, concurrency_key, cost, batch_key, tenant, $17::text, $18::text,
           coalesce(preemptible, false), coalesce(grace_seconds, 30), coalesce(max_preemptions, 10)
    FROM input ORDER BY ord
    ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL AND status IN ('pending', 'leased', 'scheduled')
    DO NOTHING
    RETURNING id, dedup_key
)
SELECT input.ord, coalesce(ins.id, live.id) AS id, ins.id IS NOT NULL AS inserted
FROM input
LEFT JOIN ins USING (dedup_key)
LEFT JOIN gpuq.jobs live ON ins.id IS NULL AND live.dedup_key = input.dedup_key
    AND live.status IN ('pending', 'leased', 'scheduled')
ORDER BY input.ord;

-- name: lease_slots
-- Lease up to $2 plain jobs of kinds $1 (not paused, no limit), pending first (phase 1, each kind from its cursor: rank $5, id $6) then expired leases (phase 2); the i-th goes to slot $3[i].
WITH leasable AS (  -- the kinds asked for that are not paused, with their default timeout
    SELECT u.kind, u.after_rank, u.after_id, t.timeout_seconds AS default_timeout
    FROM unnest($1::text[], $5::int[], $6::bigint[]) AS u(kind, after_rank, after_id)
    LEFT JOIN gpuq.kind_timeouts t ON t.kind = u.kind
    WHERE NOT EXISTS (SELECT 1 FROM gpuq.paused_kinds p WHERE p.kind = u.kind)
      AND NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'kind' AND l.name = u.kind)  -- lease_limited's
), picked AS (
    SELECT c.ctid, k.default_timeout, row_number() OVER (ORDER BY c.priority DESC, c.id) AS rn
    FROM leasable AS k
    CROSS JOIN LATERAL (
        SELECT ctid, id, priority FROM gpuq.jobs
        -- kind <= k.kind with the row comparison, never kind = k.kind: given an
        -- equality, the B-tree starts at the kind's first entry and reads every
        -- leaf page behind the cursor (docs/design.md, "Lease cursors").
        WHERE status = 'pending' AND shape IS NULL AND kind <= k.kind
          AND (kind, -priority, id) > (k.kind, k.after_rank, k.after_id)
        ORDER BY kind, -priority, id
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ) c
    ORDER BY c.priority DESC, c.id
    LIMIT $2
), expired AS (
    SELECT e.ctid, (SELECT lk.default_timeout FROM leasable lk WHERE lk.kind = e.kind) AS default_timeout,
           (SELECT count(*) FROM picked) + row_number() OVER (ORDER BY e.lease_expires_at, e.id) AS rn
    FROM (
        SELECT ctid, id, kind, lease_expires_at FROM gpuq.jobs
        WHERE status = 'leased' AND lease_expires_at < now() AND kind = ANY(ARRAY(SELECT kind FROM leasable))
          AND shape IS NULL  -- a placed job's expired lease goes back to pending (the sweeper)
        ORDER BY lease_expires_at
        LIMIT greatest($2 - (SELECT count(*) FROM picked), 0)
        FOR UPDATE SKIP LOCKED
    ) e
), assigned AS (
    SELECT p.ctid, p.phase, p.default_timeout, s.agent, s.slot
    FROM (SELECT ctid, rn, 1 AS phase, default_timeout FROM picked
          UNION ALL SELECT ctid, rn, 2, default_timeout FROM expired) p
    JOIN unnest($3::text[]) WITH ORDINALITY AS s(agent, slot) ON s.slot = p.rn
)
UPDATE gpuq.jobs j
SET status = CASE WHEN (a.phase = 2 AND j.attempts >= j.max_attempts) THEN 'dead'::gpuq.job_status ELSE 'leased' END,
    attempts = CASE WHEN (a.phase = 2 AND j.attempts >= j.max_attempts) THEN j.attempts ELSE j.attempts + 1 END,
    lease_token = CASE WHEN (a.phase = 2 AND j.attempts >= j.max_attempts) THEN j.lease_token ELSE gen_random_uuid() END,
    leased_by = CASE WHEN (a.phase = 2 AND j.attempts >= j.max_attempts) THEN j.leased_by ELSE a.agent END,
    lease_expires_at = CASE WHEN (a.phase = 2 AND j.attempts >= j.max_attempts) THEN j.lease_expires_at ELSE now() + make_interval(secs => $4) END,
    started_at = CASE WHEN (a.phase = 2 AND j.attempts >= j.max_attempts) THEN j.started_at ELSE now() END,
    deadline_at = now() + make_interval(secs => coalesce(j.timeout_seconds, a.default_timeout)),
    finished_at = CASE WHEN (a.phase = 2 AND j.attempts >= j.max_attempts) THEN now() END,
    last_error = CASE WHEN (a.phase = 2 AND j.attempts >= j.max_attempts) THEN 'lease expired after the last attempt' ELSE j.last_error END
FROM assigned a
WHERE j.ctid = a.ctid
RETURNING j.id, j.kind, j.attempts, j.max_attempts, j.lease_token::text AS lease_token,
          j.priority, j.leased_by, j.payload::text AS payload_json, j.status, a.phase, a.slot,
          coalesce(j.timeout_seconds, a.default_timeout) AS timeout_seconds,
          (extract(epoch FROM now() - j.run_at) * 1000)::int8 AS queued_ms,  -- how long it was due
          j.traceparent, j.tracestate, j.checkpoint::text AS checkpoint_json;

-- name: lease_fair
-- Fair share on: lease up to cardinality($3) plain jobs of kinds $1 (not paused, no limit) by tickets $2: tenants in the order fair share gives slots ('default': jobs without a tenant). A tenant's n-th job (by priority then id, jobs_fair_idx) fills its n-th ticket; the first cardinality($3) tickets filled go to slots $3 in order.
WITH leasable AS (  -- the kinds asked for that are not paused, with their default timeout
    SELECT k.kind, t.timeout_seconds AS default_timeout
    FROM unnest($1::text[]) AS k(kind)
    LEFT JOIN gpuq.kind_timeouts t ON t.kind = k.kind
    WHERE NOT EXISTS (SELECT 1 FROM gpuq.paused_kinds p WHERE p.kind = k.kind)
      AND NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'kind' AND l.name = k.kind)  -- lease_limited's
), tickets AS (
    SELECT t.tenant, t.ticket, row_number() OVER (PARTITION BY t.tenant ORDER BY t.ticket) AS nth
    FROM unnest($2::text[]) WITH ORDINALITY AS t(tenant, ticket)
), wanted AS (
    SELECT tenant, count(*) AS n FROM tickets GROUP BY tenant
), named AS (  -- a row may also name the default tenant
    SELECT c.ctid, c.id, c.priority, w.tenant, k.default_timeout
    FROM wanted w CROSS JOIN leasable k CROSS JOIN LATERAL (
        SELECT ctid, id, priority FROM gpuq.jobs
        WHERE status = 'pending' AND shape IS NULL AND kind = k.kind AND tenant = w.tenant
        ORDER BY tenant, -priority, id  -- jobs_fair_idx's order: never jobs_pending_idx, filtering a flood
        LIMIT w.n
        FOR UPDATE SKIP LOCKED
    ) c
), unnamed AS (
    SELECT c.ctid, c.id, c.priority, w.tenant, k.default_timeout
    FROM (SELECT * FROM wanted WHERE tenant = 'default') w CROSS JOIN leasable k CROSS JOIN LATERAL (
        SELECT ctid, id, priority FROM gpuq.jobs
        WHERE status = 'pending' AND shape IS NULL AND kind = k.kind AND tenant IS NULL
        ORDER BY tenant, -priority, id
        LIMIT w.n
        FOR UPDATE SKIP LOCKED
    ) c
), picked AS (
    SELECT p.*, row_number() OVER (PARTITION BY p.tenant ORDER BY p.priority DESC, p.id) AS nth
    FROM (SELECT * FROM named UNION ALL SELECT * FROM unnamed) AS p
), assigned AS (
    SELECT p.ctid, p.default_timeout, t.ticket, row_number() OVER (ORDER BY t.ticket) AS slot
    FROM tickets t JOIN picked p ON p.tenant = t.tenant AND p.nth = t.nth
    ORDER BY t.ticket
    LIMIT cardinality($3::text[])
)
UPDATE gpuq.jobs j
SET status = 'leased', attempts = j.attempts + 1, lease_token = gen_random_uuid(), leased_by = s.agent,
    lease_expires_at = now() + make_interval(secs => $4), started_at = now(),
    deadline_at = now() + make_interval(secs => coalesce(j.timeout_seconds, a.default_timeout))
FROM assigned a
JOIN unnest($3::text[]) WITH ORDINALITY AS s(agent, slot) ON s.slot = a.slot
WHERE j.ctid = a.ctid
RETURNING j.id, j.kind, j.attempts, j.max_attempts, j.lease_token::text AS lease_token,
          j.priority, j.leased_by, j.payload::text AS payload_json, a.slot, a.ticket,
          coalesce(j.tenant, 'default') AS tenant,
          coalesce(j.timeout_seconds, a.default_timeout) AS timeout_seconds,
          (extract(epoch FROM now() - j.run_at) * 1000)::int8 AS queued_ms,
          j.traceparent, j.tracestate, j.checkpoint::text AS checkpoint_json;

-- name: lease_placed_fair
-- Fair share on: lease up to cardinality($4) pending jobs of kind $1 (not paused, no limit) and placement shape $2, none under a limited key, by tickets $3 (as lease_fair's; jobs_fair_placed_idx); the first cardinality($4) tickets filled go to slots $4 in order.
WITH leasable AS (
    SELECT (SELECT t.timeout_seconds FROM gpuq.kind_timeouts t WHERE t.kind = $1) AS default_timeout
    WHERE NOT EXISTS (SELECT 1 FROM gpuq.paused_kinds p WHERE p.kind = $1)
      AND NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'kind' AND l.name = $1)
), tickets AS (
    SELECT t.tenant, t.ticket, row_number() OVER (PARTITION BY t.tenant ORDER BY t.ticket) AS nth
    FROM unnest($3::text[]) WITH ORDINALITY AS t(tenant, ticket)
), wanted AS (
    SELECT tenant, count(*) AS n FROM tickets GROUP BY tenant
), named AS (  -- a row may also name the default tenant
    SELECT c.ctid, c.id, c.priority, w.tenant
    FROM wanted w CROSS JOIN LATERAL (
        SELECT ctid, id, priority FROM gpuq.jobs
        WHERE status = 'pending' AND shape IS NOT NULL AND kind = $1 AND shape = $2 AND tenant = w.tenant
          AND EXISTS (SELECT 1 FROM leasable)
          AND (concurrency_key IS NULL
               OR NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'key' AND l.name = concurrency_key))
        ORDER BY tenant, -priority, id
        LIMIT w.n
        FOR UPDATE SKIP LOCKED
    ) c
), unnamed AS (
    SELECT c.ctid, c.id, c.priority, w.tenant
    FROM (SELECT * FROM wanted WHERE tenant = 'default') w CROSS JOIN LATERAL (
        SELECT ctid, id, priority FROM gpuq.jobs
        WHERE status = 'pending' AND shape IS NOT NULL AND kind = $1 AND shape = $2 AND tenant IS NULL
          AND EXISTS (SELECT 1 FROM leasable)
          AND (concurrency_key IS NULL
               OR NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'key' AND l.name = concurrency_key))
        ORDER BY tenant, -priority, id
        LIMIT w.n
        FOR UPDATE SKIP LOCKED
    ) c
), picked AS (
    SELECT p.*, row_number() OVER (PARTITION BY p.tenant ORDER BY p.priority DESC, p.id) AS nth
    FROM (SELECT * FROM named UNION ALL SELECT * FROM unnamed) AS p
), assigned AS (
    SELECT p.ctid, t.ticket, row_number() OVER (ORDER BY t.ticket) AS slot
    FROM tickets t JOIN picked p ON p.tenant = t.tenant AND p.nth = t.nth
    ORDER BY t.ticket
    LIMIT cardinality($4::text[])
)
UPDATE gpuq.jobs j
SET status = 'leased', attempts = j.attempts + 1, lease_token = gen_random_uuid(), leased_by = s.agent,
    lease_expires_at = now() + make_interval(secs => $5), started_at = now(),
    deadline_at = now() + make_interval(secs => coalesce(j.timeout_seconds, (SELECT default_timeout FROM leasable)))
FROM assigned a
JOIN unnest($4::text[]) WITH ORDINALITY AS s(agent, slot) ON s.slot = a.slot
WHERE j.ctid = a.ctid
RETURNING j.id, j.kind, j.attempts, j.max_attempts, j.lease_token::text AS lease_token, j.priority, j.leased_by,
          j.payload::text AS payload_json, a.slot, a.ticket, coalesce(j.tenant, 'default') AS tenant,
          coalesce(j.timeout_seconds, (SELECT default_timeout FROM leasable)) AS timeout_seconds,
          (extract(epoch FROM now() - j.run_at) * 1000)::int8 AS queued_ms, j.traceparent, j.tracestate,
          j.failed_devices, j.checkpoint::text AS checkpoint_json, j.grace_seconds;

-- name: lease_placed
-- Lease up to cardinality($3) pending jobs of kind $1 (not paused, no limit) and placement shape $2, by priority and id, none under a limited key; the i-th goes to slot $3[i].
WITH leasable AS (
    SELECT (SELECT t.timeout_seconds FROM gpuq.kind_timeouts t WHERE t.kind = $1) AS default_timeout
    WHERE NOT EXISTS (SELECT 1 FROM gpuq.paused_kinds p WHERE p.kind = $1)
      AND NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'kind' AND l.name = $1)
), picked AS (
    SELECT c.ctid, row_number() OVER (ORDER BY c.priority DESC, c.id) AS rn
    FROM (
        SELECT ctid, id, priority FROM gpuq.jobs
        WHERE status = 'pending' AND shape IS NOT NULL AND kind = $1 AND shape = $2
          AND EXISTS (SELECT 1 FROM leasable)
          AND (concurrency_key IS NULL
               OR NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'key' AND l.name = concurrency_key))
        ORDER BY priority DESC, id
        LIMIT cardinality($3::text[])
        FOR UPDATE SKIP LOCKED
    ) c
)
UPDATE gpuq.jobs j
SET status = 'leased', attempts = j.attempts + 1, lease_token = gen_random_uuid(), leased_by = s.agent,
    lease_expires_at = now() + make_interval(secs => $4), started_at = now(),
    deadline_at = now() + make_interval(secs => coalesce(j.timeout_seconds, (SELECT default_timeout FROM leasable)))
FROM picked p
JOIN unnest($3::text[]) WITH ORDINALITY AS s(agent, slot) ON s.slot = p.rn
WHERE j.ctid = p.ctid
RETURNING j.id, j.kind, j.attempts, j.max_attempts, j.lease_token::text AS lease_token, j.priority, j.leased_by,
          j.payload::text AS payload_json, s.slot,
          coalesce(j.timeout_seconds, (SELECT default_timeout FROM leasable)) AS timeout_seconds,
          (extract(epoch FROM now() - j.run_at) * 1000)::int8 AS queued_ms, j.traceparent, j.tracestate,
          j.failed_devices, j.checkpoint::text AS checkpoint_json, j.grace_seconds;

-- name: limits_lock
-- Taken before lease_limited, in its transaction: limited leases run one at a time across dispatchers, each counting the last one's.
SELECT pg_advisory_xact_lock(hashtext('gpuq.limits'));

-- name: lease_limited
-- Lease up to cardinality($3) pending jobs of kind $1 and shape $2 ('': plain jobs) that the limits of gpuq.limits leave room for, reading at most $5 in order; the i-th goes to slot $3[i].
WITH leasable AS (  -- not paused; room: what the kind's limit leaves, at most the slots
    SELECT (SELECT t.timeout_seconds FROM gpuq.kind_timeouts t WHERE t.kind = $1) AS default_timeout,
           least(cardinality($3::text[]), greatest(0, coalesce(
               (SELECT l.max_running FROM gpuq.limits l WHERE l.scope = 'kind' AND l.name = $1)
               - (SELECT count(*) FROM gpuq.jobs WHERE status = 'leased' AND kind = $1), 2147483647))) AS room
    WHERE NOT EXISTS (SELECT 1 FROM gpuq.paused_kinds p WHERE p.kind = $1)
), candidates AS (  -- the next jobs, from the partial index of plain or of placed jobs
    (SELECT ctid, id, priority, concurrency_key FROM gpuq.jobs
     WHERE status = 'pending' AND shape IS NULL AND kind = $1 AND $2::text = '' AND (SELECT room FROM leasable) > 0
     ORDER BY kind, -priority, id LIMIT $5)
    UNION ALL
    (SELECT ctid, id, priority, concurrency_key FROM gpuq.jobs
     WHERE status = 'pending' AND shape IS NOT NULL AND kind = $1 AND shape = $2 AND (SELECT room FROM leasable) > 0
     ORDER BY priority DESC, id LIMIT $5)
), running AS (  -- jobs leased now under the candidates' keys (jobs_running_key_idx)
    SELECT concurrency_key, count(*) AS n FROM gpuq.jobs
    WHERE status = 'leased' AND concurrency_key = ANY(ARRAY(SELECT DISTINCT concurrency_key FROM candidates))
    GROUP BY concurrency_key
), allowed AS (  -- each key's first (limit - running) candidates, then the kind's room
    SELECT c.ctid FROM (
        SELECT *, row_number() OVER (PARTITION BY concurrency_key ORDER BY priority DESC, id) AS nth
        FROM candidates
    ) c
    LEFT JOIN gpuq.limits l ON l.scope = 'key' AND l.name = c.concurrency_key
    LEFT JOIN running r ON r.concurrency_key = c.concurrency_key
    WHERE l.max_running IS NULL OR c.nth <= l.max_running - coalesce(r.n, 0)
    ORDER BY c.priority DESC, c.id
    LIMIT coalesce((SELECT room FROM leasable), 0)
), picked AS (
    SELECT ctid, row_number() OVER (ORDER BY priority DESC, id) AS rn
    FROM (SELECT ctid, id, priority FROM gpuq.jobs
          WHERE ctid = ANY(ARRAY(SELECT ctid FROM allowed)) AND status = 'pending'
          FOR UPDATE SKIP LOCKED) locked
)
UPDATE gpuq.jobs j
SET status = 'leased', attempts = j.attempts + 1, lease_token = gen_random_uuid(), leased_by = s.agent,
    lease_expires_at = now() + make_interval(secs => $4), started_at = clock_timestamp(),
    deadline_at = now() + make_interval(secs => coalesce(j.timeout_seconds, (SELECT default_timeout FROM leasable)))
FROM picked p
JOIN unnest($3::text[]) WITH ORDINALITY AS s(agent, slot) ON s.slot = p.rn
WHERE j.ctid = p.ctid
RETURNING j.id, j.kind, j.attempts, j.max_attempts, j.lease_token::text AS lease_token, j.priority, j.leased_by,
          j.payload::text AS payload_json, s.slot,
          coalesce(j.timeout_seconds, (SELECT default_timeout FROM leasable)) AS timeout_seconds,
          (extract(epoch FROM now() - j.run_at) * 1000)::int8 AS queued_ms, j.traceparent, j.tracestate,
          j.failed_devices, j.checkpoint::text AS checkpoint_json, j.grace_seconds;

-- name: limit_set
-- At most $3 jobs leased at once under scope $1 ('kind' or 'key') and name $2 (NULL: no limit); wakes the dispatchers.
WITH cleared AS (DELETE FROM gpuq.limits WHERE scope = $1 AND name = $2 AND $3::int IS NULL RETURNING name),
set AS (
    INSERT INTO gpuq.limits (scope, name, max_running) SELECT $1, $2, $3 WHERE $3::int IS NOT NULL
    ON CONFLICT (scope, name) DO UPDATE SET max_running = excluded.max_running
    RETURNING name
)
SELECT pg_notify('gpuq_jobs', '*');

-- name: batch_policy_set
-- Kind $1's jobs go in batches of at most $2 items ($2 NULL: the kind's policy goes), a partial batch after its oldest waited $3 ms, costs summing to at most $4 (NULL: no budget); wakes the dispatchers.
WITH cleared AS (DELETE FROM gpuq.batch_policies WHERE kind = $1 AND $2::int IS NULL RETURNING kind),
set AS (
    INSERT INTO gpuq.batch_policies (kind, max_items, max_wait_ms, max_cost) SELECT $1, $2, $3, $4 WHERE $2::int IS NOT NULL
    ON CONFLICT (kind) DO UPDATE SET max_items = excluded.max_items, max_wait_ms = excluded.max_wait_ms,
                                     max_cost = excluded.max_cost, updated_at = now()
    RETURNING kind
)
SELECT pg_notify('gpuq_jobs', '*');

-- name: batch_policies
-- Every kind's batching policy, by kind.
SELECT kind, max_items, max_wait_ms, max_cost, updated_at FROM gpuq.batch_policies ORDER BY kind;

-- name: tenant_set
-- Tenant $1 weighs $2 ($2 NULL: its weight goes, back to 1; no weight left turns fair share off); wakes the dispatchers.
WITH cleared AS (DELETE FROM gpuq.tenants WHERE name = $1 AND $2::float8 IS NULL RETURNING name),
set AS (
    INSERT INTO gpuq.tenants (name, weight) SELECT $1, $2 WHERE $2::float8 IS NOT NULL
    ON CONFLICT (name) DO UPDATE SET weight = excluded.weight, updated_at = now()
    RETURNING name
)
SELECT pg_notify('gpuq_jobs', '*');

-- name: tenant_weights
-- Every tenant's weight, by name (a few rows; fair share is on while there is one).
SELECT name, weight, updated_at FROM gpuq.tenants ORDER BY name;

-- name: half_life_set
-- Usage halves every $1 seconds from now on, for every server.
INSERT INTO gpuq.fair_share_settings (id, half_life_seconds) VALUES (true, $1)
ON CONFLICT (id) DO UPDATE SET half_life_seconds = excluded.half_life_seconds;

-- name: half_life
-- Seconds in which usage halves.
SELECT gpuq.half_life();

-- name: tenant_usage
-- While fair share is on (else nothing): each tenant with a weight, usage or work, its weight (1 without a row), usage decayed to now plus its running jobs' GPU-seconds so far, running jobs, and pending jobs counted up to $1 (loose scans of jobs_fair_idx and jobs_fair_placed_idx, then a count of each kind and shape's up to $1). O(shapes + triples with work x $1), never history.
WITH fair AS (
    SELECT EXISTS (SELECT 1 FROM gpuq.tenants) AS on_
), triples AS (  -- each (kind, shape, tenant) with jobs pending (shape NULL: plain; tenant NULL: the default)
    SELECT w.kind, NULL::text AS shape, w.tenant FROM gpuq.tenants_waiting() w WHERE (SELECT on_ FROM fair)
    UNION ALL
    SELECT w.kind, w.shape, w.tenant FROM gpuq.tenants_waiting_placed() w WHERE (SELECT on_ FROM fair)
), waiting AS (  -- pending jobs per triple, each count stopping at $1
    SELECT coalesce(t.tenant, 'default') AS tenant, CASE
        WHEN t.shape IS NULL AND t.tenant IS NULL THEN (SELECT count(*) FROM (
            SELECT FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NULL AND j.kind = t.kind
              AND j.tenant IS NULL ORDER BY j.tenant, -j.priority, j.id LIMIT $1) AS c)
        WHEN t.shape IS NULL THEN (SELECT count(*) FROM (
            SELECT FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NULL AND j.kind = t.kind
              AND j.tenant = t.tenant ORDER BY j.tenant, -j.priority, j.id LIMIT $1) AS c)
        WHEN t.tenant IS NULL THEN (SELECT count(*) FROM (
            SELECT FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NOT NULL AND j.kind = t.kind
              AND j.shape = t.shape AND j.tenant IS NULL ORDER BY j.tenant, -j.priority, j.id LIMIT $1) AS c)
        ELSE (SELECT count(*) FROM (
            SELECT FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NOT NULL AND j.kind = t.kind
              AND j.shape = t.shape AND j.tenant = t.tenant ORDER BY j.tenant, -j.priority, j.id LIMIT $1) AS c)
    END AS n
    FROM triples t
), running AS (  -- jobs leased now (jobs_leased_idx), charged so far
    SELECT coalesce(tenant, 'default') AS tenant, count(*) AS n,
           sum(gpuq.gpu_seconds(started_at, now(), gpus, batch_size)) AS gpu_seconds
    FROM gpuq.jobs WHERE status = 'leased' AND (SELECT on_ FROM fair) GROUP BY 1
), used AS (
    SELECT tenant, gpuq.decayed(usage, usage_at, (SELECT gpuq.half_life())) AS usage FROM gpuq.tenant_usage
    WHERE (SELECT on_ FROM fair)
), names AS (
    SELECT name AS tenant FROM gpuq.tenants
    UNION SELECT tenant FROM used WHERE usage > 0
    UNION SELECT tenant FROM running
    UNION SELECT tenant FROM waiting WHERE n > 0
)
SELECT n.tenant, coalesce(w.weight, 1)::float8 AS weight, w.name IS NOT NULL AS weighted,
       (coalesce(u.usage, 0) + coalesce(r.gpu_seconds, 0))::float8 AS usage, coalesce(r.n, 0)::bigint AS running,
       least($1, (SELECT coalesce(sum(q.n), 0) FROM waiting q WHERE q.tenant = n.tenant))::bigint AS pending
FROM names n
LEFT JOIN gpuq.tenants w ON w.name = n.tenant
LEFT JOIN used u ON u.tenant = n.tenant
LEFT JOIN running r ON r.tenant = n.tenant
ORDER BY n.tenant;

-- name: fair_state
-- Fair share on: each tenant with a weight, usage or running jobs: its weight (1 without a row), usage, attempts and floor decayed to now, and what each of its running jobs has charged so far (jobs_leased_idx). O(tenants + running), never history.
WITH h AS (
    SELECT gpuq.half_life() AS hl
), used AS (
    SELECT u.tenant, gpuq.decayed(u.usage, u.usage_at, h.hl) AS usage, gpuq.decayed(u.attempts, u.usage_at, h.hl) AS attempts,
           gpuq.decayed(u.usage_floor, u.usage_at, h.hl) AS usage_floor
    FROM gpuq.tenant_usage u CROSS JOIN h
), running AS (
    SELECT coalesce(tenant, 'default') AS tenant, array_agg(gpuq.gpu_seconds(started_at, now(), gpus, batch_size)) AS charges
    FROM gpuq.jobs WHERE status = 'leased' GROUP BY 1
), names AS (
    SELECT name AS tenant FROM gpuq.tenants UNION SELECT tenant FROM used UNION SELECT tenant FROM running
)
SELECT n.tenant, coalesce(w.weight, 1)::float8 AS weight, coalesce(u.usage, 0)::float8 AS usage,
       coalesce(u.attempts, 0)::float8 AS attempts, coalesce(u.usage_floor, 0)::float8 AS usage_floor,
       coalesce(r.charges, '{}')::float8[] AS running
FROM names n
LEFT JOIN gpuq.tenants w ON w.name = n.tenant
LEFT JOIN used u ON u.tenant = n.tenant
LEFT JOIN running r ON r.tenant = n.tenant;

-- name: fair_waiting
-- Every (kind, shape, tenant) with jobs pending (shape NULL: plain jobs; 'default': jobs without a tenant): loose scans of jobs_fair_idx and jobs_fair_placed_idx, O(shapes + triples with work).
SELECT kind, NULL AS shape, coalesce(tenant, 'default') AS tenant FROM gpuq.tenants_waiting()
UNION ALL
SELECT kind, shape, coalesce(tenant, 'default') FROM gpuq.tenants_waiting_placed();

-- name: tenant_lift
-- Tenants $1, back from idle, count as having used at least $2 GPU-seconds, decayed from now on like their usage (tenants in name order, as the charges lock them).
INSERT INTO gpuq.tenant_usage AS u (tenant, usage_floor, usage_at)
SELECT f.tenant, f.usage_floor, now() FROM unnest($1::text[], $2::float8[]) AS f(tenant, usage_floor) ORDER BY 1
ON CONFLICT (tenant) DO UPDATE
SET usage = gpuq.decayed(u.usage, u.usage_at, (SELECT gpuq.half_life())),
    attempts = gpuq.decayed(u.attempts, u.usage_at, (SELECT gpuq.half_life())),
    usage_floor = greatest(gpuq.decayed(u.usage_floor, u.usage_at, (SELECT gpuq.half_life())), excluded.usage_floor),
    usage_at = greatest(u.usage_at, excluded.usage_at);

-- name: limits
-- Every limit, with the jobs leased under it now (jobs_leased_idx for a kind, jobs_running_key_idx for a key).
SELECT l.scope, l.name, l.max_running,
       CASE l.scope WHEN 'kind' THEN (SELECT count(*) FROM gpuq.jobs j WHERE j.status = 'leased' AND j.kind = l.name)
                    ELSE (SELECT count(*) FROM gpuq.jobs j WHERE j.status = 'leased' AND j.concurrency_key = l.name)
       END AS running
FROM gpuq.limits l ORDER BY l.scope, l.name;

-- name: shapes
-- Every placement shape enqueued so far, with what its jobs need (a handful of rows).
SELECT kind, shape, gpus, gpu_memory_mb, labels, model, keyed, preemptible FROM gpuq.shapes;

-- name: batch_head
-- The next $2 pending plain jobs of kind $1 (not paused, no limit) in lease order (jobs_pending_idx), with what batches form by: cost, batch_key, the timeout an attempt will have, and the milliseconds each has been due. Reads, locks nothing.
SELECT id, cost, batch_key, greatest(0, extract(epoch FROM now() - run_at) * 1000)::int8 AS waited_ms,
       coalesce(timeout_seconds, (SELECT t.timeout_seconds FROM gpuq.kind_timeouts t WHERE t.kind = $1)) AS timeout_seconds
FROM gpuq.jobs
WHERE kind = $1 AND status = 'pending' AND shape IS NULL
  AND NOT EXISTS (SELECT 1 FROM gpuq.paused_kinds p WHERE p.kind = $1)
  AND NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'kind' AND l.name = $1)
ORDER BY (-priority), id
LIMIT $2;

-- name: batch_head_placed
-- The next $3 pending jobs of kind $1 and placement shape $2 (not paused, no limit; none under a limited key) in lease order (jobs_placed_idx), with what batches form by, as batch_head. Reads, locks nothing.
SELECT id, cost, batch_key, greatest(0, extract(epoch FROM now() - run_at) * 1000)::int8 AS waited_ms,
       coalesce(timeout_seconds, (SELECT t.timeout_seconds FROM gpuq.kind_timeouts t WHERE t.kind = $1)) AS timeout_seconds
FROM gpuq.jobs
WHERE status = 'pending' AND shape IS NOT NULL AND kind = $1 AND shape = $2
  AND NOT EXISTS (SELECT 1 FROM gpuq.paused_kinds p WHERE p.kind = $1)
  AND NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'kind' AND l.name = $1)
  AND (concurrency_key IS NULL
       OR NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'key' AND l.name = concurrency_key))
ORDER BY priority DESC, id
LIMIT $3;

-- name: lease_batched
-- Lease the pending jobs $2 (ids, from batch_head or batch_head_placed) of kind $1 and shape $7 (NULL: plain jobs; not paused, no limit, none under a limited key), the i-th for agent $3[i] in batch $5[i] of $6[i] jobs; one leased, cancelled or paused meanwhile is skipped (pkey lookups: O(batch)).
WITH leasable AS (
    SELECT (SELECT t.timeout_seconds FROM gpuq.kind_timeouts t WHERE t.kind = $1) AS default_timeout
    WHERE NOT EXISTS (SELECT 1 FROM gpuq.paused_kinds p WHERE p.kind = $1)
      AND NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'kind' AND l.name = $1)
), picked AS (
    SELECT j.ctid, s.agent, s.batch_id, s.batch_size
    FROM unnest($2::int8[], $3::text[], $5::int8[], $6::int[]) AS s(id, agent, batch_id, batch_size)
    JOIN gpuq.jobs j ON j.id = s.id
    WHERE j.status = 'pending' AND j.shape IS NOT DISTINCT FROM $7::text AND j.kind = $1 AND EXISTS (SELECT 1 FROM leasable)
      AND (j.concurrency_key IS NULL
           OR NOT EXISTS (SELECT 1 FROM gpuq.limits l WHERE l.scope = 'key' AND l.name = j.concurrency_key))
    FOR UPDATE OF j SKIP LOCKED
)
UPDATE gpuq.jobs j
SET status = 'leased', attempts = j.attempts + 1, lease_token = gen_random_uuid(), leased_by = p.agent,
    lease_expires_at = now() + make_interval(secs => $4), started_at = now(),
    deadline_at = now() + make_interval(secs => coalesce(j.timeout_seconds, (SELECT default_timeout FROM leasable))),
    batch_id = p.batch_id, batch_size = p.batch_size
FROM picked p
WHERE j.ctid = p.ctid
RETURNING j.id, j.kind, j.attempts, j.max_attempts, j.lease_token::text AS lease_token, j.priority, j.leased_by,
          j.payload::text AS payload_json,
          coalesce(j.timeout_seconds, (SELECT default_timeout FROM leasable)) AS timeout_seconds,
          (extract(epoch FROM now() - j.run_at) * 1000)::int8 AS queued_ms, j.batch_id, j.traceparent, j.tracestate,
          j.checkpoint::text AS checkpoint_json, j.grace_seconds;

-- name: placed_head
-- Seconds the next pending job of kind $1 and shape $2 has been due (jobs_placed_idx; no row: none pending).
SELECT extract(epoch FROM now() - run_at)::float8 AS waited FROM gpuq.jobs
WHERE status = 'pending' AND shape IS NOT NULL AND kind = $1 AND shape = $2 AND run_at <= now()
ORDER BY priority DESC, id LIMIT 1;

-- name: placed_head_priority
-- The priority of the next pending job of kind $1 and shape $2 that is due (jobs_placed_idx; no row: none pending).
SELECT priority FROM gpuq.jobs
WHERE status = 'pending' AND shape IS NOT NULL AND kind = $1 AND shape = $2 AND run_at <= now()
ORDER BY priority DESC, id LIMIT 1;

-- name: plain_head_priority
-- The priority of kind $1's next pending plain job, unless the kind is paused (jobs_pending_idx: its first entry; no row: none pending).
SELECT priority FROM gpuq.jobs
WHERE status = 'pending' AND shape IS NULL AND kind = $1
  AND NOT EXISTS (SELECT 1 FROM gpuq.paused_kinds p WHERE p.kind = $1)
ORDER BY kind, -priority, id LIMIT 1;

-- name: held_preemption
-- Of the leased jobs $1 (held by this server's agents), how preemption sees each: preemptible, priority, seconds run, and whether it was asked to yield within its grace time.
SELECT id, preemptible, priority, extract(epoch FROM now() - started_at)::float8 AS ran_seconds,
       coalesce(preempt_at > now() - make_interval(secs => grace_seconds), false) AS yielding
FROM gpuq.jobs WHERE id = ANY($1::bigint[]) AND status::text = 'leased';

-- name: placed_pending
-- Pending placed jobs per kind and shape (jobs_placed_idx: live rows only).
SELECT kind, shape, count(*) AS n, min(created_at) AS oldest
FROM gpuq.jobs WHERE status = 'pending' AND shape IS NOT NULL GROUP BY kind, shape;

-- name: fleet_put
-- Write agents of server $1 (a jsonb array of rows: agent, kinds, protocol, devices, models, labels, draining), seen now.
INSERT INTO gpuq.fleet_agents AS f (server, agent, kinds, protocol, devices, models, labels, draining)
SELECT $1, r.agent, r.kinds, r.protocol, r.devices, r.models, r.labels, r.draining
FROM jsonb_to_recordset($2::jsonb) AS r(agent text, kinds text[], protocol int, devices int[], models text[],
                                        labels text[], draining boolean)
ON CONFLICT (server, agent) DO UPDATE
SET kinds = EXCLUDED.kinds, protocol = EXCLUDED.protocol, devices = EXCLUDED.devices, models = EXCLUDED.models,
    labels = EXCLUDED.labels, draining = EXCLUDED.draining, seen_at = now();

-- name: fleet_drop
-- Delete agents $2 of server $1 (they disconnected); all of its rows when $2 is NULL (a clean stop).
DELETE FROM gpuq.fleet_agents WHERE server = $1 AND ($2::text[] IS NULL OR agent = ANY($2));

-- name: fleet_refresh
-- Server $1 is alive: its rows seen now; the count tells it whether they are all there (a failover empties the table).
WITH seen AS (UPDATE gpuq.fleet_agents SET seen_at = now() WHERE server = $1 RETURNING 1)
SELECT count(*) FROM seen;

-- name: fleet_prune
-- Delete the rows of servers that stopped refreshing them more than $1 seconds ago (crashed, or cut off).
DELETE FROM gpuq.fleet_agents WHERE seen_at < now() - make_interval(secs => $1);

-- name: fleet_others
-- The agents of every other server than $1 seen in the last $2 seconds (a few rows: one per connected agent).
SELECT server, agent, kinds, protocol, devices, models, labels, draining FROM gpuq.fleet_agents
WHERE server <> $1 AND seen_at >= now() - make_interval(secs => $2);

-- name: device_fault
-- Agent $1's devices $2 faulted (source $3: handler, xid or ecc; error $4; job $5 or NULL): recorded; a device with $6 faults within the last $7 seconds (one xid or ecc fault) is quarantined and the dispatchers told. The devices quarantined now, with the reason.
WITH pruned AS (  -- faults older than the window no longer count: the table keeps only the window's
    DELETE FROM gpuq.device_faults WHERE agent = $1 AND device = ANY($2::int[]) AND at < now() - make_interval(secs => $7)
), added AS (
    INSERT INTO gpuq.device_faults (agent, device, source, error, job_id)
    SELECT $1, d, $3, left($4, 1024), $5 FROM unnest($2::int[]) AS d
), counted AS (  -- the statement's snapshot does not see its own insert: + 1
    SELECT d AS device, 1 + (SELECT count(*) FROM gpuq.device_faults f
                             WHERE f.agent = $1 AND f.device = d AND f.at >= now() - make_interval(secs => $7)) AS n
    FROM unnest($2::int[]) AS d
), quarantined AS (
    INSERT INTO gpuq.quarantined_devices (agent, device, reason, faults)
    SELECT $1, device, CASE WHEN $3 = 'handler'
                            THEN format('%s device faults within %s s, the last: %s', n, $7::int, left($4, 200))
                            ELSE format('%s: %s', $3, left($4, 200)) END, n
    FROM counted WHERE n >= $6 OR $3 <> 'handler'
    ON CONFLICT (agent, device) DO NOTHING
    RETURNING device, reason
), told AS (
    SELECT pg_notify('gpuq_jobs', 'quarantine:' || $1) FROM (SELECT 1 FROM quarantined LIMIT 1) AS any_new
)
SELECT device, reason FROM quarantined WHERE (SELECT count(*) FROM told) >= 0;

-- name: quarantine_set
-- Quarantine agent $1's devices $2 by hand with reason $3 (a device quarantined already keeps its reason); tells the dispatchers.
WITH added AS (
    INSERT INTO gpuq.quarantined_devices (agent, device, reason) SELECT $1, d, $3 FROM unnest($2::int[]) AS d
    ON CONFLICT (agent, device) DO NOTHING
    RETURNING device
)
SELECT pg_notify('gpuq_jobs', 'quarantine:' || $1), (SELECT coalesce(array_agg(device ORDER BY device), '{}') FROM added) AS added;

-- name: quarantine_clear
-- Clear the quarantine of agent $1's devices $2 (NULL: every device of it) and forget their faults; tells the dispatchers.
WITH cleared AS (
    DELETE FROM gpuq.quarantined_devices WHERE agent = $1 AND ($2::int[] IS NULL OR device = ANY($2)) RETURNING device
), forgot AS (
    DELETE FROM gpuq.device_faults WHERE agent = $1 AND ($2::int[] IS NULL OR device = ANY($2))
)
SELECT pg_notify('gpuq_jobs', 'quarantine:' || $1),
       (SELECT coalesce(array_agg(device ORDER BY device), '{}') FROM cleared) AS cleared;

-- name: quarantined
-- Every quarantined device (a few rows), by agent and index.
SELECT agent, device, reason, faults, since FROM gpuq.quarantined_devices ORDER BY agent, device;

-- name: quarantined_of
-- The quarantined devices of agents named $1, with the reason (read when one connects, or is told its quarantine changed).
SELECT agent, device, reason FROM gpuq.quarantined_devices WHERE agent = ANY($1::text[]);

-- name: failed_devices
-- The jobs $1, still leased with tokens $2, failed on devices $3 ('agent:index,...' each): their next attempt goes elsewhere when it can.
UPDATE gpuq.jobs j
SET failed_devices = string_to_array(f.devices, ',')
FROM unnest($1::bigint[], $2::uuid[], $3::text[]) AS f(id, token, devices)
WHERE j.id = f.id AND j.status::text = 'leased' AND j.lease_token = f.token;

-- name: move_leases
-- Jobs $1, still leased with tokens $2, go to agents $3 instead (placement moved them off the devices they failed on).
UPDATE gpuq.jobs j
SET leased_by = m.agent
FROM unnest($1::bigint[], $2::uuid[], $3::text[]) AS m(id, token, agent)
WHERE j.id = m.id AND j.status::text = 'leased' AND j.lease_token = m.token;

-- name: complete_many
-- Mark jobs done where (id, lease_token) still holds the lease, and tell waiters (gpuq_outcomes); returns the ids accepted.
WITH done AS (
    UPDATE gpuq.jobs j
    SET status = 'done', result = d.result::jsonb, finished_at = now(), lease_expires_at = NULL
    FROM unnest($1::bigint[], $2::uuid[], $3::text[]) AS d(id, token, result)
    WHERE j.id = d.id AND j.status::text = 'leased' AND j.lease_token = d.token
    RETURNING j.id
), told AS (  -- one NOTIFY per 300 ids (its payload limit), in this transaction: sent when it commits
    SELECT pg_notify('gpuq_outcomes', string_agg(id::text, ',')) FROM (
        SELECT id, (row_number() OVER () - 1) / 300 AS chunk FROM done) AS c GROUP BY chunk
)
SELECT id FROM done WHERE (SELECT count(*) FROM told) >= 0;

-- name: fail_many
-- Record fenced failures: retryable with attempts left -> scheduled after a capped, jittered backoff; else dead (and waiters are told).
WITH f AS (
    SELECT * FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::bool[]) AS f(id, token, error, retryable)
), failed AS (
UPDATE gpuq.jobs j
SET status = CASE WHEN f.retryable AND j.attempts < j.max_attempts
                  THEN 'scheduled'::gpuq.job_status ELSE 'dead' END,
    run_at = CASE WHEN f.retryable AND j.attempts < j.max_attempts
                  THEN now() + make_interval(secs => least($6::float8, $5::float8 * power(2, j.attempts - 1))
                                                     * (1 - $7::float8 * random()))
                  ELSE j.run_at END,
    finished_at = CASE WHEN f.retryable AND j.attempts < j.max_attempts THEN NULL ELSE now() END,
    last_error = f.error, lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
FROM f
WHERE j.id = f.id AND j.status::text = 'leased' AND j.lease_token = f.token
RETURNING j.id, j.status, j.run_at
), told AS (
    SELECT pg_notify('gpuq_outcomes', string_agg(id::text, ',')) FROM (
        SELECT id, (row_number() OVER () - 1) / 300 AS chunk FROM failed WHERE status = 'dead') AS c GROUP BY chunk
)
SELECT id, status, run_at FROM failed WHERE (SELECT count(*) FROM told) >= 0;

-- name: complete_many_charged
-- complete_many while fair share is on (gpuq.tenants has a row): each job's GPU-seconds (its run time $4 where known, else since its lease) also go to its tenant's decayed usage (one upsert, tenants in name order).
WITH done AS (
    UPDATE gpuq.jobs j
    SET status = 'done', result = d.result::jsonb, finished_at = now(), lease_expires_at = NULL
    FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::float8[]) AS d(id, token, result, ran)
    WHERE j.id = d.id AND j.status::text = 'leased' AND j.lease_token = d.token
    RETURNING j.id, j.tenant, gpuq.gpu_seconds(j.started_at, now(), j.gpus, j.batch_size, d.ran) AS charge
), charged AS (
    INSERT INTO gpuq.tenant_usage AS u (tenant, usage, attempts, usage_at)
    SELECT coalesce(tenant, 'default'), sum(charge), count(*) FILTER (WHERE charge > 0), now() FROM done GROUP BY 1 ORDER BY 1
    ON CONFLICT (tenant) DO UPDATE
    SET usage = gpuq.decayed(u.usage, u.usage_at, (SELECT gpuq.half_life())) + excluded.usage,
        attempts = gpuq.decayed(u.attempts, u.usage_at, (SELECT gpuq.half_life())) + excluded.attempts,
        usage_floor = gpuq.decayed(u.usage_floor, u.usage_at, (SELECT gpuq.half_life())),
        usage_at = greatest(u.usage_at, excluded.usage_at)
), told AS (  -- one NOTIFY per 300 ids (its payload limit), in this transaction: sent when it commits
    SELECT pg_notify('gpuq_outcomes', string_agg(id::text, ',')) FROM (
        SELECT id, (row_number() OVER () - 1) / 300 AS chunk FROM done) AS c GROUP BY chunk
)
SELECT id FROM done WHERE (SELECT count(*) FROM told) >= 0;

-- name: fail_many_charged
-- fail_many while fair share is on (gpuq.tenants has a row): each attempt's GPU-seconds (its run time $8 where known, else since its lease) also go to its tenant's decayed usage (one upsert, tenants in name order).
WITH f AS (
    SELECT * FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::bool[], $8::float8[]) AS f(id, token, error, retryable, ran)
), failed AS (
UPDATE gpuq.jobs j
SET status = CASE WHEN f.retryable AND j.attempts < j.max_attempts
                  THEN 'scheduled'::gpuq.job_status ELSE 'dead' END,
    run_at = CASE WHEN f.retryable AND j.attempts < j.max_attempts
                  THEN now() + make_interval(secs => least($6::float8, $5::float8 * power(2, j.attempts - 1))
                                                     * (1 - $7::float8 * random()))
                  ELSE j.run_at END,
    finished_at = CASE WHEN f.retryable AND j.attempts < j.max_attempts THEN NULL ELSE now() END,
    last_error = f.error, lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
FROM f
WHERE j.id = f.id AND j.status::text = 'leased' AND j.lease_token = f.token
RETURNING j.id, j.status, j.run_at, j.tenant, gpuq.gpu_seconds(j.started_at, now(), j.gpus, j.batch_size, f.ran) AS charge
), charged AS (
    INSERT INTO gpuq.tenant_usage AS u (tenant, usage, attempts, usage_at)
    SELECT coalesce(tenant, 'default'), sum(charge), count(*) FILTER (WHERE charge > 0), now() FROM failed GROUP BY 1 ORDER BY 1
    ON CONFLICT (tenant) DO UPDATE
    SET usage = gpuq.decayed(u.usage, u.usage_at, (SELECT gpuq.half_life())) + excluded.usage,
        attempts = gpuq.decayed(u.attempts, u.usage_at, (SELECT gpuq.half_life())) + excluded.attempts,
        usage_floor = gpuq.decayed(u.usage_floor, u.usage_at, (SELECT gpuq.half_life())),
        usage_at = greatest(u.usage_at, excluded.usage_at)
), told AS (
    SELECT pg_notify('gpuq_outcomes', string_agg(id::text, ',')) FROM (
        SELECT id, (row_number() OVER () - 1) / 300 AS chunk FROM failed WHERE status = 'dead') AS c GROUP BY chunk
)
SELECT id, status, run_at FROM failed WHERE (SELECT count(*) FROM told) >= 0;

-- name: record_progress
-- Store running jobs' latest progress where (id, lease_token) still holds the lease, and tell waiters (gpuq_progress); returns the ids written.
WITH written AS (
    UPDATE gpuq.jobs j
    SET progress = jsonb_build_object('fraction', p.fraction, 'message', p.message, 'data', p.data::jsonb,
                                      'attempt', j.attempts, 'at', now())
    FROM unnest($1::bigint[], $2::uuid[], $3::float8[], $4::text[], $5::text[]) AS p(id, token, fraction, message, data)
    WHERE j.id = p.id AND j.status::text = 'leased' AND j.lease_token = p.token
    RETURNING j.id
), told AS (  -- one NOTIFY per 300 ids, sent when this commits
    SELECT pg_notify('gpuq_progress', string_agg(id::text, ',')) FROM (
        SELECT id, (row_number() OVER () - 1) / 300 AS chunk FROM written) AS c GROUP BY chunk
)
SELECT id FROM written WHERE (SELECT count(*) FROM told) >= 0;

-- name: record_checkpoints
-- Store running jobs' checkpoints (JSON text $3) where (id $1, lease_token $2) still holds the lease, with when and by which attempt; returns the ids stored (one row per job: the caller passes each job once).
UPDATE gpuq.jobs j
SET checkpoint = c.data::jsonb, checkpoint_at = now(), checkpoint_attempt = j.attempts
FROM unnest($1::bigint[], $2::uuid[], $3::text[]) AS c(id, token, data)
WHERE j.id = c.id AND j.status::text = 'leased' AND j.lease_token = c.token
RETURNING j.id;

-- name: heartbeat
-- Extend the leases agent $2 holds on ids $1 by $3 seconds; returns the ids extended.
UPDATE gpuq.jobs
SET lease_expires_at = now() + make_interval(secs => $3)
WHERE id = ANY($1::bigint[]) AND status::text = 'leased' AND leased_by = $2
RETURNING id;

-- name: release_agent
-- An agent left: its leased jobs go back to pending (dead, with error $2, when out of attempts); only ids $3 had started: the others (prefetched, or still on their way) go back without counting the attempt, nor (fair share on) charging it.
WITH moved AS (
    UPDATE gpuq.jobs j
    SET status = CASE WHEN j.attempts >= j.max_attempts AND picked.started THEN 'dead'::gpuq.job_status
                      ELSE 'pending' END,
        finished_at = CASE WHEN j.attempts >= j.max_attempts AND picked.started THEN now() END,
        last_error = CASE WHEN j.attempts >= j.max_attempts AND picked.started THEN $2 ELSE j.last_error END,
        attempts = j.attempts - (NOT picked.started)::int,
        lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
    FROM (SELECT id, id = ANY($3::bigint[]) AS started FROM gpuq.jobs
          WHERE status = 'leased' AND leased_by = $1 FOR UPDATE) AS picked
    WHERE j.id = picked.id
    RETURNING j.id, j.kind, j.status, j.tenant,
              CASE WHEN picked.started THEN gpuq.gpu_seconds(j.started_at, now(), j.gpus, j.batch_size) ELSE 0 END AS charge
), charged AS (  -- only while fair share is on (gpuq.tenants has a row)
    INSERT INTO gpuq.tenant_usage AS u (tenant, usage, attempts, usage_at)
    SELECT coalesce(tenant, 'default'), sum(charge), count(*) FILTER (WHERE charge > 0), now() FROM moved
    WHERE EXISTS (SELECT 1 FROM gpuq.tenants) GROUP BY 1 ORDER BY 1
    ON CONFLICT (tenant) DO UPDATE
    SET usage = gpuq.decayed(u.usage, u.usage_at, (SELECT gpuq.half_life())) + excluded.usage,
        attempts = gpuq.decayed(u.attempts, u.usage_at, (SELECT gpuq.half_life())) + excluded.attempts,
        usage_floor = gpuq.decayed(u.usage_floor, u.usage_at, (SELECT gpuq.half_life())),
        usage_at = greatest(u.usage_at, excluded.usage_at)
)
SELECT id, kind, status FROM moved;

-- name: release_unstarted
-- An agent gives back jobs it will not start (prefetched, then draining): ids $1 still leased with tokens $2 go back to pending, the attempt not counted.
UPDATE gpuq.jobs j
SET status = 'pending', attempts = j.attempts - 1, lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
FROM (SELECT id FROM gpuq.jobs WHERE status::text = 'leased' AND id = ANY($1::bigint[]) FOR UPDATE) AS picked,
     unnest($1::bigint[], $2::uuid[]) AS given(id, token)
WHERE j.id = picked.id AND given.id = j.id AND j.lease_token = given.token
RETURNING j.id, j.kind, j.status;

-- name: preempted_many
-- Preemptible jobs that yielded (to a preempt, or their agent's interruption): ids $1 still leased with tokens $2 go back to pending (their place in the queue kept), one more preemption counted, the attempt not counted while preemptions are left (past max_preemptions, as a spot interruption can take it, it counts: dead after the last attempt, error $3); while fair share is on (gpuq.tenants has a row) the attempt's GPU-seconds are charged.
WITH moved AS (
    UPDATE gpuq.jobs j
    SET status = CASE WHEN j.preemptions >= j.max_preemptions AND j.attempts >= j.max_attempts
                      THEN 'dead'::gpuq.job_status ELSE 'pending' END,
        finished_at = CASE WHEN j.preemptions >= j.max_preemptions AND j.attempts >= j.max_attempts THEN now() END,
        last_error = CASE WHEN j.preemptions >= j.max_preemptions AND j.attempts >= j.max_attempts THEN $3
                          ELSE j.last_error END,
        attempts = j.attempts - (j.preemptions < j.max_preemptions)::int,
        preemptions = j.preemptions + 1, preempt_at = NULL,
        lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
    FROM (SELECT id FROM gpuq.jobs WHERE status::text = 'leased' AND id = ANY($1::bigint[]) FOR UPDATE) AS picked,
         unnest($1::bigint[], $2::uuid[]) AS given(id, token)
    WHERE j.id = picked.id AND given.id = j.id AND j.lease_token = given.token AND j.preemptible
    RETURNING j.id, j.kind, j.status, j.tenant, gpuq.gpu_seconds(j.started_at, now(), j.gpus, j.batch_size) AS charge
), charged AS (
    INSERT INTO gpuq.tenant_usage AS u (tenant, usage, usage_at)
    SELECT coalesce(tenant, 'default'), sum(charge), now() FROM moved
    WHERE EXISTS (SELECT 1 FROM gpuq.tenants) GROUP BY 1 ORDER BY 1
    ON CONFLICT (tenant) DO UPDATE
    SET usage = gpuq.decayed(u.usage, u.usage_at, (SELECT gpuq.half_life())) + excluded.usage,
        usage_at = greatest(u.usage_at, excluded.usage_at)
)
SELECT id, kind, status FROM moved;

-- name: preempt
-- Ask the running preemptible jobs among ids $1 to yield (gpuq.preempt: those with preemptions left, not asked within their grace time): each id asked and its grace time.
SELECT id, grace_seconds FROM gpuq.preempt($1::bigint[]);

-- name: release_jobs
-- Give up the leases on ids $1 (shutdown, undeliverable jobs): back to pending, or dead with error $2; $3: they never reached an agent, so the attempt does not count.
UPDATE gpuq.jobs j
SET status = CASE WHEN j.attempts >= j.max_attempts AND NOT $3 THEN 'dead'::gpuq.job_status ELSE 'pending' END,
    finished_at = CASE WHEN j.attempts >= j.max_attempts AND NOT $3 THEN now() END,
    last_error = CASE WHEN j.attempts >= j.max_attempts AND NOT $3 THEN $2 ELSE j.last_error END,
    attempts = j.attempts - $3::boolean::int,
    lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
FROM (SELECT id FROM gpuq.jobs WHERE status::text = 'leased' AND id = ANY($1::bigint[]) FOR UPDATE) AS picked
WHERE j.id = picked.id
RETURNING j.id, j.kind, j.status;

-- name: reclaim_expired
-- Up to $1 expired leases, oldest expiry first, back to pending (dead, with error $2, when out of attempts); fair share on, each attempt charges its GPU-seconds until its lease expired.
WITH moved AS (
    UPDATE gpuq.jobs j
    SET status = CASE WHEN j.attempts >= j.max_attempts THEN 'dead'::gpuq.job_status ELSE 'pending' END,
        finished_at = CASE WHEN j.attempts >= j.max_attempts THEN now() END,
        last_error = CASE WHEN j.attempts >= j.max_attempts THEN $2 ELSE j.last_error END,
        lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
    FROM (SELECT id, lease_expires_at FROM gpuq.jobs WHERE status = 'leased' AND lease_expires_at < now()
          ORDER BY lease_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED) AS picked
    WHERE j.id = picked.id
    RETURNING j.id, j.kind, j.status, j.tenant,
              gpuq.gpu_seconds(j.started_at, picked.lease_expires_at, j.gpus, j.batch_size) AS charge
), charged AS (  -- only while fair share is on (gpuq.tenants has a row)
    INSERT INTO gpuq.tenant_usage AS u (tenant, usage, attempts, usage_at)
    SELECT coalesce(tenant, 'default'), sum(charge), count(*) FILTER (WHERE charge > 0), now() FROM moved
    WHERE EXISTS (SELECT 1 FROM gpuq.tenants) GROUP BY 1 ORDER BY 1
    ON CONFLICT (tenant) DO UPDATE
    SET usage = gpuq.decayed(u.usage, u.usage_at, (SELECT gpuq.half_life())) + excluded.usage,
        attempts = gpuq.decayed(u.attempts, u.usage_at, (SELECT gpuq.half_life())) + excluded.attempts,
        usage_floor = gpuq.decayed(u.usage_floor, u.usage_at, (SELECT gpuq.half_life())),
        usage_at = greatest(u.usage_at, excluded.usage_at)
)
SELECT id, kind, status FROM moved;

-- name: expire_deadlines
-- Up to $1 attempts still leased $2 seconds past their deadline fail with 'timeout': retried after the backoff ($3 base, $4 cap) while attempts remain, else dead; fair share on, each charges its GPU-seconds.
WITH over AS (
    SELECT id FROM gpuq.jobs WHERE status = 'leased' AND deadline_at < now() - make_interval(secs => $2)
    ORDER BY deadline_at LIMIT $1 FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE gpuq.jobs j
    SET status = CASE WHEN j.attempts < j.max_attempts THEN 'scheduled'::gpuq.job_status ELSE 'dead' END,
        run_at = CASE WHEN j.attempts < j.max_attempts
                      THEN now() + make_interval(secs => least($4::float8, $3::float8 * power(2, j.attempts - 1)))
                      ELSE j.run_at END,
        finished_at = CASE WHEN j.attempts < j.max_attempts THEN NULL ELSE now() END,
        last_error = 'timeout', lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
    FROM over
    WHERE j.id = over.id
    RETURNING j.id, j.kind, j.status, j.tenant, gpuq.gpu_seconds(j.started_at, now(), j.gpus, j.batch_size) AS charge
), charged AS (  -- only while fair share is on (gpuq.tenants has a row)
    INSERT INTO gpuq.tenant_usage AS u (tenant, usage, attempts, usage_at)
    SELECT coalesce(tenant, 'default'), sum(charge), count(*) FILTER (WHERE charge > 0), now() FROM moved
    WHERE EXISTS (SELECT 1 FROM gpuq.tenants) GROUP BY 1 ORDER BY 1
    ON CONFLICT (tenant) DO UPDATE
    SET usage = gpuq.decayed(u.usage, u.usage_at, (SELECT gpuq.half_life())) + excluded.usage,
        attempts = gpuq.decayed(u.attempts, u.usage_at, (SELECT gpuq.half_life())) + excluded.attempts,
        usage_floor = gpuq.decayed(u.usage_floor, u.usage_at, (SELECT gpuq.half_life())),
        usage_at = greatest(u.usage_at, excluded.usage_at)
)
SELECT id, kind, status FROM moved;

-- name: promote_due
-- Up to $1 scheduled jobs whose run_at has come become pending.
UPDATE gpuq.jobs j SET status = 'pending'
FROM (SELECT id FROM gpuq.jobs WHERE status = 'scheduled' AND run_at <= now()
      ORDER BY run_at LIMIT $1 FOR UPDATE SKIP LOCKED) AS due
WHERE j.id = due.id
RETURNING j.id, j.kind, j.status;

-- name: notify
-- Wake the dispatchers for the comma-joined kinds $1 ('*': every kind).
SELECT pg_notify('gpuq_jobs', $1);

-- name: notify_outcomes
-- Tell waiters that the comma-joined job ids $1 ended (jobs that went dead outside the completer).
SELECT pg_notify('gpuq_outcomes', $1);

-- name: job_outcome
-- Where job $1 stands, for a waiter: its state, result (JSON text), last error and progress (JSON text).
SELECT status::text AS status, result::text AS result, last_error, progress::text AS progress
FROM gpuq.jobs WHERE id = $1;

-- name: arm_wakeups
-- Declare a dispatcher waiting for $1 ms: the clock, the mark before and after, and the transactions to see end first.
SELECT now_ms, previous, until, stragglers FROM gpuq.arm_wakeups($1);

-- name: insert_horizon
-- The highest job id drawn, and the transactions to see end before a lease cursor may pass it.
SELECT last_id, writers FROM gpuq.insert_horizon();

-- name: stragglers_left
-- Of the transaction ids $1, those still running.
SELECT coalesce(array_agg(DISTINCT transactionid::text), '{}') FROM pg_locks
WHERE locktype = 'transactionid' AND transactionid::text = ANY($1::text[]);

-- name: set_floors
-- Dispatcher $1's lease cursors reached priorities $3 in kinds $2: inserts above them notify.
SELECT gpuq.set_floors($1, $2::text[], $3::smallint[]);

-- name: clear_floors
-- Remove dispatcher $1's lease floors and those of dispatchers whose connection is gone.
SELECT gpuq.clear_floors($1);

-- name: cancel
-- Cancel the live jobs among ids $1 (they end 'cancelled'; a running agent's result is fenced out): each id and the state it left.
SELECT id, was FROM gpuq.cancel($1::bigint[]);

-- name: show
-- Every column of job $1, payload and result as JSON text.
SELECT id, kind, status::text AS status, priority, attempts, max_attempts, payload::text AS payload,
       result::text AS result, last_error, leased_by, lease_expires_at, run_at, created_at, started_at,
       finished_at, dedup_key, timeout_seconds, deadline_at, progress::text AS progress,
       gpus, gpu_memory_mb, labels, model, concurrency_key, cost, batch_key, batch_id, batch_size,
       traceparent, tracestate, coalesce(tenant, 'default') AS tenant,
       failed_devices, checkpoint::text AS checkpoint, checkpoint_at, checkpoint_attempt,
       preemptible, grace_seconds, max_preemptions, preemptions, preempt_at
FROM gpuq.jobs WHERE id = $1;

-- name: job_attempts
-- The attempts of job $1 that did not succeed, oldest first (the running or successful one is the job row).
SELECT attempt, agent, started_at, ended_at, became::text AS became, error
FROM gpuq.attempts WHERE job_id = $1 ORDER BY ended_at, attempt;

-- name: last_agents
-- For each of jobs $1, the agent of its latest attempt that did not succeed (attempts_job_idx).
SELECT DISTINCT ON (job_id) job_id, agent FROM gpuq.attempts
WHERE job_id = ANY($1::bigint[]) ORDER BY job_id, ended_at DESC;

-- name: jobs_recent
-- Up to $7 jobs with ids in [$2, $1), newest first, of kind $3, state $4, concurrency key $5, error text $6 (NULL: any): one bounded walk of the primary key.
SELECT id, kind, status::text AS status, priority, attempts, max_attempts, created_at, started_at, finished_at,
       leased_by, right(last_error, 300) AS error, concurrency_key
FROM gpuq.jobs
WHERE id < $1 AND id >= $2 AND ($3::text IS NULL OR kind = $3) AND ($4::text IS NULL OR status::text = $4)
  AND ($5::text IS NULL OR concurrency_key = $5) AND ($6::text IS NULL OR strpos(last_error, $6) > 0)
ORDER BY id DESC LIMIT $7;

-- name: max_job_id
-- The newest job id (the primary key's last entry), where a list of recent jobs starts.
SELECT max(id) FROM gpuq.jobs;

-- name: jobs_failed
-- Up to $6 dead or cancelled jobs below id $1, newest first, of kind $2, state $3, concurrency key $4, error text $5 (NULL: any): from jobs_failed_idx.
SELECT id, kind, status::text AS status, priority, attempts, max_attempts, created_at, started_at, finished_at,
       leased_by, right(last_error, 300) AS error, concurrency_key
FROM gpuq.jobs
WHERE status IN ('dead', 'cancelled') AND id < $1 AND ($2::text IS NULL OR kind = $2)
  AND ($3::text IS NULL OR status::text = $3) AND ($4::text IS NULL OR concurrency_key = $4)
  AND ($5::text IS NULL OR strpos(last_error, $5) > 0)
ORDER BY id DESC LIMIT $6;

-- name: jobs_keyed
-- Up to $6 jobs with concurrency key $1 below id $2, newest first, of kind $3, state $4, error text $5 (NULL: any): from jobs_keyed_idx.
SELECT id, kind, status::text AS status, priority, attempts, max_attempts, created_at, started_at, finished_at,
       leased_by, right(last_error, 300) AS error, concurrency_key
FROM gpuq.jobs
WHERE concurrency_key IS NOT NULL AND concurrency_key = $1 AND id < $2 AND ($3::text IS NULL OR kind = $3)
  AND ($4::text IS NULL OR status::text = $4) AND ($5::text IS NULL OR strpos(last_error, $5) > 0)
ORDER BY id DESC LIMIT $6;

-- name: jobs_live
-- Up to $6 jobs in live state $1 below id $2, newest first, of kind $3, concurrency key $4, error text $5 (NULL: any): each state from its partial index.
SELECT id, kind, status::text AS status, priority, attempts, max_attempts, created_at, started_at, finished_at,
       leased_by, right(last_error, 300) AS error, concurrency_key
FROM (
    SELECT * FROM gpuq.jobs WHERE $1::text = 'pending' AND status = 'pending' AND shape IS NULL
    UNION ALL
    SELECT * FROM gpuq.jobs WHERE $1::text = 'pending' AND status = 'pending' AND shape IS NOT NULL
    UNION ALL
    SELECT * FROM gpuq.jobs WHERE $1::text = 'leased' AND status = 'leased'
    UNION ALL
    SELECT * FROM gpuq.jobs WHERE $1::text = 'scheduled' AND status = 'scheduled'
) AS live
WHERE id < $2 AND ($3::text IS NULL OR kind = $3) AND ($4::text IS NULL OR concurrency_key = $4)
  AND ($5::text IS NULL OR strpos(last_error, $5) > 0)
ORDER BY id DESC LIMIT $6;

-- name: pause_kind
-- Stop leasing kind $1 ($2: who); returns nothing if it was paused already.
INSERT INTO gpuq.paused_kinds (kind, paused_by) VALUES ($1, $2)
ON CONFLICT (kind) DO NOTHING
RETURNING kind;

-- name: resume_kind
-- Lease kind $1 again, and wake the dispatchers for it (its jobs may be behind a cursor).
WITH r AS (DELETE FROM gpuq.paused_kinds WHERE kind = $1 RETURNING kind)
SELECT r.kind, pg_notify('gpuq_jobs', r.kind || '!') FROM r;

-- name: kind_timeout_set
-- The default timeout of kind $1's jobs: $2 seconds (NULL: none); jobs with their own keep theirs.
WITH cleared AS (DELETE FROM gpuq.kind_timeouts WHERE kind = $1 AND $2::int IS NULL RETURNING kind)
INSERT INTO gpuq.kind_timeouts (kind, timeout_seconds) SELECT $1, $2 WHERE $2::int IS NOT NULL
ON CONFLICT (kind) DO UPDATE SET timeout_seconds = excluded.timeout_seconds;

-- name: kind_timeouts
-- Every kind's default timeout.
SELECT kind, timeout_seconds FROM gpuq.kind_timeouts ORDER BY kind;

-- name: paused_kinds
-- Every paused kind, who paused it and since when.
SELECT kind, paused_at, paused_by FROM gpuq.paused_kinds ORDER BY kind;

-- name: retry_count
-- How many dead or cancelled jobs match ids $1 (NULL: any), kind $2, error text $3 (substring), finished in [$4, $5), state $6, concurrency key $7 (jobs_failed_idx).
SELECT count(*) FROM gpuq.jobs
WHERE status IN ('dead', 'cancelled') AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
  AND ($2::text IS NULL OR kind = $2) AND ($3::text IS NULL OR strpos(last_error, $3) > 0)
  AND ($4::timestamptz IS NULL OR finished_at >= $4) AND ($5::timestamptz IS NULL OR finished_at < $5)
  AND ($6::text IS NULL OR status::text = $6) AND ($7::text IS NULL OR concurrency_key = $7);

-- name: retry
-- Send the dead or cancelled jobs retry_count matches back to pending with fresh attempts (their checkpoint kept, or dropped when $8), and wake the dispatchers for their kinds.
WITH r AS (
    UPDATE gpuq.jobs
    SET status = 'pending', attempts = 0, run_at = now(), finished_at = NULL, started_at = NULL,
        lease_token = NULL, leased_by = NULL, lease_expires_at = NULL,
        checkpoint = CASE WHEN $8::boolean THEN NULL ELSE checkpoint END,
        checkpoint_at = CASE WHEN $8::boolean THEN NULL ELSE checkpoint_at END,
        checkpoint_attempt = CASE WHEN $8::boolean THEN NULL ELSE checkpoint_attempt END
    WHERE status IN ('dead', 'cancelled') AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
      AND ($2::text IS NULL OR kind = $2) AND ($3::text IS NULL OR strpos(last_error, $3) > 0)
      AND ($4::timestamptz IS NULL OR finished_at >= $4) AND ($5::timestamptz IS NULL OR finished_at < $5)
      AND ($6::text IS NULL OR status::text = $6) AND ($7::text IS NULL OR concurrency_key = $7)
    RETURNING kind
), kinds AS (
    SELECT count(*) AS n, string_agg(DISTINCT kind || '!', ',') AS k FROM r
)
SELECT n, pg_notify('gpuq_jobs', CASE WHEN length(k) > 7000 THEN '*' ELSE k END) FROM kinds WHERE n > 0;

-- name: schedule_add
-- A periodic job: name $1, cron $2, kind $3, payload $4 (JSON text), priority $5, max attempts $6, first run $7, by $8; nothing if the name exists.
INSERT INTO gpuq.schedules (name, cron, kind, payload, priority, max_attempts, next_run_at, created_by)
VALUES ($1, $2, $3, $4::text::jsonb, $5, $6, $7, $8)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: schedule_remove
-- Remove schedule $1; returns its name if it existed.
DELETE FROM gpuq.schedules WHERE name = $1 RETURNING name;

-- name: schedule_list
-- Every schedule, by name.
SELECT name, cron, kind, payload::text AS payload, priority, max_attempts, next_run_at, created_at, created_by
FROM gpuq.schedules ORDER BY name;

-- name: schedules_due
-- The database's clock, and the schedules whose next run has come (at most $1).
SELECT now() AS now, name, cron, next_run_at FROM gpuq.schedules WHERE next_run_at <= now()
ORDER BY next_run_at LIMIT $1;

-- name: schedules_fire
-- For each schedule $1 still due at $3, move its next run to $2 and enqueue its job (compare and set: once per tick, whoever runs it).
WITH fired AS (
    UPDATE gpuq.schedules s SET next_run_at = n.next_run_at
    FROM unnest($1::text[], $2::timestamptz[], $3::timestamptz[]) AS n(name, next_run_at, was)
    WHERE s.name = n.name AND s.next_run_at = n.was
    RETURNING s.name, s.kind, s.payload, s.priority, s.max_attempts, n.was
)
INSERT INTO gpuq.jobs (kind, payload, priority, max_attempts, dedup_key)
SELECT kind, coalesce(payload, '{}'::jsonb), priority, max_attempts, 'schedule:' || name || '@' || was::text FROM fired
ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL AND status IN ('pending', 'leased', 'scheduled') DO NOTHING
RETURNING id;

-- name: prune_window
-- Delete done/dead/cancelled rows finished over $3 seconds ago among ids [$1, $2), and their attempts; says whether the window reached young rows.
WITH w AS (
    SELECT id, status, finished_at, created_at FROM gpuq.jobs WHERE id >= $1 AND id < $2
), del AS (
    DELETE FROM gpuq.jobs j USING w
    WHERE j.id = w.id AND w.status IN ('done', 'dead', 'cancelled') AND w.finished_at < now() - make_interval(secs => $3)
    RETURNING j.id
), attempts_gone AS (  -- their failed attempts go with them
    DELETE FROM gpuq.attempts a WHERE a.job_id >= $1 AND a.job_id < $2 AND a.job_id IN (SELECT id FROM del)
)
SELECT (SELECT count(*) FROM del) AS deleted,
       coalesce((SELECT bool_or(created_at >= now() - make_interval(secs => $3)) FROM w), false) AS reached_young,
       (SELECT max(id) FROM gpuq.jobs) AS max_id;

-- name: min_job_id
-- The oldest job id (the primary key's first entry), where retention starts.
SELECT min(id) FROM gpuq.jobs;

-- name: status_counts
-- Live counts and the oldest row per state and kind, each branch from its own partial index.
SELECT 'pending' AS status, kind, sum(n)::bigint AS n, min(oldest) AS oldest FROM (
    SELECT kind, count(*) AS n, min(created_at) AS oldest
      FROM gpuq.jobs WHERE status = 'pending' AND shape IS NULL GROUP BY kind
    UNION ALL
    SELECT kind, count(*), min(created_at) FROM gpuq.jobs WHERE status = 'pending' AND shape IS NOT NULL GROUP BY kind
) AS pending GROUP BY kind
UNION ALL
SELECT 'leased', kind, count(*), min(started_at) FROM gpuq.jobs WHERE status = 'leased' GROUP BY kind
UNION ALL
SELECT 'scheduled', kind, count(*), min(run_at) FROM gpuq.jobs WHERE status = 'scheduled' GROUP BY kind;

-- name: backlog
-- Per kind and placement shape (plain jobs: shape NULL; every gpuq.shapes row, 0 when none wait): pending jobs counted up to $1, and the longest the next job of any of its first $2 priority levels has been due. Index probes only (loose scans of jobs_pending_idx and jobs_placed_idx): O(kinds and shapes x levels + $1), whatever the backlog.
WITH RECURSIVE kinds AS (  -- each kind with plain jobs pending, one descent each
    (SELECT kind FROM gpuq.jobs WHERE status = 'pending' AND shape IS NULL ORDER BY kind, (-priority), id LIMIT 1)
    UNION ALL
    SELECT n.kind FROM kinds k CROSS JOIN LATERAL (
        SELECT j.kind FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NULL AND j.kind > k.kind
        ORDER BY j.kind, (-j.priority), j.id LIMIT 1) AS n
), plain_heads AS (  -- per kind, the next job of each priority level, highest first
    SELECT k.kind, n.rank, n.run_at, 1 AS level FROM kinds k CROSS JOIN LATERAL (
        SELECT (-j.priority) AS rank, j.run_at FROM gpuq.jobs j
        WHERE j.status = 'pending' AND j.shape IS NULL AND j.kind = k.kind
        ORDER BY (-j.priority), j.id LIMIT 1) AS n
    UNION ALL
    SELECT h.kind, n.rank, n.run_at, h.level + 1 FROM plain_heads h CROSS JOIN LATERAL (
        SELECT (-j.priority) AS rank, j.run_at FROM gpuq.jobs j
        WHERE j.status = 'pending' AND j.shape IS NULL AND j.kind = h.kind AND (-j.priority) > h.rank
        ORDER BY (-j.priority), j.id LIMIT 1) AS n
    WHERE h.level < $2
), placed_heads AS (  -- per shape, the next job of each priority level, highest first
    SELECT s.kind, s.shape, n.priority, n.run_at, 1 AS level FROM gpuq.shapes s CROSS JOIN LATERAL (
        SELECT j.priority, j.run_at FROM gpuq.jobs j
        WHERE j.status = 'pending' AND j.shape IS NOT NULL AND j.kind = s.kind AND j.shape = s.shape
        ORDER BY j.priority DESC, j.id LIMIT 1) AS n
    UNION ALL
    SELECT h.kind, h.shape, n.priority, n.run_at, h.level + 1 FROM placed_heads h CROSS JOIN LATERAL (
        SELECT j.priority, j.run_at FROM gpuq.jobs j
        WHERE j.status = 'pending' AND j.shape IS NOT NULL AND j.kind = h.kind AND j.shape = h.shape
          AND j.priority < h.priority
        ORDER BY j.priority DESC, j.id LIMIT 1) AS n
    WHERE h.level < $2
)
SELECT p.kind, NULL::text AS shape, 0::int2 AS gpus, NULL::int4 AS gpu_memory_mb, '{}'::text[] AS labels,
       NULL::text AS model, false AS keyed,
       (SELECT count(*) FROM (SELECT FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NULL
                              AND j.kind = p.kind LIMIT $1) AS c) AS pending,
       p.waited
FROM (SELECT kind, max(greatest(0, extract(epoch FROM now() - run_at)))::float8 AS waited
      FROM plain_heads GROUP BY kind) AS p
UNION ALL
SELECT s.kind, s.shape, s.gpus, s.gpu_memory_mb, s.labels, s.model, s.keyed,
       (SELECT count(*) FROM (SELECT FROM gpuq.jobs j WHERE j.status = 'pending' AND j.shape IS NOT NULL
                              AND j.kind = s.kind AND j.shape = s.shape LIMIT $1) AS c),
       p.waited
FROM gpuq.shapes s
LEFT JOIN (SELECT kind, shape, max(greatest(0, extract(epoch FROM now() - run_at)))::float8 AS waited
           FROM placed_heads GROUP BY kind, shape) AS p ON p.kind = s.kind AND p.shape = s.shape;

-- name: table_estimate
-- The planner's row estimate of gpuq.jobs (O(1), approximate) and the server's clock.
SELECT greatest(c.reltuples, 0)::bigint AS estimate, now() AS now FROM pg_class c
WHERE c.oid = 'gpuq.jobs'::regclass;

-- name: plan_guards
-- The planner guards for this transaction only: what a transaction pooler lets stick (docs/design.md).
SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off; SET LOCAL jit = off;

-- name: ping
-- Is the connection alive?
SELECT 1;

-- name: migrations_lock
-- Take the session advisory lock that makes concurrent migrators take turns (key $1).
SELECT pg_advisory_lock($1);

-- name: migrations_unlock
-- Release the migrators' advisory lock (key $1).
SELECT pg_advisory_unlock($1);

-- name: migrations_bootstrap
-- The schema and the table that records applied migrations.
CREATE SCHEMA IF NOT EXISTS gpuq;
CREATE TABLE IF NOT EXISTS gpuq.schema_migrations (
    version    text PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migrations_tracked
-- Whether the migrations table exists (an unmigrated database has none).
SELECT to_regclass('gpuq.schema_migrations') IS NOT NULL;

-- name: migrations_applied
-- Applied migrations and their checksums.
SELECT version, checksum FROM gpuq.schema_migrations;

-- name: migration_record
-- Record migration $1 ($2, checksum $3) as applied.
INSERT INTO gpuq.schema_migrations (version, name, checksum) VALUES ($1, $2, $3);
