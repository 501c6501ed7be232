"""``gpuq bench lease-history``: lease cost against the size of the done history.

For each history size N: a fresh ``gpuq.jobs`` with N done rows (ids 1..N)
and then 1,000 pending rows behind them, the layout of the naive design's failure. The same
rows are copied into ``gpuq_naive.jobs``, the naive design: same columns,
a primary key and ONLY a plain index on ``status`` (no partial indexes).

Measured, each in a transaction that is rolled back (so every run leases the
same rows from the same state):

- gpuq: lease phase 1 as ``gpuq.queue`` runs it (two-phase lease, pending
  partial index, update by ctid);
- gpuq fair: the lease with fair share on (``lease_fair``: a descent per
  tenant and kind it leases from; the pending rows belong to ``TENANTS``
  tenants, a ticket each in turn), and the two reads a fair-share dispatcher
  makes every second (``fair_waiting``, ``fair_state``: ``fair_reads_buffers``);
- naive: the single-phase ``SELECT id ... WHERE status = 'pending' ORDER BY
  id LIMIT n FOR UPDATE SKIP LOCKED`` + ``UPDATE ... WHERE id = picked.id``,
  with the naive plan: walk the primary key from id 1, filtering
  on status. PostgreSQL picks that plan whenever its statistics say pending
  rows are common (as they are when autoanalyze runs, during a burst); with
  fresh statistics on this exact layout it may instead read every pending
  entry of the status index and sort them (O(pending), not O(batch)). The
  bench pins the naive plan with ``SET LOCAL enable_sort = off`` and also
  reports the planner's own choice on fresh statistics (``naive_planner_*``).

Figures: common.median wall ms over ``--repeat`` runs (a query slower than
``--budget`` seconds in all stops early, after at least 5 runs), and the
shared buffers (hit + read) that one ``EXPLAIN (ANALYZE, BUFFERS)`` execution
touched.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from gpuq import fairlease, plans, queue
from gpuq.bench import common
from gpuq.db import connect
from gpuq.sql import queries

KIND = "train"
PENDING = 1_000
CHUNK = 500_000  # done rows per INSERT statement (common.progress granularity)
LEASE_SECONDS = 30.0
TENANTS = 10  # the pending rows' tenants
GPUQ, GPUQ_FAIR, NAIVE, NAIVE_PLANNER = "gpuq", "gpuq_fair", "naive", "naive_planner"


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--done", type=common.parse_int_list, default=[0, 1_000_000, 5_000_000],
                       help="comma-separated history sizes (done rows), default 0,1000000,5000000")
        common.positive(p, "--batch", 32, "jobs per lease")
        p.add_argument("--repeat", type=common.positive_int, default=50,
                       help="timed leases per size and query (default 50); the median is reported")
        p.add_argument("--budget", type=float, default=10.0,
                       help="seconds of timed runs per query and size before stopping early "
                            "(after at least 5 runs; default 10)")
        p.add_argument("--plot", default=None, metavar="PATH", help="also write a PNG plot here")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        result = await run(t.dsn, a.done, a.batch, a.repeat, a.budget)
        if a.plot:
            Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
            plot(result, a.plot)
            common.progress(f"plot written to {a.plot}")
        return result

    common.declare(sub, "lease-history", "lease cost (ms, shared buffers) vs done-history size: gpuq vs the naive query",
            __doc__, args, body, report)


async def run(dsn: str, done_sizes: list[int], batch: int, repeat: int,
              budget: float = 10.0) -> dict[str, Any]:
    rows = []
    settings: dict[str, str] = {}
    for done in sorted(set(done_sizes)):
        await common.reset_gpuq_schema(dsn)
        conn = await connect(dsn, command_timeout=None)  # builds millions of rows: no GPUQ_COMMAND_TIMEOUT
        try:
            settings = await common.server_settings(conn)
            build_s = await _build(conn, done)
            common.progress(f"done={done:,}: measuring gpuq and naive leases ({repeat} runs each)")
            row: dict[str, Any] = {"done": done}
            for variant in (GPUQ, GPUQ_FAIR, NAIVE, NAIVE_PLANNER):
                plan, times = await _measure(conn, batch, repeat, budget, variant)
                row[f"{variant}_buffers"] = plans.plan_buffers(plan)
                row[f"{variant}_ms"] = round(common.median(times), 3)
                row[f"{variant}_runs"] = len(times)
                row[f"{variant}_scans"] = sorted(plans.plan_indexes(plan))
                if variant == GPUQ:
                    row["gpuq_pick_buffers"] = plans.plan_buffers(plan, reads_only=True)
            row["fair_reads_buffers"] = sum([plans.plan_buffers(await plans.explain(conn, queries[name]))
                                             for name in ("fair_waiting", "fair_state")])
            row["build_s"] = round(build_s, 1)
            rows.append(row)
            await conn.execute(common.queries["naive_drop"])
        finally:
            await conn.close()

    base, top = rows[0], rows[-1]
    result = {
        "bench": "lease-history",
        "batch": batch,
        "repeat": repeat,
        "pending": PENDING,
        "rows": rows,
        "gpuq_buffer_ratio": _ratio(top["gpuq_buffers"], base["gpuq_buffers"]),
        "gpuq_fair_buffer_ratio": _ratio(top["gpuq_fair_buffers"], base["gpuq_fair_buffers"]),
        "fair_reads_buffer_ratio": _ratio(top["fair_reads_buffers"], base["fair_reads_buffers"]),
        "naive_buffer_ratio": _ratio(top["naive_buffers"], base["naive_buffers"]),
        "naive_planner_buffer_ratio": _ratio(top["naive_planner_buffers"],
                                             base["naive_planner_buffers"]),
        "postgres": settings,
    }
    return result


async def _build(conn: Any, done: int) -> float:
    t0 = time.perf_counter()
    await conn.execute(common.queries["trigger_off"])
    try:
        for lo in range(1, done + 1, CHUNK):
            hi = min(done, lo + CHUNK - 1)
            await conn.execute(common.queries["insert_done"], lo, hi)
            common.progress(f"done={done:,}: inserted {hi:,} done rows ({time.perf_counter() - t0:.1f}s)")
    finally:
        await conn.execute(common.queries["trigger_on"])
    await conn.execute(common.queries["insert_pending_tenants"], KIND, PENDING, TENANTS)
    common.progress(f"done={done:,}: copying into gpuq_naive.jobs")
    await conn.execute(common.queries["naive_drop"])
    await conn.execute(common.queries["naive_create"])
    common.progress(f"done={done:,}: VACUUM ANALYZE")
    await conn.execute(common.queries["vacuum_jobs"])
    await conn.execute(common.queries["vacuum_naive"])
    elapsed = time.perf_counter() - t0
    common.progress(f"done={done:,}: tables ready in {elapsed:.1f}s")
    return elapsed


async def _measure(conn: Any, batch: int, repeat: int, budget: float,
                   variant: str) -> tuple[dict[str, Any], list[float]]:
    """(plan of one EXPLAIN ANALYZE run, ms of up to ``repeat`` plain runs), all rolled back."""
    naive = variant not in (GPUQ, GPUQ_FAIR)
    tickets = [f"t{i % TENANTS}" for i in range(batch)]

    async def lease_once() -> int:
        if naive:
            rows = await conn.fetch(common.queries["naive_lease"], batch, "bench#naive", LEASE_SECONDS)
            return len(rows)
        if variant == GPUQ_FAIR:
            return len(await fairlease.lease_fair(conn, [KIND], tickets, ["bench#fair"] * batch, LEASE_SECONDS))
        return len((await queue.lease(conn, [KIND], batch, "bench#gpuq", LEASE_SECONDS)).jobs)

    async def rolled_back(fn: Any) -> tuple[Any, float]:
        tx = conn.transaction()
        await tx.start()
        try:
            if naive:
                await conn.execute(common.queries["planner_defaults"])
            if variant == NAIVE:
                await conn.execute(common.queries["pin_pk_walk"])
            t0 = time.perf_counter()
            out = await fn()
            return out, (time.perf_counter() - t0) * 1000
        finally:
            await tx.rollback()

    for _ in range(3):  # warm caches and the statement cache
        got, _ms = await rolled_back(lease_once)
        if got != min(batch, PENDING):
            raise RuntimeError(f"{variant} lease returned {got} rows, "
                               f"expected {min(batch, PENDING)}")
    if naive:  # plans.explain in the transaction that holds the planner settings
        plan, _ms = await rolled_back(lambda: plans.explain(conn, common.queries["naive_lease"], batch, "explain",
                                                            LEASE_SECONDS))
    elif variant == GPUQ_FAIR:
        plan = await plans.explain(conn, queries["lease_fair"], [KIND], tickets, ["explain"] * batch, LEASE_SECONDS)
    else:  # its own rolled-back transaction
        plan = await plans.explain_lease(conn, [KIND], batch)
    times: list[float] = []
    while len(times) < repeat and (len(times) < 5 or sum(times) < budget * 1000):
        times.append((await rolled_back(lease_once))[1])
    return plan, times


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def report(result: dict[str, Any]) -> None:
    common.print_settings(result["postgres"])
    print(f"lease-history: lease {result['batch']} of {result['pending']:,} pending rows behind "
          f"N done rows; ms = median of up to {result['repeat']} rolled-back runs; buffers = "
          "shared hit+read of one EXPLAIN ANALYZE run")
    print("  naive = the primary-key walk plan; naive planner = PostgreSQL's own "
          "choice on fresh statistics")
    print()
    common.print_table(
        ["done rows", "gpuq buffers", "gpuq ms", "fair buffers", "fair ms", "fair reads buffers", "naive buffers",
         "naive ms", "naive planner buffers", "naive planner ms"],
        [[r["done"], r["gpuq_buffers"], r["gpuq_ms"], r["gpuq_fair_buffers"], r["gpuq_fair_ms"],
          r["fair_reads_buffers"], r["naive_buffers"], r["naive_ms"], r["naive_planner_buffers"],
          r["naive_planner_ms"]] for r in result["rows"]],
    )
    common.print_table(["done rows", "gpuq scans", "naive scans", "naive planner scans"],
                [[r["done"], ",".join(r["gpuq_scans"]), ",".join(r["naive_scans"]),
                  ",".join(r["naive_planner_scans"])] for r in result["rows"]])
    print(f"gpuq buffer ratio (largest/smallest history): {result['gpuq_buffer_ratio']}")
    print(f"gpuq fair share buffer ratio: lease {result['gpuq_fair_buffer_ratio']}, "
          f"reads {result['fair_reads_buffer_ratio']}")
    print(f"naive buffer ratio (largest/smallest history): {result['naive_buffer_ratio']}")
    print(f"naive planner buffer ratio: {result['naive_planner_buffer_ratio']}")


def plot(result: dict[str, Any], path: str) -> None:
    """PNG of buffers and ms vs done rows, gpuq vs naive (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    done_m = [r["done"] / 1e6 for r in rows]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((ax_b, "buffers", "shared buffers touched (hit + read)"),
                           (ax_t, "ms", "median wall time (ms)")):
        ax.plot(done_m, [r[f"naive_{key}"] for r in rows], "o-", color="#c0392b",
                label="naive, primary-key walk")
        ax.plot(done_m, [r[f"naive_planner_{key}"] for r in rows], "^--", color="#e67e22",
                label="naive, planner's choice on fresh stats")
        ax.plot(done_m, [r[f"gpuq_{key}"] for r in rows], "s-", color="#2471a3",
                label="gpuq: pending partial index")
        ax.set_xlabel("done rows before the pending ones (millions)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Leasing {result['batch']} jobs vs history size "
                 f"({result['pending']:,} pending, PostgreSQL {result['postgres'].get('server_version', '')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(common.standalone("lease-history"))
