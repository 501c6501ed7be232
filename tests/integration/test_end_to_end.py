"""Jobs flow from an INSERT to websocket agents and back (real server, real sockets)."""

import anyio

from gpuq.harness import running_server
from tests.helpers import count, dispatcher_idle, sets, wait_count


async def test_1000_jobs_three_agents_each_done_exactly_once(dsn, pool):
    calls: dict[int, int] = {}

    async def handle(job):
        calls[job.id] = calls.get(job.id, 0) + 1
        return {"double": job.payload["n"] * 2}

    async with running_server(dsn) as srv:
        for i in range(3):
            await srv.agent(["embed"], 4, handle, name=f"a{i}")
        await pool.execute(
            "INSERT INTO gpuq.jobs (kind, payload) SELECT 'embed', jsonb_build_object('n', g) "
            "FROM generate_series(1, 1000) g"
        )
        await wait_count(pool, "done", 1000)
    rows = await pool.fetch("SELECT id, payload, result, attempts FROM gpuq.jobs")
    assert len(rows) == 1000
    assert all(r["result"] == {"double": r["payload"]["n"] * 2} for r in rows)
    assert all(r["attempts"] == 1 for r in rows)
    assert sorted(calls) == sorted(r["id"] for r in rows) and set(calls.values()) == {1}


async def test_a_single_insert_reaches_an_idle_agent_without_polling(dsn, pool):
    started = anyio.Event()
    async with running_server(dsn, poll_seconds=30) as srv:
        await srv.agent(["embed"], 1, sets(started))
        await dispatcher_idle()  # the agent is idle: its first lease pass found nothing
        await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('embed')")
        with anyio.fail_after(3):  # far below the 30 s poll interval: NOTIFY did it
            await started.wait()


async def test_capacity_is_never_exceeded_and_kinds_route(dsn, pool):
    running = {"now": 0, "max": 0}
    seen_by_b: list[str] = []
    release = anyio.Event()

    async def slow(job):
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        await release.wait()
        running["now"] -= 1

    async def only_b(job):
        seen_by_b.append(job.kind)

    async with running_server(dsn) as srv:
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'A' FROM generate_series(1, 20)")
        await srv.agent(["B"], 4, only_b, name="b")
        await dispatcher_idle()  # woken by the inserts and the agent, it went idle with credit left
        assert await count(pool, "leased") == 0  # no agent for kind A: nothing leased
        await srv.agent(["A"], 2, slow, name="a")
        await wait_count(pool, "leased", 3, timeout=5)  # 2 running, 1 prefetched (DEFAULT_PREFETCH)
        await dispatcher_idle()  # it went idle with agent b's credit left: it leases no more A
        assert await count(pool, "leased") == 3 and running["max"] == 2
        release.set()
        await wait_count(pool, "done", 20)
        assert running["max"] == 2
        await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('B')")
        await wait_count(pool, "done", 21)
    assert seen_by_b == ["B"]
