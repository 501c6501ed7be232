"""``gpuq bench latency``: insert -> handler start, in ms, with idle agents.

A real ``gpuq serve`` and ``--agents`` idle agent processes (handler
``gpuq.bench.handlers:latency``) on 127.0.0.1. The producer inserts one job
per statement at ``--rate`` jobs/s for ``--seconds``; each job's payload is
the wall clock just before its INSERT, and the handler stores (its start -
that time) as the job's result. One warm-up job goes first and is not counted.
Same machine, same clock: no clock skew enters the figure.

``--compare pgqueuer`` runs the same schedule against an idle pgqueuer
consumer (``peer_pgqueuer.latency``) on the same database.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

from gpuq import queue
from gpuq.bench import common, peer_pgqueuer
from gpuq.bench.measure import percentiles
from gpuq.harness import KIND, Fleet
from gpuq.jobs import NewJob

STATS = ("p50_ms", "p90_ms", "p99_ms", "max_ms")


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--rate", 100.0, "jobs per second")
        common.positive(p, "--seconds", 20.0, "duration")
        common.fleet_args(p, agents=2, capacity=4)
        p.add_argument("--compare", choices=["pgqueuer"], default=None,
                       help="also run this peer on the same database and schedule")
        p.add_argument("--pgq-batch", type=common.positive_int, default=10,
                       help="pgqueuer dequeue batch_size (default 10, its default)")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        return await run(t.dsn, a.rate, a.seconds, a.agents, a.capacity, a.compare, a.pgq_batch)

    common.declare(sub, "latency", "insert -> handler start latency (p50/p90/p99/max ms) with idle agents",
            __doc__, args, body, report)


async def run(dsn: str, rate: float, seconds: float, agents: int = 2, capacity: int = 4,
              compare: str | None = None, pgq_batch: int = 10) -> dict[str, Any]:
    n = max(1, round(rate * seconds))
    gpuq, settings = await run_gpuq(dsn, rate, n, agents, capacity)
    result: dict[str, Any] = {"bench": "latency", "rate": rate, "seconds": seconds, "jobs": n,
                              "agents": agents, "capacity": capacity}
    result.update({f"gpuq_{k}": v for k, v in gpuq.items()})
    if compare == "pgqueuer":
        common.progress(f"pgqueuer {peer_pgqueuer.version()}: {n} jobs at {rate}/s, batch {pgq_batch}")
        peer = await peer_pgqueuer.latency(dsn, rate, seconds, batch_size=pgq_batch)
        result.update({f"pgqueuer_{k}": peer[k] for k in STATS})
        result["pgqueuer_version"] = peer_pgqueuer.version()
        result["pgqueuer_batch_size"] = pgq_batch
    result["postgres"] = settings
    return result


async def run_gpuq(dsn: str, rate: float, n: int, agents: int,
                   capacity: int) -> tuple[dict[str, float], dict[str, str]]:
    async with common.fleet_on(dsn) as (fleet, conn, settings):
        common.progress(f"starting gpuq serve on 127.0.0.1:{fleet.port} and {agents} idle agents "
                 f"(capacity {capacity}); logs in {fleet.logdir}")
        await anyio.to_thread.run_sync(fleet.start_serve)
        await anyio.to_thread.run_sync(fleet.start_agents, agents, capacity, "gpuq.bench.handlers:latency")
        # Warm-up: every connection and code path used once before the clock counts.
        await queue.enqueue_many(conn, [NewJob(KIND, {"t": time.time(), "warmup": True})])
        await _done(conn, fleet, 1, 30)
        await anyio.sleep(0.2)
        common.progress(f"inserting {n} jobs one per statement at {rate}/s")
        t0 = time.perf_counter()
        for i in range(n):
            await anyio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            await queue.enqueue_many(conn, [NewJob(KIND, {"t": time.time()})])
        await _done(conn, fleet, n + 1, 60)
        lat = [float(r["ms"]) for r in await conn.fetch(common.queries["latencies"])]
    if len(lat) != n:
        raise RuntimeError(f"gpuq: {len(lat)} latencies recorded, expected {n}")
    return percentiles(lat), settings


async def _done(conn: Any, fleet: Fleet, n: int, timeout: float) -> None:
    async def reached() -> bool:
        return bool(await conn.fetchval(common.queries["count_done"]) >= n)

    await common.wait_until(reached, fleet, timeout, f"{n} jobs done")


def report(r: dict[str, Any]) -> None:
    common.print_settings(r["postgres"])
    rows = [[f"gpuq ({r['agents']} agents x {r['capacity']})", *(r[f"gpuq_{k}"] for k in STATS)]]
    if "pgqueuer_p50_ms" in r:
        rows.append([f"pgqueuer {r['pgqueuer_version']} (batch {r['pgqueuer_batch_size']})",
                     *(r[f"pgqueuer_{k}"] for k in STATS)])
    common.print_table(["system", "p50 ms", "p90 ms", "p99 ms", "max ms"], rows,
                title=f"latency insert -> handler start: {r['jobs']} jobs at {r['rate']}/s, "
                      "one per INSERT, idle consumers")


if __name__ == "__main__":
    raise SystemExit(common.standalone("latency"))
