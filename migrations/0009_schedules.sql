-- Periodic jobs (`gpuq schedule add NAME --cron ...`, issue #15). A sweeper
-- enqueues a schedule's job when next_run_at has passed and moves next_run_at
-- to the first tick after now, in one statement that compares and sets it, so
-- each tick is enqueued once however many sweepers run, and after downtime a
-- schedule gets one catch-up job, not one per missed tick.
CREATE TABLE gpuq.schedules (
    name         text PRIMARY KEY CHECK (length(name) BETWEEN 1 AND 128),
    cron         text NOT NULL,
    kind         text NOT NULL CHECK (kind ~ '^[A-Za-z0-9_.:/-]+$' AND length(kind) <= 128),
    payload      jsonb,
    priority     smallint NOT NULL DEFAULT 0,
    max_attempts int NOT NULL DEFAULT 5 CHECK (max_attempts >= 1),
    next_run_at  timestamptz NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    created_by   text NOT NULL
);
CREATE INDEX schedules_next_run_idx ON gpuq.schedules (next_run_at);
