"""Two-phase leasing: O(batch) on the pending partial index, then expired leases."""

import asyncio
import json

from gpuq import db, plans, queue
from tests.helpers import add_pending, expire_leases, job, seed_history, wait_for

LEASE = 30.0


async def _phase1_buffers(conn, kinds=("train",), n=32):
    await conn.execute("ANALYZE gpuq.jobs")
    await plans.explain_lease(conn, kinds, n)  # warm the caches and the plan
    plan = await plans.explain_lease(conn, kinds, n)
    return (plans.plan_buffers(plan, reads_only=True), plans.plan_buffers(plan),
            plans.plan_indexes(plan))


async def test_seed_regression_lease_ignores_done_history(conn):
    """The naive design's failure: 100k done rows at low ids must not make leasing walk them."""
    await add_pending(conn, 200)
    empty_reads, empty_total, empty_indexes = await _phase1_buffers(conn)

    await conn.execute("TRUNCATE gpuq.jobs RESTART IDENTITY")
    await seed_history(conn, 100_000)
    pending = await add_pending(conn, 200)
    assert min(pending) > 100_000  # pending rows sit behind the whole done prefix
    full_reads, full_total, full_indexes = await _phase1_buffers(conn)

    assert "jobs_pending_idx" in empty_indexes and "jobs_pending_idx" in full_indexes
    assert not any(i.startswith("seqscan:") for i in full_indexes)
    # 100k done rows fill ~1,800 heap pages: a walk of that prefix would add
    # hundreds to thousands of buffers. Finding the rows costs the same as on an
    # empty table; writing them costs a little more only because the primary
    # key B-tree is one level deeper (log of the table, not the done prefix).
    assert full_reads <= empty_reads + 8, (empty_reads, full_reads)
    assert full_total <= empty_total * 1.5, (empty_total, full_total)

    got = await queue.lease(conn, ["train"], 32, "a#1", LEASE)
    assert [j.id for j in got.jobs] == pending[:32]
    assert not got.phase2_ran


async def test_lease_sets_lease_fields_and_orders_by_priority(conn):
    low = await add_pending(conn, 3, priority=0)
    high = await add_pending(conn, 2, priority=5)
    other = await add_pending(conn, 2, kind="render")
    got = await queue.lease(conn, ["train"], 4, "agent-a#1", LEASE)
    assert [j.id for j in got.jobs] == high + low[:2]
    row = await job(conn, high[0])
    assert row["status"] == "leased" and row["attempts"] == 1 and row["leased_by"] == "agent-a#1"
    assert str(row["lease_token"]) == got.jobs[0].lease_token
    assert row["lease_expires_at"] > row["started_at"]
    first = got.jobs[0]  # and the payload as JSON text, for the push
    assert json.loads(first.payload_json) == row["payload"] == first.payload
    # Kinds route: a render lease never sees train jobs.
    render = await queue.lease(conn, ["render"], 10, "agent-b#1", LEASE)
    assert [j.id for j in render.jobs] == other


async def test_multiple_kinds_are_merged_in_priority_order(conn):
    a = await add_pending(conn, 2, kind="a", priority=1)
    b = await add_pending(conn, 2, kind="b", priority=9)
    got = await queue.lease(conn, ["a", "b"], 3, "x#1", LEASE)
    assert [j.id for j in got.jobs] == b + a[:1]


async def test_phase2_runs_only_when_phase1_is_short(conn):
    first = await add_pending(conn, 4)
    await queue.lease(conn, ["train"], 4, "old#1", LEASE)
    await expire_leases(conn)
    fresh = await add_pending(conn, 4)
    # One statement does both phases; with the batch full, the scan of expired
    # leases is never started (its LIMIT is 0).
    assert _expired_scan_loops(await plans.explain_lease(conn, ["train"], 4)) == 0
    assert _expired_scan_loops(await plans.explain_lease(conn, ["train"], 5)) == 1

    full = await queue.lease(conn, ["train"], 4, "new#1", LEASE)
    assert [j.id for j in full.jobs] == fresh and not full.phase2_ran
    assert [(await job(conn, i))["leased_by"] for i in first] == ["old#1"] * 4

    short = await queue.lease(conn, ["train"], 10, "new#1", LEASE)
    assert short.phase2_ran and short.reclaimed == 4
    assert sorted(j.id for j in short.jobs) == first
    assert all(j.attempt == 2 for j in short.jobs)
    row = await job(conn, first[0])
    assert row["leased_by"] == "new#1" and row["attempts"] == 2


def _expired_scan_loops(plan):
    def nodes(n):
        yield n
        for child in n.get("Plans", []):
            yield from nodes(child)

    [scan] = [n for n in nodes(plan["Plan"]) if n.get("Index Name") == "jobs_leased_idx"]
    return scan["Actual Loops"]


async def test_reclaimed_lease_gets_a_new_token(conn):
    [jid] = await add_pending(conn, 1)
    old = (await queue.lease(conn, ["train"], 1, "old#1", LEASE)).jobs[0]
    await expire_leases(conn)
    new = (await queue.lease(conn, ["train"], 1, "new#1", LEASE)).jobs[0]
    assert new.id == jid and new.lease_token != old.lease_token
    # The old holder's late result is fenced out; the new holder's lands.
    assert not await queue.complete(conn, jid, old.lease_token, {"late": True})
    assert await queue.complete(conn, jid, new.lease_token, {"ok": True})
    assert (await job(conn, jid))["result"] == {"ok": True}


async def test_exhausted_expired_lease_goes_dead(conn):
    jid = await conn.fetchval("INSERT INTO gpuq.jobs (kind, max_attempts) VALUES ('train', 1) RETURNING id")
    await queue.lease(conn, ["train"], 1, "a#1", LEASE)
    await expire_leases(conn)
    got = await queue.lease(conn, ["train"], 5, "b#1", LEASE)
    assert got.jobs == [] and got.dead == 1 and got.phase2_ran
    row = await job(conn, jid)
    assert row["status"] == "dead" and row["attempts"] == 1 and row["finished_at"] is not None
    assert "expired" in row["last_error"]


async def test_unexpired_leases_are_not_reclaimed(conn):
    await add_pending(conn, 3)
    await queue.lease(conn, ["train"], 3, "a#1", LEASE)
    got = await queue.lease(conn, ["train"], 3, "b#1", LEASE)
    assert got.jobs == [] and got.phase2_ran and got.reclaimed == 0


async def test_empty_requests_do_nothing(conn):
    await add_pending(conn, 3)
    assert (await queue.lease(conn, ["train"], 0, "a#1", LEASE)).jobs == []
    assert (await queue.lease(conn, [], 5, "a#1", LEASE)).jobs == []
    assert await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'pending'") == 3


async def test_eight_concurrent_leasers_never_share_a_job(pool):
    async with pool.acquire() as c:
        ids = await add_pending(c, 2000)

    async def leaser(name):
        mine = []
        while True:
            got = await queue.lease(pool, ["train"], 25, name, LEASE)
            if not got.jobs:
                # Pending rows another leaser holds locks on are skipped, not
                # gone: stop only when none are left at all.
                left = await pool.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'pending'")
                if left == 0:
                    return mine
                continue
            mine.extend(j.id for j in got.jobs)

    results = await asyncio.gather(*(leaser(f"l{i}#1") for i in range(8)))
    every = [i for r in results for i in r]
    assert len(every) == len(set(every)) == 2000
    assert set(every) == set(ids)
    assert sum(1 for r in results if r) >= 2  # they really ran side by side
    owners = await pool.fetch("SELECT leased_by, count(*) AS n FROM gpuq.jobs GROUP BY leased_by")
    assert {r["leased_by"]: r["n"] for r in owners} == {f"l{i}#1": len(r) for i, r in enumerate(results) if r}


async def test_lease_slots_spread_one_batch_over_agents(conn):
    ids = await add_pending(conn, 5)
    got = await queue.lease_slots(conn, ["train"], ["a#1", "b#1", "a#1", "c#1"], LEASE)
    assert [(j.id, j.leased_by) for j in got.jobs] == list(zip(ids[:4], ["a#1", "b#1", "a#1", "c#1"], strict=True))
    owners = dict(await conn.fetch("SELECT id, leased_by FROM gpuq.jobs WHERE status = 'leased'"))
    assert owners == {ids[0]: "a#1", ids[1]: "b#1", ids[2]: "a#1", ids[3]: "c#1"}
    # Fewer jobs than slots: the first slots are served, in order.
    await expire_leases(conn)
    got = await queue.lease_slots(conn, ["train"], ["x#1", "y#1"] * 4, LEASE)
    assert [j.leased_by for j in got.jobs] == ["x#1", "y#1", "x#1", "y#1", "x#1"]
    assert got.reclaimed == 4


async def test_stale_statistics_cannot_turn_the_lease_into_a_scan_of_pending(conn):
    """ANALYZE saw 2 pending rows; then 20k arrive, and the session's costs
    favour reading everything (as a mis-estimating planner does). The lease
    must still walk the pending index in order and stop after the batch."""
    await seed_history(conn, 1000)
    await add_pending(conn, 2)
    await conn.execute("ANALYZE gpuq.jobs")
    await add_pending(conn, 20_000)
    await conn.execute("SET random_page_cost = 40; SET effective_cache_size = '8kB'")
    plan = await plans.explain_lease(conn, ["train"], 64)
    text = json.dumps(plan)
    assert "Bitmap Heap Scan" not in text and "Seq Scan" not in text
    assert plans.plan_buffers(plan, reads_only=True) < 150  # 20k pending rows span ~150+ pages
    got = await queue.lease(conn, ["train"], 64, "a#1", LEASE)
    assert len(got.jobs) == 64


async def test_every_gpuq_connection_plans_with_the_lease_guard(pool, live_conn):
    """The guard is a startup setting of every connection gpuq.db opens (the
    lease itself no longer sets it), and survives a pool release."""
    for _ in range(3):  # acquire, release, acquire again
        assert await pool.fetchval("SHOW enable_bitmapscan") == "off"
        assert await pool.fetchval("SHOW enable_seqscan") == "off"
        assert await pool.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
    assert await live_conn.fetchval("SHOW enable_bitmapscan") == "off"


async def test_autovacuum_clears_the_dead_entries_leases_leave_however_large_the_history(live_conn):
    """Migration 0003: autovacuum after 20,000 dead row versions, not after 20 % of the table.

    Each lease leaves its rows' jobs_pending_idx entries dead in front of the
    live ones, and the next lease walks them until a vacuum. With 400,000 done
    rows the default would wait for 84,000 dead versions; 20,000 jobs leased
    and completed leave 40,000 (fewer once pruning reclaims some), so only the
    table's own threshold of 20,000 can start it.
    """
    await seed_history(live_conn, 400_000)
    await add_pending(live_conn, 21_000)
    # Flush this backend's insert counts first, or they arrive after the VACUUM
    # and start an insert-triggered autovacuum (the 420,000 inserted rows).
    await live_conn.execute("SELECT pg_stat_force_next_flush()")
    await live_conn.execute("SELECT 1")
    await live_conn.execute("VACUUM ANALYZE gpuq.jobs")
    clean, _, _ = await _phase1_buffers(live_conn, n=256)
    runs = "SELECT autovacuum_count FROM pg_stat_user_tables WHERE relid = 'gpuq.jobs'::regclass"
    # Autovacuum stays off while the dead prefix is built: the test cluster
    # looks every second and would otherwise clear it before it is measured.
    await live_conn.execute("ALTER TABLE gpuq.jobs SET (autovacuum_enabled = false)")
    finished = 0
    while finished < 20_000:
        jobs = (await queue.lease(live_conn, ["train"], 256, "a#1", LEASE)).jobs
        finished += len(await queue.complete_many(live_conn, [(j.id, j.lease_token, None) for j in jobs]))
    dirty, _, _ = await _phase1_buffers(live_conn, n=256)
    assert dirty > clean + 20, (clean, dirty)  # the dead prefix is there to clear
    await live_conn.execute("SELECT pg_stat_clear_snapshot()")
    before = await live_conn.fetchval(runs)
    # Only autovacuum_enabled is reset: migration 0003's thresholds stay as they are.
    await live_conn.execute("ALTER TABLE gpuq.jobs RESET (autovacuum_enabled)")

    async def vacuumed():
        await live_conn.execute("SELECT pg_stat_clear_snapshot()")
        return await live_conn.fetchval(runs) > before

    # The test cluster looks every second (devdb); a server with the default naptime, every minute.
    await wait_for(vacuumed, timeout=90, interval=0.5)
    after, _, _ = await _phase1_buffers(live_conn, n=256)
    assert after <= clean + 8, (clean, dirty, after)


async def test_a_lease_from_its_cursor_continues_where_the_last_one_ended(conn):
    await conn.execute("INSERT INTO gpuq.jobs (kind, priority) SELECT 'train', (g % 3)::smallint "
                       "FROM generate_series(1, 12) g")
    order = [r["id"] for r in await conn.fetch(
        "SELECT id FROM gpuq.jobs ORDER BY priority DESC, id")]
    first = await queue.lease(conn, ["train"], 5, "a#1", LEASE)
    assert [j.id for j in first.jobs] == order[:5]
    last = first.jobs[-1]
    assert first.cursors == {"train": (last.priority, last.id)}
    second = await queue.lease_slots(conn, ["train"], ["a#1"] * 5, LEASE, first.cursors)
    assert [j.id for j in second.jobs] == order[5:10]


async def test_a_cursor_never_passes_an_id_that_may_still_commit(conn):
    """Ids are drawn at insert: a job whose id is above ``settled`` may commit
    after the lease, so the cursor stops at settled in whatever level it lands."""
    five = await add_pending(conn, 2, priority=5)
    zero = await add_pending(conn, 3)
    got = await queue.lease_slots(conn, ["train"], ["a#1"] * 4, LEASE, None, settled=zero[0])
    assert [j.id for j in got.jobs] == five + zero[:2]
    assert got.cursors == {"train": (0, zero[0])}  # not (0, zero[1]): zero[1] was not settled
    again = await queue.lease_slots(conn, ["train"], ["a#1"] * 4, LEASE, got.cursors, settled=zero[2])
    assert [j.id for j in again.jobs] == [zero[2]] and again.cursors == {"train": (0, zero[2])}


async def test_a_cursor_stays_at_priority_zero_or_above(conn):
    """The insert trigger looks floors up only for jobs above priority 0, so no
    cursor may sit below it: a lease into negative priorities leaves it at the end of level 0."""
    low = await add_pending(conn, 2, priority=-3)
    got = await queue.lease_slots(conn, ["train"], ["a#1"], LEASE, None)
    assert [j.id for j in got.jobs] == low[:1] and got.cursors == {"train": (0, 2**63 - 1)}
    settled = await queue.lease_slots(conn, ["train"], ["a#1"], LEASE, got.cursors, settled=low[1])
    assert [j.id for j in settled.jobs] == low[1:] and settled.cursors == {"train": (0, low[1])}
    [zero] = await add_pending(conn, 1)  # level 0, id above settled: ahead of (0, settled)
    again = await queue.lease_slots(conn, ["train"], ["a#1"], LEASE, settled.cursors, settled=zero)
    assert [j.id for j in again.jobs] == [zero]


async def test_a_job_behind_the_cursor_waits_until_the_cursor_is_dropped(conn):
    await add_pending(conn, 10)
    first = await queue.lease(conn, ["train"], 4, "a#1", LEASE)
    [urgent] = await add_pending(conn, 1, priority=9)  # a higher priority: behind the cursor
    from_cursor = await queue.lease_slots(conn, ["train"], ["a#1"] * 2, LEASE, first.cursors)
    assert urgent not in [j.id for j in from_cursor.jobs]
    from_top = await queue.lease_slots(conn, ["train"], ["a#1"] * 2, LEASE)  # the dispatcher dropped it
    assert [j.id for j in from_top.jobs][0] == urgent


async def test_an_old_snapshot_cannot_slow_a_lease_that_starts_at_its_cursor(live_conn, dsn):
    """A REPEATABLE READ transaction keeps every entry the leases leave dead in jobs_pending_idx;
    a lease from the top walks them all, a lease from its cursor none (issue #14)."""
    await add_pending(live_conn, 62_000)
    # No visibility map bits, then or later: locking a row on an all-visible
    # page reads the map too, and whether a VACUUM (or an autovacuum during the
    # leases) sets them depends on other sessions' snapshots, not on the lease.
    await live_conn.execute("ALTER TABLE gpuq.jobs SET (autovacuum_enabled = false)")
    await live_conn.execute("ANALYZE gpuq.jobs")
    holder = await db.connect(dsn, direct=True)
    await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    await holder.fetchval("SELECT count(*) FROM gpuq.jobs")
    try:
        start = plans.plan_buffers(await plans.explain_lease(live_conn, ["train"], 256), reads_only=True)
        cursors: dict = {}
        for _ in range(240):  # 61,440 jobs through, as a dispatcher leases them
            got = await queue.lease_slots(live_conn, ["train"], ["a#1"] * 256, LEASE, cursors)
            cursors.update(got.cursors)
            await queue.complete_many(live_conn, [(j.id, j.lease_token, None) for j in got.jobs])
        at_cursor_plan = await plans.explain_lease(live_conn, ["train"], 256, cursors)
        at_cursor = plans.plan_buffers(at_cursor_plan, reads_only=True)
        from_top = plans.plan_buffers(await plans.explain_lease(live_conn, ["train"], 256), reads_only=True)
    finally:
        await holder.close()
    assert at_cursor <= 1.5 * start, (start, at_cursor)
    assert from_top > 2 * start, (start, from_top)  # what the cursor saves
    # The index scan itself starts at the cursor: it reads a few pages, not one per 250 jobs behind it.
    assert index_buffers(at_cursor_plan, "jobs_pending_idx") <= 12, at_cursor_plan


def index_buffers(plan: dict, index: str) -> int:
    """Buffers the plan's scans of ``index`` touched (with their heap fetches)."""
    def walk(node: dict) -> int:
        own = node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0) if node.get("Index Name") == index else 0
        return own + sum(walk(c) for c in node.get("Plans", []))
    return walk(plan["Plan"])
