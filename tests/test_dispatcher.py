"""Dispatcher resilience: lost notifications, several dispatchers on one database."""

import anyio

from tests.harness import running_server
from tests.helpers import wait_count


async def test_jobs_inserted_while_not_listening_are_delivered_after_reconnect(dsn, pool):
    got = anyio.Event()

    async def handle(job):
        got.set()

    async with running_server(dsn, poll_seconds=30) as srv:
        await srv.agent(["embed"], 1, handle)
        await anyio.sleep(0.3)
        # The notification is lost for sure: no trigger fires for this insert.
        await pool.execute("ALTER TABLE gpuq.jobs DISABLE TRIGGER jobs_notify_inserted")
        await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('embed')")
        await anyio.sleep(0.3)
        assert not got.is_set()  # nothing told the dispatcher, and the poll is 30 s away
        killed = await pool.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%'")
        assert killed == 1
        with anyio.fail_after(5):  # the reconnect leases at once
            await got.wait()


async def test_polling_covers_a_lost_notification(dsn, pool):
    got = anyio.Event()
    async with running_server(dsn, poll_seconds=0.3) as srv:
        await srv.agent(["embed"], 1, lambda job: got.set())
        await anyio.sleep(0.2)
        await pool.execute("ALTER TABLE gpuq.jobs DISABLE TRIGGER jobs_notify_inserted")
        await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('embed')")
        with anyio.fail_after(5):
            await got.wait()


async def test_two_dispatchers_never_deliver_one_job_twice(dsn, pool):
    deliveries: dict[int, list[str]] = {}

    def recorder(name):
        async def handle(job):
            deliveries.setdefault(job.id, []).append(name)
            await anyio.sleep(0)
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
