"""Maintenance services: expired leases, due retries (with NOTIFY) and bounded retention."""

from gpuq import queue
from gpuq.maintenance import Maintainer, PromoteDue, PruneHistory, ReclaimExpired
from tests.helpers import add_pending, expire_leases, job, seed_history


async def test_retry_is_promoted_when_due_and_a_listener_hears_it(pool, notifications):
    async with pool.acquire() as conn:
        await add_pending(conn, 1)
        [j] = (await queue.lease(conn, ["train"], 1, "a#1", 30)).jobs
        await notifications.drain(0.1)
        out = await queue.fail(conn, j.id, j.lease_token, "flaky", True)
        assert out.status == "scheduled" and out.run_at > await conn.fetchval("SELECT now()")
        sweeper = Maintainer.standard(pool)
        assert (await sweeper.run_once())["promoted"] == 0  # not due yet
        await conn.execute("UPDATE gpuq.jobs SET run_at = now() - interval '1 ms' WHERE id = $1", j.id)
        report = await sweeper.run_once()
        assert report["promoted"] == 1
        assert (await job(conn, j.id))["status"] == "pending"
        assert await notifications.next() == "train!"
        [again] = (await queue.lease(conn, ["train"], 1, "b#1", 30)).jobs
        assert again.id == j.id and again.attempt == 2


async def test_sweeper_reclaims_expired_leases_in_bounded_batches(pool, notifications):
    async with pool.acquire() as conn:
        await add_pending(conn, 25)
        await conn.execute("UPDATE gpuq.jobs SET max_attempts = 1 WHERE id <= 5")
        await queue.lease(conn, ["train"], 25, "gone#1", 30)
        await expire_leases(conn)
        await notifications.drain(0.1)
        sweeper = ReclaimExpired(pool, batch=4, max_batches=3)
        first = await sweeper.run_once()
        assert first["reclaimed"] + first["dead"] == 12  # 3 statements of 4 rows: bounded
        while sum((await sweeper.run_once()).values()):
            pass
        counts = dict(await conn.fetch("SELECT status::text, count(*) FROM gpuq.jobs GROUP BY 1"))
        assert counts == {"pending": 20, "dead": 5}
        assert "train!" in await notifications.drain()


async def test_retention_deletes_only_old_history_in_windows(pool):
    async with pool.acquire() as conn:
        await seed_history(conn, 3000)
        await seed_history(conn, 400, status="dead")
        await seed_history(conn, 100, status="cancelled")
        await conn.execute("UPDATE gpuq.jobs SET created_at = now() - interval '2 days', "
                           "finished_at = now() - interval '2 days'")
        old_live = await add_pending(conn, 3)
        await conn.execute("UPDATE gpuq.jobs SET created_at = now() - interval '2 days' WHERE id = ANY($1)",
                           old_live)
        await seed_history(conn, 200)  # finished just now: kept
        sweeper = PruneHistory(pool, retention_seconds=86400, window=1000, max_batches=2)
        first = await sweeper.run_once()
        assert first["pruned"] == 2000  # two windows of 1,000 ids per run
        total = first["pruned"]
        while (report := await sweeper.run_once())["pruned"]:
            total += report["pruned"]
        assert total == 3500
        left = dict(await conn.fetch("SELECT status::text, count(*) FROM gpuq.jobs GROUP BY 1"))
        assert left == {"pending": 3, "done": 200}


async def test_no_retention_keeps_history(pool):
    async with pool.acquire() as conn:
        await seed_history(conn, 100)
        await conn.execute("UPDATE gpuq.jobs SET finished_at = now() - interval '400 days'")
    maintainer = Maintainer.standard(pool)
    assert [s.name for s in maintainer.services] == ["reclaim_expired", "promote_due", "fire_schedules",
                                                        "expire_deadlines"]
    assert (await maintainer.run_once())["pruned"] == 0
    assert await pool.fetchval("SELECT count(*) FROM gpuq.jobs") == 100


async def test_a_promoted_batch_is_bounded_too(pool):
    async with pool.acquire() as conn:
        await conn.execute("INSERT INTO gpuq.jobs (kind, status, run_at) "
                           "SELECT 'train', 'scheduled', now() - interval '1 s' FROM generate_series(1, 10)")
    assert await PromoteDue(pool, batch=3, max_batches=2).run_once() == {"promoted": 6}
