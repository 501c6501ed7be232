"""gpuq behind a real PgBouncer in transaction mode (the ``bouncer`` fixture starts one).

Through a transaction pooler LISTEN and session settings do not work, and
PgBouncer refuses unknown startup parameters: queries go through the pooler
with the planner guards set per transaction, LISTEN uses a direct URL, or
serve polls when there is none.
"""

import json
import os
import subprocess
import sys

import anyio
import pytest

from gpuq import db, plans, queue
from gpuq.harness import http_json, running_server
from gpuq.jobs import NewJob
from tests.helpers import add_pending, dispatcher_idle, seed_history, sets, wait_count

POOLED = {"GPUQ_POOLER": "transaction"}


async def health(srv):
    return await anyio.to_thread.run_sync(http_json, srv.port, "/healthz")


async def test_a_direct_connection_is_refused_by_the_pooler_with_a_hint(bouncer):
    with pytest.raises(db.DatabaseUnavailable, match="GPUQ_POOLER=transaction"):
        await db.connect(bouncer.url, pooler=False)


async def test_serve_through_the_pooler_with_a_direct_url_for_listen(dsn, bouncer):
    done = anyio.Event()
    async with running_server(bouncer.url, pooler="transaction", direct_url=dsn, poll_seconds=30) as srv:
        await srv.agent(["embed"], 2, sets(done))
        producer = await db.connect(bouncer.url, pooler=True)
        try:
            await dispatcher_idle()  # idle: the job below can only come through NOTIFY (poll is 30 s)
            await queue.enqueue_many(producer, [NewJob("embed", {"n": 1})])
            with anyio.fail_after(10):
                await done.wait()
            assert (await health(srv))["listening"] is True
        finally:
            await producer.close()


async def test_pooled_without_a_direct_url_serve_polls_and_says_so(dsn, bouncer):
    async with running_server(bouncer.url, pooler="transaction", poll_seconds=0.2) as srv:
        assert srv.config.listen_url is None
        await srv.agent(["embed"], 4, lambda job: {"ok": job.id})
        producer = await db.connect(bouncer.url, pooler=True)
        try:
            await queue.enqueue_many(producer, [NewJob("embed", {"i": i}) for i in range(20)])
            await wait_count(producer, "done", 20, timeout=20)
        finally:
            await producer.close()
        got = await health(srv)
        assert got["ok"] is True and got["poll_only"] is True and got["listening"] is False


async def test_the_lease_guards_hold_through_the_pooler(live_conn, bouncer):
    """Each pooled statement runs with the guards (SET LOCAL in its own transaction), whatever
    server connection the pooler gives it; without them the session's defaults apply. Under
    stale statistics and costs that favour reading everything, the lease still walks
    jobs_pending_idx (test_lease has the direct case)."""
    await seed_history(live_conn, 1000)
    await add_pending(live_conn, 2)
    await live_conn.execute("ANALYZE gpuq.jobs")
    await add_pending(live_conn, 20_000)
    pooled = await db.connect(bouncer.url, pooler=True)
    try:
        for _ in range(3):
            assert await pooled.fetchval("SHOW enable_bitmapscan") == "off"
            assert await pooled.fetchval("SHOW enable_seqscan") == "off"
            assert await pooled.fetchval("SHOW jit") == "off"
            assert await pooled.inner.fetchval("SHOW enable_bitmapscan") == "on"  # no session setting
        async with pooled.inner.transaction():  # one server connection, however the pooler assigns them
            await pooled.inner.execute("SET LOCAL random_page_cost = 40; SET LOCAL effective_cache_size = '8kB'")
            plan = await plans.explain_lease(pooled, ["train"], 64)
    finally:
        await pooled.close()
    text = json.dumps(plan)
    assert "Bitmap Heap Scan" not in text and "Seq Scan" not in text and "jobs_pending_idx" in text
    assert plans.plan_buffers(plan, reads_only=True) < 150


def gpuq(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuq.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_enqueue_and_status_work_through_the_pooler(dsn, bouncer):
    env = {"DATABASE_URL": bouncer.url, **POOLED}
    res = gpuq("enqueue", "embed", '{"x": 1}', env=env)
    assert res.returncode == 0, res.stderr
    res = gpuq("status", "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["live"]["pending"] == {"embed": 1}


def test_migrate_through_the_pooler_needs_the_direct_url(dsn, bouncer):
    refused = gpuq("migrate", env={"DATABASE_URL": bouncer.url, **POOLED})
    assert refused.returncode == 1 and "GPUQ_DIRECT_URL" in refused.stderr
    ok = gpuq("migrate", env={"DATABASE_URL": bouncer.url, "GPUQ_DIRECT_URL": dsn, **POOLED})
    assert ok.returncode == 0 and ok.stdout.strip() == "up to date", ok.stderr
