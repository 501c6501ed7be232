"""Periodic jobs (issue #15): each tick enqueued once across sweepers, one catch-up after downtime."""

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from gpuq import schedules
from gpuq.schedules import Schedule


def test_a_schedule_is_checked_before_it_is_stored():
    with pytest.raises(ValueError, match="bad cron expression"):
        Schedule("nightly", "every night", "train")
    with pytest.raises(ValueError, match="bad job kind"):
        Schedule("nightly", "0 3 * * *", "no spaces")
    with pytest.raises(ValueError, match="max_attempts"):
        Schedule("nightly", "0 3 * * *", "train", max_attempts=0)
    tick = Schedule("x", "*/5 * * * *", "train").next_after(datetime(2026, 12, 5, 7, 36, tzinfo=UTC))
    assert tick == datetime(2026, 12, 5, 7, 40, tzinfo=UTC)


async def make_due(conn, name: str, ago: timedelta) -> None:
    await conn.execute("UPDATE gpuq.schedules SET next_run_at = now() - $2::interval WHERE name = $1", name, ago)


async def test_a_due_schedule_enqueues_its_job_once_and_moves_to_its_next_tick(live_conn):
    first = await schedules.add(live_conn, Schedule("embed-refresh", "*/5 * * * *", "embed", {"full": True},
                                                    priority=3, max_attempts=2), by="ops")
    assert first > datetime.now(UTC) - timedelta(seconds=1)
    with pytest.raises(ValueError, match="exists"):
        await schedules.add(live_conn, Schedule("embed-refresh", "* * * * *", "embed"), by="ops")
    assert await schedules.fire_due(live_conn) == 0  # not due yet
    await make_due(live_conn, "embed-refresh", timedelta(seconds=1))
    assert await schedules.fire_due(live_conn) == 1
    assert await schedules.fire_due(live_conn) == 0  # that tick is spent
    row = await live_conn.fetchrow("SELECT kind, payload::text, priority, max_attempts, status::text, dedup_key "
                                   "FROM gpuq.jobs")
    assert tuple(row)[:5] == ("embed", '{"full": true}', 3, 2, "pending")
    assert row["dedup_key"].startswith("schedule:embed-refresh@")
    [listed] = await schedules.listing(live_conn)
    assert listed["next_run_at"] > await live_conn.fetchval("SELECT now()") and listed["created_by"] == "ops"


async def test_after_downtime_one_catch_up_job_not_one_per_missed_tick(live_conn):
    await schedules.add(live_conn, Schedule("every-minute", "* * * * *", "train"), by="ops")
    await make_due(live_conn, "every-minute", timedelta(days=2))  # 2,880 ticks missed
    assert await schedules.fire_due(live_conn) == 1
    assert await live_conn.fetchval("SELECT count(*) FROM gpuq.jobs") == 1
    now = await live_conn.fetchval("SELECT now()")
    [listed] = await schedules.listing(live_conn)
    assert now < listed["next_run_at"] <= now + timedelta(minutes=1)


async def test_several_sweepers_at_once_enqueue_each_tick_once(live_conn, pool):
    for i in range(20):
        await schedules.add(live_conn, Schedule(f"s{i}", "*/5 * * * *", "train"), by="ops")
    await live_conn.execute("UPDATE gpuq.schedules SET next_run_at = now() - interval '1 second'")
    fired = await asyncio.gather(*(schedules.fire_due(pool) for _ in range(8)))
    assert sum(fired) == 20
    assert await live_conn.fetchval("SELECT count(DISTINCT dedup_key) FROM gpuq.jobs") == 20
    assert await schedules.remove(live_conn, "s0") and not await schedules.remove(live_conn, "s0")
    assert len(await schedules.listing(live_conn)) == 19
