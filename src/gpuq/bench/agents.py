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
import time
from typing import Any

import anyio

from gpuq.bench import common
from gpuq.bench.measure import CpuMeter, rss_mb
from gpuq.bench.throughput import drained, insert
from gpuq.harness import http_json


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--per-process", 250, "agents per swarm process")
        common.fleet_args(p, agents=1000, capacity=1, what="agents")
        p.add_argument("--jobs", type=common.positive_int, default=None,
                       help="jobs once all are connected (default 20 per agent)")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        return await run(t.dsn, a.agents, a.per_process, a.capacity, a.jobs or 20 * a.agents)

    common.declare(sub, "agents", "many websocket agents on one serve: connect time, serve RSS, jobs/s",
            __doc__, args, body, report)


async def run(dsn: str, agents: int, per_process: int, capacity: int, jobs: int) -> dict[str, Any]:
    async with common.fleet_on(dsn) as (fleet, conn, settings):
        await anyio.to_thread.run_sync(fleet.start_serve)
        assert fleet.serve is not None
        serve_pid = fleet.serve.popen.pid
        rss_idle = rss_mb(serve_pid)
        common.progress(f"serve on 127.0.0.1:{fleet.port} ({rss_idle:.0f} MB); starting {agents} agents, "
                 f"{per_process} per process; logs in {fleet.logdir}")
        t0 = time.perf_counter()
        fleet.start_swarm(agents, per_process, capacity)
        await anyio.to_thread.run_sync(fleet.wait_connected, agents, max(120.0, agents * 0.2))
        connect_s = time.perf_counter() - t0
        await anyio.sleep(1.0)  # let the last handshakes settle before reading RSS
        rss_connected = rss_mb(serve_pid)
        common.progress(f"{agents} connected in {connect_s:.1f}s, serve RSS {rss_connected:.0f} MB; "
                 f"inserting {jobs:,} jobs")
        cpu = CpuMeter(fleet.pids())
        cpu.start()
        await insert(conn, jobs, 10_000)
        await drained(conn, fleet, timeout=max(120.0, jobs / 50))
        used = cpu.stop()
        rss_after = rss_mb(serve_pid)
        status = http_json(fleet.port, "/status")
        row = await conn.fetchrow(common.queries["end_to_end"])
    if row["done"] != jobs:
        raise RuntimeError(f"{row['done']} jobs done, expected {jobs}")
    seconds = float(row["seconds"])
    return {
        "bench": "agents", "agents": agents, "per_process": per_process, "capacity": capacity,
        "jobs": jobs, "connect_s": round(connect_s, 2),
        "serve_rss_idle_mb": round(rss_idle, 1), "serve_rss_mb": round(rss_connected, 1),
        "serve_rss_after_mb": round(rss_after, 1),
        "serve_kb_per_agent": round((rss_connected - rss_idle) * 1024 / agents, 1),
        "agents_connected_at_end": status.get("agents_connected"),
        "jobs_per_s": round(jobs / seconds, 1), "seconds": round(seconds, 3),
        "serve_cpu_s": used["serve"], "swarm_cpu_s": used["agents"],
        "agents_used": row["agents_used"], "every_agent_got_work": row["agents_used"] == agents,
        "postgres": settings,
    }


def report(r: dict[str, Any]) -> None:
    common.print_settings(r["postgres"])
    common.print_table(
        ["agents", "connect s", "serve RSS idle MB", "serve RSS MB", "KB/agent", "jobs", "jobs/s",
         "serve CPU s", "swarm CPU s", "agents used"],
        [[r["agents"], r["connect_s"], r["serve_rss_idle_mb"], r["serve_rss_mb"], r["serve_kb_per_agent"],
          r["jobs"], r["jobs_per_s"], r["serve_cpu_s"], r["swarm_cpu_s"], r["agents_used"]]],
        title=f"agents: {r['agents']} websocket agents ({r['per_process']} per process, capacity "
              f"{r['capacity']}) on one serve, no-op handler")


if __name__ == "__main__":
    raise SystemExit(common.standalone("agents"))
