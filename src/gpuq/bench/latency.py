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
import asyncio
import time
from typing import Any

from gpuq import queue
from gpuq.bench import peer_pgqueuer, procs
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

_LATENCIES = """
SELECT (result->>'lat_ms')::float8 AS ms FROM gpuq.jobs
WHERE status = 'done' AND NOT coalesce((payload->>'warmup')::bool, false)
"""
_DONE = "SELECT count(*) FROM gpuq.jobs WHERE status = 'done'"


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, not {v}")
    return v


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "latency", help="insert -> handler start latency (p50/p90/p99/max ms) with idle agents",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--rate", type=_positive_float, default=100.0, help="jobs per second (default 100)")
    p.add_argument("--seconds", type=_positive_float, default=20.0, help="duration (default 20)")
    p.add_argument("--agents", type=positive_int, default=2, help="agent processes (default 2)")
    p.add_argument("--capacity", type=positive_int, default=4, help="capacity of each agent (default 4)")
    p.add_argument("--compare", choices=["pgqueuer"], default=None,
                   help="also run this peer on the same database and schedule")
    p.add_argument("--pgq-batch", type=positive_int, default=10,
                   help="pgqueuer dequeue batch_size (default 10, its default)")
    add_common_args(p)
    p.set_defaults(bench=main)


def main(args: argparse.Namespace) -> int:
    async def body(dsn: str) -> dict[str, Any]:
        return await run(dsn, args.rate, args.seconds, args.agents, args.capacity, args.compare,
                         args.pgq_batch)

    return run_bench(args, body)


async def run(dsn: str, rate: float, seconds: float, agents: int = 2, capacity: int = 4,
              compare: str | None = None, pgq_batch: int = 10) -> dict[str, Any]:
    n = max(1, round(rate * seconds))
    gpuq, settings = await run_gpuq(dsn, rate, n, agents, capacity)
    result: dict[str, Any] = {"bench": "latency", "rate": rate, "seconds": seconds, "jobs": n,
                              "agents": agents, "capacity": capacity}
    result.update({f"gpuq_{k}": v for k, v in gpuq.items()})
    if compare == "pgqueuer":
        progress(f"pgqueuer {peer_pgqueuer.version()}: {n} jobs at {rate}/s, batch {pgq_batch}")
        peer = await peer_pgqueuer.latency(dsn, rate, seconds, batch_size=pgq_batch)
        result.update({f"pgqueuer_{k}": peer[k] for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")})
        result["pgqueuer_version"] = peer_pgqueuer.version()
        result["pgqueuer_batch_size"] = pgq_batch
    result["postgres"] = settings
    _report(result)
    return result


async def run_gpuq(dsn: str, rate: float, n: int, agents: int,
                   capacity: int) -> tuple[dict[str, float], dict[str, str]]:
    await reset_gpuq_schema(dsn)
    fleet = procs.Fleet(dsn)
    conn = await connect(dsn)
    try:
        settings = await server_settings(conn)
        progress(f"starting gpuq serve on 127.0.0.1:{fleet.port} and {agents} idle agents "
                 f"(capacity {capacity}); logs in {fleet.logdir}")
        await asyncio.to_thread(fleet.start_serve)
        await asyncio.to_thread(fleet.start_agents, agents, capacity, "gpuq.bench.handlers:latency")
        # Warm-up: every connection and code path used once before the clock counts.
        await queue.enqueue_many(conn, [NewJob(procs.KIND, {"t": time.time(), "warmup": True})])
        await _wait_done(conn, fleet, 1, 30)
        await asyncio.sleep(0.2)
        progress(f"inserting {n} jobs one per statement at {rate}/s")
        t0 = time.perf_counter()
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await queue.enqueue_many(conn, [NewJob(procs.KIND, {"t": time.time()})])
        await _wait_done(conn, fleet, n + 1, 60)
        lat = [float(r["ms"]) for r in await conn.fetch(_LATENCIES)]
    finally:
        await conn.close()
        await asyncio.to_thread(fleet.stop)
    if len(lat) != n:
        raise RuntimeError(f"gpuq: {len(lat)} latencies recorded, expected {n}")
    return peer_pgqueuer.percentiles(lat), settings


async def _wait_done(conn: Any, fleet: procs.Fleet, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while await conn.fetchval(_DONE) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {n} jobs done; serve log:\n"
                               f"{fleet.serve.tail() if fleet.serve else ''}")
        if not fleet.serve or not fleet.serve.alive():
            raise RuntimeError(f"serve died:\n{fleet.serve.tail() if fleet.serve else ''}")
        await asyncio.sleep(0.05)


def _report(r: dict[str, Any]) -> None:
    print_settings(r["postgres"])
    rows = [[f"gpuq ({r['agents']} agents x {r['capacity']})", r["gpuq_p50_ms"], r["gpuq_p90_ms"],
             r["gpuq_p99_ms"], r["gpuq_max_ms"]]]
    if "pgqueuer_p50_ms" in r:
        rows.append([f"pgqueuer {r['pgqueuer_version']} (batch {r['pgqueuer_batch_size']})",
                     r["pgqueuer_p50_ms"], r["pgqueuer_p90_ms"], r["pgqueuer_p99_ms"],
                     r["pgqueuer_max_ms"]])
    print_table(["system", "p50 ms", "p90 ms", "p99 ms", "max ms"], rows,
                title=f"latency insert -> handler start: {r['jobs']} jobs at {r['rate']}/s, "
                      "one per INSERT, idle consumers")
