"""status_counts: the truth about live work, read from the partial indexes only."""

import json

from gpuq import admin, plans, queue
from gpuq.jobs import LIVE_STATES
from gpuq.sql import queries
from tests.helpers import add_pending, seed_history


async def test_status_counts_match_the_truth(conn):
    await seed_history(conn, 5000)
    await seed_history(conn, 100, status="dead")
    await add_pending(conn, 7, kind="train")
    await add_pending(conn, 3, kind="render")
    await queue.lease(conn, ["train"], 2, "a#1", 30)
    await conn.execute("INSERT INTO gpuq.jobs (kind, status, run_at) VALUES ('train', 'scheduled', now() + interval '1h')")
    await conn.execute("ANALYZE gpuq.jobs")
    counts = await admin.status_counts(conn)
    truth = {}
    for r in await conn.fetch("SELECT status::text, kind, count(*) AS n FROM gpuq.jobs GROUP BY 1, 2"):
        truth.setdefault(r["status"], {})[r["kind"]] = r["n"]
    for status in LIVE_STATES:
        assert counts.live[status] == truth[status]
    assert counts.as_dict()["totals"] == {"pending": 8, "leased": 2, "scheduled": 1}
    assert counts.oldest_pending_seconds is not None and counts.oldest_pending_seconds >= 0
    # History is an estimate from planner statistics (exact right after ANALYZE here).
    assert abs(counts.history_estimate - 5100) <= 50


async def test_status_plan_touches_no_done_rows(conn):
    await seed_history(conn, 50_000)
    await add_pending(conn, 5)
    await conn.execute("ANALYZE gpuq.jobs")
    raw = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + queries["status_counts"])
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]
    used = plans.plan_indexes(plan)
    assert {"jobs_leased_idx", "jobs_scheduled_idx"} <= used
    # Pending plain jobs: either of their partial indexes (fair share's jobs_fair_idx has the same rows).
    assert used & {"jobs_pending_idx", "jobs_fair_idx"}
    assert not any(i.startswith("seqscan:") for i in used)
    # 50k done rows span ~900 heap pages; the status query reads a handful.
    assert plans.plan_buffers(plan) < 30
