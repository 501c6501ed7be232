"""Preemption (issue #33): a preemptible job asked to yield goes back to pending without counting the
attempt; the server reaches the agent through the database (gpuq.preempt's NOTIFY), fences the report
by the lease token, counts preemptions and stops at max_preemptions; older agents never get such jobs."""

import asyncio
import json

import anyio
import pytest

import gpuq
from gpuq.agent import JobPreempted, on_preempt
from gpuq.dispatcher import Tuning
from gpuq.harness import http_json, next_of, raw_agent, running_server
from tests.helpers import job, wait_for, wait_status

HELLO_9 = {"protocol": 9, "devices": [], "labels": [], "models": [], "prefetch": 0, "batch": 0}
WRONG_TOKEN = "00000000-0000-0000-0000-000000000000"


async def test_a_preempted_job_yields_goes_back_and_runs_again_without_counting_the_attempt(dsn, pool):
    seen: list[tuple[int, bool]] = []
    running = anyio.Event()

    async def handle(job):
        seen.append((job.attempt, job.preempted))
        if len(seen) > 1:
            return {"resumed": True}
        asked = asyncio.Event()
        on_preempt(job, asked.set)
        running.set()
        await asked.wait()
        raise JobPreempted("checkpoint saved")

    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, handle)
        job_id = await gpuq.enqueue(pool, "train", {}, preemptible=True, grace_seconds=60)
        with anyio.fail_after(10):
            await running.wait()
        assert await gpuq.preempt(pool, job_id) == {job_id: 60.0}
        await wait_status(pool, job_id, "done")
    row = await job(pool, job_id)
    assert seen == [(1, False), (1, False)]  # the same attempt, run again
    assert (row["attempts"], row["preemptions"], row["preempt_at"]) == (1, 1, None)
    assert row["result"] == {"resumed": True}


async def test_the_server_asks_a_version_9_agent_fences_its_report_and_stops_at_max_preemptions(dsn, pool):
    async with running_server(dsn, poll_seconds=60) as srv:
        ws, _ = await raw_agent(srv, ("train",), **HELLO_9)
        job_id = await gpuq.enqueue(pool, "train", {}, preemptible=True, grace_seconds=2.5, max_preemptions=1)
        [pushed] = (await next_of(ws, "jobs"))["jobs"]
        assert pushed["grace_seconds"] == 2.5  # pushed as preemptible
        assert await gpuq.preempt(pool, job_id) == {job_id: 2.5}
        assert await gpuq.preempt(pool, job_id) == {}  # asked already, within its grace time
        assert await next_of(ws, "preempt") == {"type": "preempt", "ids": [job_id], "deadline_seconds": 2.5}

        await ws.send(json.dumps({"type": "preempted", "id": job_id, "lease_token": WRONG_TOKEN}))
        assert (await next_of(ws, "ack"))["rejected"] == [job_id]
        await ws.send(json.dumps({"type": "results", "results": [
            {"type": "preempted", "id": job_id, "lease_token": pushed["lease_token"]}]}))
        assert (await next_of(ws, "ack"))["accepted"] == [job_id]

        [again] = (await next_of(ws, "jobs"))["jobs"]  # pending again, and pushed again
        assert (again["id"], again["attempt"]) == (job_id, 1)
        assert await gpuq.preempt(pool, job_id) == {}  # max_preemptions reached: it runs to its end
        await ws.send(json.dumps({"type": "done", "id": job_id, "lease_token": again["lease_token"], "result": 1}))
        assert (await next_of(ws, "ack"))["accepted"] == [job_id]
        await ws.close()
    row = await job(pool, job_id)
    assert (row["status"], row["attempts"], row["preemptions"]) == ("done", 1, 1)
    assert await pool.fetchval("SELECT count(*) FROM gpuq.attempts WHERE job_id = $1", job_id) == 0


async def test_a_version_8_agent_is_never_given_a_preemptible_job(dsn, pool):
    async with running_server(dsn, poll_seconds=60, tuning=Tuning(shapes_seconds=0)) as srv:
        old, _ = await raw_agent(srv, ("train",), capacity=2, name="old", **{**HELLO_9, "protocol": 8})
        yielding = await gpuq.enqueue(pool, "train", {}, preemptible=True)
        plain = await gpuq.enqueue(pool, "train", {})
        [pushed] = (await next_of(old, "jobs"))["jobs"]  # the old agent keeps a free slot
        assert pushed["id"] == plain and "grace_seconds" not in pushed
        status = await asyncio.to_thread(http_json, srv.port, "/status")
        [why] = status["unplaceable"]["train"]
        assert "protocol 9" in why["reason"]
        new, _ = await raw_agent(srv, ("train",), name="new", **HELLO_9)
        [pushed] = (await next_of(new, "jobs"))["jobs"]
        assert pushed["id"] == yielding and (await job(pool, yielding))["leased_by"].startswith("new#")
        await old.close()
        await new.close()


async def test_only_running_preemptible_jobs_with_preemptions_left_are_asked(dsn, pool):
    async with running_server(dsn, poll_seconds=60) as srv:
        ws, _ = await raw_agent(srv, ("train",), capacity=2, **HELLO_9)
        plain = await gpuq.enqueue(pool, "train", {})
        spent = await gpuq.enqueue(pool, "train", {}, preemptible=True, max_preemptions=0)
        await wait_for(lambda: _both_leased(pool, plain, spent))
        pending = await gpuq.enqueue(pool, "other", {}, preemptible=True)
        assert await gpuq.preempt(pool, plain, spent, pending, 10**9) == {}
        await ws.close()


async def _both_leased(pool, *ids: int) -> bool:
    return await pool.fetchval("SELECT count(*) FROM gpuq.jobs WHERE id = ANY($1) AND status = 'leased'",
                               list(ids)) == len(ids)


async def test_plain_sql_enqueues_a_preemptible_job_and_other_jobs_keep_their_shape(pool):
    shaped = await pool.fetchrow("INSERT INTO gpuq.jobs (kind, preemptible, grace_seconds) VALUES ('sqlp', true, 5) "
                                 "RETURNING shape, max_preemptions")
    assert shaped["shape"] is not None and shaped["max_preemptions"] == 10
    assert await pool.fetchval("SELECT preemptible FROM gpuq.shapes WHERE kind = 'sqlp'")
    gpu = await pool.fetchval("INSERT INTO gpuq.jobs (kind, gpus) VALUES ('sqlp', 1) RETURNING shape")
    assert gpu == await pool.fetchval("SELECT md5(concat_ws('/', 1, NULL::int, '', NULL::text, false))")  # 0014's
    assert await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('sqlp') RETURNING shape") is None


async def test_sigterm_makes_running_preemptible_jobs_yield_and_the_others_finish(dsn, pool):
    running = anyio.Event()

    async def handle(job):
        if job.grace_seconds is None:
            running.set()
            return "finished"  # not preemptible: it runs to its end
        asked = asyncio.Event()
        on_preempt(job, asked.set)
        await asked.wait()
        raise JobPreempted

    async with running_server(dsn, poll_seconds=60) as srv:
        yielding = await gpuq.enqueue(pool, "train", {}, preemptible=True, grace_seconds=30)
        agent = await srv.agent(["train"], 2, handle)
        await wait_status(pool, yielding, "leased")
        plain = await gpuq.enqueue(pool, "train", {})
        with anyio.fail_after(10):
            await running.wait()
        agent._terminated()  # what SIGTERM does (run_until_signal), with no interruption notice
        await wait_status(pool, yielding, "pending")
        await wait_status(pool, plain, "done")
    row = await job(pool, yielding)
    assert (row["attempts"], row["preemptions"]) == (0, 1) and agent.protocol.finished


async def test_with_two_servers_the_one_holding_the_agent_asks_it(dsn, pool):
    async with running_server(dsn, poll_seconds=60), running_server(dsn, poll_seconds=60) as b:
        ws, _ = await raw_agent(b, ("train",), **HELLO_9)  # on server b; the admin's call reaches neither directly
        job_id = await gpuq.enqueue(pool, "train", {}, preemptible=True, grace_seconds=4)
        [pushed] = (await next_of(ws, "jobs"))["jobs"]
        assert await gpuq.preempt(pool, job_id) == {job_id: 4.0}
        assert await next_of(ws, "preempt") == {"type": "preempt", "ids": [job_id], "deadline_seconds": 4.0}
        await ws.send(json.dumps({"type": "preempted", "id": job_id, "lease_token": pushed["lease_token"]}))
        assert (await next_of(ws, "ack"))["accepted"] == [job_id]
        await ws.close()
    assert (await job(pool, job_id))["preemptions"] == 1


@pytest.mark.parametrize("prefetch", [1, 0])  # pushed to wait on the busy device, or left pending
async def test_an_urgent_gpu_job_preempts_a_lower_priority_one_and_waits_no_longer_than_its_grace(dsn, pool, prefetch):
    from gpuq.protocol import Device

    grace = 1.0
    running = anyio.Event()

    async def handle(job):
        if job.payload.get("low") and not running.is_set():
            running.set()
            await asyncio.Event().wait()  # ignores the preempt: stopped at the deadline
        return "done"

    async with running_server(dsn, poll_seconds=60, preempt_min_run_seconds=0) as srv:
        await srv.agent(["train"], 1, handle, devices=[Device(0, "h100", 81920)], prefetch=prefetch)
        low = await gpuq.enqueue(pool, "train", {"low": True}, gpus=1, preemptible=True, grace_seconds=grace)
        with anyio.fail_after(10):
            await running.wait()
        urgent = await gpuq.enqueue(pool, "train", {}, gpus=1, priority=10)
        await wait_status(pool, urgent, "done")
        waited = await pool.fetchval("SELECT extract(epoch FROM started_at - created_at) FROM gpuq.jobs WHERE id = $1",
                                     urgent)
        await wait_status(pool, low, "done")  # it ran again after the urgent one
        assert ((await job(pool, low))["preemptions"], (await job(pool, low))["attempts"]) == (1, 1)
    assert waited <= grace + 1.0  # the bound: the grace time plus a little


async def test_past_max_preemptions_a_yield_counts_the_attempt_so_spot_interruptions_cannot_loop(dsn, pool):
    async with running_server(dsn, poll_seconds=60) as srv:
        ws, _ = await raw_agent(srv, ("train",), capacity=2, **HELLO_9)
        last = await gpuq.enqueue(pool, "train", {}, preemptible=True, max_preemptions=0, max_attempts=1)
        more = await gpuq.enqueue(pool, "train", {}, preemptible=True, max_preemptions=0, max_attempts=2)
        pushed: list = []
        while len(pushed) < 2:
            pushed += (await next_of(ws, "jobs"))["jobs"]
        await ws.send(json.dumps({"type": "results", "results": [  # its agent is going away: it yields anyway
            {"type": "preempted", "id": j["id"], "lease_token": j["lease_token"]} for j in pushed]}))
        assert sorted((await next_of(ws, "ack"))["accepted"]) == sorted([last, more])
        await ws.close()
    dead, again = await job(pool, last), await job(pool, more)
    assert (dead["status"], dead["attempts"], dead["preemptions"]) == ("dead", 1, 1)
    assert "max_preemptions" in dead["last_error"]
    assert again["attempts"] == 1 and again["preemptions"] == 1 and again["status"] in ("pending", "leased")


def _yields_once(running: anyio.Event):
    """A handler whose first run waits until preempted, then yields; later runs return at once."""
    runs: list[int] = []

    async def handle(job):
        if job.payload.get("low") and not runs:
            runs.append(job.id)
            asked = asyncio.Event()
            on_preempt(job, asked.set)
            running.set()
            await asked.wait()
            raise JobPreempted("yielded")
        return "done"

    return handle


@pytest.mark.parametrize("prefetch", [1, 0])  # pushed to wait ready behind it, or left pending
async def test_an_urgent_plain_job_preempts_a_lower_priority_one_for_its_slot(dsn, pool, prefetch):
    grace = 5.0
    running = anyio.Event()
    async with running_server(dsn, poll_seconds=60, preempt_min_run_seconds=0) as srv:
        await srv.agent(["work"], 1, _yields_once(running), prefetch=prefetch)
        low = await gpuq.enqueue(pool, "work", {"low": True}, preemptible=True, grace_seconds=grace)
        with anyio.fail_after(10):
            await running.wait()
        other = await gpuq.enqueue(pool, "work", {}, preemptible=True)  # pending: it could take the freed slot
        urgent = await gpuq.enqueue(pool, "work", {}, priority=10)
        await wait_status(pool, urgent, "done")
        waited = await pool.fetchval("SELECT extract(epoch FROM started_at - created_at) FROM gpuq.jobs WHERE id = $1",
                                     urgent)
        await wait_status(pool, low, "done")  # it ran again after the urgent one
        await wait_status(pool, other, "done")
    row = await job(pool, low)
    assert (row["preemptions"], row["attempts"]) == (1, 1)  # back to pending, the attempt not counted
    assert (await job(pool, other))["preemptions"] == 0  # the freed slot went to the urgent job
    assert waited <= grace + 1.0


async def test_a_plain_job_of_equal_priority_never_preempts(dsn, pool):
    from structlog.testing import capture_logs

    running = anyio.Event()
    async with running_server(dsn, poll_seconds=60, preempt_min_run_seconds=0) as srv:
        await srv.agent(["a", "b"], 1, _yields_once(running), prefetch=0)  # the equal job stays pending
        low = await gpuq.enqueue(pool, "b", {"low": True}, preemptible=True, priority=5)
        with anyio.fail_after(10):
            await running.wait()
        with capture_logs() as logged:
            equal = await gpuq.enqueue(pool, "a", {}, priority=5)  # kind a: looked at before b in one look
            urgent = await gpuq.enqueue(pool, "b", {}, priority=6)
            await wait_status(pool, urgent, "done")
        await wait_status(pool, equal, "done")
        await wait_status(pool, low, "done")
    asks = [e["priority"] for e in logged if e["event"] == "preempt.priority"]
    assert asks == [6]  # only for the higher-priority job, once
    assert (await job(pool, low))["preemptions"] == 1



async def test_a_plain_jobs_head_priority_is_one_probe_of_jobs_pending_idx_not_the_history(conn):
    from gpuq import plans
    from gpuq.sql import queries

    await conn.execute("INSERT INTO gpuq.jobs (kind, status, priority, finished_at) "
                       "SELECT 'hist', 'done', 100, now() FROM generate_series(1, 3000)")
    await conn.execute("INSERT INTO gpuq.jobs (kind, priority) SELECT 'hist', i % 7 FROM generate_series(1, 200) i")
    await conn.execute("ANALYZE gpuq.jobs")
    assert await conn.fetchval(queries["plain_head_priority"], "hist") == 6
    plan = await plans.explain_warm(conn, queries["plain_head_priority"], "hist")
    assert "jobs_pending_idx" in plans.plan_indexes(plan)
    assert plans.plan_buffers(plan) < 20
