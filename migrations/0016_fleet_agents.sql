-- Placement across servers (issue #29): each gpuq serve keeps here one row per
-- agent connected to it, so every server decides "warm somewhere" (the warm
-- wait) and "unplaceable" (/status) from the whole fleet, not its own agents.
-- Leasing never reads it: a server leases for its own agents from memory.
--
-- Written on agent events (hello, models, labels or devices changed, drain),
-- deleted on disconnect and on a clean stop, never on the per-job path. The
-- server refreshes seen_at of its rows every few seconds; rows not refreshed
-- for longer than the staleness bound (a server that crashed or lost the
-- database) are ignored by readers and pruned by the next refresh of any
-- server. UNLOGGED: a crash or a failover empties it, and each server's next
-- refresh finds its rows gone and writes them again.
CREATE UNLOGGED TABLE gpuq.fleet_agents (
    server      text NOT NULL,                -- the gpuq serve's id (new at each start)
    agent       text NOT NULL,                -- the agent's session id (its jobs' leased_by)
    kinds       text[] NOT NULL,
    protocol    int NOT NULL,                 -- placement needs protocol 4
    devices     int[] NOT NULL DEFAULT '{}',  -- each device's memory in MiB (the count is its length)
    models      text[] NOT NULL DEFAULT '{}', -- the models it holds warm
    labels      text[] NOT NULL DEFAULT '{}',
    draining    boolean NOT NULL DEFAULT false,
    seen_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (server, agent)
);
