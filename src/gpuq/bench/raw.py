"""``gpuq bench raw``: the physical limit of the lease+complete SQL on this database.

N pending jobs are inserted up front; then ``--workers`` asyncpg connections
each loop ``queue.lease`` (batch ``--batch``) and ``queue.complete_many`` of
what they got, with no websockets and no Python in between, until the queue
is empty. jobs/s = N / (first lease -> last completion committed).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

from gpuq import queue
from gpuq.bench import common
from gpuq.db import connect
from gpuq.harness import KIND

LEASE_SECONDS = 300.0


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--jobs", 100_000, "jobs to run")
        common.positive(p, "--batch", 64, "jobs per lease")
        common.positive(p, "--workers", 2, "concurrent lease/complete loops, one connection each")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        return await run(t.dsn, a.jobs, a.batch, a.workers)

    common.declare(sub, "raw", "jobs/s of the lease + complete SQL alone (the ceiling for serve + agents)",
            __doc__, args, body, report)


async def run(dsn: str, jobs: int, batch: int, workers: int) -> dict[str, Any]:
    await common.reset_gpuq_schema(dsn)
    conns = [await connect(dsn) for _ in range(workers)]
    done, leases = [0] * workers, [0] * workers

    async def worker(i: int) -> None:
        while got := (await queue.lease(conns[i], [KIND], batch, f"raw#{i}", LEASE_SECONDS)).jobs:
            leases[i] += 1
            done[i] += len(await queue.complete_many(conns[i], [(j.id, j.lease_token, None) for j in got]))

    try:
        settings = await common.server_settings(conns[0])
        t0 = time.perf_counter()
        await conns[0].execute(common.queries["insert_pending"], KIND, jobs)
        insert_s = time.perf_counter() - t0
        await conns[0].execute(common.queries["vacuum_jobs"])
        common.progress(f"inserted {jobs:,} pending jobs in {insert_s:.2f}s; running {workers} workers")
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(workers):
                tg.start_soon(worker, i)
        elapsed = time.perf_counter() - start
        committed = await conns[0].fetchval(common.queries["count_done"])
    finally:
        for c in conns:
            await c.close()
    if committed != jobs:
        raise RuntimeError(f"raw: {committed} jobs done, expected {jobs}")
    return {"bench": "raw", "jobs": jobs, "batch": batch, "workers": workers, "elapsed_s": round(elapsed, 3),
            "insert_s": round(insert_s, 3), "raw_jobs_per_s": round(jobs / elapsed, 1), "leases": sum(leases),
            "postgres": settings}


def report(r: dict[str, Any]) -> None:
    common.print_settings(r["postgres"])
    common.print_table(["jobs", "batch", "workers", "insert s", "consume s", "jobs/s"],
                [[r["jobs"], r["batch"], r["workers"], r["insert_s"], r["elapsed_s"], r["raw_jobs_per_s"]]],
                title="raw: lease + complete_many over asyncpg, no websockets")


if __name__ == "__main__":
    raise SystemExit(common.standalone("raw"))
