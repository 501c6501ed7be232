"""Admin actions (issue #15): pause and resume a kind, retry dead jobs."""

from datetime import timedelta

import pytest

from gpuq import admin, queue
from gpuq.jobs import RetryFilter
from tests.helpers import add_pending, expire_leases, job

LEASE = 30.0


async def test_a_paused_kind_is_not_leased_by_either_phase(conn):
    a = await add_pending(conn, 3, kind="a")
    b = await add_pending(conn, 3, kind="b")
    held = await queue.lease(conn, ["a"], 1, "x#1", LEASE)
    await expire_leases(conn, [held.jobs[0].id])  # phase 2 would reclaim it
    assert await admin.pause(conn, "a", by="ops")
    got = await queue.lease(conn, ["a", "b"], 10, "x#1", LEASE)
    assert sorted(j.id for j in got.jobs) == b and got.reclaimed == 0
    assert not await admin.pause(conn, "a", by="ops")  # already paused
    assert await admin.resume(conn, "a")
    again = await queue.lease(conn, ["a", "b"], 10, "x#1", LEASE)
    assert sorted(j.id for j in again.jobs) == a and again.reclaimed == 1


async def test_resume_wakes_the_dispatchers_and_a_pause_shows_in_status(live_conn, notifications):
    assert await admin.pause(live_conn, "render", by="alice")
    status = (await admin.status_counts(live_conn)).as_dict()
    assert status["paused"]["render"]["by"] == "alice" and status["paused"]["render"]["since"]
    assert await admin.resume(live_conn, "render")
    assert not await admin.resume(live_conn, "render")  # not paused any more: nothing to wake
    assert await notifications.drain() == ["render!"]  # its jobs may be behind a cursor
    assert (await admin.status_counts(live_conn)).paused == {}


async def dead(conn, kind: str, error: str, ended_ago: timedelta) -> int:
    return await conn.fetchval(
        "INSERT INTO gpuq.jobs (kind, status, attempts, last_error, finished_at) "
        "VALUES ($1, 'dead', 3, $2, now() - $3::interval) RETURNING id", kind, error, ended_ago)


async def test_retry_sends_matching_dead_jobs_back_with_fresh_attempts(live_conn, notifications):
    oom = await dead(live_conn, "train", "CUDA out of memory", timedelta(hours=1))
    old = await dead(live_conn, "train", "CUDA out of memory", timedelta(days=3))
    other = await dead(live_conn, "render", "CUDA out of memory", timedelta(hours=1))
    await dead(live_conn, "train", "bad input", timedelta(hours=1))
    [pending] = await add_pending(live_conn, 1)
    await notifications.drain()
    now = await live_conn.fetchval("SELECT now()")
    which = RetryFilter(kind="train", error="out of memory", since=now - timedelta(days=1))
    assert await admin.retry_count(live_conn, which) == 1  # a dry run changes nothing
    assert (await job(live_conn, oom))["status"] == "dead"
    assert await admin.retry(live_conn, which) == 1
    row = await job(live_conn, oom)
    assert (row["status"], row["attempts"], row["finished_at"]) == ("pending", 0, None)
    assert await notifications.drain() == ["train!"]
    assert await admin.retry(live_conn, RetryFilter(ids=[old, other, pending])) == 2  # not the pending one
    assert await notifications.drain() == ["render!,train!"]  # one notification, each kind once
    assert await admin.retry(live_conn, which) == 0  # nothing left: no notification either
    assert await notifications.drain() == []


async def test_retry_without_a_criterion_is_refused():
    with pytest.raises(ValueError, match="at least one filter"):
        RetryFilter().args()


async def test_cancel_and_show_from_python_by_dsn(dsn):
    import gpuq

    job_id = await gpuq.enqueue(dsn, "train", {"lr": 0.1})
    assert (await gpuq.show(dsn, job_id))["payload"] == {"lr": 0.1}
    assert await gpuq.cancel(dsn, job_id, job_id) == {job_id: "pending"}
    shown = await gpuq.show(dsn, job_id)
    assert shown["status"] == "cancelled" and shown["finished_at"] is not None
    assert await gpuq.show(dsn, 10**9) is None
