"""``gpuq bench lease-history``: lease cost against the size of the done history.

For each history size N: a fresh ``gpuq.jobs`` with N done rows (ids 1..N)
and then 1,000 pending rows behind them, the layout of the naive design's failure. The same
rows are copied into ``gpuq_naive.jobs``, the naive design: same columns,
a primary key and ONLY a plain index on ``status`` (no partial indexes).

Measured, each in a transaction that is rolled back (so every run leases the
same rows from the same state):

- gpuq: lease phase 1 as ``gpuq.queue`` runs it (two-phase lease, pending
  partial index, update by ctid);
- naive: the single-phase ``SELECT id ... WHERE status = 'pending' ORDER BY
  id LIMIT n FOR UPDATE SKIP LOCKED`` + ``UPDATE ... WHERE id = picked.id``,
  with the naive plan: walk the primary key from id 1, filtering
  on status. PostgreSQL picks that plan whenever its statistics say pending
  rows are common (as they are when autoanalyze runs, during a burst); with
  fresh statistics on this exact layout it may instead read every pending
  entry of the status index and sort them (O(pending), not O(batch)). The
  bench pins the naive plan with ``SET LOCAL enable_sort = off`` and also
  reports the planner's own choice on fresh statistics (``naive_planner_*``).

Figures: median wall ms over ``--repeat`` runs (a query slower than
``--budget`` seconds in all stops early, after at least 5 runs), and the
shared buffers (hit + read) that one ``EXPLAIN (ANALYZE, BUFFERS)`` execution
touched.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from gpuq import plans, queue
from gpuq.bench.common import (
    add_common_args,
    median,
    parse_int_list,
    positive_int,
    print_settings,
    print_table,
    progress,
    reset_gpuq_schema,
    run_bench,
    server_settings,
)
from gpuq.db import connect

KIND = "train"
PENDING = 1_000
CHUNK = 500_000  # done rows per INSERT statement (progress granularity)
LEASE_SECONDS = 30.0

# Finished rows as the queue leaves them: a result, lease fields, timestamps.
# (md5 stands in for the lease token: a uuid of the same width, far cheaper
# to make than gen_random_uuid() five million times.)
_INSERT_DONE = """
INSERT INTO gpuq.jobs (kind, payload, status, attempts, started_at, finished_at,
                       leased_by, lease_token, result)
SELECT 'train', jsonb_build_object('i', g), 'done', 1, now(), now(),
       'bench#1', md5(g::text)::uuid, '{"ok": true}'::jsonb
FROM generate_series($1::bigint, $2::bigint) AS g
"""
_INSERT_PENDING = """
INSERT INTO gpuq.jobs (kind, payload)
SELECT 'train', jsonb_build_object('i', g) FROM generate_series(1, $1::int) AS g
"""
# A bulk load of history need not NOTIFY (nor build a transition table of
# millions of rows): the trigger is off during it, on again for the pending rows.
_TRIGGER_OFF = "ALTER TABLE gpuq.jobs DISABLE TRIGGER jobs_notify_inserted"
_TRIGGER_ON = "ALTER TABLE gpuq.jobs ENABLE TRIGGER jobs_notify_inserted"

# The naive design, same rows in the same physical order (a fresh table
# scans in insertion order, which is id order). CREATE TABLE AS is the fast
# bulk path; the key, the one status index and the CHECK constraints follow.
# The CHECKs apply to every new row version (so the naive UPDATE pays for them
# like gpuq's does) but are added NOT VALID: the rows are gpuq's, already
# checked, and validating jobs_kind_format's regex costs ~5 us a row.
_NAIVE_DROP = "DROP SCHEMA IF EXISTS gpuq_naive CASCADE"
_NAIVE_CREATE = """
CREATE SCHEMA gpuq_naive;
CREATE TABLE gpuq_naive.jobs AS SELECT * FROM gpuq.jobs;
ALTER TABLE gpuq_naive.jobs ADD PRIMARY KEY (id);
CREATE INDEX jobs_status_idx ON gpuq_naive.jobs (status);
DO $$
DECLARE c record;
BEGIN
    FOR c IN SELECT conname, pg_get_constraintdef(oid) AS def FROM pg_constraint
             WHERE conrelid = 'gpuq.jobs'::regclass AND contype = 'c'
    LOOP
        EXECUTE format('ALTER TABLE gpuq_naive.jobs ADD CONSTRAINT %I %s NOT VALID', c.conname, c.def);
    END LOOP;
END
$$;
"""
_VACUUM_GPUQ = "VACUUM (ANALYZE) gpuq.jobs"
_VACUUM_NAIVE = "VACUUM (ANALYZE) gpuq_naive.jobs"

_NAIVE_LEASE = """
WITH picked AS (
    SELECT id FROM gpuq_naive.jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE gpuq_naive.jobs j
SET status = 'leased', attempts = j.attempts + 1, lease_token = gen_random_uuid(),
    leased_by = $2, lease_expires_at = now() + make_interval(secs => $3), started_at = now()
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.kind, j.payload, j.attempts, j.max_attempts, j.lease_token, j.priority
"""
_NAIVE_EXPLAIN = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + _NAIVE_LEASE
# The naive plan: no sort possible, so ORDER BY id walks the primary key.
_PIN_PK_WALK = "SET LOCAL enable_sort = off"
# The naive design ran with PostgreSQL's default planner, not gpuq's PLAN_SETTINGS.
_PLANNER_DEFAULTS = ("SET LOCAL enable_bitmapscan = on; SET LOCAL enable_seqscan = on; "
                     "SET LOCAL plan_cache_mode = auto")

GPUQ, NAIVE, NAIVE_PLANNER = "gpuq", "naive", "naive_planner"


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "lease-history",
        help="lease cost (ms, shared buffers) vs done-history size: gpuq vs the naive query",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--done", type=parse_int_list, default=[0, 1_000_000, 5_000_000],
                   help="comma-separated history sizes (done rows), default 0,1000000,5000000")
    p.add_argument("--batch", type=positive_int, default=32, help="jobs per lease (default 32)")
    p.add_argument("--repeat", type=positive_int, default=50,
                   help="timed leases per size and query (default 50); the median is reported")
    p.add_argument("--budget", type=float, default=10.0,
                   help="seconds of timed runs per query and size before stopping early "
                        "(after at least 5 runs; default 10)")
    p.add_argument("--plot", default=None, metavar="PATH", help="also write a PNG plot here")
    add_common_args(p)
    p.set_defaults(bench=main)


def main(args: argparse.Namespace) -> int:
    async def body(dsn: str) -> dict[str, Any]:
        return await run(dsn, args.done, args.batch, args.repeat, args.budget)

    rc = run_bench(args, body, after=lambda result: _maybe_plot(args.plot, result))
    return rc


def _maybe_plot(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        plot(result, path)
        progress(f"plot written to {path}")


async def run(dsn: str, done_sizes: list[int], batch: int, repeat: int,
              budget: float = 10.0) -> dict[str, Any]:
    rows = []
    settings: dict[str, str] = {}
    for done in sorted(set(done_sizes)):
        await reset_gpuq_schema(dsn)
        conn = await connect(dsn)
        try:
            settings = await server_settings(conn)
            build_s = await _build(conn, done)
            progress(f"done={done:,}: measuring gpuq and naive leases ({repeat} runs each)")
            row: dict[str, Any] = {"done": done}
            for variant in (GPUQ, NAIVE, NAIVE_PLANNER):
                plan, times = await _measure(conn, batch, repeat, budget, variant)
                row[f"{variant}_buffers"] = plans.plan_buffers(plan)
                row[f"{variant}_ms"] = round(median(times), 3)
                row[f"{variant}_runs"] = len(times)
                row[f"{variant}_scans"] = sorted(plans.plan_indexes(plan))
                if variant == GPUQ:
                    row["gpuq_pick_buffers"] = plans.plan_buffers(plan, reads_only=True)
            row["build_s"] = round(build_s, 1)
            rows.append(row)
            await conn.execute(_NAIVE_DROP)
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
        "naive_buffer_ratio": _ratio(top["naive_buffers"], base["naive_buffers"]),
        "naive_planner_buffer_ratio": _ratio(top["naive_planner_buffers"],
                                             base["naive_planner_buffers"]),
        "postgres": settings,
    }
    _report(result)
    return result


async def _build(conn: Any, done: int) -> float:
    t0 = time.perf_counter()
    await conn.execute(_TRIGGER_OFF)
    try:
        for lo in range(1, done + 1, CHUNK):
            hi = min(done, lo + CHUNK - 1)
            await conn.execute(_INSERT_DONE, lo, hi)
            progress(f"done={done:,}: inserted {hi:,} done rows ({time.perf_counter() - t0:.1f}s)")
    finally:
        await conn.execute(_TRIGGER_ON)
    await conn.execute(_INSERT_PENDING, PENDING)
    progress(f"done={done:,}: copying into gpuq_naive.jobs")
    await conn.execute(_NAIVE_DROP)
    await conn.execute(_NAIVE_CREATE)
    progress(f"done={done:,}: VACUUM ANALYZE")
    await conn.execute(_VACUUM_GPUQ)
    await conn.execute(_VACUUM_NAIVE)
    elapsed = time.perf_counter() - t0
    progress(f"done={done:,}: tables ready in {elapsed:.1f}s")
    return elapsed


async def _measure(conn: Any, batch: int, repeat: int, budget: float,
                   variant: str) -> tuple[dict[str, Any], list[float]]:
    """(plan of one EXPLAIN ANALYZE run, ms of up to ``repeat`` plain runs), all rolled back."""
    naive = variant != GPUQ

    async def lease_once() -> int:
        if naive:
            rows = await conn.fetch(_NAIVE_LEASE, batch, "bench#naive", LEASE_SECONDS)
            return len(rows)
        return len((await queue.lease(conn, [KIND], batch, "bench#gpuq", LEASE_SECONDS)).jobs)

    async def rolled_back(fn: Any) -> tuple[Any, float]:
        tx = conn.transaction()
        await tx.start()
        try:
            if naive:
                await conn.execute(_PLANNER_DEFAULTS)
            if variant == NAIVE:
                await conn.execute(_PIN_PK_WALK)
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
    if naive:
        plan, _ms = await rolled_back(lambda: _explain_naive(conn, batch))
    else:  # its own rolled-back transaction
        plan = await plans.explain_lease(conn, [KIND], batch)
    times: list[float] = []
    while len(times) < repeat and (len(times) < 5 or sum(times) < budget * 1000):
        times.append((await rolled_back(lease_once))[1])
    return plan, times


async def _explain_naive(conn: Any, batch: int) -> dict[str, Any]:
    raw = await conn.fetchval(_NAIVE_EXPLAIN, batch, "explain", LEASE_SECONDS)
    return dict((json.loads(raw) if isinstance(raw, str) else raw)[0])


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _report(result: dict[str, Any]) -> None:
    print_settings(result["postgres"])
    print(f"lease-history: lease {result['batch']} of {result['pending']:,} pending rows behind "
          f"N done rows; ms = median of up to {result['repeat']} rolled-back runs; buffers = "
          "shared hit+read of one EXPLAIN ANALYZE run")
    print("  naive = the primary-key walk plan; naive planner = PostgreSQL's own "
          "choice on fresh statistics")
    print()
    print_table(
        ["done rows", "gpuq buffers", "gpuq ms", "naive buffers", "naive ms",
         "naive planner buffers", "naive planner ms"],
        [[r["done"], r["gpuq_buffers"], r["gpuq_ms"], r["naive_buffers"], r["naive_ms"],
          r["naive_planner_buffers"], r["naive_planner_ms"]] for r in result["rows"]],
    )
    print_table(["done rows", "gpuq scans", "naive scans", "naive planner scans"],
                [[r["done"], ",".join(r["gpuq_scans"]), ",".join(r["naive_scans"]),
                  ",".join(r["naive_planner_scans"])] for r in result["rows"]])
    print(f"gpuq buffer ratio (largest/smallest history): {result['gpuq_buffer_ratio']}")
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
