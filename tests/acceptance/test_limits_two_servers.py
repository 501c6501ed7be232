"""Global limits hold across two ``gpuq serve`` processes and their agent processes (issue #16)."""

from __future__ import annotations

import anyio
import asyncpg
import pytest

from gpuq import admin
from gpuq.harness import Fleet
from gpuq.producer import NewJob, enqueue_many

HANDLER = "gpuq.bench.handlers:timed"  # its result: when it ran, by the wall clock


def most_at_once(spans: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])  # ends first on a tie
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


@pytest.mark.slow
async def test_kind_and_key_limits_are_never_exceeded_by_two_servers(dsn):
    conn = await asyncpg.connect(dsn)
    await admin.set_limit(conn, "kind", "render", 3)
    await admin.set_limit(conn, "key", "tenant-a", 2)
    fleets = [Fleet(dsn), Fleet(dsn)]
    try:
        for i, fleet in enumerate(fleets):
            fleet.start_serve(poll_seconds=0.2)
            fleet.start_agents(2, 3, HANDLER, kinds="render,train", prefix=f"s{i}")
        jobs = [NewJob("render", {"sleep": 0.1}) for _ in range(24)]
        jobs += [NewJob("train", {"sleep": 0.1}, concurrency_key="tenant-a") for _ in range(12)]
        jobs += [NewJob("train", {"sleep": 0.1}, concurrency_key="tenant-b") for _ in range(6)]
        await enqueue_many(conn, jobs)
        for _ in range(600):
            if await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status <> 'done'") == 0:
                break
            for fleet in fleets:
                fleet.check()
            await anyio.sleep(0.1)  # not a settle wait: the poll's interval, checking the processes between reads
        rows = await conn.fetch("SELECT kind, concurrency_key, leased_by, status::text, "
                                "(result->>'start')::float8 AS s, (result->>'end')::float8 AS e FROM gpuq.jobs")
    finally:
        for fleet in fleets:
            fleet.stop()
        await conn.close()
    assert {r["status"] for r in rows} == {"done"}
    render = [(r["s"], r["e"]) for r in rows if r["kind"] == "render"]
    tenant_a = [(r["s"], r["e"]) for r in rows if r["concurrency_key"] == "tenant-a"]
    assert most_at_once(render) <= 3 and most_at_once(tenant_a) <= 2
    assert most_at_once([(r["s"], r["e"]) for r in rows if r["kind"] == "train"]) > 2  # tenant-b was not held
