"""``gpuq bench agents``: one ``gpuq serve`` with many websocket agents connected.

``--agents`` agents (``gpuq.agent.Agent``, capacity ``--capacity``, no-op
handler) run ``--per-process`` to a process (``python -m gpuq.bench.swarm``,
one event loop each) against one ``serve`` subprocess on 127.0.0.1.
Measured: the time until serve's /status reports them all connected, serve's
RSS before and with them all connected, then end-to-end jobs/s for ``--jobs``
jobs (default 20 per agent) inserted 10,000 per statement, from the database's
own timestamps, the CPU seconds of serve and of the swarm processes over
that phase, and how many distinct agents got work (leased_by).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from gpuq import queue
from gpuq.bench import procs
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

CHUNK = 10_000
_LIVE = "SELECT count(*) FROM gpuq.jobs WHERE status IN ('pending', 'leased', 'scheduled')"
_E2E = """
SELECT extract(epoch FROM max(finished_at) - min(created_at))::float8 AS seconds,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(DISTINCT split_part(leased_by, '#', 1)) AS agents_used
FROM gpuq.jobs
"""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "agents", help="many websocket agents on one serve: connect time, serve RSS, jobs/s",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--agents", type=positive_int, default=1000, help="agents (default 1000)")
    p.add_argument("--per-process", type=positive_int, default=250,
                   help="agents per swarm process (default 250)")
    p.add_argument("--capacity", type=positive_int, default=1, help="capacity of each agent (default 1)")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="jobs once all are connected (default 20 per agent)")
    add_common_args(p)
    p.set_defaults(bench=main)


def main(args: argparse.Namespace) -> int:
    async def body(dsn: str) -> dict[str, Any]:
        return await run(dsn, args.agents, args.per_process, args.capacity,
                         args.jobs or 20 * args.agents)

    return run_bench(args, body)


async def run(dsn: str, agents: int, per_process: int, capacity: int, jobs: int) -> dict[str, Any]:
    await reset_gpuq_schema(dsn)
    fleet = procs.Fleet(dsn)
    conn = await connect(dsn)
    try:
        settings = await server_settings(conn)
        await asyncio.to_thread(fleet.start_serve)
        assert fleet.serve is not None
        serve_pid = fleet.serve.popen.pid
        rss_idle = procs.rss_mb(serve_pid)
        progress(f"serve on 127.0.0.1:{fleet.port} ({rss_idle:.0f} MB); starting {agents} agents, "
                 f"{per_process} per process; logs in {fleet.logdir}")
        t0 = time.perf_counter()
        fleet.start_swarm(agents, per_process, capacity, "gpuq.bench.handlers:noop")
        await asyncio.to_thread(fleet.wait_connected, agents, max(120.0, agents * 0.2))
        connect_s = time.perf_counter() - t0
        await asyncio.sleep(1.0)  # let the last handshakes settle before reading RSS
        rss_connected = procs.rss_mb(serve_pid)
        progress(f"{agents} connected in {connect_s:.1f}s, serve RSS {rss_connected:.0f} MB; "
                 f"inserting {jobs:,} jobs")
        pids = fleet.pids()
        cpu0 = {k: procs.cpu_seconds(v) for k, v in pids.items()}
        for lo in range(0, jobs, CHUNK):
            k = min(CHUNK, jobs - lo)
            await queue.enqueue_many(conn, [NewJob(procs.KIND, {"i": lo + i}) for i in range(k)])
        last = time.monotonic()
        deadline = last + max(120.0, jobs / 50)
        while (live := await conn.fetchval(_LIVE)) > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out with {live} jobs live; serve log:\n{fleet.serve.tail()}")
            if not fleet.serve.alive():
                raise RuntimeError(f"serve died:\n{fleet.serve.tail()}")
            if time.monotonic() - last > 5:
                progress(f"{live:,} jobs still live")
                last = time.monotonic()
            await asyncio.sleep(0.05)
        cpu1 = {k: procs.cpu_seconds(v) for k, v in pids.items()}
        rss_after = procs.rss_mb(serve_pid)
        status = fleet.http_json("/status")
        row = await conn.fetchrow(_E2E)
    finally:
        await conn.close()
        await asyncio.to_thread(fleet.stop)
    if row["done"] != jobs:
        raise RuntimeError(f"{row['done']} jobs done, expected {jobs}")
    seconds = float(row["seconds"])
    server = status.get("server", status)
    result = {
        "bench": "agents", "agents": agents, "per_process": per_process, "capacity": capacity,
        "jobs": jobs, "connect_s": round(connect_s, 2),
        "serve_rss_idle_mb": round(rss_idle, 1), "serve_rss_mb": round(rss_connected, 1),
        "serve_rss_after_mb": round(rss_after, 1),
        "serve_kb_per_agent": round((rss_connected - rss_idle) * 1024 / agents, 1),
        "agents_connected_at_end": server.get("agents_connected"),
        "jobs_per_s": round(jobs / seconds, 1), "seconds": round(seconds, 3),
        "serve_cpu_s": round(cpu1["serve"] - cpu0["serve"], 2),
        "swarm_cpu_s": round(cpu1["agents"] - cpu0["agents"], 2),
        "agents_used": row["agents_used"], "every_agent_got_work": row["agents_used"] == agents,
        "postgres": settings,
    }
    _report(result)
    return result


def _report(r: dict[str, Any]) -> None:
    print_settings(r["postgres"])
    print_table(
        ["agents", "connect s", "serve RSS idle MB", "serve RSS MB", "KB/agent", "jobs", "jobs/s",
         "serve CPU s", "swarm CPU s", "agents used"],
        [[r["agents"], r["connect_s"], r["serve_rss_idle_mb"], r["serve_rss_mb"],
          r["serve_kb_per_agent"], r["jobs"], r["jobs_per_s"], r["serve_cpu_s"], r["swarm_cpu_s"],
          r["agents_used"]]],
        title=f"agents: {r['agents']} websocket agents ({r['per_process']} per process, capacity "
              f"{r['capacity']}) on one serve, no-op handler")
