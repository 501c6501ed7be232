"""``gpuq bench raw``: the physical limit of the lease+complete SQL on this database.

N pending jobs are inserted up front; then ``--workers`` asyncpg connections
each loop ``queue.lease`` (batch ``--batch``) and ``queue.complete_many`` of
what they got, with no websockets and no Python in between, until the queue
is empty. jobs/s = N / (first lease -> last completion committed).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from gpuq import queue
from gpuq.bench.common import (
    add_common_args,
    positive_int,
    print_settings,
    print_table,
    progress,
    reset_gpuq_schema,
    run_bench,
    server_settings,
)
from gpuq.db import connect

KIND = "bench"
LEASE_SECONDS = 300.0

_INSERT_PENDING = """
INSERT INTO gpuq.jobs (kind, payload)
SELECT $1, jsonb_build_object('i', g) FROM generate_series(1, $2::int) AS g
"""
_COUNT_DONE = "SELECT count(*) FROM gpuq.jobs WHERE status = 'done'"
_VACUUM = "VACUUM (ANALYZE) gpuq.jobs"


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "raw", help="jobs/s of the lease + complete SQL alone (the ceiling for serve + agents)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--jobs", type=positive_int, default=100_000, help="jobs to run (default 100000)")
    p.add_argument("--batch", type=positive_int, default=64, help="jobs per lease (default 64)")
    p.add_argument("--workers", type=positive_int, default=2,
                   help="concurrent lease/complete loops, one connection each (default 2)")
    add_common_args(p)
    p.set_defaults(bench=main)


def main(args: argparse.Namespace) -> int:
    async def body(dsn: str) -> dict[str, Any]:
        return await run(dsn, args.jobs, args.batch, args.workers)

    return run_bench(args, body)


async def run(dsn: str, jobs: int, batch: int, workers: int, quiet: bool = False) -> dict[str, Any]:
    await reset_gpuq_schema(dsn)
    conns = [await connect(dsn) for _ in range(workers)]
    try:
        settings = await server_settings(conns[0])
        t0 = time.perf_counter()
        await conns[0].execute(_INSERT_PENDING, KIND, jobs)
        insert_s = time.perf_counter() - t0
        await conns[0].execute(_VACUUM)
        progress(f"inserted {jobs:,} pending jobs in {insert_s:.2f}s; running {workers} workers")

        done = [0] * workers
        leases = [0] * workers

        async def worker(i: int) -> None:
            conn, agent = conns[i], f"raw#{i}"
            while True:
                got = await queue.lease(conn, [KIND], batch, agent, LEASE_SECONDS)
                if not got.jobs:
                    return
                leases[i] += 1
                accepted = await queue.complete_many(conn, [(j.id, j.lease_token, None) for j in got.jobs])
                done[i] += len(accepted)

        async def report() -> None:
            while True:
                await asyncio.sleep(2.0)
                progress(f"{sum(done):,}/{jobs:,} done")

        reporter = asyncio.create_task(report())
        start = time.perf_counter()
        try:
            await asyncio.gather(*(worker(i) for i in range(workers)))
        finally:
            reporter.cancel()
        elapsed = time.perf_counter() - start
        committed = await conns[0].fetchval(_COUNT_DONE)
    finally:
        for c in conns:
            await c.close()

    if committed != jobs:
        raise RuntimeError(f"raw: {committed} jobs done, expected {jobs}")
    result = {
        "bench": "raw",
        "jobs": jobs,
        "batch": batch,
        "workers": workers,
        "elapsed_s": round(elapsed, 3),
        "insert_s": round(insert_s, 3),
        "raw_jobs_per_s": round(jobs / elapsed, 1),
        "leases": sum(leases),
        "postgres": settings,
    }
    if quiet:
        return result
    print_settings(settings)
    print_table(["jobs", "batch", "workers", "insert s", "consume s", "jobs/s"],
                [[jobs, batch, workers, result["insert_s"], result["elapsed_s"],
                  result["raw_jobs_per_s"]]],
                title="raw: lease + complete_many over asyncpg, no websockets")
    return result
