"""Two ``gpuq serve`` on one database, the agents split between them (issue #29, "Placement across
servers"): reservations, warm holds and unplaceable jobs are decided from the whole fleet
(gpuq.fleet_agents); cancel, pause, progress and gpuq.wait go through the database."""

import json

import anyio

import gpuq
from gpuq import admin
from gpuq.dispatcher import Tuning
from gpuq.harness import TOKEN, http_get, running_server
from gpuq.producer import cancel as gpuq_cancel
from gpuq.producer import enqueue
from gpuq.protocol import Device
from tests.helpers import async_until_cancelled, dispatcher_idle, status_of, wait_for, wait_status

H100S = [Device(0, "h100", 81920), Device(1, "h100", 81920)]
# Server A reads the other servers' rows at every pass: a test that waited for a row in the table
# knows A's next pass sees it (the default reads at most every 0.1 s).
READ_ALWAYS = Tuning(fleet_read_seconds=0, fleet_refresh_seconds=0.2, fleet_stale_seconds=2)


async def status(srv) -> dict:
    return json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])


def recorder(name: str, runs: list, release: anyio.Event):
    async def handler(job):
        runs.append((name, job.id))
        await release.wait()
    return handler


async def fleet_row(conn, agent_name: str, model: str | None = None) -> bool:
    """Whether an agent's row (holding ``model`` warm) is in gpuq.fleet_agents."""
    return bool(await conn.fetchval("SELECT count(*) FROM gpuq.fleet_agents WHERE agent LIKE $1 || '#%' "
                                    "AND ($2::text IS NULL OR $2 = ANY(models))", agent_name, model))


async def test_each_server_keeps_its_agents_rows_and_drops_them_on_disconnect_and_stop(dsn, live_conn):
    release = anyio.Event()
    async with running_server(dsn) as a, running_server(dsn) as b:
        await a.agent(["train"], 1, recorder("a", [], release), "a-box", devices=H100S, labels=["gpu=h100"])
        b_runs: list = []
        gone = await b.agent(["train", "embed"], 1, recorder("b", b_runs, release), "b-box", models=["llama"])
        await wait_for(lambda: fleet_row(live_conn, "b-box", "llama"))
        await wait_for(lambda: fleet_row(live_conn, "a-box"))
        row = await live_conn.fetchrow("SELECT * FROM gpuq.fleet_agents WHERE agent LIKE 'a-box#%'")
        assert (row["kinds"], row["devices"], row["labels"], row["models"]) == (["train"], [81920, 81920],
                                                                                ["gpu=h100"], [])
        servers = await live_conn.fetchval("SELECT count(DISTINCT server) FROM gpuq.fleet_agents")
        assert servers == 2
        gone.set_models(["sdxl"])
        await wait_for(lambda: fleet_row(live_conn, "b-box", "sdxl"))
        await enqueue(live_conn, "embed")  # b-box runs it until release: its drain takes that long
        await wait_for(lambda: b_runs)  # started, not only leased: a stop gives back a job not yet started
        gone.stop()

        async def draining() -> bool:
            return bool(await live_conn.fetchval("SELECT draining FROM gpuq.fleet_agents WHERE agent LIKE 'b-box#%'"))

        async def b_left() -> bool:
            return not await fleet_row(live_conn, "b-box")

        await wait_for(draining)  # no job waits for its warm models any more
        release.set()
        await wait_for(b_left)
    assert await live_conn.fetchval("SELECT count(*) FROM gpuq.fleet_agents") == 0  # a clean stop leaves none


async def test_a_reservation_ends_when_another_server_leases_its_job(dsn, live_conn):
    """A's agent is kept for a 2-GPU job; B's agent, free, leases it: A's agent takes 1-GPU jobs
    again at its next check (it once refused every other GPU shape for good)."""
    started: list[int] = []
    release = anyio.Event()

    async def handler(job):
        started.append(job.id)
        await release.wait()

    async with running_server(dsn, reserve_after_seconds=0.3) as a:  # polls look for reservations
        await a.agent(["train"], 1, handler, "a-box", devices=H100S, prefetch=0)
        first = await enqueue(live_conn, "train", gpus=1)
        await wait_for(lambda: first in started)  # device 0 taken: the 2-GPU job must wait
        big = await enqueue(live_conn, "train", gpus=2)

        async def reserved() -> bool:
            return any(x["reserved_for"] for x in (await status(a))["agents"])

        await wait_for(reserved)
        async with running_server(dsn) as b:
            await b.agent(["train"], 1, handler, "b-box", devices=H100S, prefetch=0)
            await wait_for(lambda: big in started)  # leased through B: its two devices were free
            small = await enqueue(live_conn, "train", gpus=1)
            await wait_for(lambda: small in started)  # only A's device 1 is free
            leased_by = await live_conn.fetchval("SELECT leased_by FROM gpuq.jobs WHERE id = $1", small)
            assert leased_by.startswith("a-box#")
            assert not await reserved()
            release.set()


async def test_a_job_waits_for_its_model_warm_on_another_servers_agent(dsn, live_conn):
    runs: list = []
    release = anyio.Event()
    async with running_server(dsn, poll_seconds=60, warm_wait_seconds=30, tuning=READ_ALWAYS) as a, \
            running_server(dsn, poll_seconds=60, warm_wait_seconds=30) as b:
        await b.agent(["train"], 1, recorder("warm", runs, release), "warm", devices=H100S[:1],
                      models=["llama"], prefetch=0)
        await enqueue(live_conn, "train", gpus=1, model="llama")
        await wait_for(lambda: [r[0] for r in runs] == ["warm"])  # B's warm agent is busy
        await a.agent(["train"], 1, recorder("cold", runs, release), "cold", devices=H100S, prefetch=0)
        await wait_for(lambda: fleet_row(live_conn, "warm", "llama"))
        held = await enqueue(live_conn, "train", gpus=1, model="llama")
        nowhere_warm = await enqueue(live_conn, "train", gpus=1, model="sdxl")  # no point waiting: goes at once
        await wait_for(lambda: ("cold", nowhere_warm) in runs)  # A made a pass after both were enqueued
        await dispatcher_idle()
        assert len(runs) == 2 and await status_of(live_conn, held) == "pending"  # A's device 1 stayed free
        release.set()
        await wait_for(lambda: len(runs) == 3)
        assert runs[2] == ("warm", held)


async def test_unplaceable_counts_the_other_servers_agents_and_forgets_a_crashed_ones(dsn, live_conn):
    runs: list = []
    release = anyio.Event()
    async with running_server(dsn, poll_seconds=60, tuning=READ_ALWAYS) as a, \
            running_server(dsn, poll_seconds=60) as b:
        await a.agent(["train"], 1, recorder("plain", runs, release), "plain", devices=H100S)
        await b.agent(["train"], 1, recorder("b200", runs, release), "b200", devices=H100S[:1],
                      labels=["gpu=b200"], prefetch=0)
        await enqueue(live_conn, "train", gpus=1, labels=["gpu=b200"])
        await wait_for(lambda: [r[0] for r in runs] == ["b200"])
        waiting = await enqueue(live_conn, "train", gpus=1, labels=["gpu=b200"])  # B's agent is busy
        await wait_for(lambda: fleet_row(live_conn, "b200"))
        assert (await status(a))["unplaceable"] == {}  # it fits B's agent: it only waits
        await enqueue(live_conn, "train", gpus=1, labels=["gpu=a100"])

        async def reported() -> bool:  # once A has read the new shape (at most every 50 ms)
            return "train" in (await status(a))["unplaceable"]

        await wait_for(reported)
        [nobody] = (await status(a))["unplaceable"]["train"]
        assert nobody["labels"] == ["gpu=a100"] and nobody["reason"] == "no agent taking train has the labels gpu=a100"

        # A server that crashed leaves its rows: they count until the staleness bound, then are pruned.
        await live_conn.execute("INSERT INTO gpuq.fleet_agents (server, agent, kinds, protocol, devices, labels) "
                                "VALUES ('crashed', 'a100#1', '{train}', 6, '{81920}', '{gpu=a100}')")
        assert (await status(a))["unplaceable"].get("train", []) == []
        await live_conn.execute("UPDATE gpuq.fleet_agents SET seen_at = now() - interval '1 minute' "
                                "WHERE server = 'crashed'")
        assert [u["labels"] for u in (await status(a))["unplaceable"]["train"]] == [["gpu=a100"]]

        async def pruned() -> bool:
            return not await live_conn.fetchval("SELECT count(*) FROM gpuq.fleet_agents WHERE server = 'crashed'")

        await wait_for(pruned)
        assert await status_of(live_conn, waiting) == "pending"
        release.set()


async def test_a_server_writes_its_rows_again_when_the_table_was_emptied(dsn, live_conn):
    """A failover or a crash empties the unlogged table: the next refresh writes the rows again."""
    release = anyio.Event()
    async with running_server(dsn, tuning=READ_ALWAYS) as a:
        await a.agent(["train"], 1, recorder("a", [], release), "a-box", devices=H100S)
        await wait_for(lambda: fleet_row(live_conn, "a-box"))
        await live_conn.execute("TRUNCATE gpuq.fleet_agents")
        await wait_for(lambda: fleet_row(live_conn, "a-box"))
        release.set()


async def test_cancel_pause_progress_and_wait_hold_across_two_servers(dsn, pool):
    """Jobs run on B's agent; A runs too (its dispatcher, sweeper and LISTEN on the same database)."""
    stopped = anyio.Event()
    go = anyio.Event()

    async def reports(job):
        job.progress(0.5, "halfway")
        await go.wait()
        return {"ok": job.id}

    async with running_server(dsn) as a, running_server(dsn) as b:
        await a.agent(["other"], 1, recorder("a", [], go), "a-box")
        await b.agent(["doomed"], 1, async_until_cancelled(stopped), "b-doomed")
        doomed = await gpuq.enqueue(pool, "doomed", {})
        await wait_status(pool, doomed, "leased")
        await gpuq_cancel(pool, doomed)
        with anyio.fail_after(10):
            await stopped.wait()  # the handler on B's agent was told to stop
        await wait_status(pool, doomed, "cancelled")

        await admin.pause(pool, "train", "test")
        job = await gpuq.enqueue(pool, "train", {})
        await b.agent(["train"], 1, reports, "b-train")
        await dispatcher_idle()
        assert await status_of(pool, job) == "pending"  # paused: neither server leases it
        await admin.resume(pool, "train")
        seen: list = []
        async with anyio.create_task_group() as tg:
            async def waiter() -> None:
                seen.append(await gpuq.wait(pool, job, timeout=30, on_progress=lambda p: seen.append(p)))

            tg.start_soon(waiter)
            await wait_for(lambda: any(isinstance(p, dict) and p.get("message") == "halfway" for p in seen))
            code, _, body = await http_get(f"{a.http}/jobs/{job}", token=TOKEN)  # A serves it too
            assert code == 200 and json.loads(body)["progress"]["message"] == "halfway"
            go.set()
        assert seen[-1] == {"ok": job}
