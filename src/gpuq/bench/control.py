"""``gpuq bench control``: how fast job control reaches a running handler.

A ``gpuq serve`` and one agent run in this process (``gpuq.harness``), the
agent's async handler sleeping until cancelled. ``--jobs`` jobs are started,
all running at once, then cancelled one at a time with ``gpuq.cancel``; each
figure is the time from the call (so it includes the cancel's own commit,
an upper bound of commit -> handler) to the handler seeing
``CancelledError`` (one process, one clock). ``lost``: cancels that never
reached their handler within ``--timeout`` (must be 0). Issue #15's target:
``cancel_p99_ms`` <= 1000. (Awaiting results and progress are not built yet,
so their figures are not here.)
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import anyio

import gpuq
from gpuq.bench import common
from gpuq.bench.measure import percentiles
from gpuq.db import create_pool
from gpuq.harness import KIND, running_server


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--jobs", type=common.positive_int, default=200, help="jobs cancelled (default 200)")
        p.add_argument("--timeout", type=common.positive_float, default=10.0,
                       help="seconds a cancel may take before it counts as lost (default 10)")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        return await run(t.dsn, a.jobs, a.timeout)

    common.declare(sub, "control", "cancel -> running handler stopped latency (p50/p99 ms)", __doc__, args, body,
                   report, failures=lambda r: [f"{r['lost']} cancels never reached their handler"] if r["lost"]
                   else [])


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
    stats = percentiles(latencies)
    return {"bench": "control", "jobs": jobs, "cancel_p50_ms": stats.get("p50_ms"),
            "cancel_p90_ms": stats.get("p90_ms"), "cancel_p99_ms": stats.get("p99_ms"),
            "cancel_max_ms": stats.get("max_ms"), "lost": lost, "postgres": settings}


def report(r: dict[str, Any]) -> None:
    common.print_settings(r["postgres"])
    common.print_table(["", "p50 ms", "p90 ms", "p99 ms", "max ms", "lost"],
                       [["cancel call -> handler stopped", r["cancel_p50_ms"], r["cancel_p90_ms"], r["cancel_p99_ms"],
                         r["cancel_max_ms"], r["lost"]]],
                       title=f"control: {r['jobs']} running jobs cancelled one at a time")


if __name__ == "__main__":
    raise SystemExit(common.standalone("control"))
