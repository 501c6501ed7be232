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

``--old-snapshot`` runs gpuq a second time with a REPEATABLE READ transaction
held open on another connection from before the first insert (issue #14), and
reports its jobs/s against the plain run and, for both, the jobs/s of the last
20 % of the jobs against the first 20 % (``tail_ratio``).

``--dashboard`` runs gpuq a second time with one dashboard client logged in
(``gpuq.bench.dashboard``: the overview's live socket open, four pages
reloaded every 2 s) and reports its jobs/s against the plain run
(``dashboard_ratio``, issue #18).

``cpu_us_per_job``: CPU microseconds per job of each component, for gpuq
(serve, agents, PostgreSQL) and pgqueuer (consumers, PostgreSQL).
``--rounds N`` runs all of it N times, alternated (gpuq, raw, pgqueuer, then
again), so one noisy run does not decide a figure: each figure is the median
of the rounds, ``*_worst`` the worst round beside it, and ``rounds`` lists
every round (issue #30).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio

from gpuq import queue
from gpuq.bench import common, peer_pgqueuer, raw
from gpuq.bench import dashboard as bench_dashboard
from gpuq.bench.measure import CpuMeter, postmaster_pid
from gpuq.db import connect
from gpuq.harness import KIND, Fleet
from gpuq.jobs import NewJob

CHUNKS = {"bulk": 10_000, "stream": 100}


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--jobs", 100_000, "jobs")
        common.fleet_args(p, agents=4, capacity=64)
        p.add_argument("--mode", choices=sorted(CHUNKS), default="bulk",
                       help="bulk: insert 10,000 a statement up front; stream: 100 a statement "
                            "while consuming (default bulk)")
        p.add_argument("--compare", choices=["pgqueuer"], default=None,
                       help="also run this peer on the same database and job count")
        p.add_argument("--pgq-batch", type=common.positive_int, default=128,
                       help="pgqueuer dequeue batch_size (default 128: its best in our sweep; "
                            "its benchmark default is 10)")
        common.positive(p, "--pgq-workers", 2, "pgqueuer QueueManagers per process, one connection each")
        common.positive(p, "--pgq-processes", 1, "pgqueuer consumer processes")
        p.add_argument("--no-raw", action="store_true", help="skip the raw ceiling run")
        p.add_argument("--dashboard", action="store_true",
                       help="also run gpuq with one dashboard client open (live overview, pages reloaded every 2 s)")
        p.add_argument("--old-snapshot", action="store_true",
                       help="also run gpuq with a REPEATABLE READ snapshot held open throughout")
        common.positive(p, "--rounds", 1, "alternated rounds; figures are their medians, the worst beside")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        rounds = []
        for i in range(a.rounds):
            if a.rounds > 1:
                common.progress(f"round {i + 1} of {a.rounds}")
            rounds.append(await run(t.dsn, a.jobs, a.agents, a.capacity, a.mode, a.compare,
                                    pgq=dict(batch_size=a.pgq_batch, workers=a.pgq_workers,
                                             processes=a.pgq_processes),
                                    with_raw=not a.no_raw, old_snapshot=a.old_snapshot, dashboard=a.dashboard))
        return summarize(rounds)

    common.declare(sub, "throughput", "end-to-end jobs/s through serve + agent processes (optionally vs pgqueuer)",
            __doc__, args, body, report)


async def run(dsn: str, jobs: int, agents: int, capacity: int, mode: str = "bulk",
              compare: str | None = None, pgq: dict[str, Any] | None = None,
              with_raw: bool = True, old_snapshot: bool = False, dashboard: bool = False) -> dict[str, Any]:
    chunk = CHUNKS[mode]
    gpuq = await run_gpuq(dsn, jobs, agents, capacity, chunk)
    result: dict[str, Any] = {
        "bench": "throughput", "jobs": jobs, "agents": agents, "capacity": capacity, "mode": mode,
        "gpuq_jobs_per_s": gpuq["jobs_per_s"], "gpuq_seconds": gpuq["seconds"],
        "serve_cpu_s": gpuq["serve_cpu_s"], "agents_cpu_s": gpuq["agents_cpu_s"],
        "postgres_cpu_s": gpuq["postgres_cpu_s"], "agents_used": gpuq["agents_used"],
        "tail_ratio": gpuq["tail_ratio"],
    }
    if old_snapshot:
        common.progress(f"gpuq again, {jobs:,} jobs, with a REPEATABLE READ snapshot held open")
        held = await run_gpuq(dsn, jobs, agents, capacity, chunk, hold_snapshot=True)
        result.update({"snapshot_jobs_per_s": held["jobs_per_s"], "snapshot_tail_ratio": held["tail_ratio"],
                       "snapshot_ratio": round(held["jobs_per_s"] / gpuq["jobs_per_s"], 3),
                       "snapshot_postgres_cpu_s": held["postgres_cpu_s"]})
    if dashboard:
        common.progress(f"gpuq again, {jobs:,} jobs, with a dashboard client open")
        watched = await run_gpuq(dsn, jobs, agents, capacity, chunk, dashboard=True)
        result.update({"dashboard_jobs_per_s": watched["jobs_per_s"],
                       "dashboard_ratio": round(watched["jobs_per_s"] / gpuq["jobs_per_s"], 3),
                       "dashboard_serve_cpu_s": watched["serve_cpu_s"],
                       "dashboard_fragments": watched["dashboard"]["fragments"],
                       "dashboard_pages": watched["dashboard"]["pages"]})
    if with_raw:
        common.progress(f"raw ceiling: {jobs:,} jobs, batch {capacity}, 2 workers")
        r = await raw.run(dsn, jobs, capacity, 2)
        result["raw_jobs_per_s"] = r["raw_jobs_per_s"]
        result["fraction_of_raw"] = round(gpuq["jobs_per_s"] / r["raw_jobs_per_s"], 3)
    if compare == "pgqueuer":
        settings = dict(pgq or {})
        common.progress(f"pgqueuer {peer_pgqueuer.version()}: {jobs:,} jobs, {settings}")
        peer = await peer_pgqueuer.end_to_end(dsn, jobs, chunk=chunk, pg_pid=gpuq["pg_pid"], **settings)
        result.update({
            "pgqueuer_jobs_per_s": peer["jobs_per_s"], "pgqueuer_seconds": peer["seconds"],
            "pgqueuer_cpu_s": peer["consumer_cpu_s"], "pgqueuer_postgres_cpu_s": peer["postgres_cpu_s"],
            "pgqueuer_settings": {k: peer[k] for k in ("batch_size", "workers", "processes")},
            "pgqueuer_version": peer_pgqueuer.version(),
            "ratio": round(gpuq["jobs_per_s"] / peer["jobs_per_s"], 3),
        })
    result["cpu_us_per_job"] = cpu_per_job(result)
    result["postgres"] = gpuq["settings"]
    return result


def cpu_per_job(r: dict[str, Any]) -> dict[str, dict[str, float]]:
    """CPU microseconds per job of each component of each system in one round."""
    def per_job(parts: dict[str, float]) -> dict[str, float]:
        us = {k: round(v * 1e6 / r["jobs"], 1) for k, v in parts.items()}
        return {**us, "total": round(sum(us.values()), 1)}

    out = {"gpuq": per_job({"serve": r["serve_cpu_s"], "agents": r["agents_cpu_s"], "postgres": r["postgres_cpu_s"]})}
    if "pgqueuer_cpu_s" in r:
        out["pgqueuer"] = per_job({"consumers": r["pgqueuer_cpu_s"], "postgres": r["pgqueuer_postgres_cpu_s"]})
    return out


# Figures whose worst round is the lowest; every other number's median is reported as is.
HIGHER_IS_BETTER = ("gpuq_jobs_per_s", "pgqueuer_jobs_per_s", "raw_jobs_per_s", "ratio", "fraction_of_raw",
                    "snapshot_ratio", "dashboard_ratio", "tail_ratio")


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One round as it is; several: each number the median of the rounds, the worst beside the
    figures that have one, and every round listed."""
    if len(rounds) == 1:
        return rounds[0]
    out = dict(rounds[0])
    for key, value in rounds[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("jobs", "agents", "capacity"):
            values = [r[key] for r in rounds]
            out[key] = value if len(set(values)) == 1 else round(common.median(values), 3)
            if key in HIGHER_IS_BETTER:
                out[f"{key}_worst"] = min(values)
    out["cpu_us_per_job"] = {system: {part: round(common.median([r["cpu_us_per_job"][system][part] for r in rounds]), 1)
                                      for part in parts}
                             for system, parts in rounds[0]["cpu_us_per_job"].items()}
    out["rounds"] = [{k: v for k, v in r.items() if k != "postgres"} for r in rounds]
    return out


async def run_gpuq(dsn: str, jobs: int, agents: int, capacity: int, chunk: int,
                   hold_snapshot: bool = False, handler: str = "gpuq.demo:noop",
                   dashboard: bool = False) -> dict[str, Any]:
    seen: dict[str, int] = {}
    async with common.fleet_on(dsn) as (fleet, conn, settings), _snapshot(dsn, hold_snapshot):
        pg_pid = await postmaster_pid(conn)
        common.progress(f"starting gpuq serve on 127.0.0.1:{fleet.port} and {agents} agents "
                 f"(capacity {capacity}); logs in {fleet.logdir}")
        flags = bench_dashboard.serve_flags() if dashboard else {}
        await anyio.to_thread.run_sync(lambda: fleet.start_serve(**flags))
        await anyio.to_thread.run_sync(fleet.start_agents, agents, capacity, handler)
        async with contextlib.AsyncExitStack() as stack:
            if dashboard:
                seen = await stack.enter_async_context(bench_dashboard.dashboard_open(fleet.port))
            cpu = CpuMeter({**fleet.pids(), "postgres": [pg_pid] if pg_pid else []})
            cpu.start()
            common.progress(f"inserting {jobs:,} jobs, {chunk:,} per statement")
            await insert(conn, jobs, chunk)
            await drained(conn, fleet, timeout=900)
            used = cpu.stop()
        row = await conn.fetchrow(common.queries["end_to_end"])
        first, last = await conn.fetchrow(common.queries["tail_rates"])
    if row["done"] != jobs:
        raise RuntimeError(f"gpuq: {row['done']} jobs done ({row['dead']} dead), expected {jobs}")
    seconds = float(row["seconds"])
    return {"seconds": round(seconds, 3), "jobs_per_s": round(jobs / seconds, 1),
            "serve_cpu_s": used["serve"], "agents_cpu_s": used["agents"], "postgres_cpu_s": used["postgres"],
            "agents_used": row["agents_used"], "settings": settings, "pg_pid": pg_pid, "dashboard": dict(seen),
            "tail_ratio": round(float(last) / float(first), 3) if first and last else None}


@contextlib.asynccontextmanager
async def _snapshot(dsn: str, hold: bool) -> AsyncIterator[None]:
    """While inside, a REPEATABLE READ transaction holds its snapshot open (when ``hold``)."""
    if not hold:
        yield
        return
    other = await connect(dsn, direct=True)
    try:
        await other.execute(common.queries["snapshot_begin"])
        await other.fetchval(common.queries["snapshot_take"])
        yield
    finally:
        await other.close()  # ends the transaction


async def insert(conn: Any, jobs: int, chunk: int) -> None:
    """``jobs`` no-op jobs of the bench kind, ``chunk`` per ``enqueue_many``."""
    for lo in range(0, jobs, chunk):
        await queue.enqueue_many(conn, [NewJob(KIND, {"i": lo + i}) for i in range(min(chunk, jobs - lo))])


async def drained(conn: Any, fleet: Fleet, timeout: float) -> None:
    """Wait until no job is live, while the fleet lives."""
    async def empty() -> bool:
        return not await conn.fetchval(common.queries["any_live"])

    async def left() -> str:
        return f"{await conn.fetchval(common.queries['count_live']):,} jobs still live"

    await common.wait_until(empty, fleet, timeout, "the queue to drain", left)


def report(r: dict[str, Any]) -> None:
    common.print_settings(r["postgres"])
    rows = [["gpuq (serve + agents)", r["gpuq_jobs_per_s"], r["gpuq_seconds"],
             f"serve {r['serve_cpu_s']}, agents {r['agents_cpu_s']}", r["postgres_cpu_s"]]]
    if "pgqueuer_jobs_per_s" in r:
        rows.append([f"pgqueuer {r['pgqueuer_version']} {r['pgqueuer_settings']}", r["pgqueuer_jobs_per_s"],
                     r["pgqueuer_seconds"], f"consumers {r['pgqueuer_cpu_s']}", r["pgqueuer_postgres_cpu_s"]])
    if "dashboard_jobs_per_s" in r:
        rows.insert(1, ["gpuq, a dashboard open", r["dashboard_jobs_per_s"], "",
                        f"serve {r['dashboard_serve_cpu_s']}", ""])
    if "raw_jobs_per_s" in r:
        rows.append(["raw lease+complete SQL", r["raw_jobs_per_s"], "", "", ""])
    common.print_table(["system", "jobs/s", "end-to-end s", "client CPU s", "postgres CPU s"], rows,
                title=f"throughput: {r['jobs']:,} jobs, {r['agents']} agents x capacity "
                      f"{r['capacity']}, {r['mode']} insert, no-op handler")
    if len(r.get("rounds", ())) > 1:
        print(f"medians of {len(r['rounds'])} alternated rounds; worst round: gpuq {r['gpuq_jobs_per_s_worst']} jobs/s"
              + (f", gpuq / pgqueuer {r['ratio_worst']}" if "ratio_worst" in r else ""))
    for system, parts in r["cpu_us_per_job"].items():
        print(f"CPU per job, {system}: " + ", ".join(f"{k} {v} µs" for k, v in parts.items()))
    for key, label in (("ratio", "gpuq / pgqueuer"), ("fraction_of_raw", "gpuq / raw"),
                       ("tail_ratio", "last 20 % / first 20 % of the jobs"),
                       ("snapshot_jobs_per_s", "with an old snapshot held, jobs/s"),
                       ("snapshot_ratio", "with an old snapshot / without"),
                       ("snapshot_tail_ratio", "with an old snapshot, last 20 % / first 20 %"),
                       ("dashboard_ratio", "with a dashboard open / without"),
                       ("dashboard_pages", "dashboard pages loaded meanwhile"),
                       ("dashboard_fragments", "dashboard live fragments received meanwhile")):
        if key in r:
            print(f"{label}: {r[key]}")


if __name__ == "__main__":
    raise SystemExit(common.standalone("throughput"))
