"""``gpuq bench fairness``: fair share of GPU-seconds between tenants (issue #32).

A real ``gpuq serve`` and two agent processes of capacity 4 (8 slots) run
``gpuq.bench.handlers:busy_async`` (each job sleeps its payload's ``sleep``
and returns when it ran). Each phase starts from a fresh schema:

- **trickle**: tenant ``a`` (weight 3) has 100,000 jobs of 200 ms queued;
  ``b`` (weight 1) enqueues 2 jobs a second for ``--seconds``. ``b``'s wait
  (enqueued to its handler started) at p99: ``trickle_p99_wait_ms``. FIFO
  (no weights, the same load for a third of the time): ``b``'s jobs queue
  behind the flood and do not start in the run, so
  ``fifo_trickle_p99_wait_ms`` is each one's wait so far plus the jobs of
  ``a`` still ahead of it at the end ÷ the rate ``a``'s jobs ran at.
- **share**: both backlogged with 200 ms jobs; each tenant's part of the
  GPU-seconds run in each ``--window`` (two windows): the largest distance
  from 75 % / 25 % is ``share_error_max``; ``share_error_mixed_max`` the same
  with ``a``'s jobs of 1 s and ``b``'s of 100 ms.
- **idle**: ``b`` has a weight and no work; ``a``'s GPU-seconds over the
  slots' in one window: ``idle_tenant_utilisation``.
- **1000 tenants**, equal weights, 10 ms jobs: Jain's index of the
  GPU-seconds per tenant ÷ weight over ``--window`` (``jain_1000``). Then,
  without agents, the lease itself: rounds of 8-slot leases alternated
  between fair share on (``FairShare.lease``, its reads every second
  included) and off (``lease_slots`` with its cursors), each leased job
  completed untimed; ``lease_p99_ratio_1000`` = p99 on ÷ p99 off.

GPU-seconds are the handlers' own times (start, end) cut to the window;
each phase runs on until the jobs running at its last window's end are done.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

from gpuq import admin, queue
from gpuq.bench import common
from gpuq.bench.measure import percentiles
from gpuq.db import connect
from gpuq.dispatcher import Tuning
from gpuq.dispatcher.fairshare import FairShare
from gpuq.dispatcher.trigger import Pass
from gpuq.harness import KIND
from gpuq.jobs import NewJob

HANDLER = "gpuq.bench.handlers:busy_async"
SLOTS = 8  # two agents of capacity 4
EXPECTED = {"a": 0.75, "b": 0.25}  # weights 3 : 1


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--seconds", 30.0, "the trickle's length (FIFO's: a third of it)")
        common.positive(p, "--window", 30.0, "each share window, the idle window and the 1000 tenants' run")
        common.positive(p, "--flood", 100_000, "tenant a's queued jobs in the trickle phase")
        common.positive(p, "--tenants", 1000, "tenants of equal weight in the last phase")
        common.positive(p, "--leases", 200, "leases per round and mode in the lease timing (3 rounds)")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        result: dict[str, Any] = {"bench": "fairness", "slots": SLOTS}
        result.update(await trickle(t.dsn, a, fair=True))
        result.update(await trickle(t.dsn, a, fair=False))
        result.update(await shares(t.dsn, a.window, {"a": 0.2, "b": 0.2}, ""))
        result.update(await shares(t.dsn, a.window, {"a": 1.0, "b": 0.1}, "_mixed"))
        result.update(await idle(t.dsn, a.window))
        result.update(await many(t.dsn, a.window, int(a.tenants)))
        result.update(await lease_timing(t.dsn, int(a.tenants), int(a.leases)))
        return result

    common.declare(sub, "fairness", "fair share of GPU-seconds between tenants: trickle wait, shares, Jain",
                   __doc__, args, body, report, summary=summary)


# -- the phases -----------------------------------------------------------------


async def _seed(conn: Any, tenant: str, n: int, sleep: float) -> None:
    await conn.execute("INSERT INTO gpuq.jobs (kind, payload, tenant) "
                       "SELECT $1, jsonb_build_object('sleep', $2::float8), $3 FROM generate_series(1, $4)",
                       KIND, sleep, tenant, n)


async def _start(fleet: Any) -> None:
    await anyio.to_thread.run_sync(fleet.start_serve)
    await anyio.to_thread.run_sync(fleet.start_agents, 2, 4, HANDLER)


async def trickle(dsn: str, a: argparse.Namespace, fair: bool) -> dict[str, Any]:
    seconds = a.seconds if fair else max(1.0, a.seconds / 3)
    async with common.fleet_on(dsn) as (fleet, conn, _settings):
        await _seed(conn, "a", int(a.flood), 0.2)
        if fair:
            await admin.set_tenant(conn, "a", 3)
            await admin.set_tenant(conn, "b", 1)
        common.progress(f"trickle ({'fair share' if fair else 'FIFO'}): {int(a.flood)} jobs of a queued; "
                        f"b sends 2 a second for {seconds:.0f} s")
        await _start(fleet)
        await _run_for(conn, fleet, 0, 0)  # the agents are at work: b's waits are the queue's, not start-up's
        ids = []
        t0 = time.monotonic()
        for i in range(int(seconds * 2)):
            await anyio.sleep(max(0.0, t0 + i * 0.5 - time.monotonic()))
            ids += await queue.enqueue_many(conn, [NewJob(KIND, {"sleep": 0.2}, tenant="b")])
        if not fair:
            return {"fifo_trickle_p99_wait_ms": await _fifo_wait(conn, ids)}

        async def started() -> bool:
            return bool(await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE id = ANY($1) AND status = 'done'",
                                            ids) == len(ids))

        await common.wait_until(started, fleet, 60, "b's jobs done")
        waits = [r["wait_ms"] for r in await conn.fetch(
            "SELECT ((result->>'start')::float8 - extract(epoch FROM created_at)) * 1000 AS wait_ms "
            "FROM gpuq.jobs WHERE id = ANY($1)", ids)]
    w = percentiles(waits)
    return {"trickle_p50_wait_ms": w["p50_ms"], "trickle_p99_wait_ms": w["p99_ms"], "trickle_jobs": len(waits)}


async def _fifo_wait(conn: Any, ids: list[int]) -> float:
    """b's waits under FIFO: waited so far + a's jobs still ahead ÷ the rate a's jobs ran at."""
    row = await conn.fetchrow(
        "SELECT count(*) FILTER (WHERE status = 'done') AS done, "
        "extract(epoch FROM max(finished_at) - min(started_at))::float8 AS span FROM gpuq.jobs WHERE tenant = 'a'")
    rate = row["done"] / row["span"] if row["done"] and row["span"] else 0.0
    waits = []
    for r in await conn.fetch(
            "SELECT b.id, extract(epoch FROM now() - b.created_at)::float8 AS so_far, "
            "(SELECT count(*) FROM gpuq.jobs j WHERE j.tenant = 'a' AND j.status = 'pending' AND j.id < b.id) AS ahead "
            "FROM gpuq.jobs b WHERE b.id = ANY($1)", ids):
        waits.append((r["so_far"] + (r["ahead"] / rate if rate else float("inf"))) * 1000)
    return percentiles(waits)["p99_ms"]


async def _run_for(conn: Any, fleet: Any, seconds: float, tail: float) -> float:
    """Wait for the first job to start, then ``seconds``, then ``tail`` for the jobs running at the
    end to finish: returns the first start (epoch)."""
    async def any_started() -> bool:
        return bool(await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'done' LIMIT 1"))

    await common.wait_until(any_started, fleet, 60, "the first job")
    t0 = float(await conn.fetchval("SELECT min((result->>'start')::float8) FROM gpuq.jobs WHERE status = 'done'"))
    await anyio.sleep(max(0.0, t0 + seconds + tail - time.time()))
    return t0


async def _gpu_seconds(conn: Any, start: float, end: float) -> dict[str, float]:
    """GPU-seconds per tenant run within [start, end] (epoch), from the handlers' own times of the
    jobs done (the run went on ``tail`` past the end, so the jobs running at the end are done)."""
    rows = await conn.fetch(
        "SELECT coalesce(tenant, 'default') AS tenant, sum(greatest(0, least((result->>'end')::float8, $2) "
        "  - greatest((result->>'start')::float8, $1))) AS s "
        "FROM gpuq.jobs WHERE status = 'done' GROUP BY 1", start, end)
    return {r["tenant"]: float(r["s"]) for r in rows}


async def shares(dsn: str, window: float, sleeps: dict[str, float], suffix: str) -> dict[str, Any]:
    async with common.fleet_on(dsn) as (fleet, conn, _settings):
        for tenant, sleep in sleeps.items():
            await _seed(conn, tenant, int(3 * SLOTS * window / sleep), sleep)
        await admin.set_tenant(conn, "a", 3)
        await admin.set_tenant(conn, "b", 1)
        common.progress(f"share{suffix}: both backlogged ({sleeps}), two windows of {window:.0f} s")
        await _start(fleet)
        t0 = await _run_for(conn, fleet, 2 * window, max(sleeps.values()) + 1)
        errors, parts = [], []
        for w in range(2):
            used = await _gpu_seconds(conn, t0 + w * window, t0 + (w + 1) * window)
            total = sum(used.values()) or 1.0
            part = {k: used.get(k, 0.0) / total for k in EXPECTED}
            parts.append(round(part["a"], 4))
            errors += [abs(part[k] - EXPECTED[k]) for k in EXPECTED]
    return {f"share_error{suffix}_max": round(max(errors), 4), f"share_a{suffix}_windows": parts}


async def idle(dsn: str, window: float) -> dict[str, Any]:
    async with common.fleet_on(dsn) as (fleet, conn, _settings):
        await _seed(conn, "a", int(3 * SLOTS * window / 0.2), 0.2)
        await admin.set_tenant(conn, "a", 3)
        await admin.set_tenant(conn, "b", 1)
        common.progress(f"idle: b has a weight and no work; a's use of the slots over {window:.0f} s")
        await _start(fleet)
        t0 = await _run_for(conn, fleet, window + 1, 1.2)
        used = await _gpu_seconds(conn, t0 + 1, t0 + 1 + window)  # from the second the slots all started
    return {"idle_tenant_utilisation": round(used.get("a", 0.0) / (SLOTS * window), 4)}


async def many(dsn: str, window: float, n: int) -> dict[str, Any]:
    per = int(3 * SLOTS * window / 0.01 / n) + 2
    async with common.fleet_on(dsn) as (fleet, conn, _settings):
        await conn.execute("INSERT INTO gpuq.tenants (name, weight) SELECT 't' || g, 1 FROM generate_series(1, $1) g", n)
        await conn.execute("INSERT INTO gpuq.jobs (kind, payload, tenant) SELECT $1, '{\"sleep\": 0.01}', 't' || t "
                           "FROM generate_series(1, $3) j, generate_series(1, $2) t ORDER BY j, t", KIND, n, per)
        common.progress(f"{n} tenants of equal weight, {per} jobs of 10 ms each; {window:.0f} s")
        await _start(fleet)
        t0 = await _run_for(conn, fleet, window, 1)
        used = await _gpu_seconds(conn, t0, t0 + window)
    xs = [used.get(f"t{i}", 0.0) for i in range(1, n + 1)]
    jain = sum(xs) ** 2 / (n * sum(x * x for x in xs)) if any(xs) else 0.0
    return {"jain_1000": round(jain, 4), "jobs_per_tenant_1000": round(sum(xs) / 0.01 / n, 1)}


async def lease_timing(dsn: str, n: int, leases: int) -> dict[str, Any]:
    """8-slot leases over ``n`` tenants' backlog, rounds alternated: fair share on, then off."""
    await common.reset_gpuq_schema(dsn)
    pool = await connect(dsn)
    try:
        await pool.execute("INSERT INTO gpuq.jobs (kind, payload, tenant) SELECT $1, '{}', 't' || t "
                           "FROM generate_series(1, $3) j, generate_series(1, $2) t ORDER BY j, t",
                           KIND, n, 6 * leases * SLOTS // n + 2)
        await pool.execute("ANALYZE gpuq.jobs")
        common.progress(f"lease timing: {n} tenants, 3 rounds of {leases} leases of {SLOTS} slots each way")
        fair = FairShare(pool, Tuning())
        cursors: dict[str, tuple[int, int]] = {}
        on: list[float] = []
        off: list[float] = []
        rounds = []
        for _ in range(3):
            await pool.execute("INSERT INTO gpuq.tenants (name, weight) SELECT 't' || g, 1 FROM generate_series(1, $1) g "
                               "ON CONFLICT DO NOTHING", n)
            await fair.refresh(Pass(every=True))
            times_on = await _leases(pool, leases, lambda: fair.refresh(Pass()),
                                     lambda: fair.lease([KIND], ["a#1"] * SLOTS, 60))
            await pool.execute("DELETE FROM gpuq.tenants")

            async def plain() -> Any:
                result = await queue.lease_slots(pool, [KIND], ["a#1"] * SLOTS, 60, cursors)
                cursors.update(result.cursors)
                return result.jobs, True

            times_off = await _leases(pool, leases, None, plain)
            on += times_on
            off += times_off
            rounds.append((percentiles(times_on)["p99_ms"], percentiles(times_off)["p99_ms"]))
    finally:
        await pool.close()
    p_on, p_off = percentiles(on), percentiles(off)
    return {"lease_p99_ms_1000": p_on["p99_ms"], "lease_p99_ms_1000_off": p_off["p99_ms"],
            "lease_p50_ms_1000": p_on["p50_ms"], "lease_p50_ms_1000_off": p_off["p50_ms"],
            "lease_p99_ratio_1000": round(p_on["p99_ms"] / p_off["p99_ms"], 3),
            "lease_p99_ratio_1000_rounds": [round(x / y, 3) for x, y in rounds]}


async def _leases(pool: Any, n: int, before: Any, lease: Any) -> list[float]:
    """``n`` leases timed (``before`` too: the dispatcher runs it each pass); each job completed untimed."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        if before is not None:
            await before()
        jobs, _more = await lease()
        times.append((time.perf_counter() - t) * 1000)
        await queue.complete_many(pool, [(j.id, j.lease_token, None) for j in jobs])
    return times


# -- output ---------------------------------------------------------------------


KEYS = ("trickle_p99_wait_ms", "fifo_trickle_p99_wait_ms", "share_error_max", "share_error_mixed_max",
        "idle_tenant_utilisation", "jain_1000", "lease_p99_ratio_1000")
TARGETS = {"trickle_p99_wait_ms": "<= 250", "share_error_max": "<= 0.05", "share_error_mixed_max": "<= 0.05",
           "idle_tenant_utilisation": ">= 0.98", "jain_1000": ">= 0.95", "lease_p99_ratio_1000": "<= 2"}


def summary(r: dict[str, Any]) -> dict[str, Any]:
    return r


def report(r: dict[str, Any]) -> None:
    common.print_table(["figure", "value", "target"], [[k, r[k], TARGETS.get(k, "")] for k in KEYS],
                       title=f"fairness: {SLOTS} slots; shares of a per window {r['share_a_windows']}, "
                             f"mixed {r['share_a_mixed_windows']}; lease p99 on {r['lease_p99_ms_1000']} ms, "
                             f"off {r['lease_p99_ms_1000_off']} ms (rounds {r['lease_p99_ratio_1000_rounds']})")


if __name__ == "__main__":
    raise SystemExit(common.standalone("fairness"))
