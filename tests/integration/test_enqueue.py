"""Producers: the NOTIFY trigger, the enqueue helpers, dedup keys and validation."""

import asyncio
from datetime import timedelta

import asyncpg
import pytest

import gpuq
from gpuq import db, queue, wakeups
from gpuq.jobs import NewJob
from tests.helpers import job


async def test_a_1000_row_insert_raises_exactly_one_notification(live_conn, notifications):
    await live_conn.execute(
        "INSERT INTO gpuq.jobs (kind, payload) "
        "SELECT CASE WHEN g % 2 = 0 THEN 'train' ELSE 'render' END, '{}' FROM generate_series(1, 1000) g"
    )
    assert await notifications.drain() == ["+"]  # a dispatcher waits: it leases for every group


async def test_a_bulk_insert_above_a_lease_floor_names_each_kind_and_priority_once(live_conn, notifications):
    await wakeups.set_floors(live_conn, live_conn.get_server_pid(), {"train": 1})
    await live_conn.execute("INSERT INTO gpuq.jobs (kind, priority) SELECT 'train', (g % 4)::smallint "
                            "FROM generate_series(1, 1000) g")
    assert sorted(await notifications.drain()) == ["+", "train@2", "train@3"]


async def test_enqueue_many_returns_ids_in_order_with_one_notification(dsn, notifications):
    jobs = [NewJob("train", {"i": i}, priority=i % 3) for i in range(50)] + [NewJob("render", [1, 2])]
    ids = await gpuq.enqueue_many(dsn, jobs)
    assert len(ids) == 51 and ids == sorted(ids)
    conn = await asyncpg.connect(dsn)
    try:
        rows = {r["id"]: r for r in await conn.fetch("SELECT id, payload::text, priority FROM gpuq.jobs")}
    finally:
        await conn.close()
    assert rows[ids[7]]["payload"] == '{"i": 7}' and rows[ids[7]]["priority"] == 1
    assert rows[ids[50]]["payload"] == "[1, 2]"
    assert await notifications.drain() == ["+"]


async def test_delay_and_run_at_start_scheduled(conn):
    now = await conn.fetchval("SELECT now()")
    delayed = await gpuq.enqueue(conn, "train", {"x": 1}, delay=60)
    later = await gpuq.enqueue(conn, "train", run_at=now + timedelta(hours=1))
    at_once = await gpuq.enqueue(conn, "train")
    assert (await job(conn, delayed))["status"] == "scheduled"
    assert (await job(conn, delayed))["run_at"] >= now + timedelta(seconds=59)
    assert (await job(conn, later))["status"] == "scheduled"
    assert (await job(conn, at_once))["status"] == "pending"
    leased = await queue.lease(conn, ["train"], 10, "a#1", 30)
    assert [j.id for j in leased.jobs] == [at_once]


async def test_dedup_key_returns_the_live_job_until_it_finishes(conn):
    first = await gpuq.enqueue(conn, "train", {"v": 1}, dedup_key="model-7")
    again = await gpuq.enqueue(conn, "train", {"v": 2}, dedup_key="model-7")
    assert again == first
    assert await conn.fetchval("SELECT count(*) FROM gpuq.jobs") == 1
    [j] = (await queue.lease(conn, ["train"], 1, "a#1", 30)).jobs
    assert await gpuq.enqueue(conn, "train", dedup_key="model-7") == first  # leased is live
    await queue.complete(conn, j.id, j.lease_token, None)
    fresh = await gpuq.enqueue(conn, "train", {"v": 3}, dedup_key="model-7")
    assert fresh != first


async def test_dedup_in_a_mixed_batch(conn):
    existing = await gpuq.enqueue(conn, "train", dedup_key="a")
    ids = await gpuq.enqueue_many(conn, [
        NewJob("train", {"n": 0}), NewJob("train", dedup_key="a"), NewJob("train", dedup_key="b"),
        NewJob("train", dedup_key="b"), NewJob("train", {"n": 4}),
    ])
    assert ids[1] == existing and ids[2] == ids[3] and len({ids[0], ids[2], ids[4], existing}) == 4
    assert await conn.fetchval("SELECT count(*) FROM gpuq.jobs") == 4


async def test_concurrent_producers_with_one_dedup_key_get_one_job(pool):
    ids = await asyncio.gather(*(gpuq.enqueue(pool, "train", {"i": i}, dedup_key="same") for i in range(10)))
    assert len(set(ids)) == 1
    assert await pool.fetchval("SELECT count(*) FROM gpuq.jobs") == 1


@pytest.mark.parametrize("bad", [
    dict(kind="has,comma"), dict(kind=""), dict(kind="x" * 129), dict(kind="ok", priority=40000),
    dict(kind="ok", max_attempts=0), dict(kind="ok", delay_seconds=-1),
])
def test_bad_jobs_are_refused_with_a_clear_error(bad):
    with pytest.raises(ValueError):
        NewJob(**bad)


async def test_the_table_refuses_bad_rows_from_plain_sql(conn):
    for bad in ("INSERT INTO gpuq.jobs (kind) VALUES ('a,b')",
                "INSERT INTO gpuq.jobs (kind, status) VALUES ('a', 'leased')",
                "INSERT INTO gpuq.jobs (kind, attempts, max_attempts) VALUES ('a', 3, 2)"):
        with pytest.raises(asyncpg.CheckViolationError):
            async with conn.transaction():  # a savepoint: the test's transaction goes on
                await conn.execute(bad)


async def test_a_bulk_enqueue_is_bounded_by_its_size_not_the_command_timeout(dsn, monkeypatch):
    """GPUQ_COMMAND_TIMEOUT bounds each statement so a hung database is found fast; an enqueue of
    many jobs in one statement gets longer (db.BULK_ROWS_PER_SECOND), or it could never pass."""
    monkeypatch.setenv("GPUQ_COMMAND_TIMEOUT", "0.05")
    async with await db.create_pool(dsn, min_size=1, max_size=1) as pool:
        ids = await queue.enqueue_many(pool, [NewJob("bulk", {"i": i}) for i in range(20_000)])
        assert len(set(ids)) == 20_000
        assert await pool.fetchval("SELECT count(*) FROM gpuq.jobs WHERE kind = 'bulk'", timeout=30) == 20_000
