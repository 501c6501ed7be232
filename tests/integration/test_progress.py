"""Progress (issue #15): job.progress() from sync and async handlers, coalesced by the agent,
written at most once per job per second, shown by show, /jobs/ID and /status, streamed to waiters."""

import json
import os
import subprocess
import sys
import threading
import time

import anyio

import gpuq
from gpuq import metrics, queue
from gpuq.harness import TOKEN, http_get, running_server
from gpuq.protocol import ProgressUpdate
from tests.helpers import add_pending, wait_for, wait_status


def written() -> float:
    return metrics.REGISTRY.get_sample_value("gpuq_progress_written_total") or 0.0


async def test_a_sync_handler_reporting_often_is_written_once_a_second_and_streamed(dsn, pool):
    release, reported = threading.Event(), []

    def handle(job):
        for i in range(1, 10_000):  # as fast as it can, until released
            job.progress(min(i / 1000, 1.0), f"step {i}", {"step": i})
            reported.append(i)
            if release.wait(0.005):
                return {"steps": i}
        return None

    streamed: list[dict] = []
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, handle)
        job_id = await gpuq.enqueue(pool, "train", {})
        before, t0 = written(), time.monotonic()
        async with anyio.create_task_group() as tg:
            async def waiter():
                streamed.append({"result": await gpuq.wait(dsn, job_id, timeout=30, on_progress=streamed.append)})

            tg.start_soon(waiter)
            async def three_written():
                return len(streamed) >= 3  # three writes: about 2 s

            await wait_for(three_written, timeout=15)
            shown = await gpuq.show(pool, job_id)
            status = json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])
            code, _, body = await http_get(f"{srv.http}/jobs/{job_id}", token=TOKEN)
            release.set()
        elapsed, writes = time.monotonic() - t0, written() - before
    assert len(reported) > 100  # reported far more often than written
    assert 3 <= writes <= elapsed / 1.0 + 1  # at most one write per job per second
    updates = [s for s in streamed if "fraction" in s]
    steps = [u["data"]["step"] for u in updates]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # the stream moves forward
    assert {u["attempt"] for u in updates} == {1} and updates[0]["message"].startswith("step ")
    assert streamed[-1]["result"]["steps"] >= steps[-1]
    assert shown["progress"]["fraction"] > 0 and set(shown["progress"]) == {"fraction", "message", "data",
                                                                             "attempt", "at"}
    assert code == 200 and json.loads(body)["progress"]["data"]["step"] > 0
    [agent] = status["agents"]
    assert agent["protocol"] >= 3 and agent["progress"][str(job_id)]["message"].startswith("step ")


async def test_an_async_handler_reports_progress_and_the_outcome_drops_it(dsn, pool):
    go = anyio.Event()

    async def handle(job):
        job.progress(0.25, "loading", {"model": "m"})
        await go.wait()
        job.progress(0.9)  # its outcome follows at once: never sent
        return "ok"

    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, handle)
        job_id = await gpuq.enqueue(pool, "train", {})

        async def stored():
            return (await gpuq.show(pool, job_id))["progress"] is not None

        await wait_for(stored)
        shown = await gpuq.show(pool, job_id)
        status = json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])
        shell = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "gpuq.cli", "status", "--server", srv.http], capture_output=True, text=True,
            env={**os.environ, "DATABASE_URL": dsn, "GPUQ_TOKEN": TOKEN}, timeout=60))
        go.set()
        await wait_status(pool, job_id, "done")
        after = json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])
    assert status["agents"][0]["progress"] == {str(job_id): {"fraction": 0.25, "message": "loading"}}
    assert after["agents"][0]["progress"] == {}  # nothing kept for a finished job
    assert f"    job {job_id}: 25% loading" in shell.stdout.splitlines()  # gpuq status --server
    assert shown["progress"]["fraction"] == 0.25 and shown["progress"]["data"] == {"model": "m"}
    assert (await gpuq.show(pool, job_id))["progress"]["fraction"] == 0.25  # the last one stored


async def test_progress_is_fenced_by_the_lease_token(pool, live_conn):
    [job_id] = await add_pending(live_conn, 1)
    [leased] = (await queue.lease(pool, ["train"], 1, "a#1", 30)).jobs
    stale = ProgressUpdate(job_id, "11111111-1111-1111-1111-111111111111", 0.5, None, None)
    assert await queue.record_progress(pool, [stale]) == set()
    good = ProgressUpdate(job_id, leased.lease_token, 0.5, "half", [1, 2])
    assert await queue.record_progress(pool, [good]) == {job_id}
    await queue.complete_many(pool, [(job_id, leased.lease_token, None)])
    assert await queue.record_progress(pool, [good]) == set()  # done: no longer leased
    assert (await gpuq.show(pool, job_id))["progress"]["data"] == [1, 2]
