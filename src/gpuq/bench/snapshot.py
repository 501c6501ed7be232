"""``gpuq bench snapshot``: what an old snapshot does to the cost of a lease.

``--pending`` jobs are queued; then ``--jobs`` of them are leased (``--batch``
at a time, each lease from the cursor the last one left, as the dispatcher
does) and completed with the queue's own statements, over asyncpg, no
websockets. The lease's EXPLAIN (ANALYZE, BUFFERS) is taken before and after,
from the cursor (what the dispatcher runs) and from the top of the index.
The run is done twice on a fresh schema: without, then with a REPEATABLE READ
transaction held open on another connection from before the first lease (a
report, ``pg_dump``, a replica with hot_standby_feedback). Every lease leaves
its rows' jobs_pending_idx entries dead in front of the live ones; only
VACUUM or a later scan can clear them, and neither can while a snapshot may
still see those rows. ``buffer_ratio`` = buffers after / before (target of
issue #14 under the snapshot: <= 1.5).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from gpuq import plans, queue
from gpuq.bench import common
from gpuq.db import connect
from gpuq.harness import KIND

LEASE_SECONDS = 300.0


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--pending", 250_000, "jobs queued")
        common.positive(p, "--jobs", 200_000, "jobs leased and completed between the two measurements")
        common.positive(p, "--batch", 256, "jobs per lease")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        if a.jobs > a.pending:
            raise RuntimeError(f"--jobs ({a.jobs}) must not exceed --pending ({a.pending})")
        plain = await run(t.dsn, a.pending, a.jobs, a.batch, hold_snapshot=False)
        held = await run(t.dsn, a.pending, a.jobs, a.batch, hold_snapshot=True)
        return {"bench": "snapshot", "pending": a.pending, "jobs": a.jobs, "batch": a.batch,
                **{f"no_snapshot_{k}": v for k, v in plain.items() if k != "postgres"},
                **{k: v for k, v in held.items() if k != "postgres"}, "postgres": held["postgres"]}

    common.declare(sub, "snapshot", "lease cost before and after N jobs, with and without an open "
                   "REPEATABLE READ snapshot", __doc__, args, body, report)


async def run(dsn: str, pending: int, jobs: int, batch: int, hold_snapshot: bool) -> dict[str, Any]:
    await common.reset_gpuq_schema(dsn)
    conn, other = (await connect(dsn, direct=True, command_timeout=None),  # seeds and VACUUMs
                   await connect(dsn, direct=True, command_timeout=None))
    try:
        settings = await common.server_settings(conn)
        await conn.execute(common.queries["insert_pending"], KIND, pending)
        await conn.execute(common.queries["vacuum_jobs"])
        if hold_snapshot:
            await other.execute(common.queries["snapshot_begin"])
            await other.fetchval(common.queries["snapshot_take"])
        before = await _measure(conn, batch)
        common.progress(f"{'with' if hold_snapshot else 'without'} an old snapshot: leasing {jobs:,} jobs")
        t0, done = time.perf_counter(), 0
        cursors: dict[str, tuple[int, int]] = {}
        while done < jobs:
            got = await queue.lease_slots(conn, [KIND], ["snap#1"] * min(batch, jobs - done), LEASE_SECONDS, cursors)
            if not got.jobs:
                raise RuntimeError(f"the queue ran dry after {done} jobs")
            cursors.update(got.cursors)
            done += len(await queue.complete_many(conn, [(j.id, j.lease_token, None) for j in got.jobs]))
        elapsed = time.perf_counter() - t0
        after = await _measure(conn, batch, cursors)
        from_top = await _measure(conn, batch)
        if hold_snapshot:
            await other.execute(common.queries["snapshot_end"])
    finally:
        await conn.close()
        await other.close()
    return {"buffers_start": before[0], "buffers_end": after[0],
            "buffer_ratio": round(after[0] / before[0], 3) if before[0] else None,
            "lease_ms_start": before[1], "lease_ms_end": after[1],
            "buffers_end_from_top": from_top[0], "lease_ms_end_from_top": from_top[1],
            "jobs_per_s": round(jobs / elapsed, 1), "postgres": settings}


async def _measure(conn: Any, batch: int, cursors: dict[str, tuple[int, int]] | None = None) -> tuple[int, float]:
    """(buffers the lease reads to find its rows, its execution ms), the second of two rolled-back runs."""
    await plans.explain_lease(conn, [KIND], batch, cursors)
    plan = await plans.explain_lease(conn, [KIND], batch, cursors)
    return plans.plan_buffers(plan, reads_only=True), round(float(plan["Execution Time"]), 3)


def report(r: dict[str, Any]) -> None:
    common.print_settings(r["postgres"])
    rows = [[label, r[f"{p}buffers_start"], r[f"{p}buffers_end"], r[f"{p}buffer_ratio"], r[f"{p}lease_ms_start"],
             r[f"{p}lease_ms_end"], r[f"{p}buffers_end_from_top"], r[f"{p}jobs_per_s"]]
            for label, p in (("no snapshot", "no_snapshot_"), ("old snapshot held", ""))]
    common.print_table(["", "buffers before", "after (cursor)", "ratio", "ms before", "ms after",
                        "after (from the top)", "jobs/s"], rows,
                       title=f"snapshot: lease {r['batch']} of {r['pending']:,} pending, before and after "
                             f"{r['jobs']:,} jobs went through")


if __name__ == "__main__":
    raise SystemExit(common.standalone("snapshot"))
