-- Kinds that no dispatcher leases (`gpuq pause` / `gpuq resume`, issue #15).
-- A handful of rows: the lease looks each of its kinds up by primary key. A
-- pause is a row, so it survives restarts and holds for every dispatcher.
CREATE TABLE gpuq.paused_kinds (
    kind      text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text NOT NULL
);
