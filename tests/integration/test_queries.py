"""sql/queries.sql: the named statements, each prepared against a migrated schema."""

import re
from importlib import resources

import pytest

from gpuq import sql
from gpuq.sql import queries

NAMES = {
    "enqueue_plain", "enqueue_dedup", "lease_slots", "complete_many", "fail_many", "heartbeat",
    "release_agent", "release_unstarted", "release_jobs", "reclaim_expired", "promote_due", "notify", "cancel",
    "prune_window", "min_job_id", "status_counts", "table_estimate", "ping", "plan_guards",
    "migrations_lock", "migrations_unlock", "migrations_bootstrap", "migrations_tracked",
    "migrations_applied", "migration_record", "arm_wakeups", "stragglers_left", "set_floors",
    "clear_floors", "insert_horizon", "pause_kind", "resume_kind", "paused_kinds", "retry_count", "retry",
    "show", "kind_timeout_set", "kind_timeouts", "expire_deadlines", "notify_outcomes", "job_outcome",
    "schedule_add", "schedule_remove", "schedule_list", "schedules_due", "schedules_fire", "record_progress",
    "lease_placed", "shapes", "placed_pending", "placed_head", "limits_lock", "lease_limited", "limit_set", "limits",
    "batch_policy_set", "batch_policies", "batch_head", "batch_head_placed", "lease_batched",
    "job_attempts", "jobs_recent", "jobs_failed", "jobs_live", "jobs_keyed", "max_job_id", "last_agents",
    "fleet_put", "fleet_drop", "fleet_refresh", "fleet_prune", "fleet_others", "backlog",
    "complete_many_charged", "fail_many_charged", "tenant_set", "tenant_weights", "half_life_set", "half_life",
    "tenant_usage", "device_fault", "quarantine_set", "quarantine_clear", "quarantined", "quarantined_of",
    "failed_devices", "move_leases", "record_checkpoints",
    "preempted_many", "preempt", "placed_head_priority", "plain_head_priority", "held_preemption",
    "lease_fair", "lease_placed_fair", "fair_state", "fair_waiting", "tenant_lift",
}
MULTI_STATEMENT = {"migrations_bootstrap", "plan_guards"}  # run as a simple query, never prepared


def test_the_file_holds_exactly_the_named_statements():
    assert set(queries) == NAMES


def test_every_statement_has_a_one_line_description():
    text = resources.files("gpuq.sql").joinpath("queries.sql").read_text()
    described = sql.descriptions(text)
    assert set(described) == NAMES
    assert all(len(d) > 10 for d in described.values())


def test_a_repeated_name_or_an_empty_block_is_refused():
    with pytest.raises(ValueError, match="twice"):
        sql.parse("-- name: a\n-- one\nSELECT 1;\n-- name: a\n-- two\nSELECT 2;\n")
    with pytest.raises(ValueError, match="no statement"):
        sql.parse("-- name: a\n-- one\n")


async def test_every_statement_prepares_against_the_migrated_schema(conn):
    for name, statement in queries.items():
        if name in MULTI_STATEMENT:
            continue
        prepared = await conn.prepare(statement)  # raises on any error in the SQL
        used = {int(n) for n in re.findall(r"\$(\d+)", statement)}
        assert len(prepared.get_parameters()) == max(used, default=0), name
