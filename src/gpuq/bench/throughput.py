"""``gpuq bench throughput``: end-to-end jobs/s, insert -> agent -> result committed.

A real ``gpuq serve`` and ``--agents`` agent processes (``gpuq agent``, no-op
handler, ``--capacity`` each) on 127.0.0.1. Once every agent is connected the
producer inserts ``--jobs`` jobs with ``gpuq.enqueue_many``: in chunks of
10,000 (``--mode bulk``, the queue fills up front) or of 100 back to back
while the agents consume (``--mode stream``). End to end = the database's own
timestamps, max(finished_at) - min(created_at). CPU seconds of serve, the
agents and the PostgreSQL server (when it runs on this machine) over the run.

``--compare pgqueuer`` runs pgqueuer on the same database in the same run:
its consumers idle and listening first, then the same number of jobs
inserted in the same chunks, end to end from its log table's timestamps.
The raw lease+complete ceiling (``gpuq bench raw``, batch = capacity) runs
too, for ``fraction_of_raw``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from gpuq import queue
from gpuq.bench import peer_pgqueuer, procs, raw
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
from gpuq.queue import NewJob

CHUNKS = {"bulk": 10_000, "stream": 100}

# Polled while the agents work: it must cost next to nothing (a count of a
# deep queue every few ms would be the bench competing with the dispatcher).
_ANY_LIVE = """
SELECT EXISTS (SELECT 1 FROM gpuq.jobs WHERE status = 'pending')
    OR EXISTS (SELECT 1 FROM gpuq.jobs WHERE status = 'leased')
    OR EXISTS (SELECT 1 FROM gpuq.jobs WHERE status = 'scheduled')
"""
_LIVE = """
SELECT (SELECT count(*) FROM gpuq.jobs WHERE status = 'pending')
     + (SELECT count(*) FROM gpuq.jobs WHERE status = 'leased')
"""
_E2E = """
SELECT extract(epoch FROM max(finished_at) - min(created_at))::float8 AS seconds,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       count(DISTINCT split_part(leased_by, '#', 1)) AS agents_used
FROM gpuq.jobs
"""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "throughput", help="end-to-end jobs/s through serve + agent processes (optionally vs pgqueuer)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--jobs", type=positive_int, default=100_000, help="jobs (default 100000)")
    p.add_argument("--agents", type=positive_int, default=4, help="agent processes (default 4)")
    p.add_argument("--capacity", type=positive_int, default=64, help="capacity of each agent (default 64)")
    p.add_argument("--mode", choices=sorted(CHUNKS), default="bulk",
                   help="bulk: insert 10,000 a statement up front; stream: 100 a statement "
                        "while consuming (default bulk)")
    p.add_argument("--compare", choices=["pgqueuer"], default=None,
                   help="also run this peer on the same database and job count")
    p.add_argument("--pgq-batch", type=positive_int, default=128,
                   help="pgqueuer dequeue batch_size (default 128: its best in our sweep; "
                        "its benchmark default is 10)")
    p.add_argument("--pgq-workers", type=positive_int, default=2,
                   help="pgqueuer QueueManagers per process, one connection each (default 2)")
    p.add_argument("--pgq-processes", type=positive_int, default=1,
                   help="pgqueuer consumer processes (default 1)")
    p.add_argument("--no-raw", action="store_true", help="skip the raw ceiling run")
    add_common_args(p)
    p.set_defaults(bench=main)


def main(args: argparse.Namespace) -> int:
    async def body(dsn: str) -> dict[str, Any]:
        return await run(dsn, args.jobs, args.agents, args.capacity, args.mode, args.compare,
                         pgq=dict(batch_size=args.pgq_batch, workers=args.pgq_workers,
                                  processes=args.pgq_processes),
                         with_raw=not args.no_raw)

    return run_bench(args, body)


async def run(dsn: str, jobs: int, agents: int, capacity: int, mode: str = "bulk",
              compare: str | None = None, pgq: dict[str, Any] | None = None,
              with_raw: bool = True) -> dict[str, Any]:
    chunk = CHUNKS[mode]
    gpuq = await run_gpuq(dsn, jobs, agents, capacity, chunk)
    result: dict[str, Any] = {
        "bench": "throughput", "jobs": jobs, "agents": agents, "capacity": capacity, "mode": mode,
        "gpuq_jobs_per_s": gpuq["jobs_per_s"], "gpuq_seconds": gpuq["seconds"],
        "serve_cpu_s": gpuq["serve_cpu_s"], "agents_cpu_s": gpuq["agents_cpu_s"],
        "postgres_cpu_s": gpuq["postgres_cpu_s"], "agents_used": gpuq["agents_used"],
    }
    if with_raw:
        progress(f"raw ceiling: {jobs:,} jobs, batch {capacity}, 2 workers")
        r = await raw.run(dsn, jobs, capacity, 2, quiet=True)
        result["raw_jobs_per_s"] = r["raw_jobs_per_s"]
        result["fraction_of_raw"] = round(gpuq["jobs_per_s"] / r["raw_jobs_per_s"], 3)
    if compare == "pgqueuer":
        settings = dict(pgq or {})
        progress(f"pgqueuer {peer_pgqueuer.version()}: {jobs:,} jobs, {settings}")
        peer = await peer_pgqueuer.end_to_end(dsn, jobs, chunk=chunk, cpu_of=procs.cpu_seconds,
                                              pg_pid=await _postmaster(dsn), **settings)
        result.update({
            "pgqueuer_jobs_per_s": peer["jobs_per_s"], "pgqueuer_seconds": peer["seconds"],
            "pgqueuer_cpu_s": peer["consumer_cpu_s"],
            "pgqueuer_postgres_cpu_s": peer["postgres_cpu_s"],
            "pgqueuer_settings": {k: peer[k] for k in ("batch_size", "workers", "processes")},
            "pgqueuer_version": peer_pgqueuer.version(),
            "ratio": round(gpuq["jobs_per_s"] / peer["jobs_per_s"], 3),
        })
    result["postgres"] = gpuq["settings"]
    _report(result)
    return result


async def _postmaster(dsn: str) -> int | None:
    conn = await connect(dsn)
    try:
        return await procs.postmaster_pid(conn)
    finally:
        await conn.close()


async def run_gpuq(dsn: str, jobs: int, agents: int, capacity: int, chunk: int) -> dict[str, Any]:
    await reset_gpuq_schema(dsn)
    fleet = procs.Fleet(dsn)
    conn = await connect(dsn)
    try:
        settings = await server_settings(conn)
        pg_pid = await procs.postmaster_pid(conn)
        progress(f"starting gpuq serve on 127.0.0.1:{fleet.port} and {agents} agents "
                 f"(capacity {capacity}); logs in {fleet.logdir}")
        await asyncio.to_thread(fleet.start_serve)
        await asyncio.to_thread(fleet.start_agents, agents, capacity, "gpuq.bench.handlers:noop")
        pids = fleet.pids()
        cpu0 = {k: procs.cpu_seconds(v) for k, v in pids.items()}
        pg0 = procs.cpu_seconds([pg_pid]) if pg_pid else None
        progress(f"inserting {jobs:,} jobs, {chunk:,} per statement")
        t0 = time.perf_counter()
        for lo in range(0, jobs, chunk):
            k = min(chunk, jobs - lo)
            await queue.enqueue_many(conn, [NewJob(procs.KIND, {"i": lo + i}) for i in range(k)])
        progress(f"inserted in {time.perf_counter() - t0:.2f}s; waiting for the agents")
        last = time.monotonic()
        while await conn.fetchval(_ANY_LIVE):
            if time.monotonic() - last > 5:
                progress(f"{await conn.fetchval(_LIVE):,} jobs still live")
                last = time.monotonic()
            if not fleet.serve or not fleet.serve.alive():
                raise RuntimeError(f"serve died:\n{fleet.serve.tail() if fleet.serve else ''}")
            await asyncio.sleep(0.05)
        cpu1 = {k: procs.cpu_seconds(v) for k, v in pids.items()}
        pg1 = procs.cpu_seconds([pg_pid]) if pg_pid else None
        row = await conn.fetchrow(_E2E)
    finally:
        await conn.close()
        await asyncio.to_thread(fleet.stop)
    if row["done"] != jobs:
        raise RuntimeError(f"gpuq: {row['done']} jobs done ({row['dead']} dead), expected {jobs}")
    seconds = float(row["seconds"])
    return {
        "seconds": round(seconds, 3), "jobs_per_s": round(jobs / seconds, 1),
        "serve_cpu_s": round(cpu1["serve"] - cpu0["serve"], 2),
        "agents_cpu_s": round(cpu1["agents"] - cpu0["agents"], 2),
        "postgres_cpu_s": round(pg1 - pg0, 2) if pg0 is not None and pg1 is not None else None,
        "agents_used": row["agents_used"], "settings": settings,
    }


def _report(r: dict[str, Any]) -> None:
    print_settings(r["postgres"])
    rows = [["gpuq (serve + agents)", r["gpuq_jobs_per_s"], r["gpuq_seconds"],
             f"serve {r['serve_cpu_s']}, agents {r['agents_cpu_s']}", r["postgres_cpu_s"]]]
    if "pgqueuer_jobs_per_s" in r:
        rows.append([f"pgqueuer {r['pgqueuer_version']} {r['pgqueuer_settings']}",
                     r["pgqueuer_jobs_per_s"], r["pgqueuer_seconds"],
                     f"consumers {r['pgqueuer_cpu_s']}", r["pgqueuer_postgres_cpu_s"]])
    if "raw_jobs_per_s" in r:
        rows.append(["raw lease+complete SQL", r["raw_jobs_per_s"], "", "", ""])
    print_table(["system", "jobs/s", "end-to-end s", "client CPU s", "postgres CPU s"], rows,
                title=f"throughput: {r['jobs']:,} jobs, {r['agents']} agents x capacity "
                      f"{r['capacity']}, {r['mode']} insert, no-op handler")
    if "ratio" in r:
        print(f"gpuq / pgqueuer: {r['ratio']}x")
    if "fraction_of_raw" in r:
        print(f"gpuq / raw: {r['fraction_of_raw']}")
