-- Producers NOTIFY only when a dispatcher needs the wake-up (docs/design.md,
-- "Wake-ups"). PostgreSQL serializes the commits of every transaction that
-- issued NOTIFY, through its WAL flush, so a producer that notifies while the
-- dispatchers are busy leasing pays for nothing.

-- Until when (the server's clock, epoch milliseconds) some dispatcher waits for
-- notifications. A sequence, because its value is not MVCC: a reader sees the
-- latest setval whatever its snapshot or isolation level, and setting it leaves
-- no dead row version behind for an old snapshot to keep.
CREATE SEQUENCE gpuq.wake_until AS bigint MINVALUE 0 START 0;

-- Per dispatcher (its LISTEN connection's backend pid) and kind, the priority
-- its lease cursor has reached. A job inserted above a floor would sit behind
-- that cursor, so its insert notifies (and the dispatcher starts the kind from
-- the top) even while no dispatcher waits. Rows change only when a cursor
-- moves to another priority; a row left by a dead dispatcher costs extra
-- notifications, nothing else, and the next dispatcher to start removes it.
CREATE UNLOGGED TABLE gpuq.lease_floors (
    kind       text NOT NULL,
    dispatcher int NOT NULL,
    priority   smallint NOT NULL,
    PRIMARY KEY (kind, dispatcher)
);

-- The lowest floor of all (32767: none). A job at or below it cannot be
-- above any floor, so the trigger skips the lookup. Kept by set_floors and clear_floors, which take turns under an advisory
-- lock so that each sees the others' floors when it sets it.
CREATE SEQUENCE gpuq.lowest_floor AS integer MINVALUE -32768 MAXVALUE 32767 START 32767;

CREATE FUNCTION gpuq.refresh_lowest_floor() RETURNS void
LANGUAGE sql AS $$
    SELECT setval('gpuq.lowest_floor', coalesce((SELECT min(priority) FROM gpuq.lease_floors), 32767))
$$;

-- Dispatcher d's lease cursors reached these priorities in these kinds.
CREATE FUNCTION gpuq.set_floors(d int, kinds text[], priorities smallint[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('gpuq.lease_floors'));
    INSERT INTO gpuq.lease_floors (kind, dispatcher, priority)
    SELECT f.kind, d, f.priority FROM unnest(kinds, priorities) AS f(kind, priority)
    ON CONFLICT (kind, dispatcher) DO UPDATE SET priority = excluded.priority;
    PERFORM gpuq.refresh_lowest_floor();
END
$$;

-- Remove dispatcher d's floors and those of dispatchers whose connection is gone.
CREATE FUNCTION gpuq.clear_floors(d int) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('gpuq.lease_floors'));
    DELETE FROM gpuq.lease_floors
    WHERE dispatcher = d OR dispatcher NOT IN (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL);
    PERFORM gpuq.refresh_lowest_floor();
END
$$;

-- The transactions that hold a write lock on gpuq.jobs now: any that inserted
-- jobs and has not ended is among them (an INSERT takes the lock before it
-- draws an id or writes a row, and keeps it to the end of its transaction).
CREATE FUNCTION gpuq.jobs_writers() RETURNS text[]
LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(array_agg(DISTINCT x.transactionid::text), '{}')
    FROM pg_locks r
    JOIN pg_locks x ON x.pid = r.pid AND x.locktype = 'transactionid'
    WHERE r.locktype = 'relation' AND r.relation = 'gpuq.jobs'::regclass
      AND r.mode = 'RowExclusiveLock' AND r.pid <> pg_backend_pid()
      AND r.database = (SELECT oid FROM pg_database WHERE datname = current_database())
$$;

-- Sequences are read with pg_sequence_last_value, never SELECT ... FROM: that
-- is a sequential scan, which gpuq's sessions price out (enable_seqscan = off),
-- and a plan priced that high is JIT-compiled on every call (100 ms of CPU in
-- every producer's insert, measured).

-- The highest job id drawn so far, then the writers of jobs: once those have
-- ended, every job with an id up to last_id has committed or rolled back, so a
-- lease cursor may pass it (no job can commit behind the cursor later).
CREATE FUNCTION gpuq.insert_horizon(OUT last_id bigint, OUT writers text[])
LANGUAGE plpgsql AS $$
BEGIN
    last_id := coalesce(pg_sequence_last_value('gpuq.jobs_id_seq'), 0);
    writers := gpuq.jobs_writers();
END
$$;

-- A dispatcher about to wait declares it for ttl_ms: the mark only ever moves
-- forward (arms take turns under an advisory lock). Returns the server's clock
-- (ms), the mark before and after, and the stragglers: transactions that hold
-- a write lock on gpuq.jobs now, so may have read the mark before it moved and
-- inserted without notifying. The dispatcher must see them end and lease once
-- more before it waits (the argument is in docs/design.md).
CREATE FUNCTION gpuq.arm_wakeups(ttl_ms bigint, OUT now_ms bigint, OUT previous bigint,
                                 OUT until bigint, OUT stragglers text[])
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('gpuq.wake_until'));
    now_ms := (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    previous := coalesce(pg_sequence_last_value('gpuq.wake_until'), 0);
    until := greatest(previous, now_ms + ttl_ms);
    PERFORM setval('gpuq.wake_until', until);
    stragglers := gpuq.jobs_writers();
END
$$;

-- The insert trigger of migrations 0001/0004 ran for every statement, built a
-- transition table and queried it: 15 % of a single-row insert's cost while
-- nobody waited. Its two successors run no function at all in that case;
-- each test is a WHEN condition, evaluated after the rows are written (the
-- no-lost-wake-up argument needs that order).
DROP TRIGGER jobs_notify_inserted ON gpuq.jobs;
DROP FUNCTION gpuq.notify_inserted();

-- While a dispatcher waits: one NOTIFY per statement, '+' (new jobs, kinds not
-- named: the dispatcher leases for every group and keeps its cursors).
CREATE FUNCTION gpuq.notify_waiting() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('gpuq_jobs', '+');
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_wake_waiting
    AFTER INSERT ON gpuq.jobs
    FOR EACH STATEMENT
    WHEN (coalesce(pg_sequence_last_value('gpuq.wake_until'), 0)
          > (extract(epoch FROM clock_timestamp()) * 1000)::bigint)
    EXECUTE FUNCTION gpuq.notify_waiting();

-- Above a floor: 'kind@priority', whether or not anyone waits, so that the
-- dispatcher whose cursor the job landed behind starts that kind from the top.
-- Floors are never below 0 (a lease cursor does not go below priority 0), so
-- a job of priority 0 or less is never above one: for those, and for all jobs
-- while the lowest floor is higher, the WHEN condition alone answers.
-- (PostgreSQL sends one of a transaction's identical payloads.)
CREATE FUNCTION gpuq.notify_above_floor() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM gpuq.lease_floors f WHERE f.kind = NEW.kind AND f.priority < NEW.priority) THEN
        PERFORM pg_notify('gpuq_jobs', NEW.kind || '@' || NEW.priority);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_above_floor
    AFTER INSERT ON gpuq.jobs
    FOR EACH ROW
    WHEN (NEW.priority > 0 AND NEW.status = 'pending'
          AND NEW.priority > coalesce(pg_sequence_last_value('gpuq.lowest_floor'), 32767))
    EXECUTE FUNCTION gpuq.notify_above_floor();
