"""Awaiting results (issue #15): woken by the outcome notification, never by a poll."""

import anyio
import pytest

import gpuq
from gpuq import queue
from tests.helpers import add_pending, expire_leases, wait_for

LEASE = 30.0


async def lease_one(conn, max_attempts: int = 5):
    [job_id] = await add_pending(conn, 1)
    await conn.execute("UPDATE gpuq.jobs SET max_attempts = $2 WHERE id = $1", job_id, max_attempts)
    [leased] = (await queue.lease(conn, ["train"], 1, "a#1", LEASE)).jobs
    return leased


async def waiting(pool, n: int) -> None:
    """Wait until ``n`` waiters wait: each LISTENs, then reads its job's outcome, then idles."""
    from gpuq.sql import queries

    async def idle_after_reading() -> bool:
        return await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' AND query = $1",
                                   queries["job_outcome"]) >= n

    await wait_for(idle_after_reading)


async def test_a_waiter_is_woken_by_the_batch_that_completes_its_job(dsn, pool, live_conn):
    job = await lease_one(live_conn)
    got = []

    async def waiter():
        got.append(await gpuq.wait(dsn, job.id, timeout=30))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await waiting(pool, 1)
        assert got == []
        await queue.complete_many(pool, [(job.id, job.lease_token, {"loss": 0.1})])
        await wait_for(lambda: got, timeout=5)  # a notification, not the 30 s timeout
    assert got == [{"loss": 0.1}]
    assert await gpuq.wait(pool, job.id) == {"loss": 0.1}  # already done: at once


async def test_dead_cancelled_and_timed_out_are_typed_errors(dsn, pool, live_conn):
    dead = await lease_one(live_conn)
    await queue.fail_many(pool, [(dead.id, dead.lease_token, "CUDA error", False)])
    with pytest.raises(gpuq.JobDead, match="CUDA error") as err:
        await gpuq.wait(pool, dead.id, timeout=5)
    assert err.value.job["status"] == "dead"
    [pending] = await add_pending(live_conn, 1)
    await gpuq.cancel(pool, pending)
    with pytest.raises(gpuq.JobCancelled):
        await gpuq.wait(pool, pending, timeout=5)
    [slow] = await add_pending(live_conn, 1)
    with pytest.raises(gpuq.WaitTimeout), anyio.fail_after(5):
        await gpuq.wait(dsn, slow, timeout=0.2)
    with pytest.raises(TimeoutError):  # a WaitTimeout is a TimeoutError too
        await gpuq.wait(dsn, slow, timeout=0.01)
    with pytest.raises(gpuq.JobError, match="no job"):
        await gpuq.wait(dsn, 10**9, timeout=1)


async def test_a_job_that_dies_in_maintenance_or_is_cancelled_wakes_its_waiter(dsn, pool, live_conn):
    expiring = await lease_one(live_conn, max_attempts=1)
    cancelled = await lease_one(live_conn)
    outcomes = {}

    async def waiter(job_id):
        try:
            await gpuq.wait(dsn, job_id, timeout=30)
        except gpuq.JobError as exc:
            outcomes[job_id] = type(exc).__name__

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, expiring.id)
        tg.start_soon(waiter, cancelled.id)
        await waiting(pool, 2)
        with anyio.fail_after(5):
            await expire_leases(live_conn, [expiring.id])
            assert (await queue.reclaim_expired(pool, 10)).dead == [expiring.id]
            await gpuq.cancel(pool, cancelled.id)
            await wait_for(lambda: len(outcomes) == 2)
    assert outcomes == {expiring.id: "JobDead", cancelled.id: "JobCancelled"}


@pytest.mark.parametrize("through", ["dsn", "pool"])
async def test_a_waiter_whose_connection_dies_connects_again_and_gets_the_result(dsn, pool, live_conn, through):
    """A restart or a failover ends the waiter's connection: it connects again, LISTENs again,
    reads the job again, and returns the result as soon as it is there (it once waited out its
    whole timeout)."""
    from gpuq import db
    from gpuq.sql import queries

    job = await lease_one(live_conn)
    got = []
    source = dsn if through == "dsn" else await db.create_pool(dsn, min_size=1, max_size=2)

    async def waiter():
        got.append(await gpuq.wait(source, job.id, timeout=60))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await waiting(pool, 1)
            await live_conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                    "WHERE state = 'idle' AND query = $1", queries["job_outcome"])
            await waiting(pool, 1)  # a new connection, listening and reading again
            await queue.complete_many(pool, [(job.id, job.lease_token, {"loss": 0.2})])
            with anyio.fail_after(5):  # a notification, not the 60 s timeout
                await wait_for(lambda: got, timeout=5)
    finally:
        if through == "pool":
            await source.close()
    assert got == [{"loss": 0.2}]


async def test_a_waiter_on_a_connection_it_was_given_says_when_that_connection_dies(dsn, pool, live_conn):
    """Not a hang: the caller's connection is the caller's to replace."""
    from gpuq import db

    job = await lease_one(live_conn)
    conn = await db.connect(dsn)
    try:
        async with anyio.create_task_group() as tg:
            async def killer():
                await waiting(pool, 1)
                await live_conn.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())

            tg.start_soon(killer)
            with pytest.raises(db.DatabaseUnavailable, match="lost"), anyio.fail_after(10):
                await gpuq.wait(conn, job.id, timeout=60)
    finally:
        await conn.close()
