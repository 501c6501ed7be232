-- Issue #33, part 4: bad GPUs are quarantined.
--
-- A device is named by its agent's name (hello.agent, stable across the
-- agent's reconnects, unlike a connection's id) and the index the agent gave
-- it in its hello. Faults reported by agents (protocol 9: the handler's
-- DeviceError, an Xid or an uncorrectable ECC error NVML read) are kept per
-- device for the quarantine window only; a device that reaches the threshold
-- (an Xid or ECC fault at once) gets a row in gpuq.quarantined_devices, which
-- every server reads when the agent connects and again when a notification
-- ('quarantine:<agent>' on gpuq_jobs) says it changed. Placement never gives a
-- quarantined device new work; an admin clears it (gpuq device clear, the
-- dashboard). None of this is on the per-job path: faults are rare.
CREATE TABLE gpuq.device_faults (
    agent  text NOT NULL,
    device integer NOT NULL,
    source text NOT NULL CHECK (source IN ('handler', 'xid', 'ecc')),
    error  text,
    job_id bigint,  -- the job whose handler raised DeviceError (none for Xid/ECC)
    at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX device_faults_idx ON gpuq.device_faults (agent, device, at);

CREATE TABLE gpuq.quarantined_devices (
    agent  text NOT NULL,
    device integer NOT NULL,
    reason text NOT NULL,                -- what the operator reads in /status and the dashboard
    faults integer NOT NULL DEFAULT 0,   -- faults within the window when it was quarantined (0: by hand)
    since  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent, device)
);

-- The devices ('agent:index') of the job's last failed attempt: its next
-- attempt goes to another device when one that fits is free (docs/design.md,
-- "Quarantine"). NULL for nearly every job: no index, no cost on the hot path.
ALTER TABLE gpuq.jobs ADD COLUMN failed_devices text[];
