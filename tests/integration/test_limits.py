"""Global concurrency limits (issue #16): per kind and per concurrency key, in the database."""

import json
from contextlib import asynccontextmanager

import anyio
import pytest

from gpuq import admin, queue
from gpuq.harness import TOKEN, http_get, next_of, raw_agent, running_server
from gpuq.jobs import Shape
from gpuq.producer import enqueue
from tests.helpers import dispatcher_idle, wait_for


@asynccontextmanager
async def limited_box(dsn, live_conn, scope, name, max_running, capacity):
    """A limit set, then a server with one 'train' agent of ``capacity`` whose handler notes the
    job it starts and blocks until the event is set; yields (running ids, release event)."""
    running: list = []
    release = anyio.Event()

    async def handler(job):
        running.append(job.id)
        await release.wait()

    await admin.set_limit(live_conn, scope, name, max_running)
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], capacity, handler, "box")
        yield srv, running, release


async def runs_no_more_than(running: list, n: int) -> None:
    """Wait until ``n`` jobs run and the dispatcher, with credit left, went idle: it starts no more."""
    await wait_for(lambda: len(running) == n)
    await dispatcher_idle()
    assert len(running) == n


async def all_done(live_conn, n: int) -> None:
    await wait_for(lambda: _done(live_conn, n))


async def _done(live_conn, n: int) -> bool:
    return await live_conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'done'") == n


async def test_a_kind_limit_holds_plain_and_gpu_jobs_and_lifting_it_wakes_the_rest(dsn, live_conn):
    async with limited_box(dsn, live_conn, "kind", "train", 2, capacity=5) as (srv, running, release):
        ids = [await enqueue(live_conn, "train") for _ in range(6)]
        await runs_no_more_than(running, 2)
        [limit] = json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])["limits"]
        assert limit == {"scope": "kind", "name": "train", "max_running": 2, "running": 2}
        await admin.set_limit(live_conn, "kind", "train", None)  # its NOTIFY wakes the dispatcher
        await wait_for(lambda: len(running) == 5)
        release.set()
        await all_done(live_conn, 6)
    assert sorted(running) == ids


async def test_a_key_limit_holds_only_that_key_and_a_finished_job_makes_room(dsn, live_conn):
    async with limited_box(dsn, live_conn, "key", "tenant-a", 1, capacity=6) as (srv, running, release):
        a = [await enqueue(live_conn, "train", concurrency_key="tenant-a") for _ in range(3)]
        b = [await enqueue(live_conn, "train", concurrency_key="tenant-b") for _ in range(2)]
        await runs_no_more_than(running, 3)
        assert sorted(running) == sorted([a[0], *b])
        release.set()
        await all_done(live_conn, 5)
    started = [r[0] for r in await live_conn.fetch("SELECT id FROM gpuq.jobs WHERE id = ANY($1) ORDER BY started_at", a)]
    assert started == a  # one at a time, in order


async def test_an_old_agent_still_gets_a_limited_kinds_plain_jobs(dsn, live_conn):
    await admin.set_limit(live_conn, "kind", "embed", 1)
    async with running_server(dsn, poll_seconds=60) as srv:
        old, _ = await raw_agent(srv, kinds=("embed",), capacity=3)  # protocol 1
        await enqueue(live_conn, "embed")
        await enqueue(live_conn, "embed")
        pushed = (await next_of(old, "jobs"))["jobs"]
        assert len(pushed) == 1
        with pytest.raises(TimeoutError):
            await next_of(old, "jobs", timeout=0.3)
        await old.close()


@pytest.mark.parametrize("scope,name,n", [("kind", "bad kind", 1), ("key", "", 1), ("kind", "train", -1),
                                          ("tenant", "x", 1)])
async def test_a_bad_limit_is_refused(conn, scope, name, n):
    with pytest.raises(ValueError):
        await admin.set_limit(conn, scope, name, n)


async def test_limited_leases_wait_for_each_other_and_count_what_the_last_one_leased(dsn, live_conn, pool):
    """Two dispatchers at once: the second waits on the first's transaction (limits_lock), then
    sees its leases; without the lock it would not see them and lease past the limit."""
    from gpuq.sql import queries

    await admin.set_limit(live_conn, "kind", "render", 2)
    for _ in range(4):
        await enqueue(live_conn, "render")
    plain = Shape.of_plain("render")
    first = await pool.acquire()
    try:
        tx = first.transaction()
        await tx.start()
        await first.execute(queries["limits_lock"])
        got = await first.fetch(queries["lease_limited"], "render", "", ["a", "a"], 30.0, 2)
        assert len(got) == 2
        second: list = []
        finished = anyio.Event()
        async with anyio.create_task_group() as tg:
            async def lease() -> None:
                second.extend(await queue.lease_limited(pool, plain, ["b", "b"], 30.0, scan_keys=False))
                finished.set()
            tg.start_soon(lease)

            async def waits_on_a_lock() -> bool:
                return bool(await live_conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"))

            await wait_for(waits_on_a_lock)
            assert not finished.is_set()  # waiting for the first one's transaction
            await tx.commit()
        assert second == []  # the limit was full once it could count
    finally:
        await pool.release(first)
