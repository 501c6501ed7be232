"""Cancelling running jobs (issue #15): the agent's handler stops, the slot frees, the outcome is fenced."""

import asyncio
import os
import time

import anyio

import gpuq
from gpuq.agent import run_process
from gpuq.harness import running_server
from tests.helpers import (
    async_until_cancelled,
    status_of,
    sync_until_cancelled,
    wait_for,
    wait_status,
)


async def started(pool, job_id: int) -> None:
    await wait_status(pool, job_id, "leased")


async def test_an_async_handler_is_cancelled_and_its_slot_serves_the_next_job(dsn, pool):
    began, stopped, ran = anyio.Event(), anyio.Event(), []

    async def handle(job):
        if job.payload.get("long"):
            began.set()
            try:
                await asyncio.sleep(60)  # not a settle wait: the long job, until it is cancelled
            except asyncio.CancelledError:
                stopped.set()
                raise
        ran.append(job.id)

    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, handle)
        long_job = await gpuq.enqueue(pool, "train", {"long": True})
        with anyio.fail_after(10):
            await began.wait()
        t0 = time.monotonic()
        assert await gpuq.cancel(pool, long_job) == {long_job: "leased"}
        with anyio.fail_after(5):
            await stopped.wait()
        assert time.monotonic() - t0 < 5
        nxt = await gpuq.enqueue(pool, "train", {})  # capacity 1: only a freed slot can run it
        await wait_status(pool, nxt, "done")
        assert ran == [nxt] and await status_of(pool, long_job) == "cancelled"


async def test_a_sync_handler_sees_job_cancelled(dsn, pool):
    seen = []
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, sync_until_cancelled(seen, "stopped early"))
        job_id = await gpuq.enqueue(pool, "train", {})
        await started(pool, job_id)
        await gpuq.cancel(pool, job_id)
        await wait_for(lambda: seen, timeout=5)
        assert seen == [True] and await status_of(pool, job_id) == "cancelled"  # its result was fenced out


async def test_a_process_started_with_run_process_is_terminated(dsn, pool, tmp_path):
    pid_file = tmp_path / "pid"

    async def handle(job):
        await run_process("sh", "-c", f"echo $$ > {pid_file}; exec sleep 60", grace_seconds=2)

    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, handle)
        job_id = await gpuq.enqueue(pool, "train", {})
        await wait_for(lambda: pid_file.exists() and pid_file.read_text().strip())
        pid = int(pid_file.read_text())
        await gpuq.cancel(pool, job_id)
        await wait_for(lambda: not _alive(pid), timeout=5)


async def test_a_lease_lost_without_a_notification_is_cancelled_at_the_next_heartbeat(dsn, pool):
    stopped = anyio.Event()
    async with running_server(dsn, poll_seconds=60, heartbeat_seconds=0.2) as srv:
        await srv.agent(["train"], 1, async_until_cancelled(stopped))
        job_id = await gpuq.enqueue(pool, "train", {})
        await started(pool, job_id)
        # Cancelled behind gpuq's back: no notification, only the heartbeat can tell.
        await pool.execute("UPDATE gpuq.jobs SET status = 'cancelled', lease_token = NULL WHERE id = $1", job_id)
        with anyio.fail_after(5):
            await stopped.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two looks (ESRCH on the read)
        return False
