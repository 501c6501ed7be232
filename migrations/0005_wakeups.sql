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

-- The highest job id drawn so far, then the writers of jobs: once those have
-- ended, every job with an id up to last_id has committed or rolled back, so a
-- lease cursor may pass it (no job can commit behind the cursor later).
CREATE FUNCTION gpuq.insert_horizon(OUT last_id bigint, OUT writers text[])
LANGUAGE plpgsql AS $$
BEGIN
    SELECT last_value INTO last_id FROM gpuq.jobs_id_seq;
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
    SELECT last_value INTO previous FROM gpuq.wake_until;
    until := greatest(previous, now_ms + ttl_ms);
    PERFORM setval('gpuq.wake_until', until);
    stragglers := gpuq.jobs_writers();
END
$$;

-- One NOTIFY per statement, as before, but only while a dispatcher waits, or
-- for a kind whose jobs landed above some dispatcher's lease floor. The mark
-- is read after the rows are written (this is an AFTER trigger), which the
-- no-lost-wake-up argument needs.
CREATE OR REPLACE FUNCTION gpuq.notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    waiting boolean := (SELECT last_value FROM gpuq.wake_until)
                       > (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    kinds text;
BEGIN
    SELECT string_agg(k.kind || '@' || k.top, ',') INTO kinds
    FROM (SELECT kind, max(priority) AS top FROM inserted WHERE status = 'pending' GROUP BY kind) AS k
    WHERE waiting OR EXISTS (SELECT 1 FROM gpuq.lease_floors f WHERE f.kind = k.kind AND f.priority < k.top);
    IF kinds IS NOT NULL THEN
        PERFORM pg_notify('gpuq_jobs', CASE WHEN length(kinds) > 7000 THEN '*' ELSE kinds END);
    END IF;
    RETURN NULL;
END
$$;
