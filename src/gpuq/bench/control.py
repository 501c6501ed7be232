"""``gpuq bench control``: how fast job control reaches a running handler.

A ``gpuq serve`` and one agent run in this process (``gpuq.harness``), the
agent's async handler sleeping until cancelled. ``--jobs`` jobs are started,
all running at once, then cancelled one at a time with ``gpuq.cancel``; each
figure is the time from the call (so it includes the cancel's own commit,
an upper bound of commit -> handler) to the handler seeing
``CancelledError`` (one process, one clock). Then ``--jobs`` waiters: each
job is leased, ``gpuq.wait`` starts, the job is completed with the
completer's statement, and the figure is from that call (so it includes the
statement and its commit: an upper bound of commit -> waiter) to ``wait``
returning. ``lost``: cancels or waits that did not arrive within
``--timeout`` (must be 0).

Progress on the hot path: ``--progress-jobs`` no-op jobs end to end through
real ``gpuq serve`` and 2 agent processes of capacity 64 (``gpuq bench
throughput``'s measure), once with the plain no-op handler and once with one
that reports progress twice (``gpuq.bench.handlers:progress``), alternating
for ``--rounds`` rounds; ``progress_throughput_ratio`` is the median jobs/s
with progress over the median without. ``progress_rows``: jobs of the last
progress run whose progress the server stored (the rest ended before the
agent's next send).

Issue #15's targets: ``cancel_p99_ms`` <= 1000, ``wait_p50_ms`` <= 5,
``progress_throughput_ratio`` >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import anyio

import gpuq
from gpuq import queue
from gpuq.bench import common, throughput
from gpuq.bench.measure import percentiles
from gpuq.db import connect, create_pool
from gpuq.harness import KIND, running_server


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--jobs", 200, "jobs cancelled")
        common.positive(p, "--timeout", 10.0, "seconds a cancel may take before it counts as lost")
        common.positive(p, "--progress-jobs", 20_000, "no-op jobs per throughput run, with and without progress")
        common.positive(p, "--rounds", 2, "throughput runs of each, alternating")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        result = await run(t.dsn, a.jobs, a.timeout)
        result.update(await measure_progress_throughput(t.dsn, a.progress_jobs, a.rounds))
        return result

    common.declare(sub, "control", "cancel -> running handler stopped, and outcome -> waiter, latency (ms)",
                   __doc__, args, body, report,
                   failures=lambda r: [f"{r['lost']} cancels or waits never arrived"] if r["lost"] else [])


async def run(dsn: str, jobs: int, timeout: float) -> dict[str, Any]:
    await common.reset_gpuq_schema(dsn)
    stopped: dict[int, anyio.Event] = {}
    started: set[int] = set()
    seen_at: dict[int, float] = {}

    async def handle(job: Any) -> None:
        started.add(job.id)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen_at[job.id] = time.perf_counter()
            stopped[job.id].set()
            raise

    latencies, lost = [], 0
    async with await create_pool(dsn, min_size=1, max_size=4) as pool:
        settings = await common.server_settings(pool)
        async with running_server(dsn, poll_seconds=1) as srv:
            await srv.agent([KIND], jobs, handle)
            ids = await gpuq.enqueue_many(pool, [gpuq.NewJob(KIND, {}) for _ in range(jobs)])
            stopped.update({i: anyio.Event() for i in ids})
            with anyio.fail_after(60):
                while len(started) < jobs:
                    await anyio.sleep(0.01)
            common.progress(f"{jobs} jobs running: cancelling them one at a time")
            for job_id in ids:
                asked = time.perf_counter()  # the call, not its return: serve runs in this loop too
                await gpuq.cancel(pool, job_id)
                with anyio.move_on_after(timeout):
                    await stopped[job_id].wait()
                if job_id in seen_at:
                    latencies.append((seen_at[job_id] - asked) * 1000)
                else:
                    lost += 1
        waits, wait_lost = await measure_waits(pool, jobs, timeout)
    stats, wait = percentiles(latencies), percentiles(waits)
    return {"bench": "control", "jobs": jobs, "cancel_p50_ms": stats.get("p50_ms"),
            "cancel_p90_ms": stats.get("p90_ms"), "cancel_p99_ms": stats.get("p99_ms"),
            "cancel_max_ms": stats.get("max_ms"), "wait_p50_ms": wait.get("p50_ms"),
            "wait_p90_ms": wait.get("p90_ms"), "wait_p99_ms": wait.get("p99_ms"),
            "wait_max_ms": wait.get("max_ms"), "lost": lost + wait_lost, "postgres": settings}


async def measure_waits(pool: Any, jobs: int, timeout: float) -> tuple[list[float], int]:
    """Outcome committed -> ``gpuq.wait`` returns: each job leased, a waiter started, then completed."""
    common.progress(f"{jobs} waiters, each woken by its job's completion")
    latencies, lost = [], 0
    for _ in range(jobs):
        job_id = await gpuq.enqueue(pool, KIND, {})
        [job] = (await queue.lease(pool, [KIND], 1, "bench#1", 60)).jobs
        returned: list[float] = []

        async def waiter(job_id: int = job_id, returned: list[float] = returned) -> None:
            await gpuq.wait(pool, job_id, timeout=timeout)
            returned.append(time.perf_counter())

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.005)  # it has read the job and waits
            called = time.perf_counter()  # the call, not its return: the waiter runs in this loop too
            await queue.complete_many(pool, [(job.id, job.lease_token, None)])
        if returned:
            latencies.append((returned[0] - called) * 1000)
        else:
            lost += 1
    return latencies, lost


async def measure_progress_throughput(dsn: str, jobs: int, rounds: int) -> dict[str, Any]:
    """No-op jobs/s end to end, with and without progress reports, alternating in one sitting."""
    runs: dict[str, list[float]] = {"gpuq.demo:noop": [], "gpuq.bench.handlers:progress": []}
    for i in range(rounds):
        for handler, rates in runs.items():
            common.progress(f"round {i + 1}/{rounds}: {jobs:,} jobs, handler {handler}")
            r = await throughput.run_gpuq(dsn, jobs, 2, 64, 10_000, handler=handler)
            rates.append(r["jobs_per_s"])
    conn = await connect(dsn)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE progress IS NOT NULL")
    finally:
        await conn.close()
    plain, reporting = runs.values()
    return {"progress_jobs": jobs, "plain_jobs_per_s": plain, "progress_jobs_per_s": reporting,
            "progress_throughput_ratio": round(common.median(reporting) / common.median(plain), 3),
            "progress_rows": rows}


def report(r: dict[str, Any]) -> None:
    common.print_settings(r["postgres"])
    common.print_table(["", "p50 ms", "p90 ms", "p99 ms", "max ms"],
                       [["cancel call -> handler stopped", r["cancel_p50_ms"], r["cancel_p90_ms"], r["cancel_p99_ms"],
                         r["cancel_max_ms"]],
                        ["completion call -> wait returns", r["wait_p50_ms"], r["wait_p90_ms"], r["wait_p99_ms"],
                         r["wait_max_ms"]]],
                       title=f"control: {r['jobs']} running jobs cancelled one at a time; {r['jobs']} waits")
    print(f"lost: {r['lost']}")
    common.print_table(["", "jobs/s (each run)", "median"],
                       [["no-op", r["plain_jobs_per_s"], common.median(r["plain_jobs_per_s"])],
                        ["no-op + 2 progress reports", r["progress_jobs_per_s"],
                         common.median(r["progress_jobs_per_s"])]],
                       title=f"progress on the hot path: {r['progress_jobs']:,} jobs a run, 2 agents x 64")
    print(f"progress_throughput_ratio: {r['progress_throughput_ratio']}  "
          f"(progress stored for {r['progress_rows']} jobs of the last run)")


if __name__ == "__main__":
    raise SystemExit(common.standalone("control"))
