"""Global concurrency limits (issue #16): per kind and per concurrency key, in the database."""

import json

import anyio
import pytest

from gpuq import admin, queue
from gpuq.harness import http_get, next_of, raw_agent, running_server
from gpuq.jobs import Shape
from gpuq.producer import enqueue
from tests.helpers import wait_for


def blocking(running: list, release: anyio.Event):
    async def handler(job):
        running.append(job.id)
        await release.wait()
    return handler


async def test_a_kind_limit_holds_plain_and_gpu_jobs_and_lifting_it_wakes_the_rest(dsn, live_conn):
    running: list = []
    release = anyio.Event()
    await admin.set_limit(live_conn, "kind", "train", 2)
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 5, blocking(running, release), "box")
        ids = [await enqueue(live_conn, "train") for _ in range(6)]

        async def two() -> bool:
            return len(running) == 2

        await wait_for(two)
        await anyio.sleep(0.3)
        assert len(running) == 2
        [limit] = json.loads((await http_get(f"{srv.http}/status"))[2])["limits"]
        assert limit == {"scope": "kind", "name": "train", "max_running": 2, "running": 2}
        await admin.set_limit(live_conn, "kind", "train", None)  # its NOTIFY wakes the dispatcher

        async def five() -> bool:
            return len(running) == 5

        await wait_for(five)
        release.set()

        async def all_done() -> bool:
            return await live_conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'done'") == 6

        await wait_for(all_done)
    assert sorted(running) == ids


async def test_a_key_limit_holds_only_that_key_and_a_finished_job_makes_room(dsn, live_conn):
    running: list = []
    release = anyio.Event()
    await admin.set_limit(live_conn, "key", "tenant-a", 1)
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 6, blocking(running, release), "box")
        a = [await enqueue(live_conn, "train", concurrency_key="tenant-a") for _ in range(3)]
        b = [await enqueue(live_conn, "train", concurrency_key="tenant-b") for _ in range(2)]

        async def three() -> bool:
            return len(running) == 3

        await wait_for(three)
        await anyio.sleep(0.3)
        assert sorted(running) == sorted([a[0], *b])
        release.set()

        async def all_done() -> bool:
            return await live_conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'done'") == 5

        await wait_for(all_done)
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
            await anyio.sleep(0.3)
            assert not finished.is_set()  # waiting for the first one's transaction
            await tx.commit()
        assert second == []  # the limit was full once it could count
    finally:
        await pool.release(first)
