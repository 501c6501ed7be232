"""Dispatcher resilience: lost notifications, several dispatchers on one database."""

import json
from contextlib import asynccontextmanager

import anyio

from gpuq.harness import TOKEN, http_get, next_of, raw_agent, running_server
from tests.helpers import dispatcher_idle, sets, wait_count, wait_for


async def _listening(srv) -> bool:
    return (await http_get(srv.http + "/healthz"))[0] == 200  # 200: the LISTEN connection is up


@asynccontextmanager
async def job_inserted_silently(dsn, pool, poll_seconds):
    """A server with one idle 'embed' agent, then an 'embed' job inserted with no trigger, so
    no notification for sure; yields the event its handler sets."""
    got = anyio.Event()
    async with running_server(dsn, poll_seconds=poll_seconds) as srv:
        await srv.agent(["embed"], 1, sets(got))
        await wait_for(lambda: _listening(srv))  # else the pass LISTEN's connect owes would find the job
        await dispatcher_idle()  # its first pass found nothing: it waits for a wake-up
        await pool.execute("ALTER TABLE gpuq.jobs DISABLE TRIGGER USER")
        await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('embed')")
        yield got


async def test_jobs_inserted_while_not_listening_are_delivered_after_reconnect(dsn, pool):
    async with job_inserted_silently(dsn, pool, poll_seconds=30) as got:
        await dispatcher_idle()  # awake since the insert, with credit, and it leased nothing
        assert not got.is_set()  # nothing told the dispatcher, and the poll is 30 s away
        killed = await pool.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%'")
        assert killed == 1
        with anyio.fail_after(5):  # the reconnect leases at once
            await got.wait()


async def test_polling_covers_a_lost_notification(dsn, pool):
    async with job_inserted_silently(dsn, pool, poll_seconds=0.3) as got:
        with anyio.fail_after(5):
            await got.wait()


async def test_two_dispatchers_never_deliver_one_job_twice(dsn, pool):
    deliveries: dict[int, list[str]] = {}

    def recorder(name):
        async def handle(job):
            deliveries.setdefault(job.id, []).append(name)
            await anyio.sleep(0)  # not a settle wait: a real await, so the handlers of an agent interleave
        return handle

    async with running_server(dsn) as one, running_server(dsn) as two:
        for srv, label in ((one, "one"), (two, "two")):
            for i in range(3):
                await srv.agent(["embed"], 8, recorder(f"{label}-{i}"), name=f"{label}-{i}")
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'embed' FROM generate_series(1, 2000)")
        await wait_count(pool, "done", 2000, timeout=60)
    assert len(deliveries) == 2000
    assert all(len(v) == 1 for v in deliveries.values())
    served = {name.split("-")[0] for v in deliveries.values() for name in v}
    assert served == {"one", "two"}  # both dispatchers really took part


async def test_one_lease_statement_serves_every_agent_of_a_group(dsn, pool):
    """4 idle agents x 64 credits and 256 new jobs: one statement of 256, not four of 64."""
    from gpuq import metrics
    from tests.helpers import wait_for

    def bucket(b):
        return metrics.REGISTRY.get_sample_value("gpuq_lease_batch_size_bucket", {"le": b}) or 0.0

    def statements(le):  # lease statements that returned 1..le jobs (polls lease 0 now and then)
        return bucket(le) - bucket("0.0")

    async with running_server(dsn) as srv:
        assert srv.config.max_batch == 256
        agents = [(await raw_agent(srv, capacity=64, name=f"a{i}"))[0] for i in range(4)]
        async def all_connected():
            return json.loads((await http_get(srv.http + "/status", token=TOKEN))[2])["agents_connected"] == 4

        await wait_for(all_connected)
        # A lease pass that began before the last agent registered leases for fewer agents (and
        # on a loaded machine its statement can run after the insert). Passes run one at a time:
        # once two more lease statements have come back empty, the next pass sees all four.
        empty = bucket("0.0")

        async def settled():
            return bucket("0.0") >= empty + 2

        await wait_for(settled)
        small, total = statements("128.0"), statements("+Inf")
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'embed' FROM generate_series(1, 256)")
        for ws in agents:
            assert len((await next_of(ws, "jobs"))["jobs"]) == 64
        assert statements("+Inf") - total >= 1 and statements("128.0") == small  # no lease of <= 128
        for ws in agents:
            await ws.close()


async def test_jobs_leased_for_an_agent_that_left_during_the_lease_go_back_at_once(pool):
    """The agent disconnected while its lease statement ran: nobody can take the push.

    Found by a flaky test: the jobs were queued as orphans but nothing woke the
    completer that releases them, so they waited for the next outcome of any
    agent, or for their lease to expire (30 s here).
    """
    from gpuq import queue
    from gpuq.dispatcher import Dispatcher
    from gpuq.harness import server_config
    from tests.helpers import add_pending, count, wait_for

    async with pool.acquire() as conn:
        await add_pending(conn, 2)
        jobs = (await queue.lease(conn, ["train"], 2, "gone#1", 30.0)).jobs
    d = Dispatcher(pool, server_config("unused"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(d.completer.run)
        d._deliver(jobs)  # "gone#1" is no longer among the dispatcher's sessions

        async def released():
            return await count(pool, "pending") == 2

        await wait_for(released, timeout=5)
        tg.cancel_scope.cancel()
