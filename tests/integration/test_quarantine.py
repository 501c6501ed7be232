"""Quarantine of bad GPUs (issue #33 part 4), through real agents, a real server and PostgreSQL:
repeated DeviceError faults quarantine a device, which then gets no new job; an Xid quarantines
at once; an admin clears it (the API the CLI and the dashboard call); the quarantine outlives the
agent's connection; a job that failed on a device is retried on another one that fits."""

import json

from gpuq import quarantine
from gpuq.agent import DeviceError
from gpuq.harness import TOKEN, http_get, next_of, raw_agent, running_server
from gpuq.producer import enqueue
from gpuq.protocol import Device
from tests.helpers import dispatcher_idle, wait_for

H100S = [Device(0, "h100", 81920), Device(1, "h100", 81920)]
ONE = [Device(0, "h100", 81920)]


async def status(srv) -> dict:
    return json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])


async def states(conn, ids: list[int]) -> list[str]:
    rows = dict(await conn.fetch("SELECT id, status::text FROM gpuq.jobs WHERE id = ANY($1)", ids))
    return [rows[i] for i in ids]


async def make_due(conn, job_id: int) -> None:
    """Its retry due now instead of after the backoff (the sweeper promotes it)."""
    await conn.execute("UPDATE gpuq.jobs SET run_at = now() WHERE id = $1 AND status = 'scheduled'", job_id)


async def test_repeated_device_errors_quarantine_a_gpu_that_then_gets_no_new_job_until_cleared(dsn, live_conn):
    runs: list = []
    broken = {0}

    async def handler(job):
        runs.append((job.id, job.devices))
        if bad := broken & set(job.devices):
            raise DeviceError("CUDA error: uncorrectable ECC error encountered", devices=bad)
        return list(job.devices)

    async with running_server(dsn, poll_seconds=60, quarantine_faults=2) as srv:
        await srv.agent(["train"], 1, handler, "box", devices=H100S)
        first = [await enqueue(live_conn, "train", gpus=2, max_attempts=1) for _ in range(2)]

        async def quarantined() -> bool:  # as placement sees it: the agent's devices
            return (await status(srv))["agents"][0]["devices"][0]["quarantined"] is not None

        await wait_for(quarantined)
        assert await states(live_conn, first) == ["dead", "dead"]
        body = await status(srv)
        [q] = body["quarantined"]
        assert (q["device"], q["faults"]) == ("box:0", 2) and "2 device faults" in q["reason"]
        assert "uncorrectable ECC" in q["reason"]
        devices = body["agents"][0]["devices"]
        assert devices[0]["quarantined"] == q["reason"] and devices[1]["quarantined"] is None

        later = [await enqueue(live_conn, "train", gpus=1) for _ in range(3)]
        both = await enqueue(live_conn, "train", gpus=2)

        async def ran_later() -> bool:
            return await states(live_conn, later) == ["done"] * 3

        await wait_for(ran_later)
        await dispatcher_idle()
        assert [d for i, d in runs if i in later] == [(1,), (1,), (1,)]  # never device 0
        assert await states(live_conn, [both]) == ["pending"]  # one device is all it has now

        broken.clear()  # repaired; an admin clears it (gpuq device clear box:0)
        assert await quarantine.clear(live_conn, "box", 0) == [0]

        async def ran_both() -> bool:
            return await states(live_conn, [both]) == ["done"]

        await wait_for(ran_both)
        assert (await status(srv))["quarantined"] == []
    assert await live_conn.fetchval("SELECT count(*) FROM gpuq.device_faults") == 0  # cleared with it


async def test_an_xid_quarantines_at_once_and_a_version_8_agent_cannot_report_one(dsn, live_conn):
    async with running_server(dsn, poll_seconds=60) as srv:
        devices = [{"index": 0, "name": "h100", "memory_mb": 81920}]
        old, _ = await raw_agent(srv, ("train",), name="old", protocol=8, devices=devices, labels=[], models=[],
                                 prefetch=0, batch=0)
        fault = {"type": "device_fault", "devices": [0], "source": "xid", "error": "Xid 79", "job": None}
        await old.send(json.dumps(fault))
        assert (await next_of(old, "error"))["code"] == "unexpected"
        ws, _ = await raw_agent(srv, ("train",), name="new", protocol=9, devices=devices, labels=[], models=[],
                                prefetch=0, batch=0)
        await ws.send(json.dumps(fault))

        async def quarantined() -> bool:  # as placement sees it: the agent's devices
            new = next(a for a in (await status(srv))["agents"] if a["agent"].startswith("new#"))
            return new["devices"][0]["quarantined"] is not None

        await wait_for(quarantined)
        assert [(q["device"], q["reason"], q["faults"]) for q in (await status(srv))["quarantined"]] == [
            ("new:0", "xid: Xid 79", 1)]
        job = await enqueue(live_conn, "train", gpus=1)
        assert (await next_of(old, "jobs"))["jobs"][0]["id"] == job  # the old agent's device is fine
        await ws.close()
        await old.close()


async def test_the_quarantine_outlives_the_connection_and_a_new_one_reads_it_first(dsn, live_conn):
    runs: list = []

    async def handler(job):
        runs.append(job.devices)

    await quarantine.quarantine(live_conn, "box", 0, "by hand: fan failure")  # gpuq device quarantine box:0
    async with running_server(dsn, poll_seconds=60) as srv:
        jobs = [await enqueue(live_conn, "train", gpus=1) for _ in range(2)]
        await srv.agent(["train"], 1, handler, "box", devices=H100S)

        async def done() -> bool:
            return await states(live_conn, jobs) == ["done", "done"]

        await wait_for(done)
        assert runs == [(1,), (1,)]
        assert (await status(srv))["agents"][0]["devices"][0]["quarantined"] == "by hand: fan failure"


async def test_a_job_that_failed_on_a_device_is_retried_on_another_that_fits(dsn, live_conn):
    runs: list = []

    def on(name: str, fails: bool):
        async def handler(job):
            runs.append((name, job.devices))
            if fails:
                raise DeviceError("NCCL error: unhandled cuda error")
        return handler

    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, on("a", True), "a", devices=ONE)
        job = await enqueue(live_conn, "train", gpus=1, max_attempts=3)

        async def failed(n: int):
            async def check() -> bool:
                return await live_conn.fetchval("SELECT attempts FROM gpuq.jobs WHERE id = $1 AND status = "
                                                "'scheduled'", job) == n
            return check

        await wait_for(await failed(1))
        assert await live_conn.fetchval("SELECT failed_devices FROM gpuq.jobs WHERE id = $1", job) == ["a:0"]
        await make_due(live_conn, job)  # no other device: it goes back to the one it failed on
        await wait_for(await failed(2))
        await srv.agent(["train"], 1, on("b", False), "b", devices=ONE)
        await make_due(live_conn, job)

        async def done() -> bool:
            return await states(live_conn, [job]) == ["done"]

        await wait_for(done)
    assert runs == [("a", (0,)), ("a", (0,)), ("b", (0,))]  # without the move: a again, and dead
