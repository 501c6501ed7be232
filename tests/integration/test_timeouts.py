"""Execution timeouts (issue #15): the agent stops the handler; the server backs it up."""

import json
import time
from datetime import timedelta

import anyio
import pytest

import gpuq
from gpuq import admin, plans, queue, wakeups
from gpuq.harness import running_server
from gpuq.jobs import NewJob
from gpuq.maintenance.deadlines import ExpireDeadlines
from gpuq.protocol import job_message, jobs_frame, parse_server
from gpuq.sql import queries
from tests.helpers import async_until_cancelled, job, sync_until_cancelled, wait_status

LEASE = 30.0
TOKEN = "00000000-0000-0000-0000-000000000000"


def test_a_timeout_must_be_a_positive_number_of_seconds():
    with pytest.raises(ValueError, match="timeout"):
        NewJob("train", timeout_seconds=0)


async def test_the_lease_sets_the_deadline_and_pushes_the_timeout(live_conn):
    job_id = await gpuq.enqueue(live_conn, "train", {}, timeout_seconds=90)
    [leased] = (await queue.lease(live_conn, ["train"], 1, "a#1", LEASE)).jobs
    assert leased.timeout_seconds == 90
    row = await job(live_conn, job_id)
    assert row["deadline_at"] - row["started_at"] == timedelta(seconds=90)
    pushed = json.loads(job_message(leased.id, leased.lease_token, "train", "{}", 1, leased.timeout_seconds))
    assert pushed["timeout"] == 90 and parse_server(jobs_frame([job_message(1, TOKEN, "t", "{}", 1, 90)])).jobs[0].timeout == 90


async def test_an_async_handler_past_its_timeout_is_stopped_and_the_attempt_fails(dsn, pool):
    stopped = anyio.Event()
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, async_until_cancelled(stopped))
        t0 = time.monotonic()
        job_id = await gpuq.enqueue(pool, "train", {}, timeout_seconds=1)
        with anyio.fail_after(10):
            await stopped.wait()
        assert 0.9 < time.monotonic() - t0 < 5
        await wait_status(pool, job_id, "scheduled")  # retried after the backoff, like any failure
        row = await job(pool, job_id)
        assert (row["last_error"], row["attempts"]) == ("timeout", 1)


async def test_a_sync_handler_sees_job_cancelled_at_its_timeout(dsn, pool):
    seen = []
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, sync_until_cancelled(seen, "partial"))
        job_id = await gpuq.enqueue(pool, "train", {}, max_attempts=1, timeout_seconds=1)
        await wait_status(pool, job_id, "dead")
        assert seen == [True] and (await job(pool, job_id))["last_error"] == "timeout"


async def test_the_server_fails_an_attempt_past_deadline_and_grace_while_it_is_heartbeated(dsn, live_conn):
    from tests.conftest import Notifications

    heard = Notifications()
    await live_conn.add_listener(wakeups.NOTIFY_CHANNEL, heard._on_notify)
    retry = await gpuq.enqueue(live_conn, "train", {}, timeout_seconds=5)
    last = await gpuq.enqueue(live_conn, "train", {}, timeout_seconds=5, max_attempts=1)
    held = (await queue.lease(live_conn, ["train"], 2, "a#1", LEASE)).jobs
    await live_conn.execute("UPDATE gpuq.jobs SET deadline_at = now() - interval '40 seconds'")
    assert await queue.heartbeat(live_conn, [j.id for j in held], "a#1", LEASE) == {retry, last}  # alive...
    assert await ExpireDeadlines(live_conn, grace_seconds=60).run_once() == {"timed_out": 0}  # within grace
    assert await ExpireDeadlines(live_conn, grace_seconds=30).run_once() == {"timed_out": 2}  # ...but too slow
    assert (await job(live_conn, retry))["status"] == "scheduled"
    assert (await job(live_conn, last))["status"] == "dead"
    assert f"cancel:{retry},{last}" in await heard.drain()  # the agent is told to stop both
    plan = await plans.explain(live_conn, queries["expire_deadlines"], 10, 30.0, 1.0, 300.0)
    # The leased ones, then by id; and whether fair share is on (a probe of gpuq.tenants: charge them?).
    assert plans.plan_indexes(plan) == {"jobs_deadline_idx", "jobs_pkey", "tenants_pkey"}


async def test_a_kind_default_applies_to_jobs_without_their_own(live_conn):
    await admin.set_kind_timeout(live_conn, "render", 120)
    own = await gpuq.enqueue(live_conn, "render", {}, timeout_seconds=30)
    default = await gpuq.enqueue(live_conn, "render", {})
    other = await gpuq.enqueue(live_conn, "train", {})
    got = {j.id: j.timeout_seconds for j in (await queue.lease(live_conn, ["render", "train"], 3, "a#1", LEASE)).jobs}
    assert got == {own: 30, default: 120, other: None}
    assert (await job(live_conn, other))["deadline_at"] is None
    assert await admin.kind_timeouts(live_conn) == {"render": 120}
    await admin.set_kind_timeout(live_conn, "render", None)
    assert await admin.kind_timeouts(live_conn) == {}
    with pytest.raises(ValueError, match="at least 1 second"):
        await admin.set_kind_timeout(live_conn, "render", 0)
